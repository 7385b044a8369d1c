"""Family plug-ins: what each family adds to the generic pipeline (its axes, the parameters
of its templates, its lowering, its run-time dispatch variables and support files)."""
from __future__ import annotations

import importlib


def family_module(name: str):
    """The plug-in module for family `name`, or None if there is none."""
    if not name.isidentifier():
        return None
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError:
        return None
