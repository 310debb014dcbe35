"""The ``batchinv`` command line.

``batchinv audit``: the contract's transform sweep (T1-T7) on a Qwen3 model -- by default
the built-in tiny configuration with random weights, on CUDA when present (then also a
production-shaped run) and on the CPU otherwise -- comparing stock PyTorch with batchinv;
exit code 1 if batchinv breaks invariance anywhere.  ``batchinv demo`` is an alias of
``batchinv audit``.

``batchinv fingerprint``: the SHA-256 of every output of a fixed, seeded set of inputs per op
and for a whole Qwen3 on this card (``batchinv.fingerprint``); ``--paths`` also compares the
code paths other cards take.

``batchinv rl-check``: samples with changing decode batches, recomputes the logprobs as a
trainer does, and reports how far each path is off-policy (``batchinv.rl_check``).

Exit codes mean one thing each, for every subcommand:

- 0: the check passed;
- 1: batchinv broke invariance (or is off-policy): the finding the command exists for;
- 2: bad input or an environment that cannot run -- a bad argument, a missing or corrupt
  checkpoint, a device or dtype that cannot run, an output path that cannot be written --
  found before any work starts;
- 3: an internal error: a one-line summary on stderr, the traceback with ``--debug``.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

EXIT_PASS = 0
EXIT_INVARIANCE_BROKEN = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL_ERROR = 3

# Options naming a file the command writes: checked before any work.
_OUTPUT_OPTIONS = ("json", "png")


def check_writable(path: str, option: str) -> None:
    """Raises ``ValueError`` naming ``option`` when no file can be written at ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{option} {path!r}: is a directory, not a file")
    if not os.path.isdir(directory):
        raise ValueError(f"{option} {path!r}: the directory {directory!r} does not exist")
    if not os.access(directory, os.W_OK):
        raise ValueError(f"{option} {path!r}: the directory {directory!r} is not writable")


def _debug_option(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument(
        "--debug",
        action="store_true",
        default=default,
        help="print the traceback of an internal error (exit code 3)",
    )


def _parser() -> argparse.ArgumentParser:
    from . import audit, fingerprint, rl_check

    parser = argparse.ArgumentParser(
        prog="batchinv",
        description=__doc__.splitlines()[2],
        epilog="exit codes: 0 pass, 1 invariance broken, 2 bad input, 3 internal error",
    )
    _debug_option(parser, False)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("audit", "transform sweep on a Qwen3 model: stock PyTorch vs batchinv"),
        ("demo", "alias of audit"),
    ):
        sub = commands.add_parser(name, help=help_text, description=audit.__doc__.splitlines()[0])
        audit.add_arguments(sub)
        sub.set_defaults(run=audit.run)
        _debug_option(sub, argparse.SUPPRESS)  # `batchinv --debug audit` or `audit --debug`
    for name, module, help_text in (
        ("rl-check", rl_check, "sampler vs trainer logprobs: how far off-policy each path is"),
        (
            "fingerprint",
            fingerprint,
            "SHA-256 of every op's outputs on fixed inputs: compare cards bit for bit",
        ),
    ):
        sub = commands.add_parser(name, help=help_text, description=module.__doc__.splitlines()[0])
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
        _debug_option(sub, argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs a subcommand and returns its exit code (argparse itself exits 2 on bad usage)."""
    args = _parser().parse_args(argv)
    prog = f"batchinv {args.command}"
    try:
        for option in _OUTPUT_OPTIONS:
            path = getattr(args, option, None)
            if path:
                check_writable(path, f"--{option}")
    except ValueError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return args.run(args)
    except Exception as err:  # every expected failure returned 2 above or in the command
        if args.debug:
            traceback.print_exc()
        summary = str(err).strip().splitlines()[0] if str(err).strip() else ""
        hint = "" if args.debug else " (run with --debug for the traceback)"
        print(
            f"{prog}: internal error: {type(err).__name__}: {summary}{hint}",
            file=sys.stderr,
        )
        return EXIT_INTERNAL_ERROR


if __name__ == "__main__":
    sys.exit(main())
