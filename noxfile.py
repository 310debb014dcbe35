"""Developer and CI sessions.  `nox --list` shows them; each is a thin wrapper over pytest,
cargo or a script, so the same commands work without nox.

CPU sessions build a virtualenv.  `build` makes the wheel (the pinned CUDA 13.0 compiler
wheels compile the kernels); `demo` and `tests` require it and install that wheel, whose
metadata brings PyTorch and the rest from PyPI, so they run what a user installs.
`cuda_parity`, `sanitize` and `bench` run on GPU machines, which are offline with torch
preinstalled: they use the current environment as it is.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from pathlib import Path

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "venv"

ROOT = Path(__file__).parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
# Only build-time tools are named here; what batchinv needs to run or test comes from its
# metadata ([project.dependencies] and the `test` extra).
BUILD_REQUIRES = PYPROJECT["build-system"]["requires"]
NVCC_WHEELS = [
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-nvvm==13.0.*",
    "nvidia-cuda-crt==13.0.*",
    "nvidia-cuda-runtime==13.0.*",
    "nvidia-cuda-cccl==13.0.*",
]
# zig links the module against glibc 2.28's symbols, so the wheel installs where PyTorch's
# manylinux_2_28 wheels do (RHEL 8, Ubuntu 20.04) whatever glibc the build machine has.
ZIG = "ziglang==0.15.*"
MANYLINUX = "manylinux_2_28"
# AMD targets of `hip_compile`, each of which must build.  Debian 12's clang-19 (LLVM 19) knows
# both; the HIP headers and device libraries are Debian's ROCm 5.2 packages (docs/amd.md).
HIP_TARGETS = ["gfx90a", "gfx942"]
HIP_CLANG = "clang++-19"
HIP_DEVICE_LIBS = Path("/usr/lib/x86_64-linux-gnu/amdgcn/bitcode")
# Names of every kernel in kernels_cu/, for compute-sanitizer's kernel filter.
CUBLASLT_TESTS = "tests/gpu/test_linear_cublaslt_cuda.py"
OUR_KERNELS = (
    "^(embedding|linear|rms_norm|rope|silu_mul|log_softmax|attn|attention_bwd|token_logprobs"
    "|qk_norm_rope)_"
)


def _nvcc_env(session: nox.Session) -> dict[str, str]:
    """Points the kernel build at the nvcc wheel installed in this session's venv."""
    script = (
        "import nvidia, os\n"
        "for p in nvidia.__path__:\n"
        "    c = os.path.join(p, 'cu13', 'bin', 'nvcc')\n"
        "    if os.path.isfile(c): print(c); break"
    )
    nvcc = session.run("python", "-c", script, silent=True).strip()
    if not nvcc:
        session.error("nvcc from the nvidia-cuda-nvcc wheel was not found in the session")
    return {"BATCHINV_NVCC": nvcc}


def _wheel_dir(session: nox.Session) -> Path:
    """Where `build` leaves the checked wheel for the sessions that require it."""
    return Path(session.cache_dir).resolve() / "wheel"


def _install_wheel(session: nox.Session, extras: str = "", *tools: str) -> None:
    """Installs the wheel `build` made, with the dependencies (and `extras`) its metadata
    names, and any build `tools`."""
    wheels = sorted(_wheel_dir(session).glob("batchinv-*.whl"))
    if len(wheels) != 1:
        session.error(f"expected one wheel from `nox -s build` in {_wheel_dir(session)}")
    session.install(f"{wheels[0]}{extras}", *tools)
    # A reused virtualenv already has this version: replace it with the new build.
    session.install("--force-reinstall", "--no-deps", str(wheels[0]))


@nox.session(requires=["build"])
def tests(session: nox.Session) -> None:
    """CPU tests: cargo tests of the Rust crates, then pytest on the installed wheel (GPU
    tests skip without a GPU)."""
    # The kernels crate's own tests compile the kernels: they need nvcc too.
    _install_wheel(session, "[test]", *NVCC_WHEELS)
    session.run(
        "cargo",
        "test",
        "-p",
        "batchinv-runtime",
        "-p",
        "batchinv-kernels",
        external=True,
        env=_nvcc_env(session),
    )
    session.run("pytest", "tests", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint and format) for Python; cargo fmt and clippy for Rust."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("cargo", "fmt", "--all", "--check", external=True)
    session.run(
        "cargo",
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
        external=True,
        env={"BATCHINV_NO_CUDA": "1"},
    )


