"""The grouped small-M linear (``linear_small_m_grouped_*``: q/k/v or gate/up of one x in one
launch) on CUDA sm_90a:

- each weight's columns bitwise equal to a separate ``batchinv.linear`` call, at the
  Qwen3-8B q/k/v and gate/up shapes and at odd sizes (N = 40, 1000, 33; K = 72), M = 1, 2, 3,
  8 and 16, bf16 and fp16, with and without bias, in every built configuration, every output
  element written (NaN-filled ``out``), an empty weight among others;
- the same inside a captured CUDA graph, replayed on new inputs;
- the op table's ``linear_group``: views of one output with those bits, declining where a
  gradient is needed or M is too large;
- the sampler with and without the grouping: the same tokens, logprobs and cache contents,
  eager and replayed (the pattern of ``test_decode_fusion_cuda.py``).
CPU tests of the checks and the chain wiring: ``tests/ops/test_linear_grouped_args.py``,
``tests/models/test_qwen3_linear_group.py``."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

import batchinv
from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import linear as gpu_linear
from batchinv.models import Qwen3, Qwen3Config
from batchinv.models.qwen3.decode import Qwen3DecodeRunner
from batchinv.models.qwen3.ops import BATCHINV_OPS
from batchinv.shapes import QWEN3_8B_CONFIG

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
DTYPES = (torch.bfloat16, torch.float16)
ROWS = (1, 2, 3, 8, 16)
_C = QWEN3_8B_CONFIG
_Q = _C["num_attention_heads"] * _C["head_dim"]
_KV = _C["num_key_value_heads"] * _C["head_dim"]
# (name, K, the weights' out_features)
GROUPS = (
    ("qkv-8b", _C["hidden_size"], (_Q, _KV, _KV)),
    ("gate-up-8b", _C["hidden_size"], (_C["intermediate_size"],) * 2),
    ("odd", 72, (40, 1000, 33)),  # partial bands and boxes, odd column offsets
    ("odd-pair", 72, (33, 40)),
    ("one", 72, (1000,)),
)


@pytest.fixture(autouse=True)
def _hopper():
    if not gpu_linear.uses_hopper(torch.device(DEVICE)):
        pytest.skip("the grouped small-M kernels are sm_90a only")


def _case(k, out_features, m, dtype, bias, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed + m)
    x = torch.randn(m, k, device=DEVICE, generator=gen).to(dtype)
    weights = [
        (torch.randn(n, k, device=DEVICE, generator=gen) / k**0.5).to(dtype) for n in out_features
    ]
    biases = [
        torch.randn(n, device=DEVICE, generator=gen).to(dtype) if bias else None
        for n in out_features
    ]
    return x, weights, biases


def _separate(x, weights, biases):
    with torch.no_grad():
        return [batchinv.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]


def _assert_columns(out, expected, label):
    parts = out.split([e.shape[-1] for e in expected], dim=-1)
    for i, (got, want) in enumerate(zip(parts, expected, strict=True)):
        assert_bitwise_equal(got, want, name=f"{label} weight {i}")


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("name, k, out_features", GROUPS, ids=[g[0] for g in GROUPS])
def test_grouped_columns_are_the_separate_linears(name, k, out_features, m, dtype, bias):
    x, weights, biases = _case(k, out_features, m, dtype, bias)
    expected = _separate(x, weights, biases)
    assert gpu_linear.small_m_grouped_configs() == gpu_linear.small_m_configs()
    for config in (None, *gpu_linear.small_m_grouped_configs()):
        out = torch.full((m, sum(out_features)), float("nan"), dtype=dtype, device=DEVICE)
        got = gpu_linear.matmul_grouped(x, weights, biases, config=config, out=out)
        assert got is out
        _assert_columns(out, expected, f"{name} M={m} {config}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_equals_every_small_m_configuration_of_the_separate_kernel(dtype):
    x, weights, biases = _case(72, (40, 1000, 33), 11, dtype, bias=True)
    grouped = gpu_linear.matmul_grouped(x, weights, biases)
    for config in gpu_linear.small_m_configs():
        separate = [
            gpu_linear.matmul_nt(x, w, b, family="small_m", config=config)
            for w, b in zip(weights, biases, strict=True)
        ]
        _assert_columns(grouped, separate, str(config))


def test_no_rows_give_an_empty_output():
    x, weights, biases = _case(72, (40, 16), 0, torch.bfloat16, bias=True)
    assert gpu_linear.matmul_grouped(x, weights, biases).shape == (0, 56)


def test_an_empty_weight_between_two_others_gets_no_columns():
    x, weights, biases = _case(72, (40, 0, 33), 5, torch.bfloat16, bias=True)
    _assert_columns(
        gpu_linear.matmul_grouped(x, weights, biases), _separate(x, weights, biases), ""
    )


@pytest.mark.parametrize("name, k, out_features", GROUPS[:3], ids=[g[0] for g in GROUPS[:3]])
def test_grouped_launch_replays_in_a_cuda_graph(name, k, out_features):
    dtype = torch.bfloat16
    x, weights, biases = _case(k, out_features, 8, dtype, bias=True)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: kernel loads and attributes outside the capture
        gpu_linear.matmul_grouped(static_x, weights, biases)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_out = gpu_linear.matmul_grouped(static_x, weights, biases)
        static_views = BATCHINV_OPS.linear_group(static_x[:, None], weights, biases)
    for seed in (1, 2):
        fresh, _, _ = _case(k, out_features, 8, dtype, bias=False, seed=100 * seed)
        static_x.copy_(fresh)
        graph.replay()
        expected = _separate(fresh, weights, biases)
        _assert_columns(static_out, expected, f"{name} replay {seed}")
        for i, (view, want) in enumerate(zip(static_views, expected, strict=True)):
            assert_bitwise_equal(view[:, 0], want, name=f"{name} linear_group replay {seed} {i}")


@pytest.mark.parametrize("m", ROWS)
def test_linear_group_returns_views_of_one_output_with_the_linear_bits(m):
    _, k, out_features = GROUPS[0]
    x, weights, biases = _case(k, out_features, m, torch.bfloat16, bias=False)
    x = x[:, None]  # [tokens, 1, K], as a decode step gives it
    with torch.no_grad():
        views = BATCHINV_OPS.linear_group(x, weights, biases)
        expected = [batchinv.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
    assert views is not None and len(views) == 3
    base = views[0].untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == base for v in views)
    for i, (view, want) in enumerate(zip(views, expected, strict=True)):
        assert view.shape == want.shape
        assert_bitwise_equal(view, want, name=f"weight {i}")


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("m", (1, 8, 16))
@pytest.mark.parametrize("name, k, out_features", GROUPS, ids=[g[0] for g in GROUPS])
def test_kept_linear_group_launch_gives_the_separate_linears_bits(name, k, out_features, m, bias):
    # The first call plans, the next replay the kept launch (TMA maps per address): a new x at
    # another address and new values must still give the separate linears' bits.
    gpu_linear._LEAN_GROUPED.clear()
    x, weights, biases = _case(k, out_features, m, torch.bfloat16, bias)
    with torch.no_grad():
        for seed in (0, 1, 2):
            fresh, _, _ = _case(k, out_features, m, torch.bfloat16, bias=False, seed=50 + seed)
            for label, rows in (("same x", x.copy_(fresh)), ("new x", fresh.clone())):
                views = gpu_linear.linear_group(rows, weights, biases)
                expected = _separate(rows, weights, biases)
                for i, (view, want) in enumerate(zip(views, expected, strict=True)):
                    assert_bitwise_equal(view, want, name=f"{name} {label} {seed} weight {i}")
    assert [type(p) for p in gpu_linear._LEAN_GROUPED.values()] == [gpu_linear._LeanGrouped]


def test_linear_group_declines_with_gradients_and_beyond_the_small_m_rule():
    _, k, out_features = GROUPS[0]
    x, weights, biases = _case(k, out_features, 4, torch.bfloat16, bias=False)
    assert BATCHINV_OPS.linear_group(x.requires_grad_(), weights, biases) is None
    big, _, _ = _case(k, out_features, 17, torch.bfloat16, bias=False)
    with torch.no_grad():
        assert BATCHINV_OPS.linear_group(big, weights, biases) is None
        assert BATCHINV_OPS.linear_group(big[:16], weights, biases) is not None


# ----- the sampler -----------------------------------------------------------------------------

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11], [300, 4, 17, 17], [5] * 40]
MODELS = {
    "bf16-d64": (None, torch.bfloat16),
    "fp16-d128": (
        dataclasses.replace(
            Qwen3Config.tiny(), head_dim=128, num_attention_heads=8, num_key_value_heads=2
        ),
        torch.float16,
    ),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    config, dtype = MODELS[request.param]
    return Qwen3.from_config(config, seed=0, device=DEVICE, dtype=dtype)


def _sample(model, *, cuda_graph, temperature, grouped=True):
    runner = Qwen3DecodeRunner(
        model, max_batch=8, capacity=64, cuda_graph=cuda_graph, temperature=temperature
    )
    if not grouped:
        runner._ops = dataclasses.replace(runner._ops, linear_group=None)
    slots = runner.add(PROMPTS, seeds=list(range(len(PROMPTS))))
    for step in range(9):
        # buckets 8, 1, 4, 2 (default buckets of max_batch 8), padded with inert rows
        runner.step([slots, slots[:1], slots[1:4], slots[3:5]][step % 4])
    runner.sync()
    return runner, slots


def _assert_same_samples(a, a_slots, b, b_slots):
    for x, y in zip(a_slots, b_slots, strict=True):
        assert a.tokens(x) == b.tokens(y)
        assert_bitwise_equal(a.logprobs(x), b.logprobs(y))
    # Every slot's storage (the scratch row, written by padding and failed steps, aside).
    assert_bitwise_equal(a.cache.k[:, :-1], b.cache.k[:, :-1], name="k")
    assert_bitwise_equal(a.cache.v[:, :-1], b.cache.v[:, :-1], name="v")
    assert_bitwise_equal(a.cache.lengths, b.cache.lengths, name="lengths")


@pytest.mark.parametrize("temperature", [None, 0.8])
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "graph"])
def test_sampler_grouped_and_separate_agree(model, cuda_graph, temperature, monkeypatch):
    calls = []
    launch, run_kept = gpu_linear._launch_grouped, gpu_linear._run_grouped

    def counting(x, *args):  # the checked path's launch
        calls.append(x.shape[0])
        return launch(x, *args)

    def counting_kept(plan, *args):  # a kept launch
        calls.append(plan.m)
        return run_kept(plan, *args)

    monkeypatch.setattr(gpu_linear, "_launch_grouped", counting)
    monkeypatch.setattr(gpu_linear, "_run_grouped", counting_kept)
    grouped, slots = _sample(model, cuda_graph=cuda_graph, temperature=temperature)
    layers = model.config.num_hidden_layers
    per_bucket = Counter(calls)  # rows of each call: the bucket
    assert set(per_bucket) == {1, 2, 4, 8}
    if cuda_graph:  # warm-ups and the capture of each bucket, q/k/v and gate/up in every layer
        assert all(n % (2 * layers) == 0 for n in per_bucket.values()), per_bucket
    else:  # nine steps (the 40-token prefill is beyond the small-M rule)
        assert len(calls) == 9 * 2 * layers
    monkeypatch.undo()
    plain, plain_slots = _sample(
        model, cuda_graph=cuda_graph, temperature=temperature, grouped=False
    )
    _assert_same_samples(grouped, slots, plain, plain_slots)
