"""RWKV-7's chunked backward kind (specs/delta_rule_grad.yaml chunked_rwkv7,
templates/delta_rule_grad/chunked_rwkv7_grad.cu.j2): which instances exist, the shared memory
the lowering derives (two CTAs an SM), what it refuses, and where the default rules send a call
(codegen/dispatch.py, the mirror of the generated table)."""
import pytest

from codegen import dispatch, pipeline
from codegen.arch import ARCHES
from tests.conftest import ROOT

SPEC = (ROOT / "specs" / "delta_rule_grad.yaml").read_text()


def lowered(text, tmp_path):
    path = tmp_path / "delta_rule_grad.yaml"
    path.write_text(text)
    (spec, insts), = pipeline.lower(pipeline.expand(pipeline.load([path])), use_tuned=False)
    return spec, insts


def test_the_chunked_backward_is_16_bit_k64_cols64(tmp_path):
    chunked = [i for i in lowered(SPEC, tmp_path)[1] if i.kind == "chunked_rwkv7"]
    assert sorted(i.name for i in chunked) == ["delta_rule_grad_chunked_rwkv7_k64_cols64_bf16_sm90a",
                                               "delta_rule_grad_chunked_rwkv7_k64_cols64_fp16_sm90a"]


def test_chunked_backward_geometry_fits_two_ctas_an_sm(tmp_path):
    """Raw r, w, k, a, b (rows 72 wide), v and dO; the decayed rows three times two over each
    other; Z over V and dO' over dY; the chunk's start state and G; the pair matrices' gradients
    side by side in bf16 (64 + 8 wide); fp32 the cumulative decays (72 wide), exp(lc_C) and
    the decay's gradient per key, the pair matrices (24 wide), their gradients and their
    transposes, the scratch and the row gradients (72 wide: 8 words mod 32, so a fragment's
    float2 rows fall on distinct banks). The window's other start states live in the workspace,
    G's stash over the row gradients. Two CTAs fill Hopper's 228 KB exactly."""
    d = {i.name: i.d for i in lowered(SPEC, tmp_path)[1]}["delta_rule_grad_chunked_rwkv7_k64_cols64_bf16_sm90a"]
    assert (d["mat_pitch"], d["xp"], d["kp"]) == (24, 72, 72)
    bf16 = 16 * (5 * 72 + 2 * 72) + 3 * 32 * 72 + 2 * 32 * 72 + 2 * 64 * 72 + 16 * 72
    fp32 = 16 * 72 + 2 * 64 + 12 * 16 * 24 + 3 * 16 * 72 + 4 * 16 * 72
    assert d["smem_bytes"] == 2 * bf16 + 4 * fp32 == 115712
    arch = ARCHES["sm_90a"]
    assert 2 * (d["smem_bytes"] + arch.smem_reserved_per_cta) == arch.smem_per_sm
    assert (d["threads"], d["chunk"], d["ctas_per_sm"]) == (128, 16, 2)
    assert 4 * 16 * 72 >= 64 * 64  # the stash (G in fp32) fits over the row gradients


@pytest.mark.parametrize("K,V,align,dtype,kind", [
    (64, 64, 8, "bf16", "chunked_rwkv7"), (56, 40, 8, "fp16", "chunked_rwkv7"),
    (60, 64, 4, "bf16", "narrow"),        # rows not whole 16-byte pieces: the step-by-step kinds
    (64, 128, 8, "bf16", "narrow"),       # more value columns than the CTA holds
    (128, 64, 8, "bf16", "recurrent"),   # wider keys (narrow stops at 64)
    (64, 64, 4, "fp32", "narrow"),        # fp32 (and Gated DeltaNet's fp32 tied vectors)
])
def test_default_rules_send_16_bit_rwkv7_within_64_to_the_chunked_kind(tmp_path, K, V, align, dtype, kind):
    spec, insts = lowered(SPEC, tmp_path)
    runtime = {"K": K, "V": V, "T": 4096, "BH": 8, "align": align, "sm_count": 132}
    inst = dispatch.select(spec, insts, runtime, {"dtype": dtype})
    assert inst is not None and inst.kind == kind, inst and inst.name
