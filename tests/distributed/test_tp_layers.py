"""Tensor-parallel layers on gloo (CPU), world sizes 2, 3 and 4, against one process.

One spawn per world size runs every check (``_rank_checks``); the parent compares bit for bit:
row-parallel == ``batchinv.linear_k_groups`` of the full layer (K with a partial last box,
empty groups and ranks that hold no column, bias or not, fp32 and bf16); column-parallel ==
``batchinv.linear``; ``invariant_all_reduce`` equal on every rank, across arrival orders
(ranks delayed differently) and to the fixed tree done in one process; vocab-parallel token
logprobs == ``token_logprobs_tiled`` (TP = 1) with ignored rows; vocab-parallel logits ==
``batchinv.lm_head``; and bad inputs raise errors naming the argument.
"""

from __future__ import annotations

import time

import pytest
import torch
from _spawn import run_world

import batchinv
from batchinv.contract import assert_bitwise_equal
from batchinv.distributed import (
    ColumnParallelLinear,
    RowParallelLinear,
    column_parallel_linear,
    invariant_all_reduce,
    k_range,
    rank_tree_sum,
    row_parallel_linear,
    shard_columns,
    shard_k,
    vocab_parallel_logits,
    vocab_parallel_token_logprobs,
    vocab_ranges,
)
from batchinv.reference.token_logprobs import token_logprobs_tiled

WORLD_SIZES = (2, 3, 4)
IGNORE = -100
# (rows shape, out_features, in_features, dtype, bias): K = 200 leaves groups 4..7 empty (and
# ranks without columns at T = 3, 4); K = 1000 has a partial last group; 520 empties 5..7.
ROW_CASES = {
    "k200_bias_fp32": ((5,), 24, 200, torch.float32, True),
    "k1000_bf16": ((3, 2), 16, 1000, torch.bfloat16, False),
    "k520_bias_bf16": ((1,), 12, 520, torch.bfloat16, True),
}
COLUMN_CASES = {
    "k200_bias_fp32": ((4,), 12, 200, torch.float32, True),
    "bf16": ((2, 3), 24, 64, torch.bfloat16, False),
}
MODULE_CASE = "k200_bias_fp32"  # the nn.Module wrappers run this case only
VOCAB, HIDDEN = 5 * 256 + 37, 8  # 6 tiles, the last one short
REDUCE_ELEMENTS = 64


def _linear_inputs(cases: dict, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    inputs = {}
    for name, (rows, out_features, in_features, dtype, bias) in cases.items():
        x = torch.randn(*rows, in_features, generator=generator).to(dtype)
        w = torch.randn(out_features, in_features, generator=generator).to(dtype)
        b = torch.randn(out_features, generator=generator).to(dtype) if bias else None
        inputs[name] = (x, w, b)
    return inputs


def _reduce_inputs(world: int) -> torch.Tensor:
    """Per-rank fp32 values over many magnitudes, where the order of the adds shows; the
    first columns are crafted so that the left fold (T >= 4) and the right fold (T = 3)
    differ from the tree."""
    generator = torch.Generator().manual_seed(7 + world)
    scale = 10.0 ** torch.randint(-3, 9, (world, REDUCE_ELEMENTS), generator=generator)
    values = torch.randn(world, REDUCE_ELEMENTS, generator=generator) * scale
    crafted = {3: [1.0, 1e8, -1e8], 4: [1e8, 1.0, -1e8, 1.0]}.get(world)
    if crafted is not None:
        values[:, 0] = torch.tensor(crafted)
    return values.float()


def _vocab_inputs() -> dict:
    generator = torch.Generator().manual_seed(11)
    hidden = torch.randn(2, 5, HIDDEN, generator=generator)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator)
    # Targets in every rank's range, the first and last columns, a short-tile column and
    # ignored rows.
    targets = torch.tensor([[0, 255, 256, IGNORE, 1316], [700, IGNORE, 1279, 1280, 513]])
    return {"hidden": hidden, "weight": weight, "targets": targets}


def _message(fn) -> str:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the parent checks the type and text
        return f"{type(error).__name__}: {error}"
    return "no error"


