"""benchmarks/bench_train_step.py (a GPU script): its arguments and batch on the CPU, and a
smoke run of every path with the tiny model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_train_step.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH.parent))  # the script imports _common.py and bench_qwen3_e2e.py
    try:
        spec = importlib.util.spec_from_file_location("bench_train_step", BENCH)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench_train_step", None)
        sys.path.remove(str(BENCH.parent))


def test_arguments(bench):
    args = bench.parse_args(["--layers", "3", "--json", "out.json"])
    assert (args.layers, args.tokens, args.sequences, args.reps) == (3, [16384, 32768], 16, 3)
    assert bench.parse_args(["--tokens", "4096"]).tokens == [4096]
    for bad in (["--layers", "0"], ["--tokens", "two"], ["--tokens", "16", "--sequences", "16"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


@pytest.mark.parametrize(("total", "count"), [(16384, 16), (32768, 16), (48, 4), (1001, 7)])
def test_sequence_lengths_are_mixed_and_sum_to_the_batch(bench, total, count):
    lengths = bench.sequence_lengths(total, count)
    assert len(lengths) == count and sum(lengths) == total and min(lengths) >= 2
    if count >= 2:
        assert max(lengths) >= 1.4 * total / count and min(lengths) <= 0.6 * total / count


def test_batch_packed_and_padded_predict_the_same_tokens(bench):
    batch = bench.make_batch(48, 4, 512, torch.device("cpu"), seed=3)
    lengths = [s.numel() for s in batch.sequences]
    assert batch.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    packed = torch.cat(batch.sequences)
    kept = batch.packed_targets != bench.IGNORE_INDEX
    assert torch.equal(batch.packed_targets[kept], batch.targets)
    # each predicting position's next token is its target, in the packed and the padded layout
    assert torch.equal(packed[1:][kept[:-1]], batch.targets)
    flat = batch.padded_ids.reshape(-1)
    assert torch.equal(flat[batch.target_rows + 1], batch.targets)
    assert batch.completion_tokens == sum(n - max(1, n // 4) for n in lengths)
    assert torch.equal(batch.padded_mask.sum(1), torch.tensor(lengths))


def test_summary_rows(bench):
    args = bench.parse_args(["--tokens", "4096"])
    batch = bench.make_batch(4096, 16, 512, torch.device("cpu"), seed=0)
    rows = [
        {"tokens": 4096, "path": path, "step_ms": ms}
        for path, ms in (
            ("batchinv.models.Qwen3", 105.0),
            ("stock PyTorch", 100.0),
            ("transformers + batchinv", 120.0),
            ("transformers, stock", 100.0),
            ("transformers + Liger-Kernel", None),
        )
    ]
    summary = bench.summary_rows(rows, args, {4096: batch})
    assert [(r["variant"], r["anchor"]) for r in summary] == [
        ("train step, batchinv.models.Qwen3", bench.ANCHOR),
        ("train step, transformers + batchinv", bench.HF_ANCHOR),
    ]
    assert summary[0]["ratio"] == pytest.approx(bench.GOAL)  # exactly 1.05x stock: on the goal
    assert summary[1]["ratio"] < summary[1]["goal"]
    assert summary[0]["case"].startswith("4096 tokens (16 sequences), 2 layers")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU messages")
def test_refuses_to_run_or_record_without_a_gpu(bench, tmp_path):
    with pytest.raises(SystemExit, match="needs an NVIDIA GPU"):
        bench.main(["--layers", "1"])
    with pytest.raises(SystemExit, match="--json needs a GPU run"):
        bench.main(["--smoke", "--json", str(tmp_path / "x.json")])


def test_smoke_run_times_every_path(bench):
    pytest.importorskip("transformers")
    steps, components, summary = bench.main(["--smoke", "--reps", "1"])
    by_path = {r["path"]: r for r in steps}
    assert set(by_path) == {
        "batchinv.models.Qwen3",
        "stock PyTorch",
        "transformers, stock",
        "transformers + batchinv",
        "transformers + Liger-Kernel",
    }
    for path in ("batchinv.models.Qwen3", "stock PyTorch", "transformers + batchinv"):
        assert by_path[path]["step_ms"] > 0 and by_path[path]["vs_anchor"] > 0
    liger = by_path["transformers + Liger-Kernel"]
    if importlib.util.find_spec("liger_kernel") is None:
        assert liger["note"] == "liger_kernel not installed" and "step_ms" not in liger
    names = [r["component"] for r in components]
    assert names[:3] == ["linear forward", "linear grad_x", "linear grad_w"]
    assert names[-1] == "other (step - components)"
    assert [r["count"] for r in components[:3]] == [14, 14, 14]  # 7 projections x 2 layers
    assert {r["variant"] for r in summary} >= {"train step, batchinv.models.Qwen3"}


def test_liger_path_patches_the_model_and_uses_its_fused_loss(bench, monkeypatch):
    """Liger-Kernel is absent here: a stand-in records how the bench calls it."""
    import importlib.machinery
    import types

    calls = {}

    class FusedLoss:
        def __init__(self, **kwargs):
            calls["loss_init"] = kwargs

        def __call__(self, weight, rows, targets):
            calls["loss_args"] = (weight, rows, targets)
            return torch.tensor(2.0), None

    def apply(**kwargs):
        calls["patch"] = kwargs

    package = types.ModuleType("liger_kernel")
    package.__spec__ = importlib.machinery.ModuleSpec("liger_kernel", None)
    package.__path__ = []
    sub = types.ModuleType("liger_kernel.transformers")
    sub.LigerFusedLinearCrossEntropyLoss = FusedLoss
    sub.apply_liger_kernel_to_qwen3 = apply
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", sub)
    model = object()
    note, loss_of = bench.liger_patch(model)
    assert note is None
    assert calls["patch"]["model"] is model
    assert calls["patch"]["rms_norm"] and calls["patch"]["rope"] and calls["patch"]["swiglu"]
    assert calls["loss_init"] == {"ignore_index": bench.IGNORE_INDEX, "reduction": "mean"}
    weight, rows, targets = torch.ones(3, 2), torch.ones(4, 2), torch.zeros(4, dtype=torch.long)
    assert float(loss_of(rows, weight, targets)) == 2.0
    assert all(a is b for a, b in zip(calls["loss_args"], (weight, rows, targets), strict=True))


def test_a_failing_path_is_recorded_and_fails_the_run(bench, monkeypatch, capsys):
    pytest.importorskip("transformers")

    def broken(token_logprobs):
        def loss_of(rows, weight, targets):
            raise RuntimeError("broken loss")

        return loss_of

    monkeypatch.setattr(bench, "logprob_loss", broken)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--smoke", "--reps", "1"])
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    assert "FAILED: transformers, stock at 48 tokens: failed: RuntimeError: broken loss" in out
    assert "FAILED: transformers + batchinv" in out
    assert "FAILED: batchinv.models.Qwen3" not in out  # the other paths still ran
