"""GPU tier of instances built on first use (codegen/jit.py, attngen/_jit.py): a head size no
prebuilt instance covers (paged D=48, RWKV N=96) is built, registered and right against the
float64 reference; a second process loads it from the cache; 8 processes asking at once get
one build and the right answer. Each test uses a cache of its own (ATTNGEN_CACHE)."""
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from attngen import _jit, paged, reference, rwkv

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def paged_case(D, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    S, Hq, Hkv, block_size, lens = 5, 8, 2, 16, [1, 17, 300, 1000, 0]
    max_blocks = max((n + block_size - 1) // block_size for n in lens)
    bt = torch.randperm(S * max_blocks + 3, generator=g)[: S * max_blocks].to(torch.int32).reshape(S, max_blocks)
    q = torch.randn(S, Hq, D, generator=g)
    k = torch.randn(S * max_blocks + 3, block_size, Hkv, D, generator=g)
    v = torch.randn(S * max_blocks + 3, block_size, Hkv, D, generator=g)
    q, k, v = (x.to(dtype).cuda() for x in (q, k, v))
    return q, k, v, bt.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")


def rel_err(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ATTNGEN_JIT", raising=False)
    return tmp_path / "cache"


def test_paged_head_size_48_is_built_on_first_use(cache, capsys):
    case = paged_case(48)
    assert paged.selected_instance(*case) == ""
    torch.full((1 << 20,), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison the allocator
    t0 = time.monotonic()
    out = paged.paged_decode(*case)
    first = time.monotonic() - t0
    ref = reference.paged_decode(*case)
    assert rel_err(out, ref) < 1e-2
    assert "attngen: building paged_decode D=48" in capsys.readouterr().err
    assert first <= 60, f"first call took {first:.0f} s"
    name = paged.selected_instance(*case)
    assert "_d48_" in name, name
    print(f"paged D=48: first call {first:.1f} s, {name}")
    assert len(list(cache.rglob("lib.so"))) == 1


def test_rwkv_head_size_96_is_built_on_first_use(cache):
    g = torch.Generator().manual_seed(1)
    B, T, H, N = 2, 70, 3, 96
    r, k, v = (torch.randn(B, T, H, N, generator=g).to(torch.bfloat16).cuda() for _ in range(3))
    w = (-torch.exp(torch.randn(B, T, H, N, generator=g) * 0.5 - 1)).to(torch.bfloat16).cuda()  # log decay
    u = (torch.randn(H, N, generator=g) * 0.5).to(torch.bfloat16).cuda()
    out, _ = rwkv.wkv6(r, k, v, w, u)
    ref, _ = reference.wkv(r, k, v, w, u)
    assert rel_err(out, ref) < 2e-2
    assert any("_n96_" in n for n in (json.loads(p.read_text())["name"] for p in cache.rglob("instance.json")))


SECOND = """
import time, torch
from attngen import paged
from tests.gpu.test_jit import paged_case
case = paged_case(48)
torch.cuda.synchronize()
t0 = time.monotonic()
out = paged.paged_decode(*case)
torch.cuda.synchronize()
print("SECONDS", time.monotonic() - t0)
from attngen import reference
ref = reference.paged_decode(*case)
err = ((out.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()
assert err < 1e-2, err
"""


def _spawn(cache, n):
    env = {**os.environ, "ATTNGEN_CACHE": str(cache), "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    return [subprocess.Popen([sys.executable, "-c", SECOND], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(n)]


def test_a_second_process_loads_it_from_the_cache(cache):
    first, = _spawn(cache, 1)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    second, = _spawn(cache, 1)
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0, err
    assert "building" not in err
    seconds = float(out.split("SECONDS")[1])
    print(f"second process: first call {seconds:.2f} s")
    # Loading, not building (a build takes tens of seconds): the first call includes CUDA's
    # start and the extension's load, 2.26 s on the H100 at 5a206fa (795 objects), so the bound
    # is loose; the speed of a cached load is bench.jit_first_use's to report.
    assert seconds <= 10.0


def test_eight_processes_racing_get_one_build(cache):
    procs = _spawn(cache, 8)
    results = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err
    builds = sum(err.count("attngen: building") for _, err in results)
    assert builds == 1, builds
    assert len(list(cache.rglob("lib.so"))) == 1
    assert not [p for p in cache.rglob(".*") if p.is_dir()], "a temporary build directory was left behind"


def test_jit_off_keeps_the_error(cache, monkeypatch):
    monkeypatch.setenv("ATTNGEN_JIT", "0")
    case = paged_case(40)
    with pytest.raises(ValueError, match="no compiled instance covers it"):
        paged.paged_decode(*case)
    assert not cache.exists() or not list(cache.rglob("lib.so"))
    assert _jit.enabled() is False


def test_flash_attention_head_size_80_is_built_on_first_use(cache):
    fa = importlib.import_module("attngen.flash_attention")  # attngen.flash_attention is also the function
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, L, H, 80, generator=g).to(torch.bfloat16).cuda() for L, H in ((113, 4), (70, 2), (70, 2)))
    out = fa.flash_attention(q, k, v, causal=True)
    ref, _ = reference.flash_attention(q, k, v, causal=True)
    assert rel_err(out, ref) < 1e-2
    # the warp-specialized Hopper kind, its tiles padded to two 64-column atoms (d96's schedule)
    assert "_hopper_ws_d80_" in fa.selected_instance(q, k, v)
    with pytest.raises(ValueError, match=r"(?s)unsupported head size D=72; built: .*Nor can one be built on first use: "
                                         r".*d=72 is not a multiple of 16"):
        x = torch.randn(1, 8, 2, 72, device="cuda", dtype=torch.bfloat16)
        fa.flash_attention(x, x, x)


def test_causal_linear_e256_gets_a_recurrent_instance_instead_of_the_generic_kind(cache):
    from attngen import causal_linear as cl
    g = torch.Generator().manual_seed(3)
    q, k, v = ((torch.randn(1, 2, 300, 256, generator=g) * 0.1).cuda() for _ in range(3))
    assert "_generic_" in cl.selected_instance(q, k, v)
    out = cl.causal_dot_product(q, k, v)
    name = cl.selected_instance(q, k, v)
    assert "_generic_" not in name and "_e256_m256_" in name, name
    ref = reference.causal_dot_product(q, k, v)
    assert rel_err(out, ref) < 1e-5
    q.requires_grad_(True)
    cl.causal_dot_product(q, k, v).sum().backward()  # the backward's calls go the same way
    assert torch.isfinite(q.grad).all()
