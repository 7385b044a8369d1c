"""The extension built without its instances (codegen/core.py), on the CPU: its sources are the
bindings and the full dispatch tables with no launcher and no kernel; its cache entry follows
the generator's inputs and the toolchain; it is built once under a lock; a row the dispatch
picks is built by its name (jit.plan_named), and the runtime asks for exactly that row."""
import re
import shutil

import pytest

from codegen import core, jit, pipeline


@pytest.fixture(scope="module")
def files():
    return core.sources()


def test_the_core_holds_the_full_tables_without_kernels(files):
    manifest_rows = {}
    for spec, instances in pipeline.lower(pipeline.expand(pipeline.load())):
        manifest_rows[spec.family] = [i.name for i in instances]
    assert not [rel for rel in files if rel.endswith(".cu")], "no kernel TU is compiled"
    for family, names in manifest_rows.items():
        table = files[f"{family}/dispatch.cpp"]
        rows = re.findall(r'^    \{"([^"]+)", "[a-z]+", (\S+), covers_\d+, (\S+)\},$', table, re.MULTILINE)
        assert [name for name, _, _ in rows] == names, f"{family}: the rows are the full build's, in its order"
        assert {(launch, workspace) for _, launch, workspace in rows} == {("nullptr", "nullptr")}
        assert "cudaError_t " not in table, f"{family}: no launcher is declared, so none is linked"
        full = (pipeline.GENERATED_DIR / family / "dispatch.cpp").read_text()
        # the same rules and coverage tests as `make gen`'s table, row for row
        strip = lambda text: [ln for ln in text.splitlines() if ln.startswith(("bool covers_", "  if ("))]
        assert strip(table) == strip(full)


def test_the_core_build_file_compiles_host_files_only(files):
    ninja_file = files["build.ninja"]
    assert "cuda_object" not in ninja_file.split("rule link")[1] and " cubin " not in ninja_file.split("rule link")[1]
    assert "build lib/attngen_ext.so: link" in ninja_file
    objects = re.findall(r"^build (build/obj/\S+\.o): cxx_object", ninja_file, re.MULTILINE)
    assert len(objects) == 2 * len(pipeline.load()) + 1  # each op's bindings and table, and the namespace


def test_the_cache_entry_follows_the_generator_inputs_and_the_toolchain(tmp_path, monkeypatch):
    here = core.digest("torch-a/cuda-b")
    assert core.digest("torch-a/cuda-b") == here and core.digest("torch-c/cuda-b") != here
    specs = tmp_path / "specs"
    shutil.copytree(pipeline.SPECS_DIR, specs)
    monkeypatch.setattr(pipeline, "SPECS_DIR", specs)
    assert core.digest("torch-a/cuda-b") == here
    path = specs / "paged.yaml"
    path.write_text(path.read_text() + "\n# an edit\n")
    assert core.digest("torch-a/cuda-b") != here, "an edited spec gets a core of its own"


def test_built_once_then_reused_and_an_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(core, "sources", lambda: {"build.ninja": "# fake\n", "paged/op.cpp": "//\n"})
    calls, counts = [], []

    def fake_ninja(entry):
        calls.append(entry)
        assert (entry / "generated" / "paged" / "op.cpp").is_file()
        (entry / "lib").mkdir()
        (entry / "lib" / "attngen_ext.so").write_bytes(b"\x7fELF fake")

    def failing(entry):
        raise RuntimeError("attngen: building the extension's bindings failed (exit 1)")
    with pytest.raises(RuntimeError, match="bindings failed"):
        core.build(tmp_path, "tag", builder=failing)
    assert not core.library_path(tmp_path, "tag").exists()
    assert [p.name for p in (tmp_path / "core").iterdir()] == [f"{core.digest('tag')}.lock"]
    path = core.build(tmp_path, "tag", builder=fake_ninja, on_build=counts.append)
    assert path == core.library_path(tmp_path, "tag") and path.read_bytes() == b"\x7fELF fake"
    assert counts == [1], "the progress line counts the host files"
    assert core.build(tmp_path, "tag", builder=fake_ninja) == path and len(calls) == 1


def test_a_row_is_built_by_its_name():
    spec = jit.spec_of("paged_decode")
    (built_spec, instances), = pipeline.lower(pipeline.expand([spec]))
    inst = next(i for i in instances if i.a == {"dtype": "bf16"} and i.p["d"] == 128)
    plan = jit.plan_named(spec, inst.name, "tag")
    assert plan.inst.name == inst.name and plan.inst.d == inst.d
    entry = plan.sources["paged/jit_entry.cu"]
    assert f'"{inst.name}"' in entry and inst.filename in plan.sources
    with pytest.raises(jit.Unbuildable, match="no instance named paged_nonesuch"):
        jit.plan_named(spec, "paged_nonesuch", "tag")


