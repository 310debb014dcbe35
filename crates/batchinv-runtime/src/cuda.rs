//! The CUDA driver API, opened at run time from `libcuda.so.1`.
//!
//! Launches share PyTorch's context: the device's primary context is retained once and
//! made current around each call, then the caller's context is restored.

use crate::config::{DeviceLimits, FunctionLimits, LaunchConfig};
use crate::driver::{Backend, Driver, FunctionHandle, ModuleHandle, TensorMapSpec};
use crate::error::{Error, Result};
use crate::signature::TENSOR_MAP_BYTES;
use libloading::Library;
use std::collections::HashMap;
use std::ffi::CStr;
use std::os::raw::{c_char, c_int, c_uint, c_void};
use std::sync::Mutex;

type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut c_void;
type CuModule = *mut c_void;
type CuFunction = *mut c_void;
type CuStream = *mut c_void;

const CUDA_SUCCESS: CuResult = 0;

// CUdevice_attribute values (cuda.h).
const ATTR_MAX_THREADS_PER_BLOCK: c_int = 1;
const ATTR_MAX_BLOCK_DIM_X: c_int = 2;
const ATTR_MAX_GRID_DIM_X: c_int = 5;
const ATTR_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
const ATTR_COMPUTE_CAPABILITY_MINOR: c_int = 76;
const ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: c_int = 97;

// CUfunction_attribute values.
const FUNC_MAX_THREADS_PER_BLOCK: c_int = 0;
const FUNC_SHARED_SIZE_BYTES: c_int = 1;
const FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES: c_int = 8;
const FUNC_NON_PORTABLE_CLUSTER_SIZE_ALLOWED: c_int = 14;

// CUlaunchAttributeID value (cuda.h).
const LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: c_uint = 6;

/// `CUlaunchConfig` (cuda.h).  Cluster shapes come from the kernels' compiled
/// `__cluster_dims__`; the only attribute batchinv sets is programmatic stream serialization.
#[repr(C)]
struct CuLaunchConfig {
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared_mem_bytes: c_uint,
    stream: CuStream,
    attrs: *mut CuLaunchAttribute,
    num_attrs: c_uint,
}

/// `CUlaunchAttribute` (cuda.h): a 4-byte id padded to 8, then a 64-byte value union
/// (8-byte aligned: some members hold pointers).
#[repr(C)]
struct CuLaunchAttribute {
    id: c_uint,
    pad: [u8; 4],
    value: [u64; 8],
}

impl CuLaunchAttribute {
    /// `programmaticStreamSerializationAllowed = 1` (an int at the start of the union).
    fn programmatic_stream_serialization() -> Self {
        let mut value = [0u64; 8];
        // The union's int member sits at its first byte, whatever the byte order.
        unsafe { *(value.as_mut_ptr() as *mut c_int) = 1 };
        CuLaunchAttribute { id: LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, pad: [0; 4], value }
    }
}

