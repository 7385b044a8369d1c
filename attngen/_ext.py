"""Loads the built extension (build/lib/attngen_ext.so, or $ATTNGEN_LIB) once."""
from __future__ import annotations

import os
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_LIB = ROOT / "build" / "lib" / "attngen_ext.so"
_loaded: Path | None = None


def library_path() -> Path:
    return Path(os.environ.get("ATTNGEN_LIB", DEFAULT_LIB))


def available() -> bool:
    return _loaded is not None or library_path().is_file()


def load() -> None:
    """Load the extension so that torch.ops.attngen.* exist; a clear error if it is not built."""
    global _loaded
    if _loaded is not None:
        return
    path = library_path()
    if not path.is_file():
        raise RuntimeError(f"attngen: the extension {path} is not built; run `make build` on a machine "
                           f"with a CUDA build of torch")
    torch.ops.load_library(str(path))
    _loaded = path
