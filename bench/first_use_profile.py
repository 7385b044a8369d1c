"""Where a process's time goes when the extension was built without its instances and the cache
holds what it calls (the second process of bench/first_use.sh): import, CUDA start, loading the
extension, the first call (planning the row, finding it in the cache, registering it), the
second call; then a profile of the first call. Run it twice with ATTNGEN_LIB naming no library
and one ATTNGEN_CACHE: the first run builds, the second is the one to read.
  python -m bench.first_use_profile"""
import cProfile
import pstats
import time

t0 = time.monotonic()


def lap(what):
    global t0
    now = time.monotonic()
    print(f"{what}: {now - t0:.2f} s", flush=True)
    t0 = now


import torch  # noqa: E402
lap("import torch")
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
lap("CUDA start")
import attngen  # noqa: E402
from attngen import _ext  # noqa: E402
lap("import attngen")
_ext.load()
lap("load the extension")
q = torch.randn(2, 8, 4096, 64, device="cuda")
k, v = torch.randn_like(q), torch.randn_like(q)
torch.cuda.synchronize()
lap("inputs")
profile = cProfile.Profile()
profile.enable()
attngen.causal_dot_product(q, k, v)
torch.cuda.synchronize()
profile.disable()
lap("first call")
attngen.causal_dot_product(q, k, v)
torch.cuda.synchronize()
lap("second call")
pstats.Stats(profile).sort_stats("cumulative").print_stats(20)
