"""Instances built on first use, on the CPU: the plan (which instance, which reasons), the
sources and their hash, and the cache (a fake compiler: reuse, an interrupted build leaving
nothing, two processes racing for one entry)."""
import multiprocessing
import time
from pathlib import Path

import pytest

from codegen import dispatch, jit, pipeline

PAGED_KEY = {"D": 48, "G": 4, "S": 64, "Q": 1, "KVE": 0, "Hq": 32, "Hkv": 8, "L": 4096, "align": 8, "sm_count": 132}
RWKV_KEY = {"N": 96, "T": 1024, "BH": 64, "align": 8, "sm_count": 132}
RWKV_AXES = {"dtype": "bf16", "direction": "fwd", "keys": "contracted"}


@pytest.fixture(scope="module")
def paged_plan():
    return jit.plan(jit.spec_of("paged_decode"), PAGED_KEY, {"dtype": "bf16"}, "tag")


def test_plan_builds_the_dispatched_kind_at_the_new_head_size(paged_plan):
    inst = paged_plan.inst
    assert inst.p["d"] == 48 and inst.a == {"dtype": "bf16"}
    spec, built = pipeline.lower(pipeline.expand([jit.spec_of("paged_decode")]))[0]
    # the kind the spec dispatches at D=128 for the same key, with the nearest head size's knobs
    at_128 = dispatch.select(spec, built, {**PAGED_KEY, "D": 128}, {"dtype": "bf16"})
    assert inst.kind == at_128.kind
    assert dispatch.covers(spec, inst, PAGED_KEY)
    assert inst.d, "the lowering passes ran"
    entry = paged_plan.sources["paged/jit_entry.cu"]
    assert f'"{inst.name}"' in entry and "key.dtype == DType::kBF16" in entry and "key.D == 48" in entry
    assert inst.filename in paged_plan.sources and "paged/params.cuh" in paged_plan.sources
    assert "paged/split.cuh" in paged_plan.sources, "the split-K merge the instance instantiates is shipped with it"
    assert "paged/bindings.cpp" not in paged_plan.sources


def test_plan_for_rwkv_and_its_refusals():
    spec = jit.spec_of("wkv_scan")
    inst = jit.plan(spec, RWKV_KEY, RWKV_AXES).inst
    assert inst.p["n"] == 96
    with pytest.raises(jit.Unbuildable, match=r"N=97.*tph: n=97 is not divisible"):
        jit.plan(spec, {**RWKV_KEY, "N": 97, "align": 1}, RWKV_AXES)
    with pytest.raises(ValueError, match="covered by a built instance"):
        jit.plan(spec, {**RWKV_KEY, "N": 64}, RWKV_AXES)
    with pytest.raises(jit.SizeIsBuilt, match="n=64 are built; none covers"):
        jit.plan(spec, {**RWKV_KEY, "N": 64, "align": 1}, RWKV_AXES)  # misaligned: not a missing size
    lowered = jit.plan(spec, RWKV_KEY, RWKV_AXES).inst
    assert lowered.d["ept"] % lowered.d["lds"] == 0 and lowered.d["lds"] & (lowered.d["lds"] - 1) == 0


def test_key_numbers_decode_in_the_generated_order():
    spec = jit.spec_of("wkv_scan")
    runtime, axes = jit.decode_key(spec, [96, 1024, 64, 8, 132, 2, 1, 0])
    assert runtime == RWKV_KEY and axes == {"dtype": "bf16", "direction": "rev", "keys": "contracted"}
    generated = (pipeline.GENERATED_DIR / "rwkv" / "dispatch.cpp").read_text()
    assert "return {key.N, key.T, key.BH, key.align, key.sm_count, static_cast<int64_t>(key.dtype)" in generated
    with pytest.raises(ValueError, match="a key of 3 numbers"):
        jit.decode_key(spec, [1, 2, 3])


def test_the_hash_follows_sources_and_toolchain(paged_plan):
    assert jit.digest(paged_plan.sources, "tag") == paged_plan.digest
    assert jit.digest(paged_plan.sources, "other torch") != paged_plan.digest
    changed = {**paged_plan.sources, "paged/params.cuh": paged_plan.sources["paged/params.cuh"] + "//"}
    assert jit.digest(changed, "tag") != paged_plan.digest


def fake_compiler(calls):
    def compile_(plan, src, out):
        calls.append(plan.inst.name)
        assert (src / plan.inst.filename).is_file() and (src / "paged/jit_entry.cu").is_file()
        out.write_bytes(b"\x7fELF fake")
    return compile_


def test_build_once_then_reuse(tmp_path, paged_plan):
    calls, seen = [], []
    path = jit.build(paged_plan, tmp_path, compiler=fake_compiler(calls), on_build=seen.append)
    assert path == jit.library_path(tmp_path, paged_plan) and path.read_bytes() == b"\x7fELF fake"
    assert calls == [paged_plan.inst.name] and seen == [paged_plan]
    assert jit.build(paged_plan, tmp_path, compiler=fake_compiler(calls)) == path
    assert len(calls) == 1, "a finished entry is not rebuilt"
    assert (path.parent / "instance.json").is_file() and (path.parent / "src").is_dir()


