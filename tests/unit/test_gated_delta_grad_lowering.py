"""Gated DeltaNet's tensor-core backward (templates/gated_delta_grad/chunked_grad.cu.j2): which
instances exist, what the lowering derives for the three kernels' shared memory, the knobs it
refuses at their spec line, and where the default rules send a call (codegen/dispatch.py, the
mirror of the generated table)."""
import pytest

from codegen import dispatch, pipeline
from codegen.errors import SpecError
from tests.conftest import ROOT

SPEC = (ROOT / "specs" / "gated_delta_grad.yaml").read_text()


def lowered(text, tmp_path):
    path = tmp_path / "gated_delta_grad.yaml"
    path.write_text(text)
    (spec, insts), = pipeline.lower(pipeline.expand(pipeline.load([path])), use_tuned=False)
    return spec, insts


def test_instances_are_16_bit_and_cover_the_head_sizes(tmp_path):
    spec, insts = lowered(SPEC, tmp_path)
    insts = [i for i in insts if spec.kernels[i.kind].role != "bench"]
    assert insts and all(i.dtype_bytes == 2 for i in insts)
    assert {(i.kind, i.p["k"], i.p["v"]) for i in insts if i.a["dtype"] == "bf16"} == {
        ("chunked", 64, 64), ("chunked", 64, 128), ("chunked", 128, 64), ("chunked", 128, 128),
        ("chunked_wide", 64, 128), ("chunked_wide", 128, 128)}


def test_shared_memory_of_the_walk_and_the_per_chunk_kernel(tmp_path):
    """The walk: `stages` chunks of q, k (k + 8 wide), dO (cols + 8), M and W (64 + 8) in 16
    bits and gc in fp32, then G's tile and four exchange tiles. The per-chunk kernel: q, k, four
    [64, v] tiles, S and G as [k, v], five [64, 64] tiles, 24 rows of 64 fp32 scalars and 8
    per-warp sums; at k = v = 128 it fills a block's 227 KiB to within 6 KiB (one CTA an SM)."""
    by_name = {i.name: i.d for i in lowered(SPEC, tmp_path)[1]}
    d = by_name["gated_delta_grad_chunked_k128_v128_cols64_warps8_stages2_grad_warps8_bf16_sm90a"]
    stage = 2 * 64 * (2 * 136 + 72 + 2 * 72) + 4 * 64
    assert d["smem_bytes"] == 2 * stage + 2 * (128 * 72 + 4 * 64 * 72)
    grads = 2 * (2 * 64 * 136 + 4 * 64 * 136 + 2 * 128 * 136 + 5 * 64 * 72) + 4 * (24 * 64 + 8)
    assert d["grad_smem_bytes"] == grads and 227 * 1024 - 6 * 1024 < grads <= 227 * 1024
    wide = by_name["gated_delta_grad_chunked_wide_k128_v128_cols128_warps8_stages1_grad_warps8_bf16_sm90a"]
    assert wide["smem_bytes"] == 2 * 64 * (2 * 136 + 136 + 2 * 72) + 4 * 64 + 2 * (128 * 136 + 4 * 64 * 136)
    assert (wide["warps_m"], wide["warps_n"]) == (8, 1)
    # the chunk records' kernel is the forward's (codegen/families/delta_rule.py prepare_geometry)
    assert d["prep_smem_bytes"] == 2 * 64 * (2 * 136 + 72) + 4 * 2 * 64
    assert d["prep_ctas_per_sm"] == 4, "the backward's first kernel keeps 128 registers (it spills at 96)"
    # 16 warps (the bench-role candidates' point): 4 column warps' partial sums, 32 scalar rows, 16 sums of S * G
    text = SPEC.replace("grad_warps: [8]           # the per-chunk", "grad_warps: [16]          # the per-chunk")
    by_name = {i.name: i.d for i in lowered(text, tmp_path)[1]}
    d16 = by_name["gated_delta_grad_chunked_k128_v128_cols64_warps8_stages2_grad_warps16_bf16_sm90a"]
    assert d16["grad_smem_bytes"] == grads + 4 * (8 * 64 + 8) <= 227 * 1024


@pytest.mark.parametrize("old,new,field,message", [
    ("      cols: [128]\n      warps: [8]\n      stages: [1]", "      cols: [128]\n      warps: [8]\n      stages: [2]",
     "kernels.chunked_wide.grid.stages", "exceed a CTA's"),
    ("      v: [64, 128]              # bucket of V", "      v: [64, 80]               # bucket of V",
     "kernels.chunked.grid.v", "must be a multiple of 32 up to 128"),
    ("      warps: [8]                # the walk's", "      warps: [4]                # the walk's",
     "kernels.chunked.grid.warps", "4 row warps x 2 column warps"),
    ("      grad_warps: [8]           # the per-chunk", "      grad_warps: [12]          # the per-chunk",
     "kernels.chunked.grid.grad_warps", "2 or 4 column warps"),
    ("    where:\n      - \"dtype_bytes == 2\"\n    covers: \"K <= k and V <= v and align % 8 == 0\"",
     "    where:\n      - \"True\"\n    covers: \"K <= k and V <= v and align % 8 == 0\"",
     "kernels.chunked.grid.k", "16-bit operands, not fp32"),
])
def test_impossible_knobs_are_refused_at_their_line(tmp_path, old, new, field, message):
    text = SPEC.replace("  dtype: [fp16, bf16]", "  dtype: [fp32, fp16, bf16]") if "True" in new else SPEC
    text = text.replace(old, new, 1)
    assert old in SPEC and text != SPEC
    with pytest.raises(SpecError) as info:
        lowered(text, tmp_path)
    err = info.value
    assert err.field == field and message in err.message


def test_the_default_rules(tmp_path):
    spec, insts = lowered(SPEC, tmp_path)
    insts = [i for i in insts if spec.kernels[i.kind].role != "bench"]

    def pick(B, H, K=128, V=128, dtype="bf16", align=8):
        key = {"K": K, "V": V, "T": 4096, "BH": B * H, "align": align, "sm_count": 132}
        inst = dispatch.select(spec, insts, key, {"dtype": dtype})
        return inst.name if inst else None
    assert "_chunked_wide_k128_v128_" in pick(8, 16)     # 128 walks of 128 columns: most of a wave
    assert "_chunked_k128_v128_cols64_" in pick(1, 8)    # 8 such walks would leave the GPU idle
    assert "_chunked_k64_v64_" in pick(1, 8, K=64, V=64)
    assert "_chunked_k128_v64_" in pick(1, 8, K=120, V=40)
    assert pick(8, 16, K=60, V=60, align=4) is None      # rows not whole 16-byte pieces: attngen falls back
    assert pick(8, 16, K=256) is None