struct Api {
    cu_init: unsafe extern "C" fn(c_uint) -> CuResult,
    cu_device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    cu_device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    cu_device_get_name: unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult,
    cu_device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, CuDevice) -> CuResult,
    cu_primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    cu_ctx_get_current: unsafe extern "C" fn(*mut CuContext) -> CuResult,
    cu_ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
    cu_ctx_get_device: unsafe extern "C" fn(*mut CuDevice) -> CuResult,
    cu_ctx_synchronize: unsafe extern "C" fn() -> CuResult,
    cu_module_load_data: unsafe extern "C" fn(*mut CuModule, *const c_void) -> CuResult,
    cu_module_unload: unsafe extern "C" fn(CuModule) -> CuResult,
    cu_module_get_function: unsafe extern "C" fn(*mut CuFunction, CuModule, *const c_char) -> CuResult,
    cu_func_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, CuFunction) -> CuResult,
    cu_func_set_attribute: unsafe extern "C" fn(CuFunction, c_int, c_int) -> CuResult,
    #[allow(clippy::type_complexity)]
    cu_launch_kernel: unsafe extern "C" fn(
        CuFunction,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        CuStream,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> CuResult,
    /// Absent from drivers older than CUDA 12 (11.8 at the earliest).
    cu_launch_kernel_ex:
        Option<unsafe extern "C" fn(*const CuLaunchConfig, CuFunction, *mut *mut c_void, *mut *mut c_void) -> CuResult>,
    /// Absent from drivers older than CUDA 12.
    cu_occupancy_max_active_clusters:
        Option<unsafe extern "C" fn(*mut c_int, CuFunction, *const CuLaunchConfig) -> CuResult>,
    /// Absent from drivers older than CUDA 12.
    #[allow(clippy::type_complexity)]
    cu_tensor_map_encode_tiled: Option<
        unsafe extern "C" fn(
            *mut c_void,
            c_uint,
            c_uint,
            *mut c_void,
            *const u64,
            *const u64,
            *const c_uint,
            *const c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
        ) -> CuResult,
    >,
    cu_get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    cu_get_error_string: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
}

pub(crate) struct CudaDriver {
    api: Api,
    /// Retained primary contexts by device ordinal (never released: they live as long as
    /// the process, like PyTorch's).
    contexts: Mutex<HashMap<i32, usize>>,
    _library: Library,
}

unsafe fn symbol<T: Copy>(library: &Library, name: &str) -> Result<T> {
    let symbol = library.get::<T>(name.as_bytes()).map_err(|e| Error::Unavailable {
        backend: "CUDA",
        reason: format!("the driver library has no symbol {name}: {e}"),
    })?;
    Ok(*symbol)
}

impl CudaDriver {
    pub(crate) fn load() -> Result<Self> {
        let library = open_library()?;
        let api = unsafe {
            Api {
                cu_init: symbol(&library, "cuInit")?,
                cu_device_get_count: symbol(&library, "cuDeviceGetCount")?,
                cu_device_get: symbol(&library, "cuDeviceGet")?,
                cu_device_get_name: symbol(&library, "cuDeviceGetName")?,
                cu_device_get_attribute: symbol(&library, "cuDeviceGetAttribute")?,
                cu_primary_ctx_retain: symbol(&library, "cuDevicePrimaryCtxRetain")?,
                cu_ctx_get_current: symbol(&library, "cuCtxGetCurrent")?,
                cu_ctx_set_current: symbol(&library, "cuCtxSetCurrent")?,
                cu_ctx_get_device: symbol(&library, "cuCtxGetDevice")?,
                cu_ctx_synchronize: symbol(&library, "cuCtxSynchronize")?,
                cu_module_load_data: symbol(&library, "cuModuleLoadData")?,
                cu_module_unload: symbol(&library, "cuModuleUnload")?,
                cu_module_get_function: symbol(&library, "cuModuleGetFunction")?,
                cu_func_get_attribute: symbol(&library, "cuFuncGetAttribute")?,
                cu_func_set_attribute: symbol(&library, "cuFuncSetAttribute")?,
                cu_launch_kernel: symbol(&library, "cuLaunchKernel")?,
                cu_launch_kernel_ex: symbol(&library, "cuLaunchKernelEx").ok(),
                cu_occupancy_max_active_clusters: symbol(&library, "cuOccupancyMaxActiveClusters").ok(),
                cu_tensor_map_encode_tiled: symbol(&library, "cuTensorMapEncodeTiled").ok(),
                cu_get_error_name: symbol(&library, "cuGetErrorName")?,
                cu_get_error_string: symbol(&library, "cuGetErrorString")?,
            }
        };
        let driver = CudaDriver { api, contexts: Mutex::new(HashMap::new()), _library: library };
        let code = unsafe { (driver.api.cu_init)(0) };
        if code != CUDA_SUCCESS {
            let err = driver.error("cuInit", code);
            return Err(Error::Unavailable { backend: "CUDA", reason: err.to_string() });
        }
        Ok(driver)
    }

