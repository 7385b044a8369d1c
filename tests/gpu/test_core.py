"""GPU tier of the extension built without its instances (codegen/core.py): a process that finds
no prebuilt extension builds the bindings and tables into the cache, then each kernel on its
first call, and every answer is right against the float64 reference; the rows it builds are the
ones the prebuilt extension's dispatch picks; a second process builds nothing. Each test runs
in subprocesses with a cache of their own and ATTNGEN_LIB naming a library that does not exist."""
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attngen import causal_linear, paged

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
FA = importlib.import_module("attngen.flash_attention")  # attngen.flash_attention is also the function


def cases():
    """One call per family kind the README shows: causal linear fp32, flash bf16 causal, paged decode bf16."""
    g = torch.Generator().manual_seed(7)
    linear = tuple(torch.randn(2, 4, 300, 64, generator=g).cuda() for _ in range(3))
    flash = tuple(torch.randn(2, L, H, 128, generator=g).to(torch.bfloat16).cuda() for L, H in ((130, 8), (200, 2), (200, 2)))
    S, Hq, Hkv, D, bs, lens, width = 3, 8, 2, 128, 16, [1, 77, 700], 44
    bt = torch.randperm(S * width + 3, generator=g)[: S * width].to(torch.int32).reshape(S, width).cuda()
    kv = [torch.randn(S * width + 3, bs, Hkv, D, generator=g).to(torch.bfloat16).cuda() for _ in range(2)]
    decode = (torch.randn(S, Hq, D, generator=g).to(torch.bfloat16).cuda(), *kv, bt,
              torch.tensor(lens, dtype=torch.int32, device="cuda"))
    return linear, flash, decode


def selected(linear, flash, decode) -> dict:
    return {"causal_linear": causal_linear.selected_instance(*linear),
            "flash_attention": FA.selected_instance(*flash),
            "paged": paged.selected_instance(*decode)}


RUN = """
import json, sys, time
t0 = time.monotonic()
import torch
from attngen import _ext, causal_linear, paged, reference
from tests.gpu.test_core import FA, cases, selected
linear, flash, decode = cases()
torch.full((1 << 22,), float("nan"), device="cuda")  # poison the allocator: unwritten outputs show as NaN
times, errs = {}, {}
def timed(name, fn):
    start = time.monotonic()
    out = fn()
    torch.cuda.synchronize()
    times[name] = time.monotonic() - start
    return out
o = timed("causal_linear", lambda: causal_linear.causal_dot_product(*linear))
errs["causal_linear"] = ((o.double() - reference.causal_dot_product(*linear)).norm() /
                         reference.causal_dot_product(*linear).norm()).item()
o = timed("flash_attention", lambda: FA.flash_attention(*flash, causal=True))
ref, _ = reference.flash_attention(*flash, causal=True)
errs["flash_attention"] = ((o.double() - ref.double()).norm() / ref.double().norm()).item()
o = timed("paged", lambda: paged.paged_decode(*decode))
ref = reference.paged_decode(*decode)
errs["paged"] = ((o.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()
path, core = _ext.loaded()
print("RESULT " + json.dumps({"total_s": time.monotonic() - t0, "times": times, "errs": errs,
                              "names": selected(linear, flash, decode), "library": str(path), "core": core}))
"""


def _run(cache: Path, tmp: Path):
    env = {**os.environ, "ATTNGEN_CACHE": str(cache), "ATTNGEN_LIB": str(tmp / "no-prebuilt" / "attngen_ext.so"),
           "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    env.pop("ATTNGEN_JIT", None)
    done = subprocess.run([sys.executable, "-c", RUN], cwd=ROOT, env=env, capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    return result, done.stderr


def test_without_a_prebuilt_extension_the_first_call_builds_what_it_uses(tmp_path):
    cache = tmp_path / "cache"
    first, err = _run(cache, tmp_path)
    print(f"first process: {json.dumps(first)}")
    assert first["core"] and first["library"].startswith(str(cache / "core"))
    assert "building its bindings and dispatch tables" in err and err.count("attngen: building ") == 3, err[-3000:]
    assert first["errs"]["causal_linear"] < 1e-5, first
    assert first["errs"]["flash_attention"] < 1e-2 and first["errs"]["paged"] < 1e-2, first
    # the prebuilt extension (this process's) picks the same rows for the same calls
    assert first["names"] == selected(*cases())
    built = sorted(json.loads(p.read_text())["name"] for p in cache.rglob("instance.json"))
    assert built == sorted(first["names"].values())

    second, err = _run(cache, tmp_path)
    print(f"second process: {json.dumps(second)}")
    assert "building" not in err, err[-3000:]
    assert second["errs"] == pytest.approx(first["errs"], abs=1e-6) and second["names"] == first["names"]
    assert second["total_s"] < first["total_s"] / 2, (first["total_s"], second["total_s"])
    # each row is found by name in the cache's record, not planned again (3.7 s for causal_linear at 21ad166)
    assert sum(second["times"].values()) < 2.0, second["times"]
