"""The flash attention forward's lowering of the warp-specialized kind
(codegen/families/flash_attention.py): the producer's and consumers' register split, the shared
memory of the ring, the d256 points (48-key tiles serve D 256, 32-key tiles are the schedule head
sizes between 128 and 256 take on first use), and head sizes padded to whole swizzle atoms (d96,
and others built on first use); the fp8 kinds (e4m3 q, k, v; an fp8 paged cache under a 16-bit q)."""
import pytest

from codegen import jit, pipeline
from tests.conftest import ROOT

SPEC = ROOT / "specs" / "flash_attention.yaml"


def shipped():
    return {i.name: i for _, insts in pipeline.lower(pipeline.expand(pipeline.load([SPEC]))) for i in insts}


def test_the_d256_warp_specialized_point():
    by_name = shipped()
    d = by_name["flash_attention_hopper_ws_d256_block_m128_block_n32_warpgroups2_stages2_overlap0_pingpong1_minb1_tma1_"
                "page_ids2_slack8_bf16_sm90a"].d
    # 384 threads at one CTA an SM: 168 registers a thread at launch; the producer keeps 64 and
    # each consumer warpgroup claims (168 * 384 - 64 * 128) / 256 rounded down to 8.
    assert (d["threads"], d["producer_regs"], d["consumer_regs"]) == (384, 64, 216)
    # scores 32 / 2, output 256 / 2, no weights held (no overlap), the wgmma overhead
    assert d["regs_estimate"] == 16 + 128 + 40 <= d["consumer_regs"]
    # 1 KB of alignment, Q (128 rows), two stages of K and V (32 rows), 2 + 4 * 2 mbarriers
    assert d["smem_bytes"] == 1024 + (128 + 2 * 2 * 32) * 256 * 2 + (2 + 4 * 2) * 8
    assert "a box per page" in d["loads_doc"]


def test_the_d256_48_key_point_and_its_spill_allowance():
    by_name = shipped()
    name = "flash_attention_hopper_ws_d256_block_m128_block_n{}_warpgroups2_stages2_overlap0_pingpong1_minb1_tma1_page_ids2_slack8_bf16_sm90a"
    d48, d32 = by_name[name.format(48)].d, by_name[name.format(32)].d
    # scores 48 / 2, output 256 / 2, the wgmma overhead: within the consumers' 216
    assert d48["regs_estimate"] == 24 + 128 + 40 <= d48["consumer_regs"] == 216
    # two stages of K and V of 48 rows
    assert d48["smem_bytes"] == 1024 + (128 + 2 * 2 * 48) * 256 * 2 + (2 + 4 * 2) * 8
    # the spec's spill_bytes: 16 where ptxas spills in the soft-cap/ALiBi variants, else 0
    assert (d48["spill_bytes_allowed"], d32["spill_bytes_allowed"]) == (16, 0)


def test_d256_dispatches_to_the_warp_specialized_kind():
    """The spec's dispatch puts hopper_ws first; with d256 in its grid the `hopper` kind serves
    no head size by default (the tuned table and forced calls still reach it)."""
    text = (ROOT / "generated" / "flash_attention" / "dispatch.cpp").read_text()
    default_ws = text[text.index("when True -> hopper_ws\n"):text.index("when True -> hopper\n")]
    assert "flash_attention_hopper_ws_d256_block_m128_block_n32" in default_ws


def test_d96_pads_its_tiles_to_whole_atoms():
    """d96 runs d128's schedule on tiles of two 64-column atoms: the same registers and shared
    memory as d128, the output accumulator 128 columns wide (the epilogue stores 96)."""
    by_name = shipped()
    name = "flash_attention_hopper_ws_d{}_block_m128_block_n128_warpgroups2_stages2_overlap1_pingpong1_minb1_tma1_page_ids2_slack0_bf16_sm90a"
    d96, d128 = by_name[name.format(96)].d, by_name[name.format(128)].d
    assert d96["tile_cols"] == 128 == d128["tile_cols"]
    for field in ("regs_estimate", "smem_bytes", "consumer_regs"):
        assert d96[field] == d128[field], field


