"""Which source a GPU result was produced from, for the committed reports and benchmarks.

A result names a commit only when it can be sure of it: ``BATCHINV_GIT_COMMIT`` when the caller
sets it (a copy of the tree without ``.git``, as the GPU machines get), else ``git rev-parse
HEAD`` of the checkout that holds ``project_root`` -- and only if that checkout's top level IS
``project_root`` (a copy staged inside another checkout would otherwise name that checkout's
commit), with ``+dirty`` when tracked files differ from it.  Otherwise ``None``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

__all__ = ["source_commit"]


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=True, timeout=30
        )
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip()


def source_commit(project_root: str | os.PathLike) -> str | None:
    """The commit results from ``project_root`` were produced at, or None if unknown."""
    if commit := os.environ.get("BATCHINV_GIT_COMMIT"):
        return commit
    root = Path(project_root).resolve()
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root:
        return None
    head = _git(root, "rev-parse", "HEAD")
    if not head:
        return None
    changed = _git(root, "status", "--porcelain", "--untracked-files=no")
    return head + ("+dirty" if changed else "")
