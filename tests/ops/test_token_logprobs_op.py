"""batchinv.token_logprobs on CPU: the registry, the reference path (forward, entropy and
gradients), the module, bad input; and the GPU path's target preparation (device-side check)."""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv import registry
from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import token_logprobs as gpu_token_logprobs
from batchinv.reference import token_logprobs as reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
IGNORE = -100


def _inputs(dtype, shape=(2, 3), hidden_size=8, vocab=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, hidden_size, generator=gen).to(dtype)
    weight = torch.randn(vocab, hidden_size, generator=gen).to(dtype)
    targets = torch.randint(0, vocab, shape, generator=gen)
    return hidden, weight, targets


def test_cpu_cuda_and_hip_are_registered():
    ops = registry.registered_ops()
    assert ops["token_logprobs"] == ("cpu", "cuda", "hip")
    assert ops["token_logprobs.saving_forward"] == ("cuda", "hip")
    assert ops["token_logprobs.saved_backward"] == ("cuda", "hip")


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_forward_and_gradients_are_the_reference(dtype):
    hidden, weight, targets = _inputs(dtype)
    targets[0, 1] = IGNORE
    got = batchinv.token_logprobs(hidden, weight, targets, vocab_chunk=16, return_entropy=True)
    want = reference.token_logprobs(hidden, weight, targets, vocab_chunk=16, return_entropy=True)
    assert_bitwise_equal(got, want)

    def grads(fn):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        logprob, entropy = fn(h, w, targets, vocab_chunk=16, return_entropy=True)
        torch.autograd.backward((logprob, entropy), (torch.ones(2, 3), torch.full((2, 3), 0.5)))
        return h.grad, w.grad

    assert_bitwise_equal(grads(batchinv.token_logprobs), grads(reference.token_logprobs))


def test_module_shares_the_lm_head_weight():
    hidden, weight, targets = _inputs(torch.float32)
    lm_head = torch.nn.Linear(8, 40, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(weight)
    module = batchinv.nn.TokenLogprobs(lm_head)
    assert module.lm_head.weight is lm_head.weight
    assert_bitwise_equal(module(hidden, targets), reference.token_logprobs(hidden, weight, targets))
    module(hidden, targets).sum().backward()
    assert lm_head.weight.grad is not None
    with pytest.raises(ValueError, match="no bias"):
        batchinv.nn.TokenLogprobs(torch.nn.Linear(8, 40))


def test_bad_input_names_the_argument():
    hidden, weight, targets = _inputs(torch.float32)
    with pytest.raises(TypeError, match="target_ids"):
        batchinv.token_logprobs(hidden, weight, targets.float())
    with pytest.raises(TypeError, match="hidden"):
        batchinv.token_logprobs(hidden.long(), weight, targets)
    with pytest.raises(ValueError, match="target_ids must have shape"):
        batchinv.token_logprobs(hidden, weight, targets[:, :2])
    with pytest.raises(ValueError, match="hidden"):
        batchinv.token_logprobs(hidden[..., :4], weight, targets)
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        batchinv.token_logprobs(hidden, weight, targets, 1.5)
    bad = targets.clone()
    bad[1, 2] = 40
    with pytest.raises(IndexError, match=r"target_ids\[1, 2\] = 40 is outside"):
        batchinv.token_logprobs(hidden, weight, bad)


def test_inputs_are_not_mutated():
    hidden, weight, targets = _inputs(torch.bfloat16)
    before = (hidden.clone(), weight.clone(), targets.clone())
    batchinv.token_logprobs(hidden, weight, targets)
    assert_bitwise_equal((hidden, weight, targets), before)


def test_target_marking_reference_marks_ignored_and_bad_ids():
    # The semantics the marking kernel is tested against on the GPU; the kernels never see a
    # bad id.
    mark = gpu_token_logprobs.mark_targets_reference
    targets32, bad = mark(torch.tensor([[3, IGNORE, 9], [10, -1, 2**40]]), IGNORE, vocab=10)
    assert targets32.dtype == torch.int32
    assert targets32.tolist() == [3, -1, 9, -1, -1, -1]
    assert bad.tolist() == [False, False, False, True, True, True]
    clean, none_bad = mark(torch.tensor([0, 5]), 5, vocab=6)  # an ignored id inside the vocab
    assert clean.tolist() == [0, -1] and not none_bad.any()


def test_gpu_arguments_are_checked_before_any_launch():
    hidden, weight, _ = _inputs(torch.float32)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        gpu_token_logprobs.check_gpu_args(hidden, weight)
    hidden, weight, _ = _inputs(torch.bfloat16, hidden_size=12)
    with pytest.raises(ValueError, match="multiple of 8"):
        gpu_token_logprobs.check_gpu_args(hidden, weight)
