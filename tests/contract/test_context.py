"""deterministic_context: strict settings inside, every setting and RNG state restored outside."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from batchinv.contract import deterministic_context


def _read(getter):
    try:
        return getter()
    except RuntimeError:  # torch refuses when legacy and new precision APIs were mixed
        return "unreadable"


def _settings() -> dict:
    state = {
        "cuda_matmul_allow_tf32": _read(lambda: torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": _read(lambda: torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": _read(torch.get_float32_matmul_precision),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cublas_env": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "autocast_cpu": torch.is_autocast_enabled("cpu"),
        "autocast_cuda": torch.is_autocast_enabled("cuda"),
    }
    for backend, op in (("cuda", "matmul"), ("cudnn", "conv"), ("mkldnn", "matmul")):
        knob = getattr(getattr(torch.backends, backend), op, None)
        if knob is not None and hasattr(knob, "fp32_precision"):
            state[f"{backend}.{op}.fp32_precision"] = knob.fp32_precision
    return state


def _rng_fingerprint() -> tuple:
    """Draws from each RNG without consuming the caller's stream (states are put back)."""
    torch_state, py_state, np_state = (
        torch.get_rng_state(),
        random.getstate(),
        np.random.get_state(),
    )
    draws = (torch.rand(4).tolist(), random.random(), float(np.random.rand()))
    torch.set_rng_state(torch_state)
    random.setstate(py_state)
    np.random.set_state(np_state)
    return draws


@pytest.fixture
def lax_settings():
    """Puts the process into the least strict state we can, then restores it."""
    saved = (
        torch.get_float32_matmul_precision(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.benchmark,
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None),
    )
    torch.set_float32_matmul_precision("medium")  # also lets cuBLAS use TF32
    torch.backends.cudnn.allow_tf32 = True
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cuda.matmul.allow_tf32 = saved[1]
    torch.backends.cudnn.allow_tf32 = saved[2]
    torch.use_deterministic_algorithms(saved[3], warn_only=saved[4])
    torch.backends.cudnn.benchmark = saved[5]
    if saved[6] is not None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved[6]


def test_lax_fixture_is_lax(lax_settings):
    state = _settings()
    assert state["float32_matmul_precision"] == "medium"
    assert state["cuda_matmul_allow_tf32"] is True
    assert state["cudnn_allow_tf32"] is True
    assert state["deterministic"] is False


def test_strict_settings_inside(lax_settings):
    with deterministic_context():
        assert torch.backends.cuda.matmul.allow_tf32 is False
        assert torch.backends.cudnn.allow_tf32 is False
        assert torch.get_float32_matmul_precision() == "highest"
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.backends.cudnn.benchmark is False


def test_autocast_is_off_inside_an_enclosing_autocast():
    a = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16, "sanity: autocast is on out here"
        with deterministic_context():
            assert not torch.is_autocast_enabled("cpu")
            assert (a @ a).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu")


def test_everything_restored_on_exit(lax_settings):
    before, rng_before = _settings(), _rng_fingerprint()
    with deterministic_context(seed=7):
        assert _settings() != before
        torch.rand(10)  # consume the seeded streams
        random.random()
        np.random.rand()
    assert _settings() == before
    assert _rng_fingerprint() == rng_before


def test_everything_restored_after_an_exception(lax_settings):
    before, rng_before = _settings(), _rng_fingerprint()
    with pytest.raises(ZeroDivisionError), deterministic_context(seed=3):
        torch.rand(3)
        raise ZeroDivisionError
    assert _settings() == before
    assert _rng_fingerprint() == rng_before


def test_existing_cublas_config_and_warn_only_are_kept(lax_settings):
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
    torch.use_deterministic_algorithms(False, warn_only=True)
    try:
        with deterministic_context():
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
            assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG")
        torch.use_deterministic_algorithms(False, warn_only=False)


def test_seeds_are_fixed(lax_settings):
    with deterministic_context(seed=5):
        first = (torch.rand(3).tolist(), random.random(), float(np.random.rand()))
    torch.rand(100)  # move the outer streams; the context must not care
    with deterministic_context(seed=5):
        second = (torch.rand(3).tolist(), random.random(), float(np.random.rand()))
    with deterministic_context(seed=6):
        third = torch.rand(3).tolist()
    assert first == second
    assert third != first[0]


def test_nesting_restores_each_level(lax_settings):
    before = _settings()
    with deterministic_context():
        inner_before = _settings()
        with deterministic_context(seed=1):
            pass
        assert _settings() == inner_before
    assert _settings() == before


def test_usable_as_decorator(lax_settings):
    @deterministic_context(seed=2)
    def strict_precision():
        return torch.get_float32_matmul_precision()

    assert strict_precision() == "highest"
    assert torch.get_float32_matmul_precision() == "medium"


def test_restores_a_state_set_through_the_new_precision_api():
    knob = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if knob is None:
        pytest.skip("this torch has no per-backend fp32_precision API")
    saved = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        before = _settings()
        with deterministic_context():
            assert torch.backends.cuda.matmul.allow_tf32 is False
            assert torch.get_float32_matmul_precision() == "highest"
        assert _settings() == before
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        torch.backends.cuda.matmul.fp32_precision = saved
