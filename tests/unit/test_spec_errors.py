"""Unit tier: every bad-spec path stops generation with file:line, the field, and status 2,
leaving generated/ untouched."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from codegen import pipeline
from codegen.errors import SpecError

ROOT = Path(__file__).resolve().parents[2]
SPEC = (ROOT / "specs" / "causal_linear.yaml").read_text()


def write(tmp_path, text):
    path = tmp_path / "causal_linear.yaml"
    path.write_text(text)
    return path


def error_for(tmp_path, text) -> SpecError:
    with pytest.raises(SpecError) as info:
        pipeline.lower(pipeline.expand(pipeline.load([write(tmp_path, text)])))
    return info.value


def line_of(text, needle, nth=0):
    lines = [i + 1 for i, line in enumerate(text.splitlines()) if needle in line]
    return lines[nth]


def test_the_real_spec_loads_and_lowers():
    lowered = pipeline.lower(pipeline.expand(pipeline.load()))
    names = [i.name for _, insts in lowered for i in insts]
    assert len(names) == len(set(names)) > 50


def test_yaml_syntax_error(tmp_path):
    text = SPEC.replace("arch: sm_90a", "arch: [sm_90a")
    err = error_for(tmp_path, text)
    assert err.field == "yaml" and err.line is not None and "syntax error" in err.message


def test_unknown_key(tmp_path):
    text = SPEC.replace("      buf: [2]", "      buff: [2]", 1)
    err = error_for(tmp_path, text)
    assert err.field == "kernels.lmha.grid.buff" and "unknown key" in err.message
    assert err.line == line_of(text, "buff:")


def test_wrong_type(tmp_path):
    text = SPEC.replace("      e: [32, 64, 128]          #", "      e: [32, sixty, 128]          #", 1)
    err = error_for(tmp_path, text)
    assert err.field == "kernels.lmha.grid.e" and "positive integer" in err.message
    assert err.line == line_of(text, "sixty")


def test_missing_field(tmp_path):
    text = SPEC.replace('    covers: "E <= emax"\n', "")
    err = error_for(tmp_path, text)
    assert err.field == "kernels.generic.covers" and "missing" in err.message


def test_e_not_divisible_by_vector_width(tmp_path):
    text = SPEC.replace("      e: [32, 64, 128]          #", "      e: [34, 64, 128]          #", 1)
    text = text.replace('      - "e // tph == 8"           # 8 x 4', '      - "e // tph >= 8"           # 8 x 4')
    err = error_for(tmp_path, text)
    assert "e=34 is not divisible by the vector width vec=4" in err.message
    assert err.field == "kernels.lmha.grid.e" and err.line == line_of(text, "e: [34,")


def test_shared_memory_over_the_limit(tmp_path):
    text = SPEC.replace("      chunk: [32]", "      chunk: [512]")
    err = error_for(tmp_path, text)
    assert err.field == "kernels.low_occupancy.grid.chunk" and "exceeds the sm_90a limit" in err.message
    assert err.line == line_of(text, "chunk: [512]")


def test_where_that_does_not_parse(tmp_path):
    text = SPEC.replace('"cols == m"', '"cols == = m"')
    err = error_for(tmp_path, text)
    assert err.field == "kernels.lmha.where[0]" and "does not parse" in err.message
    assert err.line == line_of(text, "cols == = m")


def test_where_with_unknown_name(tmp_path):
    text = SPEC.replace('"cols == m"', '"cols == n"')
    err = error_for(tmp_path, text)
    assert "unknown name 'n'" in err.message


def test_two_instances_with_one_name(tmp_path):
    dup = SPEC.replace("  low_occupancy:\n", "  low_occupancy:\n", 1)
    # A second kind named like the first cannot exist in YAML (duplicate key), so the same
    # grid under the same kind name twice is the duplicate-key error:
    text = dup.replace("  generic:\n", "  lmha:\n", 1)
    err = error_for(tmp_path, text)
    assert "duplicate key" in err.message and err.field == "lmha"


def test_template_that_does_not_exist(tmp_path):
    text = SPEC.replace("template: causal_linear/generic.cu.j2", "template: causal_linear/nope.cu.j2")
    err = error_for(tmp_path, text)
    assert err.field == "kernels.generic.template" and "no lowering for template" in err.message


def test_unknown_dispatch_kind(tmp_path):
    text = SPEC.replace("  - kind: generic", "  - kind: generik")
    err = error_for(tmp_path, text)
    assert err.field == "dispatch[4].kind" and "unknown kernel kind" in err.message


def test_make_gen_exits_2_and_leaves_generated_alone(tmp_path):
    """The CLI on a broken copy of the tree: status 2, message with file:line, nothing written."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "codegen", tree / "codegen")
    shutil.copytree(ROOT / "templates", tree / "templates")
    shutil.copytree(ROOT / "specs", tree / "specs")
    shutil.copytree(ROOT / "generated", tree / "generated")
    before = {p: p.read_bytes() for p in (tree / "generated").rglob("*") if p.is_file()}
    spec = tree / "specs" / "causal_linear.yaml"
    spec.write_text(spec.read_text().replace("      chunk: [32]", "      chunk: [512]"))
    proc = subprocess.run([sys.executable, "-m", "codegen", "gen"], cwd=tree, capture_output=True, text=True)
    assert proc.returncode == 2
    assert re.search(r"specs/causal_linear\.yaml:\d+: kernels\.low_occupancy\.grid\.chunk: ", proc.stderr)
    after = {p: p.read_bytes() for p in (tree / "generated").rglob("*") if p.is_file()}
    assert before == after


