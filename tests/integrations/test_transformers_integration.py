"""Hugging Face integration: the "batchinv" attention implementation and
``apply_batchinv_to_qwen3`` (instance and class patching), on the tiny random Qwen3."""

from __future__ import annotations

import sys

import pytest
import torch

import batchinv
from _hf_tiny_qwen3 import (
    assert_packed_row_matches_alone,
    logits,
    make_hf_model,
    sweep_cases,
    token_ids,
)
from batchinv.contract import assert_bitwise_equal, assert_within_tolerance
from batchinv.integrations import transformers as hf

transformers = pytest.importorskip("transformers")
modeling = transformers.models.qwen3.modeling_qwen3

# As in tests/chain/test_hf_qwen3_parity.py: logits after two layers are judged with the fp32
# "reduction" class (the gap to HF is summation order only).
LOGITS_CLASS = "reduction"


def _assert_sweep_bitwise(model, target, label):
    alone = logits(model, target[None])[0]
    for case in sweep_cases(target):
        got = logits(model, case.ids, case.mask)[case.row, : target.numel()]
        assert_bitwise_equal(got, alone, name=f"{label}: {case.name}")
    return alone


@pytest.mark.parametrize("tied", [False, True])
def test_patched_model_matches_hf_and_is_batch_invariant(tied):
    model = make_hf_model("sdpa", tie_word_embeddings=tied)
    target = token_ids(1, 11, seed=1)[0]
    ids = token_ids(3, 11, seed=2)
    stock = logits(model, ids)
    undo = hf.apply_batchinv_to_qwen3(model)
    try:
        assert isinstance(model.lm_head, batchinv.nn.Linear)
        assert isinstance(model.model.layers[0].mlp.down_proj, batchinv.nn.Linear)
        assert model.config._attn_implementation == "batchinv"
        assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
        patched = logits(model, ids)
        assert_within_tolerance(patched, stock, op_class=LOGITS_CLASS)
        assert not torch.equal(patched, stock)  # batchinv really ran (different order)
        _assert_sweep_bitwise(model, target, f"patched (tied={tied})")
    finally:
        undo()
    assert type(model.lm_head) is torch.nn.Linear
    assert model.config._attn_implementation == "sdpa"
    assert_bitwise_equal(logits(model, ids), stock, name="after undo")


def test_patched_logits_equal_the_reference_chain():
    """The patched HF model runs exactly batchinv's chain: bitwise equal to
    batchinv.reference.qwen3_chain.qwen3_forward on the same weights (fp32)."""
    from batchinv.reference.qwen3_chain import Qwen3ChainConfig, qwen3_forward

    model = make_hf_model("sdpa")
    config = Qwen3ChainConfig.from_hf(model.config)
    ids = token_ids(2, 9, seed=3)
    hf.apply_batchinv_to_qwen3(model)
    got = logits(model, ids)
    want = qwen3_forward(ids, model.state_dict(), config)
    assert_bitwise_equal(got, want, name="patched HF vs reference chain")


def test_flags_select_what_is_patched():
    model = make_hf_model("sdpa")
    undo = hf.apply_batchinv_to_qwen3(model, rms_norm=False, linear=False, attention=False)
    layer = model.model.layers[0]
    assert "forward" not in layer.input_layernorm.__dict__
    assert "forward" in layer.mlp.__dict__ and "forward" in layer.self_attn.__dict__
    assert type(layer.mlp.up_proj) is torch.nn.Linear
    assert model.config._attn_implementation == "sdpa"
    ids = token_ids(2, 7, seed=4)
    undo()
    assert "forward" not in layer.mlp.__dict__
    with pytest.raises(TypeError, match="rope must be a bool"):
        hf.apply_batchinv_to_qwen3(model, rope=1)
    with pytest.raises(TypeError, match="Qwen3 model"):
        hf.apply_batchinv_to_qwen3(torch.nn.Linear(2, 2))
    assert logits(model, ids).shape == (2, 7, 256)


