"""The CUDA attention backward (kernels_cu/attention_backward.cu).

- Axis-B: dq/dk/dv within the contract's attention/grad tolerance of the strict fp32
  reference's gradients (autograd through ``attention_varlen_fp32``, run on the GPU).
- Axis-A: a sequence's dq/dk/dv bitwise the same alone and packed with 2 or 7 other
  sequences, at different places in the pack, with NaN padding rows between sequences; the
  rows no sequence covers get exact zeros; bitwise the same run to run; the kernel variants
  (``KERNEL_VARIANT``: 32-row warp tiles with P^T / dS^T through shared memory, 16-row warp
  tiles with ldmatrix or plain shared loads, with or without cp.async double buffering) give
  the same bits, and every GPU test runs on each variant.  Long sequences (up to 19 key
  blocks, q_len > k_len, k_len - q_len not a multiple of 64) are checked against the
  reference and across batches too.  On sm_90a the "tiled" variant's dK/dV kernel is the
  two-warpgroup ("pair") wgmma one (d = 64 and 128): its dk/dv are checked bitwise against the
  mma.sync kernel ``_wide`` on two varlen packs with NaN padding, empty sequences, q_len >
  k_len, long sequences, CTAs whose second warpgroup has no keys and, causal, second warpgroups
  that skip a query block per head (a CPU test checks that the packs hold those cases);
  likewise its wgmma dQ kernel's dq against the mma.sync kernel ``_tiled``.
- Bad inputs: clear errors (the type/shape checks run on CPU tensors, without a GPU).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import pytest
import torch

from batchinv.contract import assert_bitwise_equal, assert_within_tolerance
from batchinv.gpu import attention_backward as gpu_attention_backward
from batchinv.reference.attention import attention_varlen_fp32

DEVICE = "cuda"
QUICK = os.environ.get("BATCHINV_QUICK") == "1"

# Shapes are data: (Hq, Hkv) GQA and MHA, head dims, dtypes, sequence (q_len, k_len) lists.
HEADS = ((8, 2), (4, 4))
HEAD_DIMS = (64, 128)
DTYPES = (torch.bfloat16, torch.float16)
# Lengths not multiples of 64, a chunk (q_len < k_len: a prefix of cached keys) and, for the
# causal case, q_len > k_len (the first queries see no key: lse = -inf, zero gradients).
ACCURACY_SEQUENCES = ((1, 1), (7, 7), (100, 100), (300, 300), (40, 170), (5, 3))
# Many key and query blocks per sequence (11 to 19 key blocks of 64).
LONG_SEQUENCES = ((700, 1100), (1100, 1100), (1200, 1000))
PROBE_SEQUENCES = ((1, 1), (7, 7), (100, 100), (50, 200)) if QUICK else (
    (1, 1), (7, 7), (100, 100), (300, 300), (50, 200), (5, 3),
)  # fmt: skip
NEIGHBOUR_SEQUENCES = ((90, 90), (29, 29), (1, 1), (67, 130), (13, 13), (200, 200), (3, 64))
PACK_BATCH_SIZES = (1, 3, 8)  # sequences in a pack, the probe included
PAD_ROWS = (0, 3, 17)  # NaN rows between sequences, cycled
CUSTOM_SCALE = 0.3


@pytest.fixture(params=gpu_attention_backward.VARIANTS, autouse=True)
def kernel_variant(request, monkeypatch):
    """Every test runs on each kernel variant (the CPU-only tests never reach a kernel)."""
    monkeypatch.setattr(gpu_attention_backward, "KERNEL_VARIANT", request.param)
    return request.param


@dataclass
class Sequence:
    """One sequence's backward inputs on the GPU (out/lse from an fp32 or fp64 forward)."""

    q: torch.Tensor  # [Lq, Hq, d]
    k: torch.Tensor  # [Lk, Hkv, d]
    v: torch.Tensor
    out: torch.Tensor  # [Lq, Hq, d]
    lse: torch.Tensor  # [Hq, Lq] fp32
    grad_out: torch.Tensor  # [Lq, Hq, d]


