"""The flash attention backward's lowering (codegen/families/flash_attention_grad.py): what it
derives for the warps' split of dK, dV and dQ and the shared memory, and the knobs it refuses,
named at their spec line."""
import re

import pytest

from codegen import pipeline
from codegen.errors import SpecError
from tests.conftest import ROOT

SPEC = (ROOT / "specs" / "flash_attention_grad.yaml").read_text()


def lowered(text, tmp_path):
    path = tmp_path / "flash_attention_grad.yaml"
    path.write_text(text)
    return [i for _, insts in pipeline.lower(pipeline.expand(pipeline.load([path]))) for i in insts]


def test_the_warps_split_of_the_products(tmp_path):
    by_name = {i.name: i.d for i in lowered(SPEC, tmp_path)}
    # d256 on mma.sync: 4 groups of 2 warps own 16 keys each, each warp 128 of dK's and dV's columns;
    # dQ's 32 x 256 tile: 2 warps over the rows, 4 over the columns.
    d256 = by_name["flash_attention_grad_mma_sync_d256_block_n64_block_m32_warps8_dsplit2_stages2_swizzle1_minb1_bf16_sm90a"]
    assert (d256["groups"], d256["mt"], d256["dw"], d256["q_warps_m"], d256["q_warps_d"]) == (4, 1, 128, 2, 4)
    # K and V tiles, two stages of Q and dO, dS^T (32 columns padded by one chunk), lse and delta
    assert d256["smem_bytes"] == (2 * 64 * 256 + 2 * 2 * 32 * 256) * 2 + 64 * 40 * 2 + 2 * 2 * 32 * 4
    # the wgmma kind: dQ by 64-column halves at d128, by each warpgroup's own keys at d64 (whole tile)
    d128 = by_name["flash_attention_grad_hopper_d128_block_n128_block_m64_warpgroups2_dq_by_keys0_dq_exchange0_dq_bulk2_stages2_overlap0_producer1_minb1_bf16_sm90a"]
    d64 = by_name["flash_attention_grad_hopper_d64_block_n128_block_m64_warpgroups2_dq_by_keys1_dq_exchange1_dq_bulk0_stages3_overlap1_producer1_minb1_bf16_sm90a"]
    assert (d128["dq_rows"], d128["dq_cols"]) == (64, 64) and (d64["dq_rows"], d64["dq_cols"]) == (64, 64)
    # d96 on the wgmma kind: tiles and dK, dV padded to two 64-column atoms, d128's split and memory
    d96 = by_name["flash_attention_grad_hopper_d96_block_n128_block_m64_warpgroups2_dq_by_keys0_dq_exchange0_dq_bulk2_stages2_overlap0_producer1_minb1_bf16_sm90a"]
    assert d96["tile_cols"] == 128 and (d96["dq_cols"], d96["smem_bytes"], d96["regs_estimate"]) == (
        d128["dq_cols"], d128["smem_bytes"], d128["regs_estimate"])
    # three stages of Q and dO, two dS buffers; the exchange: a float4 per thread and handed-over tile;
    # the producer's mbarriers (K and V, then full and empty per stage)
    assert d64["smem_bytes"] == (2 * 128 * 64 + 3 * 2 * 64 * 64 + 2 * 64 * 128) * 2 + 3 * 2 * 64 * 4 + 2 * 4 * 128 * 16 \
        + (1 + 2 * 3) * 8 + 1024
    # d128 adds dQ by tensor reductions (dq_bulk 2): each warpgroup's two boxes of 64 x 32 floats, and
    # the deterministic writer's mbarriers (stored, full, empty for two buffers of boxes)
    assert d128["smem_bytes"] == (2 * 128 * 128 + 2 * 2 * 64 * 128 + 2 * 64 * 128) * 2 + 2 * 2 * 64 * 4 \
        + 2 * 64 * 64 * 4 + (1 + 2 * 2 + 3 * 2) * 8 + 1024


