"""Small launches of one instance per kernel kind and direction, for compute-sanitizer
(memcheck, racecheck): `compute-sanitizer --tool racecheck python3 tests/gpu/sanitize_small.py`."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import attngen  # noqa: E402
from attngen import reference  # noqa: E402

seen = set()
for name in attngen.instances():
    kind = name.split("_e")[0] if "_generic_" not in name else name.split("_emax")[0]
    key = (kind, "fp32" in name, "bf16" in name)
    if key in seen or "_e64_m64_" not in name and "generic" not in name:
        continue
    seen.add(key)
    dtype = torch.float32 if "fp32" in name else torch.bfloat16 if "bf16" in name else torch.float16
    E, M = (64, 64) if "generic" not in name else (40, 36)
    q, k, v = (torch.randn(1, 2, 600, D, device="cuda").to(dtype) for D in (E, E, M))  # 600: split_time splits
    out = attngen.causal_dot_product_with(name, q, k, v, "_rev_" in name)
    ref = reference.causal_dot_product(q, k, v, "_rev_" in name)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    print(f"{name}: rel err {err:.2e}")
    assert err < 2e-2
torch.cuda.synchronize()
print(f"sanitized {len(seen)} instances")