def test_the_lazy_rescale_reaches_the_kernel_as_the_spec_sets_it():
    """`slack` (the lazy rescale's 2^slack) is the 16-bit kinds' axis, rendered as SLACK; the fp8
    kinds have no such axis and take 0 (their weights are scaled against the exact max)."""
    by_name = shipped()
    d256 = by_name["flash_attention_hopper_ws_d256_block_m128_block_n48_warpgroups2_stages2_overlap0_pingpong1_minb1_tma1_"
                   "page_ids2_slack8_bf16_sm90a"]
    d128 = by_name["flash_attention_hopper_ws_d128_block_m128_block_n128_warpgroups2_stages2_overlap1_pingpong1_minb1_tma1_"
                   "page_ids2_slack0_bf16_sm90a"]
    fp8 = by_name[FP8_NAME.format(128)]
    assert (d256.d["slack"], d128.d["slack"], fp8.d["slack"]) == (8, 0, 0)
    for inst, slack in ((d256, 8), (d128, 0), (fp8, 0)):
        text = (ROOT / "generated" / "flash_attention" / f"{inst.name}.cu").read_text()
        assert f"constexpr int SLACK = {slack};" in text, inst.name


FLASH_KEY = {"B": 2, "Hq": 16, "Hkv": 16, "G": 1, "Lq": 1024, "Lk": 1024, "align": 8, "sm_count": 132, "causal": 0,
             "KVE": 0}


@pytest.mark.parametrize("head, tile", [(80, 128), (160, 192), (192, 192)])
def test_head_sizes_between_the_built_ones_reach_the_hopper_kind_on_first_use(head, tile):
    inst = jit.plan(jit.spec_of("flash_attention"), {**FLASH_KEY, "D": head}, {"dtype": "bf16"}).inst
    assert inst.kind == "hopper_ws" and inst.p["d"] == head and inst.d["tile_cols"] == tile


def test_a_head_size_off_the_k_step_is_refused_with_the_reason():
    with pytest.raises(jit.Unbuildable, match=r"d=72: Q K\^T steps 16 columns"):
        jit.plan(jit.spec_of("flash_attention"), {**FLASH_KEY, "D": 72}, {"dtype": "bf16"})


# ---- the fp8 (e4m3) kind ---------------------------------------------------------------------
FP8_NAME = ("flash_attention_hopper_ws_fp8_d{}_block_m128_block_n128_warpgroups2_stages2_overlap1_pingpong1_minb1_"
            "tma1_page_ids2_exp160_e4m3_sm90a")


def test_the_fp8_points():
    """e4m3 tiles: Q and K in 128-element (128-byte) atoms, V^T with a row per head column, the
    output accumulator D wide and written in bf16; the same register split as the 16-bit kind."""
    by_name = shipped()
    d64, d128 = by_name[FP8_NAME.format(64)].d, by_name[FP8_NAME.format(128)].d
    assert (d64["tile_cols"], d64["out_cols"], d128["tile_cols"], d128["out_cols"]) == (128, 64, 128, 128)
    assert d64["out_ctype"] == d128["out_ctype"] == "__nv_bfloat16"
    # scores 128 / 2, output D / 2, the weights of a tile held during the next scores (128 keys,
    # one byte each: 128 / 8 registers), the wgmma overhead
    assert d128["regs_estimate"] == 64 + 64 + 16 + 40 <= d128["consumer_regs"] == 216
    # 1 KB of alignment, Q (128 rows) and two stages of K (128 rows) at 128 bytes, two stages of
    # V^T (D rows of 128 keys), the mbarriers
    assert d64["smem_bytes"] == 1024 + (128 + 2 * 128) * 128 + 2 * 64 * 128 + (2 + 4 * 2) * 8
    assert d128["smem_bytes"] == 1024 + (128 + 2 * 128) * 128 + 2 * 128 * 128 + (2 + 4 * 2) * 8


def test_the_fp8_d256_point_takes_64_key_tiles():
    """d256: the output's 128 registers leave room for 64 keys' scores (128 keys: about 248
    registers); Q and K rows are two 128-byte atoms, V^T's tiles 256 rows of 64 keys."""
    name = FP8_NAME.format(256).replace("block_n128", "block_n64")
    d256 = shipped()[name].d
    assert (d256["tile_cols"], d256["out_cols"]) == (256, 256)
    assert d256["regs_estimate"] == 32 + 128 + 8 + 40 <= d256["consumer_regs"] == 216
    assert d256["smem_bytes"] == 1024 + (128 + 2 * 64) * 256 + 2 * 256 * 64 + (2 + 4 * 2) * 8
    assert d256["spill_bytes_allowed"] == 20   # the sliding-window variant (the spec's spill_bytes)


