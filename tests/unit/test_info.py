"""Unit tier: `python -m attngen.info` reports what the manifest holds, without a GPU."""
import json

import pytest

from attngen import _ext, _jit, info
from tests.conftest import ROOT


def test_summary_counts_the_manifest():
    manifest = json.loads((ROOT / "generated" / "manifest.json").read_text())
    got = info.summary(ROOT)
    assert set(got["families"]) == {row["family"] for row in manifest}
    assert sum(f["instances"] for f in got["families"].values()) == len(manifest)
    chunked = sum(1 for row in manifest if row["kind"] == "chunked" and row["family"] == "causal_linear")
    assert got["families"]["causal_linear"]["kinds"]["chunked"] == chunked > 0
    assert got["arches"] == ["sm90a"]


def test_format_names_every_family_and_the_tuned_table():
    text = info.format_summary(info.summary(ROOT))
    for family in ("causal_linear", "rwkv", "rwkv_grad", "paged", "flash_attention"):
        assert f"  {family}: " in text
    assert "tuned/sm_90a/causal_linear.yaml" in text
    reasons = _jit.cannot_build()  # on this machine: none, or e.g. a torch without CUDA
    assert f"built on first use: {'not possible here: ' + '; '.join(reasons) if reasons else 'on'}\n" in text


def test_first_use_says_why_it_cannot_build(monkeypatch):
    monkeypatch.setenv("ATTNGEN_JIT", "0")
    monkeypatch.setenv("ATTNGEN_LIB", "/nonexistent/attngen_ext.so")
    monkeypatch.setattr(_jit, "_generator", lambda module="jit": None)
    reasons = _jit.cannot_build()
    assert reasons[0] == "ATTNGEN_JIT=0" and reasons[1] == _jit.GENERATOR_MISSING
    text = info.format_summary(info.summary(ROOT))
    assert "extension: /nonexistent/attngen_ext.so (not built, nor can it be built on first use here: make build)" in text
    # Loading names the missing library and every reason the first use cannot build it.
    with pytest.raises(RuntimeError, match=r"(?s)/nonexistent/attngen_ext.so is not built, and it cannot be built on "
                                           r"first use here: ATTNGEN_JIT=0; .*source tree.*make build"):
        _jit.core_library(_ext.library_path())


def test_without_a_prebuilt_extension_info_says_the_first_call_builds_it(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNGEN_LIB", str(tmp_path / "attngen_ext.so"))
    monkeypatch.setenv("ATTNGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(_jit, "cannot_build", lambda: [])
    text = info.format_summary(info.summary(ROOT))
    assert (f"extension: {tmp_path / 'attngen_ext.so'} (not prebuilt: the first call builds its bindings, no kernels, "
            f"into {tmp_path / 'cache' / 'core'})") in text


def test_the_jit_cache_lists_finished_builds_only(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNGEN_CACHE", str(tmp_path))
    done = tmp_path / "sm_90a" / "paged" / "paged_x_d48-0123"
    half = tmp_path / "sm_90a" / "paged" / ".paged_x_d40-4567.tmp"
    for d, name in ((done, "paged_x_d48"), (half, "paged_x_d40")):
        d.mkdir(parents=True)
        (d / "instance.json").write_text(json.dumps({"name": name}))
    (done / "lib.so").write_bytes(b"")
    monkeypatch.setenv("ATTNGEN_JIT", "0")
    text = info.format_summary(info.summary(ROOT))
    assert "built on first use: not possible here: ATTNGEN_JIT=0" in text
    assert f"first-use cache {tmp_path}: 1 instance(s)" in text
    assert "  paged_x_d48" in text and "paged_x_d40" not in text


def test_info_names_the_bindings_built_without_kernels_when_the_cache_has_them(monkeypatch, tmp_path):
    from codegen import core
    monkeypatch.setenv("ATTNGEN_LIB", str(tmp_path / "attngen_ext.so"))
    monkeypatch.setenv("ATTNGEN_CACHE", str(tmp_path / "cache"))
    library = core.library_path(tmp_path / "cache", _jit.toolchain_tag())
    library.parent.mkdir(parents=True)
    library.write_bytes(b"\x7fELF fake")
    text = info.format_summary(info.summary(ROOT))
    assert f"(not prebuilt: its bindings, built without kernels, load from {library})" in text

