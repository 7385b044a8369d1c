"""The delta-rule chunked kinds (templates/delta_rule/chunked.cu.j2): which instances exist,
what the lowering derives for shared memory and the first kernel's layout, the knobs it
refuses at their spec line, and where the default rules send a call (codegen/dispatch.py, the
mirror of the generated table)."""
import pytest

from codegen import dispatch, pipeline
from codegen.arch import ARCHES
from codegen.passes import Rejected, resources
from codegen.errors import SpecError
from tests.conftest import ROOT

SPEC = (ROOT / "specs" / "delta_rule.yaml").read_text()


def lowered(text, tmp_path):
    path = tmp_path / "delta_rule.yaml"
    path.write_text(text)
    (spec, insts), = pipeline.lower(pipeline.expand(pipeline.load([path])), use_tuned=False)  # the spec alone
    return spec, insts


def test_only_16_bit_instances_are_chunked_each_variant_by_its_kind(tmp_path):
    _, insts = lowered(SPEC, tmp_path)
    chunked = [i for i in insts if i.kind.startswith("chunked")]
    assert chunked and all(i.dtype_bytes == 2 for i in chunked)
    assert {i.kind for i in chunked if i.a["variant"] == "gated_delta"} == {"chunked", "chunked_wide"}  # chunked_candidates: the bench build
    assert {i.kind for i in chunked if i.a["variant"] == "rwkv7"} == {"chunked_rwkv7"}


def test_rwkv7_chunked_geometry(tmp_path):
    """Four warps (a pair matrix, 16 keys and 16 columns each), two stages of r, w, k, a, b, v
    (rows 72 wide, padded), the decayed rows, b and k over each other, Z over V, the state and
    the pair matrices side by side in bf16; the cumulative decays (rows 72 wide), exp(lc_C), L_ab
    (24 wide) and X + L_ak V (72 wide) in fp32."""
    by_name = {i.name: i.d for i in lowered(SPEC, tmp_path)[1]}
    d = by_name["delta_rule_rwkv7_chunked_rwkv7_k64_cols64_stages2_bf16_sm90a"]
    raw = 2 * 16 * (5 * 72 + 72)
    tiles = 2 * (4 * 16 * 72 + 32 * 72 + 32 * 72 + 64 * 72 + 16 * 72)
    scalars = 4 * (16 * 72 + 64 + 16 * 24 + 16 * 72)  # rows 8 words mod 32: a fragment's float2 rows on distinct banks
    assert (d["lc_pitch"], d["mat_pitch"], d["xr_pitch"]) == (72, 24, 72)
    assert d["smem_bytes"] == 2 * raw + tiles + scalars
    assert (d["threads"], d["chunk"], d["ctas_per_sm"]) == (128, 16, 2)
    assert d["product_spread"] == 40.0
    # The carveout that holds two CTAs an SM (with their 1 KB reserves) and not three, once rounded
    # up to Hopper's 164 KB configuration: ptxas's registers would admit a third, which the
    # launcher must not let in (measured: rwkv7_rows_ab.md).
    per_cta = d["smem_bytes"] + 1024
    assert d["smem_carveout"] == 60 and resources.carveout_bytes(60, ARCHES["sm_90a"]) == 164 * 1024
    assert 2 * per_cta <= 164 * 1024 < 3 * per_cta


def test_a_carveout_that_cannot_hold_the_planned_ctas_is_refused():
    """Two CTAs of 50 KB (51 KB with the reserve) want 45% of 228 KB, which rounds up to the 132 KB
    configuration: two fit, a third does not. One CTA of 7 KB wants 4% (9.1 KB), which rounds up
    to 16 KB: a second would fit, so no carveout holds the kernel at one and the knob is named."""
    arch = ARCHES["sm_90a"]
    assert resources.smem_carveout(2, 50 * 1024, arch, "stages") == 45
    assert resources.carveout_bytes(45, arch) == 132 * 1024
    with pytest.raises(Rejected) as info:
        resources.smem_carveout(1, 7 * 1024, arch, "stages")
    assert info.value.param == "stages" and "rounds to 16 KB, which holds 2" in info.value.reason



def test_rwkv7_chunked_narrower_columns(tmp_path):
    """16 and 32 value columns a CTA (the tune grid's points for few heads): the key-side tiles
    stay 64 wide, the value-side ones (v, Z over V, the state, X + L_ak V) narrow; 48 columns do not
    share the 128 threads evenly and are refused at the grid line."""
    text = SPEC.replace("      k: [64]\n      cols: [64]\n      stages: [2]\n    where:\n      - \"dtype_bytes == 2 and variant == 'rwkv7'\"",
                        "      k: [64]\n      cols: [16, 32, 64]\n      stages: [2]\n    where:\n      - \"dtype_bytes == 2 and variant == 'rwkv7'\"", 1)
    assert text != SPEC
    by_name = {i.name: i.d for i in lowered(text, tmp_path)[1]}
    for cols, pc in ((16, 24), (32, 40)):
        d = by_name[f"delta_rule_rwkv7_chunked_rwkv7_k64_cols{cols}_stages2_bf16_sm90a"]
        raw = 2 * 16 * (5 * 72 + pc)
        tiles = 2 * (4 * 16 * 72 + 32 * 72 + 32 * pc + 64 * pc + 16 * 72)
        scalars = 4 * (16 * 72 + 64 + 16 * 24 + 16 * (cols + 8))
        assert d["smem_bytes"] == 2 * raw + tiles + scalars and d["threads"] == 128
    with pytest.raises(SpecError) as info:
        lowered(text.replace("cols: [16, 32, 64]", "cols: [16, 48]", 1), tmp_path)
    assert info.value.field == "kernels.chunked_rwkv7.grid.cols" and "dividing k" in info.value.message


