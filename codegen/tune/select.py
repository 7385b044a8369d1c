"""Choosing a winner per bucket from measurements. Pure: testable with any cost function.

A candidate must beat the runner-up by more than the measured spread (the larger of the
two); otherwise the simpler candidate wins, so tables do not churn between runs."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Measurement:
    name: str
    median_ms: float      # median over repeats (inf: failed to build, launch or verify)
    spread_ms: float      # max - min of the repeats' medians
    simplicity: tuple     # smaller is simpler
    note: str = ""

    @property
    def ok(self) -> bool:
        return math.isfinite(self.median_ms)


@dataclass(frozen=True)
class Choice:
    winner: Measurement
    runner_up: Measurement | None
    tied: tuple           # names within the spread of the fastest (the winner among them)


def choose(measurements: list[Measurement]) -> Choice | None:
    ok = sorted((m for m in measurements if m.ok), key=lambda m: (m.median_ms, m.simplicity))
    if not ok:
        return None
    fastest = ok[0]
    tied = [m for m in ok if m.median_ms - fastest.median_ms <= max(m.spread_ms, fastest.spread_ms)]
    winner = min(tied, key=lambda m: m.simplicity)
    others = [m for m in ok if m.name != winner.name]
    return Choice(winner, others[0] if others else None, tuple(sorted(m.name for m in tied)))
