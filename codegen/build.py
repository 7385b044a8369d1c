"""Stage 5, build: write build/toolchain.ninja for this machine, then run ninja under a file
lock. With a CUDA-enabled torch it links the extension; without one it compiles every
kernel TU to a cubin and says what it skipped."""
from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from .pipeline import ROOT


# nvcc's flags for every kernel, in `make build` and in a build on first use (codegen/jit.py).
# -lineinfo: profilers and the bank check (bench/bank_check.py) map instructions to source lines.
NVCC_FLAGS = ("-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo")


def cuda_home() -> str:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    if Path("/usr/local/cuda/bin/nvcc").is_file():
        return "/usr/local/cuda"
    nvcc = shutil.which("nvcc")
    if nvcc:
        return str(Path(nvcc).resolve().parent.parent)
    return "/usr/local/cuda"


def torch_flags():
    """(cflags, ldflags, reason): reason is None when torch can link a CUDA extension."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return "", "", "torch is not installed"
    includes = " ".join(f"-I{p}" for p in cpp_extension.include_paths())
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cflags = f"{includes} -D_GLIBCXX_USE_CXX11_ABI={abi} -DTORCH_API_INCLUDE_EXTENSION_H"
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    ldflags = f"-L{libdir} -Wl,-rpath,{libdir} -lc10 -ltorch -ltorch_cpu -lc10_cuda -ltorch_cuda"
    if torch.version.cuda is None:
        return cflags, ldflags, f"torch {torch.__version__} is built without CUDA"
    return cflags, ldflags, None


def write_toolchain(build_dir: Path) -> str | None:
    cflags, ldflags, reason = torch_flags()
    home = cuda_home()
    nvcc = os.environ.get("NVCC", os.path.join(home, "bin", "nvcc"))
    text = "\n".join([
        "# Written by `python -m codegen build` for this machine; not committed.",
        f"nvcc = {nvcc}",
        f"cxx = {os.environ.get('CXX', 'c++')}",
        f"cuda_home = {home}",
        f"nvcc_flags = {' '.join(NVCC_FLAGS)}",
        "cxx_flags = -O2 -std=c++17",
        f"torch_cflags = {cflags}",
        f"torch_ldflags = {ldflags}",
    ]) + "\n"
    build_dir.mkdir(parents=True, exist_ok=True)
    path = build_dir / "toolchain.ninja"
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return reason


@contextmanager
def build_lock(build_dir: Path):
    """One build at a time per checkout (two ninjas on one tree corrupt each other)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("waiting for another build of this checkout to finish...", flush=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def ninja_command(targets, jobs=None, ninja_file="generated/build.ninja", keep_going=False) -> list[str]:
    exe = shutil.which("ninja")
    cmd = [exe] if exe else [sys.executable, "-m", "ninja"]
    cmd += ["-f", ninja_file]
    if keep_going:
        cmd += ["-k", "0"]
    if jobs:
        cmd += ["-j", str(jobs)]
    return cmd + list(targets)


def build_bench(jobs: int | None = None, specs: list[str] | None = None) -> int:
    """The benchmark extension: bench-role kinds (of `specs`, default every spec) rendered into
    build/bench/generated and linked as build/bench/lib/attngen_bench_ext.so (needs a CUDA build
    of torch)."""
    from .pipeline import BENCH_LAYOUT, generate_bench
    lowered, _ = generate_bench(specs or None)
    count = sum(len(insts) for _, insts in lowered)
    print(f"bench: {count} bench-role instances into {BENCH_LAYOUT.build}/", flush=True)
    return build("extension", jobs, ninja_file=f"{BENCH_LAYOUT.gen}/build.ninja")


def build(target: str | None = None, jobs: int | None = None, ninja_file: str = "generated/build.ninja") -> int:
    """Build `target` ('extension', 'cubins' or a ninja path); None picks what this machine can."""
    build_dir = ROOT / "build"
    with build_lock(build_dir):
        reason = write_toolchain(build_dir)
        if target is None:
            target = "extension" if reason is None else "cubins"
        if target == "extension" and reason is not None:
            print(f"error: cannot link the extension: {reason}", file=sys.stderr)
            return 2
        cmd = ninja_command([target], jobs, ninja_file)
        print("+ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
        rc = subprocess.call(cmd, cwd=ROOT)
        if rc == 0 and target == "cubins" and reason is not None:
            count = len(list((build_dir / "cubin").rglob("*.cubin")))
            print(f"built {count} kernel cubins; skipped linking the torch extension "
                  f"({reason}; install a CUDA build of torch on a GPU machine to link it)")
        return rc
