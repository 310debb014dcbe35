"""torch.compile with the default backend (inductor) on CUDA: the compiled Qwen3 forward and a
compiled token_logprobs training step give eager's bits, and the compiled forward stays
batch-invariant when the batch shape changes (inductor recompiles with dynamic shapes).

The batchinv ops are opaque custom ops to the compiler (batchinv/ops/_custom_op.py); what
inductor generates is the glue between them (residual adds, views, the loss), so these tests
check that inductor's own kernels change no bit on the way."""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv.contract import assert_bitwise_equal
from batchinv.models import Qwen3

pytestmark = pytest.mark.cuda


def _model() -> Qwen3:
    return Qwen3.from_config(seed=0, device="cuda", dtype=torch.bfloat16)


def _ids(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (3, 70), generator=torch.Generator().manual_seed(1))
    return ids.cuda(), torch.tensor([70, 33, 51], device="cuda")


def test_qwen3_forward_inductor_same_bits_as_eager():
    model = _model()
    ids, seqlens = _ids(model.config.vocab_size)
    with torch.no_grad():
        eager = model(ids, seqlens=seqlens)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)(ids, seqlens=seqlens)
    assert_bitwise_equal(compiled, eager, name="inductor Qwen3 forward")


def test_qwen3_forward_inductor_rows_invariant_across_batch_shapes():
    model = _model()
    ids, seqlens = _ids(model.config.vocab_size)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        batch = compiled(ids, seqlens=seqlens)
        for row in (1, 2):
            length = int(seqlens[row])
            alone = compiled(ids[row : row + 1, :length])
            assert_bitwise_equal(alone[0], batch[row, :length], name=f"row {row} alone vs batch")


def test_token_logprobs_training_step_inductor_same_bits_as_eager():
    g = torch.Generator().manual_seed(2)
    hidden = (torch.randn(37, 256, generator=g) * 0.5).to(torch.bfloat16).cuda()
    weight = (torch.randn(1000, 256, generator=g) * 0.05).to(torch.bfloat16).cuda()
    targets = torch.randint(0, 1000, (37,), generator=g).cuda()
    targets[5] = -100
    advantages = torch.linspace(-1, 1, 37, device="cuda")

    # One multiply only: a sum compiled by inductor may add in another order than torch's, and
    # `-logprob * advantages` gave -0.0 from inductor where eager gave +0.0 at an ignored token
    # (H200, torch 2.11) -- stock glue, not batchinv.  A multiply and its backward (a
    # broadcast) are exact either way.
    def step(h, w, t):
        return batchinv.token_logprobs(h, w, t) * advantages

    def run(fn):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        per_token = fn(h, w, targets)
        per_token.sum().backward()
        return per_token.detach(), h.grad, w.grad

    eager = run(step)
    torch._dynamo.reset()
    compiled = run(torch.compile(step, fullgraph=True))
    names = ("per-token loss", "grad hidden", "grad weight")
    for name, got, want in zip(names, compiled, eager, strict=True):
        assert_bitwise_equal(got, want, name=f"inductor {name}")


def test_token_logprobs_compiled_backward_does_not_rerun_the_forward(monkeypatch):
    """The compiled op saves the log-sum-exp: its backward runs the backward kernels only, so
    the forward kernels run once per step (the eager autograd's count)."""
    from batchinv.gpu import token_logprobs as gpu_token_logprobs

    calls = []
    real_forward = gpu_token_logprobs.forward

    def counting_forward(*args, **kwargs):
        calls.append(1)
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(gpu_token_logprobs, "forward", counting_forward)
    g = torch.Generator().manual_seed(3)
    hidden = (torch.randn(21, 128, generator=g) * 0.5).to(torch.bfloat16).cuda().requires_grad_()
    weight = (torch.randn(500, 128, generator=g) * 0.05).to(torch.bfloat16).cuda()
    targets = torch.randint(0, 500, (21,), generator=g).cuda()
    torch._dynamo.reset()
    step = torch.compile(lambda h, w, t: batchinv.token_logprobs(h, w, t) * 2.0, fullgraph=True)
    step(hidden, weight, targets).sum().backward()
    assert len(calls) == 1, f"the forward kernels ran {len(calls)} times in one compiled step"
    assert hidden.grad is not None and hidden.grad.shape == hidden.shape


def _attention_inputs(batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = ((batch, seq, 8, 64), (batch, seq, 2, 64), (batch, seq, 2, 64))
    return [torch.randn(s, generator=g).to(torch.bfloat16).cuda() for s in shapes]


def _count_forward_calls(monkeypatch) -> list:
    from batchinv.gpu import attention as gpu_attention

    calls = []
    real_forward = gpu_attention.forward

    def counting_forward(*args, **kwargs):
        calls.append(1)
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(gpu_attention, "forward", counting_forward)
    return calls


@pytest.mark.parametrize("varlen", [False, True], ids=["padded_masked", "varlen"])
def test_attention_compiled_backward_eager_bits_without_a_second_forward(monkeypatch, varlen):
    """The compiled attention op saves (out, lse): its backward gives the eager gradients bit
    for bit and the forward kernels run once per step."""
    q, k, v = _attention_inputs(2, 75, seed=4)
    if varlen:
        # Two packed sequences of 75 and 56 rows.
        q, k, v = (t.reshape(150, *t.shape[2:])[:131] for t in (q, k, v))
        cu = torch.tensor([0, 75, 131], dtype=torch.int32, device="cuda")

        def fn(q, k, v):
            return batchinv.attention_varlen(q, k, v, cu, cu, causal=True) * 2.0
    else:
        keep = torch.ones(2, 75, dtype=torch.bool, device="cuda")
        keep[0, 10:13] = False
        keep[1, 40:] = False
        seqlens = torch.tensor([75, 60], device="cuda")

        def fn(q, k, v):
            out = batchinv.attention(q, k, v, causal=True, seqlens_q=seqlens, key_padding_mask=keep)
            return out * 2.0

    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(q).cuda()

    def run(f):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = f(*inputs)
        out.backward(grad)
        return [out.detach()] + [t.grad for t in inputs]

    eager = run(fn)
    calls = _count_forward_calls(monkeypatch)
    torch._dynamo.reset()
    compiled = run(torch.compile(fn, fullgraph=True))
    assert len(calls) == 1, f"the forward kernels ran {len(calls)} times in one compiled step"
    for name, got, want in zip(("out", "dq", "dk", "dv"), compiled, eager, strict=True):
        assert_bitwise_equal(got, want, name=f"inductor attention {name}")
