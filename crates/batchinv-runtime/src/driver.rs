//! The interface both GPU backends implement, and the process-wide driver instances.

use crate::config::{DeviceLimits, FunctionLimits, LaunchConfig};
use crate::error::{Error, Result};
use std::ffi::CStr;
use std::os::raw::c_void;
use std::sync::{Arc, OnceLock};

/// Which GPU API a module is loaded through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    Cuda,
    Hip,
}

impl Backend {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "cuda" => Ok(Backend::Cuda),
            "hip" => Ok(Backend::Hip),
            other => Err(Error::Invalid(format!("unknown backend '{other}' (expected 'cuda' or 'hip')"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Cuda => "CUDA",
            Backend::Hip => "HIP",
        }
    }
}

/// Raw module and function handles, stored as integers so they can cross threads.
pub type ModuleHandle = usize;
pub type FunctionHandle = usize;

/// A GPU driver API: the few calls a raw-kernel launcher needs.
pub trait Driver: Send + Sync {
    fn backend(&self) -> Backend;
    fn device_count(&self) -> Result<i32>;
    /// The device the calling thread works on (the current context's; 0 if none is current).
    fn current_device(&self) -> Result<i32>;
    fn device_name(&self, device: i32) -> Result<String>;
    fn compute_capability(&self, device: i32) -> Result<(i32, i32)>;
    fn device_limits(&self, device: i32) -> Result<DeviceLimits>;
    fn load_module(&self, device: i32, image: &[u8]) -> Result<ModuleHandle>;
    fn unload_module(&self, device: i32, module: ModuleHandle);
    fn get_function(&self, device: i32, module: ModuleHandle, name: &CStr) -> Result<FunctionHandle>;
    fn function_limits(&self, device: i32, function: FunctionHandle) -> Result<FunctionLimits>;
    fn set_max_dynamic_shared(&self, device: i32, function: FunctionHandle, bytes: u32) -> Result<()>;
    /// Launches; `params` points at one value per kernel parameter.
    fn launch(
        &self,
        device: i32,
        function: FunctionHandle,
        config: &LaunchConfig,
        params: &mut [*mut c_void],
    ) -> Result<()>;
    fn synchronize(&self, device: i32) -> Result<()>;
}

static CUDA: OnceLock<std::result::Result<Arc<dyn Driver>, Error>> = OnceLock::new();
static HIP: OnceLock<std::result::Result<Arc<dyn Driver>, Error>> = OnceLock::new();

/// The process-wide driver for `backend`, loaded on first use.
pub fn driver_for(backend: Backend) -> Result<Arc<dyn Driver>> {
    let slot = match backend {
        Backend::Cuda => CUDA.get_or_init(|| crate::cuda::CudaDriver::load().map(|d| Arc::new(d) as Arc<dyn Driver>)),
        Backend::Hip => HIP.get_or_init(|| crate::hip::HipDriver::load().map(|d| Arc::new(d) as Arc<dyn Driver>)),
    };
    slot.clone()
}
