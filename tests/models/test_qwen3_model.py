"""batchinv.models.Qwen3 on the CPU: parity with transformers' Qwen3ForCausalLM holding the
same random weights (fp32 and bf16, within the contract), bitwise invariance across every way
of computing a sequence (batchinv ops), checkpoints, generation, token logprobs with
autograd, and the bad-input errors (all raised before any work)."""

from __future__ import annotations

import json

import pytest
import torch

from batchinv.contract import assert_bitwise_equal, assert_within_tolerance, deterministic_context
from batchinv.models import Qwen3, Qwen3Config
from batchinv.models.qwen3 import check_device_dtype, random_state_dict
from batchinv.models.qwen3.weights import save_safetensors

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

CONFIG = Qwen3Config.tiny()
VOCAB = CONFIG.vocab_size
# Logits: the fp32 "reduction" class, as tests/chain/test_hf_qwen3_parity.py (the gap to HF is
# summation order).  bf16: the model's output that RL consumes is the logprob, judged by the
# "logprob" class at bf16 against HF's strict fp32 logprobs from the same bf16 weights.
LOGITS_CLASS = "reduction"


def hf_model(state_dict):
    config = transformers.Qwen3Config(**CONFIG.to_dict(), attn_implementation="eager")
    model = transformers.Qwen3ForCausalLM(config).eval()
    # strict: our parameter names are exactly Hugging Face's
    model.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
    return model


def hf_logits(model, ids, mask=None):
    with torch.no_grad(), deterministic_context():
        return model(input_ids=ids, attention_mask=mask).logits


