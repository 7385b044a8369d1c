"""Choosing a winner per bucket from measurements. Pure: testable with any cost function.

A candidate must beat the runner-up by more than the noise (the larger of the two);
otherwise the simpler candidate wins, so tables do not churn between runs. The noise is at
least NOISE_FLOOR of the median: the spread of back-to-back repeats underestimates the drift
between runs (two fresh tuning runs on the H100 gave 0.0904 and 0.0902 ms for one candidate
whose repeats spread by 0.0001 ms, and a near-tie flipped).

The spread that counts is the jitter: the smaller gap between the middle repeat and its
neighbours. One repeat thrown off by the host (a launch-bound shape whose CPU side stalled once)
leaves the median and the jitter where they were but can widen max - min tenfold; on the H100
(paged tune, 2 seqs x 8 kv heads) a candidate with repeats near 0.022 and 0.040 ms "tied" the
0.022-ms fastest through its 0.019-ms spread and, being simpler, won at 0.74x the default.

Where the default rules' own pick is among the tied, it wins: a tie with what dispatch does
already is no reason for a rule, and a tied winner of another instance adds a kernel to every
build for nothing (the first flash attention tunes, H200: three rows of 20 went to a simpler
point at 0.998-1.006x the default, two of them instances outside the default grid)."""
from __future__ import annotations

import math
from dataclasses import dataclass

NOISE_FLOOR = 0.005  # relative: 0.5%, above the 0.2-0.3% run-to-run drift measured


@dataclass(frozen=True)
class Measurement:
    name: str
    median_ms: float      # median over repeats (inf: failed to build, launch or verify)
    spread_ms: float      # max - min of the repeats' medians
    simplicity: tuple     # smaller is simpler
    note: str = ""
    jitter_ms: float | None = None  # smaller gap of the middle repeat to a neighbour (None: use the spread)

    @property
    def ok(self) -> bool:
        return math.isfinite(self.median_ms)

    @property
    def noise(self) -> float:
        jitter = self.spread_ms if self.jitter_ms is None else self.jitter_ms
        return max(jitter, NOISE_FLOOR * self.median_ms)


@dataclass(frozen=True)
class Choice:
    winner: Measurement
    runner_up: Measurement | None
    tied: tuple           # names within the spread of the fastest (the winner among them)


def choose(measurements: list[Measurement], default: str | None = None) -> Choice | None:
    """The winner: the default rules' pick (`default`) if tied with the fastest, else the
    simplest of the tied."""
    ok = sorted((m for m in measurements if m.ok), key=lambda m: (m.median_ms, m.simplicity))
    if not ok:
        return None
    fastest = ok[0]
    tied = [m for m in ok if m.median_ms - fastest.median_ms <= max(m.noise, fastest.noise)]
    winner = next((m for m in tied if m.name == default), None) or min(tied, key=lambda m: m.simplicity)
    others = [m for m in ok if m.name != winner.name]
    return Choice(winner, others[0] if others else None, tuple(sorted(m.name for m in tied)))


def combine(per_shape: list[Measurement]) -> Measurement:
    """One candidate's measurements on a bucket's shapes as one score: the geometric mean of its
    medians (each shape weighs the same whatever its size), with its noise the largest relative
    noise of any shape, scaled to that mean. Failed on any shape: failed."""
    first = per_shape[0]
    if len(per_shape) == 1:
        return first
    bad = next((m for m in per_shape if not m.ok), None)
    if bad is not None:
        return Measurement(first.name, math.inf, 0.0, first.simplicity, bad.note)
    mean = math.exp(sum(math.log(m.median_ms) for m in per_shape) / len(per_shape))
    spread = max(m.spread_ms / m.median_ms for m in per_shape) * mean
    jitter = max((m.spread_ms if m.jitter_ms is None else m.jitter_ms) / m.median_ms for m in per_shape) * mean
    return Measurement(first.name, mean, spread, first.simplicity, "; ".join(m.note for m in per_shape if m.note),
                       jitter)

