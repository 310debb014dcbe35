"""Qwen3's generate / token_logprobs / prefill_chunked and its config under bad input (CPU):
strict integer types (no silent int()), limits checked before the prefill, and the model's
parameters unchanged."""

from __future__ import annotations

import pytest
import torch

from _adversarial import Case, host_ids, ids, run_case, tiny_model
from batchinv.models.qwen3 import Qwen3Config
from batchinv.reference.qwen3_chain import Qwen3ChainConfig


def _setup():
    return {"model": tiny_model("cpu", torch.float32)}


def _generate(prompts, max_new_tokens=2, **kw):
    return lambda s: s["model"].generate(prompts, max_new_tokens, **kw)


def _good_generate(s):
    return s["model"].generate([[1, 2, 3], [4]], 2)


def _logprobs(prompt_lens, sequences=((1, 2, 3), (4, 5))):
    return lambda s: s["model"].token_logprobs([list(q) for q in sequences], prompt_lens)


def _good_logprobs(s):
    with torch.no_grad():
        return s["model"].token_logprobs([[1, 2, 3], [4, 5]], [1, 1])


def _chunked(chunks):
    return lambda s: s["model"].prefill_chunked(torch.arange(1, 7).view(2, 3), chunks)


def _good_chunked(s):
    with torch.no_grad():
        return s["model"].prefill_chunked(torch.arange(1, 7).view(2, 3), [2, 1])


LIMIT = Qwen3Config.tiny().max_position_embeddings
GENERATE = [
    ("float_ids", _generate([[1.7, 2.2]]), TypeError, r"prompts\[0\]"),  # was truncated to [1, 2]
    ("bool_ids", _generate([[True, 2]]), TypeError, r"prompts\[0\]"),
    ("str_prompts", _generate("hello"), TypeError, "prompts"),
    ("empty_prompts", _generate([]), TypeError, "prompts"),
    ("empty_sequence", _generate([[1], []]), ValueError, r"prompts\[1\]"),
    ("id_beyond_int64", _generate([[2**70]]), ValueError, r"prompts\[0\]\[0\]"),
    ("id_past_vocab", _generate([[1, 512]]), IndexError, "ids"),
    ("id_negative", _generate([[-1]]), IndexError, "ids"),
    ("float_tensor_ids", _generate([torch.tensor([1.0, 2.0])]), TypeError, r"prompts\[0\]"),
    ("max_new_tokens_zero", _generate([[1]], 0), ValueError, "max_new_tokens"),
    ("max_new_tokens_float", _generate([[1]], 1.5), TypeError, "max_new_tokens"),
    ("max_new_tokens_bool", _generate([[1]], True), TypeError, "max_new_tokens"),
    ("past_max_position", _generate([[1, 2]], LIMIT - 1), ValueError, "max_new_tokens"),
    ("temperature_zero", _generate([[1]], temperature=0.0), ValueError, "temperature"),
    ("temperature_nan", _generate([[1]], temperature=float("nan")), ValueError, "temperature"),
    ("temperature_bool", _generate([[1]], temperature=True), TypeError, "temperature"),
    (
        "generators_count",
        _generate([[1], [2]], generator=[torch.Generator()]),
        TypeError,
        "generator",
    ),
]
LOGPROBS = [
    ("prompt_lens_float", _logprobs([1.9, 1]), TypeError, r"prompt_lens\[0\]"),  # was int() = 1
    ("prompt_lens_str", _logprobs(["1", 1]), TypeError, r"prompt_lens\[0\]"),
    ("prompt_lens_scalar", _logprobs(1), TypeError, "prompt_lens"),
    ("prompt_lens_bool", _logprobs([True, 1]), TypeError, r"prompt_lens\[0\]"),
    ("prompt_lens_float_tensor", _logprobs(torch.ones(2)), TypeError, "prompt_lens"),
    ("prompt_lens_count", _logprobs([1]), ValueError, "prompt_lens"),
    ("prompt_lens_zero", _logprobs([0, 1]), ValueError, r"prompt_lens\[0\]"),
    ("prompt_lens_past", _logprobs([1, 3]), ValueError, r"prompt_lens\[1\]"),
    ("sequences_float", _logprobs([1, 1], ((1.0, 2.0), (3, 4))), TypeError, r"sequences\[0\]"),
]
CHUNKED = [
    ("chunk_lengths_float", _chunked([1.5, 1.5]), TypeError, r"chunk_lengths\[0\]"),
    ("chunk_lengths_sum", _chunked([1, 1]), ValueError, "chunk_lengths"),
    ("chunk_lengths_zero", _chunked([3, 0]), ValueError, "chunk_lengths"),
    ("chunk_lengths_scalar", _chunked(3), TypeError, "chunk_lengths"),
]


