"""Unit tier: expansion, naming, passes, dispatch rendering, write-if-changed, ninja file."""
import json
import os
import time
from pathlib import Path

import pytest

from codegen import expr, pipeline, render
from codegen.arch import ARCHES
from codegen.families import causal_linear, paged
from codegen.lower import lower_one
from codegen.passes import Rejected, banks

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lowered():
    return pipeline.lower(pipeline.expand(pipeline.load()))


def instances(lowered):
    return [i for _, insts in lowered for i in insts]


def test_names_spell_every_parameter_in_order(lowered):
    inst = next(i for i in instances(lowered) if i.kind == "lmha" and i.p["e"] == 64 and i.p["m"] == 64
                and i.a == {"dtype": "fp32", "direction": "fwd"})
    assert inst.name == ("causal_linear_fwd_lmha_e64_m64_cols64_mpt4_tph8_vec4_chunk8_buf2_pad%d_seg0_fp32_sm90a"
                         % inst.p["pad"])
    assert inst.filename == f"causal_linear/{inst.name}.cu"
    assert inst.launcher == f"launch_{inst.name}"


def test_where_filters_the_grid(lowered):
    tuned = {i.name for spec, _ in lowered for rule in spec.tuned for i in rule.instances}
    for inst in instances(lowered):
        if inst.name in tuned:
            continue  # winners of the tuned table come from the tuning grid
        p = inst.p
        if inst.kind == "lmha":
            assert p["cols"] == p["m"] and p["e"] // p["tph"] == 8
        if inst.template == causal_linear.RECURRENT:
            assert p["vec"] * inst.dtype_bytes == 16


def test_bench_kinds_are_built_apart(lowered):
    """A bench-role kind is in no shipped build and no dispatch rule; `--bench` holds only them."""
    bench_lowered = pipeline.lower(pipeline.expand(pipeline.load()), bench=True)
    for (spec, insts), (_, bench) in zip(lowered, bench_lowered):
        roles = {name: kind.role for name, kind in spec.kernels.items()}
        assert all(roles[i.kind] != "bench" for i in insts), spec.file
        assert all(roles[i.kind] == "bench" for i in bench), spec.file
        assert all(roles[rule.kind] != "bench" for rule in spec.dispatch), spec.file
    assert sum(len(b) for _, b in bench_lowered) > 0


def test_every_axis_value_is_instantiated(lowered):
    """Every combination of axis values has instances, and every kind has some (a kind may
    leave out axis values its `where:` excludes, as the tensor-core kinds leave out fp32)."""
    for spec, insts in lowered:
        want = 1
        for values in spec.axes.values():
            want *= len(values)
        assert len({tuple(i.a.values()) for i in insts}) == want, spec.file
        shipped = {name for name, kind in spec.kernels.items() if kind.role != "bench"}
        assert {i.kind for i in insts} == shipped, spec.file


def test_instance_names_carry_every_axis(lowered):
    names = {i.name for i in instances(lowered)}
    assert "rwkv_fwd_contracted_full_head_n64_cols64_mpt4_tph8_vec8_chunk8_buf2_pad16_dsplit0_bf16_sm90a" in names
    assert "rwkv_rev_output_full_head_n64_cols64_mpt4_tph8_vec8_chunk8_buf2_pad16_dsplit0_bf16_sm90a" in names


def test_pad_auto_is_resolved_to_the_cheapest_layout(lowered):
    for inst in instances(lowered):
        if inst.template == causal_linear.RECURRENT:
            p = inst.p
            assert isinstance(p["pad"], int)
            read = min(p["vec"], 4)
            accesses = banks.output_tile_accesses(p["cols"], p["mpt"], p["tph"], p["vec"], read)
            costs = {pad: sum(a.cost(pad) for a in accesses) for pad in range(0, 32, read)}
            assert costs[p["pad"]] == min(costs.values()), inst.name
    # And where a conflict-free layout exists it is found: fp32 lmha e64 x m64.
    inst = next(i for i in instances(lowered) if i.kind == "lmha" and i.p["e"] == 64 and i.p["m"] == 64
                and i.a["dtype"] == "fp32")
    assert banks.ways(inst.d["bank"])["o_write"] == 1 and banks.ways(inst.d["bank"])["o_read"] == 1


