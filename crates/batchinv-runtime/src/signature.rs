//! Kernel signatures: what each parameter is, parsed from a short text form.

use crate::error::{Error, Result};
use std::fmt;
use std::os::raw::c_void;

/// The kind of one kernel parameter, as passed by value through `cuLaunchKernel`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKind {
    /// A device pointer (64-bit).
    Ptr,
    I32,
    U32,
    I64,
    U64,
    F32,
    F64,
    /// A 128-byte TMA descriptor (`CUtensorMap`) passed by value (`__grid_constant__`).
    TensorMap,
}

/// Size of a `CUtensorMap`, the by-value kernel parameter behind [`ParamKind::TensorMap`].
pub const TENSOR_MAP_BYTES: usize = 128;

impl ParamKind {
    pub fn parse(text: &str) -> Result<Self> {
        Ok(match text.trim() {
            "ptr" | "pointer" | "p" => ParamKind::Ptr,
            "i32" | "int32" => ParamKind::I32,
            "u32" | "uint32" => ParamKind::U32,
            "i64" | "int64" => ParamKind::I64,
            "u64" | "uint64" => ParamKind::U64,
            "f32" | "float32" => ParamKind::F32,
            "f64" | "float64" => ParamKind::F64,
            "tmap" => ParamKind::TensorMap,
            other => {
                return Err(Error::Invalid(format!(
                    "unknown parameter type '{other}' (expected one of ptr, i32, u32, i64, u64, f32, f64, tmap)"
                )))
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            ParamKind::Ptr => "ptr",
            ParamKind::I32 => "i32",
            ParamKind::U32 => "u32",
            ParamKind::I64 => "i64",
            ParamKind::U64 => "u64",
            ParamKind::F32 => "f32",
            ParamKind::F64 => "f64",
            ParamKind::TensorMap => "tmap",
        }
    }
}

/// A kernel's parameter list, e.g. `"ptr, ptr, i64, f32"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signature {
    params: Vec<ParamKind>,
}

impl Signature {
    pub fn new(params: Vec<ParamKind>) -> Self {
        Signature { params }
    }

    /// Parses a comma-separated list; an empty string is a kernel without parameters.
    pub fn parse(text: &str) -> Result<Self> {
        let text = text.trim().trim_start_matches('(').trim_end_matches(')');
        if text.trim().is_empty() {
            return Ok(Signature { params: Vec::new() });
        }
        let params = text.split(',').map(ParamKind::parse).collect::<Result<Vec<_>>>()?;
        Ok(Signature { params })
    }

    pub fn params(&self) -> &[ParamKind] {
        &self.params
    }

    /// Checks arity and the kind of every argument; `kernel` names the kernel in errors.
    pub fn check(&self, kernel: &str, args: &[ArgValue]) -> Result<()> {
        if args.len() != self.params.len() {
            return Err(Error::Signature(format!(
                "kernel '{kernel}' takes {} arguments ({self}), got {}",
                self.params.len(),
                args.len()
            )));
        }
        for (index, (param, arg)) in self.params.iter().zip(args).enumerate() {
            if arg.kind() != *param {
                return Err(Error::Signature(format!(
                    "kernel '{kernel}' argument {index} must be {}, got {}",
                    param.name(),
                    arg.kind().name()
                )));
            }
        }
        Ok(())
    }
}

impl fmt::Display for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.params.iter().map(|p| p.name()).collect();
        write!(f, "({})", names.join(", "))
    }
}

/// One argument value, tagged with its kind.
#[derive(Debug, Clone, PartialEq)]
pub enum ArgValue {
    Ptr(u64),
    I32(i32),
    U32(u32),
    I64(i64),
    U64(u64),
    F32(f32),
    F64(f64),
    TensorMap(Box<[u8; TENSOR_MAP_BYTES]>),
}

impl ArgValue {
    pub fn kind(&self) -> ParamKind {
        match self {
            ArgValue::Ptr(_) => ParamKind::Ptr,
            ArgValue::I32(_) => ParamKind::I32,
            ArgValue::U32(_) => ParamKind::U32,
            ArgValue::I64(_) => ParamKind::I64,
            ArgValue::U64(_) => ParamKind::U64,
            ArgValue::F32(_) => ParamKind::F32,
            ArgValue::F64(_) => ParamKind::F64,
            ArgValue::TensorMap(_) => ParamKind::TensorMap,
        }
    }

