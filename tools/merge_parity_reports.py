"""Merges cuda_parity reports of one tree run in parts (for example ``tests/gpu`` and the rest,
where one machine session cannot run the whole suite) into one report.

    python tools/merge_parity_reports.py OUT.json PART.json [PART.json ...]

The parts must name the same commit, build, versions and card model; a test id in two parts
is an error.  The merged report keeps each part's date and pytest exit status under
``parts`` and sums the outcomes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SAME = ("commit", "build", "versions")


def merge(parts: list[dict]) -> dict:
    if not parts:
        raise ValueError("no reports given")
    first = parts[0]
    for i, part in enumerate(parts[1:], start=1):
        for key in SAME:
            if part[key] != first[key]:
                raise ValueError(f"part {i} has another {key}: {part[key]!r} vs {first[key]!r}")
        if part["gpu"]["name"] != first["gpu"]["name"]:
            raise ValueError(f"part {i} ran on {part['gpu']['name']}, not {first['gpu']['name']}")
    tests: dict[str, dict] = {}
    for part in parts:
        for entry in part["tests"]:
            if entry["id"] in tests:
                raise ValueError(f"{entry['id']} is in two parts")
            tests[entry["id"]] = entry
    summary: dict[str, int] = {}
    for entry in tests.values():
        summary[entry["outcome"]] = summary.get(entry["outcome"], 0) + 1
    statuses = [part["pytest_exit_status"] for part in parts]
    return {
        **{key: first[key] for key in ("commit", "gpu", "versions", "build")},
        "date_utc": max(part["date_utc"] for part in parts),
        "pytest_exit_status": max(statuses, key=abs),
        "parts": [
            {"date_utc": p["date_utc"], "pytest_exit_status": p["pytest_exit_status"]}
            for p in parts
        ],
        "summary": summary,
        "tests": [tests[key] for key in sorted(tests)],
    }


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    out, *paths = argv
    try:
        merged = merge([json.loads(Path(p).read_text()) for p in paths])
    except (OSError, ValueError, KeyError) as exc:
        print(f"merge_parity_reports: {exc}", file=sys.stderr)
        return 1
    Path(out).write_text(json.dumps(merged, indent=1) + "\n")
    print(f"{out}: {merged['summary']} from {len(paths)} parts")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
