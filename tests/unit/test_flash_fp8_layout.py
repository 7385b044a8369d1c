"""The fp8 forward's P V (forward_ws.cu.j2, FP8) packs each thread's fp32 weights into 8-bit A
fragments as they sit in the accumulator, and V^T (values_t_kernel) stores each 32-key block's
keys in the order that leaves. This holds the three layouts to each other: the accumulator of
wgmma (an mma.m16n8 C fragment per 8 columns), the 8-bit A fragment of wgmma k32 (PTX ISA,
"Register Fragments": register r, byte i of lane l is row l / 4 + 8 (r % 2), column 4 (l % 4) +
16 (r / 2) + i), and the kernel's packing and V^T permutation, restated here."""


def accumulator(lane: int, tile: int, e: int) -> tuple[int, int]:
    """(row, key) of score s[0][tile][e] of `lane`: rows g, g + 8; columns 2t, 2t + 1 of each 8-key tile."""
    return lane // 4 + 8 * (e >= 2), 8 * tile + 2 * (lane % 4) + (e & 1)


def a_fragment(lane: int, r: int, i: int) -> tuple[int, int]:
    """(row, k) of byte i of register r of an 8-bit wgmma A fragment (k within the k-step's 32)."""
    return lane // 4 + 8 * (r % 2), 4 * (lane % 4) + 16 * (r // 2) + i


def packed(kn: int, r: int, i: int) -> tuple[int, int]:
    """(tile, e) of the score pack_fp8_weights (and EXP16's pairs) put in byte i of register r of
    k-step kn: registers 0 / 1 take rows g / g + 8 of tiles 4 kn, 4 kn + 1, registers 2 / 3 of
    tiles 4 kn + 2, 4 kn + 3; two bytes from each tile."""
    return 4 * kn + 2 * (r // 2) + i // 2, 2 * (r % 2) + (i & 1)


def value_key(col: int) -> int:
    """The key values_t_kernel stores at V^T column `col`."""
    j = col % 32
    return col - j + (j & 16) + ((j >> 1) & 1) * 8 + ((j >> 2) & 3) * 2 + (j & 1)


def test_v_t_columns_are_a_permutation_of_each_32_key_block():
    for block in range(4):
        cols = range(32 * block, 32 * block + 32)
        assert sorted(value_key(c) for c in cols) == list(cols)


def test_every_packed_weight_meets_its_own_value_row():
    """P V sums weight (row, k) times V^T column 32 kn + k: that column must hold the key whose
    score the kernel packed there, for the same row."""
    for kn in range(4):   # 128-key tiles
        for lane in range(32):
            for r in range(4):
                for i in range(4):
                    row, k = a_fragment(lane, r, i)
                    score_row, key = accumulator(lane, *packed(kn, r, i))
                    assert score_row == row
                    assert value_key(32 * kn + k) == key


def test_each_lane_packs_only_its_own_scores():
    """No shuffles: a register's bytes come from the lane's own accumulator (the packed tiles
    exist and each score is used once per k-step)."""
    for kn in range(4):
        used = {packed(kn, r, i) for r in range(4) for i in range(4)}
        assert used == {(tile, e) for tile in range(4 * kn, 4 * kn + 4) for e in range(4)}
