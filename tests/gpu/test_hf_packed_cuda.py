"""A trainer's packed row through a patched Hugging Face Qwen3 on the GPU: the block-diagonal
causal mask transformers builds from restarting ``position_ids`` is routed as one causal run
per sequence, so each sequence's logits are its logits alone, bit for bit, and its gradients
reach every weight."""

from __future__ import annotations

import pytest
import torch

from _hf_tiny_qwen3 import CUDA_CONFIG, assert_packed_row_matches_alone, make_hf_model
from batchinv.integrations import transformers as hf

pytestmark = pytest.mark.cuda

transformers = pytest.importorskip("transformers")


def test_packed_row_gives_each_sequence_its_bits_alone():
    model = make_hf_model("sdpa", **CUDA_CONFIG).to(device="cuda", dtype=torch.bfloat16)
    hf.apply_batchinv_to_qwen3(model)
    # crosses the kernels' 64-key blocks, and a one-token sequence
    assert_packed_row_matches_alone(model, (70, 1, 130, 33), device="cuda")
