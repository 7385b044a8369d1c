"""The flash attention forward's lowering of the warp-specialized kind
(codegen/families/flash_attention.py): the producer's and consumers' register split, the shared
memory of the ring, and the d256 point with 32-key tiles that serves D 256."""
from codegen import pipeline
from tests.conftest import ROOT

SPEC = ROOT / "specs" / "flash_attention.yaml"


def shipped():
    return {i.name: i for _, insts in pipeline.lower(pipeline.expand(pipeline.load([SPEC]))) for i in insts}


def test_the_d256_warp_specialized_point():
    by_name = shipped()
    d = by_name["flash_attention_hopper_ws_d256_block_m128_block_n32_warpgroups2_stages2_overlap0_pingpong1_minb1_tma1_"
                "page_ids2_bf16_sm90a"].d
    # 384 threads at one CTA an SM: 168 registers a thread at launch; the producer keeps 64 and
    # each consumer warpgroup claims (168 * 384 - 64 * 128) / 256 rounded down to 8.
    assert (d["threads"], d["producer_regs"], d["consumer_regs"]) == (384, 64, 216)
    # scores 32 / 2, output 256 / 2, no weights held (no overlap), the wgmma overhead
    assert d["regs_estimate"] == 16 + 128 + 40 <= d["consumer_regs"]
    # 1 KB of alignment, Q (128 rows), two stages of K and V (32 rows), 2 + 4 * 2 mbarriers
    assert d["smem_bytes"] == 1024 + (128 + 2 * 2 * 32) * 256 * 2 + (2 + 4 * 2) * 8
    assert "a box per page" in d["loads_doc"]


def test_d256_dispatches_to_the_warp_specialized_kind():
    """The spec's dispatch puts hopper_ws first; with d256 in its grid the `hopper` kind serves
    no head size by default (the tuned table and forced calls still reach it)."""
    text = (ROOT / "generated" / "flash_attention" / "dispatch.cpp").read_text()
    default_ws = text[text.index("when True -> hopper_ws\n"):text.index("when True -> hopper\n")]
    assert "flash_attention_hopper_ws_d256_block_m128_block_n32" in default_ws
