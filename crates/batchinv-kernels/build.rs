//! Compiles every `kernels_cu/<op>.cu` into an embedded image and writes the module table.
//!
//! Environment (all optional):
//! - `BATCHINV_CUDA_ARCHS`  SASS targets, `;`-separated (default `80;90a`); PTX for the
//!   lowest target is added so newer GPUs can JIT it.  Never probed from a GPU.
//! - `BATCHINV_NVCC`        the nvcc to use (default: `nvcc` on PATH, `$CUDA_HOME/bin`, then
//!   the `nvidia-cuda-nvcc` wheel of the Python that `PYO3_PYTHON` or `python3` names).
//! - `BATCHINV_NO_CUDA=1`   build without CUDA images; GPU ops then raise at run time.
//! - `BATCHINV_HIP_ARCHS`   also build AMD code objects, e.g. `gfx90a;gfx942`, one offload
//!   bundle per source compiled as HIP by clang's driver (docs/amd.md).
//! - `BATCHINV_HIP_CLANG`   the clang++ that compiles them (default `clang++-19`): its AMDGPU
//!   target, HIP headers and ROCm device libraries are found the way clang finds them.
//! - `BATCHINV_HIP_DEVICE_LIBS` the ROCm device-library bitcode directory, where clang's own
//!   search finds none for a target (default: clang's search).
//! - `CC`                   the C compiler whose preprocessor expands each source's macros
//!   before its kernel declarations are read (default `cc`).
//!
//! Every kernel's signature comes from its `extern "C" __global__` declaration (macro-made
//! ones after preprocessing); a CUDA build checks them against the PTX entries nvcc emits and
//! fails, naming the file and kernel, where they disagree (build_support/signatures.rs).

#[path = "build_support/signatures.rs"]
mod signatures;

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const DEFAULT_CUDA_ARCHS: &str = "80;90a";
const DEFAULT_HIP_CLANG: &str = "clang++-19";
const NVCC_HELP: &str = "nvcc was not found. Install the pinned CUDA 13.0 compiler wheels:\n    \
    pip install nvidia-cuda-nvcc==13.0.88 'nvidia-nvvm==13.0.*' 'nvidia-cuda-crt==13.0.*' \
    'nvidia-cuda-runtime==13.0.*' 'nvidia-cuda-cccl==13.0.*'\n\
    or point BATCHINV_NVCC at an nvcc, or set BATCHINV_NO_CUDA=1 for a CPU-only build.";

struct Source {
    op: String,
    path: PathBuf,
    kernels: Vec<signatures::KernelSignature>,
}

