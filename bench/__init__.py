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


def host_us(fn, rounds: int = 20, calls: int = 20) -> float:
    """Host time per call of fn (us): the median over rounds of calls issued back to back between
    synchronizations, so that the launch queue never fills and the GPU never holds the host back
    (where fn's GPU work is shorter than its host work, as it is on small shapes)."""
    import torch
    for _ in range(calls):
        fn()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2] * 1e6
