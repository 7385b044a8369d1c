"""Launchers set kernel attributes through the helpers of templates/common/device.cuh
(`allow_dynamic_smem`, `prefer_smem_carveout`), which set each once per kernel, device and
attribute: set on every launch it cost each eager call about 2 us of host time
(bench/results/h200/paged_host_launches_before_e9eb487.md). A template that calls
cudaFuncSetAttribute directly would bring that back unnoticed."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HELPER = ROOT / "templates" / "common" / "device.cuh.j2"


def test_kernel_attributes_are_set_through_the_helpers():
    direct = [f"{path.relative_to(ROOT)}:{number}"
              for path in sorted((ROOT / "templates").rglob("*.j2")) if path != HELPER
              for number, line in enumerate(path.read_text().splitlines(), 1)
              if "cudaFuncSetAttribute" in line or "cudaFuncAttribute" in line]
    assert not direct, "set through device.cuh's helpers (once per kernel and device), not directly: " + ", ".join(direct)
    assert "cudaFuncAttributeMaxDynamicSharedMemorySize" in HELPER.read_text()
    users = [p for p in (ROOT / "templates").rglob("*.j2") if "allow_dynamic_smem(" in p.read_text() and p != HELPER]
    assert len(users) >= 10, f"only {len(users)} templates call allow_dynamic_smem"
