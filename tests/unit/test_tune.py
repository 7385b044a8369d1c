"""Unit tier for the tuner, on the CPU: selection and tie rules, the cache (resume, re-time
only what changed), and the tuned table turned into dispatch rules by `make gen`."""
import dataclasses
import math
from pathlib import Path

import pytest

from codegen import dispatch, families, pipeline, render
from codegen.errors import SpecError
from codegen import tuned as table
from codegen.tune import cache, candidates, select

ROOT = Path(__file__).resolve().parents[2]


def m(name, ms, spread=0.0, simple=0):
    return select.Measurement(name, ms, spread, (simple, name))


def test_fastest_wins_when_clear_of_the_spread():
    choice = select.choose([m("a", 1.0, 0.01, simple=1), m("b", 1.2, 0.01, simple=0)])
    assert choice.winner.name == "a" and choice.runner_up.name == "b"


def test_tie_within_spread_goes_to_the_simpler():
    choice = select.choose([m("fast", 1.00, 0.05, simple=5), m("simple", 1.03, 0.02, simple=0)])
    assert choice.winner.name == "simple" and choice.tied == ("fast", "simple")


def test_a_near_tie_under_the_noise_floor_goes_to_the_simpler():
    # The case seen on the H100: 0.0904 vs 0.0905 ms with back-to-back spreads near zero.
    choice = select.choose([m("seg512", 0.0904, 0.0, simple=1), m("seg128", 0.0905, 0.0001, simple=0)])
    assert choice.winner.name == "seg128"
    # A clear gap still goes to the fastest.
    assert select.choose([m("fast", 0.0900, 0.0, simple=1), m("simple", 0.0950, 0.0, simple=0)]).winner.name == "fast"


def test_one_outlying_repeat_does_not_make_a_slower_candidate_tie():
    # The paged tune on the H100: repeats of the simpler candidate near 0.021 / 0.040 / 0.040 ms
    # (spread 0.019) against a fastest at 0.0221; the jitter (0.0) says the median is settled.
    slow = select.Measurement("simple_slow", 0.0397, 0.0187, (0, "simple_slow"), "", 0.0)
    fast = select.Measurement("fast", 0.0221, 0.0001, (1, "fast"), "", 0.0001)
    assert select.choose([slow, fast]).winner.name == "fast"
    # Without a jitter (measurements cached before it was recorded) the spread stands in.
    assert select.choose([m("simple_slow", 0.0397, 0.0187), m("fast", 0.0221, 0.0001, simple=1)]).winner.name == "simple_slow"


def test_a_tie_with_the_default_rules_pick_keeps_it():
    # The first flash_attention tune (H200): a simpler point within the jitter of the default
    # rules' pick would have become a rule and a new instance for nothing.
    tied = [m("default", 1.0852, 0.01, simple=3), m("simpler", 1.0875, 0.01, simple=0)]
    assert select.choose(tied).winner.name == "simpler"
    assert select.choose(tied, default="default").winner.name == "default"
    # Clear of the noise, the fastest still wins over the default.
    assert select.choose([m("default", 1.20, 0.001, simple=0), m("fast", 1.00, 0.001, simple=1)],
                         default="default").winner.name == "fast"


def test_failed_candidates_never_win():
    choice = select.choose([m("broken", math.inf), m("slow", 9.0)])
    assert choice.winner.name == "slow"
    assert select.choose([m("broken", math.inf)]) is None


def test_selection_is_deterministic_under_a_cost_function():
    cost = {f"c{i}": 1 + ((i * 37) % 11) / 10 for i in range(20)}
    runs = [select.choose([m(n, c, 0.001, simple=int(n[1:])) for n, c in sorted(cost.items(), key=lambda kv: h)])
            .winner.name for h in range(3)]
    assert len(set(runs)) == 1 and cost[runs[0]] == min(cost.values())