def test_built_sources_name_their_place_in_the_finished_entry(tmp_path, paged_plan):
    """Compiled in a temporary directory that is renamed into place, each source starts with a
    #line naming the file's final path, so that line info (ncu's source view) finds it; below
    it, the rendered text unchanged."""
    path = jit.build(paged_plan, tmp_path, compiler=fake_compiler([]))
    src = path.parent / "src"
    for rel, text in paged_plan.sources.items():
        written = (src / rel).read_text()
        if rel.endswith((".cu", ".cuh", ".h")):
            first, rest = written.split("\n", 1)
            assert first == f'#line 1 "{src / rel}"' and rest == text, rel
        else:
            assert written == text, rel


def test_an_interrupted_build_leaves_nothing(tmp_path, paged_plan):
    def failing(plan, src, out):
        out.write_bytes(b"half")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        jit.build(paged_plan, tmp_path, compiler=failing)
    family = tmp_path / "paged"
    assert not jit.library_path(tmp_path, paged_plan).exists()
    assert [p.name for p in family.iterdir()] == [f"{paged_plan.entry_name}.lock"]
    calls = []
    assert jit.build(paged_plan, tmp_path, compiler=fake_compiler(calls)).is_file() and len(calls) == 1


def _race(cache, plan, log):
    def slow(plan_, src, out):
        with open(log, "a") as fh:
            fh.write("build\n")
        time.sleep(0.5)
        out.write_bytes(b"\x7fELF fake")
    return str(jit.build(plan, cache, compiler=slow))


def test_processes_racing_for_one_entry_get_one_build(tmp_path, paged_plan):
    log = tmp_path / "log"
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        paths = pool.starmap(_race, [(tmp_path / "cache", paged_plan, log)] * 4)
    assert len(set(paths)) == 1 and Path(paths[0]).is_file()
    assert log.read_text() == "build\n"


def test_compile_command_builds_one_shared_library(paged_plan, tmp_path, monkeypatch):
    monkeypatch.setenv("NVCC", "/bin/true")
    cmd = jit.compile_command(paged_plan, tmp_path, tmp_path / "lib.so")
    assert cmd[0] == "/bin/true" and "-shared" in cmd and "-gencode=arch=compute_90a,code=sm_90a" in cmd
    assert [c for c in cmd if c.endswith(".cu")] == [str(tmp_path / r) for r in sorted(paged_plan.sources)
                                                      if r.endswith(".cu")]
    monkeypatch.setenv("NVCC", str(tmp_path / "missing-nvcc"))
    with pytest.raises(RuntimeError, match="needs nvcc"):
        jit.nvcc_path()


def test_causal_linear_past_the_buckets_gets_a_recurrent_instance_before_the_fallback():
    spec = jit.spec_of("causal_dot_product")
    key = {"E": 256, "M": 256, "L": 4096, "BH": 16, "align": 4, "sm_count": 132}
    axes = {"dtype": "fp32", "direction": "fwd"}
    built_spec, built = pipeline.lower(pipeline.expand([spec]))[0]
    assert dispatch.select(built_spec, built, key, axes).kind == "generic"
    inst = jit.plan(spec, key, axes).inst
    assert inst.kind == "split_time" and (inst.p["e"], inst.p["m"]) == (256, 256)
    assert jit.plan(spec, {**key, "BH": 128}, axes).inst.kind == "lmha"
    with pytest.raises(jit.SizeIsBuilt):
        jit.plan(spec, {**key, "E": 64, "M": 64, "align": 1}, axes)  # misaligned: the fallback's job
    generated = (pipeline.GENERATED_DIR / "causal_linear" / "dispatch.cpp").read_text()
    body = generated[generated.index("causal_dot_product_select(const"):]
    assert body.index("jit_select(key)") < body.index("-> generic")


def test_without_the_source_tree_the_ops_error_stands(monkeypatch, tmp_path):
    from attngen import _jit
    from codegen import pipeline as pl
    monkeypatch.setattr(pl, "SPECS_DIR", tmp_path / "no-specs")
    assert _jit._generator() is None

    def uncovered():
        raise ValueError("paged_decode: unsupported head size or layout: D=48; no compiled instance covers it")
    # The op's bindings record the uncovered key (the typed signal) before raising.
    monkeypatch.setattr(_jit, "_take_uncovered", lambda: ("paged_decode", [48, 1, 1], ""))
    with pytest.raises(ValueError, match=r"(?s)no compiled instance covers it.*Not built on first use: .*source tree"):
        _jit.call("paged_decode", uncovered)
    monkeypatch.setenv("ATTNGEN_JIT", "0")
    with pytest.raises(ValueError, match="no compiled instance covers it$"):
        _jit.call("paged_decode", uncovered)


def test_only_the_typed_signal_starts_a_build(monkeypatch):
    """An error whose text says 'no compiled instance covers it' but that no dispatch recorded
    (bad input, a forced instance, another op's record) is raised as it is: nothing is built."""
    from attngen import _jit
    monkeypatch.setattr(_jit, "ensure", lambda *a: pytest.fail("nothing may be built"))

    def fails():
        raise ValueError("paged_decode: no compiled instance covers it")
    for record in (("", [], ""), ("wkv_scan", [96], "")):
        monkeypatch.setattr(_jit, "_take_uncovered", lambda record=record: record)
        with pytest.raises(ValueError, match="no compiled instance covers it$"):
            _jit.call("paged_decode", fails)
