"""Loads the built extension once: $ATTNGEN_LIB, else the copy `pip install` put beside this
file, else the checkout's build/lib/attngen_ext.so (`make build`); where none of them is built,
the extension built without its instances, whose kernels build on first use (attngen/_jit.py). The benchmark extension
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
_core = False               # the loaded library is the one built without its instances (codegen/core.py)
_bench_loaded: bool | None = None


def library_path() -> Path:
    if "ATTNGEN_LIB" in os.environ:
        return Path(os.environ["ATTNGEN_LIB"])
    in_checkout = (ROOT / "specs").is_dir()
    return DEFAULT_LIB if in_checkout and not PACKAGED_LIB.is_file() else PACKAGED_LIB


def available() -> bool:
    return _loaded is not None or library_path().is_file()


def load() -> None:
    """Load the extension so that torch.ops.attngen.* exist. Where none is built, the extension
    built without its instances (its kernels build on first use) from the cache, built now if
    need be; a clear error where that cannot be built here."""
    global _loaded, _core
    if _loaded is not None:
        return
    path = library_path()
    if not path.is_file():
        from . import _jit
        path = _jit.core_library(path)
        _core = True
    torch.ops.load_library(str(path))
    _loaded = path


def loaded() -> tuple[Path | None, bool]:
    """The loaded library (None before load) and whether it is the one built without instances."""
    return _loaded, _core


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
