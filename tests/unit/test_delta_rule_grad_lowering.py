"""The delta-rule backward's lowering (codegen/families/delta_rule_grad.py): what it derives for
the reduce-scatter and shared memory, and the knobs it refuses, named at their spec line."""
import pytest

from codegen import pipeline
from codegen.errors import SpecError
from tests.conftest import ROOT

SPEC = (ROOT / "specs" / "delta_rule_grad.yaml").read_text()


def lowered(text, tmp_path):
    path = tmp_path / "delta_rule_grad.yaml"
    path.write_text(text)
    return [i for _, insts in pipeline.lower(pipeline.expand(pipeline.load([path]))) for i in insts]


def test_the_reduce_scatter_halves_down_to_one_float4_group(tmp_path):
    """Halving rounds while a lane holds more than a group and columns remain; the rest add up
    plainly. 16 entries over 8 columns (k 64, 4 lanes): 2 halvings, then 1 plain round."""
    by_name = {i.name: i.d for i in lowered(SPEC, tmp_path)}
    k64 = by_name["delta_rule_grad_recurrent_k64_cols64_tph2_sub4_bf16_sm90a"]   # 32 entries, 16 columns a warp
    assert (k64["ept"], k64["log_warp_cols"], k64["halvings"], k64["kept"]) == (32, 4, 3, 4)
    narrow = by_name["delta_rule_grad_narrow_k64_cols32_tph8_sub8_bf16_sm90a"]   # 8 entries, 4 columns a warp
    assert (narrow["ept"], narrow["log_warp_cols"], narrow["halvings"], narrow["kept"]) == (8, 2, 1, 4)
    # staged vectors, v and do, the states of `sub` steps, per-warp rows of the 5 gradients
    assert k64["smem_bytes"] == 4 * 4 * (5 * 64 + 2 * 64 + 64 * 64 + 4 * 5 * 64)


@pytest.mark.parametrize("old,new,field,message", [
    ("      sub: [8]", "      sub: [12]", "kernels.narrow.grid.sub",
     "sub=12 must be a power of two dividing the checkpoint interval 64"),
    ("      sub: [8]", "      sub: [32]", "kernels.narrow.grid.sub", "bytes of shared memory exceed"),
])
def test_impossible_knobs_are_refused_at_their_line(tmp_path, old, new, field, message):
    text = SPEC.replace(old, new, 1)
    assert text != SPEC
    with pytest.raises(SpecError) as info:
        lowered(text, tmp_path)
    err = info.value
    assert err.field == field and message in err.message
    assert err.line == next(i + 1 for i, line in enumerate(text.splitlines()) if line == new)