def test_a_producer_warpgroup_takes_registers_from_the_launch_and_adds_barriers(tmp_path):
    """producer=1: a third warpgroup, 32 registers after setmaxnreg and the consumers 232 (65536 /
    384 threads, rounded to 8, less the producer's); two dS buffers and the mbarriers of K and V
    and of each stage (full, empty) on top of the same tiles."""
    text = SPEC.replace("      producer: [1]\n      minb: [1]\n    where:\n      # d96 pads",
                        "      producer: [0, 1]\n      minb: [1]\n    where:\n      # d96 pads", 1)
    assert text != SPEC
    by_name = {i.name: i.d for i in lowered(text, tmp_path)}
    base = "flash_attention_grad_hopper_d128_block_n128_block_m64_warpgroups2_dq_by_keys0_dq_exchange0_dq_bulk2_stages2_overlap0"
    plain, fed = by_name[base + "_producer0_minb1_bf16_sm90a"], by_name[base + "_producer1_minb1_bf16_sm90a"]
    assert (plain["threads"], fed["threads"]) == (256, 384)
    assert (fed["producer_regs"], fed["consumer_regs"]) == (32, 232)
    # deterministic, the producer also waits for the dq turns: 48 and 224, the same total
    assert (fed["turns_producer_regs"], fed["turns_consumer_regs"]) == (48, 224)
    assert fed["turns_producer_regs"] + 2 * fed["turns_consumer_regs"] == 32 + 2 * 232
    assert fed["smem_bytes"] == plain["smem_bytes"] + 64 * 128 * 2 + (1 + 2 * 2 + 3 * 2) * 8


def test_bulk_dq_stages_the_rows_each_warpgroup_adds(tmp_path):
    """dq_bulk=1: each warpgroup's 64 dQ rows of the columns it adds, padded by 8 floats a row;
    dq_bulk=2: the same columns in unpadded 64 x 32 boxes (d128: 64 columns each; d64 with the
    exchange: half of the tile's 64)."""
    where = "(d, dq_by_keys, dq_exchange, stages, overlap, dq_bulk) in ((64, 1, 1, 3, 1, 0), (96, 0, 0, 2, 0, 2), (128, 0, 0, 2, 0, 2))"
    assert SPEC.count(where) == 1 and SPEC.count("      dq_bulk: [0, 2]\n      stages: [2, 3]\n      overlap: [0, 1]\n      producer: [1]") == 1
    text = SPEC.replace(where, "(d, dq_by_keys, dq_exchange, stages, overlap) in ((64, 1, 1, 3, 1), (128, 0, 0, 2, 0))").replace(
        "      dq_bulk: [0, 2]\n      stages: [2, 3]\n      overlap: [0, 1]\n      producer: [1]",
        "      dq_bulk: [0, 1, 2]\n      stages: [2, 3]\n      overlap: [0, 1]\n      producer: [1]", 1)
    by_name = {i.name: i.d for i in lowered(text, tmp_path)}
    for d, schedule, cols in ((128, "dq_by_keys0_dq_exchange0_dq_bulk{}_stages2_overlap0", 64),
                              (64, "dq_by_keys1_dq_exchange1_dq_bulk{}_stages3_overlap1", 32)):
        name = f"flash_attention_grad_hopper_d{d}_block_n128_block_m64_warpgroups2_{schedule}_producer1_minb1_bf16_sm90a"
        atomics, rows, boxes = (by_name[name.format(mode)] for mode in (0, 1, 2))
        assert rows["smem_bytes"] == atomics["smem_bytes"] + 2 * 64 * (cols + 8) * 4
        # the boxes, and the deterministic writer's mbarriers (stored, full, empty for two buffers)
        assert boxes["smem_bytes"] == atomics["smem_bytes"] + 2 * 64 * cols * 4 + 3 * 2 * 8


