//! Modules and kernels: images loaded lazily per device, functions checked before launch.

use crate::config::{
    check_non_portable_clusters, check_programmatic_launch, check_static_limits, DeviceLimits, FunctionLimits,
    LaunchConfig, STATIC_LIMITS,
};
use crate::driver::{driver_for, Backend, Driver, FunctionHandle, ModuleHandle};
use crate::error::{Error, Result};
use crate::signature::{ArgValue, PackedArgs, Signature};
use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{Arc, Mutex};

/// A code image (cubin, fatbin, PTX or an AMD code object) and its per-device loads.
///
/// Creating a module touches no driver; the image is loaded into a device the first time
/// a kernel of it runs there, and unloaded when the module is dropped.
pub struct Module {
    backend: Backend,
    label: String,
    image: Arc<[u8]>,
    loaded: Mutex<HashMap<i32, ModuleHandle>>,
}

impl Module {
    pub fn new(backend: Backend, label: impl Into<String>, image: Arc<[u8]>) -> Result<Self> {
        if image.is_empty() {
            return Err(Error::Invalid("the module image is empty".to_string()));
        }
        Ok(Module { backend, label: label.into(), image, loaded: Mutex::new(HashMap::new()) })
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    pub fn label(&self) -> &str {
        &self.label
    }

    pub fn image(&self) -> &[u8] {
        &self.image
    }

    fn handle(&self, driver: &dyn Driver, device: i32) -> Result<ModuleHandle> {
        let mut loaded = self.loaded.lock().expect("module cache poisoned");
        if let Some(&handle) = loaded.get(&device) {
            return Ok(handle);
        }
        let handle = driver.load_module(device, &self.image).map_err(|e| match e {
            Error::Driver { .. } => Error::Invalid(format!("module '{}' could not be loaded: {e}", self.label)),
            other => other,
        })?;
        loaded.insert(device, handle);
        Ok(handle)
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        let loaded = std::mem::take(&mut *self.loaded.lock().expect("module cache poisoned"));
        if loaded.is_empty() {
            return;
        }
        if let Ok(driver) = driver_for(self.backend) {
            for (device, handle) in loaded {
                driver.unload_module(device, handle);
            }
        }
    }
}

struct Resolved {
    function: FunctionHandle,
    device_limits: DeviceLimits,
    function_limits: FunctionLimits,
    /// Whether a programmatic launch passed its checks on this device (asked once).
    programmatic_checked: bool,
}

/// One kernel of a module with its declared signature.
pub struct Kernel {
    module: Arc<Module>,
    name: String,
    c_name: CString,
    signature: Signature,
    resolved: Mutex<HashMap<i32, Resolved>>,
}

impl Kernel {
    /// Declares a kernel; nothing is looked up until the first launch on a device.
    pub fn new(module: Arc<Module>, name: &str, signature: Signature) -> Result<Self> {
        let c_name =
            CString::new(name).map_err(|_| Error::Invalid(format!("kernel name {name:?} contains a NUL byte")))?;
        if name.is_empty() {
            return Err(Error::Invalid("kernel name is empty".to_string()));
        }
        Ok(Kernel { module, name: name.to_string(), c_name, signature, resolved: Mutex::new(HashMap::new()) })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn signature(&self) -> &Signature {
        &self.signature
    }

    pub fn module(&self) -> &Arc<Module> {
        &self.module
    }

    fn with_resolved<T>(&self, device: i32, body: impl FnOnce(&dyn Driver, &mut Resolved) -> Result<T>) -> Result<T> {
        let driver = driver_for(self.module.backend)?;
        let mut resolved = self.resolved.lock().expect("kernel cache poisoned");
        let entry = match resolved.entry(device) {
            std::collections::hash_map::Entry::Occupied(slot) => slot.into_mut(),
            std::collections::hash_map::Entry::Vacant(slot) => {
                let module = self.module.handle(driver.as_ref(), device)?;
                let function = driver.get_function(device, module, &self.c_name)?;
                slot.insert(Resolved {
                    function,
                    device_limits: driver.device_limits(device)?,
                    function_limits: driver.function_limits(device, function)?,
                    programmatic_checked: false,
                })
            }
        };
        body(driver.as_ref(), entry).map_err(|e| e.for_kernel(&self.name))
    }

    /// Checks everything that can be checked without a device: the arguments against the
    /// signature, the launch shape against the limits all supported GPUs share, and that a
    /// programmatic launch is not asked of a HIP module.  The checked call launches without
    /// repeating these checks.
    pub fn check_call<'a>(&'a self, config: &'a LaunchConfig, args: &'a [ArgValue]) -> Result<CheckedCall<'a>> {
        self.signature.check(&self.name, args)?;
        check_static_limits(&self.name, config, &STATIC_LIMITS)?;
        if config.programmatic && self.module.backend != Backend::Cuda {
            check_programmatic_launch(&self.name, self.module.backend, (0, 0), false)?;
        }
        Ok(CheckedCall { kernel: self, config, args })
    }

    /// Validates and launches on `device` (asynchronously, on `config.stream`).  A
    /// programmatic launch on a device or driver without it is [`Error::Unavailable`].
    pub fn launch(&self, device: i32, config: &LaunchConfig, args: &[ArgValue]) -> Result<()> {
        self.check_call(config, args)?.launch(device)
    }

