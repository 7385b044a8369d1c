"""The measuring half of each family's tuning workload: what `python -m bench.tune_worker`
runs on the GPU (codegen's tuner starts it as a separate process and never imports it; the
planning half, the dispatch variables of a bucket's shape, is the family's TunePlan in
codegen/families/<family>.py). One module per family, with the same names:

  (shape: a bucket's dims, and the values of the axes the bucket fixes with `axes:`, such as
  the delta rule's variant)
  check_shape(shape)
                  a small shape of the same coverage, for the correctness check before timing
  inputs(torch, ops, shape, dtype, seed)
                  fresh inputs on the GPU (`ops`: the tuning extension's op namespace)
  run(ops, instance, inputs) / reference(inputs)
                  the forced instance's output (this call is what gets timed) and the float64
                  reference of the same output
  as_tensor(out)  (optional) a run's output as one tensor for the check, where it is a tuple
"""
from __future__ import annotations

import importlib
from types import ModuleType

def for_family(family: str) -> ModuleType:
    try:
        return importlib.import_module(f"{__name__}.{family}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{family}":
            raise
        raise SystemExit(f"tune: family {family!r} has no tuning workload; add bench/workloads/{family}.py "
                         f"(the contract is in bench/workloads/__init__.py)") from None