def test_shared_memory_and_the_first_kernels_layout(tmp_path):
    """A stage holds q, k (rows k + 8 wide, padded), v (cols + 8), M and W (64 + 8) in 16 bits
    and gc in fp32; then the state tile and three exchange tiles. The first kernel puts A over
    the k and q tiles beside T where both fit (k = 128), after M otherwise."""
    by_name = {i.name: i.d for i in lowered(SPEC, tmp_path)[1]}
    wide = by_name["delta_rule_gated_delta_chunked_wide_k128_cols128_warps8_stages2_bf16_sm90a"]
    stage = 2 * 64 * (2 * 136 + 136 + 2 * 72) + 4 * 64
    assert wide["smem_bytes"] == 2 * stage + 2 * (128 * 136 + 3 * 64 * 136) <= 227 * 1024
    assert (wide["warps_m"], wide["warps_n"], wide["ctas_per_sm"]) == (8, 1, 1)
    assert wide["a_over_tiles"] == "true"
    assert wide["prep_smem_bytes"] == 2 * 64 * (2 * 136 + 72) + 4 * 2 * 64
    k64 = by_name["delta_rule_gated_delta_chunked_k64_cols64_warps8_stages2_fp16_sm90a"]
    assert k64["a_over_tiles"] == "false"
    assert k64["prep_smem_bytes"] == 2 * 64 * (2 * 72 + 72) + 4 * 64 * 68 + 4 * 2 * 64
    # the first kernel held to 96 registers at k = 128 (no spills there): 5 CTAs an SM; 128 at k = 64
    assert (wide["prep_ctas_per_sm"], k64["prep_ctas_per_sm"]) == (5, 4)
    assert "__launch_bounds__(PREP_THREADS, 5) prepare_kernel" in (
        ROOT / "generated" / "delta_rule" / "delta_rule_gated_delta_chunked_wide_k128_cols128_warps8_stages2_bf16_sm90a.cu").read_text()


@pytest.mark.parametrize("old,new,field,message", [
    ("      warps: [8]                # 4 row warps (16 steps each) x 2 column warps",
     "      warps: [6]                # 4 row warps (16 steps each) x 2 column warps",
     "kernels.chunked.grid.warps", "a multiple of 4 (16 steps each)"),
    ("      cols: [64]                # value columns per CTA", "      cols: [72]                # value columns per CTA",
     "kernels.chunked.grid.cols", "must be multiples of 16"),
    ("      - \"dtype_bytes == 2 and variant == 'gated_delta'\"\n    covers: \"K <= k and align % 8 == 0\"\n    prefer: [k]\n\n  # The same",
     "      - \"dtype_bytes == 2\"\n    covers: \"K <= k and align % 8 == 0\"\n    prefer: [k]\n\n  # The same",
     "kernels.chunked.grid.k", "solves Gated DeltaNet's scalar-decay chunks, not rwkv7"),
])
def test_impossible_knobs_are_refused_at_their_line(tmp_path, old, new, field, message):
    text = SPEC.replace(old, new, 1)
    assert text != SPEC
    with pytest.raises(SpecError) as info:
        lowered(text, tmp_path)
    err = info.value
    assert err.field == field and message in err.message


def test_the_default_rules(tmp_path):
    spec, insts = lowered(SPEC, tmp_path)
    shipped = [i for i in insts if spec.kernels[i.kind].role != "bench"]

    def pick(B, H, T, K=128, V=128, dtype="bf16", variant="gated_delta", align=8):
        key = {"K": K, "V": V, "T": T, "BH": B * H, "align": align, "sm_count": 132}
        inst = dispatch.select(spec, shipped, key, {"dtype": dtype, "variant": variant})
        return inst.kind if inst else None
    assert pick(8, 16, 4096) == "chunked_wide"      # 128 CTAs of 128 columns: most of a wave
    assert pick(1, 8, 4096) == "chunked"            # 8 such CTAs would leave the GPU idle
    assert pick(8, 16, 255) == "recurrent"          # short sequences keep the step-by-step kind
    assert pick(8, 16, 4096, dtype="fp32") == "recurrent"
    assert pick(8, 16, 4096, variant="rwkv7") == "recurrent"
    assert pick(8, 16, 4096, V=60, align=4) == "narrow"   # rows not whole 16-byte pieces (and few columns)
    assert pick(1, 8, 4096, K=64, V=64) == "chunked"
