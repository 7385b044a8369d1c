"""Compile tier: every generated kernel TU compiles for its arch with nvcc (no GPU needed),
ptxas reports no spills (or no more than the kind's spill_bytes in its spec), and the registers and shared memory fit the arch."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.compile


def nvcc_available() -> bool:
    from codegen.build import cuda_home
    return shutil.which("nvcc") is not None or (Path(cuda_home()) / "bin" / "nvcc").is_file()


@pytest.fixture(scope="module")
def cubins():
    if not nvcc_available():
        pytest.skip("nvcc not found (set CUDA_HOME)")
    proc = subprocess.run([sys.executable, "-m", "codegen", "build", "--target", "cubins"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return ROOT / "build" / "cubin"


def test_every_instance_compiles_without_spills(cubins):
    manifest = json.loads((ROOT / "generated" / "manifest.json").read_text())
    problems = []
    for row in manifest:
        stem = row["file"][:-3]
        cubin, log = cubins / f"{stem}.cubin", cubins / f"{stem}.cubin.log"
        if not cubin.is_file():
            problems.append(f"{row['name']}: no cubin")
            continue
        text = log.read_text()
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", text)]
        allowed = row["derived"].get("spill_bytes_allowed", 0)  # the kind's spill_bytes in its spec
        if not spills or max(spills) > allowed:
            problems.append(f"{row['name']}: spills {spills} (its spec allows {allowed} bytes)")
        regs = [int(x) for x in re.findall(r"Used (\d+) registers", text)]
        threads = row["derived"]["threads"]
        if not regs or max(regs) * threads > 65536:
            problems.append(f"{row['name']}: {regs} registers x {threads} threads exceed the register file")
        if row["derived"]["smem_bytes"] > 227 * 1024:
            problems.append(f"{row['name']}: shared memory {row['derived']['smem_bytes']}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("family", __import__("codegen.families", fromlist=["names"]).names())
def test_host_dispatch_compiles(family):
    if shutil.which("c++") is None:
        pytest.skip("no host C++ compiler")
    from codegen.build import cuda_home
    src = ROOT / "generated" / family / "dispatch.cpp"
    proc = subprocess.run(["c++", "-std=c++17", "-fsyntax-only", f"-I{cuda_home()}/include", str(src)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_report_covers_every_instance(cubins, tmp_path):
    """make report: one row per instance, each with ptxas' registers and a theoretical occupancy."""
    from codegen import report
    path = report.write(ROOT, tmp_path)
    rows = json.loads((tmp_path / "report.json").read_text())
    manifest = json.loads((ROOT / "generated" / "manifest.json").read_text())
    assert [r["name"] for r in rows] == [m["name"] for m in manifest]
    missing = [r["name"] for r in rows if not r["built"] or r["registers"] == 0 or r["ctas_per_sm"] < 1]
    assert not missing, missing[:5]
    assert path.read_text().count("\n| `") == len(rows)
