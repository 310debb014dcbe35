"""Models built from batchinv's ops.  ``Qwen3``: the dense Qwen3 family."""

from .qwen3 import Qwen3, Qwen3Config

__all__ = ["Qwen3", "Qwen3Config"]