def token_ids(batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("ops", ["batchinv", "stock"])
def test_fp32_logits_match_hf(ops):
    weights = random_state_dict(CONFIG, seed=0)
    hf = hf_model(weights)
    model = Qwen3(CONFIG, weights, ops=ops)
    ids = token_ids(3, 70, seed=1)
    expected = hf_logits(hf, ids)
    with torch.no_grad():
        got = model(ids)
    assert got.dtype == torch.float32 and got.shape == (3, 70, VOCAB)
    assert_within_tolerance(got, expected, op_class=LOGITS_CLASS)
    # Not vacuous: the logits spread, and another model's are far outside the tolerance.
    assert expected.std() > 0.5
    other = hf_logits(hf_model(random_state_dict(CONFIG, seed=1)), ids)
    with pytest.raises(AssertionError):
        assert_within_tolerance(got, other, op_class=LOGITS_CLASS)


def test_fp32_padded_batch_matches_hf_on_real_tokens():
    weights = random_state_dict(CONFIG, seed=2)
    ids = token_ids(3, 40, seed=2)
    seqlens = torch.tensor([40, 17, 29])
    mask = (torch.arange(40)[None, :] < seqlens[:, None]).long()
    expected = hf_logits(hf_model(weights), ids, mask)
    with torch.no_grad():
        got = Qwen3(CONFIG, weights)(ids, seqlens=seqlens)
    for b, n in enumerate(seqlens.tolist()):
        assert_within_tolerance(got[b, :n], expected[b, :n], op_class=LOGITS_CLASS)


@pytest.mark.parametrize("seed", [0, 3])
def test_bf16_logprobs_match_hf_fp32(seed):
    weights = random_state_dict(CONFIG, seed=seed, dtype=torch.bfloat16)
    hf = hf_model(weights)  # fp32 copy of the same bf16 weights: the strict reference
    ids = token_ids(3, 70, seed=seed)
    expected = torch.log_softmax(hf_logits(hf, ids), dim=-1)
    model = Qwen3(CONFIG, weights)
    with torch.no_grad():
        logits = model(ids)
    assert logits.dtype == torch.bfloat16
    got = model.ops.log_softmax(logits)
    assert got.dtype == torch.float32
    assert_within_tolerance(got, expected, op_class="logprob", dtype=torch.bfloat16)
    other = torch.log_softmax(hf_logits(hf_model(random_state_dict(CONFIG, seed=9)), ids), -1)
    with pytest.raises(AssertionError):
        assert_within_tolerance(got, other, op_class="logprob", dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batchinv_bitwise_across_prefill_chunks_decode_and_packing(dtype):
    model = Qwen3.from_config(seed=4, dtype=dtype)
    seq = token_ids(1, 67, seed=5)
    with torch.no_grad():
        alone = model(seq)
        batch = token_ids(3, 80, seed=6)
        batch[1, :67] = seq[0]
        padded = model(batch, seqlens=torch.tensor([80, 67, 9]))
        assert_bitwise_equal(padded[1:2, :67], alone, name="in a padded batch")

        chunked = model.prefill_chunked(seq, [5, 7, 1, 30, 24])  # 43 | 67 crosses 64
        assert_bitwise_equal(chunked, alone, name="chunked prefill")

        others = token_ids(2, 30, seed=7)
        packed_ids = torch.cat([others[0], seq[0], others[1, :11]])
        cu = torch.tensor([0, 30, 97, 108])
        packed = model(packed_ids, cu_seqlens=cu)
        assert_bitwise_equal(packed[30:97][None], alone, name="varlen packed")

        caches = model.new_caches(2, 80)
        prompt = 20
        companion = token_ids(2, prompt, seed=8)
        companion[0] = seq[0, :prompt]
        steps = [model(companion, caches=caches)[0:1]]
        for t in range(prompt, 67):
            step = torch.stack([seq[0, t : t + 1], token_ids(1, 1, seed=t)[0]])
            steps.append(model(step, caches=caches)[0:1])
        assert_bitwise_equal(torch.cat(steps, dim=1), alone, name="prefill + decode")


def test_stock_ops_are_a_different_path():
    """The stock table really runs other kernels: not bitwise the batchinv logits."""
    model = Qwen3.from_config(seed=0, dtype=torch.bfloat16)
    ids = token_ids(2, 30, seed=0)
    with torch.no_grad():
        a, b = model(ids), model(ids, ops="stock")
    assert not torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert_within_tolerance(
        model.ops.log_softmax(b),
        model.ops.log_softmax(a).float(),
        op_class="logprob",
        dtype=torch.bfloat16,
    )


def test_stock_decode_with_repeated_kv_heads(monkeypatch):
    """``with_repeated_kv_heads``: the stock cached attention hands SDPA one kv head per query
    head (no ``enable_gqa``), as transformers does with a mask, and decodes the same logits."""
    from batchinv.models.qwen3 import ops as qwen3_ops

    model = Qwen3.from_config(seed=0, dtype=torch.float32)
    table = qwen3_ops.with_repeated_kv_heads(qwen3_ops.STOCK_OPS)
    assert table.name == "stock-repeat-kv"
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.shape[1], k.shape[1], kwargs["enable_gqa"]))
        return sdpa(q, k, v, **kwargs)

    ids = token_ids(2, 9, seed=1)
    logits = {}
    with torch.no_grad():
        for name, ops in (("gqa", qwen3_ops.STOCK_OPS), ("repeat", table)):
            caches = model.new_caches(2, 16)
            model(ids[:, :8], caches=caches, ops=ops)
            seen.clear()
            monkeypatch.setattr(qwen3_ops.F, "scaled_dot_product_attention", spy)
            logits[name] = model(ids[:, 8:], caches=caches, ops=ops)
            monkeypatch.undo()
            heads = CONFIG.num_attention_heads
            kv_heads = CONFIG.num_key_value_heads
            want = (heads, heads, False) if name == "repeat" else (heads, kv_heads, True)
            assert seen and all(call == want for call in seen), (name, seen)
    assert_within_tolerance(logits["repeat"], logits["gqa"], op_class=LOGITS_CLASS)


@pytest.mark.parametrize("sharded", [False, True])
def test_from_pretrained_round_trip(tmp_path, sharded):
    model = Qwen3.from_config(seed=1, dtype=torch.bfloat16)
    if sharded:
        CONFIG.save(tmp_path)
        state = model.hf_state_dict()
        names = sorted(state)
        halves = {"model-00001-of-00002.safetensors": names[::2]}
        halves["model-00002-of-00002.safetensors"] = names[1::2]
        weight_map = {}
        for file, part in halves.items():
            sub = tmp_path / "tmp"
            sub.mkdir(exist_ok=True)
            save_safetensors({n: state[n] for n in part}, sub).rename(tmp_path / file)
            weight_map |= {n: file for n in part}
        index = {"metadata": {}, "weight_map": weight_map}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        model.save_pretrained(tmp_path)
    loaded = Qwen3.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.config == model.config
    ids = token_ids(2, 12, seed=3)
    with torch.no_grad():
        assert_bitwise_equal(loaded(ids), model(ids), name="reloaded logits")
    # Loading casts: the same checkpoint in fp32 holds the bf16 values exactly.
    loaded32 = Qwen3.from_pretrained(tmp_path, dtype=torch.float32)
    assert loaded32.dtype == torch.float32
    w = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(loaded32.hf_state_dict()[w], model.hf_state_dict()[w].float())


