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

/// A 2-D tiled TMA descriptor request: a row-major matrix and the box one copy moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorMapSpec {
    /// `CUtensorMapDataType` value (e.g. 9 for bf16, 6 for fp16, 7 for fp32).
    pub data_type: u32,
    pub element_bytes: u32,
    pub address: u64,
    pub rows: u64,
    /// Elements per row (the contiguous dimension).
    pub cols: u64,
    pub row_stride_bytes: u64,
    pub box_rows: u32,
    pub box_cols: u32,
    /// 0, 32, 64 or 128 bytes.
    pub swizzle_bytes: u32,
}

impl TensorMapSpec {
    /// The rules `cuTensorMapEncodeTiled` enforces, checked first so errors name the field.
    pub fn validate(&self) -> Result<()> {
        let fail = |msg: String| Err(Error::Invalid(format!("tensor map: {msg}")));
        if self.address % 16 != 0 {
            return fail(format!("the base address {:#x} must be 16-byte aligned", self.address));
        }
        if self.row_stride_bytes % 16 != 0 {
            return fail(format!("the row stride of {} bytes must be a multiple of 16", self.row_stride_bytes));
        }
        if self.rows == 0 || self.cols == 0 {
            return fail("rows and cols must be positive".to_string());
        }
        if self.row_stride_bytes < self.cols * self.element_bytes as u64 {
            return fail("the row stride is shorter than a row".to_string());
        }
        for (name, value) in [("box_rows", self.box_rows), ("box_cols", self.box_cols)] {
            if value == 0 || value > 256 {
                return fail(format!("{name} = {value} must be in 1..=256"));
            }
        }
        if !matches!(self.swizzle_bytes, 0 | 32 | 64 | 128) {
            return fail(format!("swizzle of {} bytes is not one of 0, 32, 64, 128", self.swizzle_bytes));
        }
        let inner_bytes = self.box_cols * self.element_bytes;
        if self.swizzle_bytes != 0 && inner_bytes > self.swizzle_bytes {
            return fail(format!(
                "a box row of {inner_bytes} bytes exceeds the {}-byte swizzle span",
                self.swizzle_bytes
            ));
        }
        if inner_bytes % 16 != 0 {
            return fail(format!("a box row of {inner_bytes} bytes must be a multiple of 16"));
        }
        Ok(())
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
    /// Lets the kernel launch with clusters of more than 8 CTAs (its compiled
    /// `__cluster_dims__` or a launch attribute); callers check the device first.
    fn allow_non_portable_cluster_size(&self, device: i32, function: FunctionHandle) -> Result<()>;
    /// How many clusters of the kernel (its compiled `__cluster_dims__`) can be resident at
    /// once for `config`'s block and shared memory; 0 when not even one fits.
    fn max_active_clusters(&self, device: i32, function: FunctionHandle, config: &LaunchConfig) -> Result<u32>;
    /// Whether [`LaunchConfig::programmatic`] launches are possible (CUDA: the driver has
    /// `cuLaunchKernelEx`; the device's compute capability is checked separately).
    fn has_programmatic_launch(&self) -> bool;
    /// Launches; `params` points at one value per kernel parameter.
    fn launch(
        &self,
        device: i32,
        function: FunctionHandle,
        config: &LaunchConfig,
        params: &mut [*mut c_void],
    ) -> Result<()>;
    fn synchronize(&self, device: i32) -> Result<()>;
    /// Encodes a TMA descriptor (Hopper and newer; an error where the driver has none), with
    /// `device`'s primary context current where given: the driver needs a current context,
    /// which a thread PyTorch has not launched on (autograd's backward thread) lacks.
    fn encode_tensor_map_2d(
        &self,
        device: Option<i32>,
        spec: &TensorMapSpec,
    ) -> Result<[u8; crate::signature::TENSOR_MAP_BYTES]>;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> TensorMapSpec {
        TensorMapSpec {
            data_type: 9,
            element_bytes: 2,
            address: 0x1000,
            rows: 4096,
            cols: 4096,
            row_stride_bytes: 8192,
            box_rows: 128,
            box_cols: 64,
            swizzle_bytes: 128,
        }
    }

    #[test]
    fn tensor_map_spec_rules() {
        spec().validate().unwrap();
        let err = |s: TensorMapSpec| s.validate().unwrap_err().to_string();
        assert!(err(TensorMapSpec { address: 0x1008, ..spec() }).contains("16-byte aligned"));
        assert!(err(TensorMapSpec { row_stride_bytes: 8200, ..spec() }).contains("multiple of 16"));
        assert!(err(TensorMapSpec { box_rows: 512, ..spec() }).contains("box_rows = 512"));
        assert!(err(TensorMapSpec { box_cols: 128, ..spec() }).contains("exceeds the 128-byte swizzle span"));
        assert!(err(TensorMapSpec { swizzle_bytes: 16, ..spec() }).contains("not one of"));
        assert!(err(TensorMapSpec { row_stride_bytes: 4096, ..spec() }).contains("shorter than a row"));
    }
}