def _visible(q_len: int, k_len: int, causal: bool, device) -> torch.Tensor:
    """[Lq, Lk] bool: query i (position k_len - q_len + i) sees key j."""
    keys = torch.arange(k_len, device=device)
    if not causal:
        return torch.ones(q_len, k_len, dtype=torch.bool, device=device).expand(q_len, k_len)
    positions = (k_len - q_len) + torch.arange(q_len, device=device)
    return keys[None, :] <= positions[:, None]


def _forward_fp64(q, k, v, causal: bool, scale: float):
    """Plain float64 attention of one sequence: (out [Lq, Hq, d], lse [Hq, Lq])."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = (t.double() for t in (q, k, v))
    kd = kd.repeat_interleave(group, dim=1)
    vd = vd.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", qd, kd) * scale
    visible = _visible(q.shape[0], k.shape[0], causal, q.device)
    scores = torch.where(visible[None], scores, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # -inf for rows that see no key
    finite = torch.isfinite(lse)
    p = torch.where(visible[None] & finite[..., None], torch.exp(scores - lse[..., None]), 0.0)
    out = torch.einsum("hqk,khd->qhd", p, vd)
    return out, lse


def _make_sequence(q_len, k_len, heads, head_dim, dtype, causal, scale, seed) -> Sequence:
    hq, hkv = heads
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)

    q, k, v = randn(q_len, hq, head_dim), randn(k_len, hkv, head_dim), randn(k_len, hkv, head_dim)
    out, lse = _forward_fp64(q, k, v, causal, scale)
    return Sequence(q, k, v, out.to(dtype), lse.float(), randn(q_len, hq, head_dim))


@dataclass
class Pack:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    grad_out: torch.Tensor
    q_start: torch.Tensor
    q_len: torch.Tensor
    k_start: torch.Tensor
    k_len: torch.Tensor
    max_q_len: int
    max_k_len: int


def _pack(seqs: list[Sequence], q_pads: list[int], k_pads: list[int]) -> Pack:
    """Sequences in order with ``q_pads[i]`` / ``k_pads[i]`` NaN rows before sequence i (and
    the last entry after the last one): the kernel must never read them."""

    def rows(parts, pads, width_like):
        pieces = []
        for part, pad in zip(parts, pads, strict=False):
            pieces.append(torch.full((pad, *width_like.shape[1:]), math.nan, **_spec(width_like)))
            pieces.append(part)
        pieces.append(torch.full((pads[-1], *width_like.shape[1:]), math.nan, **_spec(width_like)))
        return torch.cat(pieces).contiguous()

    def starts(lengths, pads):
        result, at = [], 0
        for length, pad in zip(lengths, pads, strict=False):
            at += pad
            result.append(at)
            at += length
        return torch.tensor(result, dtype=torch.int32, device=DEVICE)

    first = seqs[0]
    q_lens = [s.q.shape[0] for s in seqs]
    k_lens = [s.k.shape[0] for s in seqs]
    lse_rows = rows([s.lse.t() for s in seqs], q_pads, first.lse.t())
    return Pack(
        q=rows([s.q for s in seqs], q_pads, first.q),
        k=rows([s.k for s in seqs], k_pads, first.k),
        v=rows([s.v for s in seqs], k_pads, first.v),
        out=rows([s.out for s in seqs], q_pads, first.out),
        lse=lse_rows.t().contiguous(),
        grad_out=rows([s.grad_out for s in seqs], q_pads, first.grad_out),
        q_start=starts(q_lens, q_pads),
        q_len=torch.tensor(q_lens, dtype=torch.int32, device=DEVICE),
        k_start=starts(k_lens, k_pads),
        k_len=torch.tensor(k_lens, dtype=torch.int32, device=DEVICE),
        max_q_len=max(q_lens),
        max_k_len=max(k_lens),
    )


def _spec(t: torch.Tensor) -> dict:
    return {"dtype": t.dtype, "device": t.device}


def _backward(pack: Pack, causal: bool, scale: float):
    return gpu_attention_backward.backward(
        pack.q, pack.k, pack.v, pack.out, pack.lse, pack.grad_out,
        pack.q_start, pack.q_len, pack.k_start, pack.k_len,
        pack.max_q_len, pack.max_k_len, causal, scale,
    )  # fmt: skip


def _sequence_grads(pack: Pack, grads, index: int):
    dq, dk, dv = grads
    qs, ql = int(pack.q_start[index]), int(pack.q_len[index])
    ks, kl = int(pack.k_start[index]), int(pack.k_len[index])
    return dq[qs : qs + ql], dk[ks : ks + kl], dv[ks : ks + kl]


def _uncovered(total: int, starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    covered = torch.zeros(total, dtype=torch.bool)
    for s, n in zip(starts.tolist(), lengths.tolist(), strict=True):
        covered[s : s + n] = True
    return (~covered).nonzero().flatten()


def _assert_padding_zero(pack: Pack, grads, label: str):
    dq, dk, dv = grads
    q_rows = _uncovered(pack.q.shape[0], pack.q_start.cpu(), pack.q_len.cpu()).to(DEVICE)
    k_rows = _uncovered(pack.k.shape[0], pack.k_start.cpu(), pack.k_len.cpu()).to(DEVICE)
    for name, grad, rows in (("dq", dq, q_rows), ("dk", dk, k_rows), ("dv", dv, k_rows)):
        picked = grad[rows]
        assert_bitwise_equal(picked, torch.zeros_like(picked), name=f"{label} {name} padding")


CONFIGS = [
    (dtype, head_dim, heads, causal)
    for dtype in DTYPES
    for head_dim in HEAD_DIMS
    for heads in HEADS
    for causal in (True, False)
]


def _config_id(config) -> str:
    dtype, head_dim, heads, causal = config
    name = str(dtype).removeprefix("torch.")
    return f"{name}-d{head_dim}-h{heads[0]}x{heads[1]}-{'causal' if causal else 'full'}"


# ----------------------------------------------------------------------------- Axis-B


@pytest.mark.cuda
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_gradients_within_tolerance_of_fp32_reference(config):
    dtype, head_dim, heads, causal = config
    _check_accuracy(dtype, head_dim, heads, causal, 1.0 / math.sqrt(head_dim), seed=11)


@pytest.mark.cuda
def test_gradients_with_a_custom_scale():
    _check_accuracy(torch.bfloat16, 64, (8, 2), True, CUSTOM_SCALE, seed=12)


@pytest.mark.cuda
@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
def test_long_sequences_within_tolerance(causal):
    _check_accuracy(torch.bfloat16, 128, (8, 2), causal, 1.0 / math.sqrt(128), 13, LONG_SEQUENCES)


def _check_accuracy(dtype, head_dim, heads, causal, scale, seed, sequences=ACCURACY_SEQUENCES):
    hq, hkv = heads
    q_lens = [s[0] for s in sequences]
    k_lens = [s[1] for s in sequences]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)

    q = randn(sum(q_lens), hq, head_dim)
    k, v = randn(sum(k_lens), hkv, head_dim), randn(sum(k_lens), hkv, head_dim)
    grad_out = randn(sum(q_lens), hq, head_dim)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], device=DEVICE)
    leaves = [t.float().requires_grad_(True) for t in (q, k, v)]
    out32, lse = attention_varlen_fp32(
        *leaves, cu_q, cu_k, causal=causal, softmax_scale=scale, return_lse=True
    )
    out32.backward(grad_out.float())
    reference = [leaf.grad for leaf in leaves]

    i32 = {"dtype": torch.int32, "device": DEVICE}
    grads = gpu_attention_backward.backward(
        q, k, v, out32.detach().to(dtype), lse.detach().contiguous(), grad_out,
        cu_q[:-1].to(**i32), torch.tensor(q_lens, **i32),
        cu_k[:-1].to(**i32), torch.tensor(k_lens, **i32),
        max(q_lens), max(k_lens), causal, scale,
    )  # fmt: skip
    for name, actual, expected in zip(("dq", "dk", "dv"), grads, reference, strict=True):
        assert actual.dtype == dtype and actual.shape == expected.shape
        assert_within_tolerance(actual, expected, op_class="attention", kind="grad", name=name)
        # Not vacuous: the reference gradient is far from zero.
        assert float(expected.abs().max()) > 0.1


# ----------------------------------------------------------------------------- Axis-A


@pytest.mark.cuda
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_sequence_gradients_are_batch_invariant(config):
    dtype, head_dim, heads, causal = config
    scale = 1.0 / math.sqrt(head_dim)
    neighbours = [
        _make_sequence(lq, lk, heads, head_dim, dtype, causal, scale, seed=100 + i)
        for i, (lq, lk) in enumerate(NEIGHBOUR_SEQUENCES)
    ]
    for p, (lq, lk) in enumerate(PROBE_SEQUENCES):
        probe = _make_sequence(lq, lk, heads, head_dim, dtype, causal, scale, seed=p)
        alone = _pack([probe], [0, 0], [0, 0])
        expected = _backward(alone, causal, scale)
        label = f"probe (q_len={lq}, k_len={lk})"
        for size in PACK_BATCH_SIZES:
            for slot in sorted({0, size // 2, size - 1}):
                others = [neighbours[(slot + j + size) % len(neighbours)] for j in range(size - 1)]
                seqs = others[:slot] + [probe] + others[slot:]
                q_pads = [PAD_ROWS[(j + slot) % len(PAD_ROWS)] for j in range(size + 1)]
                k_pads = [PAD_ROWS[(j + slot + 1) % len(PAD_ROWS)] for j in range(size + 1)]
                pack = _pack(seqs, q_pads, k_pads)
                grads = _backward(pack, causal, scale)
                where = f"{label} in a batch of {size} at slot {slot}"
                for name, got, want in zip(
                    ("dq", "dk", "dv"), _sequence_grads(pack, grads, slot), expected, strict=True
                ):
                    assert_bitwise_equal(got, want, name=f"{where}: {name}")
                _assert_padding_zero(pack, grads, where)


@pytest.mark.cuda
@pytest.mark.parametrize("config", CONFIGS[:4], ids=_config_id)
def test_backward_is_deterministic_run_to_run(config):
    dtype, head_dim, heads, causal = config
    scale = 1.0 / math.sqrt(head_dim)
    seqs = [
        _make_sequence(lq, lk, heads, head_dim, dtype, causal, scale, seed=200 + i)
        for i, (lq, lk) in enumerate(NEIGHBOUR_SEQUENCES)
    ]
    pack = _pack(seqs, [2] * (len(seqs) + 1), [1] * (len(seqs) + 1))
    first = _backward(pack, causal, scale)
    for _ in range(3):
        assert_bitwise_equal(_backward(pack, causal, scale), first, name="rerun")


@pytest.mark.cuda
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_kernel_variants_give_the_same_bits(config, kernel_variant, monkeypatch):
    dtype, head_dim, heads, causal = config
    scale = 1.0 / math.sqrt(head_dim)
    seqs = [
        _make_sequence(lq, lk, heads, head_dim, dtype, causal, scale, seed=300 + i)
        for i, (lq, lk) in enumerate(NEIGHBOUR_SEQUENCES[:4])
    ]
    pack = _pack(seqs, [0, 1, 2, 3, 0], [1, 0, 5, 0, 2])
    mine = _backward(pack, causal, scale)
    for other in gpu_attention_backward.VARIANTS:
        monkeypatch.setattr(gpu_attention_backward, "KERNEL_VARIANT", other)
        theirs = _backward(pack, causal, scale)
        assert_bitwise_equal(mine, theirs, name=f"{kernel_variant} vs {other}")


@pytest.mark.cuda
@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
def test_long_sequences_are_batch_invariant(causal):
    heads, head_dim, dtype = (8, 2), 128, torch.bfloat16
    scale = 1.0 / math.sqrt(head_dim)
    seqs = [
        _make_sequence(lq, lk, heads, head_dim, dtype, causal, scale, seed=400 + i)
        for i, (lq, lk) in enumerate(LONG_SEQUENCES)
    ]
    packed = _pack(seqs, [5, 0, 64, 3], [0, 17, 1, 2])
    grads = _backward(packed, causal, scale)
    _assert_padding_zero(packed, grads, "long sequences")
    for index, seq in enumerate(seqs):
        alone = _backward(_pack([seq], [0, 0], [0, 0]), causal, scale)
        for name, got, want in zip(
            ("dq", "dk", "dv"), _sequence_grads(packed, grads, index), alone, strict=True
        ):
            assert_bitwise_equal(got, want, name=f"long sequence {index} packed vs alone: {name}")
    assert_bitwise_equal(_backward(packed, causal, scale), grads, name="long sequences rerun")


@pytest.mark.cuda
def test_empty_sides_give_exact_zero_gradients():
    """A sequence with queries but no keys, and one with keys but no queries."""
    heads, head_dim, dtype = (8, 2), 64, torch.bfloat16
    no_keys = _make_sequence(9, 0, heads, head_dim, dtype, False, 0.125, seed=1)
    no_queries = _make_sequence(0, 70, heads, head_dim, dtype, False, 0.125, seed=2)
    middle = _make_sequence(20, 20, heads, head_dim, dtype, False, 0.125, seed=3)
    pack = _pack([no_keys, middle, no_queries], [1, 2, 0, 1], [0, 3, 1, 2])
    grads = _backward(pack, False, 0.125)
    for index in (0, 2):
        for name, grad in zip(("dq", "dk", "dv"), _sequence_grads(pack, grads, index), strict=True):
            assert_bitwise_equal(grad, torch.zeros_like(grad), name=f"sequence {index} {name}")
    _assert_padding_zero(pack, grads, "empty sides")
    assert float(_sequence_grads(pack, grads, 1)[0].abs().max()) > 0


# ----------------------------------------------------------------------------- wgmma dK/dV, dQ

# Varlen pack for the sm_90a dK/dV and dQ kernels: the neighbours, q_len > k_len, no queries,
# no keys and the long sequences, with NaN rows between them.
WGMMA_SEQUENCES = (*NEIGHBOUR_SEQUENCES, (5, 3), (0, 70), (9, 0), *LONG_SEQUENCES)
# The pair dK/dV kernel's CTA: 128 keys, warpgroup w the 64 from 128 J + 64 w; query blocks of 64.
PAIR_CTA_KEYS, PAIR_WARPGROUP_KEYS, PAIR_QUERY_BLOCK = 128, 64, 64


def _pair_kernel_cases(q_len: int, k_len: int) -> set[str]:
    """Which of the pair dK/dV kernel's special cases the sequence (q_len, k_len) reaches, from
    the lengths alone: a CTA whose second warpgroup has no keys, and (causal) one whose second
    warpgroup's first visible query block is later than the first warpgroup's and the first
    warpgroup's is a block of the sequence (a step the second skips, for each head)."""
    cases = set()
    offset = k_len - q_len  # absolute position of query 0
    blocks = -(-q_len // PAIR_QUERY_BLOCK)
    for key0 in range(0, k_len, PAIR_CTA_KEYS):
        second = key0 + PAIR_WARPGROUP_KEYS
        if second >= k_len:
            cases.add("second warpgroup without keys")
            continue
        first_block = max(0, key0 - offset) // PAIR_QUERY_BLOCK
        second_block = max(0, second - offset) // PAIR_QUERY_BLOCK
        if first_block < second_block and first_block < blocks:
            cases.add("second warpgroup skips a block (causal)")
    if q_len > k_len:
        cases.add("q_len > k_len")
    if q_len == 0 or k_len == 0:
        cases.add("empty side")
    return cases


@pytest.mark.parametrize("kernel_variant", ["tiled"], indirect=True)  # data only: no kernel
def test_wgmma_pack_reaches_the_pair_kernel_cases(kernel_variant):
    """The pack the wgmma tests compare against the mma.sync kernels (CPU: lengths only) holds
    every special case of the pair dK/dV kernel, so that the bitwise test against `_wide`
    covers them."""
    reached = set().union(*(_pair_kernel_cases(lq, lk) for lq, lk in WGMMA_SEQUENCES))
    assert reached == {
        "second warpgroup without keys",
        "second warpgroup skips a block (causal)",
        "q_len > k_len",
        "empty side",
    }


def _wgmma_pack(config, first_seed, q_pad_shift, k_pad_shift):
    """The WGMMA_SEQUENCES pack of ``config`` (seeds first_seed + i), its pads rotated through
    PAD_ROWS: both wgmma tests build their data this way, with their own seeds and rotations."""
    dtype, head_dim, heads, causal = config
    scale = 1.0 / math.sqrt(head_dim)
    seqs = [
        _make_sequence(lq, lk, heads, head_dim, dtype, causal, scale, seed=first_seed + i)
        for i, (lq, lk) in enumerate(WGMMA_SEQUENCES)
    ]
    count = len(seqs) + 1
    pack = _pack(
        seqs,
        [PAD_ROWS[(j + q_pad_shift) % 3] for j in range(count)],
        [PAD_ROWS[(j + k_pad_shift) % 3] for j in range(count)],
    )
    return pack, causal, scale


def _wgmma_and_mma_sync_grads(pack, causal, scale, monkeypatch, switch, uses_wgmma, kernel):
    """(dq, dk, dv) with the wgmma ``kernel``, then with ``switch`` turned off (the mma.sync
    kernel it replaces); skips where the wgmma kernel cannot run."""
    if not uses_wgmma(pack.q):
        pytest.skip(f"the wgmma {kernel} kernel needs an sm_90 GPU and the sm_90a image")
    wgmma_grads = _backward(pack, causal, scale)
    monkeypatch.setattr(gpu_attention_backward, switch, False)
    assert not uses_wgmma(pack.q)
    return wgmma_grads, _backward(pack, causal, scale)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "config", [c for c in CONFIGS if c[1] in gpu_attention_backward.WGMMA_HEAD_DIMS], ids=_config_id
)
@pytest.mark.parametrize("kernel_variant", ["tiled"], indirect=True)  # the only one it replaces
@pytest.mark.parametrize(
    ("first_seed", "q_pad_shift", "k_pad_shift"), [(500, 0, 1), (900, 1, 2)], ids=("a", "b")
)
def test_wgmma_dkdv_gives_the_bits_of_the_wide_kernel(
    config, kernel_variant, monkeypatch, first_seed, q_pad_shift, k_pad_shift
):
    """On sm_90a the "tiled" variant's dK/dV launch is the wgmma pair kernel (two warpgroups, 128
    keys per CTA, shared Q/dO tiles): its dk and dv are bitwise those of the mma.sync kernel
    ``_wide`` (forced with USE_WGMMA_DKDV = False), on two packs (own seeds and NaN padding
    rotations) of WGMMA_SEQUENCES: CTAs whose second warpgroup has no keys, second warpgroups
    that skip a query block per head (causal), q_len > k_len, empty sequences, long sequences
    (test_wgmma_pack_reaches_the_pair_kernel_cases checks the list holds them)."""
    pack, causal, scale = _wgmma_pack(config, first_seed, q_pad_shift, k_pad_shift)
    (_, dk, dv), (_, dk_wide, dv_wide) = _wgmma_and_mma_sync_grads(
        pack,
        causal,
        scale,
        monkeypatch,
        "USE_WGMMA_DKDV",
        gpu_attention_backward.dkdv_uses_wgmma,
        "dK/dV",
    )
    assert_bitwise_equal(dk, dk_wide, name="dk, wgmma vs _wide")
    assert_bitwise_equal(dv, dv_wide, name="dv, wgmma vs _wide")
    # Not vacuous: real gradients, and the rows of no sequence are zero.
    assert float(dk.float().abs().max()) > 0 and float(dv.float().abs().max()) > 0
    _assert_padding_zero(pack, (torch.zeros_like(pack.q), dk, dv), "wgmma pack")


