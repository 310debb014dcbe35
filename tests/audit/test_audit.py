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
    QUICK_SWEEP,
    audit_json,
    count_cases,
    main,
    run_audit,
)
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

    return dataclasses.replace(model_ops.BATCHINV_OPS, linear=linear)


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
    assert report["seq_len"] == AUDIT_SEQ_LEN == 131 and report["config"]["vocab_size"] == 512
    assert [t["id"] for t in report["transforms"]] == TRANSFORM_IDS
    cases = report["paths"]["batchinv"]["cases"]
    assert len(cases) == len(report["paths"]["stock"]["cases"]) == count_cases(seq_len=131) - 1
    assert {c["transform_id"] for c in cases} == set(TRANSFORM_IDS)
    assert all(c["status"] == "ok" and c["max_abs_logprob_diff"] == 0.0 for c in cases)
    for transform in report["transforms"]:
        assert transform["paths"]["batchinv"]["bitwise"] is True, transform["id"]


def test_audit_result_and_json_structure():
    model = Qwen3.from_config(seed=0, dtype=torch.bfloat16)
    result = run_audit(model, **SMALL)
    assert result.passed
    report = json.loads(json.dumps(audit_json(result), allow_nan=False))  # strict JSON
    assert set(report) >= {"passed", "device", "dtype", "model", "config", "transforms", "paths"}
    assert list(report["paths"]) == list(AUDIT_PATHS)
    for name in AUDIT_PATHS:
        path = report["paths"][name]
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
    assert json.loads(out.read_text())["model"] == str(tmp_path / "ckpt")


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
