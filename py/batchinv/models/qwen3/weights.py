"""Qwen3 weights: local safetensors checkpoints (checked before loading) and random init.

``load_safetensors`` reads a single ``model.safetensors`` or a sharded checkpoint
(``model.safetensors.index.json``).  Every tensor's name, shape and dtype is checked from
the files' headers against the configuration BEFORE any tensor is read, so a wrong
checkpoint fails fast with an error naming the tensor.  Nothing is downloaded.

Every failure names the file and what is wrong with it, and is a ``ValueError``
(``CheckpointError``: corrupt, truncated or wrong content) or an ``OSError`` (missing, not a
directory), which the command line maps to exit code 2.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor

from ...reference.qwen3_chain import Qwen3ChainConfig, qwen3_state_dict_shapes

__all__ = [
    "CheckpointError",
    "checkpoint_files",
    "load_safetensors",
    "random_state_dict",
    "save_safetensors",
]

_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _safetensors():
    try:
        import safetensors
        import safetensors.torch  # noqa: F401  (save_file)
    except ImportError as err:
        raise ImportError(
            "reading and writing Qwen3 checkpoints needs the safetensors package "
            "(pip install safetensors)"
        ) from err
    return safetensors


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used (corrupt, truncated, not what its name says, or
    holding the wrong tensors); the message names the file."""


class CheckpointKeyError(CheckpointError, KeyError):
    """A tensor the configuration needs is absent (also a ``KeyError``)."""

    def __str__(self) -> str:  # a KeyError would quote its message
        return str(self.args[0]) if self.args else ""


class CheckpointDtypeError(CheckpointError, TypeError):
    """A tensor's dtype is not one batchinv loads (also a ``TypeError``)."""


@contextlib.contextmanager
def _open(file: Path) -> Iterator:
    """``safe_open(file)``; a file safetensors cannot parse is a ``CheckpointError`` naming it."""
    safetensors = _safetensors()
    try:
        handle = safetensors.safe_open(str(file), framework="pt")
    except safetensors.SafetensorError as err:  # an OSError (permissions) stays one
        raise CheckpointError(
            f"{file}: not a readable safetensors file (corrupt or truncated?): {err}"
        ) from err
    with handle:
        yield handle


def _read_json(file: Path, what: str):
    """``file`` parsed as JSON; unreadable text or invalid JSON is a ``CheckpointError``."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{file}: {what} is not a text (JSON) file: {err}") from err
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{file}: {what} is not valid JSON: {err}") from err


def _where(located: Mapping[str, Path]) -> str:
    files = sorted({str(f) for f in located.values()})
    if len(files) == 1:
        return files[0]
    return f"{Path(files[0]).parent} ({len(files)} shards)" if files else "the checkpoint"


def _ignorable(name: str) -> bool:
    # A non-persistent buffer some exports keep; the chain recomputes it.
    return name.endswith("rotary_emb.inv_freq")


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, for a checkpoint directory (single file
    or sharded with an index) or a single ``.safetensors`` file."""
    path = Path(path)
    if path.is_file():
        files = [path]
    elif (path / INDEX_FILE).is_file():
        index = _read_json(path / INDEX_FILE, "the shard index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) for f in weight_map.values()
        ):
            raise CheckpointError(
                f"{path / INDEX_FILE}: has no 'weight_map' object of tensor name -> file name"
            )
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise FileNotFoundError(f"{path / INDEX_FILE} names missing shard files: {missing}")
        return {name: path / file for name, file in weight_map.items()}
    elif (path / SINGLE_FILE).is_file():
        files = [path / SINGLE_FILE]
    else:
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
    located: dict[str, Path] = {}
    for file in files:
        with _open(file) as handle:
            for name in handle.keys():
                located[name] = file
    return located


