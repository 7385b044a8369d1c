"""Unit tier: `python -m attngen.info` reports what the manifest holds, without a GPU."""
import json

from attngen import info
from tests.conftest import ROOT


def test_summary_counts_the_manifest():
    manifest = json.loads((ROOT / "generated" / "manifest.json").read_text())
    got = info.summary(ROOT)
    assert set(got["families"]) == {row["family"] for row in manifest}
    assert sum(f["instances"] for f in got["families"].values()) == len(manifest)
    chunked = sum(1 for row in manifest if row["kind"] == "chunked")
    assert got["families"]["causal_linear"]["kinds"]["chunked"] == chunked > 0
    assert got["arches"] == ["sm90a"]


def test_format_names_every_family_and_the_tuned_table():
    text = info.format_summary(info.summary(ROOT))
    for family in ("causal_linear", "rwkv", "paged", "flash_attention"):
        assert f"  {family}: " in text
    assert "tuned/sm_90a/causal_linear.yaml" in text and "jit cache: none" in text
