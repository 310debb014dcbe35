"""The eager no-grad path of ``token_logprobs`` (a launch plan kept per signature, TMA maps
per address, one output allocation and one workspace, pointers as ints) gives the bits of the
general path (``batchinv.gpu.token_logprobs.forward``), eagerly and in a CUDA graph: at decode
and prefill token counts, across hidden and weight address changes and shape changes, with
ignored rows, with bad targets raising (the default check) or flagged (deferred).  The host
logic is ``tests/ops/test_host_path_token_logprobs.py``'s."""

from __future__ import annotations

import pytest
import torch

import batchinv
from _streams import capture_graph
from batchinv import device_checks
from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import token_logprobs as gpu_token_logprobs

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
DTYPES = (torch.bfloat16, torch.float16)
IGNORE = -100
ROWS = (1, 8, 17, 64, 1024)  # 1024: the 128-row tile
# (H, V): Qwen3's lm_head, and a vocabulary with a short last tile.
SHAPES = [(4096, 151936), (256, 5000)]


def _randn(*shape, dtype, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, device=DEVICE, generator=gen).to(dtype)


def _case(rows, hidden_size, vocab, dtype, seed=0, ids=torch.int64):
    hidden = _randn(rows, hidden_size, dtype=dtype, seed=seed)
    weight = _randn(vocab, hidden_size, dtype=dtype, seed=seed + 1) / 16
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 2)
    targets = torch.randint(0, vocab, (rows,), device=DEVICE, generator=gen).to(ids)
    targets[1::3] = IGNORE  # ignored rows
    return hidden, weight, targets


def _general(hidden, weight, targets, entropy=False, check_targets=True):
    logprob, _, ent, _ = gpu_token_logprobs.forward(
        hidden, weight, targets, IGNORE, entropy, check_targets
    )
    shape = targets.shape
    return (logprob.view(shape), ent.view(shape)) if entropy else logprob.view(shape)


def _new_values(t):
    t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hidden_size", "vocab"), SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("entropy", [False, True])
def test_lean_calls_give_the_general_path_bits(rows, hidden_size, vocab, dtype, entropy):
    hidden, weight, targets = _case(rows, hidden_size, vocab, dtype, seed=rows)
    want = _general(hidden, weight, targets, entropy)
    gpu_token_logprobs._LEAN.clear()  # below: only this test's plans
    with torch.no_grad():
        for call in ("first", "kept"):
            got = batchinv.token_logprobs(hidden, weight, targets, IGNORE, return_entropy=entropy)
            assert_bitwise_equal(got, want, name=call)
        as_int32 = batchinv.token_logprobs(
            hidden, weight, targets.int(), IGNORE, return_entropy=entropy
        )
        assert_bitwise_equal(as_int32, want, name="int32 targets")
        lead = batchinv.token_logprobs(
            hidden.view(1, rows, hidden_size), weight, targets.view(1, rows), IGNORE
        )
        first = want[0] if entropy else want
        assert_bitwise_equal(lead, first.view(1, rows), name="a leading dimension")
    assert None not in gpu_token_logprobs._LEAN.values()


@pytest.mark.parametrize("dtype", DTYPES)
def test_address_and_shape_changes_give_the_general_path_bits(dtype):
    hidden, weight, targets = _case(8, 4096, 151936, dtype, seed=3)
    other_hidden = _randn(8, 4096, dtype=dtype, seed=4)  # another address: another TMA map
    other_weight = weight.clone()  # another address, and other values in its first rows
    _new_values(other_weight[:1000])
    gpu_token_logprobs._LEAN.clear()
    with torch.no_grad():
        for round_ in range(2):  # the second round from kept maps
            for h, w in ((hidden, weight), (other_hidden, weight), (hidden, other_weight)):
                got = batchinv.token_logprobs(h, w, targets, IGNORE, return_entropy=True)
                assert_bitwise_equal(got, _general(h, w, targets, True), name=f"round {round_}")
            for rows in (3, 5, 1):  # new shapes: new plans
                h, t = hidden[:rows], targets[:rows]
                got = batchinv.token_logprobs(h, weight, t, IGNORE)
                assert_bitwise_equal(got, _general(h, weight, t), name=f"{rows} rows")
    assert len(gpu_token_logprobs._LEAN) == 4


def test_misaligned_and_strided_hidden_give_the_general_path_bits():
    hidden, weight, targets = _case(8, 256, 5000, torch.bfloat16, seed=5)
    shifted = torch.empty(8 * 256 + 1, dtype=hidden.dtype, device=DEVICE)[1:].view(8, 256)
    strided = torch.empty(8, 320, dtype=hidden.dtype, device=DEVICE)[:, :256]
    with torch.no_grad():
        for h in (shifted, strided):
            h.copy_(hidden)
            got = batchinv.token_logprobs(h, weight, targets, IGNORE, return_entropy=True)
            assert_bitwise_equal(got, _general(hidden, weight, targets, True))


def test_bad_targets_raise_by_default_and_are_flagged_when_deferred():
    hidden, weight, targets = _case(17, 256, 5000, torch.bfloat16, seed=6)
    bad = targets.clone()
    bad[4], bad[9] = 5000, -7
    with torch.no_grad():
        batchinv.token_logprobs(hidden, weight, targets, IGNORE)  # a kept plan first
        with pytest.raises(IndexError, match=r"target_ids\[4\] = 5000 is outside"):
            batchinv.token_logprobs(hidden, weight, bad, IGNORE)
        with device_checks.deferred():
            got = batchinv.token_logprobs(hidden, weight, bad, IGNORE, return_entropy=True)
            good = batchinv.token_logprobs(hidden, weight, targets, IGNORE)
        want = _general(hidden, weight, bad, True, check_targets=False)
        assert_bitwise_equal(got, want, name="bad rows as ignored rows")
        assert got[0][4] == 0 and got[0][9] == 0
        with pytest.raises(IndexError, match="token_logprobs: target_ids"):
            device_checks.raise_device_errors(DEVICE)
        assert_bitwise_equal(good, _general(hidden, weight, targets))
        with device_checks.deferred():
            batchinv.token_logprobs(hidden, weight, targets, IGNORE)
        device_checks.raise_device_errors(DEVICE)  # a good call flags nothing


@pytest.mark.parametrize("rows", (1, 17, 64))
@pytest.mark.parametrize("entropy", [False, True])
def test_a_captured_call_replays_the_eager_bits(rows, entropy):
    hidden, weight, targets = _case(rows, 4096, 151936, torch.bfloat16, seed=7)
    with torch.no_grad():
        graph, captured = capture_graph(
            lambda: batchinv.token_logprobs(hidden, weight, targets, IGNORE, return_entropy=entropy)
        )
        for replay in range(2):
            _new_values(hidden)
            targets.copy_(torch.randint_like(targets, 0, 151936))
            targets[::2] = IGNORE
            graph.replay()
            torch.cuda.synchronize()
            want = _general(hidden, weight, targets, entropy)
            assert_bitwise_equal(captured, want, name=f"replay {replay}")
        device_checks.raise_device_errors(DEVICE)  # good targets flag nothing
        targets[0] = 151936  # a bad target in the graph: flagged, never a sync
        graph.replay()
        torch.cuda.synchronize()
        want = _general(hidden, weight, targets, entropy, check_targets=False)
        assert_bitwise_equal(captured, want, name="replay with a bad target")
        with pytest.raises(IndexError, match="token_logprobs: target_ids"):
            device_checks.raise_device_errors(DEVICE)