PAGED = (ROOT / "specs" / "paged.yaml").read_text()


def paged_error(tmp_path, text) -> SpecError:
    path = tmp_path / "paged.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        pipeline.lower(pipeline.expand(pipeline.load([path])))
    return info.value


def test_paged_heads_per_thread_must_divide_heads(tmp_path):
    text = PAGED.replace('"hpt == 2 and heads >= 2 or hpt == 1 and heads == 1"', '"hpt == 2"', 1)
    err = paged_error(tmp_path, text)
    assert err.line == line_of(text, "hpt: [2, 1]") and err.field == "kernels.single_pass.grid.hpt"
    assert "must be a power of two dividing heads=1" in str(err)


def test_paged_partition_must_hold_whole_tiles(tmp_path):
    text = PAGED.replace("part: [512]", "part: [500]")
    err = paged_error(tmp_path, text)
    assert err.line == line_of(text, "part: [500]") and err.field == "kernels.split_k.grid.part"
    assert "multiple of tile=32" in str(err)


def test_paged_ring_over_the_shared_memory_limit(tmp_path):
    text = PAGED.replace("stages: [3]", "stages: [40]", 1)
    err = paged_error(tmp_path, text)
    assert err.field == "kernels.single_pass.grid.tile" and "exceeds the sm_90a limit" in str(err)


def test_paged_grouped_mma_cache_exponent_bits(tmp_path):
    text = PAGED.replace("kv_e: [0, 4, 5]", "kv_e: [0, 3]")
    err = paged_error(tmp_path, text)
    assert err.line == line_of(text, "kv_e: [0, 3]") and err.field == "kernels.grouped_mma.grid.kv_e"
    assert "kv_e=3: 0 (the cache has q's dtype), 4 (fp8 e4m3) or 5 (fp8 e5m2)" in str(err)


def test_paged_grouped_mma_rows_over_the_register_file(tmp_path):
    text = PAGED.replace('      - "mt == 1 or d <= 128"', '      - "mt == 1 or d <= 256"')
    err = paged_error(tmp_path, text)
    assert err.field == "kernels.grouped_mma.grid.mt" and "registers per thread (output 192" in str(err)