def test_hf_config_json_is_read(tmp_path):
    hf_config = transformers.Qwen3Config(**CONFIG.to_dict())
    hf_config.save_pretrained(tmp_path)
    assert Qwen3Config.from_json(tmp_path) == CONFIG


def test_generate_greedy_and_seeded_are_batch_invariant():
    model = Qwen3.from_config(seed=2, dtype=torch.bfloat16)
    prompt = [5, 17, 300, 2]
    others = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [400]]
    alone = model.generate([prompt], 6)[0]
    in_batch = model.generate([others[0], prompt, others[1]], 6)[1]
    assert alone[:4].tolist() == prompt and alone.numel() == 10
    assert_bitwise_equal(in_batch, alone, name="greedy tokens")

    def sample(prompts, index):
        gens = [torch.Generator().manual_seed(100 + i) for i in range(len(prompts))]
        gens[index] = torch.Generator().manual_seed(42)
        return model.generate(prompts, 6, generator=gens, temperature=1.5)[index]

    sampled = sample([prompt], 0)
    assert_bitwise_equal(sample([others[0], prompt, others[1]], 1), sampled, name="sampled")
    assert_bitwise_equal(sample([prompt], 0), sampled, name="sampled again")
    # the seed matters (sampling is not greedy in disguise)
    gens = [torch.Generator().manual_seed(s) for s in range(8)]
    draws = {
        tuple(model.generate([prompt], 6, generator=[g], temperature=1.5)[0].tolist()) for g in gens
    }
    assert len(draws) > 1


def test_token_logprobs_values_invariance_and_autograd():
    model = Qwen3.from_config(seed=3)
    seqs = [token_ids(1, n, seed=n)[0] for n in (12, 30, 7)]
    prompts = [4, 29, 7]  # 8 completion tokens, 1, and none
    got = model.token_logprobs(seqs, prompts)
    assert [t.shape for t in got] == [(8,), (1,), (0,)]
    assert all(t.dtype == torch.float32 for t in got)
    # the definition: log_softmax of the sequence's own logits at the previous position
    with torch.no_grad():
        full = model.ops.log_softmax(model(seqs[0][None]))[0]
    expected = full[3:11].gather(-1, seqs[0][4:12, None])[:, 0]
    assert_bitwise_equal(got[0].detach(), expected, name="token logprobs vs forward")
    # batch invariance: the sequence alone gives the same bits
    assert_bitwise_equal(model.token_logprobs([seqs[0]], [4])[0].detach(), got[0].detach())
    # autograd reaches every parameter; the gradient matches the stock ops' within fp32 grads
    loss = -(got[0].sum() + got[1].sum())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert all(g is not None and bool(g.abs().sum() > 0) for g in grads.values())
    model.zero_grad()
    stock = model.token_logprobs(seqs, prompts, ops="stock")
    (-(stock[0].sum() + stock[1].sum())).backward()
    for name, p in model.named_parameters():
        assert_within_tolerance(grads[name], p.grad, op_class="reduction", kind="grad", name=name)


# ----- bad input: each error before any work --------------------------------------------


def write_checkpoint(path, state=None, config_dict=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_dict or CONFIG.to_dict()))
    save_safetensors(state if state is not None else random_state_dict(CONFIG, 0), path)
    return path


def test_not_a_qwen3_checkpoint(tmp_path):
    config = CONFIG.to_dict() | {"model_type": "llama"}
    with pytest.raises(ValueError, match="model_type must be 'qwen3'.*'llama'"):
        Qwen3.from_pretrained(write_checkpoint(tmp_path, config_dict=config))
    config = CONFIG.to_dict()
    del config["hidden_size"]
    with pytest.raises(ValueError, match="missing required keys: hidden_size"):
        Qwen3.from_pretrained(write_checkpoint(tmp_path / "b", config_dict=config))
    with pytest.raises(FileNotFoundError, match="config.json"):
        Qwen3.from_pretrained(tmp_path / "nothing")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text(json.dumps(CONFIG.to_dict()))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        Qwen3.from_pretrained(tmp_path / "c")


