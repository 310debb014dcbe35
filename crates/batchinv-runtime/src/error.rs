use std::fmt;

pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong between a launch request and the driver.
#[derive(Debug, Clone, PartialEq)]
pub enum Error {
    /// The backend's library could not be loaded or has no usable device.
    Unavailable { backend: &'static str, reason: String },
    /// A driver call returned an error code.
    Driver {
        backend: &'static str,
        call: &'static str,
        code: i32,
        name: String,
        message: String,
        kernel: Option<String>,
    },
    /// Arguments do not match the kernel's declared signature.
    Signature(String),
    /// Grid, block or shared-memory request outside the limits.
    Config(String),
    /// A kernel name that the module does not contain, or a malformed request.
    Invalid(String),
    /// Run-time compilation failed; carries the compiler log.
    Compile(String),
}

impl Error {
    /// Attaches the kernel's name to a driver error, so the message says which launch failed.
    pub fn for_kernel(self, kernel: &str) -> Self {
        match self {
            Error::Driver { backend, call, code, name, message, kernel: None } => {
                Error::Driver { backend, call, code, name, message, kernel: Some(kernel.to_string()) }
            }
            other => other,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Unavailable { backend, reason } => {
                write!(f, "{backend} is not available: {reason}")
            }
            Error::Driver { backend, call, code, name, message, kernel } => {
                if let Some(kernel) = kernel {
                    write!(f, "kernel '{kernel}': ")?;
                }
                write!(f, "{backend} error {name} ({code}) in {call}: {message}")
            }
            Error::Signature(msg) | Error::Config(msg) | Error::Invalid(msg) => f.write_str(msg),
            Error::Compile(log) => write!(f, "run-time compilation failed:\n{log}"),
        }
    }
}

impl std::error::Error for Error {}