@nox.session
def build(session: nox.Session) -> None:
    """Builds the abi3 wheel (CUDA fatbins embedded) for manylinux_2_28 into dist/ and checks
    its tag and the glibc symbols its module needs (tools/check_wheel.py).  `demo` and `tests`
    require it, so it takes no arguments: theirs would reach it too."""
    session.install(*BUILD_REQUIRES, *NVCC_WHEELS, ZIG)
    # Built apart from dist/, which may hold older wheels, so the check sees this one only.
    out = Path(session.create_tmp()).resolve() / "wheel"
    shutil.rmtree(out, ignore_errors=True)
    session.run(
        "maturin",
        "build",
        "--release",
        "--zig",
        "--compatibility",
        MANYLINUX,
        "--out",
        str(out),
        env=_nvcc_env(session),
    )
    wheels = sorted(out.glob("batchinv-*.whl"))
    session.run("python", str(ROOT / "tools" / "check_wheel.py"), *map(str, wheels))
    shutil.rmtree(_wheel_dir(session), ignore_errors=True)
    _wheel_dir(session).mkdir(parents=True)
    (ROOT / "dist").mkdir(exist_ok=True)
    for wheel in wheels:
        shutil.copy2(wheel, _wheel_dir(session))
        shutil.copy2(wheel, ROOT / "dist")
        session.log(f"built dist/{wheel.name}")


def _isa_version(target: str) -> int:
    """The ROCm device libraries' __oclc_ISA_version of a target: gfx942 -> 9402, gfx90a -> 9010."""
    digits = target.removeprefix("gfx")
    return int(digits[:-2]) * 1000 + int(digits[-2], 16) * 100 + int(digits[-1], 16)


