"""rope reference: per-token invariance, schedules, accuracy, gradients, bad input."""

from __future__ import annotations

import pytest
import torch
from _helpers_elementwise import (
    ALL_FLOAT,
    LOW_PRECISION,
    assert_unchanged,
    generator,
    grads_with_cotangent,
    leaves,
    randn,
    snapshot,
)

from batchinv.contract import (
    assert_bitwise_equal,
    assert_no_drift,
    assert_within_tolerance,
    row_invariance_sweep,
)
from batchinv.reference.rope import (
    MAX_EXACT_POSITION,
    ROPE_TABLE_BLOCK,
    RopeReference,
    rope,
    rope_backward,
)

THETA = 1_000_000.0  # Qwen3's rope_theta
HEAD_DIM = 16
Q_HEADS, KV_HEADS = 4, 2  # GQA
MAX_TEST_POSITION = 3 * ROPE_TABLE_BLOCK + 5  # positions span several table blocks
BATCH_SIZES = (1, 3, 17, 33)


def _tokens(n: int, seed: int, dtype: torch.dtype = torch.float32):
    """``n`` random tokens: q [n, Hq, d], k [n, Hkv, d], position ids [n]."""
    gen = generator(seed)
    q = torch.randn(n, Q_HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    positions = torch.randint(0, MAX_TEST_POSITION, (n,), generator=gen)
    return q, k, positions


def _rope(q, k, positions):
    return rope(q, k, positions, theta=THETA)


def _cos_sin_f64(positions: torch.Tensor):
    """cos/sin by the documented fp32 definition (HF's), written here independently."""
    inv_freq = 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    angles = positions.float().unsqueeze(-1) * inv_freq
    return angles.cos().double().unsqueeze(-2), angles.sin().double().unsqueeze(-2)


def _rope_f64(q, k, positions):
    """Rotate-half in float64 with the fp32 cos/sin upcast (differentiable w.r.t. q, k)."""
    cos, sin = _cos_sin_f64(positions)

    def rotate(x):
        x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(q), rotate(k)


# ---------------------------------------------------------------- Axis-A (bitwise, CPU)


def _seed_from(gen: torch.Generator) -> int:
    return int(torch.randint(1 << 30, (1,), generator=gen))


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_forward_is_row_invariant(dtype):
    """Rows are tokens (q, k, position id); padding tokens get in-range position ids."""

    def make_rows(n, gen):
        return _tokens(n, _seed_from(gen), dtype)

    reports = row_invariance_sweep(lambda rows: _rope(*rows), make_rows, int_high=MAX_TEST_POSITION)
    assert_no_drift(reports)


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_input_grads_are_row_invariant(dtype):
    """Rows carry a token and its own cotangents; the op returns grad_q, grad_k per token."""

    def make_rows(n, gen):
        seed = _seed_from(gen)
        q, k, positions = _tokens(n, seed, dtype)
        cot_q, cot_k, _ = _tokens(n, seed + 1, dtype)
        return q, k, positions, cot_q, cot_k

    def op(rows):
        q, k, positions, cot_q, cot_k = rows
        return grads_with_cotangent(
            lambda a, b: _rope(a, b, positions), leaves(q, k), (cot_q, cot_k)
        )

    assert_no_drift(row_invariance_sweep(op, make_rows, int_high=MAX_TEST_POSITION))


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_token_bits_depend_only_on_its_values_and_position(dtype):
    """The same token at the same position id, in any batch, slot or neighbourhood."""
    q_probe, k_probe, _ = _tokens(1, seed=30, dtype=dtype)
    for position in (0, ROPE_TABLE_BLOCK - 1, ROPE_TABLE_BLOCK, MAX_TEST_POSITION - 1):
        positions_probe = torch.tensor([position])
        expected = _rope(q_probe, k_probe, positions_probe)
        for n in BATCH_SIZES:
            for slot in sorted({0, n // 2, n - 1}):
                for neighbours in ("random", "extreme"):
                    q, k, positions = _tokens(n, seed=31 + n, dtype=dtype)
                    if neighbours == "extreme":
                        specials = torch.tensor([float("inf"), float("nan"), -6e4, 6e4])
                        q = specials[torch.arange(q.numel()) % 4].reshape(q.shape).to(dtype)
                        k = specials[torch.arange(k.numel()) % 4].reshape(k.shape).to(dtype)
                    q[slot], k[slot], positions[slot] = q_probe[0], k_probe[0], position
                    q_rot, k_rot = _rope(q, k, positions)
                    where = f"position {position}, batch {n}, slot {slot}, {neighbours}"
                    assert_bitwise_equal(q_rot[slot : slot + 1], expected[0], name=f"q, {where}")
                    assert_bitwise_equal(k_rot[slot : slot + 1], expected[1], name=f"k, {where}")


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_prefill_chunked_prefill_and_decode_agree(dtype):
    """A sequence at absolute positions 60..82 (crossing a table block), three schedules."""
    length, start = 23, ROPE_TABLE_BLOCK - 4
    q, k, _ = _tokens(length, seed=32, dtype=dtype)
    positions = torch.arange(start, start + length)
    prefill = rope(q[None], k[None], positions[None], theta=THETA)  # [B=1, S, H, d] layout
    chunked = [_rope(q[a:b], k[a:b], positions[a:b]) for a, b in ((0, 5), (5, 12), (12, length))]
    decode = [_rope(q[t : t + 1], k[t : t + 1], positions[t : t + 1]) for t in range(length)]
    for name, parts in (("chunked prefill", chunked), ("decode", decode)):
        for i, (full, pieces) in enumerate(zip(prefill, zip(*parts, strict=True), strict=True)):
            assert_bitwise_equal(torch.cat(pieces), full[0], name=f"{name}, output {i}")


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_padded_batch_equals_packed_varlen(dtype):
    """[B, S, H, d] with [B, S] ids (padding rows at position 0) vs packed [T, H, d]."""
    lengths = (5, 1, 9)
    q, k, _ = _tokens(sum(lengths), seed=33, dtype=dtype)
    positions = torch.cat([torch.arange(100, 100 + n) for n in lengths])
    packed = _rope(q, k, positions)
    seq_len = max(lengths)
    q_pad = torch.full((len(lengths), seq_len, Q_HEADS, HEAD_DIM), float("nan")).to(dtype)
    k_pad = torch.full((len(lengths), seq_len, KV_HEADS, HEAD_DIM), float("nan")).to(dtype)
    pos_pad = torch.zeros(len(lengths), seq_len, dtype=torch.int64)
    offset = 0
    for b, n in enumerate(lengths):
        q_pad[b, :n], k_pad[b, :n] = q[offset : offset + n], k[offset : offset + n]
        pos_pad[b, :n] = positions[offset : offset + n]
        offset += n
    padded = rope(q_pad, k_pad, pos_pad, theta=THETA)
    valid = torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None]
    for i in range(2):
        assert_bitwise_equal(padded[i][valid], packed[i], name=f"output {i}")


def test_int32_positions_and_non_contiguous_inputs_give_the_same_bits():
    q, k, positions = _tokens(7, seed=34, dtype=torch.bfloat16)
    expected = _rope(q, k, positions)
    # q and k as views into one fused qkv buffer, as a qkv projection produces them.
    qkv = torch.cat((q.flatten(1), k.flatten(1), torch.zeros(7, 3, dtype=q.dtype)), dim=1)
    q_view = qkv[:, : Q_HEADS * HEAD_DIM].unflatten(1, (Q_HEADS, HEAD_DIM))
    k_view = qkv[:, Q_HEADS * HEAD_DIM : -3].unflatten(1, (KV_HEADS, HEAD_DIM))
    assert not q_view.is_contiguous()
    got = rope(q_view, k_view, positions.int(), theta=THETA)
    assert_bitwise_equal(got, expected)


# ---------------------------------------------------------------- Axis-B (accuracy)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision_forward_and_grads_within_tolerance(dtype):
    q, k, _ = _tokens(2 * 11, seed=35, dtype=dtype)
    q, k = q.reshape(2, 11, Q_HEADS, HEAD_DIM), k.reshape(2, 11, KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, 4096, (2, 11), generator=generator(36))
    module = RopeReference(HEAD_DIM, THETA)
    for got, want in zip(
        module(q, k, positions), module.forward_fp32(q, k, positions), strict=True
    ):
        assert got.dtype == dtype
        assert_within_tolerance(got, want, op_class="elementwise")

    # Cotangents in dtype: both paths get the same values (only the computation is judged).
    cotangents = (randn(*q.shape, seed=37, dtype=dtype), randn(*k.shape, seed=38, dtype=dtype))
    low = grads_with_cotangent(lambda a, b: module(a, b, positions), leaves(q, k), cotangents)
    ref = grads_with_cotangent(
        lambda a, b: module.forward_fp32(a, b, positions),
        leaves(q, k, dtype=torch.float32),
        cotangents,
    )
    for got, want in zip(low, ref, strict=True):
        assert got.dtype == dtype
        assert_within_tolerance(got, want, op_class="elementwise", kind="grad")


def test_fp32_forward_and_grads_match_float64_autograd():
    q, k, positions = _tokens(13, seed=39)
    cotangents = (randn(*q.shape, seed=40), randn(*k.shape, seed=41))
    got_out = _rope(q, k, positions)
    want_out = _rope_f64(q.double(), k.double(), positions)
    for got, want in zip(got_out, want_out, strict=True):
        assert_within_tolerance(got, want, op_class="elementwise")
    got = grads_with_cotangent(lambda a, b: _rope(a, b, positions), leaves(q, k), cotangents)
    want = grads_with_cotangent(
        lambda a, b: _rope_f64(a, b, positions), leaves(q, k, dtype=torch.float64), cotangents
    )
    for g, w in zip(got, want, strict=True):
        assert_within_tolerance(g, w, op_class="elementwise", kind="grad")
    direct = rope_backward(*cotangents, positions, theta=THETA)
    assert_bitwise_equal(direct, got, name="rope_backward vs autograd")


def test_matches_hugging_face_qwen3_rope_in_fp32():
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import (
        Qwen3RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    config = Qwen3Config(
        hidden_size=Q_HEADS * HEAD_DIM,
        num_attention_heads=Q_HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rope_theta=THETA,
        max_position_embeddings=40960,
        num_hidden_layers=1,
        intermediate_size=32,
        vocab_size=32,
    )
    batch, seq = 2, 9
    q, k, _ = _tokens(batch * seq, seed=42)
    q, k = q.reshape(batch, seq, Q_HEADS, HEAD_DIM), k.reshape(batch, seq, KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, 40960, (batch, seq), generator=generator(43))
    cos, sin = Qwen3RotaryEmbedding(config)(q, positions)
    # HF's layout is [B, H, S, d]; ours is [B, S, H, d].
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    expected = (q_hf.transpose(1, 2), k_hf.transpose(1, 2))
    got = rope(q, k, positions, theta=THETA, max_position=config.max_position_embeddings)
    for g, e in zip(got, expected, strict=True):
        assert_within_tolerance(g, e, op_class="elementwise")
    # The doc claims more: in fp32 the arithmetic is HF's, bit for bit.
    assert_bitwise_equal(got, expected)


# ---------------------------------------------------------------- edge cases and bad input


def test_empty_token_batch_gives_empty_outputs():
    q, k = torch.empty(0, Q_HEADS, HEAD_DIM), torch.empty(0, KV_HEADS, HEAD_DIM)
    q_rot, k_rot = _rope(q, k, torch.empty(0, dtype=torch.int64))
    assert q_rot.shape == q.shape and k_rot.shape == k.shape


def test_inputs_are_not_modified():
    q, k, positions = _tokens(5, seed=44)
    before = snapshot(q, k, positions)
    q_leaf, k_leaf = leaves(q, k)
    q_rot, k_rot = _rope(q_leaf, k_leaf, positions)
    (q_rot.sum() + k_rot.sum()).backward()
    assert_unchanged(before, (q_leaf, k_leaf, positions))
    assert_unchanged(before, (q, k, positions))


_Q = torch.ones(3, Q_HEADS, HEAD_DIM)
_K = torch.ones(3, KV_HEADS, HEAD_DIM)
_P = torch.arange(3)


def _call(q=_Q, k=_K, positions=_P, **kwargs):
    kwargs.setdefault("theta", THETA)
    return lambda: rope(q, k, positions, **kwargs)


BAD_CALLS = [
    ("q not a tensor", _call(q=_Q.tolist()), TypeError, "q must be a torch.Tensor"),
    ("q integer", _call(q=_Q.int()), TypeError, "^q must have dtype"),
    ("k other dtype", _call(k=_K.half()), TypeError, "k has dtype"),
    ("positions float", _call(positions=_P.float()), TypeError, "position_ids must have dtype"),
    ("positions other device", _call(positions=_P.to("meta")), ValueError, "position_ids"),
    ("positions shape", _call(positions=_P[:2]), ValueError, "position_ids must have shape"),
    ("positions 2-d", _call(positions=_P[None]), ValueError, "position_ids must have shape"),
    ("k tokens", _call(k=_K[:2]), ValueError, "q and k must have the same token"),
    ("q 2-d", _call(q=_Q[0], positions=_P[0]), ValueError, "^q must be"),
    ("q no heads", _call(q=_Q[:, :0]), ValueError, "q must have at least one head"),
    ("odd head_dim", _call(q=_Q[..., :5], k=_K[..., :5]), ValueError, "head_dim must be even"),
    ("k head_dim", _call(k=_K[..., :8]), ValueError, "k.shape"),
    ("head_dim arg", _call(head_dim=8), ValueError, "head_dim"),
    ("theta zero", _call(theta=0.0), ValueError, "theta"),
    ("theta inf", _call(theta=float("inf")), ValueError, "theta"),
    ("theta string", _call(theta="1e6"), TypeError, "theta"),
    (
        "max_position too big",
        _call(max_position=MAX_EXACT_POSITION + 1),
        ValueError,
        "max_position",
    ),
    (
        "negative position",
        _call(positions=torch.tensor([0, -1, 2])),
        IndexError,
        r"position_ids\[1\]",
    ),
    (
        "position at max_position",
        _call(positions=torch.tensor([0, 1, 40960]), max_position=40960),
        IndexError,
        r"position_ids\[2\] = 40960",
    ),
    (
        "position past 2^24 by default",
        _call(positions=torch.tensor([0, MAX_EXACT_POSITION, 2])),
        IndexError,
        "position_ids",
    ),
    ("module odd head_dim", lambda: RopeReference(15, THETA), ValueError, "head_dim"),
    (
        "backward grad dtype",
        lambda: rope_backward(_Q.half(), _K, _P, theta=THETA),
        TypeError,
        "grad_k_rot has dtype",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "match"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_input_raises_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()
