"""``torch.ops.batchinv.*``: opcheck, eager equality, and torch.compile(fullgraph=True).

The compiled model is built from batchinv's public ops only (embedding -> rms_norm -> linear ->
rope -> attention -> linear -> silu_mul -> linear -> log_softmax).  On the CPU it is compiled
with the "aot_eager" backend (forward and backward graphs through AOTAutograd, no inductor
codegen, which would take minutes on this machine); each custom op is one opaque node whose
implementation is the eager op, so compiled and eager must agree bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv.contract import assert_bitwise_equal

OPS = torch.ops.batchinv


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed: int, requires_grad: bool = True, dtype=torch.float32):
    t = torch.randn(*shape, generator=_gen(seed), dtype=dtype)
    return t.requires_grad_(requires_grad)


# (op, args) for opcheck: small CPU shapes, float inputs requiring grad so the autograd
# registration and the backward op are exercised.
def _opcheck_cases():
    ids = torch.tensor([[3, 0, 5], [1, 1, 7]])
    positions = torch.tensor([[0, 1, 2], [5, 6, 7]])
    seqlens = torch.tensor([3, 2])
    keep = torch.tensor([[True, True, False, True], [True, False, True, True]])
    cu = torch.tensor([0, 3, 5])
    targets = torch.tensor([[3, -100, 10], [0, 7, 7]])
    return {
        "linear": (OPS.linear.default, (_randn(2, 3, 8, seed=0), _randn(5, 8, seed=1), None)),
        "linear_bias": (
            OPS.linear.default,
            (_randn(4, 8, seed=0), _randn(5, 8, seed=1), _randn(5, seed=2)),
        ),
        "embedding": (OPS.embedding.default, (ids, _randn(9, 4, seed=3), True)),
        "rms_norm": (OPS.rms_norm.default, (_randn(2, 3, 8, seed=4), _randn(8, seed=5), 1e-6)),
        "fused_add_rms_norm": (
            OPS.fused_add_rms_norm.default,
            (_randn(3, 8, seed=6), _randn(3, 8, seed=7), _randn(8, seed=8), 1e-6),
        ),
        "rope": (
            OPS.rope.default,
            (
                _randn(2, 3, 4, 8, seed=9),
                _randn(2, 3, 2, 8, seed=10),
                positions,
                10000.0,
                None,
                64,
                True,
            ),
        ),
        "silu_mul": (OPS.silu_mul.default, (_randn(3, 6, seed=11), _randn(3, 6, seed=12))),
        "silu_mul_fused": (OPS.silu_mul_fused.default, (_randn(3, 12, seed=13),)),
        "log_softmax": (OPS.log_softmax.default, (_randn(3, 10, seed=14), -1, torch.float32, 4)),
        "attention": (
            OPS.attention.default,
            (
                _randn(2, 3, 4, 8, seed=15),
                _randn(2, 4, 2, 8, seed=16),
                _randn(2, 4, 2, 8, seed=17),
                True,
                None,
                seqlens,
                None,
                keep,
            ),
        ),
        "attention_varlen": (
            OPS.attention_varlen.default,
            (
                _randn(5, 4, 8, seed=18),
                _randn(5, 2, 8, seed=19),
                _randn(5, 2, 8, seed=20),
                cu,
                cu,
                True,
                0.3,
            ),
        ),
        "token_logprobs": (
            OPS.token_logprobs.default,
            (_randn(2, 3, 8, seed=21), _randn(11, 8, seed=22), targets, -100, 4, False),
        ),
        "token_logprobs_entropy": (
            OPS.token_logprobs.default,
            (_randn(6, 8, seed=23), _randn(11, 8, seed=24), targets.reshape(6), -100, 4, True),
        ),
    }


@pytest.mark.parametrize("case", sorted(_opcheck_cases()))
def test_opcheck(case):
    op, args = _opcheck_cases()[case]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("case", sorted(_opcheck_cases()))
def test_custom_op_equals_public_op_bitwise(case):
    """The custom op runs the public op: same forward bits and same input gradients."""
    op, args = _opcheck_cases()[case]
    public = {
        "linear": lambda a: batchinv.linear(*a),
        "linear_bias": lambda a: batchinv.linear(*a),
        "embedding": lambda a: batchinv.embedding(a[0], a[1]),
        "rms_norm": lambda a: batchinv.rms_norm(*a),
        "fused_add_rms_norm": lambda a: batchinv.fused_add_rms_norm(*a),
        "rope": lambda a: batchinv.rope(a[0], a[1], a[2], theta=a[3], max_position=a[5]),
        "silu_mul": lambda a: batchinv.silu_mul(*a),
        "silu_mul_fused": lambda a: batchinv.silu_mul_fused(*a),
        "log_softmax": lambda a: batchinv.log_softmax(a[0], a[1], a[2], chunk_size=a[3]),
        "attention": lambda a: batchinv.attention(
            *a[:3], causal=a[3], seqlens_q=a[5], key_padding_mask=a[7], return_lse=True
        ),
        "attention_varlen": lambda a: batchinv.attention_varlen(
            *a[:5], causal=a[5], softmax_scale=a[6], return_lse=True
        ),
        # The op's entropy is empty without entropy; its lse is empty on the CPU.
        "token_logprobs": lambda a: (
            batchinv.token_logprobs(*a[:4], vocab_chunk=a[4]),
            torch.empty(0),
            torch.empty(0),
        ),
        "token_logprobs_entropy": lambda a: (
            *batchinv.token_logprobs(*a[:4], vocab_chunk=a[4], return_entropy=True),
            torch.empty(0),
        ),
    }[case]

    def run(fn):
        inputs = [a.detach().clone().requires_grad_() if _is_float(a) else a for a in args]
        out = fn(inputs)
        outs = out if isinstance(out, tuple) else (out,)
        differentiable = [o for o in outs if o.requires_grad]
        seeds = [torch.randn(o.shape, generator=_gen(99), dtype=o.dtype) for o in differentiable]
        torch.autograd.backward(differentiable, seeds)
        return [o.detach() for o in outs], [a.grad for a in inputs if _is_float(a)]

    got_out, got_grads = run(lambda a: op(*a))
    want_out, want_grads = run(public)
    assert_bitwise_equal(got_out, want_out, name=f"{case} forward")
    assert_bitwise_equal(got_grads, want_grads, name=f"{case} input gradients")


def _is_float(a) -> bool:
    return isinstance(a, torch.Tensor) and a.is_floating_point()


def test_fake_checks_shapes_without_values():
    """Under FakeTensorMode (what torch.compile traces with) a shape error is still raised."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w = torch.empty(3, 8), torch.empty(5, 7)
        with pytest.raises(ValueError, match="in_features"):
            OPS.linear(x, w, None)
        out = OPS.linear(x, torch.empty(5, 8), None)
        assert out.shape == (3, 5)


