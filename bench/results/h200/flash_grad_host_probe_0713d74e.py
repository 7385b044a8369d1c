"""Ad-hoc: where a flash_attention training step's extra host time goes (not committed)."""
import sys, time, importlib
import torch
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, ".")
from bench import host_us
from bench.flash_attention_grad import sdpa
from torch.nn.attention import SDPBackend
fa = importlib.import_module("attngen.flash_attention")
B, H, N, D = 1, 8, 128, 64
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, d_out = (torch.randn(B, N, H, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4))
leaves = [t.requires_grad_() for t in (q, k, v)]
fwd = lambda: fa.flash_attention(*leaves, causal=True)
flash = lambda: sdpa(SDPBackend.FLASH_ATTENTION, *leaves, True)
def step_backward(f):
    def run():
        for t in leaves: t.grad = None
        f().backward(d_out)
    return run
out = fwd()
probe = {
 "step grad": lambda: torch.autograd.grad(fwd(), leaves, d_out),
 "step grad retain": lambda: torch.autograd.grad(fwd(), leaves, d_out, retain_graph=True),
 "step .backward": step_backward(fwd),
 "fwd recording": fwd,
 "bwd retained graph": lambda: torch.autograd.grad(out, leaves, d_out, retain_graph=True),
 "sdpa flash step grad": lambda: torch.autograd.grad(flash(), leaves, d_out),
}
res = {k: host_us(f, rounds=30) for k, f in probe.items()}
real_grad = fa.GRAD
saved = fa.flash_attention(*[t.detach() for t in leaves], causal=True, return_lse=True)
args = ([t.detach() for t in leaves] + [saved[0], d_out, saved[1], None, None, None, N, N, D ** -0.5, -1, 0, None, 0.0, False])
res["GRAD direct"] = host_us(lambda: real_grad(*args), rounds=30)
fa.GRAD = lambda q, k, v, *rest: (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
res["step grad, formula launches nothing"] = host_us(lambda: torch.autograd.grad(fwd(), leaves, d_out), rounds=30)
res["bwd retained, formula launches nothing"] = host_us(lambda: torch.autograd.grad(out, leaves, d_out, retain_graph=True), rounds=30)
fa.GRAD = real_grad
for k_, v_ in res.items(): print(f"{k_:45s} {v_:7.1f} us")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(50): torch.autograd.grad(fwd(), leaves, d_out)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(50): torch.autograd.grad(out, leaves, d_out, retain_graph=True)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