    fn to_slot(&self) -> Slot {
        let mut slot = Slot([0u8; TENSOR_MAP_BYTES]);
        let out = &mut slot.0;
        match *self {
            ArgValue::Ptr(v) | ArgValue::U64(v) => out[..8].copy_from_slice(&v.to_ne_bytes()),
            ArgValue::I64(v) => out[..8].copy_from_slice(&v.to_ne_bytes()),
            ArgValue::F64(v) => out[..8].copy_from_slice(&v.to_ne_bytes()),
            ArgValue::I32(v) => out[..4].copy_from_slice(&v.to_ne_bytes()),
            ArgValue::U32(v) => out[..4].copy_from_slice(&v.to_ne_bytes()),
            ArgValue::F32(v) => out[..4].copy_from_slice(&v.to_ne_bytes()),
            ArgValue::TensorMap(ref bytes) => out.copy_from_slice(&bytes[..]),
        }
        slot
    }
}

/// One parameter's bytes, large and aligned enough for any kind (a tensor map wants 64).
#[repr(C, align(64))]
struct Slot([u8; TENSOR_MAP_BYTES]);

/// Argument storage in the form `cuLaunchKernel` wants: an array of pointers to values.
pub(crate) struct PackedArgs {
    values: Vec<Slot>,
}

impl PackedArgs {
    pub(crate) fn new(args: &[ArgValue]) -> Self {
        PackedArgs { values: args.iter().map(ArgValue::to_slot).collect() }
    }

    /// Pointers into `self`; valid while `self` is alive and unmoved.
    pub(crate) fn pointers(&mut self) -> Vec<*mut c_void> {
        self.values.iter_mut().map(|v| v.0.as_mut_ptr() as *mut c_void).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        let sig = Signature::parse("ptr, i64,f32 , u32").unwrap();
        assert_eq!(sig.params(), &[ParamKind::Ptr, ParamKind::I64, ParamKind::F32, ParamKind::U32]);
        assert_eq!(sig.to_string(), "(ptr, i64, f32, u32)");
        assert_eq!(Signature::parse("").unwrap().params().len(), 0);
        assert_eq!(Signature::parse("(ptr)").unwrap().params(), &[ParamKind::Ptr]);
    }

    #[test]
    fn rejects_unknown_type() {
        let err = Signature::parse("ptr, int").unwrap_err();
        assert!(err.to_string().contains("unknown parameter type 'int'"), "{err}");
    }

    #[test]
    fn checks_arity_and_kinds() {
        let sig = Signature::parse("ptr, i64").unwrap();
        sig.check("k", &[ArgValue::Ptr(16), ArgValue::I64(3)]).unwrap();
        let err = sig.check("k", &[ArgValue::Ptr(16)]).unwrap_err();
        assert_eq!(err.to_string(), "kernel 'k' takes 2 arguments ((ptr, i64)), got 1");
        let err = sig.check("k", &[ArgValue::Ptr(16), ArgValue::I32(3)]).unwrap_err();
        assert_eq!(err.to_string(), "kernel 'k' argument 1 must be i64, got i32");
    }

    #[test]
    fn packs_values_little_endian() {
        let map = Box::new([7u8; TENSOR_MAP_BYTES]);
        let mut packed =
            PackedArgs::new(&[ArgValue::I32(-2), ArgValue::F32(1.5), ArgValue::Ptr(7), ArgValue::TensorMap(map)]);
        let ptrs = packed.pointers();
        unsafe {
            assert_eq!(*(ptrs[0] as *const i32), -2);
            assert_eq!(*(ptrs[1] as *const f32), 1.5);
            assert_eq!(*(ptrs[2] as *const u64), 7);
            assert_eq!(*(ptrs[3] as *const [u8; TENSOR_MAP_BYTES]), [7u8; TENSOR_MAP_BYTES]);
            assert_eq!(ptrs[3] as usize % 64, 0);
        }
    }
}