def _header_shapes(located: Mapping[str, Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """(shape, safetensors dtype) of every tensor, read from the file headers only."""
    by_file: dict[Path, list[str]] = {}
    for name, file in located.items():
        by_file.setdefault(file, []).append(name)
    headers = {}
    for file, names in by_file.items():
        with _open(file) as handle:
            present = set(handle.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"{file}: the index places {name} here, but it lacks it")
                piece = handle.get_slice(name)
                headers[name] = (tuple(piece.get_shape()), piece.get_dtype())
    return headers


def check_checkpoint(located: Mapping[str, Path], config: Qwen3ChainConfig) -> None:
    """Names, shapes and dtypes against ``config``, from the headers; raises naming the tensor."""
    headers = _header_shapes(located)
    where = _where(located)
    expected = qwen3_state_dict_shapes(config)
    missing = [name for name in expected if name not in headers]
    if missing:
        raise CheckpointKeyError(
            f"{where}: checkpoint is missing {len(missing)} tensors the Qwen3 config needs, "
            f"first: {missing[:3]}"
        )
    tied_copy = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = [n for n in headers if n not in expected and n not in tied_copy]
    unexpected = [n for n in unexpected if not _ignorable(n)]
    if unexpected:
        raise CheckpointError(
            f"{where}: checkpoint has {len(unexpected)} tensors a dense Qwen3 does not use "
            f"(not a dense Qwen3 checkpoint?), first: {unexpected[:3]}"
        )
    for name, shape in expected.items():
        got, dtype = headers[name]
        if got != shape:
            raise CheckpointError(
                f"{located[name]}: checkpoint tensor {name} has shape {got}, expected {shape}"
            )
        if dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointDtypeError(
                f"{located[name]}: checkpoint tensor {name} has dtype {dtype}; expected one of "
                f"{sorted(_SAFETENSORS_DTYPES)}"
            )


def load_safetensors(
    path: str | Path,
    config: Qwen3ChainConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> dict[str, Tensor]:
    """The checked state dict (only the tensors ``config`` needs), cast to ``dtype``."""
    located = checkpoint_files(path)
    check_checkpoint(located, config)
    state: dict[str, Tensor] = {}
    needed = qwen3_state_dict_shapes(config)
    by_file: dict[Path, list[str]] = {}
    for name in needed:
        by_file.setdefault(located[name], []).append(name)
    for file, names in by_file.items():
        with _open(file) as handle:
            for name in names:
                try:
                    tensor = handle.get_tensor(name)
                except _safetensors().SafetensorError as err:
                    raise CheckpointError(f"{file}: cannot read tensor {name}: {err}") from err
                state[name] = tensor.to(device=device, dtype=dtype)
    return state


def save_safetensors(state_dict: Mapping[str, Tensor], directory: str | Path) -> Path:
    """Writes ``model.safetensors`` (contiguous CPU copies) into ``directory``."""
    save_file = _safetensors().torch.save_file
    target = Path(directory) / SINGLE_FILE
    save_file({n: t.detach().cpu().contiguous() for n, t in state_dict.items()}, str(target))
    return target


def random_state_dict(
    config: Qwen3ChainConfig,
    seed: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> dict[str, Tensor]:
    """Random weights from ``seed`` (CPU generator, so the same bits on every device).

    Matrices are ``N(0, 1/fan_in)`` so activations keep their scale through the layers; norm
    weights are ``1 + 0.3 N(0, 1)`` so every norm weight matters (HF initialises them to 1).
    """
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in qwen3_state_dict_shapes(config).items():
        if len(shape) == 1 and name.endswith("norm.weight"):
            values = 1.0 + 0.3 * torch.randn(shape, generator=generator)
        elif len(shape) == 1:  # attention biases
            values = 0.1 * torch.randn(shape, generator=generator)
        elif name == "model.embed_tokens.weight":
            values = torch.randn(shape, generator=generator)
        else:
            values = torch.randn(shape, generator=generator) / math.sqrt(shape[1])
        state[name] = values.to(device=device, dtype=dtype)
    return state
