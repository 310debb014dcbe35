//! HIP, opened at run time from `libamdhip64.so`.  Compile-tested only: no AMD GPU is
//! available to this project, so nothing here has run against a device.
//!
//! HIP keeps one implicit context per device; the device is selected around each call
//! and the caller's device restored.  Device limits are the architectural ones of CDNA
//! GPUs rather than attribute queries, because the numbering of `hipDeviceAttribute_t`
//! changed between ROCm releases.

use crate::config::{DeviceLimits, FunctionLimits, LaunchConfig};
use crate::driver::{Backend, Driver, FunctionHandle, ModuleHandle, TensorMapSpec};
use crate::error::{Error, Result};
use crate::signature::TENSOR_MAP_BYTES;
use libloading::Library;
use std::ffi::CStr;
use std::os::raw::{c_char, c_int, c_uint, c_void};

type HipError = c_int;
type HipModule = *mut c_void;
type HipFunction = *mut c_void;
type HipStream = *mut c_void;

const HIP_SUCCESS: HipError = 0;
const FUNC_MAX_THREADS_PER_BLOCK: c_int = 0;
const FUNC_SHARED_SIZE_BYTES: c_int = 1;

/// CDNA (gfx90a, gfx942): 1024 threads per block, 64 KiB of LDS per workgroup.
const CDNA_LIMITS: DeviceLimits = DeviceLimits {
    max_threads_per_block: 1024,
    max_block: [1024, 1024, 1024],
    max_grid: [i32::MAX as u32, 65535, 65535],
    max_shared_optin: 64 * 1024,
};

struct Api {
    hip_init: unsafe extern "C" fn(c_uint) -> HipError,
    hip_get_device_count: unsafe extern "C" fn(*mut c_int) -> HipError,
    hip_get_device: unsafe extern "C" fn(*mut c_int) -> HipError,
    hip_set_device: unsafe extern "C" fn(c_int) -> HipError,
    hip_device_get_name: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> HipError,
    hip_device_compute_capability: unsafe extern "C" fn(*mut c_int, *mut c_int, c_int) -> HipError,
    hip_device_synchronize: unsafe extern "C" fn() -> HipError,
    hip_module_load_data: unsafe extern "C" fn(*mut HipModule, *const c_void) -> HipError,
    hip_module_unload: unsafe extern "C" fn(HipModule) -> HipError,
    hip_module_get_function: unsafe extern "C" fn(*mut HipFunction, HipModule, *const c_char) -> HipError,
    hip_func_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, HipFunction) -> HipError,
    #[allow(clippy::type_complexity)]
    hip_module_launch_kernel: unsafe extern "C" fn(
        HipFunction,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        HipStream,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> HipError,
    hip_get_error_name: unsafe extern "C" fn(HipError) -> *const c_char,
    hip_get_error_string: unsafe extern "C" fn(HipError) -> *const c_char,
}

pub(crate) struct HipDriver {
    api: Api,
    _library: Library,
}

unsafe fn symbol<T: Copy>(library: &Library, name: &str) -> Result<T> {
    let symbol = library.get::<T>(name.as_bytes()).map_err(|e| Error::Unavailable {
        backend: "HIP",
        reason: format!("the HIP runtime has no symbol {name}: {e}"),
    })?;
    Ok(*symbol)
}

impl HipDriver {
    pub(crate) fn load() -> Result<Self> {
        let mut reasons = Vec::new();
        let mut opened = None;
        for name in ["libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"] {
            match unsafe { Library::new(name) } {
                Ok(library) => {
                    opened = Some(library);
                    break;
                }
                Err(e) => reasons.push(format!("{name}: {e}")),
            }
        }
        let library = opened.ok_or_else(|| Error::Unavailable {
            backend: "HIP",
            reason: format!("the HIP runtime could not be loaded ({})", reasons.join("; ")),
        })?;
        let api = unsafe {
            Api {
                hip_init: symbol(&library, "hipInit")?,
                hip_get_device_count: symbol(&library, "hipGetDeviceCount")?,
                hip_get_device: symbol(&library, "hipGetDevice")?,
                hip_set_device: symbol(&library, "hipSetDevice")?,
                hip_device_get_name: symbol(&library, "hipDeviceGetName")?,
                hip_device_compute_capability: symbol(&library, "hipDeviceComputeCapability")?,
                hip_device_synchronize: symbol(&library, "hipDeviceSynchronize")?,
                hip_module_load_data: symbol(&library, "hipModuleLoadData")?,
                hip_module_unload: symbol(&library, "hipModuleUnload")?,
                hip_module_get_function: symbol(&library, "hipModuleGetFunction")?,
                hip_func_get_attribute: symbol(&library, "hipFuncGetAttribute")?,
                hip_module_launch_kernel: symbol(&library, "hipModuleLaunchKernel")?,
                hip_get_error_name: symbol(&library, "hipGetErrorName")?,
                hip_get_error_string: symbol(&library, "hipGetErrorString")?,
            }
        };
        let driver = HipDriver { api, _library: library };
        let code = unsafe { (driver.api.hip_init)(0) };
        if code != HIP_SUCCESS {
            let reason = driver.error("hipInit", code).to_string();
            return Err(Error::Unavailable { backend: "HIP", reason });
        }
        Ok(driver)
    }

