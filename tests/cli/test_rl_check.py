"""``batchinv rl-check`` on the CPU: batchinv's sampler is on-policy bit for bit, the check
fails when a logprob is one ulp off, and bad arguments exit 2 before any work."""

from __future__ import annotations

import json

import pytest
import torch

from batchinv import rl_check
from batchinv.cli import main

SMALL = ["--prompts", "6", "--new-tokens", "5"]


def test_batchinv_is_on_policy(tmp_path, capsys):
    out = tmp_path / "rl.json"
    assert main(["rl-check", *SMALL, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "ratio == 1" in printed and "batchinv" in printed
    results = {r["path"]: r for r in json.loads(out.read_text())["results"]}
    assert results["batchinv"]["tokens"] == results["stock"]["tokens"] > 6
    assert results["batchinv"]["max_abs_diff"] == 0.0
    assert results["batchinv"]["kl_k1"] == 0.0 and results["batchinv"]["kl_k3"] == 0.0
    assert results["batchinv"]["exact_share"] == 1.0


def test_one_ulp_off_fails_the_check(monkeypatch):
    real = rl_check._sample_batchinv

    def off_by_one_ulp(*args):
        sequences, logprobs = real(*args)
        first = logprobs[0].clone()
        first[0] = torch.nextafter(first[0], torch.tensor(0.0))
        return sequences, [first, *logprobs[1:]]

    monkeypatch.setattr(rl_check, "_sample_batchinv", off_by_one_ulp)
    assert main(["rl-check", *SMALL]) == 1


def test_the_decode_batch_changes():
    waves = rl_check._waves(16)
    assert [len(w) for w in waves] == [1, 3, 2, 5, 5]
    budgets = {rl_check._budget(i, 16) for i in range(16)}
    assert len(budgets) > 3  # sequences finish at different steps


@pytest.mark.parametrize(
    "args",
    [
        ["--prompts", "0"],
        ["--new-tokens", "-1"],
        ["--temperature", "0"],
        ["--temperature", "nan"],
        ["--device", "nonsense"],
        ["--model", "/nonexistent/checkpoint"],
    ],
)
def test_bad_arguments_exit_2(args, capsys):
    assert main(["rl-check", *args]) == 2
    assert "batchinv rl-check: error:" in capsys.readouterr().err


def test_unwritable_outputs_exit_2_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(rl_check, "run_rl_check", lambda *a, **k: pytest.fail("ran"))
    assert main(["rl-check", "--json", str(tmp_path)]) == 2
    assert main(["rl-check", "--png", str(tmp_path / "missing" / "h.png")]) == 2


def test_png_histogram(tmp_path, capsys):
    png = tmp_path / "stock.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert main(["rl-check", *SMALL, "--png", str(png)]) == 2
        assert "needs matplotlib" in capsys.readouterr().err
        return
    assert main(["rl-check", *SMALL, "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