def test_cache_resumes_and_rekeys_on_source_change(tmp_path):
    path = tmp_path / "cache.jsonl"
    args = ("inst", "source v1", "nvcc 13.0", "2.11", "sm_90a", "H100", {"B": 1, "L": 8})
    k1 = cache.key(*args)
    store = cache.Cache(path)
    store.put(k1, {"median_ms": 1.5, "spread_ms": 0.01})
    with open(path, "a") as fh:
        fh.write('{"key": "cut-off')  # an interrupted write
    again = cache.Cache(path)
    assert again.get(k1)["median_ms"] == 1.5
    assert cache.key("inst", "source v2", *args[2:]) != k1
    assert cache.key(*args[:6], {"B": 2, "L": 8}) != k1


def test_candidates_cover_the_buckets_and_report_rejections():
    spec = pipeline.load()[0]
    cands, rejected = candidates.candidates(spec)
    assert len(cands) >= 48 and len(spec.tune.buckets) >= 6
    assert all(c.a["direction"] == "fwd" and c.a["dtype"] in spec.tune.dtypes for c in cands)
    assert rejected and all(r.reason for r in rejected)
    for bucket in spec.tune.buckets:
        runtime = families.family("causal_linear").tune.runtime(bucket.shape, 4, 132)
        assert any(dispatch.covers(spec, c, runtime) for c in cands if c.a["dtype"] == "fp32"), bucket.name


def test_python_dispatch_follows_the_default_rules():
    spec, built = pipeline.lower(pipeline.expand(pipeline.load()), use_tuned=False)[0]
    pick = lambda B, H, E, M, dtype="fp32": dispatch.select(  # noqa: E731
        spec, built, families.family("causal_linear").tune.runtime({"B": B, "H": H, "L": 64, "E": E, "M": M}, 4 if dtype == "fp32" else 2, 132),
        {"dtype": dtype, "direction": "fwd"})
    assert pick(8, 16, 64, 64).kind == "lmha" and pick(8, 16, 64, 64).p["e"] == 64
    assert pick(1, 8, 64, 64).kind == "low_occupancy"
    assert pick(1, 8, 63, 64).kind == "generic"
    assert pick(1, 8, 48, 100).p["m"] == 128


def _fake_table(tmp_path, spec, bucket="e64_large_bh", params=None):
    params = params or {"e": 64, "m": 64, "cols": 32, "mpt": 2, "tph": 8, "vec": 4, "chunk": 16, "buf": 2, "pad": "auto", "seg": 0}
    path = tmp_path / "tuned.yaml"
    table.write(path, {"device": "test"}, [{"bucket": bucket, "dtype": "fp32", "serves": ["fp32"], "kind": "lmha",
                                            "params": params, "instance": "x"}])
    return path


def test_tuned_table_becomes_dispatch_rules_ahead_of_the_defaults(tmp_path):
    from codegen import lower
    spec, built = pipeline.lower(pipeline.expand(pipeline.load()), use_tuned=False)[0]
    extra, rules = table.load_rules(spec, _fake_table(tmp_path, spec), lower.lower_one)
    assert {i.a["direction"] for i in extra} == {"fwd", "rev"} and all(i.p["cols"] == 32 for i in extra)
    tuned_spec = table.attach(spec, rules)
    instances = built + extra
    runtime = families.family("causal_linear").tune.runtime({"B": 8, "H": 16, "L": 4096, "E": 64, "M": 64}, 4, 132)
    assert dispatch.select(tuned_spec, instances, runtime, {"dtype": "fp32", "direction": "rev"}).p["cols"] == 32
    # bf16 was not tuned here: the default rules still decide.
    runtime16 = families.family("causal_linear").tune.runtime({"B": 8, "H": 16, "L": 4096, "E": 64, "M": 64}, 2, 132)
    assert dispatch.select(tuned_spec, instances, runtime16, {"dtype": "bf16", "direction": "fwd"}).p["cols"] == 64
    text = render.dispatch_context(tuned_spec, instances)["rules"][0]
    assert text["source"].startswith("tuned:") and "key.E <= 64" in text["when"]


def test_tuned_table_errors_name_the_line(tmp_path):
    from codegen import lower
    spec = pipeline.load()[0]
    with pytest.raises(SpecError) as info:
        table.load_rules(spec, _fake_table(tmp_path, spec, bucket="nope"), lower.lower_one)
    assert info.value.field == "buckets[0].bucket" and info.value.line is not None
    bad = {"e": 64, "m": 64, "cols": 64, "mpt": 4, "tph": 3, "vec": 4, "chunk": 8, "buf": 2, "pad": 0, "seg": 0}
    with pytest.raises(SpecError) as info:
        table.load_rules(spec, _fake_table(tmp_path, spec, params=bad), lower.lower_one)
    assert info.value.field == "buckets[0].params.tph"


