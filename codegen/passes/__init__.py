"""The checks of stage 3: the bank-conflict model (banks), shared tile layouts (tiles),
vectorization legality (vectorize) and the arch's resource limits (resources). Family
lowerings call them and raise `Rejected` for an impossible instance; codegen/lower.py drives
the stage. Nothing here knows a family."""
from __future__ import annotations


class Rejected(Exception):
    """An instance that cannot be built; `param` names the grid parameter at fault."""

    def __init__(self, param: str, reason: str):
        self.param = param
        self.reason = reason
        super().__init__(f"{param}: {reason}")


def is_pow2(x: int) -> bool:
    """Whether x is a positive power of two (lane counts, rows, tiles that halve or shuffle)."""
    return x > 0 and x & (x - 1) == 0
