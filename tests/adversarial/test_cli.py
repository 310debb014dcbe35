"""The command line under bad input (CPU): exit code 2 before any work for bad arguments,
checkpoints and output paths (nothing written), 3 with a one-line summary for an internal
error (the traceback with --debug), for every subcommand."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from _adversarial import tiny_model
from batchinv import audit, rl_check
from batchinv.cli import main

SUBCOMMANDS = ["audit", "demo", "rl-check"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    tiny_model("cpu", torch.float32).save_pretrained(path)
    return path


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if a subcommand starts its work (the sweep or the sampling)."""

    def started(*args, **kwargs):
        raise AssertionError("the command started its work before rejecting the input")

    monkeypatch.setattr(audit, "run_audit", started)
    monkeypatch.setattr(rl_check, "run_rl_check", started)


def _bad_paths(tmp_path, checkpoint):
    truncated = tmp_path / "truncated"
    shutil.copytree(checkpoint, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:100])
    eps = tmp_path / "eps"
    shutil.copytree(checkpoint, eps)
    config = json.loads((eps / "config.json").read_text()) | {"rms_norm_eps": 0}
    (eps / "config.json").write_text(json.dumps(config))
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    return {
        "json_is_dir": (["--json", str(tmp_path)], "--json"),
        "json_under_file": (["--json", str(a_file / "out.json")], "--json"),
        "json_missing_dir": (["--json", str(tmp_path / "no" / "out.json")], "--json"),
        "model_config_file": (["--model", str(checkpoint / "config.json")], "config.json"),
        "model_weights_file": (["--model", str(checkpoint / "model.safetensors")], "safetensors"),
        "model_truncated": (["--model", str(truncated)], "model.safetensors"),
        "model_eps_zero": (["--model", str(eps)], "rms_norm_eps"),
        "model_missing": (["--model", str(tmp_path / "none")], "config.json"),
        "device_nonsense": (["--device", "nonsense"], "nonsense"),
        "device_meta": (["--device", "meta"], "meta"),
    }


CASES = [
    "json_is_dir",
    "json_under_file",
    "json_missing_dir",
    "model_config_file",
    "model_weights_file",
    "model_truncated",
    "model_eps_zero",
    "model_missing",
    "device_nonsense",
    "device_meta",
]


@pytest.mark.parametrize("command", SUBCOMMANDS)
@pytest.mark.parametrize("case", CASES)
def test_bad_input_exits_2_before_any_work(command, case, tmp_path, checkpoint, no_work, capsys):
    args, named = _bad_paths(tmp_path, checkpoint)[case]
    listing = sorted(p.name for p in tmp_path.iterdir())
    assert main([command, *args]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == listing  # nothing written


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_usage_errors_exit_2(command):
    with pytest.raises(SystemExit) as raised:
        main([command, "--dtype", "float64"])
    assert raised.value.code == 2


@pytest.mark.parametrize("command", SUBCOMMANDS)
@pytest.mark.parametrize("debug", [[], ["--debug"]])
def test_internal_error_exits_3(command, debug, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("an invariant of batchinv itself\nsecond line")

    monkeypatch.setattr(audit, "run_audit", broken)
    monkeypatch.setattr(rl_check, "run_rl_check", broken)
    args = [command, "--device", "cpu", *debug]
    if command == "rl-check":
        args += ["--prompts", "1", "--new-tokens", "1"]
    assert main(args) == 3
    err = capsys.readouterr().err
    assert "internal error: RuntimeError: an invariant of batchinv itself" in err
    if debug:
        assert "Traceback" in err
    else:
        assert "Traceback" not in err and "--debug" in err
        assert len(err.strip().splitlines()) == 1


def test_debug_before_the_subcommand(monkeypatch, capsys):
    monkeypatch.setattr(audit, "run_audit", lambda *a, **k: 1 / 0)
    assert main(["--debug", "audit", "--device", "cpu", "--no-progress"]) == 3
    assert "Traceback" in capsys.readouterr().err