def test_value_checks_run_when_the_compiled_op_executes():
    """An out-of-range id is not visible at trace time; the op raises when it runs."""
    weight = torch.randn(4, 3)
    compiled = torch.compile(
        lambda ids: batchinv.embedding(ids, weight), fullgraph=True, backend="aot_eager"
    )
    assert_bitwise_equal(compiled(torch.tensor([0, 3])), weight[[0, 3]], name="compiled gather")
    with pytest.raises(IndexError, match="ids"):
        compiled(torch.tensor([0, 4]))


# ----------------------------------------------------------------------------- compile

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 32, 4, 2, 8, 48


def _block_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = _gen(seed)

    def p(*shape, scale=0.2):
        return (torch.randn(*shape, generator=g) * scale).requires_grad_()

    return {
        "embed": p(VOCAB, HIDDEN, scale=1.0),
        "norm": (1 + p(HIDDEN)).detach().requires_grad_(),
        "q": p(HEADS * HEAD_DIM, HIDDEN),
        "k": p(KV_HEADS * HEAD_DIM, HIDDEN),
        "v": p(KV_HEADS * HEAD_DIM, HIDDEN),
        "o": p(HIDDEN, HEADS * HEAD_DIM),
        "gate_up": p(2 * INTER, HIDDEN),
        "down": p(HIDDEN, INTER),
        "head": p(VOCAB, HIDDEN),
    }


def qwen3_like_block(ids, positions, seqlens, w):
    """One Qwen3-shaped layer and the head, from batchinv's public ops only."""
    batch, seq = ids.shape
    h = batchinv.embedding(ids, w["embed"])
    x = batchinv.rms_norm(h, w["norm"], 1e-6)
    q = batchinv.linear(x, w["q"]).view(batch, seq, HEADS, HEAD_DIM)
    k = batchinv.linear(x, w["k"]).view(batch, seq, KV_HEADS, HEAD_DIM)
    v = batchinv.linear(x, w["v"]).view(batch, seq, KV_HEADS, HEAD_DIM)
    q, k = batchinv.rope(q, k, positions, theta=10000.0)
    a = batchinv.attention(q, k, v, causal=True, seqlens_q=seqlens, seqlens_k=seqlens)
    h = h + batchinv.linear(a.reshape(batch, seq, HEADS * HEAD_DIM), w["o"])
    x, h = batchinv.fused_add_rms_norm(h, torch.zeros_like(h), w["norm"], 1e-6)
    h = h + batchinv.linear(batchinv.silu_mul_fused(batchinv.linear(x, w["gate_up"])), w["down"])
    return batchinv.log_softmax(batchinv.linear(h, w["head"]))


