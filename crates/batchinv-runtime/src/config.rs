//! Launch geometry and its limits.
//!
//! Two stages of checks: [`check_static_limits`] needs no device (the limits every CUDA
//! GPU since sm_70 shares), so a bad request fails the same way on a machine without a
//! GPU; [`LaunchConfig::check_device`] then applies the device's and the kernel's own
//! limits (registers or `__launch_bounds__`, static and dynamic shared memory).

use crate::driver::Backend;
use crate::error::{Error, Result};

/// Grid, block, dynamic shared memory and stream of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem_bytes: u32,
    /// A `CUstream` / `hipStream_t` handle; 0 is the legacy default stream.
    pub stream: u64,
    /// Programmatic dependent launch (CUDA, sm_90): the kernel may start while the previous
    /// kernel on `stream` is still running, once every CTA of that kernel has executed
    /// `griddepcontrol.launch_dependents` (or exited).  The kernel must execute
    /// `griddepcontrol.wait` before it touches anything that kernel writes; the wait returns
    /// when that kernel has completed and its memory is visible.  A scheduling permission:
    /// the same kernel launched without it is ordinary stream order, with the same results.
    pub programmatic: bool,
}

/// What a device allows (from the driver's attributes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceLimits {
    pub max_threads_per_block: u32,
    pub max_block: [u32; 3],
    pub max_grid: [u32; 3],
    /// Largest shared memory a block may use after opting in, static plus dynamic.
    pub max_shared_optin: u32,
}

/// What one compiled kernel allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FunctionLimits {
    pub max_threads_per_block: u32,
    pub static_shared_bytes: u32,
    /// The current dynamic shared-memory limit (48 KiB minus static until raised).
    pub max_dynamic_shared_bytes: u32,
}

/// Limits common to every device batchinv targets; the device check refines them.
pub const STATIC_LIMITS: DeviceLimits = DeviceLimits {
    max_threads_per_block: 1024,
    max_block: [1024, 1024, 64],
    max_grid: [i32::MAX as u32, 65535, 65535],
    max_shared_optin: 227 * 1024,
};

fn check_dims(kernel: &str, what: &str, dims: [u32; 3], max: [u32; 3]) -> Result<()> {
    for (axis, (&d, &m)) in ["x", "y", "z"].iter().zip(dims.iter().zip(max.iter())) {
        if d == 0 {
            return Err(Error::Config(format!(
                "kernel '{kernel}': {what}.{axis} is 0; every {what} dimension must be at least 1"
            )));
        }
        if d > m {
            return Err(Error::Config(format!("kernel '{kernel}': {what}.{axis} = {d} exceeds the limit of {m}")));
        }
    }
    Ok(())
}

/// Checks a launch against `limits`, with no kernel-specific information.
pub fn check_static_limits(kernel: &str, config: &LaunchConfig, limits: &DeviceLimits) -> Result<()> {
    check_dims(kernel, "grid", config.grid, limits.max_grid)?;
    check_dims(kernel, "block", config.block, limits.max_block)?;
    let threads: u64 = config.block.iter().map(|&d| d as u64).product();
    if threads > limits.max_threads_per_block as u64 {
        return Err(Error::Config(format!(
            "kernel '{kernel}': block of {threads} threads exceeds the limit of {} threads per block",
            limits.max_threads_per_block
        )));
    }
    if config.shared_mem_bytes > limits.max_shared_optin {
        return Err(Error::Config(format!(
            "kernel '{kernel}': {} bytes of dynamic shared memory exceed the device maximum of {} bytes",
            config.shared_mem_bytes, limits.max_shared_optin
        )));
    }
    Ok(())
}

