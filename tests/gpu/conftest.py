import json

import pytest
import torch

from attngen import _ext

from ..conftest import ROOT


def pytest_collection_modifyitems(config, items):
    reason = None
    if not torch.cuda.is_available():
        reason = "no CUDA device"
    elif not _ext.available():
        reason = "extension not built (make build)"
    for item in items:
        if "gpu" in item.keywords and reason:
            item.add_marker(pytest.mark.skip(reason=reason))


def family_manifest(family: str) -> dict:
    rows = json.loads((ROOT / "generated" / "manifest.json").read_text())
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
