"""GPU tier: a tiny tuning grid end to end, in a subprocess (its own op namespace)."""
import subprocess
import sys

import pytest
import yaml

from ..conftest import ROOT

pytestmark = pytest.mark.gpu

TINY_TUNE = """
tune:
  dtypes: [fp32]
  buckets:
    - name: e64_any
      when: "E <= 64 and M <= 64"
      shape: {B: 2, H: 4, L: 512, E: 64, M: 64}
  kernels:
    lmha:
      grid: {e: [64], m: [64], cols: [64], mpt: [2, 4], tph: [8], vec: [4], chunk: [8], buf: [2], pad: [auto], seg: [0]}
    low_occupancy:
      grid: {e: [64], m: [64], cols: [8], mpt: [1], tph: [16], vec: [4], chunk: [32], buf: [2], pad: [auto], seg: [0]}
    split_time:
      grid: {e: [64], m: [64], cols: [16], mpt: [2], tph: [16], vec: [4], chunk: [32], buf: [2], pad: [auto], seg: [128]}
"""


def test_tiny_tune_end_to_end(tmp_path):
    text = (ROOT / "specs" / "causal_linear.yaml").read_text()
    spec = tmp_path / "causal_linear_tinytune.yaml"
    spec.write_text(text[:text.index("\ntune:")] + TINY_TUNE)
    table = ROOT / "tuned" / "sm_90a" / "causal_linear_tinytune.yaml"
    try:
        for attempt in range(2):  # the second run is served from the cache
            proc = subprocess.run([sys.executable, "-m", "codegen", "tune", str(spec), "--out", str(tmp_path)],
                                  cwd=ROOT, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "0 to time" in proc.stdout
        doc = yaml.safe_load(table.read_text())
        (entry,) = doc["buckets"]
        assert entry["bucket"] == "e64_any" and entry["time_ms"] > 0 and entry["candidates"] >= 3
        assert entry["default"] and entry["speedup_vs_default"] > 0
        assert (tmp_path / "tune_causal_linear_tinytune.png").is_file()
    finally:
        table.unlink(missing_ok=True)
