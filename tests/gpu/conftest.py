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


@pytest.fixture(scope="session")
def manifest():
    return {row["name"]: row for row in json.loads((ROOT / "generated" / "manifest.json").read_text())}