def test_paged_merge_rows_are_a_power_of_two_within_a_block(tmp_path):
    text = PAGED.replace("      merge_rows: [1]\n      pdl: [1]\n    where:", "      merge_rows: [3]\n      pdl: [1]\n    where:", 1)
    err = paged_error(tmp_path, text)
    assert err.line == line_of(text, "merge_rows: [3]") and err.field == "kernels.split_k.grid.merge_rows"
    assert "merge_rows=3 must be a power of two" in str(err)
    text = PAGED.replace("      merge_rows: [1]\n      pdl: [1]\n    where:", "      merge_rows: [64]\n      pdl: [1]\n    where:", 1)
    assert "merge_rows * d / 4 = 1280 threads <= 1024" in str(paged_error(tmp_path, text))  # d 80


def test_paged_single_pass_has_no_merge(tmp_path):
    text = PAGED.replace("      merge_rows: [0]           # no merge\n      pdl: [0]", "      merge_rows: [0]\n      pdl: [1]", 1)
    err = paged_error(tmp_path, text)
    assert err.field == "kernels.single_pass.grid.merge_rows" and "a single-pass kind has no merge" in str(err)


def test_paged_pdl_needs_sm_90():
    from codegen.arch import ARCHES
    from codegen.families import paged
    from codegen.passes import Rejected
    knobs = {"d": 128, "merge_rows": 4, "pdl": 1}
    assert paged._merge(knobs, True, ARCHES["sm_90a"]) == {"pdl": "true", "merge_threads": 128}
    with pytest.raises(Rejected, match="pdl=1 needs programmatic dependent launch .* not sm_80") as info:
        paged._merge(knobs, True, ARCHES["sm_80"])
    assert info.value.param == "pdl"


FLASH = (ROOT / "specs" / "flash_attention.yaml").read_text()


def flash_error(tmp_path, text) -> SpecError:
    path = tmp_path / "flash_attention.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        pipeline.lower(pipeline.expand(pipeline.load([path])))
    return info.value


def test_flash_swizzle_needs_whole_128_byte_lines(tmp_path):
    text = FLASH.replace('"swizzle == 1 and d % 64 == 0 or swizzle == 0 and d % 64 != 0"', '"swizzle == 1"')
    err = flash_error(tmp_path, text)
    assert err.line == line_of(text, "swizzle: [1, 0]") and err.field == "kernels.mma_sync.grid.swizzle"
    assert "d=96 is not a multiple of 64" in str(err)


def test_flash_rows_must_split_into_m_tiles(tmp_path):
    text = FLASH.replace("block_m: [128]", "block_m: [96]", 1)
    err = flash_error(tmp_path, text)
    assert err.field == "kernels.mma_sync.grid.block_m" and "whole 16-row m-tiles over 4 warps" in str(err)


def test_flash_register_estimate_rejects_wide_tiles(tmp_path):
    text = FLASH.replace("block_n: [32, 64, 128]", "block_n: [32, 64, 128, 512]", 1).replace("(64, 4, 64, 0)", "(64, 4, 512, 0)")
    err = flash_error(tmp_path, text)
    assert err.field == "kernels.mma_sync.grid.block_m" and "registers per thread" in str(err)


def test_flash_shared_memory_over_the_limit(tmp_path):
    text = FLASH.replace("stages: [2]", "stages: [4]", 1)
    err = flash_error(tmp_path, text)
    assert err.field == "kernels.mma_sync.grid.stages" and "exceeds the sm_90a limit" in str(err)


RWKV = (ROOT / "specs" / "rwkv.yaml").read_text()


def rwkv_error(tmp_path, text) -> SpecError:
    path = tmp_path / "rwkv.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        pipeline.load([path])
    return info.value