@pytest.mark.cuda
@pytest.mark.parametrize(
    "config", [c for c in CONFIGS if c[1] in gpu_attention_backward.WGMMA_HEAD_DIMS], ids=_config_id
)
@pytest.mark.parametrize("kernel_variant", ["tiled"], indirect=True)  # the only one it replaces
def test_wgmma_dq_gives_the_bits_of_the_tiled_kernel(config, kernel_variant, monkeypatch):
    """On sm_90a the "tiled" variant's dQ launch is the wgmma kernel: its dq is bitwise that of
    the mma.sync kernel ``_tiled`` (forced with USE_WGMMA_DQ = False), -0 included."""
    pack, causal, scale = _wgmma_pack(config, first_seed=700, q_pad_shift=2, k_pad_shift=0)
    (dq, dk, dv), (dq_tiled, dk_tiled, dv_tiled) = _wgmma_and_mma_sync_grads(
        pack, causal, scale, monkeypatch, "USE_WGMMA_DQ", gpu_attention_backward.dq_uses_wgmma, "dQ"
    )
    assert_bitwise_equal(dq, dq_tiled, name="dq, wgmma vs _tiled")
    # The dK/dV launch is the same kernel either way.
    assert_bitwise_equal(dk, dk_tiled, name="dk")
    assert_bitwise_equal(dv, dv_tiled, name="dv")
    # Not vacuous: real gradients, and the rows of no sequence are zero.
    assert float(dq.float().abs().max()) > 0
    _assert_padding_zero(pack, (dq, dk, dv), "wgmma dq pack")


