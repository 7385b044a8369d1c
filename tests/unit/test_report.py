"""Unit tier: the static resource report reads ptxas' logs and computes occupancy as the CUDA
occupancy calculator does (register allocation in steps of 8 per thread, 256 per warp)."""
from codegen.arch import ARCHES
from codegen.report import markdown, occupancy, parse_ptxas_log
from codegen.report_figure import draw, kind_costs

LOG = """ptxas info    : Compiling entry function 'a' for 'sm_90a'
    24 bytes stack frame, 24 bytes spill stores, 72 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 24 bytes cumulative stack size
ptxas info    : Compiling entry function 'b' for 'sm_90a'
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 186 registers, used 1 barriers
"""


def test_ptxas_log_gives_the_worst_kernel():
    res = parse_ptxas_log(LOG)
    assert (res.kernels, res.registers, res.spill_bytes, res.stack_bytes) == (2, 255, 96, 24)


def test_ptxas_log_counts_its_wgmma_notes():
    log = LOG + (
        "ptxas info    : (C7517) warpgroup.wait is injected in around line 3470 by compiler to allow use of "
        "registers defined by GMMA in function 'b'\n"
        "ptxas info    : (C7517) warpgroup.wait is injected in around line 7063 by compiler to allow use of "
        "registers defined by GMMA in function 'a'\n"
        "ptxas info    : (C7510) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
        "insufficient register resources for the wgmma pipeline in the function 'a'\n")
    res = parse_ptxas_log(log)
    assert (res.wgmma_serialized, res.wgmma_waits_injected) == (1, 2)
    assert (parse_ptxas_log(LOG).wgmma_serialized, parse_ptxas_log(LOG).wgmma_waits_injected) == (0, 0)
    row = {"name": "x_sm90a", "family": "f", "kind": "k", "threads": 128, "smem_bytes": 2048, "bank": {},
           "built": True, "registers": 255, "spill_bytes": 96, "ctas_per_sm": 1, "warps_per_sm": 4,
           "limiter": "registers", "wgmma_serialized": 1, "wgmma_waits_injected": 2}
    text = markdown([row])
    assert "| serialized in 1, 2 waits injected |" in text and "1 with serialized wgmma" in text


def test_occupancy_matches_the_calculator():
    h100 = ARCHES["sm_90a"]
    # 4 warps at 255 registers (256 per thread): 8192 per warp, two CTAs; 96 KB of shared memory
    # also allows two (228 KB, 1 KB reserved per CTA).
    assert occupancy(255, 128, 96 * 1024, h100) == {"ctas_per_sm": 2, "warps_per_sm": 8, "occupancy": 0.125,
                                                     "limiter": "registers"}
    # 107 registers round up to 112: 3584 per warp, 18 one-warp CTAs.
    assert occupancy(107, 32, 8 * 1024, h100)["ctas_per_sm"] == 18
    # Shared memory binds: 160 KB leaves room for one.
    got = occupancy(64, 256, 160 * 1024, h100)
    assert got["ctas_per_sm"] == 1 and got["limiter"] == "shared memory"
    # Threads bind: 1024-thread CTAs of few registers, two per SM.
    assert occupancy(32, 1024, 0, h100)["ctas_per_sm"] == 2


def test_markdown_says_what_is_not_built():
    rows = [{"name": "x_sm90a", "family": "f", "kind": "k", "threads": 128, "smem_bytes": 2048, "bank": {},
             "built": False}]
    assert "no ptxas log" in markdown(rows)


def _bank(wavefronts, ideal, unpadded, worst):
    return {"buffers": ["b"], "width": 4, "wavefronts": wavefronts, "ideal": ideal, "unpadded": unpadded,
            "worst": worst}


def test_kind_costs_sum_over_instances_and_accesses():
    rows = [{"family": "f", "kind": "k", "bank": {"a": _bank(1, 1, 4, 8), "b": _bank(4, 4, 4, 4)}},
            {"family": "f", "kind": "k", "bank": {"a": _bank(2, 1, 2, 2)}},
            {"family": "f", "kind": "plain", "bank": {}}]
    (kind, cost), = kind_costs(rows)
    assert kind == "f k" and cost == {"wavefronts": 7 / 6, "unpadded": 10 / 6, "worst": 14 / 6}


def test_the_figure_is_a_png(tmp_path):
    rows = [{"name": "x_sm90a", "family": "f", "kind": "k", "threads": 128, "smem_bytes": 2048, "built": True,
             "registers": 96, "spill_bytes": 8, "warps_per_sm": 16, "bank": {"a": _bank(2, 1, 4, 4)}}]
    path = draw(rows, tmp_path / "report.png", "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