@pytest.mark.parametrize("edits,field,message", [
    ([("dsplit: [1, 2]", "dsplit: [1, 3]"), ("(256, 64, 32, 8, 2))", "(256, 64, 32, 8, 3))")],
     "kernels.mma_sync.grid.dsplit", "dsplit=3: it must divide warps=8"),
    ([("block_m: [32]", "block_m: [32, 40]"), ("(96, 64, 32, 4, 1)", "(96, 64, 40, 4, 1)")],
     "kernels.mma_sync.grid.block_m", "block_m=40 is not a multiple of 16"),
    ([("((64, 1, 1, 3, 1, 0), (96, 0, 0, 2, 0, 2),", "((64, 1, 1, 2, 1, 0), (96, 0, 0, 2, 0, 2),"),
      ("      producer: [1]\n      minb: [1]\n    where:\n      # d96", "      producer: [0]\n      minb: [1]\n    where:\n      # d96")],
     "kernels.hopper.grid.stages", "stages=2: the cp.async ring needs at least 3"),
    ([("(96, 0, 0, 2, 0, 2), (128, 0, 0, 2, 0, 2))", "(96, 0, 0, 2, 0, 2), (128, 0, 1, 2, 0, 2))")],
     "kernels.hopper.grid.dq_exchange", "dq_exchange=1: 0, or 1 with dq_by_keys=1"),
    ([("      block_m: [64]\n      warpgroups: [2]\n      dq_by_keys: [0, 1]",
       "      block_m: [128]\n      warpgroups: [2]\n      dq_by_keys: [0, 1]"),
      ("((64, 1, 1, 3, 1, 0), (96, 0, 0, 2, 0, 2),", "((64, 0, 0, 2, 0, 2), (96, 0, 0, 2, 0, 2),")],
     "kernels.hopper.grid.block_m", "block_m=128 with producer=1: the producer stages a tile's lse and delta"),
])
def test_impossible_knobs_are_refused_at_their_spec(tmp_path, edits, field, message):
    text = SPEC
    for old, new in edits:
        assert old in text
        text = text.replace(old, new, 1)
    with pytest.raises(SpecError) as info:
        lowered(text, tmp_path)
    err = info.value
    assert err.field == field and message in err.message, (err.field, err.message)


def test_a_d64_query_tile_the_warpgroups_cannot_split_is_refused(tmp_path):
    """dQ of a 64 x 64 tile does not split into whole 64-column atoms over two warpgroups: the
    column split is refused and names the knob that splits the keys instead."""
    text = SPEC.replace('"(d, dq_by_keys, dq_exchange, stages, overlap, dq_bulk) in ((64, 1, 1, 3, 1, 0), (96, 0, 0, 2, 0, 2),',
                        '"(d, dq_by_keys, dq_exchange, stages, overlap, dq_bulk) in ((64, 0, 0, 2, 0, 0), (96, 0, 0, 2, 0, 2),', 1)
    assert text != SPEC
    with pytest.raises(SpecError) as info:
        lowered(text, tmp_path)
    assert info.value.field == "kernels.hopper.grid.block_m" and "dq_by_keys=1 splits the keys" in info.value.message


def test_the_wide_kind_splits_columns_and_fills_the_shared_memory(tmp_path):
    """hopper_wide at d256: each warpgroup 128 columns of dK, dV and dQ over one 64-key block; K, V,
    two stages of Q and dO, one dS tile, the hand-off (a float4 per thread and 8-column tile of
    dP^T), the statistics and the mbarriers (the producer's, the writer's): within the 227 KB a block may have. dQ's
    boxes (dq_bulk 2) take the stage's Q and dO tiles, so they add nothing."""
    by_name = {i.name: i.d for i in lowered(SPEC, tmp_path)}
    wide = by_name["flash_attention_grad_hopper_wide_d256_block_n64_block_m64_warpgroups2_dq_cols64_dq_bulk2_stages2_minb1_"
                   "bf16_sm90a"]
    assert (wide["threads"], wide["cols"], wide["producer_regs"], wide["consumer_regs"]) == (384, 128, 32, 232)
    assert wide["smem_bytes"] == (2 * 64 * 256 + 2 * 2 * 64 * 256 + 64 * 64) * 2 + 8 * 128 * 16 + 2 * 2 * 64 * 4 \
        + (1 + 2 * 2 + 2) * 8 + 1024 <= 232448
    assert wide["regs_estimate"] <= wide["consumer_regs"]


