"""The package version: pyproject.toml's, from the installed metadata or, in a checkout that
is not installed, from the file itself."""
from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path


def _version() -> str:
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():  # a checkout: its own file, whatever copy pip installed elsewhere
        found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.MULTILINE)
        if found:
            return found.group(1)
    try:
        return metadata.version("attngen")
    except metadata.PackageNotFoundError:
        return "unknown"


__version__ = _version()