def _cost(job) -> float:
    """Deterministic stand-in for a GPU timing: favours more value columns per thread and
    longer chunks, penalises state split over many lanes."""
    name = job["name"]
    val = lambda key: int(name.split(f"_{key}")[1].split("_")[0])  # noqa: E731
    if "_chunked_" in name:
        return 0.5 + 0.1 * val("stages")
    return 1.0 / val("mpt") + 8.0 / val("chunk") + 0.01 * val("tph") + (0.3 if "_lmha_" in name else 0.0)


def test_runner_end_to_end_on_cpu_resumes_from_the_cache(tmp_path):
    """The whole tuner with stand-ins for the GPU parts: a second run times nothing, an
    interrupted one resumes, a candidate that fails to build never wins."""
    from codegen.tune import runner
    dev = runner.Device("Test GPU", 132, "2.x", "13.0", "nvcc test")
    timed = []

    def fake_build(spec, cands, jobs):
        broken = {c.name: "failed to compile" for c in cands if c.p.get("chunk") == 32 and c.kind == "split_time"}
        return tmp_path / "fake.so", broken, {c.name: c.name for c in cands}

    def fake_measure(jobs, so_path, on_result):
        for job in jobs:
            timed.append(job["id"])
            on_result(job, {"median_ms": _cost(job), "spread_ms": 0.0, "note": ""})

    spec_file = str(ROOT / "specs" / "causal_linear.yaml")
    kw = dict(root=tmp_path, device=dev, build_fn=fake_build, measure_fn=fake_measure, out_dir=str(tmp_path / "out"))
    header = runner.run(spec_file, **kw)
    first = len(timed)
    assert first > 48 and header["measured_now"] == first
    assert any("|bf16|" in t and "_chunked_" in t for t in timed)  # bf16 buckets time the tensor-core kind too
    doc = __import__("yaml").safe_load((tmp_path / "tuned" / "sm_90a" / "causal_linear.yaml").read_text())
    tune = pipeline.load()[0].tune
    assert {(e["bucket"], e["dtype"]) for e in doc["buckets"]} == {(b.name, d) for b in tune.buckets
                                                                  for d in tune.dtypes}
    for entry in doc["buckets"]:
        assert not (entry["kind"] == "split_time" and entry["params"]["chunk"] == 32)  # failed builds never win
        assert entry["speedup_vs_default"] is None or entry["speedup_vs_default"] > 0
    # Second run: everything from the cache.
    timed.clear()
    assert runner.run(spec_file, **kw)["measured_now"] == 0 and not timed
    # An interrupted run: drop the last 10 cache lines, the next run times exactly those.
    cache_file = tmp_path / "build" / "tune" / "causal_linear" / "cache.jsonl"
    lines = cache_file.read_text().splitlines()
    cache_file.write_text("\n".join(lines[:-10]) + "\n")
    runner.run(spec_file, **kw)
    assert len(timed) == 10
    doc2 = __import__("yaml").safe_load((tmp_path / "tuned" / "sm_90a" / "causal_linear.yaml").read_text())
    assert [e["instance"] for e in doc2["buckets"]] == [e["instance"] for e in doc["buckets"]]


