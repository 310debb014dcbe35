"""Axis-A: the transforms T1-T7 as data, and the sweeps that apply them.

A batch-invariant op gives a row (a token, a sequence) the same bits whatever else is
computed with it.  The transforms below are the ways "whatever else" changes in an
inference or training engine; a sweep computes a probe alone, then under each transform,
and compares the probe's outputs bit for bit (``compare_bits``).  Every case becomes a
``DriftReport``; ``assert_no_drift`` fails listing every drifting case, and also every case
the op could not run ("not applicable") unless the caller explicitly allows it.

Two sweeps:

- ``row_invariance_sweep(op, make_rows)`` for row-wise ops (norms, activations, GEMMs over
  rows, logprobs): T1-T4 on a batch of rows.
- ``sequence_invariance_sweep(adapter, make_sequence)`` for sequence ops (attention, the
  whole model), through a small ``SequenceAdapter`` protocol: T1-T7.

All sweep parameters live in the constants below, in one place.  The sweeps never modify
their inputs and check that the op did not either.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from .comparator import _format_element, compare_bits

__all__ = [
    "BATCH_SIZES",
    "CHUNK_SIZES",
    "DECODE_PROMPT_LENGTHS",
    "EXTREME_MAGNITUDE",
    "IRREGULAR_CHUNK_SCHEDULE",
    "NEIGHBOUR_KINDS",
    "NEIGHBOUR_SEQUENCE_LENGTHS",
    "PADDING_MODES",
    "PADDING_ROWS",
    "POSITIONS",
    "PREFIX_LENGTHS",
    "PROBE_SEQUENCE_LENGTH",
    "SEQUENCE_BATCH_SIZES",
    "TRANSFORMS",
    "DriftReport",
    "SequenceAdapter",
    "Transform",
    "assert_no_drift",
    "chunk_schedule",
    "format_reports",
    "padding_fill",
    "row_invariance_sweep",
    "sequence_invariance_sweep",
]

Rows = Tensor | tuple[Tensor, ...]
Seq = Tensor | tuple[Tensor, ...]
Output = Tensor | tuple[Tensor, ...]


@dataclass(frozen=True)
class Transform:
    id: str
    name: str
    description: str


TRANSFORMS: tuple[Transform, ...] = (
    Transform(
        "T1",
        "batch population",
        "The number of rows/sequences computed together changes (1, 3, 17, 33 ...).",
    ),
    Transform(
        "T2",
        "row position",
        "The probe sits first, in the middle or last of the batch (other offsets, alignment).",
    ),
    Transform(
        "T3",
        "neighbour content",
        "The other rows hold extreme values (+-1e4), subnormals, NaN, inf, or copies of the probe.",
    ),
    Transform(
        "T4",
        "padding layout and fully masked rows",
        "Padding rows/positions of zeros, NaN or random bits around the probe; a zero-length "
        "(fully masked) neighbour sequence.",
    ),
    Transform(
        "T5",
        "execution schedule",
        "Chunked prefill with several chunk sizes (1, 7, 64, 100 and an irregular mix), and "
        "prefill of a prompt followed by token-by-token decode in a batch.",
    ),
    Transform(
        "T6",
        "varlen packed vs padded",
        "The same sequences packed back to back (cu_seqlens) instead of right-padded.",
    ),
    Transform(
        "T7",
        "prefix reuse",
        "The KV cache of a prefix is written while prefilling in one batch and read to "
        "compute the rest of the sequence in another batch.",
    ),
)
_TRANSFORM_IDS = tuple(t.id for t in TRANSFORMS)

# ----- sweep parameters (the one place they are kept) ----------------------------------------
BATCH_SIZES = (1, 3, 17, 33)  # T1 for row sweeps
POSITIONS = ("first", "middle", "last")  # T2
EXTREME_MAGNITUDE = 1e4  # T3: fits fp16 (max 65504), squares overflow it
NEIGHBOUR_KINDS = ("extreme", "subnormal", "nan", "inf", "copies")  # T3
PADDING_ROWS = (1, 4)  # T4, row sweeps: padding rows on each side of the probe
PADDING_MODES = ("zeros", "nan", "garbage")  # T4: what fills padding
SEQUENCE_BATCH_SIZES = (1, 3, 5)  # T1 for sequence sweeps (each sequence is many tokens)
# Odd, crosses a 64-token boundary; attention's sweeps pass 131 (past one 128-key block).
PROBE_SEQUENCE_LENGTH = 67
NEIGHBOUR_SEQUENCE_LENGTHS = (90, 29, 1, 67, 13)  # cycled; 90 > 67 so the probe gets padded
CHUNK_SIZES = (1, 7, 64, 100)  # T5 chunked prefill; 7 and 100 divide neither 64 nor 128
IRREGULAR_CHUNK_SCHEDULE = (5, 64, 1, 7, 100)  # T5: cycled until the sequence is covered
DECODE_PROMPT_LENGTHS = (1, 33, 66)  # T5: prompt prefilled, the rest decoded token by token
PREFIX_LENGTHS = (1, 33, 64)  # T7: cached prefix lengths (64: a block boundary)
# For another seq_len the sweep derives both the same way: see _split_points.


@dataclass(frozen=True)
class DriftReport:
    """One case of a sweep.

    ``first_mismatch`` is the index of the first differing element in the probe's output;
    for tuple outputs it is prefixed with the output's position in the tuple.
    ``applicable=False`` means the op could not run this case (NotImplementedError):
    ``bitwise`` is then False, and ``assert_no_drift`` fails unless the transform is allowed.
    """

    transform_id: str
    case: str
    bitwise: bool
    mismatches: int
    first_mismatch: tuple[int, ...] | None
    max_abs_diff: float
    applicable: bool = True
    detail: str = ""

    @property
    def status(self) -> str:
        if not self.applicable:
            return "n/a"
        return "ok" if self.bitwise else "DRIFT"


def format_reports(reports: Iterable[DriftReport]) -> str:
    """A fixed-width table: transform, status, mismatches, first mismatch, max |diff|, case."""
    rows = [("id", "status", "mismatches", "first mismatch", "max abs diff", "case")]
    for r in reports:
        first = "-" if r.first_mismatch is None else str(r.first_mismatch)
        diff = "-" if not r.applicable or r.bitwise else f"{r.max_abs_diff:.3g}"
        case = f"{r.case} ({r.detail})" if r.detail else r.case
        mismatches = "-" if not r.applicable else str(r.mismatches)
        rows.append((r.transform_id, r.status, mismatches, first, diff, case))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = []
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:5], widths, strict=True)]
        lines.append("  ".join(cells + [row[5]]).rstrip())
    return "\n".join(lines)


def assert_no_drift(
    reports: Sequence[DriftReport], *, allow_not_applicable: Iterable[str] = ()
) -> None:
    """Fails listing every drifting case, and every not-applicable case whose transform id
    is not in ``allow_not_applicable`` (e.g. ``{"T7"}`` for an op without a KV cache).
    An empty report list fails too: a sweep that ran nothing proves nothing."""
    allowed = set(allow_not_applicable)
    unknown = allowed - set(_TRANSFORM_IDS)
    if unknown:
        raise ValueError(f"allow_not_applicable has unknown transform ids {sorted(unknown)}")
    reports = list(reports)
    if not reports:
        raise AssertionError("no drift reports: the sweep ran no case")
    failing = [
        r
        for r in reports
        if (r.applicable and not r.bitwise) or (not r.applicable and r.transform_id not in allowed)
    ]
    if failing:
        drift = sum(r.applicable for r in failing)
        missing = len(failing) - drift
        raise AssertionError(
            f"{drift} drifting and {missing} not-applicable (not allowed) cases out of "
            f"{len(reports)}:\n{format_reports(failing)}"
        )


# ----- tensors-or-tuples helpers -----------------------------------------------------------


def _as_tuple(x: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return (x,) if isinstance(x, Tensor) else tuple(x)


def _like(template: Tensor | tuple[Tensor, ...], parts: Sequence[Tensor]):
    return parts[0] if isinstance(template, Tensor) else tuple(parts)


def _leading(x: Tensor | tuple[Tensor, ...], what: str) -> int:
    tensors = _as_tuple(x)
    if not tensors or not all(isinstance(t, Tensor) for t in tensors):
        raise TypeError(f"{what} must be a tensor or a non-empty tuple of tensors")
    if any(t.dim() == 0 for t in tensors):
        raise ValueError(f"{what}: every tensor needs a leading row/token dimension")
    sizes = {t.shape[0] for t in tensors}
    if len(sizes) != 1:
        raise ValueError(f"{what}: tensors disagree on the leading dimension {sorted(sizes)}")
    return sizes.pop()


def _cat(parts: Sequence[Tensor | tuple[Tensor, ...]]):
    columns = zip(*(_as_tuple(p) for p in parts), strict=True)
    return _like(parts[0], [torch.cat(column, dim=0) for column in columns])


def _slice(x, start: int, stop: int):
    return _like(x, [t[start:stop] for t in _as_tuple(x)])


def _clone(x):
    return _like(x, [t.clone() for t in _as_tuple(x)])


def _unchanged(x, snapshot) -> bool:
    return all(
        compare_bits(a, b).equal for a, b in zip(_as_tuple(x), _as_tuple(snapshot), strict=True)
    )


def _tensors_in(value) -> list[Tensor]:
    """Every tensor inside nested lists/tuples (the sequences handed to an adapter)."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors_in(item)]
    return []


