//! `batchinv._native`: a cupy-style raw-kernel API over `batchinv-runtime`.
//!
//! Thin by design: this file converts Python values to the runtime's types and runtime
//! errors to Python exceptions; every rule lives in `batchinv-runtime`.

mod convert;
mod errors;

use batchinv_runtime::{
    compile_cuda_source, driver_for, Backend, Kernel, LaunchConfig, Module, Signature, TensorMapSpec,
};
use convert::{dims, kernel_args, stream_handle};
use errors::{to_py_err, BackendUnavailableError, BatchinvError, CompileError, DriverError, KernelsNotBuiltError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::collections::BTreeMap;
use std::sync::Arc;

/// A code image and the kernels it holds; built from an embedded op, raw bytes or source.
#[pyclass(frozen, module = "batchinv._native")]
struct RawModule {
    module: Arc<Module>,
    /// Signatures known from the build (embedded modules only).
    declared: BTreeMap<String, String>,
}

fn embedded(name: &str) -> PyResult<&'static batchinv_kernels::EmbeddedModule> {
    batchinv_kernels::module(name).ok_or_else(|| {
        let known: Vec<&str> = batchinv_kernels::MODULES.iter().map(|m| m.name).collect();
        pyo3::exceptions::PyValueError::new_err(format!(
            "no embedded module named '{name}' (built modules: {})",
            known.join(", ")
        ))
    })
}

fn image_of(module: &batchinv_kernels::EmbeddedModule, backend: Backend) -> PyResult<&'static [u8]> {
    let image = match backend {
        Backend::Cuda => module.cuda_image,
        Backend::Hip => module.hip_image,
    };
    image.ok_or_else(|| {
        let how = match backend {
            Backend::Cuda => "this build of batchinv was made with BATCHINV_NO_CUDA=1",
            Backend::Hip => "this build of batchinv was made without BATCHINV_HIP_ARCHS",
        };
        KernelsNotBuiltError::new_err(format!(
            "built without {} kernels: module '{}' has no {} image ({how})",
            backend.name(),
            module.name,
            backend.name()
        ))
    })
}

#[pymethods]
impl RawModule {
    /// Exactly one of `image` (cubin, fatbin, PTX or AMD code object bytes), `embedded`
    /// (the name of a built `kernels_cu/<op>.cu`) or `code` (CUDA C++ compiled with NVRTC
    /// for `device`'s architecture unless `options` name one).
    #[new]
    #[pyo3(signature = (image=None, *, embedded=None, code=None, backend="cuda", options=Vec::new(), nvrtc_path=None, device=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        image: Option<Vec<u8>>,
        embedded: Option<&str>,
        code: Option<&str>,
        backend: &str,
        options: Vec<String>,
        nvrtc_path: Option<&str>,
        device: Option<i32>,
    ) -> PyResult<Self> {
        let backend = Backend::parse(backend).map_err(to_py_err)?;
        let given = [image.is_some(), embedded.is_some(), code.is_some()].iter().filter(|&&g| g).count();
        if given != 1 {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "RawModule takes exactly one of image=, embedded= or code=",
            ));
        }
        if let Some(name) = embedded {
            let module = self::embedded(name)?;
            let image = image_of(module, backend)?;
            let declared = module.kernels.iter().map(|k| (k.name.to_string(), k.signature.to_string())).collect();
            let module = Module::new(backend, format!("embedded '{name}'"), Arc::from(image)).map_err(to_py_err)?;
            return Ok(RawModule { module: Arc::new(module), declared });
        }
        let image: Vec<u8> = match (image, code) {
            (Some(image), _) => image,
            (None, Some(code)) => {
                if backend != Backend::Cuda {
                    return Err(pyo3::exceptions::PyValueError::new_err("code= needs backend='cuda' (NVRTC)"));
                }
                let mut options = options;
                if !options.iter().any(|o| o.starts_with("--gpu-architecture") || o.starts_with("-arch")) {
                    let driver = driver_for(Backend::Cuda).map_err(to_py_err)?;
                    let device = match device {
                        Some(d) => d,
                        None => driver.current_device().map_err(to_py_err)?,
                    };
                    let (major, minor) = driver.compute_capability(device).map_err(to_py_err)?;
                    options.push(format!("--gpu-architecture=sm_{major}{minor}"));
                }
                compile_cuda_source(nvrtc_path, code, "batchinv_module.cu", &options).map_err(to_py_err)?
            }
            (None, None) => unreachable!("checked above"),
        };
        let module = Module::new(backend, "user module", Arc::from(image)).map_err(to_py_err)?;
        Ok(RawModule { module: Arc::new(module), declared: BTreeMap::new() })
    }

    /// A kernel of this module.  `signature` (e.g. `"ptr, ptr, i64, f32"`) is required for
    /// user modules; for embedded modules it comes from the build and may be omitted.
    #[pyo3(signature = (name, signature=None))]
    fn get_function(&self, name: &str, signature: Option<&str>) -> PyResult<RawKernel> {
        let signature = match (signature, self.declared.get(name)) {
            (Some(given), Some(declared)) => {
                let (given, declared) =
                    (Signature::parse(given).map_err(to_py_err)?, Signature::parse(declared).map_err(to_py_err)?);
                if given != declared {
                    return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                        "signature {given} for '{name}' differs from the kernel's declared {declared}"
                    )));
                }
                declared
            }
            (None, Some(declared)) => Signature::parse(declared).map_err(to_py_err)?,
            (Some(given), None) if self.declared.is_empty() => Signature::parse(given).map_err(to_py_err)?,
            (_, None) if !self.declared.is_empty() => {
                let known: Vec<&str> = self.declared.keys().map(String::as_str).collect();
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "{} has no kernel '{name}' (it has: {})",
                    self.module.label(),
                    known.join(", ")
                )));
            }
            (None, None) => {
                return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                    "get_function('{name}') needs signature= for a user module, e.g. signature=\"ptr, i64\""
                )))
            }
            _ => unreachable!(),
        };
        let kernel = Kernel::new(self.module.clone(), name, signature).map_err(to_py_err)?;
        Ok(RawKernel { kernel: Arc::new(kernel) })
    }

    /// Kernel names and signatures declared by the build (empty for user modules).
    fn declared_kernels(&self) -> BTreeMap<String, String> {
        self.declared.clone()
    }

    #[getter]
    fn backend(&self) -> &'static str {
        match self.module.backend() {
            Backend::Cuda => "cuda",
            Backend::Hip => "hip",
        }
    }

    fn __repr__(&self) -> String {
        format!("RawModule({}, backend={})", self.module.label(), self.backend())
    }
}

