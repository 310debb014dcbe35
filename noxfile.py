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
HIP_TARGETS = ["gfx90a", "gfx942"]
# Names of every kernel in kernels_cu/, for compute-sanitizer's kernel filter.
CUBLASLT_TESTS = "tests/gpu/test_linear_cublaslt_cuda.py"
OUR_KERNELS = (
    "^(embedding|linear|rms_norm|rope|silu_mul|log_softmax|attn|attention_bwd|token_logprobs)_"
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


@nox.session(venv_backend="none")
def hip_compile(session: nox.Session) -> None:
    """Compiles every kernels_cu/*.cu with hipcc for AMD targets and embeds them in a Rust build."""
    hipcc = shutil.which("hipcc")
    if hipcc is None:
        session.error("hipcc is not installed (Debian: apt-get install hipcc)")
    out = ROOT / "build" / "hip"
    out.mkdir(parents=True, exist_ok=True)
    env = {"HIP_PLATFORM": "amd"}
    supported = []
    probe_source = out / "probe.hip"  # hipcc finds its ROCm paths only for file inputs
    probe_source.write_text("__global__ void probe() {}\n")
    for target in HIP_TARGETS:
        probe = subprocess.run(
            [hipcc, "--genco", f"--offload-arch={target}", "-x", "hip", str(probe_source)]
            + ["-o", str(out / "probe.hsaco")],
            text=True,
            capture_output=True,
            env={**os.environ, **env},
        )
        if probe.returncode == 0:
            supported.append(target)
        else:
            session.log(
                f"this hipcc cannot target {target}; skipping it ({probe.stderr.strip()[:200]})"
            )
    if not supported:
        session.error("hipcc supports none of " + ", ".join(HIP_TARGETS))
    for source in sorted(glob.glob(str(ROOT / "kernels_cu" / "*.cu"))):
        name = Path(source).stem
        arch_flags = [f"--offload-arch={t}" for t in supported]
        session.run(
            hipcc,
            "--genco",
            *arch_flags,
            "-O3",
            "-std=c++17",
            "-x",
            "hip",
            "-I",
            str(ROOT / "kernels_cu"),
            source,
            "-o",
            str(out / f"{name}.hsaco"),
            env=env,
            external=True,
        )
    session.run(
        "cargo",
        "build",
        "-p",
        "batchinv-kernels",
        external=True,
        env={"BATCHINV_NO_CUDA": "1", "BATCHINV_HIP_ARCHS": ";".join(supported)},
    )


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