def test_class_patch_applies_to_models_built_afterwards_and_from_pretrained(tmp_path):
    source = make_hf_model("sdpa")
    source.save_pretrained(tmp_path)
    ids = token_ids(2, 8, seed=5)
    stock = logits(source, ids)
    undo = hf.apply_batchinv_to_qwen3()
    try:
        loaded = modeling.Qwen3ForCausalLM.from_pretrained(tmp_path).eval()
        assert isinstance(loaded.lm_head, batchinv.nn.Linear)
        assert loaded.config._attn_implementation == "batchinv"
        assert "forward" in loaded.model.norm.__dict__
        assert_within_tolerance(logits(loaded, ids), stock, op_class=LOGITS_CLASS)
        direct = make_hf_model("sdpa")
        hf.apply_batchinv_to_qwen3(direct)
        assert_bitwise_equal(logits(loaded, ids), logits(direct, ids), name="class vs instance")
    finally:
        undo()
    assert type(modeling.Qwen3ForCausalLM(source.config).lm_head) is torch.nn.Linear


def test_attention_implementation_with_enable_is_batch_invariant():
    """attn_implementation="batchinv" on a stock model: close to SDPA on its own (the other
    stock ops still reduce in their own order), bitwise invariant with enable() routing them."""
    hf.register_attention()
    model = make_hf_model("batchinv")
    assert model.config._attn_implementation == "batchinv"
    target = token_ids(1, 11, seed=1)[0]
    sdpa = logits(make_hf_model("sdpa"), target[None])[0]
    assert_within_tolerance(logits(model, target[None])[0], sdpa, op_class=LOGITS_CLASS)
    with batchinv.enable():
        _assert_sweep_bitwise(model, target, "attn_implementation=batchinv under enable()")


def test_generate_with_cache_equals_full_forward():
    """Decode through HF's KV cache (mask with left context) gives the full forward's bits."""
    model = make_hf_model("sdpa")
    hf.apply_batchinv_to_qwen3(model)
    prompt = token_ids(1, 6, seed=6)
    with torch.no_grad():
        out = model.generate(
            prompt,
            max_new_tokens=4,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    full = logits(model, out.sequences)
    for step, step_logits in enumerate(out.logits):
        assert_bitwise_equal(step_logits[0], full[0, 5 + step], name=f"decode step {step}")


def _generate_logits(model, ids, mask, **kwargs):
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=4,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            disable_compile=True,
            **kwargs,
        )
    return out.sequences, torch.stack(out.logits)


def test_token_major_static_cache_generates_hf_static_cache_bits():
    """batchinv's static cache stores keys token-major but is otherwise HF's StaticCache: a
    left-padded batch generates the bits of HF's own static cache (CPU: the packed route)."""
    model = make_hf_model("sdpa")
    hf.apply_batchinv_to_qwen3(model)
    ids = token_ids(2, 6, seed=7)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    cache = hf.static_cache(model, max_cache_len=16)
    got_ids, got = _generate_logits(model, ids, mask, past_key_values=cache)
    want_ids, want = _generate_logits(model, ids, mask, cache_implementation="static")
    assert torch.equal(got_ids, want_ids)
    assert_bitwise_equal(got, want, name="logits, token-major vs HF static cache")
    keys = cache.layers[0].keys
    assert keys.shape == (2, 2, 16, 16)  # HF's [B, H, L, d] view ...
    assert keys.transpose(1, 2).is_contiguous()  # ... of [B, L, H, d] storage


def test_static_cache_rejects_a_bad_length():
    model = make_hf_model("sdpa")
    for bad in (0, -3):
        with pytest.raises(ValueError, match="max_cache_len must be >= 1"):
            hf.static_cache(model, max_cache_len=bad)
    for bad in (2.5, True, "8"):
        with pytest.raises(TypeError, match="max_cache_len must be an int"):
            hf.static_cache(model, max_cache_len=bad)


def test_attention_errors():
    q = torch.randn(1, 4, 3, 16)
    k = torch.randn(1, 2, 3, 16)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="dropout"):
        hf.batchinv_attention_forward(module, q, k, k, None, dropout=0.1)
    with pytest.raises(ValueError, match="sliding_window"):
        hf.batchinv_attention_forward(module, q, k, k, None, sliding_window=2)
    out, weights = hf.batchinv_attention_forward(module, q, k, k, None, scaling=0.25)
    assert out.shape == (1, 3, 4, 16) and weights is None


def test_missing_transformers_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="needs Hugging Face transformers"):
        hf.register_attention()


def test_packed_rows_give_each_sequence_its_bits_alone():
    """A trainer's packed row: transformers builds a block-diagonal causal mask from the
    restarting ``position_ids``, which is routed as one causal run per sequence."""
    model = make_hf_model("sdpa")
    hf.apply_batchinv_to_qwen3(model)
    assert_packed_row_matches_alone(model, (5, 3, 6))
