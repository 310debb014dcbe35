"""The ``batchinv`` command line.

``batchinv demo``: shows, on CUDA when present and on the CPU otherwise, that a row's
result from batchinv's ops is bitwise the same whatever batch it is computed in.
"""

from __future__ import annotations

import argparse
import sys

import torch


def _pick_device(requested: str | None) -> torch.device:
    if requested is not None:
        device = torch.device(requested)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda was asked for, but CUDA is not available")
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def demo(args: argparse.Namespace) -> int:
    import batchinv
    from batchinv.contract import bitwise_equal

    device = _pick_device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"batchinv {batchinv.__version__} invariance demo on {where}")
    gen = torch.Generator(device=device).manual_seed(0)
    vocab, hidden = 32000, 1024
    weight = torch.randn(vocab, hidden, device=device, generator=gen).bfloat16()
    probe = torch.randint(0, vocab, (1,), device=device, generator=gen)
    alone = batchinv.embedding(probe, weight)
    failures = 0
    print(f"{'op':<10} {'batch':>5} {'position':>8}  bitwise equal to the row alone")
    for batch in (1, 3, 17, 33, 257):
        for position in sorted({0, batch // 2, batch - 1}):
            ids = torch.randint(0, vocab, (batch,), device=device, generator=gen)
            ids[position] = probe[0]
            same = bitwise_equal(batchinv.embedding(ids, weight)[position : position + 1], alone)
            failures += not same
            print(f"{'embedding':<10} {batch:>5} {position:>8}  {'yes' if same else 'NO'}")
    print("all rows bitwise equal" if failures == 0 else f"{failures} rows differ")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchinv", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="show batch invariance of batchinv's ops")
    demo_parser.add_argument(
        "--device", default=None, help="cpu or cuda (default: cuda if present)"
    )
    demo_parser.set_defaults(run=demo)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