impl LaunchConfig {
    /// The device- and kernel-specific checks, run just before the launch.
    pub fn check_device(&self, kernel: &str, device: &DeviceLimits, function: &FunctionLimits) -> Result<()> {
        check_static_limits(kernel, self, device)?;
        let threads: u64 = self.block.iter().map(|&d| d as u64).product();
        if threads > function.max_threads_per_block as u64 {
            return Err(Error::Config(format!(
                "kernel '{kernel}': block of {threads} threads exceeds this kernel's limit of {} \
                 (set by its register use or __launch_bounds__)",
                function.max_threads_per_block
            )));
        }
        if self.shared_mem_bytes > function.max_dynamic_shared_bytes {
            let ceiling = device.max_shared_optin.saturating_sub(function.static_shared_bytes);
            return Err(Error::Config(format!(
                "kernel '{kernel}': {} bytes of dynamic shared memory exceed its current limit of {} \
                 bytes; raise it with set_max_dynamic_shared_memory() (this device allows up to {} bytes)",
                self.shared_mem_bytes, function.max_dynamic_shared_bytes, ceiling
            )));
        }
        Ok(())
    }
}

/// CTAs a thread-block cluster may hold on every cluster-capable GPU (sm_90).
pub const PORTABLE_CLUSTER_CTAS: u32 = 8;
/// CTAs a cluster may hold on sm_90 once the kernel opts in to non-portable sizes.
pub const NON_PORTABLE_CLUSTER_CTAS: u32 = 16;

/// Whether a device of `compute_capability` on `backend` can run clusters of more than
/// [`PORTABLE_CLUSTER_CTAS`] CTAs; an error that says why not otherwise (no fallback).
pub fn check_non_portable_clusters(kernel: &str, backend: Backend, compute_capability: (i32, i32)) -> Result<()> {
    if backend != Backend::Cuda {
        return Err(Error::Unavailable {
            backend: backend.name(),
            reason: format!("kernel '{kernel}': thread-block clusters are a CUDA feature (sm_90 or newer)"),
        });
    }
    let (major, minor) = compute_capability;
    if major < 9 {
        return Err(Error::Unavailable {
            backend: backend.name(),
            reason: format!(
                "kernel '{kernel}': clusters of more than {PORTABLE_CLUSTER_CTAS} CTAs need compute \
                 capability 9.0 or newer; this device has {major}.{minor}"
            ),
        });
    }
    Ok(())
}