def _random_signs(t: Tensor, generator: torch.Generator) -> Tensor:
    signs = torch.randint(0, 2, t.shape, generator=generator).to(t.device) * 2 - 1
    return signs.to(t.dtype)


def _neighbour_tensor(t: Tensor, kind: str, magnitude: float, generator: torch.Generator) -> Tensor:
    """``t`` (random rows) with its floating-point content replaced according to ``kind``."""
    if not t.is_floating_point():
        return t
    if kind == "random":
        return t
    if kind == "extreme":
        return _random_signs(t, generator) * magnitude
    if kind == "subnormal":
        info = torch.finfo(t.dtype)
        return _random_signs(t, generator) * (info.smallest_normal * info.eps)
    if kind == "nan":
        return torch.full_like(t, float("nan"))
    if kind == "inf":
        return _random_signs(t, generator) * float("inf")
    raise ValueError(f"unknown neighbour kind {kind!r}; expected one of {NEIGHBOUR_KINDS}")


def _has_float(x) -> bool:
    return any(t.is_floating_point() for t in _as_tuple(x))


def padding_fill(
    like: Tensor,
    length: int,
    mode: str,
    *,
    generator: torch.Generator | None = None,
    int_high: int | None = None,
) -> Tensor:
    """``length`` rows shaped like ``like[0]`` to fill padding, for adapters and sweeps.

    ``mode``: "zeros"; "nan" (NaN for floats); "garbage" (random bit patterns for floats,
    which include NaNs, infinities and subnormals).  Integer tensors get zeros for "zeros"
    and random values in ``[0, int_high)`` otherwise (zeros when ``int_high`` is None), so
    padded token ids stay valid ids.  A fixed seed is used when ``generator`` is None.
    """
    if mode not in PADDING_MODES:
        raise ValueError(f"unknown padding mode {mode!r}; expected one of {PADDING_MODES}")
    generator = generator if generator is not None else torch.Generator().manual_seed(1234)
    shape = (length, *like.shape[1:])
    if mode == "zeros":
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    if not like.is_floating_point():
        if int_high is None:
            return torch.zeros(shape, dtype=like.dtype, device=like.device)
        values = torch.randint(0, int_high, shape, generator=generator)
        return values.to(dtype=like.dtype, device=like.device)
    if mode == "nan":
        return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)
    count = math.prod(shape) * like.element_size()
    raw = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=generator)
    return raw.view(like.dtype).reshape(shape).to(like.device)


