"""Float64 references of the ops (what the kernels are tested against)."""
from __future__ import annotations

import torch


def causal_dot_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, reverse: bool = False,
                       dtype=torch.float64) -> torch.Tensor:
    """o_t = sum_{s<=t} (q_t . k_s) v_s (s >= t when reverse), as a masked matmul in `dtype`."""
    q, k, v = (x.to(dtype) for x in (q, k, v))
    scores = q @ k.transpose(-1, -2)
    scores = scores.triu() if reverse else scores.tril()
    return scores @ v


def causal_dot_product_loops(q, k, v):
    """The seed's CPU algorithm, literally: per step, S += k_t v_t^T then o_t = q_t S."""
    B, H, L, E = q.shape
    M = v.shape[-1]
    out = torch.zeros(B, H, L, M, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            state = torch.zeros(E, M, dtype=torch.float64)
            for t in range(L):
                state += torch.outer(k[b, h, t].double(), v[b, h, t].double())
                out[b, h, t] = q[b, h, t].double() @ state
    return out


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.elu(x) + 1


def causal_linear_attention(q, k, v, eps: float = 1e-6):
    """fast-transformers' CausalLinearAttention on [B, L, H, E] inputs, in float64."""
    Q, K, v = elu_feature_map(q.double()), elu_feature_map(k.double()), v.double()
    Z = 1 / (torch.einsum("nlhi,nlhi->nlh", Q, K.cumsum(1)) + eps)
    V = causal_dot_product(Q.permute(0, 2, 1, 3), K.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3))
    return V.permute(0, 2, 1, 3) * Z[..., None]


def linear_attention(q, k, v, eps: float = 1e-6):
    """fast-transformers' (non-causal) LinearAttention on [B, L, H, E] inputs, in float64."""
    Q, K, v = elu_feature_map(q.double()), elu_feature_map(k.double()), v.double()
    KV = torch.einsum("nshd,nshm->nhmd", K, v)
    Z = 1 / (torch.einsum("nlhd,nhd->nlh", Q, K.sum(dim=1)) + eps)
    return torch.einsum("nlhd,nhmd,nlh->nlhm", Q, KV, Z)