/// Whether a launch of `kernel` may use programmatic dependent launch: a CUDA device of
/// compute capability 9.0 or newer and a driver with `cuLaunchKernelEx`; an error that says
/// why not otherwise (never silently an ordinary launch).
pub fn check_programmatic_launch(
    kernel: &str,
    backend: Backend,
    compute_capability: (i32, i32),
    driver_has_launch_ex: bool,
) -> Result<()> {
    if backend != Backend::Cuda {
        return Err(Error::Unavailable {
            backend: backend.name(),
            reason: format!("kernel '{kernel}': programmatic dependent launch is a CUDA feature (sm_90 or newer)"),
        });
    }
    let (major, minor) = compute_capability;
    if major < 9 {
        return Err(Error::Unavailable {
            backend: backend.name(),
            reason: format!(
                "kernel '{kernel}': programmatic dependent launch needs compute capability 9.0 or newer; \
                 this device has {major}.{minor}"
            ),
        });
    }
    if !driver_has_launch_ex {
        return Err(Error::Unavailable {
            backend: backend.name(),
            reason: format!(
                "kernel '{kernel}': programmatic dependent launch needs cuLaunchKernelEx, which this \
                 driver lacks (CUDA 12 or newer)"
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(grid: [u32; 3], block: [u32; 3], shared: u32) -> LaunchConfig {
        LaunchConfig { grid, block, shared_mem_bytes: shared, stream: 0, programmatic: false }
    }

    #[test]
    fn accepts_ordinary_launch() {
        check_static_limits("k", &config([100, 1, 1], [256, 1, 1], 0), &STATIC_LIMITS).unwrap();
    }

    #[test]
    fn rejects_zero_and_oversized_dims() {
        let err = check_static_limits("k", &config([0, 1, 1], [1, 1, 1], 0), &STATIC_LIMITS);
        assert!(err.unwrap_err().to_string().contains("grid.x is 0"));
        let err = check_static_limits("k", &config([1, 70000, 1], [1, 1, 1], 0), &STATIC_LIMITS);
        assert!(err.unwrap_err().to_string().contains("grid.y = 70000 exceeds the limit of 65535"));
        let err = check_static_limits("k", &config([1, 1, 1], [32, 32, 2], 0), &STATIC_LIMITS);
        assert!(err.unwrap_err().to_string().contains("block of 2048 threads"));
        let err = check_static_limits("k", &config([1, 1, 1], [1, 1, 65], 0), &STATIC_LIMITS);
        assert!(err.unwrap_err().to_string().contains("block.z = 65"));
    }

    #[test]
    fn rejects_too_much_shared_memory() {
        let err = check_static_limits("k", &config([1, 1, 1], [1, 1, 1], 300_000), &STATIC_LIMITS);
        assert!(err.unwrap_err().to_string().contains("300000 bytes of dynamic shared memory"));
    }

    #[test]
    fn function_limits_apply() {
        let function = FunctionLimits {
            max_threads_per_block: 256,
            static_shared_bytes: 1024,
            max_dynamic_shared_bytes: 48 * 1024 - 1024,
        };
        let err = config([1, 1, 1], [512, 1, 1], 0).check_device("k", &STATIC_LIMITS, &function);
        assert!(err.unwrap_err().to_string().contains("this kernel's limit of 256"));
        let err = config([1, 1, 1], [128, 1, 1], 64 * 1024).check_device("k", &STATIC_LIMITS, &function);
        let msg = err.unwrap_err().to_string();
        assert!(msg.contains("set_max_dynamic_shared_memory"), "{msg}");
        assert!(msg.contains("up to 231424 bytes"), "{msg}");
    }

    #[test]
    fn non_portable_clusters_need_cuda_sm90() {
        check_non_portable_clusters("k", Backend::Cuda, (9, 0)).unwrap();
        check_non_portable_clusters("k", Backend::Cuda, (10, 0)).unwrap();
        let err = check_non_portable_clusters("k", Backend::Cuda, (8, 9)).unwrap_err();
        assert!(matches!(err, Error::Unavailable { backend: "CUDA", .. }));
        assert!(err.to_string().contains("kernel 'k': clusters of more than 8 CTAs need compute capability 9.0"));
        assert!(err.to_string().contains("this device has 8.9"));
        let err = check_non_portable_clusters("k", Backend::Hip, (9, 4)).unwrap_err();
        assert!(matches!(err, Error::Unavailable { backend: "HIP", .. }));
        assert!(err.to_string().contains("thread-block clusters are a CUDA feature"));
    }

    #[test]
    fn programmatic_launch_needs_cuda_sm90_and_launch_ex() {
        check_programmatic_launch("k", Backend::Cuda, (9, 0), true).unwrap();
        check_programmatic_launch("k", Backend::Cuda, (10, 0), true).unwrap();
        let err = check_programmatic_launch("k", Backend::Cuda, (8, 0), true).unwrap_err();
        assert!(matches!(err, Error::Unavailable { backend: "CUDA", .. }));
        let msg = err.to_string();
        assert!(msg.contains("kernel 'k': programmatic dependent launch needs compute capability 9.0"), "{msg}");
        assert!(msg.contains("this device has 8.0"), "{msg}");
        let err = check_programmatic_launch("k", Backend::Cuda, (9, 0), false).unwrap_err();
        assert!(matches!(err, Error::Unavailable { backend: "CUDA", .. }));
        assert!(err.to_string().contains("kernel 'k': programmatic dependent launch needs cuLaunchKernelEx"));
        let err = check_programmatic_launch("k", Backend::Hip, (9, 4), true).unwrap_err();
        assert!(matches!(err, Error::Unavailable { backend: "HIP", .. }));
        assert!(err.to_string().contains("kernel 'k': programmatic dependent launch is a CUDA feature"));
    }
}
