"""Float64 references of the ops (what the kernels are tested against)."""
from __future__ import annotations

import math

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


def wkv(r, k, v, w, u, state=None, dtype=torch.float64):
    """RWKV6 wkv as the naive recurrence in `dtype` (differentiable, so its autograd is the
    backward's reference). r, k, v, w [B, T, H, N] with w the log decay; u [H, N]; state
    [B, H, N(key), N(value)] or None. Returns o [B, T, H, N] and the final state.

        o_t[i] = sum_j r_t[j] (u[j] k_t[j] v_t[i] + S[j, i]);  S[j, i] <- S[j, i] exp(w_t[j]) + k_t[j] v_t[i]
    """
    r, k, v, w = (x.to(dtype) for x in (r, k, v, w))
    u = u.to(dtype)
    B, T, H, N = r.shape
    S = torch.zeros(B, H, N, N, dtype=dtype, device=r.device) if state is None else state.to(dtype)
    outs = []
    for t in range(T):
        kv = k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhj,bhji->bhi", r[:, t], S + u[None, :, :, None] * kv))
        S = S * torch.exp(w[:, t])[..., None] + kv
    o = torch.stack(outs, 1) if outs else r.new_zeros(B, 0, H, N)
    return o, S


def wkv_scan(q, kc, vo, w, u=None, state=None, reverse=False, keys_output=False, return_state=True,
             float_out=False, checkpoints=None, *, every=None, dtype=torch.float64):
    """The generated scan kernels' contract (templates/rwkv/params.cuh), in `dtype`: per (b, h),
    read X then update it, walking time forward or in reverse:
        y_t[o] = sum_c q_t[c] X[c, o] + vo_t[o] uo[o] sum_c q_t[c] uc[c] kc_t[c]
        X[c, o] <- X[c, o] exp(w_t[key]) + kc_t[c] vo_t[o]
    key = o (u on o) if keys_output else c (u on c). state and the returned state are
    [B, H, key, value] as wkv's, so X is the state, transposed when keys_output. A forward walk
    with `checkpoints` [B, H, ceil(T / every), N, N] writes the state before steps 0, every, ..."""
    q, kc, vo, w = (x.to(dtype) for x in (q, kc, vo, w))
    B, T, H, N = q.shape
    if state is None:
        X = torch.zeros(B, H, N, N, dtype=dtype, device=q.device)
    else:
        X = state.to(dtype).transpose(-1, -2) if keys_output else state.to(dtype)
    ys = [None] * T
    for t in (reversed(range(T)) if reverse else range(T)):
        if checkpoints is not None and t % every == 0:
            checkpoints[:, :, t // every] = X.transpose(-1, -2) if keys_output else X
        qt, kt, vt = q[:, t], kc[:, t], vo[:, t]
        y = torch.einsum("bhc,bhco->bho", qt, X)
        if u is not None:
            uu = u.to(dtype)
            if keys_output:
                y = y + vt * uu * (qt * kt).sum(-1, keepdim=True)
            else:
                y = y + vt * (qt * uu * kt).sum(-1, keepdim=True)
        ys[t] = y
        decay = torch.exp(w[:, t])
        X = X * (decay[..., None, :] if keys_output else decay[..., :, None]) + kt[..., :, None] * vt[..., None, :]
    y = torch.stack(ys, 1) if T else q.new_zeros(B, 0, H, N)
    final = X.transpose(-1, -2) if keys_output else X
    return y, (final if return_state else X.new_zeros(0))


def wkv_grad_rkwu(r, k, v, w, u, d_o, checkpoints, d_state=None, want_d_state0=True, *, every,
                  dtype=torch.float64):
    """The contract of the backward pass for r, k, w, u and the initial state
    (templates/rwkv_grad/grad_rkwu.cu.j2), in `dtype`, taking S_{t-1} only from the forward's
    checkpoints (the state before steps 0, every, 2 every, ...) rebuilt forward within each
    window. Returns dr, dk, dw (r's dtype), du per batch [B, H, N] and dS_0 (or an empty tensor)."""
    out_dtype = r.dtype
    r, k, v, w, u, d_o = (x.to(dtype) for x in (r, k, v, w, u, d_o))
    B, T, H, N = r.shape
    decay = torch.exp(w)
    S_prev = torch.empty(B, T, H, N, N, dtype=dtype, device=r.device)  # S_{t-1}[j, i]
    for t in range(T):
        if t % every == 0:
            S = checkpoints[:, :, t // every].to(dtype)
        S_prev[:, t] = S
        S = S * decay[:, t, :, :, None] + k[:, t, :, :, None] * v[:, t, :, None, :]
    dS = torch.zeros(B, H, N, N, dtype=dtype, device=r.device) if d_state is None else d_state.to(dtype)
    dr, dk, dw = (torch.empty(B, T, H, N, dtype=dtype, device=r.device) for _ in range(3))
    ov = (d_o * v).sum(-1, keepdim=True)
    for t in reversed(range(T)):
        dr[:, t] = torch.einsum("bhji,bhi->bhj", S_prev[:, t], d_o[:, t]) + u * k[:, t] * ov[:, t]
        dk[:, t] = torch.einsum("bhji,bhi->bhj", dS, v[:, t]) + u * r[:, t] * ov[:, t]
        dw[:, t] = decay[:, t] * (dS * S_prev[:, t]).sum(-1)
        dS = dS * decay[:, t, :, :, None] + r[:, t, :, :, None] * d_o[:, t, :, None, :]
    du = (r * k * ov).sum(1)
    d_s0 = dS if want_d_state0 else dS.new_zeros(0)
    return dr.to(out_dtype), dk.to(out_dtype), dw.to(out_dtype), du, d_s0


def paged_decode(q, k_cache, v_cache, block_table, context_lens, scale=None, alibi_slopes=None,
                 soft_cap=0.0, kv_layout="NHD", dtype=torch.float64, k_scale=None, v_scale=None) -> torch.Tensor:
    """Paged decode attention by gathering each sequence's pages into a contiguous K and V and
    taking a softmax in `dtype`. q [S, Hq, D] or [S, Q, Hq, D]: query token i of Q sits at
    position n - Q + i of its context of n tokens and sees tokens 0 .. n - Q + i. Cache NHD
    [blocks, block_size, Hkv, D] or HND [blocks, Hkv, block_size, D]; zeros for a query that
    sees no token. An fp8 cache is dequantized first: K = k_scale * k, V = v_scale * v with
    k_scale, v_scale [1] or [Hkv]. Returns the shape of q."""
    if kv_layout == "HND":
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    q4 = q if q.dim() == 4 else q[:, None]
    S, Q, Hq, D = q4.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    out = torch.zeros(S, Q, Hq, D, dtype=dtype)
    k_cache, v_cache = k_cache.cpu().to(dtype), v_cache.cpu().to(dtype)
    if k_scale is not None:
        k_cache = k_cache * k_scale.cpu().to(dtype)[:, None]          # [Hkv or 1, 1] over (head, dim)
    if v_scale is not None:
        v_cache = v_cache * v_scale.cpu().to(dtype)[:, None]
    for s in range(S):
        n = int(context_lens[s])
        if n == 0:
            continue
        pages = block_table[s, : (n + bs - 1) // bs].long().cpu()
        k = k_cache[pages].reshape(-1, Hkv, D)[:n].to(dtype)      # [n, Hkv, D]
        v = v_cache[pages].reshape(-1, Hkv, D)[:n].to(dtype)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [n, Hq, D]
        scores = torch.einsum("ihd,nhd->ihn", q4[s].cpu().to(dtype), k) * scale   # [Q, Hq, n]
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        position = torch.arange(Q, dtype=dtype) + (n - Q)                       # [Q]
        t = torch.arange(n, dtype=dtype)
        if alibi_slopes is not None:
            scores = scores + alibi_slopes.cpu().to(dtype)[None, :, None] * (t - position[:, None])[:, None, :]
        scores = scores.masked_fill((t > position[:, None])[:, None, :], float("-inf"))
        weights = scores.softmax(-1).nan_to_num()                                # rows that see nothing: 0
        out[s] = torch.einsum("ihn,nhd->ihd", weights, v)
    return out if q.dim() == 4 else out[:, 0]


def paged_decode_loops(q, k_cache, v_cache, block_table, context_lens, scale):
    """The seed's algorithm, literally (NHD cache, no extras): per query head, walk the block
    table token by token, then a two-pass softmax."""
    S, Hq, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(S, Hq, D, dtype=torch.float64)
    for s in range(S):
        n = int(context_lens[s])
        for h in range(Hq):
            g = h // (Hq // Hkv)
            logits = []
            for t in range(n):
                page, slot = int(block_table[s, t // bs]), t % bs
                logits.append(float(q[s, h].double() @ k_cache[page, slot, g].double()) * scale)
            if not logits:
                continue
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            total = sum(weights)
            for t, w in enumerate(weights):
                page, slot = int(block_table[s, t // bs]), t % bs
                out[s, h] += w / total * v_cache[page, slot, g].double()
    return out


def attention_mask(Lq: int, Lk: int, window_left: int = -1, window_right: int = -1, device=None):
    """[Lq, Lk] bool, True where key j is visible to query row i (params.cuh of
    flash_attention): the diagonal is aligned to the bottom-right corner, shift = Lk - Lq."""
    i = torch.arange(Lq, device=device)[:, None] + (Lk - Lq)
    j = torch.arange(Lk, device=device)[None, :]
    visible = torch.ones(Lq, Lk, dtype=torch.bool, device=device)
    if window_left >= 0:
        visible &= j >= i - window_left
    if window_right >= 0:
        visible &= j <= i + window_right
    return visible


def flash_attention(q, k, v, causal=False, scale=None, window=None, alibi_slopes=None, soft_cap=None,
                    dtype=torch.float64, weights_dtype=None, weights_scale=256.0):
    """Softmax attention on [B, L, H, D] tensors computed in `dtype` (float64: the reference;
    the storage dtype: what a plain torch implementation gets, whose error sets the bound).
    weights_dtype (float8_e4m3fn): the unnormalized weights exp(s - max) are rounded to it after
    scaling by weights_scale before they multiply v, as the fp8 kernels do (the normalizing sum
    is not rounded). Returns (out [B, Lq, Hq, D] in `dtype`, lse [B, Hq, Lq] in float64; -inf
    and zeros for rows that see no key)."""
    B, Lq, Hq, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    qh = q.to(dtype).transpose(1, 2)                                         # [B, Hq, Lq, D]
    kh = k.to(dtype).transpose(1, 2).repeat_interleave(Hq // Hkv, dim=1)     # [B, Hq, Lk, D]
    vh = v.to(dtype).transpose(1, 2).repeat_interleave(Hq // Hkv, dim=1)
    s = (qh @ kh.transpose(-1, -2)) * scale
    if soft_cap:
        s = soft_cap * torch.tanh(s / soft_cap)
    if alibi_slopes is not None:
        i = torch.arange(Lq, device=q.device)[:, None] + (Lk - Lq)
        j = torch.arange(Lk, device=q.device)[None, :]
        s = s - alibi_slopes.to(dtype)[None, :, None, None] * (i - j).abs().to(dtype)
    visible = attention_mask(Lq, Lk, left, right, q.device)
    seen = visible.any(dim=-1)                                              # rows with a key
    # Rows that see no key get finite scores before the softmax and zeros after it, so that
    # autograd through this function gives them zero gradients, not NaN.
    s = s.masked_fill(~visible, float("-inf")).masked_fill(~seen[:, None], 0.0)
    lse = torch.logsumexp(s.double(), dim=-1)                                # [B, Hq, Lq]
    if weights_dtype is None:
        p = torch.softmax(s, dim=-1).masked_fill(~seen[:, None], 0.0)
        out = (p @ vh).transpose(1, 2)
    else:
        e = torch.exp(s - s.amax(dim=-1, keepdim=True))
        rounded = (e * weights_scale).to(weights_dtype).to(dtype) / weights_scale
        out = ((rounded @ vh) / e.sum(dim=-1, keepdim=True)).masked_fill(~seen[..., None], 0.0).transpose(1, 2)
    return out, lse.masked_fill(~seen, float("-inf"))


def dequantize(t, descale):
    """fp8 t [B, L, H, D] times its descale factor (None: 1; one element; or [B, Hkv] for
    H = G * Hkv heads, each kv head's factor shared by its group), in float64."""
    x = t.double()
    if descale is None:
        return x
    f = descale.double()
    if f.numel() == 1:
        return x * f.reshape(())
    return x * f.repeat_interleave(t.shape[2] // f.shape[1], dim=1)[:, None, :, None]


def paged_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens, kv_layout="NHD",
                    dtype=torch.float64, causal=True, k_scale=None, v_scale=None, **kwargs):
    """paged_attention by gathering each sequence's pages into contiguous rows and taking
    flash_attention (bottom-right aligned: query token i of a sequence of q_len tokens and n
    keys sits at position n - q_len + i); causal by default, as the op. An fp8 cache is
    dequantized first in float64: K = k_scale * k, V = v_scale * v (k_scale, v_scale [1] or
    [Hkv]). kwargs: scale, window, alibi_slopes, soft_cap.
    Returns (out [total_q, Hq, D] in `dtype`, lse [Hq, total_q] float64)."""
    if kv_layout == "HND":
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    if k_cache.element_size() == 1:   # fp8: its values, dequantized per kv head
        k_cache, v_cache = (c.double() * (1.0 if f is None else f.double()[:, None])
                            for c, f in ((k_cache, k_scale), (v_cache, v_scale)))
    bs, Hkv, D = k_cache.shape[1:]
    Hq = q.shape[1]
    cu, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    outs, lses = [], []
    for s, n in enumerate(lens):
        q_s = q[cu[s]:cu[s + 1]]
        pages = block_table[s, : (n + bs - 1) // bs].long()
        k = k_cache[pages].reshape(-1, Hkv, D)[:n]
        v = v_cache[pages].reshape(-1, Hkv, D)[:n]
        if q_s.shape[0] == 0:
            continue
        if n == 0:
            outs.append(torch.zeros(q_s.shape, dtype=dtype, device=q.device))
            lses.append(torch.full((Hq, q_s.shape[0]), float("-inf"), dtype=torch.float64, device=q.device))
            continue
        out, lse = flash_attention(q_s[None], k[None], v[None], causal=causal, dtype=dtype, **kwargs)
        outs.append(out[0])
        lses.append(lse[0])
    if not outs:
        return torch.zeros(q.shape, dtype=dtype, device=q.device), torch.zeros(Hq, 0, dtype=torch.float64, device=q.device)
    return torch.cat(outs), torch.cat(lses, dim=1)


def flash_attention_grad(q, k, v, d_out, d_lse=None, dtype=torch.float64, **kwargs):
    """dq, dk, dv of flash_attention computed by autograd in `dtype` (float64: the reference;
    the storage dtype: what a plain torch implementation gets), for the loss
    sum(out * d_out) + sum(lse * d_lse). Returned in `dtype`."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention(*leaves, dtype=dtype, **kwargs)
    loss = (out * d_out.to(dtype)).sum()
    if d_lse is not None:
        seen = lse > float("-inf")
        loss = loss + (lse.masked_fill(~seen, 0.0) * d_lse.double()).sum()
    return torch.autograd.grad(loss, leaves)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, dtype=torch.float64, **kwargs):
    """flash_attention per packed sequence: q [Tq, Hq, D], k, v [Tk, Hkv, D] -> (out [Tq, Hq, D],
    lse [Hq, Tq])."""
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if cq[b + 1] == cq[b]:
            continue
        o, l = flash_attention(q[None, qs], k[None, ks], v[None, ks], dtype=dtype, **kwargs)
        out[qs], lse[:, qs] = o[0], l[0]
    return out, lse


def flash_attention_loops(q, k, v, causal=False, scale=None):
    """The seed's algorithm, literally, per (batch, head, row): scores over the visible keys,
    a running max and sum over them one key at a time (the online softmax), in float64."""
    B, Lq, Hq, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    out = torch.zeros(B, Lq, Hq, D, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            g = h // (Hq // Hkv)
            for i in range(Lq):
                run_max, run_sum, acc = -math.inf, 0.0, torch.zeros(D, dtype=torch.float64)
                for j in range(Lk):
                    if causal and j > i + Lk - Lq:
                        continue
                    s = scale * float(q[b, i, h].double() @ k[b, j, g].double())
                    new_max = max(run_max, s)
                    alpha = math.exp(run_max - new_max) if run_max > -math.inf else 0.0
                    w = math.exp(s - new_max)
                    run_sum = run_sum * alpha + w
                    acc = acc * alpha + w * v[b, j, g].double()
                    run_max = new_max
                if run_sum > 0:
                    out[b, i, h] = acc / run_sum
    return out


def rwkv7(r, w, k, v, a, b, state=None, scale=1.0, dtype=torch.float64):
    """RWKV-7 in `dtype`, state S[b, h, key, value] as flash-linear-attention keeps it:
    sa = S^T a; S <- diag(exp(w)) S + b sa^T + k v^T; o = scale S^T r. r, w, k, a, b [B, T, H, K],
    v [B, T, H, V] -> (o [B, T, H, V], final state [B, H, K, V])."""
    r, w, k, v, a, b = (x.to(dtype) for x in (r, w, k, v, a, b))
    B, T, H, K = r.shape
    S = (torch.zeros(B, H, K, v.shape[-1], dtype=dtype, device=r.device) if state is None
         else state.to(dtype).clone())
    out = torch.empty(B, T, H, v.shape[-1], dtype=dtype, device=r.device)
    for t in range(T):
        sa = torch.einsum("bhkv,bhk->bhv", S, a[:, t])
        S = (w[:, t].exp()[..., None] * S + b[:, t][..., None] * sa[:, :, None, :]
             + k[:, t][..., None] * v[:, t][:, :, None, :])
        out[:, t] = scale * torch.einsum("bhkv,bhk->bhv", S, r[:, t])
    return out, S


def gated_delta_rule(q, k, v, g, beta, state=None, scale=None, dtype=torch.float64):
    """Gated DeltaNet in `dtype`, state S[b, h, key, value]: S <- exp(g) S;
    u = beta (v - S^T k); S <- S + k u^T; o = scale S^T q. q, k [B, T, H, K], v [B, T, H, V],
    g, beta [B, T, H] -> (o [B, T, H, V], final state [B, H, K, V]). scale defaults to K^-0.5."""
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    S = (torch.zeros(B, H, K, v.shape[-1], dtype=dtype, device=q.device) if state is None
         else state.to(dtype).clone())
    out = torch.empty(B, T, H, v.shape[-1], dtype=dtype, device=q.device)
    for t in range(T):
        S = g[:, t].exp()[..., None, None] * S
        u = beta[:, t][..., None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t][..., None] * u[:, :, None, :]
        out[:, t] = scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t])
    return out, S


def kda(q, k, v, g, beta, state=None, scale=None, dtype=torch.float64):
    """Kimi Delta Attention (Gated DeltaNet with a per-channel gate) in `dtype`, state
    S[b, h, key, value], as flash-linear-attention's naive_recurrent_kda runs it:
    S <- diag(exp(g)) S; u = beta (v - S^T k); S <- S + k u^T; o = scale S^T q. q, k [B, T, H, K],
    v [B, T, HV, V], g [B, T, HV, K] (log decay per key channel), beta [B, T, HV]; HV a multiple
    of H (grouped values: q and k serve HV / H value heads each) -> (o [B, T, HV, V], final
    state [B, HV, K, V]). scale defaults to K^-0.5."""
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k = (x.repeat_interleave(HV // H, dim=2) for x in (q, k))
    scale = K ** -0.5 if scale is None else scale
    S = torch.zeros(B, HV, K, V, dtype=dtype, device=q.device) if state is None else state.to(dtype).clone()
    out = torch.empty(B, T, HV, V, dtype=dtype, device=q.device)
    for t in range(T):
        S = g[:, t].exp()[..., None] * S
        u = beta[:, t][..., None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t][..., None] * u[:, :, None, :]
        out[:, t] = scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t])
    return out, S


def delta_rule_packed(fn, inputs, cu_seqlens, state=None, **kwargs):
    """`fn` (rwkv7 or gated_delta_rule above) over sequences packed along T of a batch of one, as
    flash-linear-attention's cu_seqlens packs them: each sequence run alone from its own initial
    state (state [N, H, K, V], default zeros). inputs [1, T, H, ...] -> (o [1, T, H, V], final
    states [N, H, K, V])."""
    bounds = [int(x) for x in cu_seqlens]
    outs, finals = [], []
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        o, s = fn(*(x[:, start:end] for x in inputs), state=None if state is None else state[i:i + 1], **kwargs)
        outs.append(o)
        finals.append(s)
    return torch.cat(outs, 1), torch.cat(finals, 0)


def _to_chunks(x, chunk: int, dtype=torch.float64):
    """[B, T, H, ...] -> [B, H, n, chunk, ...] in `dtype`, zero-padded to whole chunks (a padded
    step has no decay, no correction and no output)."""
    x = x.to(dtype)
    B, T, H = x.shape[:3]
    pad = -T % chunk
    x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 3) + (0, 0, 0, pad))
    return x.view(B, (T + pad) // chunk, chunk, H, *x.shape[3:]).movedim(3, 1)


def _from_chunks(x, T: int):
    """_to_chunks' inverse, the padding dropped."""
    x = x.movedim(1, 3)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])[:, :T]


def rwkv7_chunk_pairs(x, y, lx, lc, strict: bool, sub: int = 16, diagonal_limit: float | None = None):
    """Per chunk, sum_c x_tc y_jc exp(lx_tc - lc_jc) for j < t (strict) or j <= t: x, y, lx, lc
    [..., C, K] -> [..., C, C], the way a tensor-core kernel would form it, by sub-chunks of
    `sub` steps. lc is the chunk's cumulative log decay (non-increasing), lx lc or lc shifted by
    a step. For a key block jb before the query block, the decay between t and j passes through
    e, lc at jb's last step, as two factors each at most 1:
        (x_t exp(lx_t - e)) . (y_j exp(e - lc_j)),
    one [sub, K] x [K, sub] product per block pair (the right factor once per key block).
    A diagonal block is taken term by term by default: a reference point inside it puts a factor
    above 1, e^80 after 16 steps of log decay -5, past fp32's range. With `diagonal_limit` a
    diagonal block is one product too where it can be: around e, the cumulative decay before the
    block (0 for the first), the left factor is at most 1 and the right at most e^R, R the block's
    largest decay over a channel (e - lc at its last step). Where R <= diagonal_limit (RWKV-7's
    own decays, log w >= -0.61 a step, give R <= 9.7 over 16 steps) the block is the product,
    masked to the triangle; elsewhere term by term, as a kernel would branch per block."""
    C = x.shape[-2]
    if C % sub:
        raise ValueError(f"rwkv7_chunk_pairs: the chunk ({C} steps) is not a whole number of {sub}-step sub-chunks")
    out = x.new_zeros(*x.shape[:-1], C)
    inside = torch.ones(sub, sub, dtype=torch.bool, device=x.device).tril(-1 if strict else 0)
    for i in range(C // sub):
        rows = slice(i * sub, (i + 1) * sub)
        expo = (lx[..., rows, None, :] - lc[..., None, rows, :]).masked_fill(~inside[..., None], float("-inf"))
        terms = torch.einsum("...tc,...jc,...tjc->...tj", x[..., rows, :], y[..., rows, :], expo.exp())
        if diagonal_limit is None:
            out[..., rows, rows] = terms
        else:
            e = lc[..., i * sub - 1, None, :] if i else torch.zeros_like(lc[..., :1, :])
            spread = (e - lc[..., (i + 1) * sub - 1, None, :]).amax(-1, keepdim=True)   # [..., 1, 1]
            left = x[..., rows, :] * (lx[..., rows, :] - e).exp()
            right = y[..., rows, :] * (e - lc[..., rows, :]).exp()   # inf past fp32's range: not taken there
            product = (left @ right.transpose(-1, -2)).masked_fill(~inside, 0.0)
            out[..., rows, rows] = torch.where(spread <= diagonal_limit, product, terms)
        for jb in range(i):
            cols = slice(jb * sub, (jb + 1) * sub)
            e = lc[..., (jb + 1) * sub - 1, None, :]
            left = x[..., rows, :] * (lx[..., rows, :] - e).exp()
            right = y[..., cols, :] * (e - lc[..., cols, :]).exp()
            out[..., rows, cols] = left @ right.transpose(-1, -2)
    return out


def rwkv7_chunked(r, w, k, v, a, b, state=None, scale=1.0, chunk: int = 64, sub: int | None = None,
                  dtype=torch.float64, diagonal_limit: float | None = None):
    """RWKV-7 by chunks in `dtype` (what `rwkv7` computes step by step; float64 by default, float32
    to see what a kernel's fp32 arithmetic makes of it): the blueprint of a chunked kind for its
    per-channel decay. Within a chunk, with S the state before it, lc the
    chunk's cumulative log decay per channel up to step t (inclusive) and le up to t - 1, the
    steps' sa vectors z_t = S_{t-1}^T a_t solve a unit lower-triangular system:
        (I - L_ab) Z = (a * exp(le)) S + L_ak V,
        L_xy[t, j] = sum_c x_tc y_jc exp(le_tc - lc_jc)   (j < t)
    then, with the same sums taken from lc_t (j <= t) as N_xy,
        O = scale ((r * exp(lc)) S + N_rb Z + N_rk V)
        S <- exp(lc_C) * S + (b * exp(lc_C - lc))^T Z + (k * exp(lc_C - lc))^T V.
    Every exponent is of a difference of cumulative log decays, <= 0. The per-channel factor
    inside L and N is what keeps them from being one product of two matrices (Gated DeltaNet's
    scalar decay factors out); by sub-chunks (`sub` steps, rwkv7_chunk_pairs) they are one
    product per pair of sub-chunks off the diagonal, whose factors stay at most 1, and term by
    term on it, or one product there too where the block's decay allows (diagonal_limit,
    rwkv7_chunk_pairs). sub=None forms them term by term throughout."""
    B, T, H, K = r.shape
    V = v.shape[-1]
    r, w, k, v, a, b = (_to_chunks(x, chunk, dtype) for x in (r, w, k, v, a, b))
    n = r.shape[2]
    lc = w.cumsum(-2)
    le = torch.nn.functional.pad(lc[..., :-1, :], (0, 0, 1, 0))  # up to t - 1: lc shifted, not lc - w (exactly lc_{t-1})

    def pairs(x, y, lx, strict):  # sum_c x_tc y_jc exp(lx_tc - lc_jc), masked to j < t or j <= t
        return rwkv7_chunk_pairs(x, y, lx, lc, strict, sub or chunk, diagonal_limit if sub else None)

    L_ab, L_ak = pairs(a, b, le, True), pairs(a, k, le, True)
    N_rb, N_rk = pairs(r, b, lc, False), pairs(r, k, lc, False)
    eye = torch.eye(chunk, dtype=dtype, device=r.device)
    inverse = torch.linalg.solve_triangular(eye - L_ab, eye.expand_as(L_ab), upper=False, unitriangular=True)
    S = (torch.zeros(B, H, K, V, dtype=dtype, device=r.device) if state is None else state.to(dtype).clone())
    out = torch.empty(B, H, n, chunk, V, dtype=dtype, device=r.device)
    for c in range(n):
        Z = inverse[:, :, c] @ ((a[:, :, c] * le[:, :, c].exp()) @ S + L_ak[:, :, c] @ v[:, :, c])
        out[:, :, c] = scale * ((r[:, :, c] * lc[:, :, c].exp()) @ S + N_rb[:, :, c] @ Z + N_rk[:, :, c] @ v[:, :, c])
        tail = (lc[:, :, c, -1:] - lc[:, :, c]).exp()
        S = (lc[:, :, c, -1, :, None].exp() * S + (b[:, :, c] * tail).transpose(-1, -2) @ Z
             + (k[:, :, c] * tail).transpose(-1, -2) @ v[:, :, c])
    return _from_chunks(out, T), S


def rwkv7_chunk_pairs_grad(dP, x, y, lx, lc, strict: bool, sub: int | None = None,
                           diagonal_limit: float | None = None):
    """The adjoint of rwkv7_chunk_pairs: for P[t, j] = sum_c x_tc y_jc exp(lx_tc - lc_jc) over
    j < t (strict) or j <= t and its gradient dP -> (dx, dy, dlx, dlc):
        dx_tc = sum_j dP_tj y_jc E_tjc      dy_jc = sum_t dP_tj x_tc E_tjc
        dlx_tc = x_tc dx_tc                 dlc_jc = -y_jc dy_jc
    E the masked exponentials. sub=None: term by term. By `sub`-step sub-chunks as the forward
    forms P (rwkv7_chunk_pairs): for a key block before the query block, around e (lc at its last
    step) both sums are products with factors at most 1 besides x and y:
        dx[rows] = (dP[rows, cols] (y exp(e - lc))[cols]) * exp(lx - e)[rows]
        dy[cols] = (dP[rows, cols]^T (x exp(lx - e))[rows]) * exp(e - lc)[cols];
    a diagonal block term by term, or, with `diagonal_limit`, as a product around the decay
    before it where its largest decay R allows (the forward's rule)."""
    C = x.shape[-2]
    sub = sub or C
    if C % sub:
        raise ValueError(f"rwkv7_chunk_pairs_grad: the chunk ({C} steps) is not a whole number of {sub}-step sub-chunks")
    dx, dy = torch.zeros_like(x), torch.zeros_like(y)
    inside = torch.ones(sub, sub, dtype=torch.bool, device=x.device).tril(-1 if strict else 0)
    for i in range(C // sub):
        rows = slice(i * sub, (i + 1) * sub)
        d = dP[..., rows, rows].masked_fill(~inside, 0.0)
        E = (lx[..., rows, None, :] - lc[..., None, rows, :]).masked_fill(~inside[..., None], float("-inf")).exp()
        term_x = torch.einsum("...tj,...jc,...tjc->...tc", d, y[..., rows, :], E)
        term_y = torch.einsum("...tj,...tc,...tjc->...jc", d, x[..., rows, :], E)
        if diagonal_limit is None:
            dx[..., rows, :] += term_x
            dy[..., rows, :] += term_y
        else:
            e = lc[..., i * sub - 1, None, :] if i else torch.zeros_like(lc[..., :1, :])
            spread = (e - lc[..., (i + 1) * sub - 1, None, :]).amax(-1, keepdim=True)
            left = (lx[..., rows, :] - e).exp()
            right = (e - lc[..., rows, :]).exp()   # inf past the dtype's range: not taken there
            fx = (d @ (y[..., rows, :] * right)) * left
            fy = (d.transpose(-1, -2) @ (x[..., rows, :] * left)) * right
            dx[..., rows, :] += torch.where(spread <= diagonal_limit, fx, term_x)
            dy[..., rows, :] += torch.where(spread <= diagonal_limit, fy, term_y)
        for jb in range(i):
            cols = slice(jb * sub, (jb + 1) * sub)
            e = lc[..., (jb + 1) * sub - 1, None, :]
            left, right = (lx[..., rows, :] - e).exp(), (e - lc[..., cols, :]).exp()
            dx[..., rows, :] += (dP[..., rows, cols] @ (y[..., cols, :] * right)) * left
            dy[..., cols, :] += (dP[..., rows, cols].transpose(-1, -2) @ (x[..., rows, :] * left)) * right
    return dx, dy, x * dx, -y * dy


def rwkv7_chunked_grad(r, w, k, v, a, b, d_o, state=None, d_state=None, scale=1.0, chunk: int = 64,
                       sub: int | None = None, dtype=torch.float64, diagonal_limit: float | None = None):
    """RWKV-7's gradients by the chunked form's explicit adjoint (rwkv7_chunked's notation), in
    float64 and in the three stages a chunked backward would run, each chunk from the state before
    it (the forward's checkpoints):
      1. every chunk at once: the state gradient's step as an affine map G_before = Phi G + Psi,
         Phi = diag(exp(lc_C)) + A'^T M^-T B',  Psi = scale (R' + N_rb M^-1 A')^T dO
         (A' = a exp(le), R' = r exp(lc), B' = b exp(lc_C - lc), K' likewise, M = I - L_ab);
      2. the chunks in reverse, one K x K times K x V product each: the state gradient after each;
      3. every chunk at once: the inputs' gradients from it. With G the state gradient after the
         chunk and Z the forward's (M Z = A' S + L_ak V):
        dZ = scale N_rb^T dO + B' G      dY = M^-T dZ       dv = scale N_rk^T dO + K' G + L_ak^T dY
        dL_ab = dY Z^T   dL_ak = dY v^T   dN_rb = scale dO Z^T   dN_rk = scale dO v^T   (masked)
        dR' = scale dO S^T   dA' = dY S^T   dB' = Z G^T   dK' = v G^T
    then each pair matrix's adjoint (rwkv7_chunk_pairs_grad), the factors' exponentials to r, a,
    b, k and the cumulative log decays, and w's gradient as the reverse cumulative sum of lc's
    within the chunk (le is lc a step back). `dtype`, `sub` and `diagonal_limit` as in
    rwkv7_chunked: float32 with 16-step sub-chunks is what a kernel's arithmetic would make of it.
    -> (dr, dw, dk, dv, da, db, d_state0)."""
    B, T, H, K = r.shape
    V = v.shape[-1]
    r, w, k, v, a, b, dO = (_to_chunks(x, chunk, dtype) for x in (r, w, k, v, a, b, d_o))
    dO = dO * scale
    n = r.shape[2]
    lc = w.cumsum(-2)
    le = torch.nn.functional.pad(lc[..., :-1, :], (0, 0, 1, 0))
    last = lc[..., -1:, :]
    gamma, tail = last.exp(), (last - lc).exp()            # [.., 1, K], [.., C, K]
    Ap, Rp, Bp, Kp = a * le.exp(), r * lc.exp(), b * tail, k * tail

    def pairs(x, y, lx, strict):
        return rwkv7_chunk_pairs(x, y, lx, lc, strict, sub or chunk, diagonal_limit if sub else None)

    L_ab, L_ak, N_rb, N_rk = pairs(a, b, le, True), pairs(a, k, le, True), pairs(r, b, lc, False), pairs(r, k, lc, False)
    eye = torch.eye(chunk, dtype=dtype, device=r.device)
    Minv = torch.linalg.solve_triangular(eye - L_ab, eye.expand_as(L_ab), upper=False, unitriangular=True)
    # The states before each chunk and the chunks' Z (the forward).
    S = torch.zeros(B, H, K, V, dtype=dtype, device=r.device) if state is None else state.to(dtype).clone()
    before, Zs = [], []
    for c in range(n):
        before.append(S)
        Z = Minv[:, :, c] @ (Ap[:, :, c] @ S + L_ak[:, :, c] @ v[:, :, c])
        Zs.append(Z)
        S = gamma[:, :, c, 0, :, None] * S + Bp[:, :, c].transpose(-1, -2) @ Z + Kp[:, :, c].transpose(-1, -2) @ v[:, :, c]
    # Stage 1: G_before = Phi G + Psi per chunk.
    MtB = Minv.transpose(-1, -2) @ Bp                                   # M^-T B'
    Phi = torch.diag_embed(gamma[..., 0, :]) + Ap.transpose(-1, -2) @ MtB
    Psi = (Rp + N_rb @ Minv @ Ap).transpose(-1, -2) @ dO
    # Stage 2: the state gradient after every chunk, the chunks in reverse.
    G = torch.zeros(B, H, K, V, dtype=dtype, device=r.device) if d_state is None else d_state.to(dtype).clone()
    after = [None] * n
    for c in reversed(range(n)):
        after[c] = G
        G = Phi[:, :, c] @ G + Psi[:, :, c]
    d_state0 = G
    # Stage 3: the inputs' gradients (a loop here; the chunks are independent).
    dr, dk, dv, da, db, dlc = (torch.zeros_like(x) for x in (r, k, v, a, b, lc))
    for c in range(n):
        G, S0, Z, do, vc = after[c], before[c], Zs[c], dO[:, :, c], v[:, :, c]
        Mi, Lak, Nrb, Nrk = (x[:, :, c] for x in (Minv, L_ak, N_rb, N_rk))
        dZ = Nrb.transpose(-1, -2) @ do + Bp[:, :, c] @ G
        dY = Mi.transpose(-1, -2) @ dZ
        dv[:, :, c] = Nrk.transpose(-1, -2) @ do + Kp[:, :, c] @ G + Lak.transpose(-1, -2) @ dY
        dRp, dAp = do @ S0.transpose(-1, -2), dY @ S0.transpose(-1, -2)
        dBp, dKp = Z @ G.transpose(-1, -2), vc @ G.transpose(-1, -2)
        lcc, lec = lc[:, :, c], le[:, :, c]
        dlcc, dlec = dRp * Rp[:, :, c], dAp * Ap[:, :, c]
        dr[:, :, c] += dRp * lcc.exp()
        da[:, :, c] += dAp * lec.exp()
        db[:, :, c] += dBp * tail[:, :, c]
        dk[:, :, c] += dKp * tail[:, :, c]
        dtail = dBp * Bp[:, :, c] + dKp * Kp[:, :, c]                  # through exp(lc_C - lc_t)
        dlcc = dlcc - dtail
        dlast = dtail.sum(-2) + (S0 * G).sum(-1) * gamma[:, :, c, 0]    # [.., K]
        # The pair matrices: (gradient, x, y, lx, strict) and where x's and y's gradients go.
        for dP, x, y, lx, strict, dx_to, dy_to, lx_is_le in (
                ((dY @ Z.transpose(-1, -2)).tril(-1), a, b, le, True, da, db, True),
                ((dY @ vc.transpose(-1, -2)).tril(-1), a, k, le, True, da, dk, True),
                ((do @ Z.transpose(-1, -2)).tril(), r, b, lc, False, dr, db, False),
                ((do @ vc.transpose(-1, -2)).tril(), r, k, lc, False, dr, dk, False)):
            gx, gy, glx, glc = rwkv7_chunk_pairs_grad(dP, x[:, :, c], y[:, :, c], lx[:, :, c], lcc, strict, sub,
                                                      diagonal_limit if sub else None)
            dx_to[:, :, c] += gx
            dy_to[:, :, c] += gy
            dlcc = dlcc + glc
            if lx_is_le:
                dlec = dlec + glx
            else:
                dlcc = dlcc + glx
        # le_t = lc_{t-1}; lc_C = lc at the chunk's last step
        dlcc = dlcc + torch.nn.functional.pad(dlec[..., 1:, :], (0, 0, 0, 1))
        dlcc[..., -1, :] += dlast
        dlc[:, :, c] = dlcc
    dw = dlc.flip(-2).cumsum(-2).flip(-2)                                # lc = cumsum(w) within a chunk
    return tuple(_from_chunks(x, T) for x in (dr, dw, dk, dv, da, db)) + (d_state0,)



def rwkv7_chunk_walk_grad(r, w, k, v, a, b, d_o, checkpoints, d_state=None, scale=1.0, chunk: int = 16,
                          every: int = 64, dtype=torch.float64):
    """RWKV-7's gradients step for step as the chunked backward kernel takes them
    (templates/delta_rule_grad/chunked_rwkv7_grad.cu.j2), in `dtype`: per window of `every` steps,
    last first, the chunk-start states rebuilt from the window's checkpoint; per chunk, last first,
    its forward again (rwkv7_chunked's quantities; the pair matrices term by term here), then with
    G the state's gradient after it and dO' = scale dO
        dZ = B~ G + N_rb^T dO',  (I - L_ab)^T dY = dZ,  dv = K~ G + N_rk^T dO' + L_ak^T dY
        dR^ = dO' S^T, dA^ = dY S^T, dB~ = Z G^T, dK~ = V G^T; the pair matrices' gradients
    and per step and key channel the chain through every exponential to r, a, b, k and lc (the
    kernel's finish: the pair matrices' zero-exponent terms kept out of lc's gradient, and dw
    summed from its three pieces without cancelling), then G <- exp(lc_C) G + R^^T dO' + A^^T dY.
    In float32 it is what the kernel does in fp32 (its 16-bit operands aside). checkpoints
    [B, H, ceil(T / every), K, V] (the state before every window) -> (dr, dw, dk, dv, da, db,
    d_state0)."""
    B, T, H, K = r.shape
    V = v.shape[-1]
    r, w, k, v, a, b, dO = (_to_chunks(x, chunk, dtype) for x in (r, w, k, v, a, b, d_o))
    dO = dO * scale
    n, per = r.shape[2], every // chunk
    eye = torch.eye(chunk, dtype=dtype, device=r.device)
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=r.device).tril(-1)
    diag = torch.eye(chunk, dtype=torch.bool, device=r.device)
    inclusive = strict | diag
    first_sub = strict & ~torch.ones(chunk, chunk, dtype=torch.bool, device=r.device).tril(-2)
    grads = {name: torch.zeros_like(x) for name, x in (("dr", r), ("dw", w), ("dk", k), ("dv", v), ("da", a), ("db", b))}

    def forward(c, S):
        x = {name: t[:, :, c] for name, t in (("r", r), ("w", w), ("k", k), ("v", v), ("a", a), ("b", b))}
        lc = x["w"].cumsum(-2)
        le = torch.nn.functional.pad(lc[..., :-1, :], (0, 0, 1, 0))
        end = lc[..., -1:, :]
        EL = (le[..., :, None, :] - lc[..., None, :, :]).masked_fill(~strict[..., None], float("-inf")).exp()
        EN = (lc[..., :, None, :] - lc[..., None, :, :]).masked_fill(~inclusive[..., None], float("-inf")).exp()
        pair = lambda x_, y_, E: torch.einsum("...tc,...jc,...tjc->...tj", x_, y_, E)  # noqa: E731
        f = dict(x, lc=lc, le=le, end=end, EL=EL, EN=EN, L_ab=pair(x["a"], x["b"], EL), L_ak=pair(x["a"], x["k"], EL),
                 N_rb=pair(x["r"], x["b"], EN), N_rk=pair(x["r"], x["k"], EN), D=end[..., 0, :].exp(),
                 Ah=x["a"] * le.exp(), Rh=x["r"] * lc.exp(), tail=(end - lc).exp())
        f["Bt"], f["Kt"] = x["b"] * f["tail"], x["k"] * f["tail"]
        Y1 = f["Ah"] @ S + f["L_ak"] @ x["v"]
        f["Z"] = torch.linalg.solve_triangular(eye - f["L_ab"], Y1, upper=False, unitriangular=True)
        return f

    G = (torch.zeros(B, H, K, V, dtype=dtype, device=r.device) if d_state is None else d_state.to(dtype).clone())
    for window in reversed(range(checkpoints.shape[2])):
        c0 = window * per
        count = min(per, n - c0)
        S = checkpoints[:, :, window].to(dtype)
        states = []
        for j in range(count):
            states.append(S)
            if j + 1 < count:
                f = forward(c0 + j, S)
                S = (f["D"][..., None] * S + f["Bt"].transpose(-1, -2) @ f["Z"]
                     + f["Kt"].transpose(-1, -2) @ f["v"])
        for j in reversed(range(count)):
            c, S = c0 + j, states[j]
            f = forward(c, S)
            do = dO[:, :, c]
            tr = lambda m: m.transpose(-1, -2)  # noqa: E731
            dZ = f["Bt"] @ G + tr(f["N_rb"]) @ do
            dY = torch.linalg.solve_triangular(tr(eye - f["L_ab"]), dZ, upper=True, unitriangular=True)
            grads["dv"][:, :, c] = f["Kt"] @ G + tr(f["N_rk"]) @ do + tr(f["L_ak"]) @ dY
            dL_ab = (dY @ tr(f["Z"])).masked_fill(~strict, 0.0)
            dL_ak = (dY @ tr(f["v"])).masked_fill(~strict, 0.0)
            dN_rb = (do @ tr(f["Z"])).masked_fill(~inclusive, 0.0)
            dN_rk = (do @ tr(f["v"])).masked_fill(~inclusive, 0.0)
            dRh, dAh, dBt, dKt = do @ tr(S), dY @ tr(S), f["Z"] @ tr(G), f["v"] @ tr(G)
            # Per (step, key channel): the direct uses of R^, A^, B~, K~, and the pair matrices'
            # adjoints without their zero-exponent terms (N's diagonal, L's first subdiagonal): those
            # add to r's, a's, b's and k's gradients but cancel from lc's, so they stay out of it.
            adj = lambda dP, y_, E: torch.einsum("...tj,...jc,...tjc->...tc", dP, y_, E)  # noqa: E731
            adj_y = lambda dP, x_, E: torch.einsum("...tj,...tc,...tjc->...jc", dP, x_, E)  # noqa: E731
            EL, EN = f["EL"].masked_fill(first_sub[..., None], 0.0), f["EN"].masked_fill(diag[..., None], 0.0)
            gxa = adj(dL_ab, f["b"], EL) + adj(dL_ak, f["k"], EL)
            gxr = adj(dN_rb, f["b"], EN) + adj(dN_rk, f["k"], EN)
            gyb = adj_y(dN_rb, f["r"], EN) + adj_y(dL_ab, f["a"], EL)
            gyk = adj_y(dN_rk, f["r"], EN) + adj_y(dL_ak, f["a"], EL)
            dr, da = dRh * f["lc"].exp() + gxr, dAh * f["le"].exp() + gxa
            db_tail, dk_tail = dBt * f["tail"], dKt * f["tail"]
            n_rb, n_rk = (m.diagonal(dim1=-2, dim2=-1)[..., None] for m in (dN_rb, dN_rk))  # [t, t]
            l_ab, l_ak = (torch.nn.functional.pad(m.diagonal(-1, dim1=-2, dim2=-1), (1, 0))[..., None]
                          for m in (dL_ab, dL_ak))                                             # [t, t - 1]
            after = lambda x_: torch.nn.functional.pad(x_[..., 1:, :], (0, 0, 0, 1))  # noqa: E731  x_{t+1}
            before = lambda x_: torch.nn.functional.pad(x_[..., :-1, :], (0, 0, 1, 0))  # noqa: E731  x_{t-1}
            zero_r = n_rb * f["b"] + n_rk * f["k"]
            zero_a = l_ab * before(f["b"]) + l_ak * before(f["k"])
            zero_b = n_rb * f["r"] + after(l_ab * f["a"])
            zero_k = n_rk * f["r"] + after(l_ak * f["a"])
            grads["dr"][:, :, c], grads["da"][:, :, c] = dr + zero_r, da + zero_a
            grads["db"][:, :, c], grads["dk"][:, :, c] = db_tail + gyb + zero_b, dk_tail + gyk + zero_k
            # lc's gradient in three pieces, summed without adding and removing a term (near-0
            # decays make dw tiny against its terms): at t, r dr - b gyb - k gyk; at t - 1, a da;
            # the tails' b dB~ + k dK~ move lc_C against lc_t (none at t = C - 1, exp(0)), so
            # dw_t = sum_{s >= t} self_s + sum_{s > t} prev_s + exp(lc_C) sum_v S G + sum_{s < t} tails_s.
            own = f["r"] * dr - f["b"] * gyb - f["k"] * gyk
            prev = (f["a"] * da)[..., 1:, :]
            tails = (f["b"] * db_tail + f["k"] * dk_tail)[..., :-1, :]
            suffix = lambda x_: x_.flip(-2).cumsum(-2).flip(-2)  # noqa: E731
            dw = suffix(own) + torch.nn.functional.pad(suffix(prev), (0, 0, 0, 1)) + torch.nn.functional.pad(
                tails.cumsum(-2), (0, 0, 1, 0))
            grads["dw"][:, :, c] = dw + (f["D"] * (S * G).sum(-1))[..., None, :]
            G = f["D"][..., None] * G + tr(f["Rh"]) @ do + tr(f["Ah"]) @ dY
    out = tuple(_from_chunks(grads[name], T) for name in ("dr", "dw", "dk", "dv", "da", "db"))
    return out + (G,)

def _gated_delta_chunk_parts(q, k, g, beta, chunk: int) -> dict:
    """Per chunk, in float64: q, k, beta chunked ([B, H, n, C, K] and [B, H, n, C]); gc, the
    cumulative log decay; R = exp(gc_t - gc_j) (j <= t, else 0); K K^T and Q K^T;
    A[t, j] = beta_t R k_t . k_j (j < t); T = (I + A)^-1; M = T diag(beta); P = R * Q K^T
    (j <= t); W = P M."""
    q, k, g, beta = (_to_chunks(x, chunk) for x in (q, k, g, beta))
    gc = g.cumsum(-1)
    R = (gc[..., :, None] - gc[..., None, :]).tril().exp().tril()
    KK, QK = k @ k.transpose(-1, -2), q @ k.transpose(-1, -2)
    eye = torch.eye(chunk, dtype=torch.float64, device=q.device)
    A = (beta[..., :, None] * R * KK).tril(-1)
    T = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    M = T * beta[..., None, :]
    P = (QK * R).tril()
    return {"q": q, "k": k, "beta": beta, "gc": gc, "R": R, "KK": KK, "QK": QK, "T": T, "M": M, "P": P, "W": P @ M}


def gated_delta_chunk_matrices(q, k, g, beta, chunk: int = 64):
    """The chunked kinds' first kernel (templates/delta_rule/chunked.cu.j2, prepare_kernel) in
    float64, per chunk of `chunk` steps (the last zero-padded: no decay, no correction): gc, the
    chunk's cumulative log decay; M = (I + A)^-1 diag(beta) with A[t, j] = beta_t exp(gc_t - gc_j)
    k_t . k_j (j < t); W = (mask(Q K^T) exp(gc_t - gc_j)) M (mask: j <= t). Returns (gc, M, W),
    [B, H, chunks, chunk] and [B, H, chunks, chunk, chunk] twice."""
    parts = _gated_delta_chunk_parts(q, k, g, beta, chunk)
    return parts["gc"], parts["M"], parts["W"]


def gated_delta_rule_chunked(q, k, v, g, beta, state=None, scale=None, chunk: int = 64):
    """Gated DeltaNet by the chunked kinds' algorithm, in float64 (what `gated_delta_rule`
    computes step by step): per chunk, with S the state before it and gamma_t = exp(gc_t),
        Y = V - diag(gamma) K S,  U = M Y,  O = scale (diag(gamma) Q S + W Y),
        S <- gamma_C S + K^T diag(exp(gc_C - gc_t)) U
    (M, W, gc from gated_delta_chunk_matrices). -> (o [B, T, H, V], final state [B, H, K, V])."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    gc, M, W = gated_delta_chunk_matrices(q, k, g, beta, chunk)
    q, k, v = (_to_chunks(x, chunk) for x in (q, k, v))
    n = q.shape[2]
    S = (torch.zeros(B, H, K, V, dtype=torch.float64, device=q.device) if state is None
         else state.to(torch.float64).clone())
    out = torch.empty(B, H, n, chunk, V, dtype=torch.float64, device=q.device)
    for c in range(n):
        gamma = gc[:, :, c].exp()[..., None]                                   # [B, H, C, 1]
        Y = v[:, :, c] - gamma * (k[:, :, c] @ S)
        U = M[:, :, c] @ Y
        out[:, :, c] = scale * (gamma * (q[:, :, c] @ S) + W[:, :, c] @ Y)
        tail = (gc[:, :, c, -1:] - gc[:, :, c]).exp()[..., None]               # exp(gc_C - gc_t)
        S = gc[:, :, c, -1].exp()[..., None, None] * S + k[:, :, c].transpose(-1, -2) @ (tail * U)
    return _from_chunks(out, T), S


def gated_delta_rule_chunked_grad(q, k, v, g, beta, d_o, state=None, d_state=None, scale=None, chunk: int = 64):
    """Gated DeltaNet's gradients by the chunked algorithm's explicit adjoint, in float64, in the
    three stages a chunked backward would run (each chunk from the state before it, as the
    forward's checkpoints hold it):
      1. every chunk at once: the state gradient's step as an affine map, G_before = Phi G + Psi,
         Phi = gamma_C I - K^T diag(gamma) M^T diag(d) K,  Psi = Q^T diag(gamma) dO' - K^T diag(gamma) W^T dO';
      2. the chunks in reverse, one K x K times K x V product each: the state gradient after every chunk;
      3. every chunk at once: the inputs' gradients from it.
    Per chunk, with G the gradient of the state after it and the forward's Y, U
    (gated_delta_rule_chunked), dO' = scale dO, d_t = exp(gc_C - gc_t):
        dU = diag(d) K G                      dY = W^T dO' + M^T dU      dV = dY
        dW = dO' Y^T      dM = dU Y^T + P^T dW      dP = dW M^T
        dT = dM diag(beta)    dA = strict_lower(-T^T dT T^T)     (T = (I + A)^-1, M = T diag(beta))
        dQ = diag(gamma) dO' S^T + (dP * R) K
        dK = diag(d) U G^T - diag(gamma) dY S^T + (dA' + dA'^T) K + (dP * R)^T Q,  dA' = dA * beta_t R
        G <- gamma_C G + Q^T diag(gamma) dO' - K^T diag(gamma) dY
    and gc's gradient from gamma, d and R = exp(gc_t - gc_j), beta's from M and A; g's is the
    reverse cumulative sum of gc's within the chunk. -> (dq, dk, dv, dg, dbeta, d_state0)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    f64 = torch.float64
    parts = _gated_delta_chunk_parts(q, k, g, beta, chunk)
    Q, Kc, bp, gc, R, KK, QK, Tinv, M, P, W = (parts[x] for x in ("q", "k", "beta", "gc", "R", "KK", "QK", "T", "M",
                                                                  "P", "W"))
    Vc, dO = _to_chunks(v, chunk), _to_chunks(d_o, chunk) * scale
    n = Q.shape[2]
    gamma = gc.exp()
    tail = (gc[..., -1:] - gc).exp()
    # The states before each chunk (the forward's checkpoints).
    S = (torch.zeros(B, H, K, V, dtype=f64, device=q.device) if state is None else state.to(f64).clone())
    before = []
    for c in range(n):
        before.append(S)
        Y = Vc[:, :, c] - gamma[:, :, c, :, None] * (Kc[:, :, c] @ S)
        U = M[:, :, c] @ Y
        S = gamma[:, :, c, -1, None, None] * S + Kc[:, :, c].transpose(-1, -2) @ (tail[:, :, c, :, None] * U)
    # Stage 1: G_before = Phi G + Psi per chunk (dY = W^T dO' + M^T diag(d) K G is affine in G).
    gd = gamma[..., None] * dO                                           # diag(gamma) dO'
    MdK = M.transpose(-1, -2) @ (tail[..., None] * Kc)                   # M^T diag(d) K
    Phi = (gamma[..., -1, None, None] * torch.eye(K, dtype=f64, device=q.device)
           - Kc.transpose(-1, -2) @ (gamma[..., None] * MdK))
    Psi = Q.transpose(-1, -2) @ gd - Kc.transpose(-1, -2) @ (gamma[..., None] * (W.transpose(-1, -2) @ dO))
    # Stage 2: the state gradient after every chunk, the chunks in reverse.
    G = torch.zeros(B, H, K, V, dtype=f64, device=q.device) if d_state is None else d_state.to(f64).clone()
    after = [None] * n
    for c in reversed(range(n)):
        after[c] = G
        G = Phi[:, :, c] @ G + Psi[:, :, c]
    d_state0 = G
    # Stage 3: the inputs' gradients, every chunk from its G (a loop here; independent chunks).
    dQ, dK, dV = torch.zeros_like(Q), torch.zeros_like(Kc), torch.zeros_like(Vc)
    dgc, dbeta = torch.zeros_like(gc), torch.zeros_like(bp)
    for c in range(n):
        G, S0, q_, k_, do = after[c], before[c], Q[:, :, c], Kc[:, :, c], dO[:, :, c]
        gm, tl, R_, M_, T_, W_, P_ = (x[:, :, c] for x in (gamma, tail, R, M, Tinv, W, P))
        KS, QS = k_ @ S0, q_ @ S0
        Y = Vc[:, :, c] - gm[..., None] * KS
        U = M_ @ Y
        # S' = gamma_C S + K^T diag(d) U
        dUd = k_ @ G                                   # d(diag(d) U)
        dU = tl[..., None] * dUd
        dK[:, :, c] += (tl[..., None] * U) @ G.transpose(-1, -2)
        dtail = (U * dUd).sum(-1) * tl                 # through d_t = exp(gc_C - gc_t)
        dgc[:, :, c] -= dtail
        dgc[:, :, c, -1] += dtail.sum(-1) + (S0 * G).sum((-1, -2)) * gm[..., -1]
        # O = dO'-weighted: diag(gamma) Q S + W Y
        dgamma = (QS * do).sum(-1)
        dQ[:, :, c] += gm[..., None] * (do @ S0.transpose(-1, -2))
        dW = do @ Y.transpose(-1, -2)
        dY = W_.transpose(-1, -2) @ do + M_.transpose(-1, -2) @ dU
        dM = dU @ Y.transpose(-1, -2) + P_.transpose(-1, -2) @ dW
        dP = dW @ M_.transpose(-1, -2)
        # Y = V - diag(gamma) K S
        dV[:, :, c] = dY
        dgamma -= (KS * dY).sum(-1)
        dK[:, :, c] -= gm[..., None] * (dY @ S0.transpose(-1, -2))
        dgc[:, :, c] += dgamma * gm
        # M = T diag(beta), T = (I + A)^-1, A = strict_lower(diag(beta) R * K K^T)
        dbeta[:, :, c] += (dM * T_).sum(-2)
        dT = dM * bp[:, :, c, None, :]
        dA = (-T_.transpose(-1, -2) @ dT @ T_.transpose(-1, -2)).tril(-1)
        dbeta[:, :, c] += (dA * R_ * KK[:, :, c]).sum(-1)
        dKK = dA * bp[:, :, c, :, None] * R_
        dK[:, :, c] += (dKK + dKK.transpose(-1, -2)) @ k_
        # P = lower(R * Q K^T)
        dQK = (dP * R_).tril()
        dQ[:, :, c] += dQK @ k_
        dK[:, :, c] += dQK.transpose(-1, -2) @ q_
        F = (dA * bp[:, :, c, :, None] * KK[:, :, c] + dP.tril() * QK[:, :, c]) * R_
        dgc[:, :, c] += F.sum(-1) - F.sum(-2)
    dg = dgc.flip(-1).cumsum(-1).flip(-1)               # gc = cumsum(g) within a chunk
    return (_from_chunks(dQ, T), _from_chunks(dK, T), _from_chunks(dV, T), _from_chunks(dg, T),
            _from_chunks(dbeta, T), d_state0)


def rwkv7_grad(q, k, v, w, a, b, d_o, checkpoints, d_state=None, scale=1.0, want_d_state0=False):
    """The delta_rule_grad op in float64, by autograd through `rwkv7`: RWKV-7's gradients
    (dq, dw, dk, da, db, dv, d_state0) for output gradient d_o and final-state gradient d_state,
    from the initial state the forward's first checkpoint holds."""
    inputs = [x.detach().to(torch.float64).requires_grad_() for x in (q, k, v, w, a, b, checkpoints[:, :, 0])]
    q_, k_, v_, w_, a_, b_, s0 = inputs
    o, final = rwkv7(q_, w_, k_, v_, a_, b_, state=s0, scale=scale)
    loss = (o * d_o.to(torch.float64)).sum()
    if d_state is not None:
        loss = loss + (final * d_state.to(torch.float64)).sum()
    dq, dk, dv, dw, da, db, ds0 = torch.autograd.grad(loss, inputs, allow_unused=True)
    return dq, dw, dk, da, db, dv, (ds0 if want_d_state0 else s0.new_empty(0))