def test_rejections_name_the_parameter():
    base = next(i for i in pipeline.expand(pipeline.load())[0][1] if i.kind == "lmha")
    with pytest.raises(Rejected) as info:
        lower_one(base.with_params(tph=3))
    assert info.value.param == "tph"
    with pytest.raises(Rejected) as info:
        lower_one(base.with_params(vec=3))
    assert info.value.param == "vec"
    with pytest.raises(Rejected) as info:
        lower_one(base.with_params(buf=1))
    assert info.value.param == "buf"


def test_bank_model():
    # 32 lanes reading consecutive words: one wavefront. Same bank, different words: 32.
    assert banks.wavefronts([4 * i for i in range(32)], 4) == 1
    assert banks.wavefronts([128 * i for i in range(32)], 4) == 32
    # Broadcast: every lane the same word.
    assert banks.wavefronts([0] * 32, 4) == 1
    # 16-byte accesses: four phases of eight lanes, conflict-free when contiguous.
    assert banks.wavefronts([16 * i for i in range(32)], 16) == 4
    # Row pitch of 64 floats, lanes walking rows: 4-way; a pad of 4 floats does not fix a
    # 4-row walk with 8 columns, a pad the chooser picks does.
    def write(lane, pad):
        return ((lane % 4) * (64 + pad) + lane // 4) * 4
    access = banks.Access("w", 4, write)
    assert access.cost(0) == 4
    assert access.cost(banks.choose_pad([access], unit=4)) == 1
    # Ways count against the phases whose lanes take part: 16-byte pieces 32 bytes apart, half
    # the lanes idle (a row of 8 pieces over 16 lanes), are 2-way, as ncu measured for the
    # paged merge stores (bench/results/h100/bank_check.md: 512 conflicts in 1024 wavefronts).
    half = banks.Access("half", 16, lambda lane, _: None if lane % 16 >= 8 else (lane // 16 * 512 + lane % 16 * 32))
    assert banks.conflict_ways([half], 0) == {"half": 2.0}


def test_expressions_evaluate_and_translate_alike():
    e = expr.parse("E <= e and M <= m and align % vec == 0", {"E", "M", "e", "m", "align", "vec"})
    env = {"E": 48, "M": 64, "e": 64, "m": 64, "align": 4, "vec": 4}
    assert e.evaluate(env) is True
    assert e.to_cpp({"e": 64, "m": 64, "vec": 4, "E": "key.E", "M": "key.M", "align": "key.align"}) == \
        "((key.E <= 64) && (key.M <= 64) && ((key.align % 4) == 0))"
    assert expr.parse("x in (1, 2)", {"x"}).to_cpp() == "(x == 1 || x == 2)"
    with pytest.raises(expr.ExprError):
        expr.parse("__import__('os')", {"x"})
    with pytest.raises(expr.ExprError):
        expr.parse("x if x else 1", {"x"})


def test_dispatch_is_generated_from_the_rules(lowered):
    files = render.render_all(pipeline.TEMPLATES_DIR, lowered)
    text = files["causal_linear/dispatch.cpp"]
    assert "if ((key.BH >= (key.sm_count / 2)))" in text
    # Within a rule, instances are tried smallest bucket first.
    first_rule = text[text.index("when BH >= sm_count // 2"):text.index("-> low_occupancy")]
    block = first_rule[first_rule.index("kFP32 && key.direction == 0"):]
    idx = [int(x) for x in __import__("re").findall(r"kEntries\[(\d+)\]\.covers", block)[:9]]
    names = [pipeline_name for pipeline_name in json.loads(files["manifest.json"])]
    buckets = [(names[i]["params"]["e"], names[i]["params"]["m"]) for i in idx]
    assert buckets == sorted(buckets)
    assert "return nullptr;" in text


def test_every_file_has_a_banner(lowered):
    files = render.render_all(pipeline.TEMPLATES_DIR, lowered)
    for rel, text in files.items():
        if rel.endswith((".cu", ".cuh", ".cpp")):
            assert text.startswith("// Generated by `python -m codegen gen`"), rel
        if rel == "build.ninja":
            assert text.startswith("# Generated by")


def test_generated_tree_is_up_to_date(lowered):
    files = render.render_all(pipeline.TEMPLATES_DIR, lowered)
    for rel, text in files.items():
        assert (ROOT / "generated" / rel).read_text() == text, f"generated/{rel} is stale: run make gen"


def test_write_tree_writes_only_changes(tmp_path):
    first = render.write_tree(tmp_path, {"a.cu": "1", "d/b.cu": "2"})
    assert sorted(first["changed"]) == ["a.cu", "d/b.cu"]
    old = (tmp_path / "a.cu").stat().st_mtime_ns
    time.sleep(0.01)
    second = render.write_tree(tmp_path, {"a.cu": "1", "d/c.cu": "3"})
    assert second["changed"] == ["d/c.cu"] and second["removed"] == ["d/b.cu"]
    assert (tmp_path / "a.cu").stat().st_mtime_ns == old


def test_ninja_file_has_one_edge_per_instance(lowered):
    files = render.render_all(pipeline.TEMPLATES_DIR, lowered)
    ninja = files["build.ninja"]
    for inst in instances(lowered):
        assert f"build build/cubin/{inst.filename[:-3]}.cubin: cubin generated/{inst.filename}" in ninja
        assert f"build build/obj/{inst.filename[:-3]}.o: cuda_object generated/{inst.filename}" in ninja
    assert "mv $out.tmp $out" in ninja  # a failed link leaves the last good library


def test_touching_one_kind_rewrites_only_its_files(tmp_path):
    spec_text = (ROOT / "specs" / "causal_linear.yaml").read_text()
    base = pipeline.render_files(pipeline.lower(pipeline.expand(pipeline.load([ROOT / "specs" / "causal_linear.yaml"]))))
    path = tmp_path / "causal_linear.yaml"
    path.write_text(spec_text.replace("      chunk: [32]", "      chunk: [64]", 1))
    changed = pipeline.render_files(pipeline.lower(pipeline.expand(pipeline.load([path]))))
    def body(text):  # the banner names the spec's path, which differs here
        return None if text is None else text.split("\n", 2)[-1]
    diff = {rel for rel in set(base) | set(changed) if body(base.get(rel)) != body(changed.get(rel))}
    kernels = {rel for rel in diff if rel.endswith(".cu")}
    assert kernels and all("_low_occupancy_" in rel for rel in kernels)
    assert diff - kernels <= {"causal_linear/dispatch.cpp", "manifest.json", "build.ninja"}


def test_flash_tile_layouts_are_conflict_free():
    """The shared tiles of the flash kernels, padded or swizzled, serve ldmatrix reads and the
    epilogue's fragment writes at one wavefront per phase; the Python
    offset mirrors the template's (a permutation within each row, nothing overlaps)."""
    from codegen.passes import tiles as fa
    for d, swizzle in ((64, 1), (96, 0), (128, 1), (128, 0), (256, 1)):
        ways = banks.conflict_ways(fa.bank_accesses(d, 128, fa.layout(d, swizzle)), 0)
        assert ways["ldmatrix"] == ways["o_fragment_write"] == 1.0, (d, swizzle, ways)
        # The fill is conflict-free when rows are whole 128-byte lines; a padded 96-wide row
        # of 13 chunks makes one phase straddle two rows (1.25 ways on average, once per tile).
        assert ways["cp_async_fill"] == (1.0 if d % 64 == 0 else 1.25), (d, swizzle, ways)
        offsets = {fa.tile_offset(r, c, d, swizzle) for r in range(16) for c in range(d)}
        assert len(offsets) == 16 * d and max(offsets) < 16 * fa.pitch(d, swizzle)
    # A 72-wide padded tile has an even pitch in chunks: the model sees the 2-way conflict.
    assert banks.conflict_ways(fa.bank_accesses(72, 128, fa.layout(72, 0)), 0)["ldmatrix"] == 2.0


def test_grouped_decode_tiles_are_conflict_free_and_fit_their_occupancy(lowered):
    """grouped_mma's ldmatrix reads and merge stores are conflict-free in the bank model
    (swizzled rows at D 64/128/192/256, padded rows otherwise, merge rows padded by 8 floats),
    its cp.async fills too where rows are swizzled, and its occupancy estimate fits shared
    memory: the split rule relies on it."""
    arch = ARCHES["sm_90a"]
    insts = [i for _, group in lowered for i in group if i.template == paged.DECODE_MMA]
    assert insts
    for inst in insts:
        d = inst.d
        ways = banks.ways(d["bank"])
        assert ways["ldmatrix"] == 1 and ways["merge_write"] == 1, (inst.name, ways)
        if d["swizzle"]:   # padded rows of 10, 12 or 14 chunks leave the 16-byte fills 1.5-1.75-way
            assert ways["cp_async_fill"] == 1, (inst.name, ways)
        assert d["swizzle"] == (inst.p["d"] % 64 == 0)
        assert 1 <= d["ctas_per_sm"] and d["ctas_per_sm"] * (d["smem_bytes"] + arch.smem_reserved_per_cta) \
            <= arch.smem_per_sm, inst.name


def _chunked(**over):
    """A chunked causal-linear instance (bf16 forward) with the given parameters changed."""
    from codegen.instance import KernelInstance
    params = {"e": 64, "m": 64, "cols": 64, "warps": 4, "stages": 2, "terms": 1, "sbuf": 2, "seg": 256,
              "waves": 1}
    params.update(over)
    dtype = params.pop("dtype", "bf16")
    return KernelInstance(family="causal_linear", op="causal_dot_product", kind="chunked",
                          template="causal_linear/chunked.cu.j2", arch="sm_90a",
                          axes=(("dtype", dtype), ("direction", "fwd")), params=tuple(params.items()),
                          spec_file="specs/causal_linear.yaml")


def test_chunked_pass_rejects_what_the_kernel_cannot_do():
    arch = ARCHES["sm_90a"]
    for over, param in [({"dtype": "fp32"}, "e"), ({"cols": 24}, "cols"), ({"cols": 128, "m": 64}, "cols"),
                        ({"terms": 3}, "terms"), ({"sbuf": 3}, "sbuf"), ({"seg": 100}, "seg"),
                        ({"stages": 1}, "stages"), ({"waves": 0}, "waves"), ({"e": 32, "cols": 16, "m": 16}, "warps"),
                        ({"e": 256, "cols": 64, "m": 64}, "cols")]:
        with pytest.raises(Rejected) as info:
            lower_one(_chunked(**over))
        assert info.value.param == param, (over, info.value)


def test_chunked_layout_and_occupancy():
    """The state splits into whole 16 x 16 blocks per warp; shared memory adds up as the kernel's
    static_assert checks; the resident CTAs the time split counts on fit the SM."""
    arch = ARCHES["sm_90a"]
    d = lower_one(_chunked()).d
    assert (d["warps_m"], d["warps_n"], d["chunk"]) == (4, 1, 64)
    # 2 stages of q, k (swizzled 64-wide) and v, 2 state buffers, 4 warps' 16 staged output rows.
    assert d["smem_bytes"] == 2 * (2 * 64 * (2 * 64 + 64) + 2 * 64 * 64 + 4 * 16 * 64)
    assert d["ctas_per_sm"] * (d["smem_bytes"] + arch.smem_reserved_per_cta) <= arch.smem_per_sm
    d32 = lower_one(_chunked(e=32, m=32, cols=32)).d
    assert (d32["warps_m"], d32["warps_n"], d32["swizzle_c"]) == (2, 2, "false")
    for name, ways in banks.ways(d["bank"]).items():
        assert ways == 1.0, (name, ways)


def _warp_specialized(**over):
    """A hopper_ws flash attention instance (bf16) with the given parameters changed."""
    from codegen.instance import KernelInstance
    params = {"d": 128, "block_m": 128, "block_n": 128, "warpgroups": 2, "stages": 2, "overlap": 1,
              "pingpong": 1, "minb": 1, "tma": 1, "page_ids": 2, "slack": 0}
    params.update(over)
    dtype = params.pop("dtype", "bf16")
    return KernelInstance(family="flash_attention", op="flash_attention", kind="hopper_ws",
                          template="flash_attention/forward_ws.cu.j2", arch="sm_90a",
                          axes=(("dtype", dtype),), params=tuple(params.items()),
                          spec_file="specs/flash_attention.yaml")


def test_warp_specialized_pass_rejects_what_the_kernel_cannot_do():
    for over, param in [({"warpgroups": 1, "block_m": 64}, "pingpong"), ({"pingpong": 2}, "pingpong"),
                        ({"stages": 1}, "stages"), ({"block_m": 192}, "block_m"), ({"block_n": 80}, "block_n"),
                        ({"d": 72}, "d"), ({"d": 320}, "d"), ({"d": 256, "block_n": 128}, "block_n"),
                        ({"warpgroups": 3, "block_m": 192, "d": 64}, "block_n"), ({"stages": 4}, "stages"),
                        ({"tma": 2}, "tma"), ({"page_ids": 3}, "page_ids"), ({"page_ids": 0}, "page_ids"),
                        ({"slack": 16}, "slack"),
                        ({"warpgroups": 5, "block_m": 320, "d": 64, "block_n": 64}, "block_m")]:
        with pytest.raises(Rejected) as info:
            lower_one(_warp_specialized(**over))
        assert info.value.param == param, (over, info.value)


def test_warp_specialized_register_split_and_shared_memory():
    """setmaxnreg hands what the producer releases of the launch's allotment to the consumers
    without oversubscribing the register file; shared memory adds up as the template asserts."""
    arch = ARCHES["sm_90a"]
    for warpgroups, d, block_n, expect in [(2, 128, 128, (64, 216)), (3, 64, 64, (64, 144))]:
        inst = lower_one(_warp_specialized(warpgroups=warpgroups, block_m=64 * warpgroups, d=d, block_n=block_n))
        producer, consumer = inst.d["producer_regs"], inst.d["consumer_regs"]
        assert (producer, consumer) == expect
        threads = inst.d["threads"]
        assert threads == (warpgroups + 1) * 128
        allotted = arch.regs_per_sm // threads // 8 * 8
        assert 128 * producer + 128 * warpgroups * consumer <= allotted * threads
        assert producer % 8 == 0 and consumer % 8 == 0 and 24 <= producer and consumer <= 256
    d = lower_one(_warp_specialized(stages=3)).d
    # 1 KB alignment, Q (128 x 128), 3 stages of K and V (128 x 128 each), Q's and 4 per stage mbarriers.
    assert d["smem_bytes"] == 1024 + 2 * 128 * 128 * (1 + 2 * 3) + 8 * (2 + 4 * 3)
    assert d["smem_bytes"] <= arch.max_smem_per_block
    # the cp.async fills, and the producer's widening of an fp8 cache (tagged in every instance,
    # run where kv_e is set)
    assert set(d["bank"]) == {"cp_async_fill", "fp8_raw_fill", "fp8_raw_read", "fp8_wide_write"}


def test_where_may_compare_axis_values_with_strings():
    e = expr.parse("dtype == 'bf16' and d > 64", {"dtype", "d"}, strings=True)
    assert e.evaluate({"dtype": "bf16", "d": 128}) is True
    assert e.evaluate({"dtype": "fp16", "d": 128}) is False
    with pytest.raises(expr.ExprError, match="integer and boolean constants"):
        expr.parse("dtype == 'bf16'", {"dtype"})   # when: and covers: become C++: no strings
