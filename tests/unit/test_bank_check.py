"""Unit tier: the bank check picks one instance per kernel kind and reads ncu's CSV by the
instance names that the mangled kernel names carry."""
import json

from bench import bank_check
from tests.conftest import ROOT

MANIFEST = json.loads((ROOT / "generated" / "manifest.json").read_text())


def test_one_representative_per_kind():
    reps = bank_check.representatives(MANIFEST)
    kinds = {(r["family"], r["kind"]) for r in MANIFEST}
    assert {(r["family"], r["kind"]) for r in reps} == kinds
    assert all(r.get("direction", "fwd") == "fwd" for r in reps)


def test_summary_sums_the_instance_kernels():
    rep = bank_check.representatives(MANIFEST)[0]
    name = rep["name"]
    lines = ['==PROF== Disconnected', '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"']
    for i, kernel in enumerate((f"_ZN7attngen_GLOBAL__N__1_{name}_cu_2kernelEv", "_Z9other_kernelv")):
        for m, v in zip(bank_check.METRICS, ("1,000", "10", "200", "0")):
            lines.append(f'"{i}","{kernel}","{m}","","{v}"')
    rows = bank_check.summarize("\n".join(lines) + "\n", MANIFEST)
    mine = next(r for r in rows if r["instance"] == name)
    assert (mine["kernels"], mine["ld_wavefronts"], mine["ld_conflicts"], mine["st_wavefronts"]) == (1, 1000, 10, 200)
    assert "1.0%" in bank_check.markdown(rows, {})
