"""What the tuner times per family: one module each, with the same names.

  AXES            the axis values candidates are built and timed at, besides dtype (the tuned
                  winner then serves every value of those axes: the same code either way)
  runtime(shape, dtype_bytes, sm_count)
                  the dispatch variables the generated table computes for contiguous inputs of
                  a bucket's `shape` (the spec's SHAPE_DIMS)
  check_shape(shape)
                  a small shape of the same coverage, for the correctness check before timing
  inputs(torch, shape, dtype, seed)
                  fresh inputs on the GPU
  run(ops, instance, inputs) / reference(inputs)
                  the forced instance's output through `ops` (the tuning extension's op
                  namespace; this call is what gets timed) and the float64 reference of the
                  same output
  as_tensor(out)  (optional) a run's output as one tensor for the check, where it is a tuple

CPU code (candidates, defaults, tables) uses only AXES and runtime; the rest runs on the GPU.
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
        raise SystemExit(f"tune: family {family!r} has no tuning workload; add codegen/tune/workloads/{family}.py "
                         f"(the contract is in codegen/tune/workloads/__init__.py)") from None