def _with_caches(max_len=8, filled=0):
    def setup():
        model = tiny_model("cpu", torch.float32)
        caches = model.new_caches(2, max_len)
        for cache in caches:
            cache.set_lengths(filled)
        return {"model": model, "caches": caches}

    return setup


def _chunked_into(ids_, chunks=(2, 1)):
    @torch.no_grad()
    def run(s):
        return s["model"].prefill_chunked(ids_, list(chunks), caches=s["caches"])

    return run


_GOOD_IDS = torch.arange(1, 7).view(2, 3)
_BAD_LAST_CHUNK = torch.tensor([[1, 2, 3], [4, 5, 512]])  # only the last chunk is bad
NEAR_END = LIMIT - 2
CHUNKED_INTO_CACHES = [
    (
        "bad_id_in_last_chunk",
        _with_caches(),
        _chunked_into(_BAD_LAST_CHUNK),
        IndexError,
        "input_ids",
    ),
    ("past_capacity", _with_caches(max_len=2), _chunked_into(_GOOD_IDS), ValueError, "max_len=2"),
    (
        "past_positions",
        _with_caches(LIMIT + 4, NEAR_END),
        _chunked_into(_GOOD_IDS),
        ValueError,
        "max_position",
    ),
]
CASES = (
    [Case(f"generate_{n}", _setup, bad, e, m, _good_generate) for n, bad, e, m in GENERATE]
    + [Case(f"token_logprobs_{n}", _setup, bad, e, m, _good_logprobs) for n, bad, e, m in LOGPROBS]
    + [Case(f"prefill_chunked_{n}", _setup, bad, e, m, _good_chunked) for n, bad, e, m in CHUNKED]
    + [
        Case(f"prefill_chunked_{n}", setup, bad, e, m, _chunked_into(_GOOD_IDS[:, :1], (1,)))
        for n, setup, bad, e, m in CHUNKED_INTO_CACHES
    ]
)


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_bad_call_changes_nothing(case):
    run_case(case)


def test_generate_checks_the_position_limit_before_the_prefill(monkeypatch):
    """prompt + max_new_tokens past max_position_embeddings fails before any forward."""
    model = tiny_model("cpu", torch.float32)
    calls = []
    monkeypatch.setattr(type(model), "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate([[1, 2, 3]], LIMIT - 2)
    assert calls == []


TINY = Qwen3Config.tiny().to_dict()
CONFIGS = [
    ("rms_norm_eps_zero", {"rms_norm_eps": 0.0}, ValueError, "rms_norm_eps"),
    ("rms_norm_eps_negative", {"rms_norm_eps": -1e-6}, ValueError, "rms_norm_eps"),
    ("rms_norm_eps_underflow", {"rms_norm_eps": 1e-50}, ValueError, "rms_norm_eps"),
    ("rope_theta_zero", {"rope_theta": 0.0}, ValueError, "rope_theta"),
    ("rope_theta_inf", {"rope_theta": float("inf")}, ValueError, "rope_theta"),
    ("head_dim_odd", {"head_dim": 7}, ValueError, "head_dim"),
    ("max_position_huge", {"max_position_embeddings": 2**25}, ValueError, "max_position"),
    ("heads_not_multiple", {"num_key_value_heads": 3}, ValueError, "num_key_value_heads"),
    ("vocab_zero", {"vocab_size": 0}, ValueError, "vocab_size"),
]


@pytest.mark.parametrize(("name", "change", "error", "match"), CONFIGS, ids=[c[0] for c in CONFIGS])
def test_config_that_cannot_run_fails_where_it_is_made(name, change, error, match):
    with pytest.raises(error, match=match):
        Qwen3Config.from_dict(TINY | change)
    with pytest.raises(error, match=match):
        fields = {k: v for k, v in (TINY | change).items() if k in Qwen3ChainConfig.__annotations__}
        Qwen3ChainConfig(**fields)


def test_seq_ids_host_copy_is_not_mutated():
    """seq_ids given as a CPU tensor is read, never written."""
    model = tiny_model("cpu", torch.float32)
    caches = model.new_caches(3, 4)
    seq_ids = host_ids(2, 0)
    with torch.no_grad():
        model(torch.ones(2, 1, dtype=torch.int64), caches=caches, seq_ids=seq_ids)
    assert seq_ids.tolist() == [2, 0]