def _rank_checks(rank: int, world: int, inputs_path: str) -> dict:
    data = torch.load(inputs_path)
    out: dict = {"errors": {}}
    errors = out["errors"]
    for name, (x, w, b) in data["row"].items():
        start, stop = k_range(w.shape[1], rank, world)
        x_shard, w_shard = x[..., start:stop], shard_k(w, rank, world)
        out[f"row/{name}"] = row_parallel_linear(x_shard, w_shard, b, in_features=w.shape[1])
    x, w, b = data["row"][MODULE_CASE]
    layer = RowParallelLinear.from_full(w, b, rank, world)
    with torch.no_grad():
        out["row_module"] = layer(layer.shard_input(x))
    start, stop = k_range(w.shape[1], rank, world)
    w_shard = shard_k(w, rank, world)
    errors["row_weight"] = _message(
        lambda: row_parallel_linear(
            x[..., start:stop], torch.zeros(w.shape[0], stop - start + 1), in_features=200
        )
    )
    x_wide = torch.zeros(*x.shape[:-1], stop - start + 1)
    errors["row_x"] = _message(lambda: row_parallel_linear(x_wide, w_shard, in_features=200))
    # A backward through the forward-only layer raises (collectives first ran on every rank).
    x_grad = x[..., start:stop].clone().requires_grad_(True)
    y = row_parallel_linear(x_grad, w_shard, b, in_features=w.shape[1])
    errors["row_backward"] = _message(lambda: y.sum().backward())

    for name, (x, w, b) in data["column"].items():
        w_shard = shard_columns(w, rank, world)
        b_shard = None if b is None else shard_columns(b, rank, world)
        out[f"column/{name}"] = column_parallel_linear(x, w_shard, b_shard, gather_output=True)
        out[f"column_local/{name}"] = column_parallel_linear(
            x, w_shard, b_shard, gather_output=False
        )
    x, w, b = data["column"][MODULE_CASE]
    with torch.no_grad():
        out["column_module"] = ColumnParallelLinear.from_full(w, b, rank, world)(x)

    t = data["reduce"][world][rank]
    time.sleep(0.05 * (world - rank))  # low ranks arrive last
    out["reduce/low_last"] = invariant_all_reduce(t)
    time.sleep(0.05 * rank)  # high ranks arrive last
    out["reduce/high_last"] = invariant_all_reduce(t)
    errors["reduce_fp16"] = _message(lambda: invariant_all_reduce(t.half()))
    errors["reduce_bf16"] = _message(lambda: invariant_all_reduce(t.bfloat16()))

    vocab = data["vocab"]
    start, stop = vocab_ranges(VOCAB, world)[rank]
    w_shard = vocab["weight"][start:stop]
    out["logprobs"] = vocab_parallel_token_logprobs(
        vocab["hidden"], w_shard, vocab["targets"], IGNORE, vocab=VOCAB
    )
    out["logits"] = vocab_parallel_logits(vocab["hidden"], w_shard, vocab=VOCAB)
    errors["vocab_weight"] = _message(
        lambda: vocab_parallel_token_logprobs(
            vocab["hidden"], w_shard[1:], vocab["targets"], vocab=VOCAB
        )
    )
    bad = vocab["targets"].clone()
    bad[1, 3] = VOCAB
    errors["vocab_target"] = _message(
        lambda: vocab_parallel_token_logprobs(vocab["hidden"], w_shard, bad, vocab=VOCAB)
    )
    return out


@pytest.fixture(scope="module")
def inputs() -> dict:
    return {
        "row": _linear_inputs(ROW_CASES, seed=1),
        "column": _linear_inputs(COLUMN_CASES, seed=2),
        "reduce": {world: _reduce_inputs(world) for world in WORLD_SIZES},
        "vocab": _vocab_inputs(),
    }


@pytest.fixture(scope="module")
def results(inputs, tmp_path_factory) -> dict[int, list[dict]]:
    """Every world size's per-rank results (one spawn per world size)."""
    tmp_path = tmp_path_factory.mktemp("tp")
    inputs_path = tmp_path / "inputs.pt"
    torch.save(inputs, inputs_path)
    return {
        world: run_world(_rank_checks, world, tmp_path, str(inputs_path), timeout_s=120)
        for world in WORLD_SIZES
    }


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", ROW_CASES)
def test_row_parallel_equals_linear_k_groups(results, inputs, world, name):
    x, w, b = inputs["row"][name]
    expected = batchinv.linear_k_groups(x, w, b)
    for rank, result in enumerate(results[world]):
        assert_bitwise_equal(result[f"row/{name}"], expected, name=f"T={world} rank {rank}")
        if name == MODULE_CASE:
            assert_bitwise_equal(result["row_module"], expected, name=f"module rank {rank}")


