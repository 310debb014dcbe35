"""The Axis-A sweeps on toy ops whose verdict is known by construction.

Row-wise toys: an elementwise op and a fixed-order row reduction (invariant), and ops that
read the batch in different ways (each must be caught, by the transform that targets it).
Sequence toys: a causal prefix sum in fp32 computed left to right through a toy KV cache
(invariant), and broken variants whose decode order, batch path or neighbour handling
differ (each must be caught).
"""

from __future__ import annotations

import pytest
import torch

from batchinv.contract import (
    BATCH_SIZES,
    PADDING_MODES,
    TRANSFORMS,
    DriftReport,
    SequenceAdapter,
    assert_no_drift,
    chunk_schedule,
    format_reports,
    padding_fill,
    row_invariance_sweep,
    sequence_invariance_sweep,
)

HIDDEN = 8


def make_rows(n, generator):
    return torch.randn(n, HIDDEN, generator=generator).to(torch.bfloat16)


def _by_id(reports, transform_id):
    return [r for r in reports if r.transform_id == transform_id]


def _drifting_ids(reports):
    return {r.transform_id for r in reports if r.applicable and not r.bitwise}


# ----- registry and helpers ----------------------------------------------------------------


def test_transforms_are_t1_to_t7_with_the_anchor_names():
    assert [t.id for t in TRANSFORMS] == [f"T{i}" for i in range(1, 8)]
    names = [t.name for t in TRANSFORMS]
    assert names == [
        "batch population",
        "row position",
        "neighbour content",
        "padding layout and fully masked rows",
        "execution schedule",
        "varlen packed vs padded",
        "prefix reuse",
    ]


def test_default_split_points_match_the_constants():
    from batchinv.contract import DECODE_PROMPT_LENGTHS, PREFIX_LENGTHS, PROBE_SEQUENCE_LENGTH
    from batchinv.contract.transforms import _split_points

    assert _split_points(PROBE_SEQUENCE_LENGTH, block=None) == DECODE_PROMPT_LENGTHS
    assert _split_points(PROBE_SEQUENCE_LENGTH, block=64) == PREFIX_LENGTHS


def test_short_sequences_get_derived_split_points():
    reports = sequence_invariance_sweep(
        PrefixSumAdapter(), make_sequence, seq_len=9, batch_sizes=(1, 2)
    )
    assert_no_drift(reports)
    decode_cases = [r.case for r in reports if "decoded" in r.case]
    assert {c.split(",")[0] for c in decode_cases} == {
        "prompt 1 prefilled",
        "prompt 4 prefilled",
        "prompt 8 prefilled",
    }


def test_chunk_schedule():
    assert chunk_schedule(67, 7) == [7] * 9 + [4]
    assert chunk_schedule(67, 100) == [67]
    assert chunk_schedule(67, 1) == [1] * 67
    assert chunk_schedule(67, (5, 64, 1, 7, 100)) == [5, 62]
    assert chunk_schedule(80, (5, 64, 1, 7, 100)) == [5, 64, 1, 7, 3]
    with pytest.raises(ValueError):
        chunk_schedule(10, 0)


def test_padding_fill_modes():
    like = torch.zeros(3, 4, dtype=torch.float16)
    assert torch.equal(padding_fill(like, 2, "zeros"), torch.zeros(2, 4, dtype=torch.float16))
    assert bool(padding_fill(like, 2, "nan").isnan().all())
    garbage = padding_fill(like, 64, "garbage", generator=torch.Generator().manual_seed(0))
    assert garbage.shape == (64, 4) and garbage.dtype == torch.float16
    assert len(set(garbage.view(torch.int16).reshape(-1).tolist())) > 200  # random bits
    ids = padding_fill(torch.zeros(3, dtype=torch.int64), 50, "garbage", int_high=7)
    assert ids.dtype == torch.int64 and int(ids.min()) >= 0 and int(ids.max()) < 7
    with pytest.raises(ValueError, match="unknown padding mode"):
        padding_fill(like, 1, "ones")


# ----- reports -----------------------------------------------------------------------------


