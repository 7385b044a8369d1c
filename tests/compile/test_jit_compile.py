"""Compile tier of instances built on first use: the generator plans, renders and compiles one
(paged D=48, no prebuilt instance covers it) with nvcc into a shared library that exports its
dispatch-table row, as attngen/_jit.py would on a GPU machine."""
import ctypes
import os
import subprocess
from pathlib import Path

import pytest

from codegen import jit
from tests.compile.test_nvcc import nvcc_available

pytestmark = pytest.mark.compile


def test_a_paged_instance_for_an_unbuilt_head_size_compiles_and_links(tmp_path):
    if not nvcc_available():
        pytest.skip("nvcc not found (set CUDA_HOME)")
    key = {"D": 48, "G": 7, "S": 3, "Q": 1, "KVE": 0, "Hq": 28, "Hkv": 4, "L": 1000, "align": 8, "sm_count": 132}
    plan = jit.plan(jit.spec_of("paged_decode"), key, {"dtype": "fp16"}, "compile-tier")
    path = jit.build(plan, tmp_path)
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True).stdout
    assert "attngen_jit_entry" in symbols
    assert plan.inst.launcher in symbols, "the instance's launcher is in the library"
    ctypes.CDLL(str(path))  # loads: nothing unresolved (cudart is linked)


def test_the_tables_of_the_extension_built_without_instances_compile(tmp_path):
    """codegen/core.py's tables (rows with no launcher, filled by name on first use) are C++ that
    compiles: each family's dispatch.cpp, which needs only the CUDA runtime's headers."""
    from codegen import core, render
    from codegen.build import cuda_home
    include = Path(cuda_home()) / "include"
    if not (include / "cuda_runtime.h").is_file():
        pytest.skip("the CUDA toolkit's headers are not installed (set CUDA_HOME)")
    files = core.sources()
    render.write_tree(tmp_path, files)
    tables = sorted(rel for rel in files if rel.endswith("/dispatch.cpp"))
    assert len(tables) >= 5
    for rel in tables:
        done = subprocess.run([os.environ.get("CXX", "c++"), "-std=c++17", "-fsyntax-only", f"-I{tmp_path / rel.split('/')[0]}",
                               f"-I{tmp_path}", f"-I{include}", str(tmp_path / rel)], capture_output=True, text=True)
        assert done.returncode == 0, f"{rel}:\n{done.stderr[-3000:]}"