/// A launchable kernel.  Calls are checked against its signature and the launch limits
/// before anything reaches the driver.
#[pyclass(frozen, module = "batchinv._native")]
struct RawKernel {
    kernel: Arc<Kernel>,
}

impl RawKernel {
    fn device_or_current(&self, device: Option<i32>) -> PyResult<i32> {
        match device {
            Some(d) => Ok(d),
            None => driver_for(self.kernel.module().backend()).and_then(|d| d.current_device()).map_err(to_py_err),
        }
    }
}

#[pymethods]
impl RawKernel {
    /// Launches `grid` x `block` (ints or 1-3-tuples) with `args` on `stream` (a handle
    /// int, an object with `.cuda_stream` or `.ptr`, or None for the default stream) on
    /// `device` (default: the current one).  Asynchronous, like a CUDA launch.
    /// `programmatic=True`: programmatic dependent launch (CUDA, sm_90): the kernel may start
    /// before the previous kernel on the stream has finished and must execute
    /// `griddepcontrol.wait` before reading what that kernel writes; BackendUnavailableError
    /// where the device, driver or backend cannot.
    #[pyo3(signature = (grid, block, args, shared_mem=0, stream=None, device=None, programmatic=false))]
    #[allow(clippy::too_many_arguments)]
    fn __call__(
        &self,
        grid: &Bound<'_, PyAny>,
        block: &Bound<'_, PyAny>,
        args: &Bound<'_, PyAny>,
        shared_mem: u32,
        stream: Option<&Bound<'_, PyAny>>,
        device: Option<i32>,
        programmatic: bool,
    ) -> PyResult<()> {
        let config = LaunchConfig {
            grid: dims("grid", grid)?,
            block: dims("block", block)?,
            shared_mem_bytes: shared_mem,
            stream: stream_handle(stream)?,
            programmatic,
        };
        let values = kernel_args(self.kernel.name(), self.kernel.signature(), args)?;
        // Everything that needs no device is checked, once, before the driver is even loaded.
        let call = self.kernel.check_call(&config, &values).map_err(to_py_err)?;
        let device = self.device_or_current(device)?;
        call.launch(device).map_err(to_py_err)
    }

