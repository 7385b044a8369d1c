"""Shared-memory tile layouts the tensor-core kernels share (templates/common/mma.cuh's Tile,
wgmma.cuh's Atoms), mirrored in Python so the bank model sees the addresses the kernels use.
Families import them; the layouts know nothing of any family."""
from __future__ import annotations

from . import banks

CHUNK = 16                        # bytes: one cp.async / one ldmatrix row


def pitch(d: int, swizzle: int) -> int:
    """Elements between rows of a shared tile (mma.cuh, Tile::PITCH)."""
    return d if swizzle else d + 8


def tile_offset(row: int, col: int, d: int, swizzle: int) -> int:
    """Element offset of (row, col) in a shared tile: the mirror of mma.cuh's Tile::offset."""
    if not swizzle:
        return row * (d + 8) + col
    chunk = col // 8
    return row * d + ((chunk & ~7) | ((chunk ^ row) & 7)) * 8 + col % 8


def layout(d: int, swizzle: int):
    """(row, col) -> element offset in a shared tile of rows d wide (mma.cuh's Tile::offset)."""
    return lambda row, col: tile_offset(row, col, d, swizzle)


def plain_layout(d: int):
    """Rows d wide with neither padding nor swizzle: what the layout choice is measured against."""
    return lambda row, col: row * d + col


def bank_accesses(d: int, threads: int, offset, buffers: tuple = ()) -> list:
    """The warp accesses of a shared tile of rows d wide at element offsets `offset(row, col)`:
    ldmatrix row reads (A operand of Q, B operands of K and V: each phase reads 8 rows at one
    chunk), the cp.async fill (consecutive chunks of consecutive rows), the epilogue's 4-byte
    fragment writes (lane g, t: row g, cols 2t) and its 16-byte row reads (as the fill)."""
    def ldmatrix(lane, _pad):
        return offset((lane & 7) + (lane >> 4) * 8, ((lane >> 3) & 1) * 8) * 2

    chunks = d // 8

    def rows(lane, _pad):
        return offset(lane // chunks, lane % chunks * 8) * 2

    def fragment_write(lane, _pad):
        return offset(lane // 4, lane % 4 * 2) * 2

    return [banks.Access("ldmatrix", CHUNK, ldmatrix, buffers), banks.Access("cp_async_fill", CHUNK, rows, buffers),
            banks.Access("o_fragment_write", 4, fragment_write, buffers[:1]),
            banks.Access("o_row_read", CHUNK, rows, buffers[:1])]


def atoms_offset(row: int, col: int, rows: int) -> int:
    """Element offset in a tile of 128-byte-swizzled atoms (wgmma.cuh, Atoms::offset)."""
    return (col // 64) * rows * 64 + row * 64 + (((col // 8) % 8) ^ (row % 8)) * 8 + col % 8


def atoms_layout(rows: int):
    return lambda row, col: atoms_offset(row, col, rows)


def atoms_bank_accesses(d: int, rows: int, staged_epilogue: bool = True, offset=None) -> list:
    """Warp accesses of the wgmma kernels' tiles by threads (wgmma reads them itself, and TMA
    writes them, through the 128-byte swizzle they are built for; neither goes through the
    banks as thread accesses): the cp.async fill and, where the epilogue stages its rows in the
    Q tile (`hopper`, not `hopper_ws`, which stores from registers), its writes and row reads.
    `offset` replaces the atoms (the unswizzled comparison)."""
    accesses = bank_accesses(d, 128, offset or atoms_layout(rows), ("q_tile", "kv_ring"))
    keep = ("cp_async_fill", "o_fragment_write", "o_row_read") if staged_epilogue else ("cp_async_fill",)
    return [a for a in accesses if a.name in keep]
