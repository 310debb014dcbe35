"""The numerical contract every batchinv op is judged by.

- Axis-A (invariance): ``assert_bitwise_equal`` / ``bitwise_equal`` compare bit patterns;
  ``TRANSFORMS`` (T1-T7) and the sweeps ``row_invariance_sweep`` /
  ``sequence_invariance_sweep`` apply them and return ``DriftReport``s.
- Axis-B (accuracy): ``tolerance`` / ``assert_within_tolerance`` and the one ``TOLERANCES``
  table, per op and derived from measured error by ``tools/tolerance_table.py``.
- ``deterministic_context`` is where strict fp32 references run.

This package never imports ``batchinv.reference`` or ``batchinv.ops``: it does not import
what it judges.  See docs/contract.md.
"""

from .comparator import (
    BitwiseComparison,
    DtypeMismatchError,
    ShapeMismatchError,
    assert_bitwise_equal,
    bitwise_equal,
    compare_bits,
)
from .context import deterministic_context
from .tolerances import (
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
from .transforms import (
    BATCH_SIZES,
    CHUNK_SIZES,
    DECODE_PROMPT_LENGTHS,
    EXTREME_MAGNITUDE,
    IRREGULAR_CHUNK_SCHEDULE,
    NEIGHBOUR_KINDS,
    NEIGHBOUR_SEQUENCE_LENGTHS,
    PADDING_MODES,
    PADDING_ROWS,
    POSITIONS,
    PREFIX_LENGTHS,
    PROBE_SEQUENCE_LENGTH,
    SEQUENCE_BATCH_SIZES,
    TRANSFORMS,
    DriftReport,
    SequenceAdapter,
    Transform,
    assert_no_drift,
    chunk_schedule,
    format_reports,
    padding_fill,
    row_invariance_sweep,
    sequence_invariance_sweep,
)

__all__ = [
    # comparator
    "BitwiseComparison",
    "DtypeMismatchError",
    "ShapeMismatchError",
    "assert_bitwise_equal",
    "bitwise_equal",
    "compare_bits",
    # context
    "deterministic_context",
    # tolerances
    "KINDS",
    "OP_CLASSES",
    "OPS",
    "TOLERANCE_DTYPES",
    "TOLERANCES",
    "Tolerance",
    "assert_within_tolerance",
    "tolerance",
    "tolerance_table_markdown",
    # transforms
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
