"""Loads the built extension once: $ATTNGEN_LIB, else the copy `pip install` put beside this
file, else the checkout's build/lib/attngen_ext.so (`make build`). The benchmark extension
(bench-role kinds, op namespace attngen_bench: `python -m codegen build --bench`) is loaded
beside it on request."""
from __future__ import annotations

import os
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PACKAGED_LIB = Path(__file__).resolve().parent / "attngen_ext.so"
DEFAULT_LIB = ROOT / "build" / "lib" / "attngen_ext.so"
BENCH_LIB = ROOT / "build" / "bench" / "lib" / "attngen_bench_ext.so"
_loaded: Path | None = None
_bench_loaded: bool | None = None


def library_path() -> Path:
    if "ATTNGEN_LIB" in os.environ:
        return Path(os.environ["ATTNGEN_LIB"])
    in_checkout = (ROOT / "specs").is_dir()
    return DEFAULT_LIB if in_checkout and not PACKAGED_LIB.is_file() else PACKAGED_LIB


def available() -> bool:
    return _loaded is not None or library_path().is_file()


def load() -> None:
    """Load the extension so that torch.ops.attngen.* exist; a clear error if it is not built."""
    global _loaded
    if _loaded is not None:
        return
    path = library_path()
    if not path.is_file():
        raise RuntimeError(f"attngen: the extension {path} is not built; run `make build` (or `pip install "
                           f"--no-build-isolation .`) on a machine with a CUDA build of torch")
    torch.ops.load_library(str(path))
    _loaded = path


def load_bench() -> bool:
    """Load the benchmark extension if it is built ($ATTNGEN_BENCH_LIB, else the checkout's
    build/bench/lib/attngen_bench_ext.so); False where it is not."""
    global _bench_loaded
    if _bench_loaded is None:
        path = Path(os.environ.get("ATTNGEN_BENCH_LIB", BENCH_LIB))
        _bench_loaded = path.is_file()
        if _bench_loaded:
            load()
            torch.ops.load_library(str(path))
    return _bench_loaded