def test_a_run_of_some_buckets_keeps_the_others_as_measured(tmp_path):
    """`tune SPEC --bucket NAME`: only the candidates that bucket times are built and timed, its
    entries are chosen again, and the table keeps every other entry as the earlier run measured
    it (with that run's day in `tuned`), in dispatch order; the table still becomes dispatch
    rules. Unknown buckets, a table from another device and no table at all are refused."""
    import json

    import yaml

    from codegen import lower
    from codegen.tune import runner
    dev = runner.Device("Test GPU", 132, "2.x", "13.0", "nvcc test")
    built, timed = [], []

    def fake_build(spec, cands, jobs):
        built.append(len(cands))
        return tmp_path / "fake.so", {}, {c.name: c.name for c in cands}

    def measure(cost):
        def fake_measure(jobs, so_path, on_result):
            for job in jobs:
                timed.append(job["id"])
                on_result(job, {"median_ms": cost(job), "spread_ms": 0.0, "note": ""})
        return fake_measure

    spec_file = str(ROOT / "specs" / "causal_linear.yaml")
    spec = pipeline.load([spec_file])[0]
    path = tmp_path / "tuned" / "sm_90a" / "causal_linear.yaml"
    kw = dict(root=tmp_path, device=dev, build_fn=fake_build, out_dir=str(tmp_path / "out"))
    with pytest.raises(SystemExit, match="does not exist"):
        runner.run(spec_file, measure_fn=measure(_cost), buckets=[spec.tune.buckets[0].name], **kw)
    runner.run(spec_file, measure_fn=measure(_cost), **kw)
    first = yaml.safe_load(path.read_text())
    first["date"] = "2026-01-01 00:00 UTC"          # the earlier run's day, told apart from today's
    path.write_text(yaml.safe_dump(first, sort_keys=False))
    (tmp_path / "build" / "tune" / "causal_linear" / "cache.jsonl").unlink()   # time again, not from the cache
    name = spec.tune.buckets[1].name
    built.clear(), timed.clear()
    header = runner.run(spec_file, measure_fn=measure(lambda job: 10.0 - _cost(job)), buckets=[name], **kw)
    assert header["retimed"] == [name] and timed and all(t.startswith(f"{name}|") for t in timed)
    assert built[0] < len(candidates.candidates(spec)[0])   # only what the bucket times was built
    again = yaml.safe_load(path.read_text())
    assert [(e["bucket"], e["dtype"]) for e in again["buckets"]] == [(e["bucket"], e["dtype"]) for e in first["buckets"]]
    for old, new in zip(first["buckets"], again["buckets"]):
        if old["bucket"] == name:
            assert "tuned" not in new and new["instance"] != old["instance"]   # the reversed cost's winner
        else:
            assert new == {**old, "tuned": "2026-01-01 00:00 UTC"}
    rows = json.loads((tmp_path / "out" / "tune_causal_linear.json").read_text())["rows"]
    assert [(r["bucket"], r["dtype"]) for r in rows] == [(e["bucket"], e["dtype"]) for e in again["buckets"]]
    assert "timed the buckets " + name + " only" in (tmp_path / "out" / "tune_causal_linear.md").read_text()
    extra, rules = table.load_rules(spec, path, lower.lower_one)
    assert len(rules) == len({e["bucket"] for e in again["buckets"]}) and extra   # a rule a bucket
    with pytest.raises(SystemExit, match=r"no bucket 'nope' in .*; its buckets: " + spec.tune.buckets[0].name):
        runner.run(spec_file, measure_fn=measure(_cost), buckets=["nope"], **kw)
    other = {**kw, "device": runner.Device("Other GPU", 78, "2.x", "13.0", "nvcc test")}
    built.clear()
    with pytest.raises(SystemExit, match="was measured on Test GPU .* time every bucket"):
        runner.run(spec_file, measure_fn=measure(_cost), buckets=[name], **other)
    assert not built   # refused before anything was built or timed


