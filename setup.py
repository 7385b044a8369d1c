"""`pip install --no-build-isolation .`: generate, build with ninja, install the package with its
extension. The metadata is in pyproject.toml; this file only adds the build step.

The build runs in the source tree (`python -m codegen build`, the same as `make build`: ninja
under a file lock, one progress line per kernel), against the torch already installed, which is
why build isolation must be off: an isolated build would compile against another torch. The
linked library (build/lib/attngen_ext.so) is copied into the installed package, where
attngen/_ext.py looks for it first. Without a CUDA build of torch the kernels are compiled to
cubins, nothing is linked, and the package installs without an extension (every op then says
so); ATTNGEN_SKIP_BUILD=1 skips the build altogether.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
LIBRARY = "attngen_ext.so"


class BuildWithKernels(build_py):
    def run(self):
        super().run()
        skip = os.environ.get("ATTNGEN_SKIP_BUILD") == "1"
        if skip:
            print("attngen: ATTNGEN_SKIP_BUILD=1, installing without building the kernels", flush=True)
        else:
            for stage in ("gen", "build"):
                print(f"attngen: python -m codegen {stage}", flush=True)
                subprocess.run([sys.executable, "-m", "codegen", stage], cwd=ROOT, check=True)
        # What `python -m attngen.info` reads: the manifest the build compiled and the tuned tables.
        record = Path(self.build_lib) / "attngen" / "_build"
        (record / "generated").mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / "generated" / "manifest.json", record / "generated" / "manifest.json")
        for table in (ROOT / "tuned").glob("*/*.yaml"):
            (record / table.parent.relative_to(ROOT)).mkdir(parents=True, exist_ok=True)
            shutil.copy2(table, record / table.relative_to(ROOT))
        if skip:
            return
        built = ROOT / "build" / "lib" / LIBRARY
        if built.is_file():
            target = Path(self.build_lib) / "attngen" / LIBRARY
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(built, target)
            print(f"attngen: packaged {built} as attngen/{LIBRARY}", flush=True)
        else:
            print(f"attngen: no {LIBRARY} was linked (see the build's message); installing without it", flush=True)


setup(cmdclass={"build_py": BuildWithKernels})