def test_row_parallel_is_not_the_sequential_k_order(inputs):
    """The target really is the K-group tree: for this case ``batchinv.linear`` (one
    sequential K chain) gives other bits, so the comparison above can fail."""
    x, w, b = inputs["row"]["k200_bias_fp32"]
    assert not torch.equal(batchinv.linear_k_groups(x, w, b), batchinv.linear(x, w, b))


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", COLUMN_CASES)
def test_column_parallel_equals_linear(results, inputs, world, name):
    x, w, b = inputs["column"][name]
    expected = batchinv.linear(x, w, b)
    width = w.shape[0] // world
    for rank, result in enumerate(results[world]):
        assert_bitwise_equal(result[f"column/{name}"], expected, name=f"T={world} rank {rank}")
        if name == MODULE_CASE:
            assert_bitwise_equal(result["column_module"], expected, name=f"module {rank}")
        columns = expected[..., rank * width : (rank + 1) * width]
        assert_bitwise_equal(result[f"column_local/{name}"], columns, name=f"local {rank}")


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_invariant_all_reduce_is_the_fixed_tree_on_every_rank(results, inputs, world):
    values = inputs["reduce"][world]
    expected = rank_tree_sum(values)
    for rank, result in enumerate(results[world]):
        assert_bitwise_equal(result["reduce/low_last"], expected, name=f"rank {rank}")
        assert_bitwise_equal(result["reduce/high_last"], expected, name=f"rank {rank} again")


@pytest.mark.parametrize("world", (3, 4))
def test_another_order_gives_other_bits(inputs, world):
    """The crafted inputs tell the orders apart (two ranks commute, so T = 2 cannot)."""
    values = inputs["reduce"][world]
    left_fold = values[0].clone()
    for rank in range(1, world):
        left_fold = left_fold + values[rank]
    right_fold = values[-1].clone()
    for rank in range(world - 2, -1, -1):
        right_fold = values[rank] + right_fold
    other = left_fold if world >= 4 else right_fold
    assert not torch.equal(rank_tree_sum(values), other)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_vocab_parallel_token_logprobs_equal_one_rank(results, inputs, world):
    vocab = inputs["vocab"]
    expected = token_logprobs_tiled(vocab["hidden"], vocab["weight"], vocab["targets"], IGNORE)
    assert (expected[vocab["targets"] == IGNORE] == 0).all()
    for rank, result in enumerate(results[world]):
        assert_bitwise_equal(result["logprobs"], expected, name=f"T={world} rank {rank}")


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_vocab_parallel_logits_equal_lm_head(results, inputs, world):
    vocab = inputs["vocab"]
    expected = batchinv.lm_head(vocab["hidden"], vocab["weight"])
    for rank, result in enumerate(results[world]):
        assert_bitwise_equal(result["logits"], expected, name=f"T={world} rank {rank}")


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_bad_inputs_raise_errors_naming_the_argument(results, inputs, world):
    vocab = inputs["vocab"]
    bad = vocab["targets"].clone()
    bad[1, 3] = VOCAB
    with pytest.raises(IndexError) as single:
        batchinv.token_logprobs(vocab["hidden"], vocab["weight"], bad, IGNORE)
    for result in results[world]:
        errors = result["errors"]
        assert errors["row_weight"].startswith("ValueError: weight_shard must be")
        assert errors["row_x"].startswith("ValueError: x_shard must be")
        assert errors["row_backward"].startswith("RuntimeError: batchinv.distributed layers")
        assert errors["reduce_fp16"].startswith("TypeError: t must be float32")
        assert errors["reduce_bf16"].startswith("TypeError: t must be float32")
        assert errors["vocab_weight"].startswith("ValueError: weight_shard must hold")
        assert errors["vocab_target"] == f"IndexError: {single.value}"
