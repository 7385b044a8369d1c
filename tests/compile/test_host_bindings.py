"""Compile tier: the extension's host TUs (each family's generated bindings, op.cpp, and
extension.cpp) compile against the installed torch's headers, checked for syntax and types
only (-fsyntax-only: nothing links), so a template error in the bindings fails here on the CPU
machine instead of in the GPU machine's build. A CPU wheel of torch ships the CUDA headers but
not the header its CMake build writes (c10/cuda/impl/cuda_cmake_macros.h); the test supplies
what a CUDA build's holds."""
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.compile
CMAKE_MACROS = "c10/cuda/impl/cuda_cmake_macros.h"


def host_sources() -> list[Path]:
    return [ROOT / "generated" / "extension.cpp"] + sorted((ROOT / "generated").glob("*/op.cpp"))


def _command(src: Path, stub: Path) -> list[str]:
    import shlex

    from codegen.build import cuda_home, torch_flags
    cflags, _, _ = torch_flags()
    return [os.environ.get("CXX", "c++"), "-std=c++17", "-fsyntax-only", "-w", f"-I{stub}", f"-I{cuda_home()}/include",
            *shlex.split(cflags), str(src)]


def test_every_binding_compiles_against_torchs_headers(tmp_path):
    torch = pytest.importorskip("torch")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no host C++ compiler")
    if not (Path(torch.__file__).parent / "include" / "c10" / "cuda" / "CUDAGuard.h").is_file():
        pytest.skip("this torch ships no CUDA headers")
    stub = tmp_path / "stub"
    if not (Path(torch.__file__).parent / "include" / CMAKE_MACROS).is_file():
        (stub / CMAKE_MACROS).parent.mkdir(parents=True)
        (stub / CMAKE_MACROS).write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    sources = host_sources()
    assert len(sources) == 1 + len(__import__("codegen.families", fromlist=["names"]).names())

    def check(src):
        return src, subprocess.run(_command(src, stub), capture_output=True, text=True)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        done = list(pool.map(check, sources))
    failed = [f"{src.relative_to(ROOT)}:\n{proc.stderr[-2000:]}" for src, proc in done if proc.returncode != 0]
    assert not failed, "\n".join(failed)