    fn error(&self, call: &'static str, code: HipError) -> Error {
        let text = |ptr: *const c_char| {
            if ptr.is_null() {
                "unknown error".to_string()
            } else {
                unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned()
            }
        };
        Error::Driver {
            backend: "HIP",
            call,
            code,
            name: text(unsafe { (self.api.hip_get_error_name)(code) }),
            message: text(unsafe { (self.api.hip_get_error_string)(code) }),
            kernel: None,
        }
    }

    fn check(&self, call: &'static str, code: HipError) -> Result<()> {
        if code == HIP_SUCCESS {
            Ok(())
        } else {
            Err(self.error(call, code))
        }
    }

    fn with_device<T>(&self, ordinal: i32, body: impl FnOnce() -> Result<T>) -> Result<T> {
        let count = self.device_count()?;
        if ordinal < 0 || ordinal >= count {
            return Err(Error::Invalid(format!("HIP device {ordinal} does not exist ({count} device(s) visible)")));
        }
        let mut previous: c_int = 0;
        self.check("hipGetDevice", unsafe { (self.api.hip_get_device)(&mut previous) })?;
        if previous == ordinal {
            return body();
        }
        self.check("hipSetDevice", unsafe { (self.api.hip_set_device)(ordinal) })?;
        let result = body();
        let restored = self.check("hipSetDevice", unsafe { (self.api.hip_set_device)(previous) });
        let value = result?;
        restored?;
        Ok(value)
    }

    fn function_attribute(&self, function: FunctionHandle, attribute: c_int) -> Result<i32> {
        let mut value: c_int = 0;
        self.check("hipFuncGetAttribute", unsafe {
            (self.api.hip_func_get_attribute)(&mut value, attribute, function as HipFunction)
        })?;
        Ok(value)
    }
}

impl Driver for HipDriver {
    fn backend(&self) -> Backend {
        Backend::Hip
    }

    fn device_count(&self) -> Result<i32> {
        let mut count: c_int = 0;
        self.check("hipGetDeviceCount", unsafe { (self.api.hip_get_device_count)(&mut count) })?;
        Ok(count)
    }

    fn current_device(&self) -> Result<i32> {
        let mut device: c_int = 0;
        self.check("hipGetDevice", unsafe { (self.api.hip_get_device)(&mut device) })?;
        Ok(device)
    }

    fn device_name(&self, ordinal: i32) -> Result<String> {
        let mut buffer = [0 as c_char; 256];
        self.with_device(ordinal, || {
            self.check("hipDeviceGetName", unsafe {
                (self.api.hip_device_get_name)(buffer.as_mut_ptr(), buffer.len() as c_int, ordinal)
            })
        })?;
        Ok(unsafe { CStr::from_ptr(buffer.as_ptr()) }.to_string_lossy().into_owned())
    }

    fn compute_capability(&self, ordinal: i32) -> Result<(i32, i32)> {
        let (mut major, mut minor) = (0, 0);
        self.with_device(ordinal, || {
            self.check("hipDeviceComputeCapability", unsafe {
                (self.api.hip_device_compute_capability)(&mut major, &mut minor, ordinal)
            })
        })?;
        Ok((major, minor))
    }

    fn device_limits(&self, _ordinal: i32) -> Result<DeviceLimits> {
        Ok(CDNA_LIMITS)
    }

    fn load_module(&self, ordinal: i32, image: &[u8]) -> Result<ModuleHandle> {
        self.with_device(ordinal, || {
            let mut module: HipModule = std::ptr::null_mut();
            self.check("hipModuleLoadData", unsafe {
                (self.api.hip_module_load_data)(&mut module, image.as_ptr() as *const c_void)
            })?;
            Ok(module as ModuleHandle)
        })
    }