# ----- reports -----------------------------------------------------------------------------


def _compare(transform_id: str, case: str, actual: Output, expected: Output) -> DriftReport:
    actual_parts, expected_parts = _as_tuple(actual), _as_tuple(expected)
    if len(actual_parts) != len(expected_parts):
        raise ValueError(
            f"{transform_id} {case}: the op returned {len(actual_parts)} outputs here but "
            f"{len(expected_parts)} for the probe alone"
        )
    tagged = not isinstance(expected, Tensor)
    mismatches, first, diffs, detail = 0, None, [], ""
    for k, (a, e) in enumerate(zip(actual_parts, expected_parts, strict=True)):
        if a.dtype != e.dtype or a.shape != e.shape:
            raise ValueError(
                f"{transform_id} {case}: output {k} is {a.dtype} {tuple(a.shape)} here but "
                f"{e.dtype} {tuple(e.shape)} for the probe alone"
            )
        result = compare_bits(a, e)
        if result.equal:
            continue
        mismatches += result.mismatches
        diffs.append(result.max_abs_diff)
        if first is None:
            assert result.first_mismatch is not None
            first = ((k,) if tagged else ()) + result.first_mismatch
            where = f"output {k} " if tagged else ""
            a_cpu, e_cpu = a.detach().cpu(), e.detach().cpu()
            detail = (
                f"{where}at {result.first_mismatch}: "
                f"{_format_element(a_cpu, result.first_mismatch)} vs alone "
                f"{_format_element(e_cpu, result.first_mismatch)}"
            )
    finite = [d for d in diffs if not math.isnan(d)]
    # nan: every mismatch involves a NaN/inf (no finite difference to report)
    max_diff = max(finite) if finite else (float("nan") if diffs else 0.0)
    return DriftReport(
        transform_id, case, mismatches == 0, mismatches, first, max_diff, detail=detail
    )