def _hip_device_libs(session: nox.Session, llvm_bin: Path, out: Path) -> Path:
    """A device-library directory for every HIP_TARGETS entry: Debian's ROCm 5.2 bitcode, plus,
    for targets newer than it (gfx942), the one per-target file it lacks, oclc_isa_version_<n>.bc.
    That file holds a single constant, so it is made from another target's by changing the
    value (checked against _isa_version first)."""
    if not HIP_DEVICE_LIBS.is_dir():
        session.error(f"no ROCm device libraries in {HIP_DEVICE_LIBS} (Debian: rocm-device-libs)")
    libs = out / "device-libs"
    shutil.rmtree(libs, ignore_errors=True)
    libs.mkdir(parents=True)
    for bitcode in HIP_DEVICE_LIBS.glob("*.bc"):
        (libs / bitcode.name).symlink_to(bitcode)
    template_target = "gfx900"
    template = subprocess.run(
        [llvm_bin / "llvm-dis", HIP_DEVICE_LIBS / "oclc_isa_version_900.bc", "-o", "-"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    constant = f"constant i32 {_isa_version(template_target)},"
    if template.count(constant) != 1:
        session.error(f"oclc_isa_version_900.bc does not hold one '{constant}'")
    for target in HIP_TARGETS:
        name = f"oclc_isa_version_{target.removeprefix('gfx')}.bc"
        if (libs / name).exists():
            continue
        session.log(f"{HIP_DEVICE_LIBS} has no {name}: writing it ({_isa_version(target)})")
        subprocess.run(
            [llvm_bin / "llvm-as", "-o", libs / name],
            input=template.replace(constant, f"constant i32 {_isa_version(target)},"),
            check=True,
            text=True,
        )
    return libs


@nox.session(venv_backend="none")
def hip_compile(session: nox.Session) -> None:
    """Builds batchinv-kernels with a HIP code object of every kernels_cu/*.cu for each of
    HIP_TARGETS (clang++-19, docs/amd.md), fails if any source or target does not build, and
    lists each image's kernels per target; the images are left in build/hip/."""
    clang = shutil.which(os.environ.get("BATCHINV_HIP_CLANG", HIP_CLANG))
    if clang is None:
        session.error(
            f"{HIP_CLANG} is not installed (Debian 12: apt-get install clang-19 clang-tools-19 "
            "lld-19 llvm-19 libamdhip64-dev rocm-device-libs)"
        )
    llvm_bin = Path(clang).resolve().parent
    out = ROOT / "build" / "hip"
    device_libs = _hip_device_libs(session, llvm_bin, out)
    env = {
        "BATCHINV_NO_CUDA": "1",
        "BATCHINV_HIP_ARCHS": ";".join(HIP_TARGETS),
        "BATCHINV_HIP_CLANG": clang,
        "BATCHINV_HIP_DEVICE_LIBS": str(device_libs),
    }
    # build.rs compiles the images; its output directory comes from cargo's JSON messages.
    cargo = subprocess.run(
        ["cargo", "build", "-p", "batchinv-kernels", "--message-format=json"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
        cwd=ROOT,
    )
    messages = [json.loads(line) for line in cargo.stdout.splitlines()]
    if cargo.returncode != 0:
        # A failing build script (a kernel that does not compile) is reported on stderr
        # above; Rust's own errors come only as JSON.
        for message in messages:
            if message.get("reason") == "compiler-message":
                session.log(message["message"]["rendered"])
        session.error("the HIP build of batchinv-kernels failed")
    out_dirs = [
        message["out_dir"]
        for message in messages
        if message.get("reason") == "build-script-executed"
        and "batchinv-kernels" in message["package_id"]
    ]
    if len(out_dirs) != 1:
        session.error("cargo named no build-script output directory for batchinv-kernels")
    bundler = llvm_bin / "clang-offload-bundler"
    for source in sorted((ROOT / "kernels_cu").glob("*.cu")):
        image = Path(out_dirs[0]) / f"{source.stem}.hsaco"
        if not image.is_file():
            session.error(f"build.rs made no HIP image for {source.name}")
        shutil.copy2(image, out / image.name)
        listed = subprocess.run(
            [bundler, "--list", "--type=o", f"--input={image}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        counts = []
        for target in HIP_TARGETS:
            bundle_id = f"hipv4-amdgcn-amd-amdhsa--{target}"
            if bundle_id not in listed:
                session.error(f"{image.name} holds no {target} code object ({listed})")
            code_object = out / f"{source.stem}.{target}.o"
            subprocess.run(
                [bundler, "--unbundle", "--type=o", f"--input={image}"]
                + [f"--targets={bundle_id}", f"--output={code_object}"],
                check=True,
            )
            symbols = subprocess.run(
                [llvm_bin / "llvm-readelf", "--symbols", "--wide", code_object],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            kernels = {line.split()[-1] for line in symbols.splitlines() if line.endswith(".kd")}
            counts.append(f"{target}: {len(kernels)} kernels")
        session.log(f"{source.name}: " + ", ".join(counts))


@nox.session(requires=["build"])
def demo(session: nox.Session) -> None:
    """The main job: `batchinv audit`, the transform sweep on the built-in Qwen3, stock PyTorch
    vs batchinv (on CUDA when present, with a production-shaped run too, else CPU); exits 1 if
    batchinv breaks invariance."""
    _install_wheel(session)
    session.run("batchinv", "audit", *session.posargs)


def _require_gpu(session: nox.Session) -> None:
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    if subprocess.run(["python", "-c", probe]).returncode != 0:
        session.error("this session needs an NVIDIA GPU with PyTorch's CUDA build")


@nox.session(venv_backend="none")
def cuda_parity(session: nox.Session) -> None:
    """On a GPU machine: the whole test suite (or the paths given); writes
    reports/cuda_parity/<gpu>.json."""
    _require_gpu(session)
    session.run(
        "python",
        "-m",
        "pytest",
        *(session.posargs or ["tests"]),
        "-p",
        "no:cacheprovider",
        "--parity-report",
        "reports/cuda_parity/{gpu}.json",
        external=True,
    )


@nox.session(venv_backend="none")
def sanitize(session: nox.Session) -> None:
    """On a GPU machine: the GPU tests (or the paths given) under compute-sanitizer memcheck,
    then racecheck."""
    _require_gpu(session)
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        session.error("compute-sanitizer is not on PATH")
    for tool in ("memcheck", "racecheck"):
        # racecheck tracks shared memory on the host for every kernel; over the whole suite,
        # PyTorch's kernels included, it ran out of 128 GB on an H200 machine, so it checks
        # batchinv's own kernels only.
        only_ours = ["--kernel-name", f"regex={OUR_KERNELS}"] if tool == "racecheck" else []
        # racecheck fails inside cuBLASLt's own cluster kernel (reports/sanitize/
        # nvidia-h200-cublaslt.md), so the pinned-cuBLASLt tests run under memcheck only.
        skip = ["--ignore", CUBLASLT_TESTS] if tool == "racecheck" else []
        session.run(
            sanitizer,
            "--tool",
            tool,
            *only_ours,
            "--error-exitcode",
            "1",
            "--target-processes",
            "all",
            "python",
            "-m",
            "pytest",
            *(session.posargs or ["tests/gpu"]),
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "-m",
            "not provokes_driver_error",
            *skip,
            env={"BATCHINV_QUICK": "1"},
            external=True,
        )


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """On a GPU machine: every benchmarks/bench_*.py -> benchmarks/results/<op>.json (GPU,
    versions, commit, a uniform summary of ratios), then tools/plot_benchmarks.py draws
    benchmarks/results/ratios.png (needs matplotlib)."""
    _require_gpu(session)
    failed = []
    for script in sorted(glob.glob(str(ROOT / "benchmarks" / "bench_*.py"))):
        name = Path(script).stem.removeprefix("bench_")
        try:
            session.run(
                "python", script, "--json", f"benchmarks/results/{name}.json", external=True
            )
        except nox.command.CommandFailed:
            failed.append(name)  # the other benchmarks still run; the session fails below
    session.run("python", str(ROOT / "tools" / "plot_benchmarks.py"), external=True)
    if failed:
        session.error(f"benchmarks failed: {', '.join(failed)}")