    fn error(&self, call: &'static str, code: CuResult) -> Error {
        let read = |f: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult| {
            let mut text: *const c_char = std::ptr::null();
            if unsafe { f(code, &mut text) } == CUDA_SUCCESS && !text.is_null() {
                unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
            } else {
                "unknown error".to_string()
            }
        };
        Error::Driver {
            backend: "CUDA",
            call,
            code,
            name: read(self.api.cu_get_error_name),
            message: read(self.api.cu_get_error_string),
            kernel: None,
        }
    }

    fn check(&self, call: &'static str, code: CuResult) -> Result<()> {
        if code == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(self.error(call, code))
        }
    }

    fn device(&self, ordinal: i32) -> Result<CuDevice> {
        let count = self.device_count()?;
        if ordinal < 0 || ordinal >= count {
            return Err(Error::Invalid(format!("CUDA device {ordinal} does not exist ({count} device(s) visible)")));
        }
        let mut device: CuDevice = 0;
        self.check("cuDeviceGet", unsafe { (self.api.cu_device_get)(&mut device, ordinal) })?;
        Ok(device)
    }

    fn attribute(&self, device: CuDevice, attribute: c_int) -> Result<i32> {
        let mut value: c_int = 0;
        self.check("cuDeviceGetAttribute", unsafe {
            (self.api.cu_device_get_attribute)(&mut value, attribute, device)
        })?;
        Ok(value)
    }

    fn primary_context(&self, ordinal: i32) -> Result<CuContext> {
        let mut contexts = self.contexts.lock().expect("context cache poisoned");
        if let Some(&ctx) = contexts.get(&ordinal) {
            return Ok(ctx as CuContext);
        }
        let device = self.device(ordinal)?;
        let mut ctx: CuContext = std::ptr::null_mut();
        self.check("cuDevicePrimaryCtxRetain", unsafe { (self.api.cu_primary_ctx_retain)(&mut ctx, device) })?;
        contexts.insert(ordinal, ctx as usize);
        Ok(ctx)
    }

    fn encode_tensor_map(&self, spec: &TensorMapSpec) -> Result<[u8; TENSOR_MAP_BYTES]> {
        spec.validate()?;
        let encode = self.api.cu_tensor_map_encode_tiled.ok_or_else(|| Error::Unavailable {
            backend: "CUDA",
            reason: "this driver has no cuTensorMapEncodeTiled (TMA needs CUDA 12 or newer)".to_string(),
        })?;
        // Dimension 0 is the contiguous one for the driver.
        let dims = [spec.cols, spec.rows];
        let strides = [spec.row_stride_bytes];
        let boxes = [spec.box_cols, spec.box_rows];
        let element_strides = [1u32, 1u32];
        let swizzle = match spec.swizzle_bytes {
            0 => 0,
            32 => 1,
            64 => 2,
            _ => 3,
        };
        const L2_PROMOTION_256B: c_uint = 3;
        const OOB_FILL_ZEROS: c_uint = 0;
        let mut map = TensorMapStorage([0u8; TENSOR_MAP_BYTES]);
        self.check("cuTensorMapEncodeTiled", unsafe {
            encode(
                map.0.as_mut_ptr() as *mut c_void,
                spec.data_type,
                2,
                spec.address as *mut c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                element_strides.as_ptr(),
                0,
                swizzle,
                L2_PROMOTION_256B,
                OOB_FILL_ZEROS,
            )
        })?;
        Ok(map.0)
    }

    /// Runs `body` with the device's primary context current, restoring the caller's after.
    fn with_context<T>(&self, ordinal: i32, body: impl FnOnce() -> Result<T>) -> Result<T> {
        let ctx = self.primary_context(ordinal)?;
        let mut previous: CuContext = std::ptr::null_mut();
        self.check("cuCtxGetCurrent", unsafe { (self.api.cu_ctx_get_current)(&mut previous) })?;
        if previous == ctx {
            return body();
        }
        self.check("cuCtxSetCurrent", unsafe { (self.api.cu_ctx_set_current)(ctx) })?;
        let result = body();
        let restored = self.check("cuCtxSetCurrent", unsafe { (self.api.cu_ctx_set_current)(previous) });
        let value = result?;
        restored?;
        Ok(value)
    }

    /// `cuLaunchKernelEx` with programmatic stream serialization allowed (see
    /// [`LaunchConfig::programmatic`]); the caller has checked the device.
    fn launch_programmatic(
        &self,
        ordinal: i32,
        function: FunctionHandle,
        config: &LaunchConfig,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let launch_ex = self.api.cu_launch_kernel_ex.ok_or_else(|| Error::Unavailable {
            backend: "CUDA",
            reason: "this driver has no cuLaunchKernelEx (programmatic dependent launch needs CUDA 12 or newer)"
                .to_string(),
        })?;
        let mut attribute = CuLaunchAttribute::programmatic_stream_serialization();
        let launch = CuLaunchConfig {
            grid: config.grid,
            block: config.block,
            shared_mem_bytes: config.shared_mem_bytes,
            stream: config.stream as CuStream,
            attrs: &mut attribute,
            num_attrs: 1,
        };
        self.with_context(ordinal, || {
            let params_ptr = if params.is_empty() { std::ptr::null_mut() } else { params.as_mut_ptr() };
            self.check("cuLaunchKernelEx", unsafe {
                launch_ex(&launch, function as CuFunction, params_ptr, std::ptr::null_mut())
            })
        })
    }

    fn function_attribute(&self, function: FunctionHandle, attribute: c_int) -> Result<i32> {
        let mut value: c_int = 0;
        self.check("cuFuncGetAttribute", unsafe {
            (self.api.cu_func_get_attribute)(&mut value, attribute, function as CuFunction)
        })?;
        Ok(value)
    }
}