def _not_applicable(transform_id: str, case: str, reason: str) -> DriftReport:
    return DriftReport(
        transform_id, case, False, 0, None, float("nan"), applicable=False, detail=reason
    )


def _positions(n: int) -> list[tuple[str, int]]:
    """(name, row index) for each of POSITIONS in a batch of n, without repeated indices."""
    seen, result = set(), []
    for position in POSITIONS:
        index = {"first": 0, "middle": n // 2, "last": n - 1}[position]
        if index not in seen:
            seen.add(index)
            result.append((position, index))
    return result


# ----- row sweep ---------------------------------------------------------------------------


def row_invariance_sweep(
    op: Callable[[Rows], Output],
    make_rows: Callable[[int, torch.Generator], Rows],
    *,
    batch_sizes: Sequence[int] = BATCH_SIZES,
    seed: int = 0,
    extreme_value: float = EXTREME_MAGNITUDE,
    neighbour_kinds: Sequence[str] = NEIGHBOUR_KINDS,
    padding_rows: Sequence[int] = PADDING_ROWS,
    padding_modes: Sequence[str] = PADDING_MODES,
    int_high: int | None = None,
) -> list[DriftReport]:
    """T1-T4 for a row-wise op; returns one report per case.

    ``op(batch)`` maps a tensor ``[N, ...]`` (or a tuple of tensors sharing N) to a tensor or
    tuple of tensors with leading dim N, row i depending only on input row i.
    ``make_rows(n, generator)`` returns n random rows in that form (``generator`` is a CPU
    ``torch.Generator``; move the rows to the op's device yourself).  The probe row's
    output computed alone is the baseline; the sweep compares it bit for bit with the probe's
    output inside batches of each size at each position (T1, T2), next to neighbours of
    each kind in ``neighbour_kinds`` (T3; float parts only, kinds that change nothing for
    integer-only rows are skipped), and between padding rows of each mode (T4).
    ``int_high`` bounds the values of integer padding rows (e.g. the vocabulary size).
    """
    generator = torch.Generator().manual_seed(seed)
    probe = make_rows(1, generator)
    _leading(probe, "make_rows(1, generator)")
    probe_bits = _clone(probe)

    def run(batch, n: int, transform_id: str, case: str):
        before = _clone(batch)
        out = op(batch)
        if not _unchanged(batch, before):
            raise RuntimeError(f"{transform_id} {case}: op modified its input batch in place")
        got = _leading(out, f"{transform_id} {case}: op output")
        if got != n:
            raise ValueError(
                f"{transform_id} {case}: op output has leading dim {got}, expected {n} rows"
            )
        return out

    def neighbours(n: int, kind: str = "random"):
        if kind == "copies":
            return _cat([probe] * n)
        rows = make_rows(n, generator)
        _leading(rows, f"make_rows({n}, generator)")
        return _like(
            rows, [_neighbour_tensor(t, kind, extreme_value, generator) for t in _as_tuple(rows)]
        )

    def probe_case(transform_id: str, case: str, before, after) -> DriftReport:
        parts = [p for p in (before, probe, after) if p is not None]
        batch = _cat(parts)
        index = 0 if before is None else _leading(before, "rows")
        n = _leading(batch, "batch")
        out = run(batch, n, transform_id, case)
        return _compare(transform_id, case, _slice(out, index, index + 1), baseline)

    baseline = run(_clone(probe), 1, "baseline", "probe alone")
    reports: list[DriftReport] = []

    for n in batch_sizes:  # T1 (probe first) and T2 (probe elsewhere)
        if n < 1:
            raise ValueError(f"batch sizes must be >= 1, got {n}")
        for position, index in _positions(n):
            transform_id = "T1" if position == "first" else "T2"
            others = neighbours(n - 1) if n > 1 else None
            before = None if others is None or index == 0 else _slice(others, 0, index)
            after = None if others is None or index == n - 1 else _slice(others, index, n - 1)
            case = (
                "N=1, probe alone again (run-to-run)"
                if n == 1
                else f"N={n}, probe at row {index} ({position}), random neighbours"
            )
            reports.append(probe_case(transform_id, case, before, after))

    t3_rows = max(3, max(batch_sizes))
    for kind in neighbour_kinds:  # T3
        if kind != "copies" and not _has_float(probe):
            continue
        others = neighbours(t3_rows - 1, kind)
        index = t3_rows // 2
        case = f"N={t3_rows}, probe at row {index}, neighbours: {kind}"
        if kind == "extreme":
            case += f" (+-{extreme_value:g})"
        reports.append(
            probe_case("T3", case, _slice(others, 0, index), _slice(others, index, t3_rows - 1))
        )

    for pad in padding_rows:  # T4
        for mode in padding_modes:
            if mode == "nan" and not _has_float(probe):
                continue
            fill = [
                _like(
                    probe,
                    [
                        padding_fill(t, pad, mode, generator=generator, int_high=int_high)
                        for t in _as_tuple(probe)
                    ],
                )
                for _ in range(2)
            ]
            case = f"{pad} padding row(s) of {mode} on each side"
            reports.append(probe_case("T4", case, fill[0], fill[1]))

    if not _unchanged(probe, probe_bits):
        raise RuntimeError("op modified the probe rows in place")
    return reports


# ----- sequence sweep ----------------------------------------------------------------------


@runtime_checkable
class SequenceAdapter(Protocol):
    """What a sequence op implements so ``sequence_invariance_sweep`` can drive it.

    A sequence ``seq`` is a tensor or a tuple of tensors whose dim 0 is the token position
    (e.g. ``(q [L, Hq, d], k [L, Hkv, d], v [L, Hkv, d])`` for attention, ``ids [L]`` for a
    model).  An output per sequence is a tensor, or a tuple of tensors (output and LSE),
    whose dim 0 is the token position: row i belongs to token i.  A method the op cannot
    support raises NotImplementedError (or is absent); the sweep then reports its cases as
    not applicable, which ``assert_no_drift`` rejects unless allowed explicitly.
    """

    def prefill_padded(self, seqs: list[Seq], padding: str) -> list[Output]:
        """Prefill ``seqs`` as one right-padded batch; return each sequence's output rows
        (without the padding).  Fill the padded region with ``padding_fill(..., padding)``:
        it may hold NaN or random bits and must never be read.  Zero-length sequences may
        occur (a fully masked row): raise NotImplementedError if unsupported."""
        ...

    def prefill_varlen(self, seqs: list[Seq]) -> list[Output]:
        """Prefill ``seqs`` packed back to back (cu_seqlens, no padding)."""
        ...

    def prefill_chunked(self, seq: Seq, chunk_lengths: Sequence[int]) -> Output:
        """Prefill ``seq`` in consecutive chunks of these lengths (they sum to its length)
        through a KV cache; return the rows of all chunks, in order."""
        ...

    def decode(self, seq: Seq, prompt_len: int, companions: list[Seq]) -> Output:
        """Prefill ``seq[:prompt_len]`` (batched with the companions' prompts, e.g. their
        first ``min(prompt_len, len)`` tokens), then decode the remaining tokens one at a
        time in a batch with the companions, which decode their own remaining tokens and
        leave the batch when they run out.  Return all of ``seq``'s rows (prompt rows from the
        prefill, then one row per decode step)."""
        ...

    def prefix_reuse(
        self, seq: Seq, prefix_len: int, writer_batch: list[Seq], reader_batch: list[Seq]
    ) -> Output:
        """Prefill ``seq[:prefix_len]`` in a batch with ``writer_batch``, keeping its KV
        cache; then compute ``seq[prefix_len:]`` reading that cache, in a batch with
        ``reader_batch``.  Return all of ``seq``'s rows."""
        ...


def _split_points(seq_len: int, *, block: int | None) -> tuple[int, ...]:
    """1, half, and the last token (or the last ``block`` boundary), within [1, seq_len)."""
    last = block * ((seq_len - 1) // block) if block else seq_len - 1
    return tuple(sorted({p for p in (1, seq_len // 2, last) if 1 <= p < seq_len}))


class _NotApplicable(Exception):
    pass


def chunk_schedule(length: int, chunk_sizes: int | Sequence[int]) -> list[int]:
    """Chunk lengths covering ``length`` tokens: one size repeated, or a list cycled; the last
    chunk is cut short."""
    sizes = [chunk_sizes] if isinstance(chunk_sizes, int) else list(chunk_sizes)
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"chunk sizes must be >= 1, got {chunk_sizes}")
    schedule, covered, k = [], 0, 0
    while covered < length:
        size = min(sizes[k % len(sizes)], length - covered)
        schedule.append(size)
        covered += size
        k += 1
    return schedule


def sequence_invariance_sweep(
    adapter: SequenceAdapter,
    make_sequence: Callable[[int, torch.Generator], Seq],
    *,
    seq_len: int = PROBE_SEQUENCE_LENGTH,
    neighbour_lengths: Sequence[int] = NEIGHBOUR_SEQUENCE_LENGTHS,
    batch_sizes: Sequence[int] = SEQUENCE_BATCH_SIZES,
    chunk_sizes: Sequence[int] = CHUNK_SIZES,
    irregular_chunks: Sequence[int] = IRREGULAR_CHUNK_SCHEDULE,
    prompt_lengths: Sequence[int] | None = None,
    prefix_lengths: Sequence[int] | None = None,
    neighbour_kinds: Sequence[str] = NEIGHBOUR_KINDS,
    padding_modes: Sequence[str] = PADDING_MODES,
    extreme_value: float = EXTREME_MAGNITUDE,
    seed: int = 0,
) -> list[DriftReport]:
    """T1-T7 for a sequence op driven through ``adapter``; returns one report per case.

    ``make_sequence(length, generator)`` returns one random sequence (see
    ``SequenceAdapter``; ``generator`` is a CPU ``torch.Generator``).  The baseline is the
    probe sequence prefilled alone (``prefill_padded([probe], "zeros")``, required); every
    other schedule's rows for the probe are compared with it bit for bit:
    T1 batch sizes, T2 probe first/middle/last, T3 neighbour sequences of each kind,
    T4 padding of each mode and a zero-length neighbour, T5 chunked prefill (each chunk size
    and an irregular schedule) and prompt + token-by-token decode alone and in a batch,
    T6 varlen packing, T7 prefix reuse across batches.  Lengths in ``prompt_lengths`` and
    ``prefix_lengths`` must lie in ``[1, seq_len)``; by default they are 1, half and the last
    token (prompts) or the last 64-token boundary (prefixes), i.e. ``DECODE_PROMPT_LENGTHS``
    and ``PREFIX_LENGTHS`` for the default ``seq_len``.
    """
    if prompt_lengths is None:
        prompt_lengths = _split_points(seq_len, block=None)
    if prefix_lengths is None:
        prefix_lengths = _split_points(seq_len, block=64 if seq_len > 64 else None)
    for what, values in (("prompt_lengths", prompt_lengths), ("prefix_lengths", prefix_lengths)):
        bad = [v for v in values if not 1 <= v < seq_len]
        if bad:
            raise ValueError(f"{what} must lie in [1, seq_len={seq_len}), got {bad}")
    generator = torch.Generator().manual_seed(seed)
    probe = make_sequence(seq_len, generator)
    if _leading(probe, f"make_sequence({seq_len}, generator)") != seq_len:
        raise ValueError(f"make_sequence({seq_len}, ...) returned a sequence of another length")
    probe_bits = _clone(probe)
    length_cycle = [0]

    def neighbours(count: int, kind: str = "random") -> list[Seq]:
        result = []
        for _ in range(count):
            if kind == "copies":
                result.append(_clone(probe))
                continue
            length = neighbour_lengths[length_cycle[0] % len(neighbour_lengths)]
            length_cycle[0] += 1
            seq = make_sequence(length, generator)
            result.append(
                _like(
                    seq,
                    [_neighbour_tensor(t, kind, extreme_value, generator) for t in _as_tuple(seq)],
                )
            )
        return result

    def call(transform_id: str, case: str, method: str, *args, **kwargs):
        fn = getattr(adapter, method, None)
        if fn is None:
            raise _NotApplicable(f"adapter has no {method}")
        inputs = _tensors_in(args)
        before = [t.clone() for t in inputs]
        try:
            result = fn(*args, **kwargs)
        except NotImplementedError as err:
            raise _NotApplicable(f"{method}: {err}" if str(err) else method) from err
        if not all(compare_bits(t, b).equal for t, b in zip(inputs, before, strict=True)):
            raise RuntimeError(f"{transform_id} {case}: {method} modified its input sequences")
        return result

    def check_rows(out, transform_id: str, case: str):
        got = _leading(out, f"{transform_id} {case}: output")
        if got != seq_len:
            raise ValueError(
                f"{transform_id} {case}: output has {got} rows, the probe has {seq_len} tokens"
            )
        return out

    def batch_case(transform_id, case, method, seqs, index, **kwargs) -> DriftReport:
        outs = call(transform_id, case, method, seqs, **kwargs)
        if len(outs) != len(seqs):
            raise ValueError(
                f"{transform_id} {case}: {method} returned {len(outs)} outputs "
                f"for {len(seqs)} sequences"
            )
        return _compare(transform_id, case, check_rows(outs[index], transform_id, case), baseline)

    def with_probe_at(others: list[Seq], index: int) -> list[Seq]:
        return others[:index] + [_clone(probe)] + others[index:]

    try:
        baseline = call(
            "baseline", "probe alone", "prefill_padded", [_clone(probe)], padding="zeros"
        )[0]
    except _NotApplicable as err:
        raise TypeError(f"the adapter must implement prefill_padded (the baseline): {err}") from err
    check_rows(baseline, "baseline", "probe alone")

    reports: list[DriftReport] = []

    def guarded(transform_id: str, case: str, thunk) -> bool:
        """Runs one case; on NotImplementedError records n/a and returns False."""
        try:
            reports.append(thunk())
        except _NotApplicable as err:
            reports.append(_not_applicable(transform_id, case, str(err)))
            return False
        return True

    for n in batch_sizes:  # T1, T2 on padded prefill
        if n < 1:
            raise ValueError(f"batch sizes must be >= 1, got {n}")
        for position, index in _positions(n):
            transform_id = "T1" if position == "first" else "T2"
            seqs = with_probe_at(neighbours(n - 1), index)
            case = (
                "B=1, probe prefilled alone again (run-to-run)"
                if n == 1
                else f"B={n}, probe at {index} ({position}), padded prefill"
            )
            guarded(
                transform_id,
                case,
                lambda seqs=seqs, index=index, case=case, t=transform_id: batch_case(
                    t, case, "prefill_padded", seqs, index, padding="zeros"
                ),
            )

    t3_batch = max(3, max(batch_sizes))
    for kind in neighbour_kinds:  # T3
        if kind != "copies" and not _has_float(probe):
            continue
        index = t3_batch // 2
        seqs = with_probe_at(neighbours(t3_batch - 1, kind), index)
        case = f"B={t3_batch}, probe at {index}, neighbour sequences: {kind}"
        if kind == "extreme":
            case += f" (+-{extreme_value:g})"
        guarded(
            "T3",
            case,
            lambda seqs=seqs, index=index, case=case: batch_case(
                "T3", case, "prefill_padded", seqs, index, padding="zeros"
            ),
        )

    longer = make_sequence(seq_len + 23, generator)
    shorter = make_sequence(max(1, seq_len // 3), generator)
    for mode in padding_modes:  # T4
        seqs = [shorter, _clone(probe), longer]
        case = f"B=3, probe at 1, padding filled with {mode}"
        guarded(
            "T4",
            case,
            lambda seqs=seqs, case=case, mode=mode: batch_case(
                "T4", case, "prefill_padded", seqs, 1, padding=mode
            ),
        )
    empty = _slice(make_sequence(1, generator), 0, 0)
    case = "B=3, probe at 1, a zero-length (fully masked) neighbour, garbage padding"
    guarded(
        "T4",
        case,
        lambda: batch_case(
            "T4", case, "prefill_padded", [empty, _clone(probe), longer], 1, padding="garbage"
        ),
    )

    ok = True
    schedules = [(f"chunks of {c}", chunk_schedule(seq_len, c)) for c in chunk_sizes]
    irregular = chunk_schedule(seq_len, irregular_chunks)
    schedules.append((f"irregular chunks {irregular}", irregular))
    for label, schedule in schedules:  # T5 chunked
        case = f"chunked prefill, {label}"
        ok = guarded(
            "T5",
            case,
            lambda schedule=schedule, case=case: _compare(
                "T5",
                case,
                check_rows(
                    call("T5", case, "prefill_chunked", _clone(probe), schedule), "T5", case
                ),
                baseline,
            ),
        )
        if not ok:
            break
    decode_batch = max(batch_sizes)
    for prompt_len in prompt_lengths:  # T5 decode
        for companions in (0, decode_batch - 1) if decode_batch > 1 else (0,):
            case = (
                f"prompt {prompt_len} prefilled, {seq_len - prompt_len} tokens decoded, "
                f"{companions} companion sequence(s)"
            )
            others = neighbours(companions)
            ok = guarded(
                "T5",
                case,
                lambda p=prompt_len, others=others, case=case: _compare(
                    "T5",
                    case,
                    check_rows(call("T5", case, "decode", _clone(probe), p, others), "T5", case),
                    baseline,
                ),
            )
            if not ok:
                break
        if not ok:
            break

    for n in batch_sizes:  # T6
        index = n // 2
        seqs = with_probe_at(neighbours(n - 1), index)
        case = f"B={n}, probe at {index}, varlen packed"
        if not guarded(
            "T6",
            case,
            lambda seqs=seqs, index=index, case=case: batch_case(
                "T6", case, "prefill_varlen", seqs, index
            ),
        ):
            break

    for prefix_len in prefix_lengths:  # T7
        for writers, readers in ((0, 0), (2, max(batch_sizes) - 1)):
            case = (
                f"prefix {prefix_len} cached by a batch of {writers + 1}, "
                f"{seq_len - prefix_len} tokens computed in a batch of {readers + 1}"
            )
            writer_batch, reader_batch = neighbours(writers), neighbours(readers)
            ok = guarded(
                "T7",
                case,
                lambda p=prefix_len, w=writer_batch, r=reader_batch, case=case: _compare(
                    "T7",
                    case,
                    check_rows(
                        call("T7", case, "prefix_reuse", _clone(probe), p, w, r), "T7", case
                    ),
                    baseline,
                ),
            )
            if not ok:
                break
        if not ok:
            break

    if not _unchanged(probe, probe_bits):
        raise RuntimeError("the adapter modified the probe sequence in place")
    return reports