fn main() {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let kernels_dir = manifest_dir.join("../../kernels_cu").canonicalize().expect("kernels_cu/ not found");
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    for var in [
        "BATCHINV_CUDA_ARCHS",
        "BATCHINV_NVCC",
        "BATCHINV_NO_CUDA",
        "BATCHINV_HIP_ARCHS",
        "BATCHINV_HIP_CLANG",
        "BATCHINV_HIP_DEVICE_LIBS",
        "CUDA_HOME",
        "PYO3_PYTHON",
        "CC",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed={}", kernels_dir.display());

    let sources = read_sources(&kernels_dir, &out_dir);
    let no_cuda = env::var("BATCHINV_NO_CUDA").map(|v| v == "1").unwrap_or(false);
    let cuda_archs = env::var("BATCHINV_CUDA_ARCHS").unwrap_or_else(|_| DEFAULT_CUDA_ARCHS.to_string());
    let hip_archs = env::var("BATCHINV_HIP_ARCHS").unwrap_or_default();

    let (nvcc_version, cuda_images) = if no_cuda {
        (String::new(), vec![None; sources.len()])
    } else {
        let nvcc = find_nvcc().unwrap_or_else(|| panic!("{NVCC_HELP}"));
        let version = tool_version(&nvcc);
        let args = cuda_arch_args(&cuda_archs);
        let images = compile_all(&sources, |source| compile_cuda(&nvcc, &args, &kernels_dir, source, &out_dir));
        (version, images.into_iter().map(Some).collect())
    };
    let hip_images = if hip_archs.trim().is_empty() {
        vec![None; sources.len()]
    } else {
        let clang = env::var("BATCHINV_HIP_CLANG").unwrap_or_else(|_| DEFAULT_HIP_CLANG.to_string());
        let device_libs = env::var_os("BATCHINV_HIP_DEVICE_LIBS").map(PathBuf::from);
        let images = compile_all(&sources, |source| {
            compile_hip(&clang, device_libs.as_deref(), &hip_archs, &kernels_dir, source, &out_dir)
        });
        images.into_iter().map(Some).collect()
    };

    let table = module_table(
        &sources,
        &cuda_images,
        &hip_images,
        &BuildInfoText { cuda_archs: if no_cuda { String::new() } else { cuda_archs }, nvcc_version, hip_archs },
    );
    fs::write(out_dir.join("module_table.rs"), table).unwrap();
}

fn read_sources(kernels_dir: &Path, out_dir: &Path) -> Vec<Source> {
    let mut paths: Vec<PathBuf> = fs::read_dir(kernels_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    paths.sort();
    let stubs = write_header_stubs(kernels_dir, out_dir);
    paths
        .into_iter()
        .map(|path| {
            let text = preprocess(&path, kernels_dir, &stubs);
            let kernels = signatures::parse_signatures(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let op = path.file_stem().unwrap().to_string_lossy().into_owned();
            Source { op, path, kernels }
        })
        .collect()
}

/// An empty file for every `#include <...>` under kernels_cu/: reading the declarations needs
/// the sources' own macros only, so no CUDA, HIP or C++ headers have to be installed.
fn write_header_stubs(kernels_dir: &Path, out_dir: &Path) -> PathBuf {
    let stubs = out_dir.join("header_stubs");
    let mut pending = vec![kernels_dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
                continue;
            }
            let Ok(text) = fs::read_to_string(&path) else { continue };
            for line in text.lines() {
                let line = line.trim_start();
                let Some(rest) = line.strip_prefix('#') else { continue };
                let Some(rest) = rest.trim_start().strip_prefix("include") else { continue };
                let rest = rest.trim_start();
                if let Some(header) = rest.strip_prefix('<').and_then(|r| r.split('>').next()) {
                    let stub = stubs.join(header);
                    fs::create_dir_all(stub.parent().unwrap()).unwrap();
                    fs::write(stub, "").unwrap();
                }
            }
        }
    }
    fs::create_dir_all(&stubs).unwrap();
    stubs
}

/// The source after the C preprocessor, as the CUDA host compilation sees it (no
/// `__CUDA_ARCH__`, no `__HIPCC__`): every kernel a CUDA image exports is declared there.
fn preprocess(source: &Path, kernels_dir: &Path, stubs: &Path) -> String {
    let cc = env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let output = Command::new(&cc)
        .args(["-E", "-P", "-x", "c", "-std=c11", "-nostdinc", "-I"])
        .arg(stubs)
        .arg("-I")
        .arg(kernels_dir)
        .arg(source)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C preprocessor '{cc} -E' (set CC to a C compiler): {e}"));
    if !output.status.success() {
        panic!(
            "preprocessing {} to read its kernel declarations failed:\n{}",
            source.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    String::from_utf8(output.stdout).expect("preprocessed source is not UTF-8")
}

fn find_nvcc() -> Option<PathBuf> {
    if let Ok(path) = env::var("BATCHINV_NVCC") {
        return Some(PathBuf::from(path));
    }
    if let Some(path) =
        env::var_os("PATH").and_then(|p| env::split_paths(&p).map(|d| d.join("nvcc")).find(|p| p.is_file()))
    {
        return Some(path);
    }
    if let Ok(home) = env::var("CUDA_HOME") {
        let path = Path::new(&home).join("bin/nvcc");
        if path.is_file() {
            return Some(path);
        }
    }
    // The nvidia-cuda-nvcc wheel puts nvcc under site-packages/nvidia/cu13/bin.
    let python = env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let script = "import nvidia, os\nfor p in nvidia.__path__:\n    c = os.path.join(p, 'cu13', 'bin', 'nvcc')\n    \
                  if os.path.isfile(c): print(c); break";
    let output = Command::new(python).args(["-c", script]).output().ok()?;
    let path = String::from_utf8_lossy(&output.stdout).trim().to_string();
    (!path.is_empty()).then(|| PathBuf::from(path))
}

fn tool_version(tool: &Path) -> String {
    let output =
        Command::new(tool).arg("--version").output().unwrap_or_else(|e| panic!("cannot run {}: {e}", tool.display()));
    let text = String::from_utf8_lossy(&output.stdout);
    text.lines().find(|l| l.contains("release")).unwrap_or("unknown").trim().to_string()
}

/// `80;90a` -> SASS for sm_80 and sm_90a, plus compute_80 PTX (arch-specific `a` targets
/// have no forward-compatible PTX).
fn cuda_arch_args(archs: &str) -> Vec<String> {
    let archs: Vec<&str> = archs.split([';', ',']).map(str::trim).filter(|a| !a.is_empty()).collect();
    assert!(!archs.is_empty(), "BATCHINV_CUDA_ARCHS is empty");
    let mut args: Vec<String> = archs.iter().map(|a| format!("-gencode=arch=compute_{a},code=sm_{a}")).collect();
    if let Some(ptx) = archs.iter().find(|a| !a.ends_with('a')) {
        args.push(format!("-gencode=arch=compute_{ptx},code=compute_{ptx}"));
    }
    args
}

fn compile_all(sources: &[Source], compile: impl Fn(&Source) -> PathBuf + Sync) -> Vec<PathBuf> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = sources.iter().map(|s| scope.spawn(|| compile(s))).collect();
        handles.into_iter().map(|h| h.join().expect("kernel compilation panicked")).collect()
    })
}

