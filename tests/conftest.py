"""Shared pytest setup: GPU tests are marked ``cuda`` and need a GPU plus built kernels."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--shard")
    if spec:
        _keep_shard(config, items, spec)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run `nox -s cuda_parity` on one)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_remembered_signatures():
    """Each test starts with no op signature remembered (``batchinv.ops._checked``), so a test
    that swaps registry entries before its calls sees its swap."""
    from batchinv.ops import _checked

    _checked.clear_all()


# --- the cuda_parity report -------------------------------------------------------------
# `pytest --parity-report PATH` writes what ran where: commit, GPU, driver, versions and
# every test's outcome.  `nox -s cuda_parity` uses it; the JSON is committed under reports/.


def pytest_configure(config):
    if config.getoption("--parity-report"):
        _interrupt_on_sigterm()


def _interrupt_on_sigterm() -> None:
    """A time limit (``timeout``) ends a parity run with SIGTERM, which would kill pytest before
    it writes the report.  Taken as an interrupt instead, pytest stops after the running test
    and still writes the report of every test that ran (exit status 2, interrupted)."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def pytest_addoption(parser):
    parser.addoption("--parity-report", default=None, help="write a JSON report of this run here")
    parser.addoption(
        "--shard",
        default=None,
        metavar="K/N",
        help="run only the K-th of N contiguous parts of the collected tests (tests/_shards.py)",
    )


def _keep_shard(config, items, spec: str) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _shards import parse_shard, shard_bounds

    try:
        k, n = parse_shard(spec)
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
    lo, hi = shard_bounds(len(items), k, n)
    config.hook.pytest_deselected(items=items[:lo] + items[hi:])
    items[:] = items[lo:hi]


_OUTCOMES: dict[str, dict] = {}


def pytest_runtest_logreport(report):
    # "interrupted" until the call phase reports: a run stopped inside a test (its time limit)
    # records that test as interrupted, not as passed.
    entry = _OUTCOMES.setdefault(report.nodeid, {"outcome": "interrupted", "duration_s": 0.0})
    entry["duration_s"] = round(entry["duration_s"] + report.duration, 4)
    if report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
    elif report.skipped:
        entry["outcome"] = "skipped"
        entry["reason"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
    elif report.when == "call" and entry["outcome"] == "interrupted":
        entry["outcome"] = "passed"


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--parity-report")
    if not path:
        return
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _parity_report import write_report

    write_report(path, _OUTCOMES, int(exitstatus))
