"""A one-line progress bar with ETA on stderr."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str):
        self.total, self.label, self.done = total, label, 0
        self.start = self.last = time.monotonic()

    def step(self, n: int = 1, note: str = "") -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last < 0.5 and self.done < self.total:
            return
        self.last = now
        rate = self.done / max(now - self.start, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else 0
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        sys.stderr.write(f"\r[{self.label}] [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"ETA {eta:5.0f}s {note[:60]:<60}")
        if self.done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()
