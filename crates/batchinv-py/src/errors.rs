//! Runtime errors as Python exceptions: wrong arguments are TypeError, bad launch shapes
//! ValueError, and GPU-side failures subclasses of `batchinv._native.BatchinvError`.

use batchinv_runtime::Error;
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::PyErr;

create_exception!(_native, BatchinvError, PyRuntimeError, "Base class of batchinv's GPU errors.");
create_exception!(_native, BackendUnavailableError, BatchinvError, "The GPU driver or device is not available.");
create_exception!(_native, DriverError, BatchinvError, "A GPU driver call failed.");
create_exception!(_native, CompileError, BatchinvError, "Run-time compilation failed.");
create_exception!(_native, KernelsNotBuiltError, BatchinvError, "This build has no kernels for the backend.");

pub fn to_py_err(error: Error) -> PyErr {
    let message = error.to_string();
    match error {
        Error::Unavailable { .. } => BackendUnavailableError::new_err(message),
        Error::Driver { .. } => DriverError::new_err(message),
        Error::Signature(_) => PyTypeError::new_err(message),
        Error::Config(_) | Error::Invalid(_) => PyValueError::new_err(message),
        Error::Compile(_) => CompileError::new_err(message),
    }
}
