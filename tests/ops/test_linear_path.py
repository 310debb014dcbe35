"""The switch between batchinv's GEMM kernels and cuBLASLt's pinned algorithm
(``BATCHINV_LINEAR_PATH``, ``batchinv.set_linear_path``, ``batchinv.linear_path``) and the
self-check's logic, on the CPU: cuBLASLt and the GPU kernels are replaced by stand-ins, so what
is tested here is which path is chosen, when it errors, what is recorded, and that a decision
is kept for the process.  tests/gpu/test_linear_cublaslt_cuda.py runs the same cases on the
real kernels and compares bits."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import batchinv
from batchinv.gpu import linear as gpu_linear
from batchinv.gpu import linear_cublaslt as lc

MIN = lc.MIN_ROWS


@pytest.fixture(autouse=True)
def fresh_switch(monkeypatch):
    """Every test starts with no setting, an unread environment and no checked shapes."""
    for name in (lc.PATH_ENV, lc.LEGACY_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(lc, "_chosen", None)
    monkeypatch.setattr(lc, "_CHECKED", {})
    monkeypatch.setattr(lc, "_REFUSED", {})
    lc.path_from_environment.cache_clear()
    yield
    lc.path_from_environment.cache_clear()


def _exact_matmul(x, w, family=None):
    return (x.double() @ w.double().T).to(x.dtype)


class FakeCublasLt:
    """Stands in for the GPU: a usable library, a plan for every M, and a pinned algorithm
    that computes what ``_exact_matmul`` computes, optionally with one bit flipped."""

    def __init__(self, monkeypatch, *, flip_in_probe: int | None = None):
        self.self_checks = 0
        self.probe_rows: list[int] = []
        self.flip_in_probe = flip_in_probe
        monkeypatch.setattr(lc, "uses_hopper", lambda device: True)
        monkeypatch.setattr(lc, "_library_error", lambda index: None)
        monkeypatch.setattr(lc, "_plan", lambda *args: "plan")
        monkeypatch.setattr(lc, "_run", self._run)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        monkeypatch.setattr(gpu_linear, "matmul_nt", _exact_matmul)  # batchinv's kernel
        real_self_check = lc._self_check

        def counting_self_check(weight, matmul):
            self.self_checks += 1
            return real_self_check(weight, matmul)

        monkeypatch.setattr(lc, "_self_check", counting_self_check)

    def _run(self, x, weight, out, plan):
        self.probe_rows.append(x.shape[0])
        out.copy_(_exact_matmul(x, weight))
        if x.shape[0] == self.flip_in_probe:
            out.view(torch.int16)[-1, 0] ^= 1
        return out


def _weight(n=16, k=32, dtype=torch.bfloat16):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(0)).to(dtype)


# ----------------------------------------------------------------------------- the switch


def test_default_is_auto_and_the_environment_is_read_once(monkeypatch):
    assert lc.configured_path() == "auto"
    monkeypatch.setenv(lc.PATH_ENV, "own")
    assert lc.configured_path() == "auto", "the environment is read once per process"
    lc.path_from_environment.cache_clear()
    assert lc.configured_path() == "own"


@pytest.mark.parametrize("value", ("own", "cublaslt", "auto"))
def test_environment_values(monkeypatch, value):
    monkeypatch.setenv(lc.PATH_ENV, value)
    assert lc.configured_path() == value


@pytest.mark.parametrize("value", ("", "OWN", "cublas", "0", "kernels"))
def test_a_bad_environment_value_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv(lc.PATH_ENV, value)
    with pytest.raises(ValueError, match=r"BATCHINV_LINEAR_PATH must be one of 'auto', 'own'"):
        lc.configured_path()


def test_the_earlier_switch_still_selects_own_and_conflicts_are_errors(monkeypatch):
    monkeypatch.setenv(lc.LEGACY_ENV, "0")
    assert lc.configured_path() == "own"
    lc.path_from_environment.cache_clear()
    monkeypatch.setenv(lc.PATH_ENV, "cublaslt")
    with pytest.raises(ValueError, match="BATCHINV_LINEAR_CUBLASLT=0"):
        lc.configured_path()


def test_set_linear_path_takes_precedence_and_none_restores_the_environment(monkeypatch):
    monkeypatch.setenv(lc.PATH_ENV, "cublaslt")
    batchinv.set_linear_path("own")
    assert lc.configured_path() == "own"
    batchinv.set_linear_path(None)
    assert lc.configured_path() == "cublaslt"
    with pytest.raises(ValueError, match="the linear path must be one of"):
        batchinv.set_linear_path("fast")
    assert lc.configured_path() == "cublaslt", "a rejected value changes nothing"


def test_linear_path_on_the_cpu_is_the_reference():
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    assert batchinv.linear_path(x, w) == "reference"
    with pytest.raises(ValueError):
        batchinv.linear_path(torch.randn(3, 7), w)


# --------------------------------------------------------------------------- the decision


def test_auto_takes_the_pinned_path_for_large_bias_free_products_only(monkeypatch):
    fake = FakeCublasLt(monkeypatch)
    w = _weight()
    assert gpu_linear.rows_path(MIN, w, has_bias=False) == "cublaslt"
    assert gpu_linear.rows_path(MIN - 1, w, has_bias=False) == "own"
    assert gpu_linear.rows_path(4 * MIN, w, has_bias=True) == "own"
    assert gpu_linear.rows_path(4 * MIN, w, has_bias=False, path="own") == "own"
    assert fake.self_checks == 1, "one self-check per (device, N, K, dtype)"
    assert fake.probe_rows == list(lc.PROBE_ROWS)


def test_own_never_touches_cublaslt(monkeypatch):
    def forbidden(*args):
        raise AssertionError("the 'own' path must not consult cuBLASLt")

    monkeypatch.setattr(lc, "_refusal", forbidden)
    batchinv.set_linear_path("own")
    assert gpu_linear.rows_path(32768, _weight(), has_bias=False) == "own"


def test_a_failed_self_check_under_auto_warns_once_records_and_sticks(monkeypatch):
    fake = FakeCublasLt(monkeypatch, flip_in_probe=lc.PROBE_ROWS[1])
    w = _weight()
    with pytest.warns(RuntimeWarning, match=r"differ from batchinv's kernels in 1 of the 1027"):
        assert gpu_linear.rows_path(2 * MIN, w, has_bias=False) == "own"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning for the same shape
        for m in (MIN, 3 * MIN + 5, 32768):
            assert gpu_linear.rows_path(m, w, has_bias=False) == "own"
    assert fake.self_checks == 1
    ((key, reason),) = lc.refusals().items()
    assert key[1:] == (16, 32, torch.bfloat16) and "self-check probe" in reason


def test_a_failed_self_check_under_cublaslt_is_an_error_every_time(monkeypatch):
    fake = FakeCublasLt(monkeypatch, flip_in_probe=lc.PROBE_ROWS[2])
    batchinv.set_linear_path("cublaslt")
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"path is 'cublaslt'.*differ from batchinv"):
            gpu_linear.rows_path(MIN, _weight(), has_bias=False)
    assert fake.self_checks == 1
    # Products the pinned algorithm is not built for take batchinv's kernels, no error.
    assert gpu_linear.rows_path(MIN - 1, _weight(), has_bias=False) == "own"
    assert gpu_linear.rows_path(MIN, _weight(), has_bias=True) == "own"


@pytest.mark.parametrize(
    "unavailable, message",
    [
        ("library", "libcublasLt is not usable"),
        ("algo_check", "cublasLtMatmulAlgoCheck refuses"),
        ("not_sm90", "needs an sm_90 GPU"),
    ],
)
def test_an_unavailable_algorithm(monkeypatch, unavailable, message):
    FakeCublasLt(monkeypatch)
    if unavailable == "library":
        monkeypatch.setattr(lc, "_library_error", lambda index: "libcublasLt is not usable (x)")
    elif unavailable == "algo_check":
        monkeypatch.setattr(lc, "_plan", lambda *args: None)
    else:
        monkeypatch.setattr(lc, "uses_hopper", lambda device: False)
    w = _weight()
    if unavailable == "not_sm90":  # no choice to make under auto: no warning, no record
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert gpu_linear.rows_path(MIN, w, has_bias=False) == "own"
        assert lc.refusals() == {}
    else:
        with pytest.warns(RuntimeWarning, match=message):
            assert gpu_linear.rows_path(MIN, w, has_bias=False) == "own"
        assert message in next(iter(lc.refusals().values()))
    batchinv.set_linear_path("cublaslt")
    with pytest.raises(RuntimeError, match=message):
        gpu_linear.rows_path(MIN, w, has_bias=False)


def test_inside_a_capture_an_unchecked_shape_takes_batchinv_kernels(monkeypatch):
    fake = FakeCublasLt(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)

    def no_library_in_a_capture(index):  # loading it synchronises
        raise AssertionError("cuBLASLt must not be loaded inside a capture")

    monkeypatch.setattr(lc, "_library_error", no_library_in_a_capture)
    monkeypatch.setattr(lc, "_plan", no_library_in_a_capture)
    with pytest.warns(RuntimeWarning, match="outside the capture"):
        assert gpu_linear.rows_path(MIN, _weight(), has_bias=False) == "own"
    assert fake.self_checks == 0
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(lc, "_library_error", lambda index: None)
    monkeypatch.setattr(lc, "_plan", lambda *args: "plan")
    assert gpu_linear.rows_path(MIN, _weight(), has_bias=False) == "cublaslt"
    assert fake.self_checks == 1
    # Once checked, a capture may take the pinned path (planning is host-only).
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert gpu_linear.rows_path(2 * MIN, _weight(), has_bias=False) == "cublaslt"


# ------------------------------------------------------------------------- the self-check


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_probes_carry_every_special_value_at_both_ends(dtype):
    special = lc.special_rows(64, dtype, torch.device("cpu"))
    bits = special.view(torch.int16)
    info = torch.finfo(dtype)
    assert (bits[0] == 0).all(), "+0"
    assert (bits[1] == torch.tensor(-0.0, dtype=dtype).view(torch.int16)).all(), "-0"
    subnormal = (special != 0) & (special.abs() < info.tiny)
    assert subnormal[2].all() and (special[2] < 0).any() and (special[2] > 0).any()
    assert subnormal[3].float().mean() > 0.5
    assert torch.isposinf(special).any() and torch.isneginf(special).any()
    assert torch.isnan(special).any()
    assert (special[-1] == info.max / 2).all()
    for m in lc.PROBE_ROWS:
        rows = lc.probe(m, 64, dtype, torch.device("cpu"))
        assert rows.shape == (m, 64)
        n = special.shape[0]
        assert torch.equal(rows[:n].view(torch.int16), bits)
        assert torch.equal(rows[m - n :].view(torch.int16), bits)
    assert any(m % 128 for m in lc.PROBE_ROWS), "a probe that is no multiple of a tile"


def test_the_self_check_passes_on_equal_bits_and_names_the_failing_probe(monkeypatch):
    FakeCublasLt(monkeypatch)
    w = _weight(n=24, k=40, dtype=torch.float16)
    assert lc._self_check(w, _exact_matmul) is None
    FakeCublasLt(monkeypatch, flip_in_probe=lc.PROBE_ROWS[0])
    reason = lc._self_check(w, _exact_matmul)
    assert reason == (
        f"its bits differ from batchinv's kernels in 1 of the {lc.PROBE_ROWS[0]} rows of a "
        "self-check probe (differing elements: 1)"
    )


def test_a_nan_payload_difference_fails_the_self_check(monkeypatch):
    """Two NaNs with different bits are different bits (the comparator's rule)."""
    fake = FakeCublasLt(monkeypatch)

    def other_nan(x, weight, out, plan):
        fake.probe_rows.append(x.shape[0])
        out.copy_(_exact_matmul(x, weight))
        bits = out.view(torch.int16)
        bits[torch.isnan(out)] = 0x7FC1 if x.dtype == torch.bfloat16 else 0x7E01
        return out

    monkeypatch.setattr(lc, "_run", other_nan)
    reason = lc._self_check(_weight(), _exact_matmul)
    assert re.search(
        r"NaN on both paths with other bits \(batchinv 0x[0-9a-f]{4}, cuBLASLt 0x7fc1\)", reason
    )
