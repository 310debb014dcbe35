"""The tolerance table: lookups, the elementwise check, and its failure message."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from batchinv.contract import (
    KINDS,
    OP_CLASSES,
    OPS,
    TOLERANCE_DTYPES,
    TOLERANCES,
    Tolerance,
    assert_within_tolerance,
    tolerance,
    tolerance_table_markdown,
)
from batchinv.contract.tolerances import _TABLE


def test_table_is_complete_and_positive():
    names = set(OPS) | set(OP_CLASSES)  # "attention" is both
    assert len(TOLERANCES) == len(names) * len(TOLERANCE_DTYPES) * len(KINDS)
    for name in names:
        for dtype in TOLERANCE_DTYPES:
            for kind in KINDS:
                entry = tolerance(name, dtype, kind)
                assert isinstance(entry, Tolerance)
                assert entry.atol > 0 and entry.rtol >= 0
                if name in OPS:
                    assert "4x atol and 2x rtol" in entry.note and "max abs" in entry.note


def test_class_entries_are_the_envelope_of_their_ops():
    for op_class in OP_CLASSES:
        ops = [op for op, cls in OPS.items() if cls == op_class]
        assert ops
        for dtype in TOLERANCE_DTYPES:
            for kind in KINDS:
                entry = tolerance(op_class, dtype, kind)
                assert entry.atol == max(tolerance(op, dtype, kind).atol for op in ops)
                assert entry.rtol == max(tolerance(op, dtype, kind).rtol for op in ops)


# Entries whose error does not grow as the dtype narrows: a copy (exact in every dtype, only
# the subnormal floors differ) and token logprobs (fp32 out, fp32 arithmetic, any inputs).
UNORDERED = {("embedding", "forward"), ("token_logprobs", "forward")}


def test_low_precision_entries_allow_more_than_fp32():
    # A calibration slip (an entry pasted into the wrong row) would break this.  bf16 and
    # fp16 are not ordered between themselves: fp16's narrow range flushes tiny gradients
    # that bf16 keeps, so some fp16 gradient entries are the wider.
    for name in (*OPS, *OP_CLASSES):
        for kind in KINDS:
            if (name, kind) in UNORDERED:
                continue
            fp32 = tolerance(name, torch.float32, kind)
            for dtype in (torch.bfloat16, torch.float16):
                low = tolerance(name, dtype, kind)
                assert low.atol + low.rtol > fp32.atol + fp32.rtol, (name, dtype, kind)


def test_table_is_what_the_committed_measurements_give():
    """The literal in tolerances.py is tools/tolerance_table.py's output for the committed
    measurements (reports/tolerances/), so every entry's derivation can be re-run."""
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "tools"))
    try:
        import tolerance_table
    finally:
        sys.path.remove(str(root / "tools"))
    cpu = json.loads((root / "reports/tolerances/cpu.json").read_text())
    gpu = json.loads((root / "reports/tolerances/nvidia-h200.json").read_text())
    built = tolerance_table.build(cpu, gpu)
    assert set(built) == {(op, d, k) for (op, d, k) in _TABLE}
    for key, (atol, rtol, note) in built.items():
        assert _TABLE[key] == (float(f"{atol:.2g}"), float(f"{rtol:.2g}"), note), key


def test_ops_have_their_own_entries():
    # The fp32 token logprob of a bf16 path errs orders of magnitude less than a bf16-rounded
    # log-softmax: the reason the table is per op.  Logits scaled by 1 + 2^-7 fail the op's
    # entry at logprob-sized values.
    tight = tolerance("token_logprobs", torch.bfloat16)
    loose = tolerance("logprob", torch.bfloat16)
    assert tight.atol + 12 * tight.rtol < (loose.atol + 12 * loose.rtol) / 100
    ref = _reference((8, 16)) - 12.0  # logprob-sized values
    scaled = ref * (1 + 2**-7)
    with pytest.raises(AssertionError, match="token_logprobs/bfloat16/forward"):
        assert_within_tolerance(scaled, ref, op="token_logprobs", dtype=torch.bfloat16)


def test_exactly_one_of_op_and_op_class():
    ref = _reference((2, 3))
    with pytest.raises(TypeError, match="exactly one"):
        assert_within_tolerance(ref, ref)
    with pytest.raises(TypeError, match="exactly one"):
        assert_within_tolerance(ref, ref, op="linear", op_class="reduction")
    assert_within_tolerance(ref, ref, op="linear")


def test_lookup_by_name_equals_lookup_by_dtype():
    assert tolerance("attention", "bfloat16", "grad") == tolerance(
        "attention", torch.bfloat16, "grad"
    )
    assert tolerance("logprob", torch.float32) == tolerance("logprob", torch.float32, "forward")


