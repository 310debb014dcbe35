"""``batchinv audit``: the contract's transform sweep on a Qwen3 model, stock vs batchinv.

``run_audit(model)`` returns an ``AuditResult``; ``format_audit`` / ``audit_json`` report it;
``main(argv)`` is the command (``batchinv audit``, ``python -m batchinv audit``), whose runs
``plan_runs`` lists: on CUDA the tiny model's sweep and a production-shaped one.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from .report import audit_json, format_audit, provenance, write_json
from .sweep import (
    AUDIT_PATHS,
    AUDIT_SEQ_LEN,
    PRODUCTION_CONFIG,
    PRODUCTION_SWEEP,
    AuditResult,
    count_cases,
    plan_cases,
    run_audit,
)

__all__ = [
    "AUDIT_PATHS",
    "PRODUCTION_CONFIG",
    "PRODUCTION_SWEEP",
    "QUICK_SWEEP",
    "AuditResult",
    "PlannedRun",
    "add_arguments",
    "audit_json",
    "count_cases",
    "format_audit",
    "main",
    "plan_cases",
    "plan_runs",
    "provenance",
    "run",
    "run_audit",
    "write_json",
]

# ``--quick``: a smaller sweep (short probe and neighbours, fewer sizes) for smoke checks;
# every transform still runs.  The default is the contract's full sweep.
QUICK_SWEEP = {
    "seq_len": 20,
    "neighbour_lengths": (25, 7, 1, 13),
    "batch_sizes": (1, 3),
    "chunk_sizes": (1, 7),
    "irregular_chunks": (3, 1, 5),
    "prompt_lengths": (10,),
    "prefix_lengths": (10,),
}

# What loading a model raises for bad input: exit code 2, before any work.
_LOAD_ERRORS = (ImportError, OSError, KeyError, TypeError, ValueError)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class PlannedRun:
    """One run of ``batchinv audit``: its name, its model ("tiny": the built-in
    configuration, "production": ``PRODUCTION_CONFIG``, "checkpoint": ``--model``; random
    weights from ``--seed`` for the built-in ones) and its sweep keywords."""

    name: str
    model: str
    sweep: dict


def plan_runs(device_type: str, *, quick: bool = False, checkpoint: bool = False):
    """The runs ``batchinv audit`` makes, in order.  ``--quick``: the quick sweep alone.  On
    the CPU: the contract's sweep (a 131-token probe) on the model.  On CUDA: with a
    checkpoint, the production sweep on it (the shapes come from the sweep, not the model);
    without, the tiny model's sweep, then the production sweep on the production-shaped
    model (batches beyond 8191 rows, contexts across the 2048-key split, vocab 151936)."""
    model = "checkpoint" if checkpoint else "tiny"
    if quick:
        return [PlannedRun("quick", model, dict(QUICK_SWEEP))]
    small = PlannedRun(model, model, {"seq_len": AUDIT_SEQ_LEN})
    if device_type != "cuda":
        return [small]
    if checkpoint:
        return [PlannedRun("production", "checkpoint", dict(PRODUCTION_SWEEP))]
    return [small, PlannedRun("production", "production", dict(PRODUCTION_SWEEP))]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="local Qwen3 checkpoint (config.json + safetensors); default: the built-in tiny "
        "configuration with random weights",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=sorted(DTYPES), help="model dtype (bfloat16)"
    )
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the result here")
    parser.add_argument("--seed", type=int, default=0, help="weights (built-in) and probe seed")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only a small sweep (20-token probe) for smoke checks; by default CUDA also "
        "runs the production-shaped sweep",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _device(args: argparse.Namespace) -> torch.device:
    if args.device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(args.device)
    except RuntimeError as err:
        raise ValueError(f"--device {args.device!r}: {err}") from err


def _load_model(args: argparse.Namespace, kind: str | None = None):
    """``(model, label)``: ``kind`` as in ``PlannedRun.model``; None: the checkpoint given
    with ``--model``, else the tiny model."""
    from ..models.qwen3 import Qwen3, check_device_dtype

    device = _device(args)
    dtype = DTYPES[args.dtype]
    check_device_dtype(device, dtype)
    if kind is None:
        kind = "tiny" if args.model is None else "checkpoint"
    if kind == "tiny":
        model = Qwen3.from_config(seed=args.seed, device=device, dtype=dtype)
        return model, f"built-in tiny Qwen3 (random weights, seed {args.seed})"
    if kind == "production":
        model = Qwen3.from_config(PRODUCTION_CONFIG, seed=args.seed, device=device, dtype=dtype)
        label = (
            "built-in production-shaped Qwen3: Qwen3-8B layer shapes and vocabulary, "
            f"{PRODUCTION_CONFIG.num_hidden_layers} layers (random weights, seed {args.seed})"
        )
        return model, label
    return Qwen3.from_pretrained(args.model, device=device, dtype=dtype), args.model


def run(args: argparse.Namespace) -> int:
    """The command: 0 when batchinv is bitwise invariant everywhere, 1 when not, 2 when the
    arguments, the checkpoint or the device/dtype pair are unusable (before any work)."""
    from .progress import ProgressBar

    try:
        runs = plan_runs(_device(args).type, quick=args.quick, checkpoint=args.model is not None)
        first = _load_model(args, runs[0].model)
    except _LOAD_ERRORS as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"batchinv audit: error: {message}", file=sys.stderr)
        return 2
    bar = None
    progress = None
    if not args.no_progress:
        total = sum(count_cases(**planned.sweep) for planned in runs) * len(AUDIT_PATHS)
        bar = ProgressBar(total)

        def progress(label: str, _done: int) -> None:
            bar.advance(label)

    results = []
    try:
        for i, planned in enumerate(runs):
            model, label = first if i == 0 else _load_model(args, planned.model)
            results.append(
                run_audit(
                    model,
                    seed=args.seed,
                    model_label=label,
                    progress=progress,
                    run_name=planned.name,
                    **planned.sweep,
                )
            )
            del model
            first = None  # the next run's model replaces this one's
    finally:
        if bar is not None:
            bar.close()
    print("\n\n".join(format_audit(result) for result in results))
    if len(results) > 1:
        verdict = "PASS" if all(r.passed for r in results) else "FAIL"
        print(f"\n{verdict} over all runs: {', '.join(r.name for r in results)}")
    if args.json:
        print(f"JSON written to {write_json(results, args.json)}")
    return 0 if all(result.passed for result in results) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchinv audit", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
