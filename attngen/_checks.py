"""Input checks the ops' Python wrappers share (each raises ValueError naming the op and the argument)."""
from __future__ import annotations

from typing import Optional

import torch


def check_tensor(op: str, name: str, t, q: Optional[torch.Tensor]) -> None:
    """`t` is a tensor on a CUDA (or meta) device, and on q's device when q is given."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in ("cuda", "meta"):
        raise ValueError(f"{op}: {name} must be a CUDA tensor, got device {t.device}")
    if q is not None and t.device != q.device:
        raise ValueError(f"{op}: {name} is on {t.device} but q is on {q.device}")