def test_the_runtime_builds_the_row_the_dispatch_picked(monkeypatch):
    from attngen import _jit
    asked, runs = [], []
    monkeypatch.setattr(_jit, "ensure", lambda op, key, row="": asked.append((op, key, row)))
    monkeypatch.setattr(_jit, "_take_uncovered", lambda: ("paged_decode", [128, 4], "paged_row_x"))
    monkeypatch.delenv("ATTNGEN_JIT", raising=False)

    def run():
        runs.append(1)
        if len(runs) == 1:
            raise ValueError("paged_decode: instance paged_row_x is not built in this extension")
        return "out"
    assert _jit.call("paged_decode", run) == "out"
    assert asked == [("paged_decode", [128, 4], "paged_row_x")] and len(runs) == 2


def test_a_built_row_is_found_again_without_a_plan(tmp_path, monkeypatch):
    """A later process finds the library of a row by the core's digest and the row's name; an
    edited generator input (another digest) or a library since removed finds nothing."""
    library = tmp_path / "sm_90a" / "paged" / "row-0123" / "lib.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"\x7fELF fake")
    assert core.built_row(tmp_path, "tag", "paged_row") is None
    core.record_row(tmp_path, "tag", "paged_row", library)
    assert core.built_row(tmp_path, "tag", "paged_row") == library
    assert core.built_row(tmp_path, "other torch", "paged_row") is None
    library.unlink()
    assert core.built_row(tmp_path, "tag", "paged_row") is None

    from attngen import _jit
    library.write_bytes(b"\x7fELF fake")
    monkeypatch.setenv("ATTNGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(_jit, "toolchain_tag", lambda: "tag")
    registered = []
    monkeypatch.setattr(_jit, "register", lambda op, path: registered.append((op, path)))
    monkeypatch.setattr(jit, "plan_named", lambda *a, **k: pytest.fail("a recorded row needs no plan"))
    assert _jit.ensure("paged_decode", [128], "paged_row") == library and registered == [("paged_decode", library)]


def test_prebuild_builds_every_row_of_its_families_once_and_records_each(tmp_path, monkeypatch):
    """python -m attngen.prebuild's work (core.prebuild) with a fake ninja and nvcc: the core and
    each row of the named families' tables, every library recorded under its row's name (what a
    first use looks up before it plans), nothing of other families; a second run compiles
    nothing; a family no spec declares is named with the ones that exist."""
    monkeypatch.setattr(core, "sources", lambda: {"build.ninja": "# fake\n"})
    linked, compiled, seen = [], [], []

    def fake_ninja(entry):
        linked.append(entry)
        (entry / "lib").mkdir()
        (entry / "lib" / "attngen_ext.so").write_bytes(b"\x7fELF core")

    def fake_nvcc(plan, src, out):
        compiled.append(plan.inst.name)
        assert (src / plan.inst.filename).is_file()
        out.write_bytes(b"\x7fELF " + plan.inst.name.encode())

    arch_dir = lambda arch: tmp_path / arch  # noqa: E731  (the runtime's _jit.cache_dir)
    families = ["gated_delta_grad", "delta_rule_grad"]
    rows = [i.name for spec, instances in pipeline.lower(pipeline.expand(pipeline.load()))
            if spec.family in families for i in instances]
    assert rows, "the families have rows"
    libraries = core.prebuild(tmp_path, "tag", families, arch_dir, jobs=4, builder=fake_ninja, compiler=fake_nvcc,
                              on_row=lambda plan, library: seen.append(plan.inst.name))
    assert sorted(compiled) == sorted(rows) == sorted(seen) and len(linked) == 1
    for name, library in zip(rows, libraries):
        assert core.built_row(tmp_path, "tag", name) == library and library.read_bytes() == b"\x7fELF " + name.encode()
        assert library.is_relative_to(tmp_path / "sm_90a")
    assert core.library_path(tmp_path, "tag").read_bytes() == b"\x7fELF core"
    assert core.prebuild(tmp_path, "tag", families, arch_dir, builder=fake_ninja, compiler=fake_nvcc) == libraries
    assert len(compiled) == len(rows) and len(linked) == 1, "a second run finds everything built"
    with pytest.raises(ValueError, match=r"\['no_such_family'\]; the specs' families are \[.*'paged'"):
        core.prebuild(tmp_path, "tag", ["paged", "no_such_family"], arch_dir, builder=fake_ninja, compiler=fake_nvcc)