    /// Validates a call without launching (no device needed).
    #[pyo3(signature = (grid, block, args, shared_mem=0))]
    fn check(
        &self,
        grid: &Bound<'_, PyAny>,
        block: &Bound<'_, PyAny>,
        args: &Bound<'_, PyAny>,
        shared_mem: u32,
    ) -> PyResult<()> {
        let config = LaunchConfig {
            grid: dims("grid", grid)?,
            block: dims("block", block)?,
            shared_mem_bytes: shared_mem,
            stream: 0,
            programmatic: false,
        };
        let values = kernel_args(self.kernel.name(), self.kernel.signature(), args)?;
        self.kernel.check_call(&config, &values).map(|_| ()).map_err(to_py_err)
    }

    /// Allows `bytes` of dynamic shared memory per block (needed above 48 KiB).
    #[pyo3(signature = (bytes, device=None))]
    fn set_max_dynamic_shared_memory(&self, bytes: u32, device: Option<i32>) -> PyResult<()> {
        let device = self.device_or_current(device)?;
        self.kernel.set_max_dynamic_shared_memory(device, bytes).map_err(to_py_err)
    }

    /// Lets this kernel launch with clusters of more than 8 CTAs on `device` (its compiled
    /// `__cluster_dims__`); raises BackendUnavailableError where the device cannot (not an sm_90
    /// CUDA device).  Set once per kernel and device.
    #[pyo3(signature = (device=None))]
    fn allow_non_portable_cluster_size(&self, device: Option<i32>) -> PyResult<()> {
        let device = self.device_or_current(device)?;
        self.kernel.allow_non_portable_cluster_size(device).map_err(to_py_err)
    }

    /// How many clusters of this kernel (its compiled `__cluster_dims__`) with `block` threads
    /// per CTA and `shared_mem` dynamic bytes can be resident on `device` at once; 0 means a
    /// launch of that shape cannot run there.  `grid` must be a valid launch grid.
    #[pyo3(signature = (grid, block, shared_mem=0, device=None))]
    fn max_active_clusters(
        &self,
        grid: &Bound<'_, PyAny>,
        block: &Bound<'_, PyAny>,
        shared_mem: u32,
        device: Option<i32>,
    ) -> PyResult<u32> {
        let config = LaunchConfig {
            grid: dims("grid", grid)?,
            block: dims("block", block)?,
            shared_mem_bytes: shared_mem,
            stream: 0,
            programmatic: false,
        };
        batchinv_runtime::check_static_limits(self.kernel.name(), &config, &batchinv_runtime::STATIC_LIMITS)
            .map_err(to_py_err)?;
        let device = self.device_or_current(device)?;
        self.kernel.max_active_clusters(device, &config).map_err(to_py_err)
    }

    /// The kernel's limits on `device`: max threads per block, static and dynamic shared memory.
    #[pyo3(signature = (device=None))]
    fn attributes<'py>(&self, py: Python<'py>, device: Option<i32>) -> PyResult<Bound<'py, PyDict>> {
        let device = self.device_or_current(device)?;
        let limits = self.kernel.limits(device).map_err(to_py_err)?;
        let dict = PyDict::new(py);
        dict.set_item("max_threads_per_block", limits.max_threads_per_block)?;
        dict.set_item("static_shared_bytes", limits.static_shared_bytes)?;
        dict.set_item("max_dynamic_shared_bytes", limits.max_dynamic_shared_bytes)?;
        Ok(dict)
    }

    #[getter]
    fn name(&self) -> &str {
        self.kernel.name()
    }

    #[getter]
    fn signature(&self) -> String {
        self.kernel.signature().to_string()
    }

    fn __repr__(&self) -> String {
        format!("RawKernel('{}', {})", self.kernel.name(), self.kernel.signature())
    }
}

/// Names of the modules built into this extension (one per `kernels_cu/<op>.cu`).
#[pyfunction]
fn embedded_modules() -> Vec<&'static str> {
    batchinv_kernels::MODULES.iter().map(|m| m.name).collect()
}

/// The raw image of an embedded module (for loading it elsewhere, e.g. with CuPy).
#[pyfunction]
#[pyo3(signature = (name, backend="cuda"))]
fn embedded_image<'py>(py: Python<'py>, name: &str, backend: &str) -> PyResult<Bound<'py, PyBytes>> {
    let backend = Backend::parse(backend).map_err(to_py_err)?;
    Ok(PyBytes::new(py, image_of(embedded(name)?, backend)?))
}

/// How this extension's kernels were built.
#[pyfunction]
fn build_info<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
    let info = &batchinv_kernels::BUILD_INFO;
    let dict = PyDict::new(py);
    dict.set_item("cuda_kernels", !info.cuda_archs.is_empty())?;
    dict.set_item("cuda_archs", info.cuda_archs)?;
    dict.set_item("nvcc_version", info.nvcc_version)?;
    dict.set_item("hip_kernels", !info.hip_archs.is_empty())?;
    dict.set_item("hip_archs", info.hip_archs)?;
    dict.set_item("version", env!("CARGO_PKG_VERSION"))?;
    Ok(dict)
}

