"""The production-shaped run of ``batchinv audit`` on an sm_90 GPU, in bf16 and fp16: batchinv
stays bitwise invariant in every case, and the production kernel paths were reached --
linear batches of 1024-8191 rows and beyond 8191 rows (on the pinned cuBLASLt GEMM in fp16,
which the path switch's ``auto`` serves there; bf16 stays on batchinv's tiles), attention in
tile and split mode with contexts past the 2048-key split, and the Hopper cluster form of
log_softmax at vocab 151936.  The sweep is the CLI's (``PRODUCTION_SWEEP`` on
``PRODUCTION_CONFIG``), batchinv's path only."""

from __future__ import annotations

import pytest
import torch

from batchinv.audit import PRODUCTION_CONFIG, PRODUCTION_SWEEP, audit_json, run_audit
from batchinv.audit.sweep import kernel_paths_summary
from batchinv.gpu import linear_cublaslt
from batchinv.gpu.attention import SPLIT_KEYS
from batchinv.models import Qwen3
from batchinv.runtime import uses_hopper

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module", params=(torch.bfloat16, torch.float16), ids=str)
def result(request):
    if not torch.cuda.is_available() or not uses_hopper(torch.device("cuda")):
        pytest.skip("the production paths (pinned cuBLASLt, cluster log_softmax) are sm_90's")
    model = Qwen3.from_config(PRODUCTION_CONFIG, seed=0, device="cuda", dtype=request.param)
    result = run_audit(model, paths=("batchinv",), run_name="production", **PRODUCTION_SWEEP)
    del model
    torch.cuda.empty_cache()
    return result


def _case_paths(result):
    path = result.paths["batchinv"]
    return [path.baseline_kernel_paths] + [c.kernel_paths for c in path.cases]


def test_production_run_is_bitwise_invariant(result):
    path = result.paths["batchinv"]
    assert path.error is None, path.error
    drifting = [(c.transform_id, c.case, c.detail) for c in path.cases if c.status != "ok"]
    assert not drifting
    assert result.passed


def test_every_case_recorded_its_kernel_paths(result):
    per_case = _case_paths(result)
    assert all(p and {"linear", "attention", "log_softmax"} <= set(p) for p in per_case)
    report = audit_json(result)
    assert report["card"]["name"] == torch.cuda.get_device_name()
    assert report["build"] is not None and "90a" in report["build"]["cuda_archs"]
    summary = report["runs"][0]["paths"]["batchinv"]["kernel_paths"]
    assert set(summary) == {"linear", "attention", "log_softmax"}


def test_linear_ran_batches_in_and_beyond_the_pinned_range(result):
    def rows_on(prefix):
        return [
            entry["max_rows"]
            for p in _case_paths(result)
            for label, entry in p["linear"].items()
            if label.startswith(prefix)
        ]

    large = rows_on("")
    assert any(linear_cublaslt.MIN_ROWS <= rows <= 8191 for rows in large)
    assert any(rows > 8191 for rows in large)
    if result.dtype == "float16":  # the switch's auto serves fp16 with the pinned algorithm
        pinned = rows_on("cublaslt:")
        assert any(linear_cublaslt.MIN_ROWS <= rows <= 8191 for rows in pinned)
        assert any(rows > 8191 for rows in pinned)
    assert rows_on("own: small-m")  # decode steps: batchinv's own small-M kernel


def test_attention_crossed_the_split_in_both_modes(result):
    summary = kernel_paths_summary(result.paths["batchinv"])["attention"]
    modes = {path.split()[0] for path, entry in summary.items() if entry["max_keys"] > SPLIT_KEYS}
    assert modes == {"tile", "split"}, summary


def test_log_softmax_took_the_cluster_form_at_full_vocabulary(result):
    assert result.config["vocab_size"] == 151936
    summary = kernel_paths_summary(result.paths["batchinv"])["log_softmax"]
    assert any(path.startswith("cluster") for path in summary), summary