def _report(transform_id="T1", bitwise=True, applicable=True):
    return DriftReport(
        transform_id,
        "case",
        bitwise,
        0 if bitwise else 3,
        None if bitwise else (0, 1),
        0.0 if bitwise else 0.5,
        applicable=applicable,
    )


def test_assert_no_drift_rules():
    assert_no_drift([_report()])
    with pytest.raises(AssertionError, match="no drift reports"):
        assert_no_drift([])
    with pytest.raises(AssertionError, match="1 drifting and 0 not-applicable"):
        assert_no_drift([_report(), _report("T2", bitwise=False)])
    not_applicable = _report("T7", bitwise=False, applicable=False)
    with pytest.raises(AssertionError, match="0 drifting and 1 not-applicable"):
        assert_no_drift([_report(), not_applicable])
    assert_no_drift([_report(), not_applicable], allow_not_applicable={"T7"})
    with pytest.raises(AssertionError):  # allowing T7 does not allow T6
        assert_no_drift(
            [_report("T6", bitwise=False, applicable=False)], allow_not_applicable={"T7"}
        )
    with pytest.raises(ValueError, match="unknown transform ids"):
        assert_no_drift([_report()], allow_not_applicable={"T8"})


def test_format_reports_shows_status_and_mismatch():
    text = format_reports(
        [_report(), _report("T3", bitwise=False), _report("T7", bitwise=False, applicable=False)]
    )
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["id", "status"]
    assert "ok" in lines[1] and "DRIFT" in lines[2] and "(0, 1)" in lines[2]
    assert "n/a" in lines[3]


# ----- row sweep ---------------------------------------------------------------------------


def _fixed_order_row_sum(x):
    acc = torch.zeros(x.shape[0], dtype=torch.float32)
    for k in range(x.shape[1]):
        acc = acc + x[:, k].float()
    return acc


def test_row_wise_ops_pass_every_case():
    reports = row_invariance_sweep(lambda x: torch.tanh(x) * 2, make_rows)
    assert_no_drift(reports)
    assert {r.transform_id for r in reports} == {"T1", "T2", "T3", "T4"}
    # 1 rerun + 3 batch sizes first; 3 x (middle, last); 5 neighbour kinds; 2 x 3 paddings.
    assert len(_by_id(reports, "T1")) == len(BATCH_SIZES)
    assert len(_by_id(reports, "T2")) == 2 * (len(BATCH_SIZES) - 1)
    assert len(_by_id(reports, "T3")) == 5
    assert len(_by_id(reports, "T4")) == 2 * len(PADDING_MODES)

    def norm_and_sum(x):  # tuple output, fixed-order reduction per row
        total = _fixed_order_row_sum(x)
        return (x.float() / (1 + total.abs()[:, None])).to(x.dtype), total

    assert_no_drift(row_invariance_sweep(norm_and_sum, make_rows, seed=3))


def test_batch_mean_op_is_caught():
    reports = row_invariance_sweep(lambda x: x - x.mean(dim=0, keepdim=True), make_rows)
    assert _drifting_ids(reports) == {"T1", "T2", "T3", "T4"}
    alone_again = _by_id(reports, "T1")[0]
    assert alone_again.case.startswith("N=1") and alone_again.bitwise
    with pytest.raises(AssertionError, match="DRIFT"):
        assert_no_drift(reports)


def test_op_depending_on_batch_size_is_caught_by_t1():
    reports = row_invariance_sweep(lambda x: x * (1 + x.shape[0] / 64), make_rows)
    t1 = _by_id(reports, "T1")
    assert t1[0].bitwise  # N=1 again
    assert all(not r.bitwise for r in t1[1:])
    assert all(r.mismatches > 0 and r.first_mismatch is not None for r in t1[1:])


def test_op_depending_on_row_position_is_caught_by_t2_only():
    def position_bias(x):
        return x + torch.arange(x.shape[0], dtype=x.dtype)[:, None] * 0.5

    reports = row_invariance_sweep(position_bias, make_rows)
    assert all(r.bitwise for r in _by_id(reports, "T1"))  # the probe is row 0 there
    assert all(not r.bitwise for r in _by_id(reports, "T2"))


