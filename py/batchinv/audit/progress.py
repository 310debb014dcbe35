"""A one-line progress bar on stderr (no dependency): ``[#####.....] 12/58 label``."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """Redraws one line with ``\\r``; on a non-terminal stream, prints a line every 10%."""

    def __init__(self, total: int, *, stream: TextIO | None = None, width: int = 30):
        self.total = max(total, 1)
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.done = 0
        self.start = time.perf_counter()
        self._interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_decile = -1

    def advance(self, label: str) -> None:
        self.done = min(self.done + 1, self.total)
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        line = f"[{bar}] {self.done}/{self.total} {elapsed:5.1f}s {label}"
        if self._interactive:
            self.stream.write("\r" + line[:100].ljust(100))
            self.stream.flush()
            return
        decile = 10 * self.done // self.total
        if decile != self._last_decile:
            self._last_decile = decile
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._interactive:
            self.stream.write("\n")
            self.stream.flush()