def test_reselect_chooses_again_from_a_runs_measurements(tmp_path, monkeypatch):
    """`tune --reselect RUN.json` (no GPU): the same measurements give the same table, and a
    changed selection rule is applied to them without timing anything."""
    import yaml

    from codegen.tune import runner
    dev = runner.Device("Test GPU", 132, "2.x", "13.0", "nvcc test")
    fake_build = lambda spec, cands, jobs: (tmp_path / "fake.so", {}, {c.name: c.name for c in cands})  # noqa: E731

    def fake_measure(jobs, so_path, on_result):
        for job in jobs:
            on_result(job, {"median_ms": _cost(job), "spread_ms": 0.0, "note": "", "jitter_ms": 0.0})

    spec_file = str(ROOT / "specs" / "causal_linear.yaml")
    runner.run(spec_file, root=tmp_path, device=dev, build_fn=fake_build, measure_fn=fake_measure,
               out_dir=str(tmp_path / "out"))
    path = tmp_path / "tuned" / "sm_90a" / "causal_linear.yaml"
    first = yaml.safe_load(path.read_text())
    run_json = tmp_path / "out" / "tune_causal_linear.json"
    header = runner.reselect(str(run_json), str(tmp_path / "again"), root=tmp_path)
    again = yaml.safe_load(path.read_text())
    assert header["device"] == "Test GPU" and "reselected" in header
    assert [(e["bucket"], e["instance"], e["time_ms"]) for e in again["buckets"]] == \
        [(e["bucket"], e["instance"], e["time_ms"]) for e in first["buckets"]]
    assert "chosen again" in (tmp_path / "again" / "tune_causal_linear.md").read_text()
    # A rule that always takes the slowest: every bucket's winner changes to its slowest measurement.
    monkeypatch.setattr(select, "choose", lambda ms, default=None: select.Choice(max(ms, key=lambda x: x.median_ms),
                                                                                 None, ()))
    runner.reselect(str(run_json), str(tmp_path / "slowest"), root=tmp_path)
    slowest = yaml.safe_load(path.read_text())
    rows = {(r["bucket"], r["dtype"]): r for r in __import__("json").loads(run_json.read_text())["rows"]}
    for e in slowest["buckets"]:
        assert e["time_ms"] == round(max(x["median_ms"] for x in rows[(e["bucket"], e["dtype"])]["measurements"]), 5)


def test_reselect_narrowed_leaves_out_candidates_the_grid_lost(tmp_path):
    """`--reselect --narrowed`: a measured candidate the spec's grid no longer holds (the fastest
    here) is left out, named in the table's header and the report, and never wins; without
    --narrowed the same run is refused."""
    import json

    import yaml

    from codegen.tune import runner
    dev = runner.Device("Test GPU", 132, "2.x", "13.0", "nvcc test")
    fake_build = lambda spec, cands, jobs: (tmp_path / "fake.so", {}, {c.name: c.name for c in cands})  # noqa: E731

    def fake_measure(jobs, so_path, on_result):
        for job in jobs:
            on_result(job, {"median_ms": _cost(job), "spread_ms": 0.0, "note": "", "jitter_ms": 0.0})

    runner.run(str(ROOT / "specs" / "causal_linear.yaml"), root=tmp_path, device=dev, build_fn=fake_build,
               measure_fn=fake_measure, out_dir=str(tmp_path / "out"))
    run_json = tmp_path / "out" / "tune_causal_linear.json"
    run = json.loads(run_json.read_text())
    gone = "causal_linear_fwd_gone_point_bf16_sm90a"
    for row in run["rows"]:
        row["measurements"].append({"name": gone, "median_ms": 1e-6, "spread_ms": 0.0, "jitter_ms": 0.0})
    run_json.write_text(json.dumps(run))
    with pytest.raises(SystemExit, match="no longer a candidate.*--narrowed"):
        runner.reselect(str(run_json), str(tmp_path / "refused"), root=tmp_path)
    header = runner.reselect(str(run_json), str(tmp_path / "narrowed"), root=tmp_path, narrowed=True)
    table = yaml.safe_load((tmp_path / "tuned" / "sm_90a" / "causal_linear.yaml").read_text())
    assert header["narrowed"] == [gone] and table["narrowed"] == [gone]
    assert all(e["instance"] != gone for e in table["buckets"])
    assert gone in (tmp_path / "narrowed" / "tune_causal_linear.md").read_text()


def test_reselect_refuses_a_run_of_candidates_the_spec_no_longer_has(tmp_path):
    import json

    from codegen.tune import runner
    run = {"header": {"spec": "specs/delta_rule.yaml", "device": "Test GPU", "sm_count": 132, "torch": "2.x",
                      "cuda": "13.0", "compiler": "nvcc"},
           "rows": [{"bucket": "gated_k64", "dtype": "bf16", "measurements": [
               {"name": "delta_rule_gated_delta_chunked_k64_cols96_warps8_stages2_bf16_sm90a", "median_ms": 1.0,
                "spread_ms": 0.0}]}]}
    (tmp_path / "run.json").write_text(json.dumps(run))
    with pytest.raises(SystemExit, match="cols96.*no longer a candidate.*tune again"):
        runner.reselect(str(tmp_path / "run.json"), str(tmp_path), root=tmp_path)