def test_grad_rkwu_knobs_are_grid_axes_checked_where_they_are_set(tmp_path):
    """grad_rkwu's knobs are grid axes of specs/rwkv_grad.yaml; a value its template cannot build
    names file:line and the grid field, with the instance."""
    grad = (ROOT / "specs" / "rwkv_grad.yaml").read_text()
    for needle, bad, field, why in (("      minb: [2]", "      minb: [9]", "minb", "1 to 4"),
                                    ("      l: [8]", "      l: [7]", "l", "dividing"),
                                    ("      threads: [128]", "      threads: [100]", "threads", "whole number of warps")):
        text = grad.replace(needle, bad)
        path = tmp_path / "rwkv_grad.yaml"
        path.write_text(text)
        with pytest.raises(SpecError) as info:
            pipeline.lower(pipeline.expand(pipeline.load([path])))
        err = info.value
        assert err.field == f"kernels.grad_rkwu.grid.{field}" and err.line == line_of(text, bad) and why in err.message
    # The old `fixed:` section is gone: it is an unknown top-level key now.
    err = rwkv_error(tmp_path, RWKV + "\nfixed:\n  grad_rkwu:\n    e: 8\n")
    assert err.field == "fixed" and "unknown" in err.message




@pytest.mark.parametrize("old,new,field,message", [
    ('    k: "[B, H, L, E]"', '    kk: "[B, H, L, E]"', "op.args.kk", "is not a tensor argument of the schema"),
    ('    k: "[B, H, L, E]"', '    reverse: "[B]"', "op.args.reverse", "is not a tensor argument of the schema"),
    ('    v: "[B, H, L, M]"', '    v: "B, H, L, M"', "op.args.v", "expected dim names in brackets"),
    ('    v: "[B, H, L, M]"', '    v: {shape: "[B, H, L, M]", dtype: int8}', "op.args.v", "expected like"),
])
def test_declared_tensor_checks_name_the_argument(tmp_path, old, new, field, message):
    text = SPEC.replace(old, new, 1)
    err = error_for(tmp_path, text)
    assert err.field == field and message in err.message
    assert err.line == line_of(text, new.strip())


def test_declared_checks_generate_the_agreeing_dims():
    """op.args of the real specs: a dim name shared with an earlier tensor is checked against
    it, an optional tensor binds nothing, float32 and any_strides are carried over."""
    from codegen import render
    spec = next(s for s in pipeline.load() if s.family == "delta_rule")
    lines = render.declared_checks_cpp(spec)
    assert 'detail::declared_agree(op, "v", a.v, "q", a.q, {{0, 0}, {1, 1}, {2, 2}}, "B, T, H");' in lines
    assert '  detail::declared_agree(op, "state", (*a.state), "v", a.v, {{3, 3}}, "V");' in lines
    assert '  detail::declared_float32(op, "state", (*a.state), "[B, H, K, V]");' in lines
    assert not any("last_contiguous" in line and "state" in line for line in lines)
    assert render.declared_checks_cpp(next(s for s in pipeline.load() if s.family == "paged")) == []


def test_a_grid_value_that_where_filters_out_is_warned_about(tmp_path):
    """README's worked example of adding a variant once added values that `where:` removed
    without a word; now generation warns, naming file:line and the value."""
    from codegen import expand
    text = SPEC.replace("      tph: [4, 8, 16]           # threads per column group", "      tph: [4, 8, 16, 32]       # threads per column group", 1)
    assert text != SPEC
    spec, = pipeline.load([write(tmp_path, text)])
    warnings = expand.unused_grid_values(spec)
    line = line_of(text, "tph: [4, 8, 16, 32]")
    assert warnings == [f"{spec.file}:{line}: kernels.lmha.grid.tph: value 32 leaves no instance after the kind's "
                        f"where: constraints"]


def test_the_real_specs_keep_every_grid_value():
    from codegen import expand
    assert [w for spec in pipeline.load() for w in expand.unused_grid_values(spec)] == []


