"""The grouped_mma kind's split knob `unsplit` (templates/paged/decode_mma.cu.j2, `split_of`):
its value reaches the instance and the kernel (above the CTAs that fit an SM it means: always
split), and a negative one is refused at its spec line."""
import pytest

from codegen import pipeline, render
from codegen.errors import SpecError
from tests.conftest import ROOT

SPEC = (ROOT / "specs" / "paged.yaml").read_text()
SHIPPED = "      unsplit: [0]\n"


def lowered(text, tmp_path):
    path = tmp_path / "paged.yaml"
    path.write_text(text)
    (spec, insts), = pipeline.lower(pipeline.expand(pipeline.load([path])), use_tuned=False)
    return spec, insts


def test_unsplit_is_in_the_name_and_the_kernels_split_rule(tmp_path):
    assert SHIPPED in SPEC
    _, insts = lowered(SPEC.replace(SHIPPED, "      unsplit: [2]\n", 1), tmp_path)
    mma = [i for i in insts if i.kind == "grouped_mma"]
    assert mma and all("_unsplit2_" in i.name for i in mma)
    source = (ROOT / "templates" / "paged" / "decode_mma.cu.j2").read_text()
    assert "constexpr int UNSPLIT = {{ p.unsplit }};" in source and "ctas >= UNSPLIT * p.sm_count" in source


def test_a_negative_unsplit_is_refused_at_its_line(tmp_path):
    text = SPEC.replace(SHIPPED, "      unsplit: [-1]\n", 1)
    with pytest.raises(SpecError) as info:
        lowered(text, tmp_path)
    err = info.value
    assert err.field.endswith("unsplit")
    assert err.line == SPEC[:SPEC.index(SHIPPED)].count("\n") + 1
