"""Qwen3 at TP = 2, 3, 4 (CPU, gloo, the strict references) gives the TP = 1 bits of
``tp_compatible_ops``: prefill logits and final hidden, packed token logprobs, a decode with
KV caches (logits and each rank's cache heads), and eager greedy generation.

The config splits evenly at TP = 2 and 4 and unevenly at TP = 3 (ranks hold 3, 3 and 2 of
the 8 K groups: 6 / 6 / 4 q heads, 3 / 3 / 2 kv heads), with attention biases so that the
o_proj bias is added once, after the tree.  One spawn per world size runs every check.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _spawn import run_world

from batchinv.contract import assert_bitwise_equal, bitwise_equal
from batchinv.distributed.qwen3 import (
    qwen3_tp_layout,
    shard_qwen3_state_dict,
    tensor_parallel_qwen3,
    tp_compatible_ops,
    tp_compatible_qwen3,
)
from batchinv.models.qwen3 import Qwen3, Qwen3Config
from batchinv.models.qwen3.ops import BATCHINV_OPS

CONFIG = Qwen3Config(
    vocab_size=1000,  # 4 vocab tiles: TP = 3 holds 2 / 1 / 1, the last one partial
    hidden_size=64,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=32,
    attention_bias=True,
)
DTYPE = torch.float32  # every ulp of a K-order difference shows (bf16 can round it away)
SEED = 3
PREFILL_SEQLENS = (9, 5, 7)
SEQUENCES = ((9, 3), (6, 2), (11, 5))  # (length, prompt length) of the packed logprob batch
DECODE_STEPS = 4
GENERATE_TOKENS = 3


def _model() -> Qwen3:
    return Qwen3.from_config(CONFIG, seed=SEED, dtype=DTYPE)


def _inputs() -> dict[str, torch.Tensor | list]:
    g = torch.Generator().manual_seed(11)
    width = max(PREFILL_SEQLENS)
    ids = torch.randint(0, CONFIG.vocab_size, (len(PREFILL_SEQLENS), width), generator=g)
    sequences = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g) for n, _ in SEQUENCES]
    return {
        "ids": ids,
        "seqlens": torch.tensor(PREFILL_SEQLENS),
        "sequences": sequences,
        "prompt_lens": [p for _, p in SEQUENCES],
    }


@torch.no_grad()
def _run(model: Qwen3) -> dict[str, torch.Tensor | list]:
    """Everything compared, computed by one rank's model (or the single-device model)."""
    data = _inputs()
    ids, seqlens = data["ids"], data["seqlens"]
    out: dict[str, torch.Tensor | list] = {
        "hidden": model.final_hidden(ids, seqlens=seqlens),
        "logits": model(ids, seqlens=seqlens),
        "token_logprobs": model.token_logprobs(data["sequences"], data["prompt_lens"]),
    }
    batch = ids.shape[0]
    caches = model.new_caches(batch, ids.shape[1] + DECODE_STEPS)
    logits = model(ids, seqlens=seqlens, caches=caches)
    last = logits[torch.arange(batch), seqlens - 1]
    steps = []
    for _ in range(DECODE_STEPS):
        token = last.float().argmax(dim=-1)
        last = model(token[:, None], caches=caches)[:, 0]
        steps.append(last)
    out["decode_logits"] = torch.stack(steps)
    out["cache_k"] = [c.k.clone() for c in caches]
    out["cache_v"] = [c.v.clone() for c in caches]
    prompts = [s[:p] for s, p in zip(data["sequences"], data["prompt_lens"], strict=True)]
    out["generated"] = model.generate(prompts, GENERATE_TOKENS)
    return out


def _tp_worker(rank: int, world: int) -> dict:
    return _run(tensor_parallel_qwen3(_model()))


def _assert_same(actual, expected, name: str) -> None:
    if isinstance(expected, list):
        assert len(actual) == len(expected), name
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_bitwise_equal(a, e, name=f"{name}[{i}]")
    else:
        assert_bitwise_equal(actual, expected, name=name)