@pytest.mark.parametrize("family", ["rwkv", "rwkv_grad", "paged", "delta_rule", "flash_attention",
                                    "flash_attention_grad"])
def test_runner_tunes_every_family_and_its_table_dispatches(tmp_path, family):
    """Every tuned family but causal linear (above) through the same tuner (their workloads give
    the dispatch variables): every bucket gets a winner, measured beside the default rules' pick at the
    bucket's axis values, and the written table loads back as rules that dispatch the winner on
    the bucket's shape, for every axis value it serves (only the variant a delta-rule bucket
    fixes)."""
    import zlib

    import yaml

    from codegen import lower
    from codegen.arch import DTYPE_BYTES
    from codegen.tune import runner
    dev = runner.Device("Test GPU", 132, "2.x", "13.0", "nvcc test")
    timed = []

    def fake_measure(jobs, so_path, on_result):
        for job in jobs:
            timed.append(job)
            on_result(job, {"median_ms": 1 + zlib.crc32(job["name"].encode()) % 97 / 10, "spread_ms": 0.0, "note": ""})

    fake_build = lambda spec, cands, jobs: (tmp_path / "fake.so", {}, {c.name: c.name for c in cands})  # noqa: E731
    spec_file = str(ROOT / "specs" / f"{family}.yaml")
    runner.run(spec_file, root=tmp_path, device=dev, build_fn=fake_build, measure_fn=fake_measure,
               out_dir=str(tmp_path / "out"))
    assert timed and all(job["family"] == family for job in timed)
    spec = pipeline.load([spec_file])[0]
    for job in timed:   # the workload is told the axis values its bucket fixes, beside the dims
        bucket = next(b for b in spec.tune.buckets if job["id"].startswith(b.name + "|"))
        k = int(job["id"].rsplit("|", 1)[1]) if job["id"].count("|") == 3 else 0   # shape k of the bucket's
        assert job["shape"] == {**bucket.shapes[k], **bucket.axes}                # shape and its `also:`
        assert job["timing"] == bucket.timing   # replayed from a CUDA graph where the bucket says so
        assert all(f"_{value}_" in job["name"] for value in bucket.axes.values()), job["name"]
    spec, built = [sb for sb in pipeline.lower(pipeline.expand(pipeline.load()), use_tuned=False) if sb[0].family == family][0]
    plan = families.family(family).tune
    path = tmp_path / "tuned" / "sm_90a" / f"{family}.yaml"
    doc = yaml.safe_load(path.read_text())
    assert {(e["bucket"], e["dtype"]) for e in doc["buckets"]} == {(b.name, d) for b in spec.tune.buckets
                                                                  for d in spec.tune.dtypes}
    extra, rules = table.load_rules(spec, path, lower.lower_one)
    tuned = table.attach(spec, rules)
    for entry in doc["buckets"]:
        bucket = next(b for b in spec.tune.buckets if b.name == entry["bucket"])
        runtime = plan.runtime(bucket.shape, DTYPE_BYTES[entry["dtype"]], 132)
        for shape in bucket.shapes:   # the bucket's own shapes fall in it
            assert bucket.when.evaluate(plan.runtime(shape, DTYPE_BYTES[entry["dtype"]], 132)), bucket.name
        default = dispatch.select(spec, built, runtime, {"dtype": entry["dtype"], **candidates.timed_axes(spec, bucket)})
        assert default is not None and entry["default"] == default.name and entry["default_ms"] is not None
        for served in entry["serves"]:
            for axes in ({**dict(i.axes), "dtype": served} for i in extra
                         if i.kind == entry["kind"] and all(i.a[a] == v for a, v in bucket.axes.items())):
                pick = dispatch.select(tuned, built + extra, runtime, axes)
                assert (pick.kind, dict(pick.params)) == (entry["kind"], entry["params"]), (bucket.name, axes)


def _delta_rule():
    spec, built = [sb for sb in pipeline.lower(pipeline.expand(pipeline.load()), use_tuned=False)
                   if sb[0].family == "delta_rule"][0]
    return spec, built