def test_missing_misshaped_and_foreign_tensors(tmp_path):
    state = random_state_dict(CONFIG, 0)
    del state["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(KeyError, match="k_norm"):
        Qwen3.from_pretrained(write_checkpoint(tmp_path / "a", state))
    state = random_state_dict(CONFIG, 0)
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(
        ValueError, match=r"up_proj.weight has shape \(3, 3\), expected \(128, 64\)"
    ):
        Qwen3.from_pretrained(write_checkpoint(tmp_path / "b", state))
    state = random_state_dict(CONFIG, 0) | {"model.layers.0.mlp.experts.0.w1": torch.zeros(2)}
    with pytest.raises(ValueError, match="does not use"):
        Qwen3.from_pretrained(write_checkpoint(tmp_path / "c", state))
    state = random_state_dict(CONFIG, 0)
    state["model.norm.weight"] = state["model.norm.weight"].double()
    with pytest.raises(TypeError, match="model.norm.weight has dtype F64"):
        Qwen3.from_pretrained(write_checkpoint(tmp_path / "d", state))


def test_checkpoint_checked_before_any_tensor_is_read(tmp_path, monkeypatch):
    state = random_state_dict(CONFIG, 0)
    state["lm_head.weight"] = torch.zeros(VOCAB, 3)
    path = write_checkpoint(tmp_path, state)
    import safetensors

    reads = []
    real = safetensors.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.inner = real(*args, **kwargs)

        def __enter__(self):
            self.handle = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_slice(self, name):
            return self.handle.get_slice(name)

        def get_tensor(self, name):
            reads.append(name)
            return self.handle.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    with pytest.raises(ValueError, match="lm_head.weight has shape"):
        Qwen3.from_pretrained(path)
    assert reads == []
    # the spy sees reads when the checkpoint is good (it is not vacuous)
    Qwen3.from_pretrained(write_checkpoint(tmp_path / "good"))
    assert "lm_head.weight" in reads


def test_dtype_the_device_cannot_run(monkeypatch):
    with pytest.raises(TypeError, match="dtype must be float32, bfloat16 or float16"):
        Qwen3.from_config(dtype=torch.float64)
    with pytest.raises(TypeError, match="dtype must be"):
        check_device_dtype("cpu", torch.int32)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            Qwen3.from_config(device="cuda", dtype=torch.bfloat16)
    # A GPU without bf16: refused up front, naming the card (no GPU needed to check this).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Old GPU")
    with pytest.raises(TypeError, match="Old GPU does not support bfloat16"):
        check_device_dtype("cuda", torch.bfloat16)
    with pytest.raises(TypeError, match="float32 runs on the CPU"):
        check_device_dtype("cuda", torch.float32)


def test_bad_call_arguments():
    model = Qwen3.from_config(seed=0)
    with pytest.raises(IndexError):
        model(torch.tensor([[1, VOCAB]]))
    with pytest.raises(TypeError, match="input_ids"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(
            torch.zeros(4, dtype=torch.int64),
            cu_seqlens=torch.tensor([0, 4]),
            seqlens=torch.tensor([4]),
        )
    with pytest.raises(ValueError, match="chunk_lengths"):
        model.prefill_chunked(torch.zeros(1, 5, dtype=torch.int64), [2, 2])
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate([[1, 2]], 0)
    with pytest.raises(ValueError, match=r"prompt_lens\[0\] = 5"):
        model.token_logprobs([[1, 2, 3]], [5])
    with pytest.raises(ValueError, match="ops must be one of"):
        model(torch.zeros(1, 3, dtype=torch.int64), ops="cublas")


def test_batchinv_table_on_cpu_is_the_reference_chain():
    """On the CPU batchinv's ops are the references: the model's logits are bitwise those of
    ``qwen3_forward`` with the reference table (one chain, two tables, the same bits)."""
    from batchinv.reference.qwen3_chain import qwen3_forward

    weights = random_state_dict(CONFIG, seed=6, dtype=torch.bfloat16)
    ids = token_ids(2, 20, seed=6)
    with torch.no_grad():
        got = Qwen3(CONFIG, weights)(ids, seqlens=torch.tensor([20, 13]))
    expected = qwen3_forward(ids, weights, CONFIG, seqlens=torch.tensor([20, 13]))
    assert_bitwise_equal(got, expected, name="batchinv table vs reference table")
