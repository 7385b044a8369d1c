"""Shared-memory bank-conflict model and the padding it chooses.

Hopper shared memory has 32 banks of 4 bytes. A warp's access is served in phases: 32 lanes
per phase for 4-byte accesses, 16 for 8-byte, 8 for 16-byte. Within a phase, lanes reading
the same word share it (broadcast); distinct words in one bank are serialized. The cost of
an access is its number of wavefronts; the ideal is one per phase.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

BANKS = 32
WORD = 4


def wavefronts(addresses: list, width: int) -> int:
    """Wavefronts for one warp-wide access; `addresses` holds one byte address per lane
    (None for an inactive lane), `width` is the bytes each lane accesses (4, 8 or 16)."""
    per_phase = 32 * WORD // max(width, WORD) if width > WORD else 32
    total = 0
    for start in range(0, len(addresses), per_phase):
        banks = defaultdict(set)
        for addr in addresses[start:start + per_phase]:
            if addr is None:
                continue
            for word in range(addr // WORD, (addr + width - 1) // WORD + 1):
                banks[word % BANKS].add(word)
        total += max((len(words) for words in banks.values()), default=0)
    return total


def ideal(width: int) -> int:
    """Wavefronts of a conflict-free access of a full warp: one per phase."""
    return max(1, width // WORD)


def active_phases(addresses: list, width: int) -> int:
    """Phases with at least one active lane: the wavefronts a conflict-free access takes when
    some lanes sit out (a row narrower than the lanes that split it)."""
    per_phase = 32 * WORD // max(width, WORD) if width > WORD else 32
    return sum(1 for start in range(0, len(addresses), per_phase)
               if any(a is not None for a in addresses[start:start + per_phase]))


@dataclass(frozen=True)
class Access:
    """One warp-wide shared-memory access pattern; `address(lane, pad)` gives bytes."""

    name: str
    width: int
    address: Callable[[int, int], int | None]

    def cost(self, pad: int) -> int:
        return wavefronts([self.address(lane, pad) for lane in range(32)], self.width)


def conflict_ways(accesses: list[Access], pad: int) -> dict:
    """Wavefronts per request over the conflict-free ideal of the lanes that take part (1: no
    conflict; below 1: lanes of a phase share words, a broadcast)."""
    out = {}
    for a in accesses:
        addresses = [a.address(lane, pad) for lane in range(32)]
        out[a.name] = wavefronts(addresses, a.width) / max(1, active_phases(addresses, a.width))
    return out


def choose_pad(accesses: list[Access], unit: int, limit: int = 32) -> int:
    """Smallest padding (a multiple of `unit` elements, below `limit`) that minimizes the
    total wavefronts of the accesses to one buffer."""
    best_pad, best_cost = 0, None
    for pad in range(0, limit, unit):
        cost = sum(a.cost(pad) for a in accesses)
        if best_cost is None or cost < best_cost:
            best_pad, best_cost = pad, cost
    return best_pad


def output_tile_accesses(cols: int, mpt: int, tph: int, vec: int, read_floats: int) -> list[Access]:
    """The two accesses to the fp32 output tile of a reduce-scatter recurrent kernel (row pitch
    `cols + pad`): after the reduce-scatter, lane j of column group g writes (step, column)
    pair j (step-major) of its group; the store loop then reads rows back `vec` columns per
    thread, `read_floats` floats per access."""
    def write(lane, pad):
        group, pair = lane // tph, lane % tph
        return ((pair // mpt) * (cols + pad) + group * mpt + pair % mpt) * WORD

    units_per_row = cols // vec

    def read(lane, pad):
        row, unit = divmod(lane, units_per_row)
        return (row * (cols + pad) + unit * vec) * WORD

    return [Access("o_write", WORD, write), Access("o_read", read_floats * WORD, read)]
