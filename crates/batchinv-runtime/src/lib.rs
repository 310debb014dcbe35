//! batchinv-runtime: a raw-kernel launcher over run-time-loaded GPU drivers.
//!
//! The CUDA driver (`libcuda.so.1`), HIP (`libamdhip64.so`) and NVRTC are opened with
//! `dlopen` when first needed, so this crate builds and loads on machines with no GPU
//! stack at all; a missing driver becomes [`Error::Unavailable`] at the first call that
//! needs it.  Every launch is checked first against the kernel's declared signature and
//! the launch limits, so a wrong call fails with a message instead of reaching the driver.
//!
//! No Python here: `batchinv-py` wraps these types for `batchinv._native`.

mod config;
mod cuda;
mod driver;
mod error;
mod hip;
mod module;
mod nvrtc;
mod signature;

pub use config::{
    check_non_portable_clusters, check_programmatic_launch, check_static_limits, DeviceLimits, FunctionLimits,
    LaunchConfig, NON_PORTABLE_CLUSTER_CTAS, PORTABLE_CLUSTER_CTAS, STATIC_LIMITS,
};
pub use driver::{driver_for, Backend, Driver, TensorMapSpec};
pub use error::{Error, Result};
pub use module::{CheckedCall, Kernel, Module};
pub use nvrtc::compile_cuda_source;
pub use signature::{ArgValue, ParamKind, Signature, TENSOR_MAP_BYTES};
