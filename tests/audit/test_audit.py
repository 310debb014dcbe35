"""``batchinv audit`` on the CPU: passes on the built-in configuration, reports JSON with the
documented structure, exits 1 when batchinv drifts or cannot run, and rejects bad input with
exit code 2 before any work."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import batchinv
from batchinv.audit import (
    AUDIT_PATHS,
    AUDIT_SEQ_LEN,
    PRODUCTION_CONFIG,
    PRODUCTION_SWEEP,
    QUICK_SWEEP,
    audit_json,
    count_cases,
    main,
    plan_cases,
    plan_runs,
    run_audit,
)
from batchinv.audit.kernel_paths import PathRecorder, merge_paths
from batchinv.audit.sweep import TOKEN_NEIGHBOUR_KINDS
from batchinv.contract import TRANSFORMS
from batchinv.models import Qwen3
from batchinv.models.qwen3 import ops as model_ops
from batchinv.registry import BackendNotImplementedError

pytest.importorskip("safetensors")

ROOT = Path(__file__).resolve().parents[2]
TRANSFORM_IDS = [t.id for t in TRANSFORMS]
# A small sweep for the tests that are not about the default run.
SMALL = dict(
    seq_len=12,
    neighbour_lengths=(15, 5, 1),
    batch_sizes=(1, 3),
    chunk_sizes=(1, 5),
    irregular_chunks=(2, 7),
    prompt_lengths=(6,),
    prefix_lengths=(6,),
)


def noisy_batchinv_ops():
    """batchinv's ops with a linear whose result depends on the batch size: a drift."""

    def linear(x, weight, bias):
        out = batchinv.linear(x, weight, bias)
        return out + 1e-2 * (x.shape[0] - 1)

    return dataclasses.replace(model_ops.BATCHINV_OPS, linear=linear, linear_group=None)