def test_a_bucket_that_fixes_the_variant_times_and_serves_only_it(tmp_path):
    """specs/delta_rule.yaml's buckets each fix the variant: the candidates hold both variants,
    each bucket is timed at its own, and a table entry adds instances of that variant only, so
    an RWKV-7 call of the same shape keeps the default rules."""
    from codegen import lower
    spec, built = _delta_rule()
    cands, _ = candidates.candidates(spec)
    assert {c.a["variant"] for c in cands} == {"rwkv7", "gated_delta"}
    assert all(c.a["variant"] == "gated_delta" for c in cands if c.kind == "chunked")
    for bucket in spec.tune.buckets:
        assert set(candidates.timed_axes(spec, bucket)) == {"variant"} and bucket.axes, bucket.name
    params = {"k": 128, "cols": 32, "tph": 4, "chunk": 16}
    path = tmp_path / "tuned.yaml"
    table.write(path, {"device": "test"}, [{"bucket": "gated_k128_short", "dtype": "bf16", "serves": ["bf16", "fp16"],
                                            "kind": "recurrent", "params": params, "instance": "x"}])
    extra, rules = table.load_rules(spec, path, lower.lower_one)
    assert {(i.a["variant"], i.a["dtype"]) for i in extra} == {("gated_delta", "bf16"), ("gated_delta", "fp16")}
    tuned = table.attach(spec, rules)
    runtime = families.family("delta_rule").tune.runtime({"B": 8, "H": 16, "T": 128, "K": 128, "V": 128}, 2, 132)
    gated = dispatch.select(tuned, built + extra, runtime, {"dtype": "bf16", "variant": "gated_delta"})
    rwkv7 = dispatch.select(tuned, built + extra, runtime, {"dtype": "bf16", "variant": "rwkv7"})
    assert dict(gated.params) == params
    assert rwkv7 == dispatch.select(spec, built, runtime, {"dtype": "bf16", "variant": "rwkv7"})
    assert dict(rwkv7.params) != params


@pytest.mark.parametrize("axes,field,message", [
    ("{dtype: bf16}", "axes.dtype", "an axis of the spec other than dtype"),
    ("{flavour: x}", "axes.flavour", "an axis of the spec other than dtype"),
    ("{variant: deltanet}", "axes.variant", "expected one of ['rwkv7', 'gated_delta'], got 'deltanet'"),
])
def test_bucket_axes_errors_name_the_line(tmp_path, axes, field, message):
    text = (ROOT / "specs" / "delta_rule.yaml").read_text()
    old = "      axes: {variant: rwkv7}\n      when: \"K > 32 and K <= 64 and BH * V < 64 * sm_count\""
    assert old in text
    bad = tmp_path / "delta_rule.yaml"
    bad.write_text(text.replace(old, old.replace("{variant: rwkv7}", axes), 1))
    with pytest.raises(SpecError) as info:
        pipeline.load([str(bad)])
    line = text[:text.index(old)].count("\n") + 1
    assert info.value.field == f"tune.buckets[0].{field}" and info.value.line == line and message in str(info.value)


def test_a_switch_dim_takes_0_or_1(tmp_path):
    """flash_attention's bucket shapes carry `causal` (a TunePlan flag): 0 is allowed there, 2 is
    named at its line; a size dim still must be positive."""
    text = (ROOT / "specs" / "flash_attention.yaml").read_text()
    old = "shape: {B: 4, Hq: 48, Hkv: 48, Lq: 4096, Lk: 4096, D: 64, causal: 1}"
    assert old in text
    line = text[:text.index(old)].count("\n") + 1
    for bad, field, message in ((old.replace("causal: 1", "causal: 2"), "causal", "expected 0 or 1 (a switch)"),
                                (old.replace("B: 4", "B: 0"), "B", "expected a positive integer")):
        path = tmp_path / "flash_attention.yaml"
        path.write_text(text.replace(old, bad, 1))
        with pytest.raises(SpecError) as info:
            pipeline.load([str(path)])
        assert info.value.field == f"tune.buckets[0].shape.{field}" and info.value.line == line
        assert message in str(info.value)


