//! Run-time compilation of CUDA C++ source with NVRTC, opened with `dlopen`.

use crate::error::{Error, Result};
use libloading::Library;
use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_int, c_void};

type NvrtcResult = c_int;
type Program = *mut c_void;

unsafe fn symbol<T: Copy>(library: &Library, name: &str) -> Result<T> {
    let symbol = library.get::<T>(name.as_bytes()).map_err(|e| Error::Unavailable {
        backend: "NVRTC",
        reason: format!("the NVRTC library has no symbol {name}: {e}"),
    })?;
    Ok(*symbol)
}

fn open(path: Option<&str>) -> Result<Library> {
    let candidates: Vec<&str> = match path {
        Some(path) => vec![path],
        None => vec!["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"],
    };
    let mut reasons = Vec::new();
    for name in &candidates {
        match unsafe { Library::new(name) } {
            Ok(library) => return Ok(library),
            Err(e) => reasons.push(format!("{name}: {e}")),
        }
    }
    Err(Error::Unavailable {
        backend: "NVRTC",
        reason: format!("the NVRTC library could not be loaded ({})", reasons.join("; ")),
    })
}

/// Compiles `source` to a cubin with NVRTC (`options` as for nvcc, e.g. `--gpu-architecture=sm_90`).
pub fn compile_cuda_source(
    library_path: Option<&str>,
    source: &str,
    name: &str,
    options: &[String],
) -> Result<Vec<u8>> {
    let library = open(library_path)?;
    unsafe {
        let create: unsafe extern "C" fn(
            *mut Program,
            *const c_char,
            *const c_char,
            c_int,
            *const *const c_char,
            *const *const c_char,
        ) -> NvrtcResult = symbol(&library, "nvrtcCreateProgram")?;
        let compile: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> NvrtcResult =
            symbol(&library, "nvrtcCompileProgram")?;
        let log_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult =
            symbol(&library, "nvrtcGetProgramLogSize")?;
        let get_log: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult =
            symbol(&library, "nvrtcGetProgramLog")?;
        let cubin_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult =
            symbol(&library, "nvrtcGetCUBINSize")?;
        let get_cubin: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult = symbol(&library, "nvrtcGetCUBIN")?;
        let destroy: unsafe extern "C" fn(*mut Program) -> NvrtcResult = symbol(&library, "nvrtcDestroyProgram")?;
        let error_string: unsafe extern "C" fn(NvrtcResult) -> *const c_char = symbol(&library, "nvrtcGetErrorString")?;

        let describe = |code: NvrtcResult, call: &str| {
            let text = error_string(code);
            let text = if text.is_null() { "unknown".into() } else { CStr::from_ptr(text).to_string_lossy() };
            Error::Compile(format!("{call} failed: {text}"))
        };
        let c_source = CString::new(source).map_err(|_| Error::Invalid("source contains a NUL byte".into()))?;
        let c_name = CString::new(name).map_err(|_| Error::Invalid("name contains a NUL byte".into()))?;
        let c_options: Vec<CString> = options
            .iter()
            .map(|o| CString::new(o.as_str()).map_err(|_| Error::Invalid(format!("option {o:?} contains a NUL byte"))))
            .collect::<Result<_>>()?;
        let option_ptrs: Vec<*const c_char> = c_options.iter().map(|o| o.as_ptr()).collect();

        let mut program: Program = std::ptr::null_mut();
        let code = create(&mut program, c_source.as_ptr(), c_name.as_ptr(), 0, std::ptr::null(), std::ptr::null());
        if code != 0 {
            return Err(describe(code, "nvrtcCreateProgram"));
        }
        let compiled = compile(program, option_ptrs.len() as c_int, option_ptrs.as_ptr());
        let result = if compiled != 0 {
            let mut size = 0usize;
            log_size(program, &mut size);
            let mut log = vec![0u8; size.max(1)];
            get_log(program, log.as_mut_ptr() as *mut c_char);
            let log = String::from_utf8_lossy(&log).trim_end_matches('\0').to_string();
            Err(Error::Compile(log))
        } else {
            let mut size = 0usize;
            let code = cubin_size(program, &mut size);
            if code != 0 {
                Err(describe(code, "nvrtcGetCUBINSize"))
            } else {
                let mut cubin = vec![0u8; size];
                let code = get_cubin(program, cubin.as_mut_ptr() as *mut c_char);
                if code != 0 {
                    Err(describe(code, "nvrtcGetCUBIN"))
                } else {
                    Ok(cubin)
                }
            }
        };
        destroy(&mut program);
        result
    }
}
