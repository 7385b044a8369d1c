"""Unit tier: the rwkv_grad lowering decides what grad_rkwu.cu's C++ Shape used to compute, and
rejects knobs the kernel cannot build with the knob's name."""
import pytest

from codegen import pipeline
from codegen.arch import ARCHES
from codegen.families import rwkv_grad
from codegen.passes import Rejected

H100 = ARCHES["sm_90a"]
DEFAULT = {"n": 64, "e": 8, "minb": 2, "threads": 128, "l": 8, "float_v": 1, "float_do": 1, "prefetch": 1}


def test_geometry_of_the_measured_default():
    # N 64 bf16 at 2 CTAs per SM: 16 keys of 8 lanes, both tiles in float, 82.3 KB (the figure
    # the C++ Shape gave, bench/results/h100/grad_rkwu_sweep.md).
    g = rwkv_grad.geometry(DEFAULT, 2, H100)
    assert (g["tpk"], g["keys_per_cta"], g["v_type"], g["d_type"], g["smem_bytes"]) == (8, 16, "float", "float", 84224)
    # N 256: a key's 256 values over 32 lanes (e raised to 8), and the float tiles would cost a CTA
    # per SM at 16 bits, so they stay in the input type.
    g = rwkv_grad.geometry({**DEFAULT, "n": 256}, 2, H100)
    assert (g["tpk"], g["keys_per_cta"], g["v_type"], g["d_type"]) == (32, 4, "T", "T")
    # Without the float knobs the tiles stay in the input type whatever the occupancy.
    g = rwkv_grad.geometry({**DEFAULT, "float_v": 0, "float_do": 0}, 2, H100)
    assert (g["v_type"], g["d_type"]) == ("T", "T") and g["smem_bytes"] < 84224


@pytest.mark.parametrize("knob,value,why", [("e", 6, "power of two"), ("minb", 5, "1 to 4"), ("l", 3, "dividing"),
                                            ("threads", 48, "whole number of warps"), ("prefetch", 2, "0 or 1")])
def test_bad_knobs_name_themselves(knob, value, why):
    with pytest.raises(Rejected) as info:
        rwkv_grad._check_knobs({**DEFAULT, knob: value})
    assert info.value.param == knob and why in info.value.reason


def test_every_built_instance_declares_its_shared_memory():
    spec, built = [sb for sb in pipeline.lower(pipeline.expand(pipeline.load())) if sb[0].family == "rwkv_grad"][0]
    assert {i.p["n"] for i in built} == {32, 64, 128, 256}
    for inst in built:
        bank = inst.d["bank"]
        assert {b for r in bank.values() for b in r["buffers"]} == {"kar", "sub", "ov", "v_tile", "do_tile", "out"}
        assert all(r["wavefronts"] >= r["ideal"] > 0 for r in bank.values()), inst.name
