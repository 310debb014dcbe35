"""Qwen3.from_pretrained under broken checkpoints (CPU): every failure is a ValueError or an
OSError naming the file and what is wrong with it, the files are not touched, and loading the
good checkpoint afterwards gives the same parameters as before."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from _adversarial import assert_same, snapshot, tiny_model
from batchinv.models.qwen3 import Qwen3
from batchinv.models.qwen3.weights import CheckpointError


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("good") / "ckpt"
    tiny_model("cpu", torch.float32).save_pretrained(path)
    return path


def _truncate(path: Path) -> Path:
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    return path


def _garbage_weights(path: Path) -> Path:
    (path / "model.safetensors").write_bytes(b"\x00\x01not a safetensors file" * 10)
    return path


def _short_header(path: Path) -> Path:
    (path / "model.safetensors").write_bytes(b"\x10\x00")
    return path


def _config_edit(**change):
    def edit(path: Path) -> Path:
        config = json.loads((path / "config.json").read_text()) | change
        (path / "config.json").write_text(json.dumps(config))
        return path

    return edit


def _config_text(text: bytes):
    def edit(path: Path) -> Path:
        (path / "config.json").write_bytes(text)
        return path

    return edit


def _sharded(index: bytes):
    def edit(path: Path) -> Path:
        (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
        (path / "model.safetensors.index.json").write_bytes(index)
        return path

    return edit


def _no_config(path: Path) -> Path:
    (path / "config.json").unlink()
    return path


def _no_weights(path: Path) -> Path:
    (path / "model.safetensors").unlink()
    return path


def _config_file(path: Path) -> Path:
    return path / "config.json"  # as in `--model .../config.json`


def _weights_file(path: Path) -> Path:
    return path / "model.safetensors"


SHARD = b'{"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}'
BROKEN = [
    ("truncated_weights", _truncate, CheckpointError, "model.safetensors.*truncated"),
    ("garbage_weights", _garbage_weights, CheckpointError, "model.safetensors"),
    ("short_header", _short_header, CheckpointError, "model.safetensors"),
    ("config_is_binary", _config_text(b"\xd8\xff\x00\x01"), CheckpointError, "config.json"),
    ("config_not_json", _config_text(b"{model_type: qwen3"), CheckpointError, "config.json"),
    ("config_a_list", _config_text(b"[1, 2]"), CheckpointError, "config.json"),
    ("config_eps_zero", _config_edit(rms_norm_eps=0), CheckpointError, "config.json.*rms_norm_eps"),
    ("config_eps_str", _config_edit(rms_norm_eps="small"), CheckpointError, "config.json"),
    ("config_llama", _config_edit(model_type="llama"), CheckpointError, "config.json.*llama"),
    ("config_float_size", _config_edit(hidden_size=64.0), CheckpointError, "config.json.*hidden"),
    ("config_vocab_mismatch", _config_edit(vocab_size=500), CheckpointError, "model.safetensors"),
    ("no_config", _no_config, FileNotFoundError, "config.json"),
    ("no_weights", _no_weights, FileNotFoundError, "model.safetensors"),
    ("path_is_config_file", _config_file, NotADirectoryError, "config.json"),
    ("path_is_weights_file", _weights_file, NotADirectoryError, "model.safetensors"),
    ("index_not_json", _sharded(b"{weight_map"), CheckpointError, "index.json"),
    ("index_no_map", _sharded(b'{"metadata": {}}'), CheckpointError, "index.json.*weight_map"),
    ("index_missing_shard", _sharded(SHARD), FileNotFoundError, "index.json"),
]


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize(("name", "damage", "error", "match"), BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_checkpoint_names_the_file(good_checkpoint, tmp_path, name, damage, error, match):
    expected = snapshot(Qwen3.from_pretrained(good_checkpoint, dtype=torch.float32))
    copy = tmp_path / "ckpt"
    shutil.copytree(good_checkpoint, copy)
    target = damage(copy)
    files_before = _files(copy)
    with pytest.raises(error, match=match) as raised:
        Qwen3.from_pretrained(target, dtype=torch.float32)
    assert isinstance(raised.value, ValueError | OSError)  # what the CLI maps to exit code 2
    assert _files(copy) == files_before
    assert_same(
        snapshot(Qwen3.from_pretrained(good_checkpoint, dtype=torch.float32)),
        expected,
        f"{name}: the good checkpoint after the failure",
    )
