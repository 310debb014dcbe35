"""A parity run stopped by its time limit (SIGTERM) still writes the report of the tests that
ran, with pytest's interrupted status and the test it stopped in marked "interrupted": a part
cut short keeps its evidence."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
_STARTED = "BATCHINV_SIGTERM_STARTED"  # set only in the run the driver test starts


def test_a_quick_test_before_the_stop():
    if not os.environ.get(_STARTED):
        pytest.skip("part of test_a_run_stopped_by_sigterm_writes_its_report")


def test_waits_for_the_stop():
    marker = os.environ.get(_STARTED)
    if not marker:
        pytest.skip("part of test_a_run_stopped_by_sigterm_writes_its_report")
    Path(marker).write_text("started")
    time.sleep(60)


def test_a_run_stopped_by_sigterm_writes_its_report(tmp_path):
    report, marker = tmp_path / "part.json", tmp_path / "started"
    module = str(TESTS / "test_parity_report_on_sigterm.py")
    ids = [f"{module}::test_a_quick_test_before_the_stop", f"{module}::test_waits_for_the_stop"]
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", *ids, "-q", "-p", "no:cacheprovider"]
        + ["--parity-report", str(report)],
        cwd=TESTS.parent,
        env={**os.environ, _STARTED: str(marker)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while not marker.exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), run.communicate()[0].decode()[-2000:]
    run.send_signal(signal.SIGTERM)
    output = run.communicate(timeout=60)[0].decode()
    assert run.returncode == 2, output[-2000:]  # pytest's "interrupted"
    written = json.loads(report.read_text())
    assert written["pytest_exit_status"] == 2
    assert [(t["id"].split("::")[-1], t["outcome"]) for t in written["tests"]] == [
        ("test_a_quick_test_before_the_stop", "passed"),
        ("test_waits_for_the_stop", "interrupted"),  # stopped inside: not a pass
    ]
