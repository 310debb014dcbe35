"""The ``batchinv`` command line.

``batchinv audit``: the contract's transform sweep (T1-T7) on a Qwen3 model -- by default
the built-in tiny configuration with random weights, on CUDA when present and on the CPU
otherwise -- comparing stock PyTorch with batchinv; exit code 1 if batchinv breaks
invariance anywhere.  ``batchinv demo`` is an alias of ``batchinv audit``.

``batchinv rl-check``: samples with changing decode batches, recomputes the logprobs as a
trainer does, and reports how far each path is off-policy (``batchinv.rl_check``).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from . import audit, rl_check

    parser = argparse.ArgumentParser(prog="batchinv", description=__doc__.splitlines()[2])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("audit", "transform sweep on a Qwen3 model: stock PyTorch vs batchinv"),
        ("demo", "alias of audit"),
    ):
        sub = commands.add_parser(name, help=help_text, description=audit.__doc__.splitlines()[0])
        audit.add_arguments(sub)
        sub.set_defaults(run=audit.run)
    sub = commands.add_parser(
        "rl-check",
        help="sampler vs trainer logprobs: how far off-policy each path is",
        description=rl_check.__doc__.splitlines()[0],
    )
    rl_check.add_arguments(sub)
    sub.set_defaults(run=rl_check.run)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