    fn unload_module(&self, ordinal: i32, module: ModuleHandle) {
        let _ = self.with_device(ordinal, || {
            self.check("hipModuleUnload", unsafe { (self.api.hip_module_unload)(module as HipModule) })
        });
    }

    fn get_function(&self, ordinal: i32, module: ModuleHandle, name: &CStr) -> Result<FunctionHandle> {
        self.with_device(ordinal, || {
            let mut function: HipFunction = std::ptr::null_mut();
            let code = unsafe { (self.api.hip_module_get_function)(&mut function, module as HipModule, name.as_ptr()) };
            if code != HIP_SUCCESS {
                let err = self.error("hipModuleGetFunction", code);
                return Err(Error::Invalid(format!(
                    "kernel '{}' is not in the module ({err})",
                    name.to_string_lossy()
                )));
            }
            Ok(function as FunctionHandle)
        })
    }

    fn function_limits(&self, ordinal: i32, function: FunctionHandle) -> Result<FunctionLimits> {
        self.with_device(ordinal, || {
            let static_shared = self.function_attribute(function, FUNC_SHARED_SIZE_BYTES)? as u32;
            Ok(FunctionLimits {
                max_threads_per_block: self.function_attribute(function, FUNC_MAX_THREADS_PER_BLOCK)? as u32,
                static_shared_bytes: static_shared,
                max_dynamic_shared_bytes: CDNA_LIMITS.max_shared_optin.saturating_sub(static_shared),
            })
        })
    }

    fn set_max_dynamic_shared(&self, _ordinal: i32, _function: FunctionHandle, bytes: u32) -> Result<()> {
        // LDS needs no opt-in on AMD GPUs; only the hardware ceiling applies.
        if bytes > CDNA_LIMITS.max_shared_optin {
            return Err(Error::Config(format!(
                "{bytes} bytes of dynamic shared memory exceed the 65536 bytes of LDS per workgroup"
            )));
        }
        Ok(())
    }

    fn allow_non_portable_cluster_size(&self, _ordinal: i32, _function: FunctionHandle) -> Result<()> {
        Err(Error::Unavailable {
            backend: "HIP",
            reason: "thread-block clusters are a CUDA feature (sm_90 or newer)".to_string(),
        })
    }

    fn max_active_clusters(&self, _ordinal: i32, _function: FunctionHandle, _config: &LaunchConfig) -> Result<u32> {
        Err(Error::Unavailable {
            backend: "HIP",
            reason: "thread-block clusters are a CUDA feature (sm_90 or newer)".to_string(),
        })
    }

    fn has_programmatic_launch(&self) -> bool {
        false
    }

    fn launch(
        &self,
        ordinal: i32,
        function: FunctionHandle,
        config: &LaunchConfig,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        if config.programmatic {
            // Kernel::launch refuses it first; never an ordinary launch in its place.
            return Err(Error::Unavailable {
                backend: "HIP",
                reason: "programmatic dependent launch is a CUDA feature (sm_90 or newer)".to_string(),
            });
        }
        self.with_device(ordinal, || {
            let params_ptr = if params.is_empty() { std::ptr::null_mut() } else { params.as_mut_ptr() };
            self.check("hipModuleLaunchKernel", unsafe {
                (self.api.hip_module_launch_kernel)(
                    function as HipFunction,
                    config.grid[0],
                    config.grid[1],
                    config.grid[2],
                    config.block[0],
                    config.block[1],
                    config.block[2],
                    config.shared_mem_bytes,
                    config.stream as HipStream,
                    params_ptr,
                    std::ptr::null_mut(),
                )
            })
        })
    }

    fn encode_tensor_map_2d(&self, _device: Option<i32>, _spec: &TensorMapSpec) -> Result<[u8; TENSOR_MAP_BYTES]> {
        Err(Error::Invalid("tensor maps (TMA) are a CUDA feature; HIP kernels do not take them".to_string()))
    }

    fn synchronize(&self, ordinal: i32) -> Result<()> {
        self.with_device(ordinal, || self.check("hipDeviceSynchronize", unsafe { (self.api.hip_device_synchronize)() }))
    }
}

unsafe impl Send for HipDriver {}
unsafe impl Sync for HipDriver {}
