"""Side-by-side benchmarks of the generated kernels against their peers (see README.md)."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_meta(started: float) -> dict:
    """Device, torch, commit and duration of a benchmark run. The device's copy of the tree
    may carry an older .git: the caller names the commit with ATTNGEN_COMMIT."""
    import torch
    commit = os.environ.get("ATTNGEN_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or "unknown"
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit,
            "seconds": round(time.time() - started, 1)}