# ----------------------------------------------------------------------------- bad inputs


def _valid_args(device="cpu", dtype=torch.bfloat16, head_dim=64, hq=4, hkv=2, tq=6, tk=8):
    def t(*shape, dt=dtype):
        return torch.zeros(*shape, dtype=dt, device=device)

    i32 = {"dtype": torch.int32, "device": device}
    return {
        "q": t(tq, hq, head_dim),
        "k": t(tk, hkv, head_dim),
        "v": t(tk, hkv, head_dim),
        "out": t(tq, hq, head_dim),
        "lse": t(hq, tq, dt=torch.float32),
        "grad_out": t(tq, hq, head_dim),
        "q_start": torch.tensor([0, 3], **i32),
        "q_len": torch.tensor([3, 3], **i32),
        "k_start": torch.tensor([0, 4], **i32),
        "k_len": torch.tensor([4, 4], **i32),
        "max_q_len": 3,
        "max_k_len": 4,
        "causal": True,
        "scale": 0.125,
    }


def _call(args):
    return gpu_attention_backward.backward(**args)


BAD_ARGUMENTS = [
    # (change, exception, text the message must contain)
    ({"q": torch.zeros(6, 4, 64)}, TypeError, "q must have dtype"),
    ({"k": torch.zeros(8, 2, 64, dtype=torch.float16)}, TypeError, "k has dtype"),
    ({"lse": torch.zeros(4, 6, dtype=torch.float16)}, TypeError, "lse must have dtype"),
    ({"q_start": torch.tensor([0, 3])}, TypeError, "q_start must have dtype"),
    ({"v": [1.0]}, TypeError, "v must be a torch.Tensor"),
    ({"causal": 1}, TypeError, "causal must be a bool"),
    ({"scale": "0.1"}, TypeError, "scale must be a float"),
    ({"scale": math.nan}, ValueError, "scale must be finite"),
    ({"max_q_len": True}, TypeError, "max_q_len must be an int"),
    ({"max_k_len": -1}, ValueError, "max_k_len must be >= 0"),
    ({"q": torch.zeros(6, 256, dtype=torch.bfloat16)}, ValueError, "q must have 3 dimensions"),
    ({"out": torch.zeros(5, 4, 64, dtype=torch.bfloat16)}, ValueError, "out must have q's shape"),
    ({"v": torch.zeros(8, 1, 64, dtype=torch.bfloat16)}, ValueError, "v must have k's shape"),
    ({"lse": torch.zeros(6, 4)}, ValueError, "lse must be [Hq, Tq]"),
    ({"k_len": torch.tensor([4], dtype=torch.int32)}, ValueError, "k_len must have one entry"),
    (
        {"q": torch.zeros(4, 6, 64, dtype=torch.bfloat16).transpose(0, 1)},
        ValueError,
        "q must be contiguous",
    ),
]


