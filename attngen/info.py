"""What this attngen build holds: `python -m attngen.info`.

Families and their instances (from generated/manifest.json, the list the build compiled),
the arch, torch and CUDA, the tuned tables `make gen` turned into dispatch rules, whether
the extension is built, and the instances built on first use in the cache. Needs no GPU.
"""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import torch
import yaml

from . import __version__, _ext

# A checkout (generated/, tuned/ beside the package) or an installed package: its tuned tables
# installed in attngen/tuned/, and where ATTNGEN_PREBUILD=1 built it, the manifest the build
# compiled in attngen/_build/generated/ (setup.py).
PACKAGE = Path(__file__).resolve().parent
INSTALLED = (PACKAGE / "specs").is_dir()
ROOT = PACKAGE if INSTALLED else _ext.ROOT


def _manifest_path(root: Path) -> Path:
    return root / "_build" / "generated" / "manifest.json" if INSTALLED else root / "generated" / "manifest.json"


def _tuned_tables(root: Path) -> list[dict]:
    tables = []
    for path in sorted((root / "tuned").glob("*/*.yaml")):
        doc = yaml.safe_load(path.read_text()) or {}
        buckets = doc.get("buckets") or []
        tables.append({"file": str(path.relative_to(root)), "device": doc.get("device"), "date": doc.get("date"),
                       "rows": len(buckets), "dtypes": sorted({b["dtype"] for b in buckets})})
    return tables


def summary(root: Path = ROOT) -> dict:
    """The build's contents as a dict (what `main` prints)."""
    manifest_path = _manifest_path(root)
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else []
    families: dict[str, dict] = defaultdict(lambda: {"instances": 0, "kinds": Counter(), "dtypes": set()})
    arches = set()
    for row in manifest:
        fam = families[row["family"]]
        fam["instances"] += 1
        fam["kinds"][row["kind"]] += 1
        fam["dtypes"].add(row["dtype"])
        arches.add(row["name"].rsplit("_", 1)[1])
    lib = _ext.library_path()
    return {
        "families": {name: {"instances": f["instances"], "kinds": dict(sorted(f["kinds"].items())),
                            "dtypes": sorted(f["dtypes"])} for name, f in sorted(families.items())},
        "arches": sorted(arches),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "extension": {"path": str(lib), "built": lib.is_file(), "core": _core_path(lib)},
        "tuned_tables": _tuned_tables(root),
        "installed": INSTALLED, "generator": str(root),
        "jit_cache": _jit_cache(),
    }


def _core_path(lib: Path) -> str | None:
    """Where no prebuilt extension is: the one built without its instances, if the cache has it."""
    if lib.is_file():
        return None
    from . import _jit
    core = _jit.built_core()
    return None if core is None else str(core)


def _jit_cache() -> dict:
    """Instances built on first use (attngen/_jit.py): this torch and CUDA's cache, what it holds."""
    from . import _jit
    root = _jit.cache_root()
    names = sorted(json.loads(p.read_text())["name"] for p in root.rglob("instance.json") if (p.parent / "lib.so").is_file())
    return {"enabled": _jit.enabled(), "cannot_build": _jit.cannot_build(), "cache": str(root), "instances": names}


def format_summary(info: dict) -> str:
    where = "installed" if info["installed"] else "checkout"
    if info["families"]:
        built = f"{sum(f['instances'] for f in info['families'].values())} instances for {', '.join(info['arches'])}"
    else:
        built = "no kernels built"
    lines = [f"attngen {__version__} ({where}, {info['generator']}): {built}; torch {info['torch']} "
             f"(CUDA {info['torch_cuda'] or 'none'})"]
    ext, jit = info["extension"], info["jit_cache"]
    if ext["built"]:
        state = "built"
    elif ext["core"]:
        state = f"not prebuilt: its bindings, built without kernels, load from {ext['core']}"
    elif jit["cannot_build"]:
        state = "not built, nor can it be built on first use here: make build"
    else:
        state = f"not prebuilt: the first call builds its bindings, no kernels, into {jit['cache']}/core"
    lines.append(f"extension: {ext['path']} ({state})")
    for name, fam in info["families"].items():
        kinds = ", ".join(f"{k} {n}" for k, n in fam["kinds"].items())
        lines.append(f"  {name}: {fam['instances']} instances ({'/'.join(fam['dtypes'])}): {kinds}")
    for table in info["tuned_tables"]:
        lines.append(f"tuned: {table['file']}: {table['rows']} rows ({'/'.join(table['dtypes'])}), "
                     f"{table['device']}, {table['date']}")
    if not info["tuned_tables"]:
        lines.append("tuned: none (the specs' default dispatch rules apply)")
    if jit["cannot_build"]:
        state = "not possible here: " + "; ".join(jit["cannot_build"])
    else:
        state = "on"
    lines.append(f"built on first use: {state}")
    lines.append(f"first-use cache {jit['cache']}: {len(jit['instances'])} instance(s)")
    lines.extend(f"  {name}" for name in jit["instances"])
    return "\n".join(lines)


def main() -> None:
    print(format_summary(summary()))


if __name__ == "__main__":
    main()