def test_only_the_fp8_kind_has_e4m3_instances():
    kinds = {i.kind for i in shipped().values() if i.a["dtype"] == "e4m3"}
    assert kinds == {"hopper_ws_fp8"}


def test_fp8_head_sizes_and_tiles_the_kernel_cannot_take_are_refused():
    spec = jit.spec_of("flash_attention")
    key = {**FLASH_KEY, "align": 16}
    with pytest.raises(jit.Unbuildable, match=r"d=160: fp8 operands need a multiple of 32 \(the k-step of m64nNk32\) "
                                              r"that wgmma.cuh instantiates as N"):
        jit.plan(spec, {**key, "D": 160}, {"dtype": "e4m3"})
    inst = jit.plan(spec, {**key, "D": 192}, {"dtype": "e4m3"}).inst   # as d256: 64-key tiles
    assert inst.p["block_n"] == 64 and inst.d["out_cols"] == 192
    with pytest.raises(jit.Unbuildable, match=r"d=80: fp8 operands need a multiple of 32"):
        jit.plan(spec, {**key, "D": 80}, {"dtype": "e4m3"})
    inst = jit.plan(spec, {**key, "D": 96}, {"dtype": "e4m3"}).inst   # 96: one atom of Q/K columns, 96 V^T rows
    assert inst.kind == "hopper_ws_fp8" and (inst.d["tile_cols"], inst.d["out_cols"]) == (128, 96)


def test_the_output_dtype_follows_fp8_inputs():
    """op.outputs.out's dtype `bfloat16 if fp8(q) else q` becomes a C++ conditional on q's dtype."""
    text = (ROOT / "generated" / "flash_attention" / "op.cpp").read_text()
    assert "(at::isFloat8Type(a.q.scalar_type()) ? at::kBFloat16 : a.q.scalar_type())" in text


# ---- an fp8 paged cache under a 16-bit q (mma_sync_fp8_cache) --------------------------------
CACHE_NAME = "flash_attention_mma_sync_fp8_cache_d{}_block_m128_block_n{}_warps{}_stages2_swizzle{}_qregs{}_minb1_kv_e{}_{}_sm90a"


def test_the_fp8_cache_points_hold_raw_tiles_and_their_widened_pair():
    """The Q tile, the K and V tiles widened to 16 bits, and a ring of raw fp8 tiles (D bytes a row,
    half a 16-bit stage); the mma_sync tiling of each head size, one instance per cache format."""
    by_name = shipped()
    d128 = by_name[CACHE_NAME.format(128, 128, 8, 1, 0, 4, "bf16")].d
    plain = by_name["flash_attention_mma_sync_d128_block_m128_block_n128_warps8_stages2_swizzle1_qregs0_minb1_bf16_sm90a"].d
    assert d128["kv_e"] == 4 and plain["kv_e"] == 0
    assert d128["smem_bytes"] == 128 * 128 * 2 + 2 * 128 * 128 * 2 + 2 * 2 * 128 * 128
    assert plain["smem_bytes"] == 128 * 128 * 2 + 2 * 2 * 128 * 128 * 2
    d96 = by_name[CACHE_NAME.format(96, 64, 8, 0, 1, 5, "fp16")].d   # padded 16-bit rows, raw rows unpadded
    assert d96["smem_bytes"] == 128 * 104 * 2 + 2 * 64 * 104 * 2 + 2 * 2 * 64 * 96
    assert "fp8 e5m2" in d96["cache_doc"]
    kinds = {(i.kind, i.p["kv_e"]) for i in by_name.values() if "kv_e" in i.p and i.family == "flash_attention"}
    assert kinds == {(kind, e) for kind in ("mma_sync_fp8_cache", "hopper_ws_fp8_cache") for e in (4, 5)}


WS_CACHE_NAME = ("flash_attention_hopper_ws_fp8_cache_d{}_block_m128_block_n{}_warpgroups2_stages{}_overlap{}_pingpong1_"
                 "minb1_tma0_page_ids2_slack{}_kv_e{}_{}_sm90a")