@pytest.mark.parametrize(("change", "error", "text"), BAD_ARGUMENTS)
def test_bad_arguments_raise_clear_errors(change, error, text):
    args = {**_valid_args(), **change}
    with pytest.raises(error, match=re.escape(text)):
        _call(args)


def test_unsupported_head_dim_names_d():
    args = _valid_args(head_dim=96)
    with pytest.raises(ValueError, match="d=96 is not supported"):
        _call(args)


def test_heads_must_divide():
    args = _valid_args(hq=6, hkv=4)
    with pytest.raises(ValueError, match="Hq=6 must be a positive multiple of"):
        _call(args)


def test_cpu_tensors_are_refused():
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        _call(_valid_args())


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("change", "error", "text"),
    [
        ({"q_len": [3, 4]}, ValueError, "q_len[1] = 4 is outside [0, max_q_len = 3]"),
        ({"k_start": [0, 5]}, IndexError, "sequence 1's k rows [5, 9)"),
        ({"k_start": [0, 2]}, ValueError, "sequences 0 and 1 share k rows"),
        ({"q_start": [-1, 3]}, IndexError, "sequence 0's q rows [-1, 2)"),
    ],
)
def test_bad_lengths_raise_clear_errors(change, error, text):
    args = _valid_args(device=DEVICE)
    for name, values in change.items():
        args[name] = torch.tensor(values, dtype=torch.int32, device=DEVICE)
    with pytest.raises(error, match=re.escape(text)):
        _call(args)


