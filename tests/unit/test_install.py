"""Unit tier: `pip install --no-build-isolation .` installs a package that works from any
directory (the kernel build is skipped here: ATTNGEN_SKIP_BUILD=1; setup.py runs the same
`python -m codegen build` as `make build` otherwise)."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def test_pip_install_gives_an_importable_package_with_its_manifest(tmp_path):
    target = tmp_path / "site"
    env = dict(os.environ, ATTNGEN_SKIP_BUILD="1")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
                           "--target", str(target), str(ROOT)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (target / "attngen" / "_build" / "generated" / "manifest.json").is_file()
    script = ("import json, attngen, attngen.info as i; s = i.summary(); "
              "print(json.dumps({'n': sum(f['instances'] for f in s['families'].values()), "
              "'lib': s['extension']['path'], 'tuned': len(s['tuned_tables'])}))")
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(target)))
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    manifest = json.loads((ROOT / "generated" / "manifest.json").read_text())
    assert got["n"] == len(manifest)
    assert got["lib"] == str(target / "attngen" / "attngen_ext.so")   # the installed copy, not a checkout's
    assert got["tuned"] >= 1
