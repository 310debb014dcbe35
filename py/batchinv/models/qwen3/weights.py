"""Qwen3 weights: local safetensors checkpoints (checked before loading) and random init.

``load_safetensors`` reads a single ``model.safetensors`` or a sharded checkpoint
(``model.safetensors.index.json``).  Every tensor's name, shape and dtype is checked from
the files' headers against the configuration BEFORE any tensor is read, so a wrong
checkpoint fails fast with an error naming the tensor.  Nothing is downloaded.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from ...reference.qwen3_chain import Qwen3ChainConfig, qwen3_state_dict_shapes

__all__ = ["checkpoint_files", "load_safetensors", "random_state_dict", "save_safetensors"]

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


def _ignorable(name: str) -> bool:
    # A non-persistent buffer some exports keep; the chain recomputes it.
    return name.endswith("rotary_emb.inv_freq")


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, for a checkpoint directory (single file
    or sharded with an index) or a single ``.safetensors`` file."""
    safe_open = _safetensors().safe_open
    path = Path(path)
    if path.is_file():
        files = [path]
    elif (path / INDEX_FILE).is_file():
        index = json.loads((path / INDEX_FILE).read_text())
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{path / INDEX_FILE} has no 'weight_map' object")
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
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                located[name] = file
    return located


def _header_shapes(located: Mapping[str, Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """(shape, safetensors dtype) of every tensor, read from the file headers only."""
    safe_open = _safetensors().safe_open
    by_file: dict[Path, list[str]] = {}
    for name, file in located.items():
        by_file.setdefault(file, []).append(name)
    headers = {}
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as handle:
            present = set(handle.keys())
            for name in names:
                if name not in present:
                    raise ValueError(f"the index places {name} in {file.name}, which lacks it")
                piece = handle.get_slice(name)
                headers[name] = (tuple(piece.get_shape()), piece.get_dtype())
    return headers


def check_checkpoint(located: Mapping[str, Path], config: Qwen3ChainConfig) -> None:
    """Names, shapes and dtypes against ``config``, from the headers; raises naming the tensor."""
    headers = _header_shapes(located)
    expected = qwen3_state_dict_shapes(config)
    missing = [name for name in expected if name not in headers]
    if missing:
        raise KeyError(
            f"checkpoint is missing {len(missing)} tensors the Qwen3 config needs, "
            f"first: {missing[:3]}"
        )
    tied_copy = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = [n for n in headers if n not in expected and n not in tied_copy]
    unexpected = [n for n in unexpected if not _ignorable(n)]
    if unexpected:
        raise ValueError(
            f"checkpoint has {len(unexpected)} tensors a dense Qwen3 does not use (not a dense "
            f"Qwen3 checkpoint?), first: {unexpected[:3]}"
        )
    for name, shape in expected.items():
        got, dtype = headers[name]
        if got != shape:
            raise ValueError(f"checkpoint tensor {name} has shape {got}, expected {shape}")
        if dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(
                f"checkpoint tensor {name} has dtype {dtype}; expected one of "
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
    safe_open = _safetensors().safe_open
    located = checkpoint_files(path)
    check_checkpoint(located, config)
    state: dict[str, Tensor] = {}
    needed = qwen3_state_dict_shapes(config)
    by_file: dict[Path, list[str]] = {}
    for name in needed:
        by_file.setdefault(located[name], []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as handle:
            for name in names:
                state[name] = handle.get_tensor(name).to(device=device, dtype=dtype)
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