@pytest.mark.parametrize("edits,field,message", [
    ({"dq_cols: [64]": "dq_cols: [128]", "dq_bulk: [2]": "dq_bulk: [0]"}, "dq_cols", "about 264 registers"),
    ({"dq_cols: [64]": "dq_cols: [128]"}, "dq_cols", "where its 128 columns of Q and of dO were: dq_cols = 64"),
    ({"dq_cols: [64]": "dq_cols: [96]"}, "dq_cols", "whole 64-column atoms"),
    ({"stages: [2]": "stages: [3]"}, "stages", "bytes of shared memory exceed"),
    ({"dq_bulk: [2]": "dq_bulk: [1]"}, "dq_bulk", "dq_bulk=1: 2 (each dQ product staged"),
])
def test_the_wide_kind_refuses_what_does_not_fit(tmp_path, edits, field, message):
    start = SPEC.index("  hopper_wide:")
    end = SPEC.index("    covers", start)
    section = SPEC[start:end]
    for old, new in edits.items():
        assert section.count(old) == 1, old
        section = section.replace(old, new)
    with pytest.raises(SpecError, match=re.escape(message)) as err:
        lowered(SPEC[:start] + section + SPEC[end:], tmp_path)
    assert f"kernels.hopper_wide.grid.{field}" in str(err.value)


def test_dq_boxes_are_stored_without_bank_conflicts():
    """store_box_row (backward_common.cuh.j2), step by step as the template computes it: lane 4r + c
    of a warp's rows stores row r's floats 2c, 2c + 1 of tile j (j ^ 2 on odd rows) at chunk
    (2 (j % 4)) ^ key of the row. Over a warp's 16 rows and 8 tiles that is every float of the
    boxes once, where the swizzle places it (_box_offset), and each step's float2 stores take the
    two wavefronts of a conflict-free warp request (tile j on every row took four)."""
    from codegen.families.flash_attention_grad import BOX_COLS, BOX_ROWS, _box_offset
    from codegen.passes import banks
    tiles, stored = 8, {}
    for hh in range(2):
        for step in range(tiles):
            j = (step & ~3) | (step & 1) << 1 | (step >> 1 & 1)
            addresses = []
            for lane in range(32):
                r = lane // 4 + hh * 8
                odd = r % 2 == 1
                key = (lane % 4 // 2) ^ (r % 8) ^ (4 if odd else 0)
                at = r * BOX_COLS + lane % 2 * 2 + j // 4 * BOX_ROWS * BOX_COLS + ((j % 4 * 2) ^ key) * 4
                tile = j ^ 2 if odd else j
                column = tile * 8 + lane % 4 * 2
                for f in range(2):
                    want = (column + f) // BOX_COLS * BOX_ROWS * BOX_COLS + _box_offset(r, (column + f) % BOX_COLS, True)
                    assert at + f == want, (hh, step, lane)
                    assert (r, column + f) not in stored
                    stored[r, column + f] = at + f
                addresses.append(at * 4)
            assert banks.wavefronts(addresses, 8) == 2, (hh, step)
    assert len(stored) == 16 * tiles * 8 and len(set(stored.values())) == len(stored)
    tile_j_everywhere = [_box_offset(lane // 4, lane % 4 * 2, True) * 4 for lane in range(32)]
    assert banks.wavefronts(tile_j_everywhere, 8) == 4


def test_every_shipped_dq_box_store_is_modelled_conflict_free():
    import json
    manifest = json.loads((ROOT / "generated" / "manifest.json").read_text())
    boxes = [r for r in manifest if r["name"].startswith("flash_attention_grad_hopper") and "dq_box_write" in r["derived"]["bank"]]
    assert boxes
    for row in boxes:
        record = row["derived"]["bank"]["dq_box_write"]
        assert record["wavefronts"] == record["ideal"] == 2, row["name"]
