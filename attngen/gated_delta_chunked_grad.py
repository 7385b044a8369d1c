"""Gated DeltaNet's backward by chunks, composed of batched torch products (no generated
kernel yet): the explicit adjoint of the chunked kinds' algorithm that
`reference.gated_delta_rule_chunked_grad` writes out step by step in float64, here over every
chunk at once in float32, with the states before each chunk taken from the forward's
checkpoints (a chunk is the checkpoint interval: the forward saves the state before each).

Three stages, as a generated backward would run them:
  1. every chunk at once: the state gradient's step through the chunk as an affine map,
     G_before = Phi G_after + Psi;
  2. the chunks in reverse: one [K, K] x [K, V] product a chunk (torch.baddbmm over B * H);
  3. every chunk at once: the inputs' gradients from G_after and the state before the chunk.
The chunks' [C, C] matrices (T, M, W, ...) are made once for both batched stages; these run
over slabs of chunks (`_SLAB_ELEMENTS`) so that their [C, V] and [K, V] temporaries stay within
a bounded size whatever B * T * H.
"""
from __future__ import annotations

import torch

_SLAB_ELEMENTS = 1 << 27  # chunk-state elements ([K, V] per chunk) a slab holds: 512 MiB of float32


def _chunked(x: torch.Tensor, n: int, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, ...] -> [B * H * n, chunk, ...] in `dtype`, zero-padded to whole chunks (a padded
    step has no decay, no correction, no output and no output gradient)."""
    B, T, H = x.shape[:3]
    x = torch.nn.functional.pad(x.to(dtype), (0, 0) * (x.dim() - 3) + (0, 0, 0, n * chunk - T))
    return x.view(B, n, chunk, H, *x.shape[3:]).movedim(3, 1).reshape(B * H * n, chunk, *x.shape[3:])


def _unchunked(x: torch.Tensor, B: int, H: int, T: int) -> torch.Tensor:
    """_chunked's inverse, the padding dropped: [B * H * n, chunk, ...] -> [B, T, H, ...]."""
    x = x.view(B, H, -1, *x.shape[1:]).movedim(1, 3)
    return x.reshape(B, -1, H, *x.shape[4:])[:, :T]


def _chunk_matrices(q, k, gc, beta):
    """Per chunk: R = exp(gc_t - gc_j) (j <= t, else 0), K K^T, Q K^T, T = (I + A)^-1 with
    A[t, j] = beta_t R k_t . k_j (j < t), M = T diag(beta), P = R * Q K^T (j <= t), W = P M."""
    chunk = gc.shape[-1]
    diff = gc[:, :, None] - gc[:, None, :]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    R = diff.masked_fill(~lower, float("-inf")).exp()
    KK, QK = k @ k.transpose(-1, -2), q @ k.transpose(-1, -2)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    A = (beta[:, :, None] * R * KK).tril(-1)
    Tinv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    M, P = Tinv * beta[:, None, :], (QK * R).tril()
    return R, KK, QK, Tinv, M, P, P @ M


def _state_step(q, k, gc, d_o, mats):
    """Stage 1 for a slab: (Phi [N, K, K], Psi [N, K, V]) with
    Phi = gamma_C I - K^T diag(gamma) M^T diag(d) K and Psi = Q^T diag(gamma) dO - K^T diag(gamma) W^T dO
    (dO already scaled; gamma = exp(gc), d = exp(gc_C - gc); mats: the slab's _chunk_matrices)."""
    R, KK, QK, Tinv, M, P, W = mats
    gamma, tail = gc.exp(), (gc[:, -1:] - gc).exp()
    gk = (gamma[..., None] * k).transpose(-1, -2)                       # K^T diag(gamma)
    phi = -(gk @ (M.transpose(-1, -2) @ (tail[..., None] * k)))
    phi.diagonal(dim1=-2, dim2=-1).add_(gamma[:, -1:])
    psi = torch.baddbmm((gamma[..., None] * q).transpose(-1, -2) @ d_o, gk, W.transpose(-1, -2) @ d_o, alpha=-1)
    return phi, psi


