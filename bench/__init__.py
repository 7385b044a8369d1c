"""Side-by-side benchmarks of the generated kernels against their peers (see README.md)."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tree_commit() -> str:
    """The commit a run's tree is: ATTNGEN_COMMIT where the caller names it (the device's copy of
    the tree may carry an older .git), else HEAD, with "+changes" where the tracked files differ
    from it (then the tree is not that commit), "unknown" without git."""
    if os.environ.get("ATTNGEN_COMMIT"):
        return os.environ["ATTNGEN_COMMIT"]
    try:
        described = subprocess.run(["git", "describe", "--always", "--abbrev=8", "--dirty=+changes", "--exclude=*"],
                                   cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:  # no git on the machine
        described = ""
    return described or "unknown"


def run_meta(started: float) -> dict:
    """Device, torch, commit (tree_commit) and duration of a benchmark run."""
    import torch
    commit = tree_commit()
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit,
            "seconds": round(time.time() - started, 1)}
