"""Parity reports of one tree run in parts merge into one; parts of other trees do not, unless
merged as re-runs (later parts replace earlier entries, each entry names its commit)."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tool():
    path = ROOT / "tools/merge_parity_reports.py"
    spec = importlib.util.spec_from_file_location("merge_parity_reports", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _part(date: str, status: int, tests: dict[str, str]) -> dict:
    return {
        "commit": "abc1234",
        "date_utc": date,
        "gpu": {"name": "NVIDIA H200", "compute_capability": "9.0"},
        "versions": {"torch": "2.11.0"},
        "build": {"cuda_archs": "90a"},
        "pytest_exit_status": status,
        "summary": {},
        "tests": [{"id": i, "outcome": o, "duration_s": 0.1} for i, o in tests.items()],
    }


def test_parts_merge_with_summed_outcomes_and_the_worst_status(tool):
    a = _part("2026-01-01T00:00:00+00:00", 0, {"t/a.py::x": "passed", "t/a.py::y": "skipped"})
    b = _part("2026-01-01T01:00:00+00:00", 1, {"t/b.py::z": "failed", "t/b.py::w": "passed"})
    merged = tool.merge([a, b])
    assert merged["summary"] == {"passed": 2, "skipped": 1, "failed": 1}
    assert merged["pytest_exit_status"] == 1
    assert merged["date_utc"] == b["date_utc"]
    assert [t["id"] for t in merged["tests"]] == sorted(
        ["t/a.py::x", "t/a.py::y", "t/b.py::z", "t/b.py::w"]
    )
    assert [p["pytest_exit_status"] for p in merged["parts"]] == [0, 1]


@pytest.mark.parametrize(
    "key, value",
    [("commit", "def5678"), ("build", {"cuda_archs": "80"}), ("versions", {"torch": "2.10"})],
)
def test_parts_of_another_tree_are_refused(tool, key, value):
    a = _part("d1", 0, {"t::x": "passed"})
    b = copy.deepcopy(a)
    b["tests"] = [{"id": "t::y", "outcome": "passed"}]
    b[key] = value
    with pytest.raises(ValueError, match=key):
        tool.merge([a, b])


def test_another_card_or_a_test_in_two_parts_is_refused(tool):
    a = _part("d1", 0, {"t::x": "passed"})
    b = _part("d2", 0, {"t::x": "passed"})
    with pytest.raises(ValueError, match="in two parts"):
        tool.merge([a, b])
    c = _part("d2", 0, {"t::y": "passed"})
    c["gpu"]["name"] = "NVIDIA H100"
    with pytest.raises(ValueError, match="H100"):
        tool.merge([a, c])


def test_cli_writes_the_merged_file(tool, tmp_path):
    paths = []
    for i, tests in enumerate(({"t::x": "passed"}, {"t::y": "passed"})):
        path = tmp_path / f"part{i}.json"
        path.write_text(json.dumps(_part(f"d{i}", 0, tests)))
        paths.append(str(path))
    out = tmp_path / "merged.json"
    assert tool.main([str(out), *paths]) == 0
    assert json.loads(out.read_text())["summary"] == {"passed": 2}
    assert tool.main([str(out)]) == 2
    assert tool.main([str(out), str(tmp_path / "missing.json")]) == 1


def test_reruns_replace_earlier_entries_and_name_their_commits(tool):
    a = _part("2026-01-01T01:00:00+00:00", 1, {"t::x": "failed", "t::y": "passed"})
    b = _part("2026-01-01T02:00:00+00:00", 0, {"t::x": "passed", "t::z": "skipped"})
    b["commit"] = "def5678"
    with pytest.raises(ValueError, match="commit"):
        tool.merge([a, b])
    merged = tool.merge([b, a], reruns=True)  # taken in date order, whatever the order given
    assert merged["summary"] == {"passed": 2, "skipped": 1}
    assert merged["pytest_exit_status"] == 0 and merged["commit"] == "def5678"
    commits = {t["id"]: t["commit"] for t in merged["tests"]}
    assert commits == {"t::x": "def5678", "t::y": "abc1234", "t::z": "def5678"}
    assert [(p["commit"], p["tests"]) for p in merged["parts"]] == [("abc1234", 2), ("def5678", 2)]
    c = _part("2026-01-01T03:00:00+00:00", 1, {"t::y": "failed"})
    assert tool.merge([a, b, c], reruns=True)["pytest_exit_status"] == 1  # a later failure stays
    d = _part("2026-01-01T04:00:00+00:00", 2, {"t::y": "passed", "t::w": "interrupted"})
    assert tool.merge([a, b, d], reruns=True)["pytest_exit_status"] == 2
    b["versions"] = {"torch": "2.10"}
    with pytest.raises(ValueError, match="versions"):
        tool.merge([a, b], reruns=True)


def test_a_merged_report_takes_more_reruns_keeping_its_commits_and_parts(tool):
    a = _part("2026-01-01T01:00:00+00:00", 0, {"t::x": "passed", "t::y": "passed"})
    b = _part("2026-01-01T02:00:00+00:00", 0, {"t::x": "passed"})
    b["commit"] = "def5678"
    merged = tool.merge([a, b], reruns=True)
    c = _part("2026-01-01T03:00:00+00:00", 0, {"t::x": "passed", "t::z": "passed"})
    c["commit"] = "9abcdef"
    again = tool.merge([merged, c], reruns=True)
    commits = {t["id"]: t["commit"] for t in again["tests"]}
    assert commits == {"t::x": "9abcdef", "t::y": "abc1234", "t::z": "9abcdef"}
    assert [(p["commit"], p["tests"]) for p in again["parts"]] == [
        ("abc1234", 2),
        ("def5678", 1),
        ("9abcdef", 2),
    ]
    assert again["commit"] == "9abcdef" and again["summary"] == {"passed": 3}


def test_cli_takes_reruns(tool, tmp_path):
    paths = []
    for i, outcome in enumerate(("failed", "passed")):
        part = _part(f"d{i}", int(outcome == "failed"), {"t::x": outcome})
        part["commit"] = f"c{i}"
        path = tmp_path / f"part{i}.json"
        path.write_text(json.dumps(part))
        paths.append(str(path))
    out = tmp_path / "merged.json"
    assert tool.main([str(out), *paths]) == 1
    assert tool.main(["--reruns", str(out), *paths]) == 0
    assert json.loads(out.read_text())["summary"] == {"passed": 1}
