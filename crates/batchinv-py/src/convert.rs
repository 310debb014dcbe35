//! Python values to launch parameters, with errors that name the argument.

use batchinv_runtime::{ArgValue, ParamKind, Signature, TENSOR_MAP_BYTES};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyFloat, PyInt, PyTuple};

/// An int or a 1-3-tuple of ints as `[x, y, z]`, missing dimensions 1.
pub fn dims(what: &str, value: &Bound<'_, PyAny>) -> PyResult<[u32; 3]> {
    let items: Vec<Bound<'_, PyAny>> = if value.is_instance_of::<PyInt>() {
        vec![value.clone()]
    } else if let Ok(tuple) = value.cast::<PyTuple>() {
        tuple.iter().collect()
    } else {
        return Err(PyTypeError::new_err(format!("{what} must be an int or a tuple of 1 to 3 ints")));
    };
    if items.is_empty() || items.len() > 3 {
        return Err(PyValueError::new_err(format!("{what} must have 1 to 3 dimensions, got {}", items.len())));
    }
    let mut out = [1u32; 3];
    for (axis, item) in items.iter().enumerate() {
        if item.is_instance_of::<PyBool>() || !item.is_instance_of::<PyInt>() {
            return Err(PyTypeError::new_err(format!("{what}[{axis}] must be an int")));
        }
        let v: i64 = item.extract().map_err(|_| PyValueError::new_err(format!("{what}[{axis}] is out of range")))?;
        if v < 1 || v > u32::MAX as i64 {
            return Err(PyValueError::new_err(format!("{what}[{axis}] = {v} must be at least 1")));
        }
        out[axis] = v as u32;
    }
    Ok(out)
}

/// A stream handle from None, an int, or an object with `.cuda_stream` (torch) or `.ptr` (CuPy).
pub fn stream_handle(stream: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
    let Some(stream) = stream else { return Ok(0) };
    if stream.is_none() {
        return Ok(0);
    }
    let handle = if stream.is_instance_of::<PyInt>() {
        stream.clone()
    } else if let Ok(h) = stream.getattr("cuda_stream") {
        h
    } else if let Ok(h) = stream.getattr("ptr") {
        h
    } else {
        return Err(PyTypeError::new_err("stream must be None, an int handle, or have .cuda_stream or .ptr"));
    };
    handle.extract::<u64>().map_err(|_| PyValueError::new_err("stream handle must be a non-negative int"))
}

fn int_arg<T: for<'a, 'py> FromPyObject<'a, 'py>>(
    kernel: &str,
    index: usize,
    kind: ParamKind,
    value: &Bound<'_, PyAny>,
) -> PyResult<T> {
    if value.is_instance_of::<PyBool>() || !value.is_instance_of::<PyInt>() {
        return Err(PyTypeError::new_err(format!(
            "kernel '{kernel}' argument {index} must be an int ({}), got {}",
            kind.name(),
            value.get_type().name()?
        )));
    }
    value.extract::<T>().map_err(|_| {
        PyValueError::new_err(format!("kernel '{kernel}' argument {index} = {value} does not fit in {}", kind.name()))
    })
}

fn pointer_arg(kernel: &str, index: usize, value: &Bound<'_, PyAny>) -> PyResult<u64> {
    if value.is_instance_of::<PyInt>() && !value.is_instance_of::<PyBool>() {
        return int_arg::<u64>(kernel, index, ParamKind::Ptr, value);
    }
    if let Ok(data_ptr) = value.getattr("data_ptr") {
        return data_ptr.call0()?.extract::<u64>();
    }
    Err(PyTypeError::new_err(format!(
        "kernel '{kernel}' argument {index} must be a pointer (an int or an object with data_ptr()), got {}",
        value.get_type().name()?
    )))
}

fn float_arg(kernel: &str, index: usize, kind: ParamKind, value: &Bound<'_, PyAny>) -> PyResult<f64> {
    if value.is_instance_of::<PyFloat>() || (value.is_instance_of::<PyInt>() && !value.is_instance_of::<PyBool>()) {
        return value.extract::<f64>();
    }
    Err(PyTypeError::new_err(format!(
        "kernel '{kernel}' argument {index} must be a float ({}), got {}",
        kind.name(),
        value.get_type().name()?
    )))
}

fn tensor_map_arg(kernel: &str, index: usize, value: &Bound<'_, PyAny>) -> PyResult<Box<[u8; TENSOR_MAP_BYTES]>> {
    let bytes = value.cast::<PyBytes>().map_err(|_| {
        PyTypeError::new_err(format!(
            "kernel '{kernel}' argument {index} must be a tensor map (bytes from tensor_map_2d), got {}",
            value.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        ))
    })?;
    let data: [u8; TENSOR_MAP_BYTES] = bytes.as_bytes().try_into().map_err(|_| {
        PyValueError::new_err(format!(
            "kernel '{kernel}' argument {index} must be {TENSOR_MAP_BYTES} bytes, got {}",
            bytes.as_bytes().len()
        ))
    })?;
    Ok(Box::new(data))
}

/// Converts a sequence of Python values according to `signature`; arity is checked first.
pub fn kernel_args(kernel: &str, signature: &Signature, args: &Bound<'_, PyAny>) -> PyResult<Vec<ArgValue>> {
    let items: Vec<Bound<'_, PyAny>> =
        args.try_iter().map_err(|_| PyTypeError::new_err("args must be a tuple or list"))?.collect::<PyResult<_>>()?;
    let params = signature.params();
    if items.len() != params.len() {
        return Err(PyTypeError::new_err(format!(
            "kernel '{kernel}' takes {} arguments {signature}, got {}",
            params.len(),
            items.len()
        )));
    }
    params
        .iter()
        .zip(&items)
        .enumerate()
        .map(|(i, (&kind, value))| {
            Ok(match kind {
                ParamKind::Ptr => ArgValue::Ptr(pointer_arg(kernel, i, value)?),
                ParamKind::I32 => ArgValue::I32(int_arg(kernel, i, kind, value)?),
                ParamKind::U32 => ArgValue::U32(int_arg(kernel, i, kind, value)?),
                ParamKind::I64 => ArgValue::I64(int_arg(kernel, i, kind, value)?),
                ParamKind::U64 => ArgValue::U64(int_arg(kernel, i, kind, value)?),
                ParamKind::F32 => ArgValue::F32(float_arg(kernel, i, kind, value)? as f32),
                ParamKind::F64 => ArgValue::F64(float_arg(kernel, i, kind, value)?),
                ParamKind::TensorMap => ArgValue::TensorMap(tensor_map_arg(kernel, i, value)?),
            })
        })
        .collect()
}