@pytest.mark.slow
def test_default_audit_passes_on_builtin_config(tmp_path, capsys):
    out = tmp_path / "audit.json"
    assert main(["--json", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "PASS: batchinv is bitwise invariant in every case" in printed
    report = json.loads(out.read_text())
    assert report["passed"] is True
    default_device = "cuda:0" if torch.cuda.is_available() else "cpu"  # the audit's default
    assert report["device"] == default_device and report["dtype"] == "bfloat16"
    tiny = report["runs"][0]
    assert tiny["seq_len"] == AUDIT_SEQ_LEN == 131 and tiny["config"]["vocab_size"] == 512
    assert [t["id"] for t in tiny["transforms"]] == TRANSFORM_IDS
    cases = tiny["paths"]["batchinv"]["cases"]
    assert len(cases) == len(tiny["paths"]["stock"]["cases"]) == count_cases(seq_len=131) - 1
    assert {c["transform_id"] for c in cases} == set(TRANSFORM_IDS)
    assert all(c["status"] == "ok" and c["max_abs_logprob_diff"] == 0.0 for c in cases)
    for transform in tiny["transforms"]:
        assert transform["paths"]["batchinv"]["bitwise"] is True, transform["id"]


def test_audit_result_and_json_structure():
    model = Qwen3.from_config(seed=0, dtype=torch.bfloat16)
    result = run_audit(model, run_name="small", **SMALL)
    assert result.passed
    top = json.loads(json.dumps(audit_json(result), allow_nan=False))  # strict JSON
    assert set(top) >= {"passed", "device", "dtype", "commit", "build", "card", "runs"}
    assert top["card"] == {"name": "CPU"} and top["build"]["version"] == batchinv.__version__
    (report,) = top["runs"]
    assert set(report) >= {"name", "passed", "model", "config", "sweep", "transforms", "paths"}
    assert report["name"] == "small" and report["sweep"] == json.loads(json.dumps(SMALL))
    assert list(report["paths"]) == list(AUDIT_PATHS)
    for name in AUDIT_PATHS:
        path = report["paths"][name]
        assert path["kernel_paths"] is None  # recorded for batchinv on CUDA only
        assert path["error"] is None and path["seconds"] > 0
        assert len(path["cases"]) == count_cases(**SMALL) - 1
        for case in path["cases"]:
            assert set(case) >= {"transform_id", "case", "status", "bitwise", "seconds"}
            assert case["seconds"] is not None and case["seconds"] >= 0
    for transform in report["transforms"]:
        for name in AUDIT_PATHS:
            summary = transform["paths"][name]
            assert summary["cases"] >= 1, (transform["id"], name)
            assert set(summary) >= {"bitwise", "max_abs_logprob_diff", "seconds"}
        assert transform["paths"]["batchinv"]["bitwise"] is True


def test_exit_code_1_when_batchinv_drifts(monkeypatch, capsys):
    monkeypatch.setitem(model_ops.OPS_BY_NAME, "batchinv", noisy_batchinv_ops())
    assert main(["--quick", "--no-progress"]) == 1
    printed = capsys.readouterr().out
    assert "FAIL" in printed and "batchinv DRIFT: T1" in printed
    model = Qwen3.from_config(seed=0, dtype=torch.bfloat16)
    result = run_audit(model, **SMALL)
    assert not result.passed
    t1 = [c for c in result.paths["batchinv"].cases if c.transform_id == "T1"]
    assert any(c.status == "DRIFT" and c.max_abs_logprob_diff > 0 for c in t1)


def test_missing_backend_is_an_error_not_a_fallback(monkeypatch, capsys):
    def no_kernel(*args, **kwargs):
        raise BackendNotImplementedError("op 'attention' has no cuda implementation")

    broken = dataclasses.replace(model_ops.BATCHINV_OPS, attention=no_kernel)
    monkeypatch.setitem(model_ops.OPS_BY_NAME, "batchinv", broken)
    model = Qwen3.from_config(seed=0, dtype=torch.bfloat16)
    result = run_audit(model, **SMALL)
    assert not result.passed
    assert "has no cuda implementation" in result.paths["batchinv"].error
    assert result.paths["stock"].error is None  # the stock path still ran
    assert main(["--quick", "--no-progress"]) == 1
    printed = capsys.readouterr().out
    assert "batchinv ERROR: AuditOpError" in printed


def test_progress_bar_on_stderr(capsys):
    assert main(["--quick"]) == 0
    captured = capsys.readouterr()
    total = len(AUDIT_PATHS) * count_cases(**QUICK_SWEEP)
    assert f"{total}/{total}" in captured.err and "[####" in captured.err
    assert "[####" not in captured.out


def test_audit_of_a_local_checkpoint(tmp_path, capsys):
    Qwen3.from_config(seed=5, dtype=torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "a.json"
    args = ["--model", str(tmp_path / "ckpt"), "--quick", "--no-progress", "--json", str(out)]
    assert main(args) == 0
    assert json.loads(out.read_text())["runs"][0]["model"] == str(tmp_path / "ckpt")


def test_bad_input_exit_code_2_before_any_work(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "none"), "--no-progress"]) == 2
    assert "no Qwen3 config.json" in capsys.readouterr().err
    ckpt = tmp_path / "llama"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))
    assert main(["--model", str(ckpt), "--no-progress"]) == 2
    assert "missing required keys" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--dtype", "float64"])
    assert exit_info.value.code == 2
    if not torch.cuda.is_available():
        assert main(["--device", "cuda", "--no-progress"]) == 2
        assert "CUDA is not available" in capsys.readouterr().err


