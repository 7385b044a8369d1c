"""What `pip install .` makes (issue: the first hour): a wheel in seconds that builds no kernel,
holds the generator inside the package with the specs and templates it reads, and no
top-level `codegen`; an installed copy finds that generator and says what it can run."""
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _pip(*args, cwd=ROOT):
    env = {k: v for k, v in os.environ.items() if k != "ATTNGEN_PREBUILD"}
    return subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, env=env, capture_output=True, text=True)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    started = time.monotonic()
    done = _pip("wheel", "--no-build-isolation", "--no-deps", "-q", "-w", str(out), ".")
    assert done.returncode == 0, done.stderr[-2000:]
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1
    return wheels[0], time.monotonic() - started


def test_the_wheel_builds_no_kernel_and_takes_seconds(wheel):
    path, seconds = wheel
    names = zipfile.ZipFile(path).namelist()
    assert seconds < 60, f"building the wheel took {seconds:.0f} s"
    assert path.name.endswith("-py3-none-any.whl"), path.name  # nothing compiled: pure
    assert not [n for n in names if n.endswith((".so", ".cubin"))]


def test_the_generator_ships_inside_the_package(wheel):
    names = set(zipfile.ZipFile(wheel[0]).namelist())
    assert not [n for n in names if n.split("/")[0] == "codegen"], "a top-level codegen package was installed"
    for want in ("attngen/_codegen/jit.py", "attngen/_codegen/families/delta_rule.py", "attngen/specs/delta_rule.yaml",
                 "attngen/templates/op/op.cpp.j2", "attngen/templates/delta_rule_grad/recurrent_grad.cu.j2",
                 "attngen/tuned/sm_90a/causal_linear.yaml"):
        assert want in names, want


def test_an_installed_copy_finds_its_generator_and_says_what_it_can_run(tmp_path):
    site = tmp_path / "site"
    done = _pip("install", "--no-build-isolation", "--no-deps", "-q", "--target", str(site), ".")
    assert done.returncode == 0, done.stderr[-2000:]
    script = ("import attngen, attngen._jit as j, attngen.info as info; s = info.summary(); "
              "print(attngen.__version__, j._generator().__name__, info.INSTALLED, s['extension']['path'], "
              "len(s['families']), len(s['tuned_tables'])); info.main()")
    env = {**os.environ, "PYTHONPATH": str(site)}
    ran = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr[-2000:]
    first, *rest = ran.stdout.splitlines()
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    # the installed copy's extension path (not a checkout's), no kernels, the tuned tables installed
    assert first.split() == [version, "attngen._codegen.jit", "True", str(site / "attngen" / "attngen_ext.so"), "0",
                             str(len(list((ROOT / "tuned").glob("*/*.yaml"))))]
    text = "\n".join(rest)
    assert "(installed, " in text and "no kernels built" in text
    assert "built on first use: not possible here: " in text
    assert "(not built, nor can it be built on first use here: make build)" in text
