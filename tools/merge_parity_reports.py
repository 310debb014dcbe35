"""Merges cuda_parity reports of one tree run in parts (for example ``tests/gpu`` and the rest,
where one machine session cannot run the whole suite) into one report.

    python tools/merge_parity_reports.py [--reruns] OUT.json PART.json [PART.json ...]

The parts must name the same commit, build, versions and card model; a test id in two parts
is an error.  The merged report keeps each part's date and pytest exit status under
``parts`` and sums the outcomes.

``--reruns``: the parts may name different commits of one branch (tests re-run after a fix,
or a part a time limit cut short run again on a later commit).  They are taken in date order,
a test in a later part replaces its earlier entry, every test entry names the commit it ran
at, ``commit`` is the newest part's and ``parts`` lists each part's commit and test count; the
exit status is that of the outcomes kept (1 if any failed or errored, else 2 if a test is
"interrupted": a part's time limit stopped it, see ``tests/conftest.py``).  A part may be a
merged report itself (the committed one, with re-runs to add): its entries keep the commits
they name and its parts are listed in its place.  What changed between the commits must be said
where the report is described (``reports/README.md``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SAME = ("commit", "build", "versions")
FAILED = ("failed", "error")


def merge(parts: list[dict], *, reruns: bool = False) -> dict:
    if not parts:
        raise ValueError("no reports given")
    if reruns:
        parts = sorted(parts, key=lambda part: part["date_utc"])
    first = parts[0]
    same = [key for key in SAME if not (reruns and key == "commit")]
    for i, part in enumerate(parts[1:], start=1):
        for key in same:
            if part[key] != first[key]:
                raise ValueError(f"part {i} has another {key}: {part[key]!r} vs {first[key]!r}")
        if part["gpu"]["name"] != first["gpu"]["name"]:
            raise ValueError(f"part {i} ran on {part['gpu']['name']}, not {first['gpu']['name']}")
    tests: dict[str, dict] = {}
    for part in parts:
        for entry in part["tests"]:
            if entry["id"] in tests and not reruns:
                raise ValueError(f"{entry['id']} is in two parts")
            # An entry of a merged report already names the commit it ran at.
            commit = entry.get("commit", part["commit"])
            tests[entry["id"]] = {**entry, "commit": commit} if reruns else entry
    summary: dict[str, int] = {}
    for entry in tests.values():
        summary[entry["outcome"]] = summary.get(entry["outcome"], 0) + 1
    if reruns:  # 1 for a failure kept, else 2 for a test a time limit stopped in, else 0
        status = 1 if any(summary.get(outcome) for outcome in FAILED) else 0
        status = status or (2 if summary.get("interrupted") else 0)
    else:
        status = max((part["pytest_exit_status"] for part in parts), key=abs)
    described = []
    for part in parts:
        if reruns and "parts" in part:  # a merged report: its own parts
            described.extend(part["parts"])
            continue
        entry = {"date_utc": part["date_utc"], "pytest_exit_status": part["pytest_exit_status"]}
        if reruns:
            entry.update(commit=part["commit"], tests=len(part["tests"]))
        described.append(entry)
    return {
        **{key: first[key] for key in ("gpu", "versions", "build")},
        "commit": parts[-1]["commit"],
        "date_utc": max(part["date_utc"] for part in parts),
        "pytest_exit_status": status,
        "parts": described,
        "summary": summary,
        "tests": [tests[key] for key in sorted(tests)],
    }


def main(argv: list[str]) -> int:
    reruns = "--reruns" in argv
    argv = [arg for arg in argv if arg != "--reruns"]
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    out, *paths = argv
    try:
        merged = merge([json.loads(Path(p).read_text()) for p in paths], reruns=reruns)
    except (OSError, ValueError, KeyError) as exc:
        print(f"merge_parity_reports: {exc}", file=sys.stderr)
        return 1
    Path(out).write_text(json.dumps(merged, indent=1) + "\n")
    print(f"{out}: {merged['summary']} from {len(paths)} parts")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