def test_nan_leaking_from_a_neighbour_is_caught_by_t3_and_t4():
    def leaky(x):  # 0 * neighbour is 0 for finite neighbours, NaN for NaN/inf ones
        return x + 0 * x.roll(1, dims=0)

    reports = row_invariance_sweep(leaky, make_rows)
    drifting = {r.case.split("neighbours: ")[-1] for r in _by_id(reports, "T3") if not r.bitwise}
    assert drifting == {"nan", "inf"}
    assert any(not r.bitwise and "nan" in r.case for r in _by_id(reports, "T4"))
    assert all(r.bitwise for r in _by_id(reports, "T1") + _by_id(reports, "T2"))


def test_tuple_inputs_and_outputs_report_the_output_index():
    def make_pairs(n, generator):
        return torch.randn(n, 4, generator=generator), torch.randn(n, 4, generator=generator)

    def op(batch):
        a, b = batch
        return a * b, b + b.sum(dim=0, keepdim=True)  # second output reads the batch

    reports = row_invariance_sweep(op, make_pairs, batch_sizes=(1, 5))
    drifting = [r for r in reports if not r.bitwise]
    assert drifting and all(r.first_mismatch[0] == 1 for r in drifting)
    assert "output 1" in drifting[0].detail


def test_integer_rows_skip_float_only_kinds():
    vocab = 11
    weight = torch.randn(vocab, 4)

    def make_ids(n, generator):
        return torch.randint(0, vocab, (n,), generator=generator)

    reports = row_invariance_sweep(lambda ids: weight[ids], make_ids, int_high=vocab)
    assert_no_drift(reports)
    assert [r.case.split(": ")[-1] for r in _by_id(reports, "T3")] == ["copies"]
    assert not any("nan" in r.case for r in _by_id(reports, "T4"))


def test_sweep_does_not_modify_rows_and_rejects_ops_that_do():
    made = []

    def recording_rows(n, generator):
        rows = make_rows(n, generator)
        made.append((rows, rows.clone()))
        return rows

    row_invariance_sweep(lambda x: x * 2, recording_rows)
    assert made and all(torch.equal(r.view(torch.int16), c.view(torch.int16)) for r, c in made)
    with pytest.raises(RuntimeError, match="modified its input"):
        row_invariance_sweep(lambda x: x.mul_(3), make_rows)


def test_wrong_output_rows_are_an_error():
    with pytest.raises(ValueError, match="leading dim"):
        row_invariance_sweep(lambda x: x.sum(dim=0, keepdim=True), make_rows)


# ----- sequence sweep ----------------------------------------------------------------------

FEATURES = 3


def make_sequence(length, generator):
    return torch.randn(length, FEATURES, generator=generator)


def _masked_prefix_sums(padded, lengths, *, right_to_left=False):
    """Per batch row, out[i] = x[0] + ... + x[i] in fp32, one add at a time, masked by length
    with ``where`` so padding (even NaN) is never read.  With ``right_to_left`` each row's
    sum of its first (i + 1) tokens runs in the other order (a broken decode kernel)."""
    batch, steps, _ = padded.shape
    out = torch.zeros_like(padded)
    if not right_to_left:
        acc = torch.zeros(batch, padded.shape[2])
        for j in range(steps):
            valid = (j < lengths)[:, None]
            acc = torch.where(valid, acc + padded[:, j], acc)
            out[:, j] = acc
        return out
    for i in range(steps):
        acc = torch.zeros(batch, padded.shape[2])
        for j in range(i, -1, -1):
            valid = (j < lengths)[:, None]
            acc = torch.where(valid, acc + padded[:, j], acc)
        out[:, i] = acc
    return out


def _running_max(x):
    return torch.cummax(x, dim=0).values  # exact in any order