def test_compiled_block_fullgraph_same_bits_as_eager():
    torch._dynamo.reset()
    w = _block_params()
    ids = torch.randint(0, VOCAB, (3, 7), generator=_gen(1))
    positions = torch.arange(7).expand(3, 7)
    seqlens = torch.tensor([7, 4, 6])

    def run(fn):
        for t in w.values():
            t.grad = None
        out = fn(ids, positions, seqlens, w)
        (out * torch.linspace(-1, 1, VOCAB)).sum().backward()
        return out.detach(), {name: t.grad.clone() for name, t in w.items()}

    eager_out, eager_grads = run(qwen3_like_block)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(qwen3_like_block, fullgraph=True, backend=counter)
    compiled_out, compiled_grads = run(compiled)
    assert counter.frame_count == 1  # one graph, no break
    assert_bitwise_equal(compiled_out, eager_out, name="compiled logprobs")
    for name in w:
        assert_bitwise_equal(compiled_grads[name], eager_grads[name], name=f"grad {name}")
    # Not vacuous: the graph holds the custom ops, not a trace of their internals.
    graph_ops = {str(n.target) for n in counter.graphs[0].graph.nodes if n.op == "call_function"}
    assert any("batchinv.attention" in t for t in graph_ops), graph_ops
    assert any("batchinv.linear" in t for t in graph_ops), graph_ops


@pytest.mark.parametrize("padded", (False, True))
def test_qwen3_model_forward_compiles_fullgraph_with_eager_bits(padded):
    """torch.compile(fullgraph=True) works on the Qwen3 forward (aot_eager on CPU)."""
    from batchinv.models import Qwen3

    model = Qwen3.from_config(seed=0)
    ids = torch.randint(
        0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1)
    )
    kwargs = {"seqlens": torch.tensor([9, 5])} if padded else {}
    eager = model(ids, **kwargs)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert_bitwise_equal(compiled(ids, **kwargs), eager, name="compiled Qwen3 forward")


def test_token_logprobs_compiles_fullgraph_with_eager_bits():
    hidden = _randn(5, 8, seed=30, requires_grad=False)
    weight = _randn(13, 8, seed=31, requires_grad=False)
    targets = torch.tensor([0, 12, -100, 4, 4])

    def fn(h, w, t):
        logprobs, entropy = batchinv.token_logprobs(h, w, t, return_entropy=True)
        return logprobs - 0.1 * entropy

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    assert_bitwise_equal(compiled(hidden, weight, targets), fn(hidden, weight, targets))


def test_backward_op_computes_only_the_gradients_asked_for():
    """The backward op gets a ``needs`` flag per differentiable input and returns an empty
    tensor (nothing computed) where it is False."""
    x, weight, bias = _randn(2, 3, 8, seed=40), _randn(5, 8, seed=41), _randn(5, seed=42)
    grad_out = _randn(2, 3, 5, seed=43, requires_grad=False)
    with torch.no_grad():
        grad_x, grad_weight, grad_bias = OPS.linear_backward(
            [grad_out], [True, False, False], [], x, weight, bias
        )
    assert grad_x.shape == x.shape
    assert grad_weight.numel() == 0 and grad_bias.numel() == 0


def test_frozen_input_gets_no_gradient_and_the_other_the_eager_bits():
    hidden = _randn(4, 8, seed=44)
    weight = _randn(13, 8, seed=45, requires_grad=False)
    targets = torch.tensor([0, 12, -100, 4])
    logprobs, _entropy, _lse = OPS.token_logprobs(hidden, weight, targets, -100, 4096, False)
    logprobs.sum().backward()
    want = hidden.detach().clone().requires_grad_()
    batchinv.token_logprobs(want, weight, targets).sum().backward()
    assert weight.grad is None
    assert_bitwise_equal(hidden.grad, want.grad, name="grad hidden")
