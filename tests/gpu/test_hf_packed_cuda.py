"""A trainer's packed row through a patched Hugging Face Qwen3 on the GPU: the block-diagonal
causal mask transformers builds from restarting ``position_ids`` is routed as one causal run
per sequence, so each sequence's logits are its logits alone, bit for bit, and its gradients
reach every weight."""

from __future__ import annotations

import pytest
import torch

from _hf_tiny_qwen3 import assert_packed_row_matches_alone, make_hf_model
from batchinv.integrations import transformers as hf

pytestmark = pytest.mark.cuda

transformers = pytest.importorskip("transformers")

# Head dim 128 (a size the CUDA attention kernels take), GQA 4:1.
CONFIG = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    num_hidden_layers=2,
)


def test_packed_row_gives_each_sequence_its_bits_alone():
    model = make_hf_model("sdpa", **CONFIG).to(device="cuda", dtype=torch.bfloat16)
    hf.apply_batchinv_to_qwen3(model)
    # crosses the kernels' 64-key blocks, and a one-token sequence
    assert_packed_row_matches_alone(model, (70, 1, 130, 33), device="cuda")
