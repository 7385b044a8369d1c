"""Vectorization legality: a vector access must be 4, 8 or 16 bytes and tile the dims it
walks exactly (a run-time alignment check in dispatch covers the tensor's own strides)."""
from __future__ import annotations

LEGAL_BYTES = (4, 8, 16)


def check(vec: int, elem_bytes: int, dims: dict) -> None:
    from . import Rejected

    if vec * elem_bytes not in LEGAL_BYTES:
        raise Rejected("vec", f"vec={vec} of {elem_bytes}-byte elements is {vec * elem_bytes} bytes; "
                              f"a vector access must be one of {LEGAL_BYTES} bytes")
    for param, size in dims.items():
        if size % vec:
            raise Rejected(param, f"{param}={size} is not divisible by the vector width vec={vec}")


def contiguous_align(dtype_bytes: int, *sizes: int) -> int:
    """The vector width (elements) contiguous tensors allow: 16 bytes, halved until it divides
    every innermost size (the bindings' vector_align on fresh allocations)."""
    align = 16 // dtype_bytes
    while align > 1 and any(size % align for size in sizes):
        align //= 2
    return align
