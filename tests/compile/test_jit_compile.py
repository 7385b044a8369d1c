"""Compile tier of instances built on first use: the generator plans, renders and compiles one
(paged D=48, no prebuilt instance covers it) with nvcc into a shared library that exports its
dispatch-table row, as attngen/_jit.py would on a GPU machine."""
import ctypes
import subprocess

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