def _input_grads(q, k, v, gc, beta, d_o, S, G, mats):
    """Stage 3 for a slab: (dq, dk, dv, dg, dbeta) of its chunks from the state S before each and
    the state gradient G after it (dO already scaled). The terms, per chunk (d_t = exp(gc_C - gc_t)):
        Y = V - diag(gamma) K S,  U = M Y,  dU = diag(d) K G,  dY = W^T dO + M^T dU,  dV = dY,
        dW = dO Y^T,  dM = dU Y^T + P^T dW,  dP = dW M^T,  dA = strict_lower(-T^T dM diag(beta) T^T),
        dQ = diag(gamma) dO S^T + (dP * R) K,
        dK = diag(d) U G^T - diag(gamma) dY S^T + (dA' + dA'^T) K + (dP * R)^T Q  (dA' = dA beta_t R),
    and gc's gradient from gamma, d and R; g's is its reverse cumulative sum within the chunk."""
    R, KK, QK, Tinv, M, P, W = mats
    gamma, tail = gc.exp(), (gc[:, -1:] - gc).exp()
    KS, QS = k @ S, q @ S
    Y = v - gamma[..., None] * KS
    U = M @ Y
    dUd = k @ G                                   # the gradient of diag(d) U
    dU = tail[..., None] * dUd
    dY = torch.baddbmm(W.transpose(-1, -2) @ d_o, M.transpose(-1, -2), dU)
    dW = d_o @ Y.transpose(-1, -2)
    dM = dU @ Y.transpose(-1, -2) + P.transpose(-1, -2) @ dW
    dP = dW @ M.transpose(-1, -2)
    dA = (-Tinv.transpose(-1, -2) @ (dM * beta[:, None, :]) @ Tinv.transpose(-1, -2)).tril(-1)
    dKK = dA * beta[:, :, None] * R
    dQK = (dP * R).tril()
    dq = gamma[..., None] * (d_o @ S.transpose(-1, -2)) + dQK @ k
    dk = ((tail[..., None] * U) @ G.transpose(-1, -2) - gamma[..., None] * (dY @ S.transpose(-1, -2))
          + (dKK + dKK.transpose(-1, -2)) @ k + dQK.transpose(-1, -2) @ q)
    # gc's gradient: through d_t, gamma_t, gamma_C (the state carried over) and R.
    dtail = (U * dUd).sum(-1) * tail
    dgc = gamma * ((QS * d_o).sum(-1) - (KS * dY).sum(-1)) - dtail
    dgc[:, -1] += dtail.sum(-1) + (S * G).sum((-1, -2)) * gamma[:, -1]
    F = (dKK * KK + dP.tril() * QK * R)
    dgc += F.sum(-1) - F.sum(-2)
    dbeta = (dM * Tinv).sum(-2) + (dA * R * KK).sum(-1)
    dg = dgc.flip(-1).cumsum(-1).flip(-1)        # gc = cumsum(g) within a chunk
    return dq, dk, dY, dg, dbeta


def _slabs(count: int, per_item: int):
    step = max(1, _SLAB_ELEMENTS // max(per_item, 1))
    return [slice(i, min(i + step, count)) for i in range(0, count, step)]


def gated_delta_chunked_backward(q, k, v, g, beta, d_o, checkpoints, d_state, scale: float,
                                 want_d_state0: bool, every: int, dtype: torch.dtype = torch.float32):
    """(dq, dk, dv, dg, dbeta, d_state0) for Gated DeltaNet's output gradient d_o [B, T, H, V]
    and final-state gradient d_state [B, H, K, V] (or None), given the forward's checkpoints
    [B, H, n, K, V] float32 (the state before each chunk of `every` steps). Gradients come in the
    inputs' dtypes; d_state0 in `dtype` (None unless want_d_state0), the arithmetic's dtype
    (float32; float64 for tests)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    n = (T + every - 1) // every
    assert checkpoints.shape == (B, H, n, K, V), (checkpoints.shape, (B, H, n, K, V))
    if n == 0:  # no steps: no gradient but the state's, which passes through
        d_state0 = torch.zeros(B, H, K, V, dtype=dtype, device=q.device) if d_state is None else d_state.to(dtype)
        return (*(torch.zeros_like(x) for x in (q, k, v, g, beta)), d_state0 if want_d_state0 else None)
    qc, kc, vc = (_chunked(x, n, every, dtype) for x in (q, k, v))
    dO = _chunked(d_o, n, every, dtype).mul_(scale)
    gc, bc = _chunked(g, n, every, dtype).cumsum(-1), _chunked(beta, n, every, dtype)
    N = B * H * n
    mats = _chunk_matrices(qc, kc, gc, bc)
    # Stage 1, then stage 2 in (chunk, b * h) order: after[c] = G after chunk c (contiguous
    # for baddbmm's out), G before chunk c = Phi[c] after[c] + Psi[c].
    phi = torch.empty(B * H, n, K, K, dtype=dtype, device=q.device)
    psi = torch.empty(B * H, n, K, V, dtype=dtype, device=q.device)
    for s in _slabs(N, K * max(K, V)):
        phi.view(N, K, K)[s], psi.view(N, K, V)[s] = _state_step(qc[s], kc[s], gc[s], dO[s],
                                                                  [x[s] for x in mats])
    after = torch.empty(n, B * H, K, V, dtype=dtype, device=q.device)
    if d_state is None:
        after[-1].zero_()
    else:
        after[-1].copy_(d_state.reshape(B * H, K, V))
    for c in reversed(range(1, n)):
        torch.baddbmm(psi[:, c], phi[:, c], after[c], out=after[c - 1])
    G = torch.baddbmm(psi[:, 0], phi[:, 0], after[0])
    del phi, psi
    S = checkpoints.to(dtype).reshape(N, K, V)
    after = after.transpose(0, 1).reshape(N, K, V)
    dq, dk, dv = torch.empty_like(qc), torch.empty_like(kc), torch.empty_like(vc)
    dg, dbeta = torch.empty_like(gc), torch.empty_like(bc)
    for s in _slabs(N, K * V):
        dq[s], dk[s], dv[s], dg[s], dbeta[s] = _input_grads(qc[s], kc[s], vc[s], gc[s], bc[s], dO[s], S[s],
                                                            after[s], [x[s] for x in mats])
    grads = [_unchunked(x, B, H, T).to(t.dtype) for x, t in ((dq, q), (dk, k), (dv, v), (dg, g), (dbeta, beta))]
    return (*grads, G.view(B, H, K, V) if want_d_state0 else None)