class PrefixSumAdapter:
    """Toy sequence op: out[i] = (sum of x[0..i], running max), x fp32 [L, FEATURES].

    The "KV cache" holds the raw x rows; every schedule recomputes a token's sum from the
    cache left to right, so the bits cannot depend on the schedule.  Flags break it.
    """

    def __init__(
        self, *, decode_right_to_left=False, batch_float64=False, leak=False, empty_ok=True
    ):
        self.decode_right_to_left = decode_right_to_left
        self.batch_float64 = batch_float64  # a "fast path" for batches > 1 (bits differ)
        self.leak = leak  # multiplies neighbours by 0 (NaN neighbours leak in)
        self.empty_ok = empty_ok

    def _outputs(self, sums, seq):
        return sums, _running_max(seq)

    def prefill_padded(self, seqs, padding):
        lengths = torch.tensor([s.shape[0] for s in seqs])
        if not self.empty_ok and int(lengths.min()) == 0:
            raise NotImplementedError("zero-length sequences")
        steps = int(lengths.max())
        padded = torch.stack(
            [torch.cat([s, padding_fill(s, steps - s.shape[0], padding)]) for s in seqs]
        )
        if self.batch_float64 and len(seqs) > 1:
            return [self._outputs(s.double().cumsum(0).float(), s) for s in seqs]
        sums = _masked_prefix_sums(padded, lengths)
        if self.leak:
            sums = sums + 0 * padded.sum(dim=0, keepdim=True)
        return [self._outputs(sums[b, : s.shape[0]], s) for b, s in enumerate(seqs)]

    def prefill_varlen(self, seqs):
        packed = torch.cat(seqs)
        cu_seqlens = [0]
        for s in seqs:
            cu_seqlens.append(cu_seqlens[-1] + s.shape[0])
        outs = []
        for b in range(len(seqs)):
            segment = packed[cu_seqlens[b] : cu_seqlens[b + 1]]
            sums = _masked_prefix_sums(segment[None], torch.tensor([segment.shape[0]]))[0]
            outs.append(self._outputs(sums, segment))
        return outs

    def _rows_from_cache(self, cache, start, *, right_to_left=False):
        """Rows start..len(cache)-1, each summed over cache[0..i]."""
        full = _masked_prefix_sums(
            cache[None], torch.tensor([cache.shape[0]]), right_to_left=right_to_left
        )[0]
        return full[start:]

    def prefill_chunked(self, seq, chunk_lengths):
        cache, rows, start = seq[:0], [], 0
        for length in chunk_lengths:
            cache = torch.cat([cache, seq[start : start + length]])
            rows.append(self._rows_from_cache(cache, start))
            start += length
        assert start == seq.shape[0]
        return self._outputs(torch.cat(rows), seq)

    def decode(self, seq, prompt_len, companions):
        prompts = [seq[:prompt_len]] + [c[: min(prompt_len, c.shape[0])] for c in companions]
        prompt_sums = self.prefill_padded(prompts, "zeros")[0][0]
        caches = list(prompts)
        rows = [prompt_sums]
        for i in range(prompt_len, seq.shape[0]):
            step = i - prompt_len
            active = [0] + [
                k + 1 for k, c in enumerate(companions) if caches[k + 1].shape[0] < c.shape[0]
            ]
            for b in active:
                source = seq if b == 0 else companions[b - 1]
                position = caches[b].shape[0]
                caches[b] = torch.cat([caches[b], source[position : position + 1]])
            assert caches[0].shape[0] == i + 1, step
            rows.append(
                self._rows_from_cache(caches[0], i, right_to_left=self.decode_right_to_left)
            )
        return self._outputs(torch.cat(rows), seq)

    def prefix_reuse(self, seq, prefix_len, writer_batch, reader_batch):
        written = self.prefill_padded([seq[:prefix_len]] + writer_batch, "zeros")[0][0]
        cache = seq[:prefix_len].clone()  # the cached prefix KV
        self.prefill_padded(reader_batch or [seq[:1]], "zeros")  # the reader batch's own work
        rest = self._rows_from_cache(torch.cat([cache, seq[prefix_len:]]), prefix_len)
        return self._outputs(torch.cat([written, rest]), seq)


