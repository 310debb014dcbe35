"""``--shard K/N`` (tests/_shards.py): N parts that cover the collected tests exactly once."""

import subprocess
import sys
from pathlib import Path

import pytest

from _shards import parse_shard, shard_bounds

TESTS = Path(__file__).parent


@pytest.mark.parametrize("total", [0, 1, 5, 7, 100])
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_parts_cover_every_index_once_in_order(total, n):
    covered = []
    for k in range(1, n + 1):
        lo, hi = shard_bounds(total, k, n)
        covered += range(lo, hi)
    assert covered == list(range(total))


@pytest.mark.parametrize("spec", ["0/2", "3/2", "1", "a/b", "1/2/3", "-1/2", ""])
def test_a_bad_shard_is_an_error_naming_the_option(spec):
    with pytest.raises(ValueError, match="--shard"):
        parse_shard(spec)


def _collected(*args):
    run = subprocess.run(
        [sys.executable, "-m", "pytest", str(TESTS / "test_shards.py"), "--collect-only", "-q"]
        + ["-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
        cwd=TESTS.parent,
    )
    return run.returncode, [line for line in run.stdout.splitlines() if "::" in line]


def test_pytest_runs_each_test_in_exactly_one_of_the_parts():
    _, everything = _collected()
    parts = [_collected("--shard", f"{k}/3")[1] for k in (1, 2, 3)]
    assert all(parts)
    assert sum(parts, []) == everything


def test_pytest_refuses_a_bad_shard():
    code, _ = _collected("--shard", "4/3")
    assert code != 0
