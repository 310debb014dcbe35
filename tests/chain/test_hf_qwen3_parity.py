"""The reference Qwen3 chain against Hugging Face ``Qwen3ForCausalLM`` (eager, fp32).

transformers is a test-only dependency (pyproject ``[test]`` extra); it is installed where
these tests run, so they run.  HF's fp32 eager path uses BLAS matmuls and torch's softmax,
whose summation orders differ from the reference's fixed orders, so the logits agree within
the contract's fp32 tolerance, not bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from batchinv.contract import assert_bitwise_equal, assert_within_tolerance, deterministic_context
from batchinv.reference.qwen3_chain import (
    Qwen3ChainConfig,
    Qwen3Reference,
    check_qwen3_state_dict,
    make_kv_caches,
    qwen3_forward,
    qwen3_forward_fp32,
)

transformers = pytest.importorskip("transformers")

from _hf_tiny_qwen3 import make_hf_model as make_tiny_hf_model  # noqa: E402
from _hf_tiny_qwen3 import token_ids  # noqa: E402

# Logit parity uses the fp32 "reduction" class.  The logits are the end of a chain of fp32
# reductions (linears, RMSNorms, attention's PV sum) ending in the lm_head linear, and the gap
# to HF is summation order (BLAS and torch's softmax vs the fixed orders); measured here at
# about 0.35 of the reduction entry.  The "attention" entry (atol 3e-6) is calibrated on one
# attention op and is too tight for small logits after two layers (about 2x over); the
# "logprob" entry (atol 1.7e-4, sized for a 32k-wide log_softmax) would be ~20x too loose
# to catch much.
LOGITS_CLASS = "reduction"


def make_hf_model(seed: int = 0, **overrides):
    return make_tiny_hf_model("eager", seed, **overrides)


def hf_logits(model, input_ids, attention_mask=None):
    with torch.no_grad(), deterministic_context():
        return model(input_ids=input_ids, attention_mask=attention_mask).logits


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_hf_eager_fp32(tied):
    model = make_hf_model(tie_word_embeddings=tied)
    config = Qwen3ChainConfig.from_hf(model.config.to_dict())
    assert config.tie_word_embeddings is tied
    ids = token_ids(3, 70, seed=1)
    expected = hf_logits(model, ids)
    got = qwen3_forward_fp32(ids, model.state_dict(), config)
    assert got.dtype == torch.float32 and got.shape == (3, 70, 256)
    assert_within_tolerance(got, expected, op_class=LOGITS_CLASS)
    # Not vacuous: the logits spread widely and a different model is far outside tolerance.
    assert expected.std() > 0.5
    other = hf_logits(make_hf_model(seed=1, tie_word_embeddings=tied), ids)
    with pytest.raises(AssertionError):
        assert_within_tolerance(got, other, op_class=LOGITS_CLASS)


def test_right_padded_batch_matches_hf_on_real_tokens():
    model = make_hf_model()
    config = Qwen3ChainConfig.from_hf(model.config)
    ids = token_ids(3, 40, seed=2)
    seqlens = torch.tensor([40, 17, 29])
    mask = (torch.arange(40)[None, :] < seqlens[:, None]).long()
    expected = hf_logits(model, ids, mask)
    got = qwen3_forward_fp32(ids, model.state_dict(), config, seqlens=seqlens)
    for b, n in enumerate(seqlens.tolist()):
        assert_within_tolerance(got[b, :n], expected[b, :n], op_class=LOGITS_CLASS)


def test_chain_rows_bitwise_across_batch_and_decode():
    """Axis-A on the whole chain: a sequence's logits alone, in a padded batch, and fed
    token by token through per-layer KV caches (after a prefill of its prompt)."""
    model = make_hf_model()
    config = Qwen3ChainConfig.from_hf(model.config)
    weights = model.state_dict()
    seq = token_ids(1, 30, seed=3)
    alone = qwen3_forward(seq, weights, config)

    batch = token_ids(3, 36, seed=4)
    batch[1, :30] = seq[0]
    in_batch = qwen3_forward(batch, weights, config, seqlens=torch.tensor([36, 30, 11]))
    assert_bitwise_equal(in_batch[1:2, :30], alone, name="sequence in a padded batch")

    caches = make_kv_caches(config, batch=2, max_len=64)
    prompt = 20
    companion = token_ids(2, prompt, seed=5)
    companion[0] = seq[0, :prompt]
    steps = [qwen3_forward(companion, weights, config, caches=caches)[0:1]]
    for t in range(prompt, 30):
        step_ids = torch.stack([seq[0, t : t + 1], token_ids(1, 1, seed=t)[0]])
        steps.append(qwen3_forward(step_ids, weights, config, caches=caches)[0:1])
    assert_bitwise_equal(torch.cat(steps, dim=1), alone, name="prefill + decode")


def test_module_parameters_and_low_precision_path():
    model = make_hf_model()
    config = Qwen3ChainConfig.from_hf(model.config)
    weights = {name: t.to(torch.bfloat16) for name, t in model.state_dict().items()}
    module = Qwen3Reference(weights, config)
    assert sum(p.numel() for p in module.parameters()) == sum(p.numel() for p in model.parameters())
    ids = token_ids(2, 12, seed=6)
    low = module(ids)
    assert low.dtype == torch.bfloat16
    assert_bitwise_equal(low, qwen3_forward(ids, weights, config), name="module forward")
    assert module.forward_fp32(ids).dtype == torch.float32


def test_config_and_state_dict_errors():
    model = make_hf_model()
    d = model.config.to_dict()
    with pytest.raises(ValueError, match="sliding"):
        Qwen3ChainConfig.from_hf(d | {"use_sliding_window": True, "sliding_window": 8})
    with pytest.raises(ValueError, match="rope_type"):
        Qwen3ChainConfig.from_hf(d | {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="model_type"):
        Qwen3ChainConfig.from_hf(d | {"model_type": "qwen3_moe"})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        Qwen3ChainConfig.from_hf(d | {"num_key_value_heads": 3})
    config = Qwen3ChainConfig.from_hf(d)
    weights = dict(model.state_dict())
    del weights["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(KeyError, match="k_norm"):
        check_qwen3_state_dict(weights, config)
    weights = dict(model.state_dict())
    weights["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"up_proj.weight must have shape \(128, 64\)"):
        check_qwen3_state_dict(weights, config)
    weights = dict(model.state_dict()) | {"model.layers.0.mlp.experts.0.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="does not use"):
        check_qwen3_state_dict(weights, config)
