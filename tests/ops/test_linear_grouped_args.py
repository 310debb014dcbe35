"""``batchinv.gpu.linear.matmul_grouped``'s argument checks and ``grouped_applies`` on the CPU
(no device is touched before the checks pass), and the grouped kernels declared by the build.
The kernel's bits: ``tests/gpu/test_linear_grouped_cuda.py``."""

from __future__ import annotations

import pytest
import torch

from batchinv.gpu import linear as gpu_linear

K = 64


def _t(*shape, dtype=torch.bfloat16):
    return torch.zeros(*shape, dtype=dtype)


def _qkv(m=3, dtype=torch.bfloat16):
    return _t(m, K, dtype=dtype), [_t(n, K, dtype=dtype) for n in (40, 16, 16)]


def test_valid_arguments_pass_the_checks_and_fill_the_biases():
    x, weights = _qkv()
    assert gpu_linear.check_grouped_args(x, weights, None) == (None, None, None)
    biases = [_t(40), None, _t(16)]
    assert gpu_linear.check_grouped_args(x, weights, biases) == tuple(biases)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda x, w, b: (x[:, :8].t(), w, b), ValueError, r"x must be 2-D|x must be contiguous"),
        (lambda x, w, b: (x[None], w, b), ValueError, r"x must be 2-D \[M, K\]"),
        (lambda x, w, b: (x.float(), w, b), TypeError, r"x must be bf16 or fp16"),
        (lambda x, w, b: (x, w[0], b), TypeError, r"weights must be a list or tuple"),
        (lambda x, w, b: (x, [], b), ValueError, r"weights must hold 1 to 3 tensors, got 0"),
        (lambda x, w, b: (x, w + [w[0]], b), ValueError, r"weights must hold 1 to 3 .* got 4"),
        (lambda x, w, b: (x, w, [None]), ValueError, r"biases must hold one entry per weight"),
        (lambda x, w, b: (x, w, _t(40)), TypeError, r"biases must be None or a list"),
        (lambda x, w, b: (x, [w[0], _t(16, 72)], b), ValueError, r"weights\[1\] must be \[N, 64\]"),
        (lambda x, w, b: (x, [w[0], "w"], b), TypeError, r"weights\[1\] must be a Tensor"),
        (
            lambda x, w, b: (x, [w[0], w[1].half()], b),
            TypeError,
            r"weights\[1\] has dtype torch.float16 but x has torch.bfloat16",
        ),
        (
            lambda x, w, b: (x, [w[0], _t(K, 32).t()], b),
            ValueError,
            r"weights\[1\] must be contiguous",
        ),
        (lambda x, w, b: (x, w, [None, _t(15), None]), ValueError, r"biases\[1\] must be \[16\]"),
        (
            lambda x, w, b: (x, w, [None, None, _t(16).half()]),
            TypeError,
            r"biases\[2\] has dtype",
        ),
        (
            lambda x, w, b: (x, w, [_t(80)[::2], None, None]),
            ValueError,
            r"biases\[0\] must be contiguous",
        ),
        (lambda x, w, b: (x, w, [1.0, None, None]), TypeError, r"biases\[0\] must be a Tensor"),
    ],
)
def test_bad_arguments_name_the_argument(change, error, message):
    x, weights = _qkv()
    x, weights, biases = change(x, weights, None)
    with pytest.raises(error, match=message):
        gpu_linear.check_grouped_args(x, weights, biases)
    with pytest.raises(error, match=message):  # before any device is asked for
        gpu_linear.matmul_grouped(x, weights, biases)


def test_in_features_must_be_a_multiple_of_8():
    x = _t(2, 60)
    with pytest.raises(ValueError, match=r"in_features % 8 == 0"):
        gpu_linear.check_grouped_args(x, [_t(8, 60)], None)
    with pytest.raises(ValueError, match=r"in_features must be >= 1"):
        gpu_linear.check_grouped_args(_t(2, 0), [_t(8, 0)], None)


@pytest.mark.parametrize(
    "m, out_features, ok",
    [
        (1, (4096, 1024, 1024), True),
        (8, (151936,), True),  # up to 8 rows: any N
        (9, (12288, 12288), True),
        (16, (4096, 1024, 1024), True),
        (16, (32768, 32768), True),
        (16, (4096, 32769), False),  # one weight beyond the wide rule's N
        (17, (1024,), False),
        (0, (1024,), True),
    ],
)
def test_rows_must_be_within_the_small_m_rule_of_every_weight(m, out_features, ok):
    assert gpu_linear.takes_grouped(m, out_features) is ok
    assert ok == all(gpu_linear.takes_small_m(m, n) for n in out_features)


def test_too_many_rows_is_a_value_error_naming_the_rule():
    x, weights = _qkv(m=17)
    with pytest.raises(ValueError, match=r"x has 17 rows: the grouped small-M kernel takes"):
        gpu_linear.check_grouped_args(x, weights, None)


def test_valid_arguments_on_the_cpu_need_an_sm90_gpu():
    x, weights = _qkv()
    with pytest.raises(RuntimeError, match=r"needs an sm_90 GPU"):
        gpu_linear.matmul_grouped(x, weights)


def test_grouped_applies_is_false_on_the_cpu_and_never_raises():
    x, weights = _qkv()
    assert not gpu_linear.grouped_applies(x[:, None], weights, [None] * 3)
    assert not gpu_linear.grouped_applies(x, "not weights", None)
    assert not gpu_linear.grouped_applies("not x", weights, None)
    assert not gpu_linear.grouped_applies(x.float(), weights, None)


def test_linear_group_traces_under_torch_compile_without_reading_pointers():
    # Under torch.compile linear_group declines (the chain then runs the separate linears)
    # before anything reads a data pointer, which dynamo cannot trace: fullgraph must hold.
    x, weights = _qkv()
    with torch.no_grad():
        got = torch.compile(
            lambda t: gpu_linear.linear_group(t, weights, None), fullgraph=True, backend="eager"
        )(x)
    assert got is None


def test_every_small_m_configuration_has_a_grouped_kernel():
    pytest.importorskip("batchinv._native", reason="the extension is built by `nox -s tests`")
    configs = gpu_linear.small_m_configs()
    assert configs and gpu_linear.small_m_grouped_configs() == configs
    declared = gpu_linear.declared_kernels("linear")
    for config in configs:
        for dtype in (torch.bfloat16, torch.float16):
            name = gpu_linear.grouped_kernel_name(config, dtype)
            # map_x, three weight maps, out, three biases, M, three N, K
            assert (
                declared[name]
                == "tmap, tmap, tmap, tmap, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32"
            )
