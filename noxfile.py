"""Developer and CI sessions.  `nox --list` shows them; each is a thin wrapper over pytest,
cargo or a script, so the same commands work without nox.

CPU sessions build a virtualenv and install what they need (torch from PyPI, the pinned
CUDA 13.0 compiler wheels).  `cuda_parity`, `sanitize` and `bench` run on GPU machines,
which are offline with torch preinstalled: they use the current environment as it is.
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
TORCH = "torch>=2.4"
TEST_DEPS = ["pytest>=8", "transformers>=4.51", "safetensors", "numpy"]
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


def _install_batchinv(session: nox.Session, *extra: str) -> dict[str, str]:
    session.install(TORCH, "maturin>=1.7,<2", *NVCC_WHEELS, *extra)
    env = _nvcc_env(session)
    session.run("pip", "install", "--no-build-isolation", "--no-deps", "-e", ".", env=env)
    return env


@nox.session
def tests(session: nox.Session) -> None:
    """CPU tests: cargo tests of the Rust crates, then pytest (GPU tests skip without a GPU)."""
    env = _install_batchinv(session, *TEST_DEPS)
    session.run(
        "cargo", "test", "-p", "batchinv-runtime", "-p", "batchinv-kernels", external=True, env=env
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
    its tag and the glibc symbols its module needs (tools/check_wheel.py)."""
    session.install("maturin>=1.7,<2", *NVCC_WHEELS, ZIG)
    # Built apart from dist/, which may hold older wheels, so the check sees this one only.
    out = Path(session.create_tmp()) / "wheel"
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
        *session.posargs,
        env=_nvcc_env(session),
    )
    wheels = sorted(out.glob("batchinv-*.whl"))
    session.run("python", str(ROOT / "tools" / "check_wheel.py"), *map(str, wheels))
    (ROOT / "dist").mkdir(exist_ok=True)
    for wheel in wheels:
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


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: `batchinv audit`, the transform sweep on the built-in Qwen3, stock PyTorch
    vs batchinv (on CUDA when present, else CPU); exits 1 if batchinv breaks invariance."""
    _install_batchinv(session, "safetensors")
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
