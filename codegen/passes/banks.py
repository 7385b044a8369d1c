"""Shared-memory bank-conflict model and the padding it chooses.

Hopper shared memory has 32 banks of 4 bytes. Lanes reading the same word share it
(broadcast); distinct words in one bank are serialized. The cost of an access is its number of
wavefronts. As measured on the H100 (Nsight Compute's per-instruction counts,
bench/results/h100/bank_check.md): 4-byte and 8-byte accesses are served for the whole warp
at once, so they take as many wavefronts as the bank holding the most distinct words (an
8-byte read of two addresses: 1; of 256 contiguous bytes: 2); 16-byte accesses are served a
quarter-warp (8 lanes) at a time, at least one wavefront per quarter with active lanes.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from . import Rejected

BANKS = 32
WORD = 4


def _lanes_per_phase(width: int) -> int:
    """Lanes a shared-memory request serves in one phase: 128 bytes' worth for 8- and 16-byte
    accesses (a half-warp of 8-byte lanes; ncu counted a float2 fragment write whose two
    half-warps each hit 2 ways at 4 wavefronts, where all 32 lanes together touch each bank twice,
    bench/results/h200/ncu_rwkv7_grad_sass_64ba626.csv.gz), the whole warp for narrower ones."""
    return 128 // width if width > 4 else 32


def wavefronts(addresses: list, width: int) -> int:
    """Wavefronts for one warp-wide access; `addresses` holds one byte address per lane
    (None for an inactive lane), `width` is the bytes each lane accesses (4, 8 or 16)."""
    per_phase = _lanes_per_phase(width)
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
    """The wavefronts a conflict-free access of these lanes takes: one per phase with active
    lanes, and at least the distinct bytes over 128 (an 8-byte access of 32 distinct lanes: 2)."""
    per_phase = _lanes_per_phase(width)
    phases = sum(1 for start in range(0, len(addresses), per_phase)
                 if any(a is not None for a in addresses[start:start + per_phase]))
    distinct = {a for a in addresses if a is not None}
    return max(phases, -(-len(distinct) * width // (BANKS * WORD)))


@dataclass(frozen=True)
class Access:
    """One warp-wide shared-memory access pattern; `address(lane, pad)` gives bytes (None for a
    lane that sits out). `name` is the tag on the template lines that make it (`// smem: name`),
    `buffers` the shared buffers it touches (`// smem buffer: name` where they are carved out)."""

    name: str
    width: int
    address: Callable[[int, int], int | None]
    buffers: tuple = ()

    def cost(self, pad: int) -> int:
        return wavefronts([self.address(lane, pad) for lane in range(32)], self.width)

    def ideal(self, pad: int) -> int:
        return max(1, active_phases([self.address(lane, pad) for lane in range(32)], self.width))


def model(chosen: list[Access], pad: int = 0, unpadded: list[Access] | None = None,
          candidates: list = ()) -> dict:
    """The bank model of one instance, per declared access: bytes per lane, the wavefronts one
    warp request takes at the layout the instance uses, the conflict-free ideal (one per phase
    with active lanes), the same access without the padding or swizzle (`unpadded`, at pad 0),
    and the worst over the layouts the knob could have chosen (`candidates`: (accesses, pad)
    pairs). Without `unpadded`, the chosen accesses at pad 0 are the unpadded layout."""
    plain = {a.name: a.cost(0) for a in (unpadded if unpadded is not None else chosen)}
    layouts = [(chosen, pad), (unpadded if unpadded is not None else chosen, 0), *candidates]
    out = {}
    for a in chosen:
        costs = [alt.cost(alt_pad) for accesses, alt_pad in layouts for alt in accesses if alt.name == a.name]
        out[a.name] = {"buffers": list(a.buffers), "width": a.width, "wavefronts": a.cost(pad),
                       "ideal": a.ideal(pad), "unpadded": plain.get(a.name, a.cost(0)), "worst": max(costs)}
    return out


def ways(record: dict, field: str = "wavefronts") -> dict:
    """Wavefronts per request over the conflict-free ideal, per access of a model() record (1: no
    conflict; below 1: lanes of a phase share words, a broadcast)."""
    return {name: r[field] / r["ideal"] for name, r in record.items()}


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


def output_tile_pad(pad, accesses: list[Access], read_floats: int):
    """A spec's `pad` of the output tile: "auto" chooses it from the accesses (choose_pad);
    a number must keep the tile's `read_floats`-float reads aligned."""
    if pad == "auto":
        return choose_pad(accesses, unit=read_floats)
    if pad % read_floats:
        raise Rejected("pad", f"pad={pad} breaks the {read_floats * 4}-byte alignment of output-tile reads")
    return pad


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

    return [Access("o_write", WORD, write, ("o_tiles",)), Access("o_read", read_floats * WORD, read, ("o_tiles",))]


def contiguous(name: str, width: int, buffers: tuple) -> Access:
    """Lane i at byte i * width: a row copied by consecutive threads (fills, staging)."""
    return Access(name, width, lambda lane, _pad: lane * width, buffers)


def fragment(pitch: int, unit: int) -> Callable[[int, int], int]:
    """The address of an mma C fragment's pair: lane (g, t) at row g, column 2 t of a tile of
    `pitch` units a row, `unit` bytes a unit (a fragment's float2s, or its packed 16-bit pairs)."""
    return lambda lane, _pad: ((lane // 4) * pitch + 2 * (lane % 4)) * unit


def fragment_pitch(cols: int) -> int:
    """Floats between the rows of an fp32 tile that mma C fragments write or read as float2s:
    the fewest past `cols` that are 8 or 24 words (mod 32), so the four rows a half-warp of
    8-byte lanes covers in one phase fall on distinct banks (cols + 4, 4 words mod 32, put rows
    g and g + 1 on the same banks: 2 ways)."""
    return cols + (8 - cols) % 16


def broadcast(name: str, width: int, buffers: tuple) -> Access:
    """Every lane at the same address: one word the whole warp reads."""
    return Access(name, width, lambda _lane, _pad: 0, buffers)


def padding_candidates(accesses: list[Access], unit: int, limit: int = 32) -> list:
    """The (accesses, pad) layouts choose_pad considers: the worst of them is what a careless
    padding would cost."""
    return [(accesses, pad) for pad in range(0, limit, unit)]


# The templates name each shared-memory access on the lines that make it (`// smem: o_read`)
# and each shared buffer where it is carved out (`// smem buffer: o_tiles`): the model's
# declarations are checked against these tags (tests/unit/test_bank_tags.py), and the hardware
# check (bench/bank_check.py) attributes each shared-memory instruction to its access through
# the line table.
ACCESS_TAG = re.compile(r"\bsmem: (\w+)")
BUFFER_TAG = re.compile(r"\bsmem buffer: (\w+)")


def tags(text: str, pattern=ACCESS_TAG) -> dict:
    """{line number (1-based): tag} of a source text."""
    out = {}
    for number, line in enumerate(text.splitlines(), 1):
        m = pattern.search(line)
        if m:
            out[number] = m.group(1)
    return out