@pytest.mark.cuda
def test_key_blocks_past_the_grid_z_limit(kernel_variant):
    """The heavy-first kernels put the key (query) block on the grid's z axis (at most 65535)
    and refuse more; the other variants keep it on x, where the same call runs and gives the
    bits of a call with a tight max_k_len (the extra CTAs see no key).  The key block is the
    dK/dV CTA's: 128 keys for the sm_90a pair kernel, 64 for the others."""
    args = _valid_args(device=DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    for name in ("q", "k", "v", "out", "grad_out", "lse"):
        like = args[name]
        args[name] = torch.randn(like.shape, generator=gen, device=DEVICE).to(like.dtype)
    tight = _call(args)
    pair = gpu_attention_backward.dkdv_uses_wgmma(args["q"], kernel_variant)
    keys = gpu_attention_backward.WGMMA_PAIR_KEYS if pair else 64
    args["max_k_len"] = keys * 65535 + 1
    if kernel_variant in gpu_attention_backward._HEAVY_FIRST:
        with pytest.raises(ValueError, match="exceed the grid's z limit"):
            _call(args)
        return
    for name, mine, theirs in zip(("dq", "dk", "dv"), _call(args), tight, strict=True):
        assert_bitwise_equal(mine, theirs, name=f"{name}, max_k_len past the z limit")


@pytest.mark.cuda
def test_misaligned_view_is_refused():
    args = _valid_args(device=DEVICE)
    storage = torch.zeros(6 * 4 * 64 + 1, dtype=torch.bfloat16, device=DEVICE)
    args["q"] = storage[1:].view(6, 4, 64)
    with pytest.raises(ValueError, match="q must start at a 16-byte aligned address"):
        _call(args)
