"""Unit tier: the bank check picks one instance per kernel kind and joins ncu's per-instruction
source counters with nvdisasm's line table through the templates' `// smem:` tags. The fixture
is a real run on the H100 (bench/bankprobe/patterns.cu under ncu 2025.3.1): patterns whose
wavefronts are known in advance."""
import json

from bench import bank_check
from tests.conftest import ROOT

MANIFEST = json.loads((ROOT / "generated" / "manifest.json").read_text())
FIXTURE = ROOT / "tests" / "fixtures" / "bank_probe"


def test_one_representative_per_kind():
    reps = bank_check.representatives(MANIFEST)
    kinds = {(r["family"], r["kind"]) for r in MANIFEST}
    assert {(r["family"], r["kind"]) for r in reps} == kinds
    assert all(r.get("direction", "fwd") == "fwd" for r in reps)
    # a kind with a padding knob is represented by an instance whose padding saves wavefronts,
    # so that its unpadded twin shows the difference on the hardware
    padded = [r for r in reps if bank_check.needs_twin(r)]
    assert padded and all(bank_check._saved(r) > 0 for r in padded)


def test_probe_join_reads_the_hardware_right():
    rows = bank_check.probe_summary((FIXTURE / "sass.csv").read_text(), (FIXTURE / "dis_gi.txt").read_text())
    by = {r["access"]: r for r in rows}
    assert set(by) == {a.name for a in bank_check.PROBE}, "every probe instruction is tagged, every tag seen"
    assert all(r["verdict"] == "agrees" for r in rows), rows
    # the known answers: 32-way column reads, conflict-free once padded, 4 wavefronts per
    # 16-byte request, the XOR swizzle conflict-free where the plain rows are 16-way
    assert (by["column_stride32"]["measured"], by["column_padded"]["measured"]) == (32, 1)
    assert (by["vector16"]["measured"], by["xor_swizzled"]["measured"], by["unswizzled_rows"]["measured"]) == (4, 4, 32)
    assert by["unswizzled_rows"]["opcodes"] == ["LDS.64"]


def test_line_table_keeps_the_inline_chain():
    table = bank_check.parse_line_table((FIXTURE / "dis_gi.txt").read_text())
    assert table["_Z8patternsPfi"][0x850] == [("/work/main/bench/bankprobe/patterns.cu", 23)]
    nested = bank_check.parse_line_table(
        '\t.section\t.text._Z1kv,"ax",@progbits\n'
        '\t//## File "/g/common/device.cuh", line 44 inlined at "/g/causal_linear/x.cu", line 114\n'
        '\t//## File "/g/causal_linear/x.cu", line 114 inlined at "/g/causal_linear/x.cu", line 150\n'
        '\t//## File "/g/causal_linear/x.cu", line 150\n'
        '        /*0110*/                   LDS.128 R4, [R5+0x40] ;\n'
        '        /*0120*/                   LDS.128 R8, [R5+0x80] ;\n'
        '\t//## File "/g/causal_linear/x.cu", line 151\n'
        '        /*0130*/                   STS [R5], R8 ;\n')
    chain = [("/g/common/device.cuh", 44), ("/g/causal_linear/x.cu", 114), ("/g/causal_linear/x.cu", 150)]
    assert nested["_Z1kv"][0x110] == nested["_Z1kv"][0x120] == chain
    assert nested["_Z1kv"][0x130] == [("/g/causal_linear/x.cu", 151)]


def test_compare_flags_what_disagrees_and_what_nothing_declares():
    model = {"a": {"width": 4, "wavefronts": 2, "ideal": 1}, "fill": {"width": 16, "wavefronts": 4, "ideal": 4},
             "never": {"width": 4, "wavefronts": 1, "ideal": 1}}
    measured = {"a": {"executed": 10, "wavefronts": 23, "ideal": 10, "opcodes": {"LDS"}},
                "fill": {"executed": 10, "wavefronts": 320, "ideal": 40, "opcodes": {"LDGSTS.E.BYPASS.128"}},
                "stray": {"executed": 5, "wavefronts": 5, "ideal": 5, "opcodes": {"STS"}},
                None: {"executed": 4, "wavefronts": 4, "ideal": 4, "opcodes": {"LDS"}}}
    verdicts = {r["access"]: r["verdict"] for r in bank_check.compare(model, measured)}
    assert verdicts == {"a": "DIFFERS", "fill": "global lines", "never": "not executed", "stray": "undeclared",
                        "(untagged)": "untagged"}
    # within 10% agrees
    measured["a"]["wavefronts"] = 21
    assert bank_check.compare(model, measured)[0]["verdict"] == "agrees"
    # conflict-free both ways, but ptxas split the access into narrower instructions
    measured["a"].update(wavefronts=30, ideal=15)
    assert bank_check.compare(model, measured)[0]["verdict"] == "ways agree"


def test_an_access_judged_at_its_own_width_when_a_neighbour_shares_its_line():
    """rwkv wide_head's vo_read line, as ncu and nvdisasm saw it on the H100: eight LDS.64 of the
    access (1 wavefront each) and two hoisted LDS.128 of the next step's q and decay reads (4 and
    8) under the same line."""
    from bench.bank_check import access_bytes, judge
    assert [access_bytes(op) for op in ("LDS.64", "LDS.128", "STS.U16", "LDS", "LDSM.16.M88.4")] == [8, 16, 2, 4, None]
    line = {"executed": 10, "wavefronts": 20, "ideal": 16, "opcodes": {"LDS.64", "LDS.128"},
            "by_width": {8: {"executed": 8, "wavefronts": 8, "ideal": 8}, 16: {"executed": 2, "wavefronts": 12, "ideal": 8}}}
    assert judge(1, 1, line, 8) == "agrees at its width"
    line["by_width"][8]["wavefronts"] = 16                      # the access itself 2-way: a real miss
    assert judge(1, 1, line, 8) == "DIFFERS"
