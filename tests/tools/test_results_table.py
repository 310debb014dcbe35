"""The README's results table and docs/results.md are generated from the benchmark files and
kept in step with them (``tools/results_table.py --check``)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results_table():
    spec = importlib.util.spec_from_file_location("results_table", ROOT / "tools/results_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_tables_match_the_benchmark_files(results_table):
    assert results_table.main(["--check"]) == 0, "run: python tools/results_table.py"


@pytest.fixture
def copy_of_tree(tmp_path):
    shutil.copytree(ROOT / "benchmarks" / "results", tmp_path / "benchmarks" / "results")
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copy(ROOT / "docs" / "results.md", tmp_path / "docs" / "results.md")
    return tmp_path


def test_a_changed_ratio_makes_the_tables_stale(results_table, copy_of_tree):
    path = copy_of_tree / "benchmarks" / "results" / "linear.json"
    data = json.loads(path.read_text())
    data["summary"][0]["ratio"] = 0.123
    path.write_text(json.dumps(data))
    assert results_table.main(["--check", "--root", str(copy_of_tree)]) == 1
    assert results_table.main(["--root", str(copy_of_tree)]) == 0
    assert "0.12x" in (copy_of_tree / "README.md").read_text()
    assert "0.12x" in (copy_of_tree / "docs" / "results.md").read_text()
    assert results_table.main(["--check", "--root", str(copy_of_tree)]) == 0


def test_a_hand_edited_table_is_caught(results_table, copy_of_tree):
    readme = copy_of_tree / "README.md"
    readme.write_text(readme.read_text().replace("| linear |", "| linear (edited) |", 1))
    assert results_table.main(["--check", "--root", str(copy_of_tree)]) == 1


def test_goal_verdicts(results_table):
    files = [
        {
            "name": "x.json",
            "environment": {"gpu": "G", "commit": "abcdef0123"},
            "summary": [
                {"op": "o", "case": "a", "variant": "v", "anchor": "copy", "ratio": 0.95,
                 "goal": 0.9},
                {"op": "o", "case": "b", "variant": "v", "anchor": "copy", "ratio": 0.85,
                 "goal": 0.9},
            ],
        }
    ]  # fmt: skip
    table = results_table.summary_table(files)
    assert "| o | v | copy | 0.85x-0.95x | 0.90x | 1 of 2 | G, `abcdef0` |" in table
