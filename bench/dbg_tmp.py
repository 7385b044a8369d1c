import torch, attngen
q = torch.randn(1, 1, 4, 2048, device="cuda"); v = torch.randn(1, 1, 4, 8, device="cuda")
try:
    attngen.causal_dot_product(q, q, v)
except ValueError as e:
    print("ValueError OK:", e)
print(attngen.instances()[:2])