/// `(True, "")` if the backend's driver loads and initialises, else `(False, reason)`.
#[pyfunction]
#[pyo3(signature = (backend="cuda"))]
fn driver_status(backend: &str) -> PyResult<(bool, String)> {
    let backend = Backend::parse(backend).map_err(to_py_err)?;
    Ok(match driver_for(backend) {
        Ok(_) => (true, String::new()),
        Err(e) => (false, e.to_string()),
    })
}

/// Number of devices the backend sees (raises if its driver is unavailable).
#[pyfunction]
#[pyo3(signature = (backend="cuda"))]
fn device_count(backend: &str) -> PyResult<i32> {
    let backend = Backend::parse(backend).map_err(to_py_err)?;
    driver_for(backend).and_then(|d| d.device_count()).map_err(to_py_err)
}

/// The device's name and compute capability, as the driver reports them.
#[pyfunction]
#[pyo3(signature = (device, backend="cuda"))]
fn device_properties<'py>(py: Python<'py>, device: i32, backend: &str) -> PyResult<Bound<'py, PyDict>> {
    let backend = Backend::parse(backend).map_err(to_py_err)?;
    let driver = driver_for(backend).map_err(to_py_err)?;
    let dict = PyDict::new(py);
    dict.set_item("name", driver.device_name(device).map_err(to_py_err)?)?;
    dict.set_item("compute_capability", driver.compute_capability(device).map_err(to_py_err)?)?;
    Ok(dict)
}

/// Waits for all work on the device; raises the first asynchronous error, if any.
#[pyfunction]
#[pyo3(signature = (device, backend="cuda"))]
fn synchronize(device: i32, backend: &str) -> PyResult<()> {
    let backend = Backend::parse(backend).map_err(to_py_err)?;
    driver_for(backend).and_then(|d| d.synchronize(device)).map_err(to_py_err)
}

/// A 2-D TMA descriptor (128 bytes) for a row-major matrix at `address`, for kernels with a
/// `tmap` parameter.  `dtype` is "bf16", "f16" or "f32"; the box is what one copy moves.
#[pyfunction]
#[pyo3(signature = (address, dtype, rows, cols, row_stride_bytes, box_rows, box_cols, swizzle_bytes=128, device=None))]
#[allow(clippy::too_many_arguments)]
fn tensor_map_2d<'py>(
    py: Python<'py>,
    address: u64,
    dtype: &str,
    rows: u64,
    cols: u64,
    row_stride_bytes: u64,
    box_rows: u32,
    box_cols: u32,
    swizzle_bytes: u32,
    device: Option<i32>,
) -> PyResult<Bound<'py, PyBytes>> {
    let (data_type, element_bytes) = match dtype {
        "bf16" => (9, 2),
        "f16" => (6, 2),
        "f32" => (7, 4),
        other => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "tensor map dtype must be 'bf16', 'f16' or 'f32', got '{other}'"
            )))
        }
    };
    let spec = TensorMapSpec {
        data_type,
        element_bytes,
        address,
        rows,
        cols,
        row_stride_bytes,
        box_rows,
        box_cols,
        swizzle_bytes,
    };
    spec.validate().map_err(to_py_err)?;
    let map = driver_for(Backend::Cuda).and_then(|d| d.encode_tensor_map_2d(device, &spec)).map_err(to_py_err)?;
    Ok(PyBytes::new(py, &map))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<RawModule>()?;
    m.add_class::<RawKernel>()?;
    m.add_function(wrap_pyfunction!(embedded_modules, m)?)?;
    m.add_function(wrap_pyfunction!(embedded_image, m)?)?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    m.add_function(wrap_pyfunction!(driver_status, m)?)?;
    m.add_function(wrap_pyfunction!(device_count, m)?)?;
    m.add_function(wrap_pyfunction!(device_properties, m)?)?;
    m.add_function(wrap_pyfunction!(synchronize, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_map_2d, m)?)?;
    m.add("BatchinvError", py.get_type::<BatchinvError>())?;
    m.add("BackendUnavailableError", py.get_type::<BackendUnavailableError>())?;
    m.add("DriverError", py.get_type::<DriverError>())?;
    m.add("CompileError", py.get_type::<CompileError>())?;
    m.add("KernelsNotBuiltError", py.get_type::<KernelsNotBuiltError>())?;
    Ok(())
}
