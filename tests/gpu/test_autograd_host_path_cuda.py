"""The host path of the public ops' gradient calls on CUDA (checks once per signature, lean
backward launches, the saved tensors the forward's own) gives the bits of the general launch
path, called directly, in every layout, for every op whose grad path it changed, and in a CUDA
graph where the op's backward can be captured."""

from __future__ import annotations

import pytest
import torch

import batchinv
from _streams import capture_graph
from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import embedding as gpu_embedding
from batchinv.gpu import linear as gpu_linear
from batchinv.gpu import rms_norm as gpu_rms_norm
from batchinv.gpu import rope as gpu_rope
from batchinv.gpu import silu_mul as gpu_silu_mul

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
EPS = 1e-6
THETA, MAX_POSITION = 1_000_000.0, 40960
# (rows, width): one row, an odd count, a trainer's 16k tokens at hidden 4096 (the fused
# rms_norm backward with two row groups and overlapped last levels).
RMS_NORM_SHAPES = ((1, 128), (257, 4096), (16384, 4096))
SILU_MUL_SHAPES = ((1, 8), (33, 1000), (1024, 12288))
# (tokens, query heads, kv heads, head_dim)
ROPE_SHAPES = ((1, 2, 1, 64), (17, 32, 8, 128), (4096, 64, 4, 128))


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _randn(*shape, dtype, gen, scale=1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, device=DEVICE, generator=gen)).to(dtype)


