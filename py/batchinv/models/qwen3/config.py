"""``Qwen3Config``: the dense Qwen3 architecture, from a Hugging Face ``config.json``.

The fields are the chain's (``Qwen3ChainConfig``); this class adds reading a config.json
(path or dict) with clear errors, writing one back, and ``Qwen3Config.tiny()``: the small
built-in random configuration everything runs with when no checkpoint is given.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from ...reference.qwen3_chain import Qwen3ChainConfig

__all__ = ["REQUIRED_KEYS", "Qwen3Config"]

# Keys a Qwen3 config.json must hold; the others have Hugging Face's defaults.
REQUIRED_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclass(frozen=True)
class Qwen3Config(Qwen3ChainConfig):
    """A dense Qwen3 configuration (Hugging Face field names)."""

    @classmethod
    def from_dict(cls, config: Mapping) -> Qwen3Config:
        """From a parsed config.json.  ``model_type`` must be "qwen3"; a missing required key,
        a non-integer size or an unsupported feature raises ``ValueError`` naming it."""
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a mapping (parsed config.json), got {type(config)}")
        missing = [key for key in REQUIRED_KEYS if key not in config]
        if missing:
            raise ValueError(f"config.json is missing required keys: {', '.join(missing)}")
        if config["model_type"] != "qwen3":
            raise ValueError(
                f"config.json model_type must be 'qwen3' (dense Qwen3), got "
                f"{config['model_type']!r}"
            )
        for key in REQUIRED_KEYS[1:] + ("num_key_value_heads", "head_dim"):
            value = config.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"config.json {key} must be an integer, got {value!r}")
        chain = Qwen3ChainConfig.from_hf(config)
        return cls(**asdict(chain))

    @classmethod
    def from_json(cls, path: str | Path) -> Qwen3Config:
        """From a config.json file, or a checkpoint directory holding one.  Every failure
        names the file: ``FileNotFoundError`` (absent), ``CheckpointError`` (a ``ValueError``:
        not text, not JSON, or a config the chain cannot run)."""
        from .weights import CheckpointError

        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no Qwen3 config.json at {path}")
        try:
            parsed = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as err:
            raise CheckpointError(f"{path}: not a text (JSON) file: {err}") from err
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{path} is not valid JSON: {err}") from err
        try:
            return cls.from_dict(parsed)
        except (KeyError, TypeError, ValueError) as err:
            message = err.args[0] if isinstance(err, KeyError) and err.args else err
            raise CheckpointError(f"{path}: {message}") from err

    @classmethod
    def tiny(cls) -> Qwen3Config:
        """The built-in random configuration: 2 layers, hidden 64, GQA 4/2 heads of 64 (a head
        dim the GPU attention kernels support; q/o projections 64 <-> 256 as in Qwen3, where
        heads x head_dim need not equal hidden), vocab 512.  Small enough for a CPU."""
        return cls(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            max_position_embeddings=512,
            tie_word_embeddings=False,
        )

    def to_dict(self) -> dict:
        """A Hugging Face ``Qwen3Config``-compatible dict (what ``save`` writes)."""
        d = asdict(self)
        d.update(
            model_type="qwen3",
            architectures=["Qwen3ForCausalLM"],
            hidden_act="silu",
            use_sliding_window=False,
        )
        return d

    def save(self, path: str | Path) -> Path:
        """Writes ``config.json`` into the directory ``path``; returns the file's path."""
        target = Path(path) / "config.json"
        target.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return target