fn run(command: &mut Command, what: &str, report: &Path) {
    let output = command.output().unwrap_or_else(|e| panic!("cannot start the compiler for {what}: {e}"));
    fs::write(report, [&output.stdout[..], &output.stderr[..]].concat()).unwrap();
    if !output.status.success() {
        panic!(
            "compiling {what} failed:\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

fn compile_cuda(nvcc: &Path, arch_args: &[String], kernels_dir: &Path, source: &Source, out_dir: &Path) -> PathBuf {
    let image = out_dir.join(format!("{}.fatbin", source.op));
    // nvcc's intermediate files hold the PTX of every target, whose entries are checked below.
    let keep = out_dir.join(format!("{}.keep", source.op));
    let _ = fs::remove_dir_all(&keep);
    fs::create_dir_all(&keep).unwrap();
    // No fast-math: every kernel keeps IEEE rounding so paths that must agree do.
    let mut command = Command::new(nvcc);
    command
        .args(["-fatbin", "-O3", "-std=c++17", "-Xptxas", "-v", "-lineinfo", "--keep", "--keep-dir"])
        .arg(&keep)
        .args(arch_args)
        .arg("-I")
        .arg(kernels_dir)
        .arg(&source.path)
        .arg("-o")
        .arg(&image);
    run(&mut command, &source.path.display().to_string(), &out_dir.join(format!("{}.ptxas.txt", source.op)));
    check_ptx_entries(source, &keep);
    fs::remove_dir_all(&keep).unwrap();
    image
}

/// Fails the build unless every PTX image nvcc made for `source` exports exactly its declared
/// kernels with parameters of the declared sizes.
fn check_ptx_entries(source: &Source, keep: &Path) {
    let mut ptx_files: Vec<PathBuf> = fs::read_dir(keep)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "ptx"))
        .collect();
    ptx_files.sort();
    assert!(!ptx_files.is_empty(), "nvcc kept no PTX for {} in {}", source.path.display(), keep.display());
    let mut report = String::new();
    for ptx in &ptx_files {
        let target = ptx.file_stem().unwrap().to_string_lossy();
        let target = target.strip_prefix(&format!("{}.", source.op)).unwrap_or(&target).to_string();
        let text = fs::read_to_string(ptx).unwrap();
        let entries = signatures::parse_ptx_entries(&text).unwrap_or_else(|e| panic!("{}: {e}", ptx.display()));
        for problem in signatures::check_image(&source.kernels, &entries) {
            writeln!(report, "  {target} PTX: {problem}").unwrap();
        }
    }
    if !report.is_empty() {
        panic!("{}: the kernel declarations and the compiled image disagree:\n{report}", source.path.display());
    }
}

/// One offload bundle (the format hipModuleLoadData reads) holding a code object per target;
/// any target clang cannot build fails the build.
fn compile_hip(
    clang: &str,
    device_libs: Option<&Path>,
    archs: &str,
    kernels_dir: &Path,
    source: &Source,
    out_dir: &Path,
) -> PathBuf {
    let image = out_dir.join(format!("{}.hsaco", source.op));
    let mut command = Command::new(clang);
    command.args(["-x", "hip", "--offload-device-only", "-O3", "-std=c++17"]);
    for arch in archs.split([';', ',']).map(str::trim).filter(|a| !a.is_empty()) {
        command.arg(format!("--offload-arch={arch}"));
    }
    if let Some(dir) = device_libs {
        command.arg(format!("--rocm-device-lib-path={}", dir.display()));
    }
    command.arg("-I").arg(kernels_dir).arg(&source.path).arg("-o").arg(&image);
    run(&mut command, &format!("{} for HIP", source.path.display()), &out_dir.join(format!("{}.hip.txt", source.op)));
    image
}

struct BuildInfoText {
    cuda_archs: String,
    nvcc_version: String,
    hip_archs: String,
}

fn image_expr(image: &Option<PathBuf>) -> String {
    match image {
        Some(path) => format!("Some(include_bytes!({:?}))", path.display().to_string()),
        None => "None".to_string(),
    }
}

fn module_table(sources: &[Source], cuda: &[Option<PathBuf>], hip: &[Option<PathBuf>], info: &BuildInfoText) -> String {
    let mut out = String::from("// Generated by build.rs from kernels_cu/*.cu. Do not edit.\n");
    writeln!(out, "pub static MODULES: &[EmbeddedModule] = &[").unwrap();
    for ((source, cuda), hip) in sources.iter().zip(cuda).zip(hip) {
        writeln!(
            out,
            "    EmbeddedModule {{ name: {:?}, cuda_image: {}, hip_image: {}, kernels: &[",
            source.op,
            image_expr(cuda),
            image_expr(hip)
        )
        .unwrap();
        for kernel in &source.kernels {
            writeln!(
                out,
                "        EmbeddedKernel {{ name: {:?}, signature: {:?} }},",
                kernel.name,
                kernel.params.join(", ")
            )
            .unwrap();
        }
        writeln!(out, "    ] }},").unwrap();
    }
    writeln!(out, "];").unwrap();
    writeln!(
        out,
        "pub static BUILD_INFO: BuildInfo = BuildInfo {{ cuda_archs: {:?}, nvcc_version: {:?}, hip_archs: {:?} }};",
        info.cuda_archs, info.nvcc_version, info.hip_archs
    )
    .unwrap();
    out
}