def _layouts(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """``t``'s values contiguous, and as a view with a padded row stride (the general path),
    each as a leaf that requires a gradient."""
    width = t.shape[-1]
    padded = torch.empty(*t.shape[:-1], width + 8, dtype=t.dtype, device=t.device)
    strided = padded[..., :width]
    strided.copy_(t)
    return {
        "contiguous": t.clone().requires_grad_(),
        "strided": strided.detach().requires_grad_(),
    }


def _strided_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a view whose rows are not contiguous: the general launch path."""
    return _layouts(t)["strided"].detach()


# ----------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", RMS_NORM_SHAPES)
def test_rms_norm_gradients_are_the_backward_launchers_bits(rows, hidden, dtype):
    gen = _seeded(rows + hidden)
    x = _randn(rows, hidden, dtype=dtype, gen=gen, scale=2.0)
    weight = (1 + 0.3 * torch.randn(hidden, device=DEVICE, generator=gen)).to(dtype)
    grad = _randn(rows, hidden, dtype=dtype, gen=gen)
    want_y, rstd = gpu_rms_norm.forward(x, weight, EPS)
    want = gpu_rms_norm.backward(grad, x, weight, rstd)
    want_x_only = gpu_rms_norm.backward(grad, x, weight, rstd, weight_grad=False)[0]
    for name, leaf in _layouts(x).items():
        w = weight.clone().requires_grad_()
        for call in range(2):  # the second call of the signature skips the checks
            y = batchinv.rms_norm(leaf, w, EPS)
            got = torch.autograd.grad(y, (leaf, w), grad)
            assert_bitwise_equal(y, want_y, name=f"{name} y, call {call}")
            assert_bitwise_equal(list(got), list(want), name=f"{name} grads, call {call}")
        (got_x,) = torch.autograd.grad(batchinv.rms_norm(leaf, weight, EPS), leaf, grad)
        assert_bitwise_equal(got_x, want_x_only, name=f"{name} grad_x without grad_weight")


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_rms_norm_of_a_strided_view_gives_the_launchers_bits(dtype):
    # The q/k norm: [tokens, heads, head_dim] split from a fused projection, so x has no one
    # row stride and the forward's copy is what the backward reads.
    gen = _seeded(7)
    qkv = _randn(129, 48, 128, dtype=dtype, gen=gen, scale=2.0)
    weight = (1 + 0.3 * torch.randn(128, device=DEVICE, generator=gen)).to(dtype)
    grad = _randn(129, 32, 128, dtype=dtype, gen=gen)
    q = qkv[:, :32]
    want_y, rstd = gpu_rms_norm.forward(q, weight, EPS)
    want = gpu_rms_norm.backward(grad, q, weight, rstd)
    leaf, w = q.detach().requires_grad_(), weight.clone().requires_grad_()
    y = batchinv.rms_norm(leaf, w, EPS)
    assert_bitwise_equal(y, want_y, name="y")
    assert_bitwise_equal(list(torch.autograd.grad(y, (leaf, w), grad)), list(want), name="grads")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", RMS_NORM_SHAPES)
def test_fused_add_rms_norm_gradients_are_the_backward_launchers_bits(rows, hidden, dtype):
    gen = _seeded(3 * rows + hidden)
    x = _randn(rows, hidden, dtype=dtype, gen=gen)
    residual = _randn(rows, hidden, dtype=dtype, gen=gen)
    weight = (1 + 0.3 * torch.randn(hidden, device=DEVICE, generator=gen)).to(dtype)
    grad_y = _randn(rows, hidden, dtype=dtype, gen=gen)
    grad_h = _randn(rows, hidden, dtype=dtype, gen=gen)
    want_y, want_h, rstd = gpu_rms_norm.fused_add_forward(x, residual, weight, EPS)
    grad_sum, grad_weight = gpu_rms_norm.backward(grad_y, want_h, weight, rstd, grad_h)
    for (name, a), r in zip(_layouts(x).items(), _layouts(residual).values(), strict=True):
        w = weight.clone().requires_grad_()
        for call in range(2):
            y, h = batchinv.fused_add_rms_norm(a, r, w, EPS)
            got = torch.autograd.grad((y, h), (a, r, w), (grad_y, grad_h))
            assert_bitwise_equal([y, h], [want_y, want_h], name=f"{name} outputs, call {call}")
            assert_bitwise_equal(
                list(got), [grad_sum, grad_sum, grad_weight], name=f"{name} grads, call {call}"
            )


def test_fused_add_rms_norm_leaves_get_their_own_gradients_and_the_custom_op_the_same_bits():
    # The node returns one tensor as the gradient of x and of residual: two leaves must still
    # get distinct .grad tensors, and the custom op (whose outputs may not alias) the same bits.
    gen = _seeded(31)
    inputs = [_randn(257, 4096, dtype=torch.bfloat16, gen=gen) for _ in range(2)]
    weight = _randn(4096, dtype=torch.bfloat16, gen=gen)
    seeds = [_randn(257, 4096, dtype=torch.bfloat16, gen=gen) for _ in range(2)]
    results = []
    for op in (batchinv.fused_add_rms_norm, torch.ops.batchinv.fused_add_rms_norm):
        x, r = (t.clone().requires_grad_() for t in inputs)
        w = weight.clone().requires_grad_()
        torch.autograd.backward(op(x, r, w, EPS), seeds)
        assert x.grad.untyped_storage().data_ptr() != r.grad.untyped_storage().data_ptr()
        assert_bitwise_equal(x.grad, r.grad, name="x and residual")
        results.append([x.grad.clone(), r.grad.clone(), w.grad])
        x.grad.zero_()  # one leaf's gradient written in place leaves the other's alone
        assert_bitwise_equal(r.grad, results[-1][1], name="residual after x.grad.zero_()")
    assert_bitwise_equal(results[1], results[0], name="custom op vs public op")


# ----------------------------------------------------------------------------- silu_mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", SILU_MUL_SHAPES)
def test_silu_mul_gradients_are_the_general_launchs_bits(rows, inter, dtype):
    gen = _seeded(rows * inter)
    gate = _randn(rows, inter, dtype=dtype, gen=gen, scale=3.0)
    up = _randn(rows, inter, dtype=dtype, gen=gen)
    grad = _randn(rows, inter, dtype=dtype, gen=gen)
    # The general launch: a strided grad takes it whatever the inputs' layout.
    want = gpu_silu_mul.backward(_strided_copy(grad), gate, up)
    for (name, g), u in zip(_layouts(gate).items(), _layouts(up).values(), strict=True):
        for call in range(2):
            out = batchinv.silu_mul(g, u)
            got = torch.autograd.grad(out, (g, u), grad)
            assert_bitwise_equal(list(got), list(want), name=f"{name}, call {call}")
    # a strided incoming gradient, contiguous inputs: the general launch through autograd
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    got = torch.autograd.grad(batchinv.silu_mul(g, u), (g, u), _strided_copy(grad))
    assert_bitwise_equal(list(got), list(want), name="strided grad")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", SILU_MUL_SHAPES)
def test_silu_mul_fused_gradient_is_the_general_launchs_bits(rows, inter, dtype):
    gen = _seeded(rows * inter + 1)
    gate_up = _randn(rows, 2 * inter, dtype=dtype, gen=gen, scale=3.0)
    grad = _randn(rows, inter, dtype=dtype, gen=gen)
    want = gpu_silu_mul.backward_fused(_strided_copy(grad), gate_up)
    want_split = torch.cat(gpu_silu_mul.backward(grad, *gate_up.split(inter, dim=-1)), dim=-1)
    assert_bitwise_equal(want, want_split, name="fused vs two tensors")
    for name, leaf in _layouts(gate_up).items():
        for call in range(2):
            (got,) = torch.autograd.grad(batchinv.silu_mul_fused(leaf), leaf, grad)
            assert_bitwise_equal(got, want, name=f"{name}, call {call}")


# ----------------------------------------------------------------------------- rope


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hq, hk, head_dim", ROPE_SHAPES)
@pytest.mark.parametrize("index_dtype", (torch.int32, torch.int64))
def test_rope_gradients_are_the_general_launchs_bits(tokens, hq, hk, head_dim, dtype, index_dtype):
    gen = _seeded(tokens + hq + head_dim)
    q = _randn(tokens, hq, head_dim, dtype=dtype, gen=gen)
    k = _randn(tokens, hk, head_dim, dtype=dtype, gen=gen)
    positions = torch.randint(0, MAX_POSITION, (tokens,), device=DEVICE, generator=gen)
    positions = positions.to(index_dtype)
    grad_q = _randn(tokens, hq, head_dim, dtype=dtype, gen=gen)
    grad_k = _randn(tokens, hk, head_dim, dtype=dtype, gen=gen)
    want = gpu_rope.launch_rotation(
        grad_q, grad_k, positions, THETA, MAX_POSITION, inverse=True, want_flag=False
    )[:2]
    want_rot = gpu_rope.launch_rotation(q, k, positions, THETA, MAX_POSITION, inverse=False)[:2]
    for (name, a), b in zip(_layouts(q).items(), _layouts(k).values(), strict=True):
        for call in range(2):
            rotated = batchinv.rope(a, b, positions, theta=THETA, max_position=MAX_POSITION)
            got = torch.autograd.grad(rotated, (a, b), (grad_q, grad_k))
            assert_bitwise_equal(list(rotated), list(want_rot), name=f"{name} rotation")
            assert_bitwise_equal(list(got), list(want), name=f"{name} grads, call {call}")
    # the lean backward called directly, and through autograd with strided incoming gradients
    direct = gpu_rope.backward(grad_q, grad_k, positions, THETA, MAX_POSITION)
    assert_bitwise_equal(list(direct), list(want), name="lean backward")
    a, b = q.clone().requires_grad_(), k.clone().requires_grad_()
    rotated = batchinv.rope(a, b, positions, theta=THETA, max_position=MAX_POSITION)
    got = torch.autograd.grad(rotated, (a, b), (_strided_copy(grad_q), _strided_copy(grad_k)))
    assert_bitwise_equal(list(got), list(want), name="strided grads")


def test_rope_gradient_of_batched_positions_is_the_general_launchs_bits():
    # position_ids [batch, seq] (the forward saves them flattened) and q/k [batch, seq, ...]
    gen = _seeded(11)
    q = _randn(3, 17, 8, 64, dtype=torch.bfloat16, gen=gen).requires_grad_()
    k = _randn(3, 17, 2, 64, dtype=torch.bfloat16, gen=gen).requires_grad_()
    positions = torch.randint(0, MAX_POSITION, (3, 17), device=DEVICE, generator=gen)
    grads = (torch.randn_like(q), torch.randn_like(k))
    want = gpu_rope.launch_rotation(
        grads[0], grads[1], positions, THETA, MAX_POSITION, inverse=True, want_flag=False
    )[:2]
    rotated = batchinv.rope(q, k, positions.t().contiguous().t(), theta=THETA)  # strided ids
    got = torch.autograd.grad(rotated, (q, k), grads)
    assert_bitwise_equal(list(got), list(want), name="grads")


def test_rope_rotates_again_after_its_inputs_change_in_place():
    # The same tensors, written in place between calls: every call launches.
    gen = _seeded(5)
    q = _randn(4, 2, 64, dtype=torch.bfloat16, gen=gen)
    k = _randn(4, 1, 64, dtype=torch.bfloat16, gen=gen)
    positions = torch.arange(4, device=DEVICE)
    first = [t.clone() for t in batchinv.rope(q, k, positions, theta=THETA)]
    q.normal_(generator=gen)
    positions.add_(1)
    again = batchinv.rope(q, k, positions, theta=THETA)
    fresh = batchinv.rope(q.clone(), k.clone(), positions.clone(), theta=THETA)
    assert_bitwise_equal(list(again), list(fresh), name="after the in-place writes")
    assert not torch.equal(again[0], first[0])
    positions[2] = MAX_POSITION + 5
    with pytest.raises(IndexError, match="position_ids"):
        batchinv.rope(q, k, positions, theta=THETA, max_position=MAX_POSITION)


# ----------------------------------------------------------------------------- embedding, linear


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_gradient_is_the_registrys_backward(dtype):
    gen = _seeded(13)
    weight = _randn(1000, 256, dtype=dtype, gen=gen)
    ids = torch.randint(0, 1000, (4, 129), device=DEVICE, generator=gen)
    grad = _randn(4, 129, 256, dtype=dtype, gen=gen)
    want = gpu_embedding.backward(ids, grad, 1000, dtype)
    leaf = weight.clone().requires_grad_()
    for call in range(2):
        (got,) = torch.autograd.grad(batchinv.embedding(ids, leaf), leaf, grad)
        assert_bitwise_equal(got, want, name=f"call {call}")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("bias", (False, True))
def test_linear_gradients_are_the_registrys_backward(dtype, bias):
    gen = _seeded(17)
    x = _randn(257, 512, dtype=dtype, gen=gen)
    weight = _randn(384, 512, dtype=dtype, gen=gen, scale=1 / 16)
    b = _randn(384, dtype=dtype, gen=gen) if bias else None
    grad = _randn(257, 384, dtype=dtype, gen=gen)
    want = gpu_linear.backward(grad, x, weight, dtype if bias else None)
    want = [g for g in want if g is not None]
    leaves = [t.clone().requires_grad_() for t in (x, weight, *([b] if bias else []))]
    for call in range(2):
        got = torch.autograd.grad(batchinv.linear(*leaves), leaves, grad)
        assert_bitwise_equal(list(got), want, name=f"call {call}")


# ----------------------------------------------------------------------------- CUDA graphs


def _graphed_grads(forward, inputs, grads):
    """The gradients of ``forward(*inputs)`` from a captured forward + backward, replayed after
    ``inputs`` were refilled, and the same computed eagerly on the refilled inputs."""

    def step():
        return torch.autograd.grad(forward(*inputs), inputs, grads)

    graph, captured = capture_graph(step)
    gen = _seeded(99)
    with torch.no_grad():
        for t in inputs:
            t.copy_(torch.randn(t.shape, device=DEVICE, generator=gen).to(t.dtype))
    graph.replay()
    torch.cuda.synchronize()
    return list(captured), list(step())


def _captured_cases():
    gen = _seeded(21)
    bf16 = dict(dtype=torch.bfloat16, gen=gen)
    x, weight = _randn(257, 4096, **bf16), _randn(4096, **bf16)
    big_x, residual = _randn(16384, 4096, **bf16), _randn(16384, 4096, **bf16)
    gate, up = _randn(1024, 12288, **bf16), _randn(1024, 12288, **bf16)
    gate_up = _randn(64, 2 * 12288, **bf16)
    q, k = _randn(1024, 32, 128, **bf16), _randn(1024, 8, 128, **bf16)
    positions = torch.randint(0, MAX_POSITION, (1024,), device=DEVICE, generator=gen)

    table = _randn(1000, 4096, **bf16)
    ids = torch.randint(0, 1000, (1024,), device=DEVICE, generator=gen)  # repeated ids
    rows_like = torch.empty(1024, 4096, dtype=torch.bfloat16, device=DEVICE)

    def rope(a, b):
        return batchinv.rope(a, b, positions, theta=THETA, check_positions=False)

    def embedding(w):  # the backward sizes its segments by the token count: no read-back
        return batchinv.embedding(ids, w, check_ids=False)

    return {
        "rms_norm": (lambda a, w: batchinv.rms_norm(a, w, EPS), (x, weight), (x,)),
        "rms_norm 16k": (lambda a, w: batchinv.rms_norm(a, w, EPS), (big_x, weight), (big_x,)),
        "fused_add_rms_norm": (
            lambda a, r, w: batchinv.fused_add_rms_norm(a, r, w, EPS),
            (big_x, residual, weight),
            (big_x, residual),
        ),
        "silu_mul": (batchinv.silu_mul, (gate, up), (gate,)),
        "silu_mul_fused": (batchinv.silu_mul_fused, (gate_up,), (gate_up[:, :12288],)),
        "rope": (rope, (q, k), (q, k)),
        "embedding": (embedding, (table,), (rows_like,)),
    }


CAPTURED = (
    "rms_norm", "rms_norm 16k", "fused_add_rms_norm", "silu_mul", "silu_mul_fused", "rope",
    "embedding",
)  # fmt: skip


@pytest.mark.parametrize("case", CAPTURED)
def test_gradients_replay_in_a_cuda_graph(case):
    forward, inputs, grad_likes = _captured_cases()[case]
    inputs = [t.clone().requires_grad_() for t in inputs]
    grads = tuple(torch.randn_like(g) for g in grad_likes)
    replayed, eager = _graphed_grads(forward, inputs, grads[0] if len(grads) == 1 else grads)
    assert_bitwise_equal(replayed, eager, name=case)