fn open_library() -> Result<Library> {
    let mut reasons = Vec::new();
    for name in ["libcuda.so.1", "libcuda.so"] {
        match unsafe { Library::new(name) } {
            Ok(library) => return Ok(library),
            Err(e) => reasons.push(format!("{name}: {e}")),
        }
    }
    Err(Error::Unavailable {
        backend: "CUDA",
        reason: format!("the NVIDIA driver library could not be loaded ({})", reasons.join("; ")),
    })
}

/// The driver writes the descriptor with 64-byte alignment.
#[repr(C, align(64))]
struct TensorMapStorage([u8; TENSOR_MAP_BYTES]);

/// Module images handed to `cuModuleLoadData`: cubin and fatbin as they are, PTX text with
/// the terminating NUL the driver expects.
fn loadable_image(image: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    const ELF: &[u8] = b"\x7fELF";
    const FATBIN: &[u8] = &0xBA55_ED50u32.to_le_bytes();
    let binary = image.starts_with(ELF) || image.starts_with(FATBIN);
    if binary || image.last() == Some(&0) {
        std::borrow::Cow::Borrowed(image)
    } else {
        let mut text = image.to_vec();
        text.push(0);
        std::borrow::Cow::Owned(text)
    }
}

impl Driver for CudaDriver {
    fn backend(&self) -> Backend {
        Backend::Cuda
    }

    fn device_count(&self) -> Result<i32> {
        let mut count: c_int = 0;
        self.check("cuDeviceGetCount", unsafe { (self.api.cu_device_get_count)(&mut count) })?;
        Ok(count)
    }

    fn current_device(&self) -> Result<i32> {
        let mut ctx: CuContext = std::ptr::null_mut();
        self.check("cuCtxGetCurrent", unsafe { (self.api.cu_ctx_get_current)(&mut ctx) })?;
        if ctx.is_null() {
            return Ok(0);
        }
        let mut device: CuDevice = 0;
        self.check("cuCtxGetDevice", unsafe { (self.api.cu_ctx_get_device)(&mut device) })?;
        Ok(device)
    }