class NoPrefixCacheAdapter(PrefixSumAdapter):
    def prefix_reuse(self, seq, prefix_len, writer_batch, reader_batch):
        raise NotImplementedError("no prefix cache")


def _sweep(adapter, **kwargs):
    return sequence_invariance_sweep(adapter, make_sequence, **kwargs)


@pytest.fixture(scope="module")
def good_reports():
    return _sweep(PrefixSumAdapter())


def test_invariant_sequence_op_passes_every_transform(good_reports):
    assert isinstance(PrefixSumAdapter(), SequenceAdapter)
    assert_no_drift(good_reports)
    assert {r.transform_id for r in good_reports} == {t.id for t in TRANSFORMS}
    assert all(r.applicable for r in good_reports)
    cases = " | ".join(r.case for r in good_reports)
    for expected in (
        "chunks of 7",
        "chunks of 100",
        "irregular chunks",
        "tokens decoded",
        "varlen",
        "zero-length",
        "padding filled with nan",
        "prefix 64 cached",
    ):
        assert expected in cases


def test_decode_in_another_order_is_caught_in_t5_only():
    reports = _sweep(PrefixSumAdapter(decode_right_to_left=True))
    drifting = [r for r in reports if not r.bitwise]
    assert drifting and {r.transform_id for r in drifting} == {"T5"}
    assert all("decoded" in r.case for r in drifting)
    assert all(r.first_mismatch[0] == 0 for r in drifting)  # the sum, not the running max
    with pytest.raises(AssertionError, match="T5"):
        assert_no_drift(reports)


def test_batch_dependent_prefill_is_caught():
    reports = _sweep(PrefixSumAdapter(batch_float64=True))
    t1 = _by_id(reports, "T1")
    assert t1[0].bitwise  # batch of one takes the normal path
    assert all(not r.bitwise for r in t1[1:])
    assert {"T1", "T2", "T3", "T4"} <= _drifting_ids(reports)


def test_neighbour_leak_is_caught_by_t3():
    reports = _sweep(PrefixSumAdapter(leak=True), batch_sizes=(1, 3))
    t3_drift = {r.case.split(": ")[-1] for r in _by_id(reports, "T3") if not r.bitwise}
    assert t3_drift == {"nan", "inf"}
    assert all(r.bitwise for r in _by_id(reports, "T1"))


def test_missing_method_is_not_applicable_and_not_silent():
    reports = _sweep(NoPrefixCacheAdapter(), batch_sizes=(1, 3))
    t7 = _by_id(reports, "T7")
    assert len(t7) == 1 and not t7[0].applicable and "no prefix cache" in t7[0].detail
    with pytest.raises(AssertionError, match="not-applicable"):
        assert_no_drift(reports)
    assert_no_drift(reports, allow_not_applicable={"T7"})


def test_unsupported_zero_length_neighbour_is_not_applicable():
    reports = _sweep(PrefixSumAdapter(empty_ok=False), batch_sizes=(1, 3))
    t4 = _by_id(reports, "T4")
    assert [r.applicable for r in t4] == [True, True, True, False]
    with pytest.raises(AssertionError):
        assert_no_drift(reports)


def test_adapter_that_modifies_its_inputs_is_rejected():
    class Mutating(PrefixSumAdapter):
        def prefill_varlen(self, seqs):
            seqs[0].mul_(2)
            return super().prefill_varlen(seqs)

    with pytest.raises(RuntimeError, match="prefill_varlen modified its input"):
        _sweep(Mutating(), batch_sizes=(1, 3))


def test_sequence_sweep_argument_checks():
    with pytest.raises(ValueError, match="prompt_lengths"):
        _sweep(PrefixSumAdapter(), prompt_lengths=(0,))
    with pytest.raises(ValueError, match="prefix_lengths"):
        _sweep(PrefixSumAdapter(), seq_len=10, prompt_lengths=(1,), prefix_lengths=(10,))

    class NoBaseline:
        def prefill_padded(self, seqs, padding):
            raise NotImplementedError

    with pytest.raises(TypeError, match="prefill_padded"):
        _sweep(NoBaseline())
