"""batchinv.log_softmax on CPU: the registry, the reference path, autograd, the module, bad
input; and the GPU block size, which must follow the row length and dtype only."""

from __future__ import annotations

import inspect

import pytest
import torch

import batchinv
from batchinv import registry
from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import log_softmax as gpu_log_softmax
from batchinv.reference import log_softmax as reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def test_every_backend_is_registered():
    assert registry.registered_ops()["log_softmax"] == ("cpu", "cuda", "hip")


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_forward_and_gradient_are_the_reference(dtype, out_dtype):
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(2, 3, 50, generator=gen)).to(dtype)
    got = batchinv.log_softmax(x, -1, out_dtype, chunk_size=16)
    assert_bitwise_equal(got, reference.log_softmax(x, -1, out_dtype, chunk_size=16))
    xl = x.clone().requires_grad_(True)
    grad = torch.randn(2, 3, 50, generator=gen).to(out_dtype)
    batchinv.log_softmax(xl, -1, out_dtype).backward(grad)
    xr = x.clone().requires_grad_(True)
    reference.log_softmax(xr, -1, out_dtype).backward(grad)
    assert_bitwise_equal(xl.grad, xr.grad)


def test_module():
    x = torch.randn(3, 10)
    assert_bitwise_equal(batchinv.nn.LogSoftmax()(x), reference.log_softmax(x))
    assert batchinv.nn.LogSoftmax(torch.bfloat16)(x).dtype == torch.bfloat16


def test_bad_input_names_the_argument():
    x = torch.randn(3, 10)
    with pytest.raises(ValueError, match="dim must be the last dimension"):
        batchinv.log_softmax(x, 0)
    with pytest.raises(TypeError, match="out_dtype must be one of"):
        batchinv.log_softmax(x, -1, torch.int32)
    with pytest.raises(TypeError, match="x must have dtype"):
        batchinv.log_softmax(x.long())
    with pytest.raises(ValueError, match="must be >= 1"):
        batchinv.log_softmax(torch.empty(2, 0))
    with pytest.raises(TypeError, match="chunk_size must be an int"):
        batchinv.log_softmax(x, chunk_size=2.0)


def test_inputs_are_not_mutated():
    x = torch.randn(3, 10).bfloat16()
    before = x.clone()
    batchinv.log_softmax(x)
    assert_bitwise_equal(x, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_block_size_follows_the_row_length_only(dtype):
    sizes = []
    for vocab in (1, 7, 111, 2048, 4096, 4097, 8192, 8193, 32000, 151936, 262144):
        threads = gpu_log_softmax.threads_for(vocab, dtype)
        assert threads == gpu_log_softmax.threads_for(vocab, dtype)
        sizes.append(threads)
    assert sizes == sorted(sizes)  # longer rows never get a narrower tree
    assert set(sizes) == {
        gpu_log_softmax.SMALL_ROW_THREADS,
        gpu_log_softmax.LARGE_ROW_THREADS,
        1024,  # the long-row T of the forward into fp32 (QWEN3_VOCAB_THREADS)
    }


# The tree of every case at the Qwen3 vocabulary, written out: it is the same on every card (no
# device argument exists), and a change here changes every card's bits at once.
QWEN3_VOCAB_THREADS = [
    # (direction, x dtype, out / grad_out dtype, T)
    ("forward", torch.bfloat16, torch.float32, 1024),
    ("forward", torch.float16, torch.float32, 1024),
    ("forward", torch.float32, torch.float32, 1024),
    ("forward", torch.bfloat16, torch.bfloat16, 512),
    ("forward", torch.float16, torch.float16, 512),
    ("backward", torch.bfloat16, torch.bfloat16, 1024),
    ("backward", torch.bfloat16, torch.float32, 2048),
    ("backward", torch.float16, torch.float32, 2048),
    ("backward", torch.float32, torch.float32, 1024),
    ("backward", torch.float16, torch.float16, 512),
]


@pytest.mark.parametrize("direction, dtype, out_dtype, threads", QWEN3_VOCAB_THREADS)
def test_gpu_block_size_at_the_qwen3_vocabulary(direction, dtype, out_dtype, threads):
    backward = direction == "backward"
    assert gpu_log_softmax.threads_for(151936, dtype, out_dtype, backward=backward) == threads
    # rows that fit one CTA on chip, or whose length is not a multiple of 8, keep T = 512
    assert gpu_log_softmax.threads_for(32000, dtype, out_dtype, backward=backward) == 512
    assert gpu_log_softmax.threads_for(151937, dtype, out_dtype, backward=backward) == 512


def test_wide_tree_is_a_backward_with_fp32_grad_out_on_a_1024_thread_block():
    # T = 2048 is compiled for the backward with fp32 grad_out only (a one-CTA kernel of 1024
    # threads playing two tree threads each, and a 16 x 128 cluster): the table may not ask for
    # it anywhere else.
    wide = gpu_log_softmax.WIDE_THREADS
    for (direction, dtype, out_dtype), threads in gpu_log_softmax.LONG_ROW_THREADS.items():
        assert threads in (gpu_log_softmax.LARGE_ROW_THREADS, 1024, wide)
        if threads == wide:
            suffix = f"{gpu_log_softmax._SUFFIX[dtype]}_{gpu_log_softmax._SUFFIX[out_dtype]}"
            assert direction == "backward" and suffix in gpu_log_softmax.WIDE_BACKWARD_SUFFIXES
            assert gpu_log_softmax.cluster_shape(wide, out_dtype) == (16, 128)
    assert gpu_log_softmax.block_threads(wide) == 1024
    assert gpu_log_softmax.block_threads(1024) == 1024
    assert gpu_log_softmax.block_threads(512) == 512


def test_gpu_block_size_takes_no_device():
    # the tree may not follow the card: threads_for has no way to see one
    params = inspect.signature(gpu_log_softmax.threads_for).parameters
    assert "device" not in params
