"""Unit tier: the roofline reads every committed benchmark result and places each case under its
floor (no measured time is faster than the bytes or FLOPs allow)."""
from bench import roofline
from tests.conftest import ROOT


def test_every_case_sits_under_its_floor():
    rows, limits = roofline.build(ROOT / "bench" / "results" / "h100")
    ops = {r["op"].split()[0] for r in rows}
    assert ops == {"causal_linear", "wkv6", "paged", "flash"}
    assert all(0 < r["fraction"] <= 1.0 for r in rows), [r for r in rows if not 0 < r["fraction"] <= 1.0]
    assert 2.0 < limits["copy_tbps"] < 4.0 and 500 < limits["bf16_matmul_tflops"] < 1000


def test_floors_pick_the_larger_term():
    f = roofline.floors(nbytes=3e9, flop=1e12, tbps=3.0, tflops=100.0)
    assert f["bound"] == "compute" and abs(f["floor_ms"] - 10.0) < 1e-9 and abs(f["memory_floor_ms"] - 1.0) < 1e-9


def test_the_figure_is_a_png(tmp_path):
    rows, limits = roofline.build(ROOT / "bench" / "results" / "h100")
    path = roofline.draw(rows, limits, tmp_path / "roofline.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