def test_python_m_batchinv_demo_alias():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "py"))
    done = subprocess.run(
        [sys.executable, "-m", "batchinv", "demo", "--quick", "--no-progress", "--device", "cpu"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "PASS" in done.stdout and "T7 prefix reuse" in done.stdout


def test_json_names_the_commit(monkeypatch):
    monkeypatch.setenv("BATCHINV_GIT_COMMIT", "0123abc")
    model = Qwen3.from_config(seed=0, dtype=torch.bfloat16)
    result = run_audit(model, paths=("batchinv",), **SMALL)
    assert audit_json(result)["commit"] == "0123abc"
    monkeypatch.delenv("BATCHINV_GIT_COMMIT")
    commit = audit_json(result)["commit"]  # this checkout's HEAD (+dirty), or None outside one
    assert commit is None or len(commit.removesuffix("+dirty")) == 40


def test_t3_neighbours_with_distinct_tokens():
    """The audit's T3 neighbours differ from the probe, so a batch-wide dependence on content
    drifts there, while the contract's "copies" neighbour cannot see it."""

    def linear(x, weight, bias):  # every row shifted by the batch's largest input
        out = batchinv.linear(x, weight, bias)
        return out + 1e-2 * x.abs().amax().to(out.dtype)

    model = Qwen3.from_config(seed=0, dtype=torch.bfloat16)
    model_ops.OPS_BY_NAME["content"] = dataclasses.replace(
        model_ops.BATCHINV_OPS, name="content", linear=linear
    )
    try:
        result = run_audit(model, paths=("content",), **SMALL)
    finally:
        del model_ops.OPS_BY_NAME["content"]
    t3 = {c.case.split(": ")[-1]: c.status for c in result.paths["content"].transform_cases("T3")}
    assert list(t3) == ["copies", *TOKEN_NEIGHBOUR_KINDS]
    assert t3["copies"] == "ok"
    assert all(t3[kind] == "DRIFT" for kind in TOKEN_NEIGHBOUR_KINDS), t3


def test_planned_runs():
    assert [(r.name, r.model) for r in plan_runs("cpu")] == [("tiny", "tiny")]
    assert [(r.name, r.model) for r in plan_runs("cuda")] == [
        ("tiny", "tiny"),
        ("production", "production"),
    ]
    assert plan_runs("cuda")[1].sweep == PRODUCTION_SWEEP
    assert [(r.name, r.model) for r in plan_runs("cuda", checkpoint=True)] == [
        ("production", "checkpoint")
    ]
    for device in ("cpu", "cuda"):
        (quick,) = plan_runs(device, quick=True)
        assert quick.sweep == QUICK_SWEEP


def test_production_sweep_reaches_the_risky_shapes():
    """What the CUDA default's production run computes: batches of 1024..8191 rows and beyond
    8191 (the pinned cuBLASLt range and past it) in prefill, packed and decode prompts; every
    case's probe past the 2048-key split; the full Qwen3 vocabulary; Qwen3-8B's shapes."""
    plans = plan_cases(**PRODUCTION_SWEEP)
    assert len(plans) == count_cases(**PRODUCTION_SWEEP)
    rows = {p.method: [] for p in plans}
    for p in plans:
        rows[p.method].append(p.rows)
    assert any(1024 <= r <= 8191 for r in rows["prefill_padded"])
    assert any(r > 8191 for r in rows["prefill_padded"])
    assert any(r > 8191 for r in rows["prefill_varlen"])
    assert max(p.rows for p in plans) <= 16384  # memory: [rows, vocab] fp32 logprobs
    assert all(p.keys > 2048 for p in plans)  # the probe (or a longer neighbour) crosses it
    assert PRODUCTION_SWEEP["seq_len"] > 2048
    assert any(p < 2048 < PRODUCTION_SWEEP["seq_len"] for p in PRODUCTION_SWEEP["prompt_lengths"])
    assert 2048 in PRODUCTION_SWEEP["prefix_lengths"]
    assert PRODUCTION_CONFIG.vocab_size == 151936
    assert (PRODUCTION_CONFIG.hidden_size, PRODUCTION_CONFIG.intermediate_size) == (4096, 12288)
    assert PRODUCTION_CONFIG.num_attention_heads * PRODUCTION_CONFIG.head_dim == 4096
    methods = {p.method for p in plans}
    assert methods == {
        "prefill_padded",
        "prefill_varlen",
        "prefill_chunked",
        "decode",
        "prefix_reuse",
    }


def test_kernel_path_records_merge():
    recorder = PathRecorder()
    recorder.note("linear", "cublaslt", "max_rows", 2048)
    recorder.note("linear", "cublaslt", "max_rows", 9000)
    recorder.note("attention", "split w1", "max_keys", 2100)
    first = recorder.take()
    assert first == {
        "linear": {"cublaslt": {"calls": 2, "max_rows": 9000}},
        "attention": {"split w1": {"calls": 1, "max_keys": 2100}},
    }
    assert recorder.take() == {}
    recorder.note("linear", "cublaslt", "max_rows", 1024)
    recorder.note("linear", "small_m", "max_rows", 5)
    merged = merge_paths([first, None, recorder.take()])
    assert merged["linear"] == {
        "cublaslt": {"cases": 2, "calls": 3, "max_rows": 9000},
        "small_m": {"cases": 1, "calls": 1, "max_rows": 5},
    }
