"""What the tuner times per family: one module each, with the same five names.

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

FAMILIES = ("causal_linear", "rwkv", "rwkv_grad", "paged")


def for_family(family: str) -> ModuleType:
    if family not in FAMILIES:
        raise SystemExit(f"tune: no tuning workload for family {family!r}; the tuner knows {list(FAMILIES)}")
    return importlib.import_module(f"{__name__}.{family}")


def contiguous_align(dtype_bytes: int, *sizes: int) -> int:
    """The vector width (elements) contiguous tensors allow: 16 bytes, halved until it divides
    every innermost size (the bindings' vector_align on fresh allocations)."""
    align = 16 // dtype_bytes
    while align > 1 and any(size % align for size in sizes):
        align //= 2
    return align
