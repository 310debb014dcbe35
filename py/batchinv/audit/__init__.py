"""``batchinv audit``: the contract's transform sweep on a Qwen3 model, stock vs batchinv.

``run_audit(model)`` returns an ``AuditResult``; ``format_audit`` / ``audit_json`` report it;
``main(argv)`` is the command (``batchinv audit``, ``python -m batchinv audit``).
"""

from __future__ import annotations

import argparse
import sys

import torch

from .report import audit_json, format_audit, write_json
from .sweep import AUDIT_PATHS, AUDIT_SEQ_LEN, AuditResult, count_cases, run_audit

__all__ = [
    "AUDIT_PATHS",
    "QUICK_SWEEP",
    "AuditResult",
    "add_arguments",
    "audit_json",
    "count_cases",
    "format_audit",
    "main",
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

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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
        "--quick", action="store_true", help="a smaller sweep (20-token probe) for smoke checks"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _load_model(args: argparse.Namespace):
    from ..models.qwen3 import Qwen3, check_device_dtype

    if args.device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError as err:
            raise ValueError(f"--device {args.device!r}: {err}") from err
    dtype = DTYPES[args.dtype]
    check_device_dtype(device, dtype)
    if args.model is None:
        model = Qwen3.from_config(seed=args.seed, device=device, dtype=dtype)
        return model, f"built-in tiny Qwen3 (random weights, seed {args.seed})"
    return Qwen3.from_pretrained(args.model, device=device, dtype=dtype), args.model


def run(args: argparse.Namespace) -> int:
    """The command: 0 when batchinv is bitwise invariant everywhere, 1 when not, 2 when the
    arguments, the checkpoint or the device/dtype pair are unusable (before any work)."""
    from .progress import ProgressBar

    sweep = dict(QUICK_SWEEP) if args.quick else {"seq_len": AUDIT_SEQ_LEN}
    try:
        model, label = _load_model(args)
    except (ImportError, OSError, KeyError, TypeError, ValueError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"batchinv audit: error: {message}", file=sys.stderr)
        return 2
    bar = None
    progress = None
    if not args.no_progress:
        total = count_cases(**sweep) * len(AUDIT_PATHS)
        bar = ProgressBar(total)

        def progress(label: str, _done: int) -> None:
            bar.advance(label)

    try:
        result = run_audit(model, seed=args.seed, model_label=label, progress=progress, **sweep)
    finally:
        if bar is not None:
            bar.close()
    print(format_audit(result))
    if args.json:
        print(f"JSON written to {write_json(result, args.json)}")
    return 0 if result.passed else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchinv audit", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
