"""The dense Qwen3 family: configuration, weights, the model and its op tables."""

from .config import Qwen3Config
from .model import Qwen3, check_device_dtype
from .ops import BATCHINV_OPS, REFERENCE_OPS, STOCK_OPS, ops_by_name
from .weights import load_safetensors, random_state_dict, save_safetensors

__all__ = [
    "BATCHINV_OPS",
    "REFERENCE_OPS",
    "STOCK_OPS",
    "Qwen3",
    "Qwen3Config",
    "check_device_dtype",
    "load_safetensors",
    "ops_by_name",
    "random_state_dict",
    "save_safetensors",
]
