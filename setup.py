"""`pip install .`: the package with its generator, specs and templates, built in seconds; no
kernel is compiled unless asked. The metadata is in pyproject.toml; this file adds the steps.

What an install holds (under site-packages/attngen/): the runtime, the generator as
`attngen._codegen` (the checkout's codegen/, no top-level `codegen` in site-packages), and
specs/, templates/, tuned/, which that generator reads (its root is the attngen folder).

ATTNGEN_PREBUILD=1 builds every kernel ahead of time in the source tree (`python -m codegen
gen` and `build`, the same as `make build`: ninja under a file lock) against the torch already
installed, so it needs `--no-build-isolation` and a CUDA build of torch; the linked library
(build/lib/attngen_ext.so) goes into the package and the wheel gets a platform tag.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
LIBRARY = "attngen_ext.so"
PREBUILD = os.environ.get("ATTNGEN_PREBUILD") == "1"
GENERATOR_DATA = ("specs", "templates", "tuned")  # what attngen._codegen reads beside itself


def _say(message: str) -> None:
    print(f"attngen: {message}", file=sys.stderr, flush=True)


class BuildPackage(build_py):
    def run(self):
        super().run()
        package = Path(self.build_lib) / "attngen"
        for folder in GENERATOR_DATA:
            shutil.copytree(ROOT / folder, package / folder, dirs_exist_ok=True)
        if not PREBUILD:
            _say("no kernel built now: on a GPU machine with a CUDA torch and nvcc, the first call builds the "
                 "extension's bindings (about a minute, once) and each kernel it uses (seconds each), cached in "
                 "~/.cache/attngen; ATTNGEN_PREBUILD=1 with --no-build-isolation builds every kernel ahead of "
                 "time; `python -m attngen.info` says what this install can run")
            return
        for stage in ("gen", "build"):
            _say(f"python -m codegen {stage}")
            subprocess.run([sys.executable, "-m", "codegen", stage], cwd=ROOT, check=True)
        # What `python -m attngen.info` reads: the manifest the build compiled.
        record = package / "_build" / "generated"
        record.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / "generated" / "manifest.json", record / "manifest.json")
        built = ROOT / "build" / "lib" / LIBRARY
        if not built.is_file():
            raise SystemExit(f"attngen: ATTNGEN_PREBUILD=1, but no {LIBRARY} was linked (the build said why: "
                             f"without a CUDA torch it compiles cubins only)")
        shutil.copy2(built, package / LIBRARY)
        _say(f"packaged {built} as attngen/{LIBRARY}")


class PackageDistribution(Distribution):
    def has_ext_modules(self):
        return PREBUILD  # a prebuilt wheel holds a linked library: a platform tag, not py3-none-any


# setuptools' staging under build/setuptools/: build/lib/ is where ninja links the extension.
setup(cmdclass={"build_py": BuildPackage}, distclass=PackageDistribution,
      options={"build": {"build_base": "build/setuptools"}})