def test_unknown_family_lists_the_known_ones(tmp_path):
    text = SPEC.replace("family: causal_linear", "family: causal_linaer", 1)
    err = error_for(tmp_path, text)
    assert err.field == "family" and "unknown family 'causal_linaer'; expected one of [" in err.message
    assert "'delta_rule'" in err.message and "'paged'" in err.message


def test_an_empty_grid_list_says_empty(tmp_path):
    text = SPEC.replace("      tph: [4, 8, 16]           # threads per column group", "      tph: []           # threads per column group", 1)
    err = error_for(tmp_path, text)
    assert err.field == "kernels.lmha.grid.tph" and "got an empty list" in err.message


@pytest.mark.parametrize("where,message", [
    ('"e // (tph - tph) == 8"', "division by zero"),
    ('"((1,) * 100000000000000) != ()"', "arithmetic takes integers"),
    ('"e * 4611686018427387904 * 4 > 0"', "leaves the 64-bit range"),
])
def test_a_where_that_cannot_be_evaluated_names_its_own_line(tmp_path, where, message):
    text = SPEC.replace('      - "e // tph == 8"           # 8 x 4', f'      - {where}           # 8 x 4', 1)
    assert text != SPEC
    err = error_for(tmp_path, text)
    assert err.field.startswith("kernels.lmha.where[") and message in err.message
    assert err.line == line_of(text, where)


def test_spill_bytes_is_an_expression_of_the_grid(tmp_path):
    """A kind's spill_bytes: what the compile tier lets each of its instances spill (0 unless said)."""
    text = SPEC.replace('    covers: "E <= e and M <= m and align % vec == 0"',
                        '    covers: "E <= e and M <= m and align % vec == 0"\n    spill_bytes: "4 * (e == 128)"', 1)
    assert text != SPEC
    lowered = pipeline.lower(pipeline.expand(pipeline.load([write(tmp_path, text)])), use_tuned=False)
    allowed = {i.name: i.d["spill_bytes_allowed"] for _, insts in lowered for i in insts}
    lmha = {n: a for n, a in allowed.items() if "_lmha_" in n}
    assert lmha and all(a == (4 if "_e128_" in n else 0) for n, a in lmha.items())
    assert any(a == 0 for n, a in allowed.items() if "_lmha_" not in n)


def test_spill_bytes_naming_an_unknown_parameter(tmp_path):
    text = SPEC.replace('    covers: "E <= e and M <= m and align % vec == 0"',
                        '    covers: "E <= e and M <= m and align % vec == 0"\n    spill_bytes: "4 * (width == 128)"', 1)
    err = error_for(tmp_path, text)
    assert err.field == "kernels.lmha.spill_bytes" and "width" in err.message
    assert err.line == line_of(text, "spill_bytes:")


def test_an_output_dtype_conditional_on_fp8_inputs():
    """`fp8(<tensor>)` in an output expression: the flash forward's bf16 output of e4m3 inputs."""
    from codegen import op
    args, _ = op.parse_schema("f", "f(Tensor q, Tensor? s=None, int n=0) -> Tensor")
    out = op.output(args, "o", {"shape": "q", "dtype": "bfloat16 if fp8(q) else q"}, "op.outputs.o")
    assert out.dtype_cpp == "(at::isFloat8Type(a.q.scalar_type()) ? at::kBFloat16 : a.q.scalar_type())"
    for bad in ("bfloat16 if fp8(n) else q", "bfloat16 if fp8(s) else q"):
        with pytest.raises(op.DeclError, match=r"expected the name of a \(non-optional\) tensor argument"):
            op.output(args, "o", {"shape": "q", "dtype": bad}, "op.outputs.o")
    with pytest.raises(op.DeclError, match=r"`fp8\(<tensor argument>\)`"):
        op.output(args, "o", {"shape": "q", "dtype": "bfloat16 if wide(q) else q"}, "op.outputs.o")