    fn device_name(&self, ordinal: i32) -> Result<String> {
        let device = self.device(ordinal)?;
        let mut buffer = [0 as c_char; 256];
        self.check("cuDeviceGetName", unsafe {
            (self.api.cu_device_get_name)(buffer.as_mut_ptr(), buffer.len() as c_int, device)
        })?;
        Ok(unsafe { CStr::from_ptr(buffer.as_ptr()) }.to_string_lossy().into_owned())
    }

    fn compute_capability(&self, ordinal: i32) -> Result<(i32, i32)> {
        let device = self.device(ordinal)?;
        Ok((
            self.attribute(device, ATTR_COMPUTE_CAPABILITY_MAJOR)?,
            self.attribute(device, ATTR_COMPUTE_CAPABILITY_MINOR)?,
        ))
    }

    fn device_limits(&self, ordinal: i32) -> Result<DeviceLimits> {
        let device = self.device(ordinal)?;
        let mut max_block = [0u32; 3];
        let mut max_grid = [0u32; 3];
        for axis in 0..3 {
            max_block[axis] = self.attribute(device, ATTR_MAX_BLOCK_DIM_X + axis as c_int)? as u32;
            max_grid[axis] = self.attribute(device, ATTR_MAX_GRID_DIM_X + axis as c_int)? as u32;
        }
        Ok(DeviceLimits {
            max_threads_per_block: self.attribute(device, ATTR_MAX_THREADS_PER_BLOCK)? as u32,
            max_block,
            max_grid,
            max_shared_optin: self.attribute(device, ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as u32,
        })
    }

    fn load_module(&self, ordinal: i32, image: &[u8]) -> Result<ModuleHandle> {
        let image = loadable_image(image);
        self.with_context(ordinal, || {
            let mut module: CuModule = std::ptr::null_mut();
            self.check("cuModuleLoadData", unsafe {
                (self.api.cu_module_load_data)(&mut module, image.as_ptr() as *const c_void)
            })?;
            Ok(module as ModuleHandle)
        })
    }

    fn unload_module(&self, ordinal: i32, module: ModuleHandle) {
        // Best effort: at interpreter exit the context may already be gone.
        let _ = self.with_context(ordinal, || {
            self.check("cuModuleUnload", unsafe { (self.api.cu_module_unload)(module as CuModule) })
        });
    }

    fn get_function(&self, ordinal: i32, module: ModuleHandle, name: &CStr) -> Result<FunctionHandle> {
        self.with_context(ordinal, || {
            let mut function: CuFunction = std::ptr::null_mut();
            let code = unsafe { (self.api.cu_module_get_function)(&mut function, module as CuModule, name.as_ptr()) };
            if code != CUDA_SUCCESS {
                let err = self.error("cuModuleGetFunction", code);
                return Err(Error::Invalid(format!(
                    "kernel '{}' is not in the module ({err})",
                    name.to_string_lossy()
                )));
            }
            Ok(function as FunctionHandle)
        })
    }

    fn function_limits(&self, ordinal: i32, function: FunctionHandle) -> Result<FunctionLimits> {
        self.with_context(ordinal, || {
            Ok(FunctionLimits {
                max_threads_per_block: self.function_attribute(function, FUNC_MAX_THREADS_PER_BLOCK)? as u32,
                static_shared_bytes: self.function_attribute(function, FUNC_SHARED_SIZE_BYTES)? as u32,
                max_dynamic_shared_bytes: self.function_attribute(function, FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES)? as u32,
            })
        })
    }

    fn set_max_dynamic_shared(&self, ordinal: i32, function: FunctionHandle, bytes: u32) -> Result<()> {
        self.with_context(ordinal, || {
            self.check("cuFuncSetAttribute", unsafe {
                (self.api.cu_func_set_attribute)(
                    function as CuFunction,
                    FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as c_int,
                )
            })
        })
    }

    fn allow_non_portable_cluster_size(&self, ordinal: i32, function: FunctionHandle) -> Result<()> {
        self.with_context(ordinal, || {
            self.check("cuFuncSetAttribute", unsafe {
                (self.api.cu_func_set_attribute)(function as CuFunction, FUNC_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
            })
        })
    }

    fn max_active_clusters(&self, ordinal: i32, function: FunctionHandle, config: &LaunchConfig) -> Result<u32> {
        let query = self.api.cu_occupancy_max_active_clusters.ok_or_else(|| Error::Unavailable {
            backend: "CUDA",
            reason: "this driver has no cuOccupancyMaxActiveClusters (clusters need CUDA 12 or newer)".to_string(),
        })?;
        let launch = CuLaunchConfig {
            grid: config.grid,
            block: config.block,
            shared_mem_bytes: config.shared_mem_bytes,
            stream: config.stream as CuStream,
            attrs: std::ptr::null_mut(),
            num_attrs: 0,
        };
        self.with_context(ordinal, || {
            let mut clusters: c_int = 0;
            self.check("cuOccupancyMaxActiveClusters", unsafe {
                query(&mut clusters, function as CuFunction, &launch)
            })?;
            Ok(clusters.max(0) as u32)
        })
    }

    fn has_programmatic_launch(&self) -> bool {
        self.api.cu_launch_kernel_ex.is_some()
    }

    fn launch(
        &self,
        ordinal: i32,
        function: FunctionHandle,
        config: &LaunchConfig,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        if config.programmatic {
            return self.launch_programmatic(ordinal, function, config, params);
        }
        self.with_context(ordinal, || {
            let params_ptr = if params.is_empty() { std::ptr::null_mut() } else { params.as_mut_ptr() };
            self.check("cuLaunchKernel", unsafe {
                (self.api.cu_launch_kernel)(
                    function as CuFunction,
                    config.grid[0],
                    config.grid[1],
                    config.grid[2],
                    config.block[0],
                    config.block[1],
                    config.block[2],
                    config.shared_mem_bytes,
                    config.stream as CuStream,
                    params_ptr,
                    std::ptr::null_mut(),
                )
            })
        })
    }

    fn encode_tensor_map_2d(&self, device: Option<i32>, spec: &TensorMapSpec) -> Result<[u8; TENSOR_MAP_BYTES]> {
        match device {
            Some(ordinal) => self.with_context(ordinal, || self.encode_tensor_map(spec)),
            None => self.encode_tensor_map(spec),
        }
    }

    fn synchronize(&self, ordinal: i32) -> Result<()> {
        self.with_context(ordinal, || self.check("cuCtxSynchronize", unsafe { (self.api.cu_ctx_synchronize)() }))
    }
}

// The raw handles are only used under the driver's own thread safety.
unsafe impl Send for CudaDriver {}
unsafe impl Sync for CudaDriver {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_attribute_matches_cuda_h() {
        // sizeof(CUlaunchAttribute) == 72 with 8-byte alignment; the value union at offset 8.
        assert_eq!(std::mem::size_of::<CuLaunchAttribute>(), 72);
        assert_eq!(std::mem::align_of::<CuLaunchAttribute>(), 8);
        let attribute = CuLaunchAttribute::programmatic_stream_serialization();
        let bytes: &[u8; 72] = unsafe { &*(&attribute as *const CuLaunchAttribute as *const [u8; 72]) };
        assert_eq!(&bytes[..4], &6u32.to_ne_bytes());
        assert_eq!(&bytes[8..12], &1i32.to_ne_bytes());
        assert!(bytes[12..].iter().all(|&b| b == 0));
    }

    #[test]
    fn ptx_gets_a_terminating_nul() {
        assert_eq!(loadable_image(b".version 8.0").last(), Some(&0));
        let elf = b"\x7fELF\x02rest";
        assert_eq!(loadable_image(elf).len(), elf.len());
        let fatbin = [0x50, 0xED, 0x55, 0xBA, 1, 2];
        assert_eq!(loadable_image(&fatbin).len(), fatbin.len());
    }
}
