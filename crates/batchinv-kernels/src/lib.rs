//! batchinv's kernels: each `kernels_cu/<op>.cu` compiled at build time (see build.rs)
//! and embedded here as one module, with the signature of every kernel it exports.

use batchinv_runtime::{Result, Signature};

/// One kernel exported by a module, with its parameters as `"ptr, i64, ..."`.
#[derive(Debug)]
pub struct EmbeddedKernel {
    pub name: &'static str,
    pub signature: &'static str,
}

/// The images built from one `.cu` file.  An image is `None` when that backend was not
/// built (a CPU-only build, or no `BATCHINV_HIP_ARCHS`).
#[derive(Debug)]
pub struct EmbeddedModule {
    pub name: &'static str,
    pub cuda_image: Option<&'static [u8]>,
    pub hip_image: Option<&'static [u8]>,
    pub kernels: &'static [EmbeddedKernel],
}

/// How the images were built.
#[derive(Debug)]
pub struct BuildInfo {
    /// `;`-separated SASS targets; empty when built without CUDA.
    pub cuda_archs: &'static str,
    pub nvcc_version: &'static str,
    /// `;`-separated AMD targets; empty when HIP was not built.
    pub hip_archs: &'static str,
}

include!(concat!(env!("OUT_DIR"), "/module_table.rs"));

/// The module built from `kernels_cu/<name>.cu`.
pub fn module(name: &str) -> Option<&'static EmbeddedModule> {
    MODULES.iter().find(|m| m.name == name)
}

impl EmbeddedModule {
    pub fn kernel(&self, name: &str) -> Option<&'static EmbeddedKernel> {
        self.kernels.iter().find(|k| k.name == name)
    }
}

impl EmbeddedKernel {
    pub fn parsed_signature(&self) -> Result<Signature> {
        Signature::parse(self.signature)
    }
}

#[cfg(test)]
#[path = "../build_support/signatures.rs"]
mod signatures;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_embedded_signature_parses() {
        assert!(!MODULES.is_empty());
        for module in MODULES {
            for kernel in module.kernels {
                kernel.parsed_signature().unwrap_or_else(|e| panic!("{}: {e}", kernel.name));
            }
        }
    }

    #[test]
    fn embedding_module_declares_its_kernels() {
        let module = module("embedding").expect("embedding module");
        let forward = module.kernel("embedding_forward_i64").unwrap();
        assert_eq!(forward.signature, "ptr, ptr, ptr, i64, i64, i64, ptr");
        assert!(module.kernel("embedding_backward_bf16").is_some());
        if !BUILD_INFO.cuda_archs.is_empty() {
            assert!(module.cuda_image.is_some_and(|image| !image.is_empty()));
        }
    }
}
