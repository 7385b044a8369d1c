"""`python -m codegen build --bench --spec S`: a benchmark extension of one spec's bench-role
kinds (generate_bench with paths), and `--spec` refused without `--bench`."""
import dataclasses

from codegen import pipeline
from codegen.__main__ import main


def test_a_bench_build_of_one_spec_renders_only_its_family(tmp_path, monkeypatch):
    # rendered under tmp_path, not over the benchmark extension's sources in build/bench
    monkeypatch.setattr(pipeline, "BENCH_LAYOUT", dataclasses.replace(pipeline.BENCH_LAYOUT, gen=str(tmp_path / "gen")))
    lowered, _ = pipeline.generate_bench(["specs/flash_attention.yaml"])
    assert [spec.family for spec, _ in lowered] == ["flash_attention"]
    names = [i.name for _, insts in lowered for i in insts]
    assert names and all(n.startswith("flash_attention_") for n in names)
    assert any("_hopper_ws_candidates_d256_" in n for n in names)


def test_spec_without_bench_is_refused(capsys):
    assert main(["build", "--spec", "specs/flash_attention.yaml"]) == 2
    assert "--spec selects the benchmark extension's specs: it needs --bench" in capsys.readouterr().err