    /// The kernel's limits on `device` (loads the module there if needed).
    pub fn limits(&self, device: i32) -> Result<FunctionLimits> {
        self.with_resolved(device, |_, entry| Ok(entry.function_limits))
    }

    /// Raises the kernel's dynamic shared-memory limit on `device` (needed above 48 KiB).
    pub fn set_max_dynamic_shared_memory(&self, device: i32, bytes: u32) -> Result<()> {
        self.with_resolved(device, |driver, entry| {
            let ceiling =
                entry.device_limits.max_shared_optin.saturating_sub(entry.function_limits.static_shared_bytes);
            if bytes > ceiling {
                return Err(Error::Config(format!(
                    "kernel '{}': {bytes} bytes of dynamic shared memory exceed what this device allows \
                     ({ceiling} bytes beside the kernel's {} static bytes)",
                    self.name, entry.function_limits.static_shared_bytes
                )));
            }
            driver.set_max_dynamic_shared(device, entry.function, bytes)?;
            entry.function_limits = driver.function_limits(device, entry.function)?;
            Ok(())
        })
    }

    /// Lets the kernel run with clusters of more than 8 CTAs on `device` (an sm_90 CUDA
    /// device; anything else is [`Error::Unavailable`], never a silent fallback).  Set once
    /// per kernel and device; the launch itself is unchanged.
    pub fn allow_non_portable_cluster_size(&self, device: i32) -> Result<()> {
        let backend = self.module.backend;
        if backend != Backend::Cuda {
            return check_non_portable_clusters(&self.name, backend, (0, 0));
        }
        let capability = driver_for(backend)?.compute_capability(device)?;
        check_non_portable_clusters(&self.name, backend, capability)?;
        self.with_resolved(device, |driver, entry| driver.allow_non_portable_cluster_size(device, entry.function))
    }

    /// How many clusters (the kernel's compiled `__cluster_dims__`) of `config`'s block and
    /// dynamic shared memory can be resident on `device` at once; 0 means the launch cannot run.
    pub fn max_active_clusters(&self, device: i32, config: &LaunchConfig) -> Result<u32> {
        check_static_limits(&self.name, config, &STATIC_LIMITS)?;
        if self.module.backend != Backend::Cuda {
            return check_non_portable_clusters(&self.name, self.module.backend, (0, 0)).map(|_| 0);
        }
        self.with_resolved(device, |driver, entry| {
            config.check_device(&self.name, &entry.device_limits, &entry.function_limits)?;
            driver.max_active_clusters(device, entry.function, config)
        })
    }
}

/// A call that passed [`Kernel::check_call`]; launching it checks only what needs the device.
#[must_use = "a checked call does nothing until it is launched"]
pub struct CheckedCall<'a> {
    kernel: &'a Kernel,
    config: &'a LaunchConfig,
    args: &'a [ArgValue],
}

impl CheckedCall<'_> {
    /// Launches on `device` (asynchronously, on the config's stream) after the checks that
    /// need the device: its limits and, for a programmatic launch, its support for one.
    pub fn launch(self, device: i32) -> Result<()> {
        let CheckedCall { kernel, config, args } = self;
        kernel.with_resolved(device, |driver, entry| {
            config.check_device(&kernel.name, &entry.device_limits, &entry.function_limits)?;
            if config.programmatic && !entry.programmatic_checked {
                let capability = driver.compute_capability(device)?;
                check_programmatic_launch(
                    &kernel.name,
                    driver.backend(),
                    capability,
                    driver.has_programmatic_launch(),
                )?;
                entry.programmatic_checked = true;
            }
            let mut packed = PackedArgs::new(args);
            let mut pointers = packed.pointers();
            driver.launch(device, entry.function, config, &mut pointers)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(backend: Backend) -> Kernel {
        let module = Module::new(backend, "test module", Arc::from(&b"not loaded"[..])).unwrap();
        Kernel::new(Arc::new(module), "k", Signature::parse("ptr, i64").unwrap()).unwrap()
    }

    fn config(programmatic: bool) -> LaunchConfig {
        LaunchConfig { grid: [4, 1, 1], block: [128, 1, 1], shared_mem_bytes: 0, stream: 0, programmatic }
    }

    #[test]
    fn a_call_is_checked_without_a_device() {
        let kernel = kernel(Backend::Cuda);
        let config = config(false);
        let args = [ArgValue::Ptr(16), ArgValue::I64(3)];
        let call = kernel.check_call(&config, &args).unwrap();
        assert!(std::ptr::eq(call.kernel, &kernel) && call.args.len() == 2);
        let err = kernel.check_call(&config, &args[..1]).err().unwrap();
        assert_eq!(err.to_string(), "kernel 'k' takes 2 arguments ((ptr, i64)), got 1");
        let too_wide = LaunchConfig { block: [2048, 1, 1], ..config };
        assert!(matches!(kernel.check_call(&too_wide, &args), Err(Error::Config(_))));
        let hip = self::kernel(Backend::Hip);
        let err = hip.check_call(&self::config(true), &args).err().unwrap();
        assert!(matches!(err, Error::Unavailable { .. }), "{err}");
    }
}