def test_a_bucket_times_by_graph_replay_where_the_spec_says_and_nothing_else(tmp_path):
    """paged's small decode batches are timed as engines run them (replayed from a CUDA graph);
    a `timing:` the worker does not know is refused at its line."""
    text = (ROOT / "specs" / "paged.yaml").read_text()
    spec = pipeline.load([ROOT / "specs" / "paged.yaml"])[0]
    graphed = {b.name for b in spec.tune.buckets if b.timing == "graph"}
    assert graphed == {"mha_tiny", "gqa_single", "gqa_tiny"}
    bad = tmp_path / "paged.yaml"
    bad.write_text(text.replace("      timing: graph\n", "      timing: replay\n", 1))
    with pytest.raises(SpecError) as info:
        pipeline.load([bad])
    line = next(i + 1 for i, row in enumerate(bad.read_text().splitlines()) if "timing: replay" in row)
    assert info.value.field == "tune.buckets[0].timing" and "eager, graph" in info.value.message
    assert info.value.line == line


def test_a_bucket_with_more_shapes_scores_the_geometric_mean():
    """A candidate fastest on the bucket's shape by a little but slow on its `also:` shapes loses
    to one that holds on all three; a candidate that fails on one shape fails."""
    from codegen.tune import runner
    spec = pipeline.load([ROOT / "specs" / "paged.yaml"])[0]
    bucket = next(b for b in spec.tune.buckets if b.name == "gqa_mid")
    assert len(bucket.shapes) == 3
    cands, _ = candidates.candidates(spec)
    a, b, c = [x for x in cands if x.a["dtype"] == "bf16"][:3]
    times = {a.name: (0.060, 0.100, 0.100), b.name: (0.0601, 0.050, 0.050), c.name: (0.050, 0.050, math.inf)}
    results = {f"{bucket.name}|bf16|{name}" + (f"|{k}" if k else ""): {"median_ms": t, "spread_ms": 0.0}
               for name, ts in times.items() for k, t in enumerate(ts)}
    shaped = dataclasses.replace(spec, tune=dataclasses.replace(spec.tune, dtypes=("bf16",), buckets=(bucket,)))
    entries, rows = runner._choose_all(shaped, cands, results, {(bucket.name, "bf16"): None})
    assert entries[0]["instance"] == b.name
    assert entries[0]["time_ms"] == round((0.0601 * 0.05 * 0.05) ** (1 / 3), 5)
    assert rows[0]["per_shape_ms"][a.name] == [0.060, 0.100, 0.100]
    assert math.isinf(next(m["median_ms"] for m in rows[0]["measurements"] if m["name"] == c.name))


def test_a_shape_dim_with_a_default_may_be_left_out(tmp_path):
    """paged's `ragged` switch: 1 (the workload's ragged contexts) where a shape leaves it out, 0
    where an `also:` shape asks for equal contexts; another value is refused at its line."""
    spec = pipeline.load([ROOT / "specs" / "paged.yaml"])[0]
    bucket = next(b for b in spec.tune.buckets if b.name == "mha_few_short")
    assert bucket.shape["ragged"] == 1 and bucket.also[0]["ragged"] == 0 and bucket.also[0]["L"] == 1000
    text = (ROOT / "specs" / "paged.yaml").read_text()
    bad = tmp_path / "paged.yaml"
    bad.write_text(text.replace("L: 1000, ragged: 0}", "L: 1000, ragged: 2}", 1))
    with pytest.raises(SpecError) as info:
        pipeline.load([bad])
    assert info.value.field.endswith(".also[0].ragged") and "a switch" in info.value.message


def test_a_bucket_shape_list_is_checked_at_its_line(tmp_path):
    text = (ROOT / "specs" / "paged.yaml").read_text()
    bad = tmp_path / "paged.yaml"
    bad.write_text(text.replace("        - {S: 16, Hq: 40, Hkv: 8, D: 128, L: 2500}", "        - {S: 16, Hq: 40, Hkv: 8, D: 128, L: 0}", 1))
    with pytest.raises(SpecError) as info:
        pipeline.load([bad])
    assert info.value.field.endswith(".also[0].L") and "positive integer" in info.value.message
    line = next(i + 1 for i, row in enumerate(bad.read_text().splitlines()) if "L: 0}" in row)
    assert info.value.line == line
