"""The direct fp8 path of the grouped paged kind reorders the head dim: Q and K agree on a
permuted reduction order, V's columns come out permuted and the merge puts them back. The
lowering mirrors the template's index functions (codegen/families/paged.py) for the bank
model; these tests hold the mirrors to the m16n8k16 fragment layout (mma.cuh's table) and
to the bank pass's verdicts."""
import pytest

from codegen import pipeline
from codegen.families import paged
from codegen.passes import banks


@pytest.mark.parametrize("d", paged.FP8_DIRECT_D)
def test_permutations_are_bijections(d):
    assert sorted(paged.q_column(c, d) for c in range(d)) == list(range(d))
    assert sorted(paged.out_column(c, d) for c in range(d)) == list(range(d))
    touched = sorted(paged.raw_at(r, b, d) for r in range(16) for b in range(d))
    assert touched == list(range(16 * d))   # the swizzle moves chunks within their row


@pytest.mark.parametrize("d", paged.FP8_DIRECT_D)
def test_k_bytes_meet_the_q_columns_of_their_mma_k(d):
    """Lane t's word w of chunk i serves k-step 4i + w: bytes 0, 1 are the MMA's k = 2t, 2t+1
    (B register b0), bytes 2, 3 are k = 2t+8, 2t+9 (b1); the permuted q tile must hold the
    same head-dim element at those columns of that k-step."""
    seen = set()
    for t in range(4):
        for i in range(d // 64):
            for w in range(4):
                for e in range(4):
                    col = paged.k_chunk(t, i, d) * 16 + 4 * w + e
                    k = 2 * t + e if e < 2 else 8 + 2 * t + e - 2
                    assert paged.q_column(col, d) == 16 * (4 * i + w) + k
                    seen.add(col)
    assert seen == set(range(d))


@pytest.mark.parametrize("d", paged.FP8_DIRECT_D)
def test_v_bytes_land_on_their_output_column(d):
    """Lane g's byte b of piece j is column g of output n-tile 16 j + b (b at D 64)."""
    seen = set()
    for g in range(8):
        for j in range(max(1, d // 128)):
            for b in range(8 if d == 64 else 16):
                col = paged.v_byte(g, j, d) + b
                assert paged.out_column(col, d) == (b if d == 64 else 16 * j + b) * 8 + g
                seen.add(col)
    assert seen == set(range(d))


def test_direct_reads_are_conflict_free_at_d128():
    (spec, insts), *_ = [x for x in pipeline.lower(pipeline.expand(pipeline.load())) if x[0].family == "paged"]
    inst = next(i for i in insts if i.kind == "grouped_mma" and i.p["d"] == 128 and i.p["kv_e"] == 4
                and i.p["mt"] == 1 and i.a["dtype"] == "bf16")
    assert inst.d["fp8_direct"] == "true" and (inst.p["tile"], inst.p["stages"]) == (128, 3)
    ways = banks.ways(inst.d["bank"])
    assert ways["fp8_k_read"] <= 1 and ways["fp8_v_read"] <= 1
    widened = next(i for i in insts if i.kind == "grouped_mma" and i.p["d"] == 96 and i.p["kv_e"] == 4)
    assert widened.d["fp8_direct"] == "false"