def test_table_is_read_only():
    with pytest.raises(TypeError):
        TOLERANCES[("reduction", torch.bfloat16, "forward")] = Tolerance(1.0, 1.0, "")  # type: ignore[index]


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (("matmul", torch.bfloat16), ValueError, "unknown op_class 'matmul'"),
        (("reduction", torch.float64), ValueError, "no entry for torch.float64"),
        (("reduction", torch.int32), ValueError, "no entry for torch.int32"),
        (("reduction", "fp8"), ValueError, "unknown dtype 'fp8'"),
        (("reduction", 16), TypeError, "torch.dtype"),
        (("reduction", torch.bfloat16, "backward"), ValueError, "unknown kind 'backward'"),
    ],
)
def test_unknown_lookups_raise_clear_errors(args, error, match):
    with pytest.raises(error, match=match):
        tolerance(*args)


def _reference(shape=(64, 32), seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


@pytest.mark.parametrize("dtype", TOLERANCE_DTYPES)
def test_rounding_the_reference_once_passes(dtype):
    ref = _reference()
    assert_within_tolerance(ref.to(dtype), ref, op_class="reduction", name="rounded")


def test_error_just_inside_and_just_outside_the_bound():
    entry = tolerance("reduction", torch.float32)
    ref = torch.tensor([0.0, 1.0, -3.0], dtype=torch.float64)
    allowed = entry.atol + entry.rtol * ref.abs()
    inside = (ref + 0.5 * allowed).float()
    outside = (ref + 1.5 * allowed).float()
    assert_within_tolerance(inside, ref, op_class="reduction")
    with pytest.raises(AssertionError, match="3 of 3 elements"):
        assert_within_tolerance(outside, ref, op_class="reduction")


def test_bf16_error_fails_the_fp32_entry_but_passes_when_dtype_is_named():
    ref = _reference()
    # A bf16-sized error carried in an fp32 tensor, as a bf16-input logprob path returns.
    actual = ref.to(torch.bfloat16).float()
    with pytest.raises(AssertionError, match="logprob/float32/forward"):
        assert_within_tolerance(actual, ref, op_class="logprob")
    assert_within_tolerance(actual, ref, op_class="logprob", dtype=torch.bfloat16)


def test_failure_message_reports_the_worst_element_and_the_entry():
    ref = _reference((4, 6))
    actual = ref.to(torch.bfloat16)
    actual[1, 2] = actual[1, 2] + 0.5  # clearly out of the bf16 reduction entry
    actual[3, 0] = actual[3, 0] + 0.25
    entry = tolerance("reduction", torch.bfloat16)
    with pytest.raises(AssertionError) as info:
        assert_within_tolerance(actual, ref, op_class="reduction", name="rms_out")
    message = str(info.value)
    assert message.startswith("rms_out: 2 of 24 elements outside the reduction/bfloat16/forward")
    assert "worst at index (1, 2)" in message
    assert f"atol {entry.atol:g}, rtol {entry.rtol:g}" in message
    assert entry.note in message


@pytest.mark.parametrize("where", ["actual", "reference", "both"])
def test_any_nan_fails(where):
    ref = _reference((3, 3))
    actual = ref.clone()
    if where in ("actual", "both"):
        actual[1, 1] = float("nan")
    if where in ("reference", "both"):
        ref[1, 1] = float("nan")
    with pytest.raises(AssertionError, match=r"worst at index \(1, 1\)"):
        assert_within_tolerance(actual, ref, op_class="elementwise")


def test_infinities_must_match_exactly():
    ref = torch.tensor([float("-inf"), 1.0, float("inf")])
    assert_within_tolerance(ref.clone(), ref, op_class="logprob")
    with pytest.raises(AssertionError, match="infinity mismatches: 1"):
        assert_within_tolerance(torch.tensor([float("-inf"), 1.0, -1e30]), ref, op_class="logprob")
    with pytest.raises(AssertionError, match="infinity mismatches: 1"):
        assert_within_tolerance(
            torch.tensor([float("inf"), 1.0, float("inf")]), ref, op_class="logprob"
        )


def test_argument_errors():
    ref = _reference((2, 3))
    with pytest.raises(TypeError, match="reference must be float32 or float64"):
        assert_within_tolerance(ref, ref.to(torch.bfloat16), op_class="reduction")
    with pytest.raises(ValueError, match="shape mismatch"):
        assert_within_tolerance(ref, ref.reshape(3, 2), op_class="reduction")
    with pytest.raises(ValueError, match="unknown op_class"):
        assert_within_tolerance(ref, ref, op_class="norm")
    with pytest.raises(TypeError, match="floating-point"):
        assert_within_tolerance(torch.ones(2, 3, dtype=torch.int32), ref, op_class="reduction")


def test_empty_tensors_pass_and_inputs_are_untouched():
    assert_within_tolerance(torch.empty(0, 4), torch.empty(0, 4), op_class="attention")
    ref = _reference((3,))
    actual = ref.to(torch.float16)
    saved = (ref.clone(), actual.clone())
    assert_within_tolerance(actual, ref, op_class="attention")
    assert torch.equal(ref, saved[0]) and torch.equal(actual, saved[1])


def test_markdown_lists_every_entry():
    table = tolerance_table_markdown()
    assert table.count("\n") == len(TOLERANCES) + 1
    entry = tolerance("attention", torch.float16, "grad")
    assert f"| attention | float16 | grad | {entry.atol:.2g} | {entry.rtol:.2g} |" in table
