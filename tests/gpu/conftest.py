import json

import pytest
import torch

from attngen import _ext, _jit

from ..conftest import ROOT


def pytest_collection_modifyitems(config, items):
    reason = None
    if not torch.cuda.is_available():
        reason = "no CUDA device"
    elif not _ext.available() and (why := _jit.cannot_build()):
        # Without `make build` the ops run where their kernels can build on first use (after
        # `python -m attngen.prebuild FAMILY...`, with no compile at all).
        reason = "extension not built (make build), nor buildable on first use: " + "; ".join(why)
    for item in items:
        if "gpu" in item.keywords and reason:
            item.add_marker(pytest.mark.skip(reason=reason))


def family_manifest(family: str, bench: bool = False) -> dict:
    """The family's shipped instances; with bench=True also the benchmark extension's (bench-role
    kinds, forced through the op), where `codegen build --bench` rendered them."""
    paths = [ROOT / "generated" / "manifest.json"] + ([ROOT / "build" / "bench" / "generated" / "manifest.json"] if bench else [])
    rows = [row for path in paths if path.is_file() for row in json.loads(path.read_text())]
    return {row["name"]: row for row in rows if row["family"] == family}


@pytest.fixture(scope="session")
def manifest():
    """The causal-linear instances (each family's tests take their own rows)."""
    return family_manifest("causal_linear")


@pytest.fixture(scope="session")
def rwkv_manifest():
    return family_manifest("rwkv")


@pytest.fixture(scope="session")
def rwkv_grad_manifest():
    return family_manifest("rwkv_grad")


# Shared by the families' GPU tests.
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "output has NaN/Inf (unwritten elements keep the poison)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def poison(numel):
    """Hand the caching allocator NaN-filled blocks, so unwritten outputs show up as NaN."""
    for dtype in (torch.float32, torch.bfloat16):
        torch.full((numel,), float("nan"), dtype=dtype, device="cuda")


def log_decays(shape, regime, g):
    """Log decays: 'near1' (w ~ -1e-4: decay ~ 0.9999), 'near0' (w ~ -12: decay ~ 6e-6), 'mixed'
    (decays from 0.9933 to 0.15)."""
    x = torch.rand(shape, device="cuda", generator=g)
    if regime == "near1":
        return -1e-4 * (0.5 + x)
    if regime == "near0":
        return -12.0 - 4.0 * x
    return -torch.exp(4.0 * x - 5.0)