def test_the_warp_specialized_fp8_cache_points_add_the_producers_raw_rows():
    """hopper_ws's points and shared memory, plus two tiles of raw K and V rows (D bytes each) that the
    producer copies (one tile ahead) and widens; the same register split (its consumers run
    hopper_ws's code)."""
    by_name = shipped()
    for (d, n, stages, overlap, slack) in ((64, 128, 3, 1, 0), (128, 128, 2, 1, 0), (256, 48, 2, 0, 8)):
        cache = by_name[WS_CACHE_NAME.format(d, n, stages, overlap, slack, 4, "bf16")].d
        plain = by_name[f"flash_attention_hopper_ws_d{d}_block_m128_block_n{n}_warpgroups2_stages{stages}_overlap{overlap}_"
                        f"pingpong1_minb1_tma1_page_ids2_slack{slack}_bf16_sm90a"].d
        assert cache["smem_bytes"] == plain["smem_bytes"] + 2 * 2 * n * d, d   # two tiles of raw K and V rows
        assert (cache["kv_e"], plain["kv_e"]) == (4, 0)
        for field in ("consumer_regs", "producer_regs", "regs_estimate"):
            assert cache[field] == plain[field], (d, field)
        bank = cache["bank"]
        assert bank["fp8_raw_read"]["wavefronts"] == bank["fp8_raw_read"]["ideal"]


def test_head_sizes_the_warp_specialized_fp8_cache_kind_cannot_take_build_on_mma_sync():
    """d80 pads its tiles (the producer widens whole-atom heads only); d192 on the d256 point's
    48-key tiles leaves raw pieces over the producer's threads, and on the 128-key points its
    shared memory exceeds the SM's: both are built as mma_sync_fp8_cache on first use."""
    spec = jit.spec_of("flash_attention")
    for head in (80, 192):
        inst = jit.plan(spec, {**FLASH_KEY, "D": head, "KVE": 4}, {"dtype": "bf16"}).inst
        assert inst.kind == "mma_sync_fp8_cache" and inst.p["d"] == head, head


def test_the_widening_is_conflict_free_on_swizzled_tiles():
    """8 bytes a lane read from the raw rows and 16 written into the swizzled tile: one wavefront
    per phase. d96's padded rows (104 elements, for conflict-free ldmatrix) cost the 16-byte
    writes one wavefront in five."""
    by_name = shipped()
    for args in ((128, 128, 8, 1, 0, 4, "bf16"), (96, 64, 8, 0, 1, 4, "bf16"), (64, 64, 4, 1, 0, 5, "fp16")):
        bank = by_name[CACHE_NAME.format(*args)].d["bank"]
        assert bank["fp8_raw_read"]["wavefronts"] == bank["fp8_raw_read"]["ideal"] == 2, args
        write = bank["fp8_wide_write"]
        assert (write["wavefronts"], write["ideal"]) == ((5, 4) if args[0] == 96 else (4, 4)), args


def test_only_an_fp8_cache_key_reaches_the_fp8_cache_kind():
    """KVE (the cache's exponent bits) picks the kind; no 16-bit kind covers an fp8 cache and the
    fp8-cache kind covers no 16-bit one, whatever rule (tuned or default) comes first."""
    from codegen import dispatch
    (spec, insts), = pipeline.lower(pipeline.expand(pipeline.load([SPEC])))
    for D in (64, 96, 128, 256):
        for kve in (0, 4, 5):
            for causal in (0, 1):
                key = {**FLASH_KEY, "D": D, "KVE": kve, "causal": causal}
                inst = dispatch.select(spec, insts, key, {"dtype": "bf16"})
                assert inst is not None, key
                want = "hopper_ws_fp8_cache" if D % 64 == 0 else "mma_sync_fp8_cache"
                assert inst.kind.endswith("fp8_cache") == (kve > 0), (key, inst.name)
                assert kve == 0 or inst.kind == want, (key, inst.name)
                assert inst.p.get("kv_e", 0) == kve


def test_an_fp8_cache_head_size_between_the_built_ones_builds_on_first_use():
    spec = jit.spec_of("flash_attention")
    inst = jit.plan(spec, {**FLASH_KEY, "D": 80, "KVE": 5}, {"dtype": "fp16"}).inst
    assert inst.kind == "mma_sync_fp8_cache" and inst.p["d"] == 80 and inst.p["kv_e"] == 5 and inst.p["swizzle"] == 0