@pytest.fixture(scope="module")
def single() -> dict:
    """TP = 1: the whole model with ``tp_compatible_ops`` in this process."""
    return _run(tp_compatible_qwen3(_model()))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_tp_equals_tp1_compatible_bitwise(world, single, tmp_path):
    results = run_world(_tp_worker, world, tmp_path, timeout_s=240.0)
    layout = qwen3_tp_layout(CONFIG, world)
    d = CONFIG.head_dim
    for rank, result in enumerate(results):
        for name in ("hidden", "logits", "token_logprobs", "decode_logits", "generated"):
            _assert_same(result[name], single[name], f"rank {rank}/{world} {name}")
        lo, hi = layout[rank].kv_heads
        for name in ("cache_k", "cache_v"):  # [batch, len, kv_heads, d]: this rank's heads
            expected = [c[:, :, lo:hi] for c in single[name]]
            _assert_same(result[name], expected, f"rank {rank}/{world} {name}")
        assert result["cache_k"][0].shape[-2:] == (hi - lo, d)


def test_tp1_compatible_differs_from_default_only_in_row_parallel_layers(single):
    """What TP reproduces is not ``BATCHINV_OPS``' bits (so the TP test can fail if the hook
    is not wired); without the hook, the compatible table is the default table."""
    model = _model()
    data = _inputs()
    with torch.no_grad():
        default = model.final_hidden(data["ids"], seqlens=data["seqlens"])
        unhooked = replace(tp_compatible_ops(BATCHINV_OPS), row_parallel_linear=None)
        plain = model.final_hidden(data["ids"], seqlens=data["seqlens"], ops=unhooked)
    assert not bitwise_equal(single["hidden"], default)
    assert_bitwise_equal(plain, default, name="compatible table without the hook")


def test_shard_shapes_and_replicated_weights():
    model = _model()
    weights = model.hf_state_dict()
    shard, config = shard_qwen3_state_dict(weights, CONFIG, 1, 3)
    assert (config.num_attention_heads, config.num_key_value_heads) == (6, 3)
    assert config.intermediate_size == 192
    assert (config.hidden_size, config.vocab_size) == (CONFIG.hidden_size, CONFIG.vocab_size)
    p = "model.layers.0."
    assert_bitwise_equal(
        shard[p + "self_attn.q_proj.weight"], weights[p + "self_attn.q_proj.weight"][192:384]
    )
    assert_bitwise_equal(
        shard[p + "self_attn.k_proj.bias"], weights[p + "self_attn.k_proj.bias"][96:192]
    )
    assert_bitwise_equal(
        shard[p + "self_attn.o_proj.weight"], weights[p + "self_attn.o_proj.weight"][:, 192:384]
    )
    assert_bitwise_equal(
        shard[p + "mlp.down_proj.weight"], weights[p + "mlp.down_proj.weight"][:, 192:384]
    )
    for name in (p + "self_attn.o_proj.bias", "lm_head.weight", "model.embed_tokens.weight"):
        assert shard[name] is weights[name]


@pytest.mark.parametrize(
    ("changes", "world", "match"),
    [
        ({}, 0, "world must be an int"),
        ({}, 9, "world must be an int"),
        # 4 kv heads: kv-head blocks of 4 q heads; TP = 3's group boundaries cut one.
        ({"num_key_value_heads": 4}, 3, "world=3 does not fit the attention heads"),
        # intermediate 256: 4 groups of 64, so TP = 8 leaves ranks 4..7 no column.
        ({"intermediate_size": 256}, 8, "world=8 leaves rank 4"),
    ],
)
def test_layout_errors_name_world(changes, world, match):
    with pytest.raises(ValueError, match=match):
        qwen3_tp_layout(replace(CONFIG, **changes), world)


def test_runner_refuses_tensor_parallel_hooks():
    model = tp_compatible_qwen3(_model())
    with pytest.raises(ValueError, match="tensor-parallel hooks"):
        model.generate([[1, 2, 3]], 2, seeds=[0])
