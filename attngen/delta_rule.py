"""The delta-rule recurrences, RWKV-7 and Gated DeltaNet: the generated `delta_rule` kernels
(specs/delta_rule.yaml) as a differentiable torch custom op.

Both keep a decayed fp32 state S[key, value] per (batch, head), [B, H, K, V] as
flash-linear-attention's `fused_recurrent_rwkv7` / `fused_recurrent_gated_delta_rule` take and
return it, and correct it by a rank-one term each step:
    rwkv7:             sa = S^T a_t;  S <- diag(exp(w_t)) S + b_t sa^T + k_t v_t^T;    o_t = scale S^T r_t
    gated_delta_rule:  S <- exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S <- S + k_t u^T;  o_t = scale S^T q_t
(o_t reads the state after step t's update). In the value-major orientation of the RWKV-7 and
Gated DeltaNet papers, S' = S^T: S'_t = S'_{t-1} diag(w_t) + (S'_{t-1} a_t) b_t^T + v_t k_t^T and
S'_t = alpha_t S'_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T.

With a gradient wanted, the forward also saves the state every `checkpoint_every()` steps; the
backward (specs/delta_rule_grad.yaml) rebuilds the states in between and walks time in reverse.
It is written for RWKV-7. In 16 bits the forward saves chunk records too (`saves_records`): for
RWKV-7 the bf16 state before every 16-step chunk (B*H*T/16 * 2*K*V bytes, 1 GB at B8 T4096 H64
K=V=64, beside the 0.5 GB of fp32 checkpoints), which its chunked backward reads instead of
rebuilding each window (9.26 -> 6.45 ms there, H200). Gated DeltaNet's backward in 16-bit storage runs on tensor cores by
chunks (the gated_delta_grad op, specs/gated_delta_grad.yaml, the checkpoints being the states
before its chunks); in fp32 it runs by chunks in torch on long sequences (`use_chunked_backward`;
attngen/gated_delta_chunked_grad.py, the same algorithm); below that, Gated DeltaNet is RWKV-7
with tied vectors (w = g on every key, a = k, b = -alpha beta k, v scaled by beta), so its
gradients are RWKV-7's mapped back through the ties (`_gated_delta_backward`), with the tied
vectors made in fp32.
"""
from __future__ import annotations

from typing import Optional

import re

import torch
from torch._subclasses.fake_tensor import is_fake

from ._checks import check_tensor
from ._ops import Op, constant_result, exported_constant
from .gated_delta_chunked_grad import gated_delta_chunked_backward

OP = Op("delta_rule")
GRAD = Op("delta_rule_grad")
# Gated DeltaNet's backward on tensor cores (specs/gated_delta_grad.yaml): 16-bit inputs and the
# head sizes its instances cover, at every length, on the chunk records the forward saved.
# Forward + backward 1.581x / 1.610x fla's chunk kernels at B8 T4096 H16 / B4 T8192 H32,
# K=V=128 bf16 (H100, bd099f0, bench/results/h100/delta_rule_gated_delta.md; 1.405x / 1.457x
# with the saves stored from fragments, 1.385x / 1.423x with fp32 checkpoints beside the
# records, 1.33x / 1.36x before the records were saved).
GATED_GRAD = Op("gated_delta_grad")
# fp32 Gated DeltaNet (and head sizes no tensor-core instance covers) runs its backward by
# chunks in torch (gated_delta_chunked_grad: batched products and a reverse scan over chunks)
# from T steps and B * H * T head-steps, the recurrent delta_rule_grad kernel on RWKV-7's tied
# vectors below. Forward + backward, K=V=128 bf16, by chunks against the recurrent kernel: B8 H16
# at T 256 0.86x, 384 1.19x, 512 1.50x, 1024 2.07x, 4096 2.21x; B1 H8 at T 512 0.38x, 2048 1.07x
# (its ~4.2 ms floor is a hundred torch calls' host time). Measured on an H200
# (bench/results/h200/gated_delta_backward.md, commit b676602), before the tensor-core backward.
CHUNKED_BACKWARD_FROM_T = 512
CHUNKED_BACKWARD_FROM_STEPS = 8 * 16 * 512


_TENSOR_CORE_BUCKETS: list = []  # (k, v) of the built gated_delta_grad instances, read by _register


def use_tensor_core_backward(args: tuple) -> bool:
    """Whether Gated DeltaNet's backward runs on tensor cores (the gated_delta_grad op, given its
    arguments): 16-bit inputs (the spec's dtype axis) and a call an instance covers, as its
    dispatch says. A compiled graph's backward is traced with fake tensors, which have no data
    pointer for the dispatch's alignment check: there the head sizes are held to the built
    instances' buckets and to whole 16-byte rows (the covers' align % 8), and the op checks the
    pointers when it runs (a call it cannot serve raises, naming why)."""
    q, v = args[0], args[2]
    if q.element_size() != 2:
        return False
    if torch.compiler.is_compiling() or is_fake(q):
        K, V = q.shape[-1], v.shape[-1]
        return K % 8 == 0 and V % 8 == 0 and any(K <= kb and V <= vb for kb, vb in _TENSOR_CORE_BUCKETS)
    return bool(GATED_GRAD.select(*args))


def use_chunked_backward(B: int, T: int, H: int) -> bool:
    """Whether Gated DeltaNet's backward at this size runs by chunks in torch (the constants above)."""
    return T >= CHUNKED_BACKWARD_FROM_T and B * H * T >= CHUNKED_BACKWARD_FROM_STEPS


_registered = False


def variant(name: str) -> int:
    """The op's `variant` argument for `name` (the spec's axis order, read from the extension)."""
    return OP.axis_index("variant", name)


def checkpoint_every() -> int:
    """Steps between the forward's state checkpoints, as the extension was built with them."""
    return exported_constant("delta_rule_checkpoint_every")


def checkpoint_shape(B: int, T: int, H: int, K: int, V: int, every: int | None = None) -> tuple:
    """The forward's state checkpoints: [B, H, ceil(T / every), K, V] float32."""
    every = checkpoint_every() if every is None else every
    return (B, H, (T + every - 1) // every, K, V)


def records_numel(B: int, T: int, H: int, K: int, V: int, every: int | None = None, rwkv7: bool = False) -> int:
    """Bytes of the chunk records a training forward saves for the tensor-core backwards (the
    delta_rule op's `records`, 16-bit inputs): a header, then for Gated DeltaNet one record per
    64-step chunk and the state before every chunk in the inputs' 16-bit dtype ([K, V] each);
    for RWKV-7 (`rwkv7`) the state before every 16-step chunk in bf16 ([K, V] each), then each
    chunk's Z (the solve's result, which the backward reads instead of solving again) in bf16
    ([16, V] each)."""
    header = exported_constant("delta_rule_records_header_bytes")
    if rwkv7:
        chunk = exported_constant("delta_rule_rwkv7_record_chunk")
        return header + B * H * ((T + chunk - 1) // chunk) * 2 * (K + chunk) * V
    every = checkpoint_every() if every is None else every
    chunks = B * H * ((T + every - 1) // every)
    return header + chunks * (exported_constant("delta_rule_saved_record_bytes") + 2 * K * V)


def saved_states(records: torch.Tensor, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """The states a chunked forward saved with its records, in `dtype`: `shape` the checkpoints'
    [B, H, ceil(T / 64), K, V], a view into `records`."""
    B, H, n, K, V = shape
    start = exported_constant("delta_rule_records_header_bytes") + B * H * n * exported_constant(
        "delta_rule_saved_record_bytes")
    return records[start:].view(dtype).view(B, H, n, K, V)


def checkpoints_in_fp32(records: torch.Tensor, checkpoints: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The states before every chunk in fp32, for a backward that reads fp32 checkpoints: those a
    chunked forward saved with its records where their header says so (it leaves the fp32
    checkpoints unwritten then), the checkpoints otherwise. Decided on the device: no
    synchronization, at the cost of reading both."""
    if records.numel() == 0:
        return checkpoints
    marked = records[:4].view(torch.int32)[0] == exported_constant("delta_rule_records_valid")
    return torch.where(marked, saved_states(records, dtype, tuple(checkpoints.shape)).float(), checkpoints)


def saves_records(variant_number: int, q: torch.Tensor) -> bool:
    """Whether a training forward saves the chunk records: in 16 bits, where the chunked kinds
    run. Gated DeltaNet's tensor-core backward reads them instead of solving each chunk's
    system again (its first kernel: 0.238 ms of its 2.306 at B8 T4096 H16 K=V=128 bf16 on the
    H100, bench/results/h100/gated_delta_profile.txt); RWKV-7's chunked backward reads each
    16-step chunk's start state instead of rebuilding it from the checkpoints; RWKV-7 only for
    heads of at most delta_rule_rwkv7_record_keys keys, the most its chunked kind takes (at
    K=V=128 they were 2.1 GB at B8 T4096 H32 that no kind filled). Decided from the dtype and the head
    size alone, so that the op's fake implementation gives the same shapes; a kind that does not
    fill them leaves them unmarked, and the backward works from the checkpoints."""
    if q.element_size() != 2:
        return False
    return variant_number != variant("rwkv7") or q.shape[-1] <= exported_constant("delta_rule_rwkv7_record_keys")


def _records_numel(variant_number: int, q: torch.Tensor, V: int, every: int) -> int:
    """The records' bytes a training forward allocates for these inputs (0: none saved)."""
    if not saves_records(variant_number, q):
        return 0
    B, T, H, K = q.shape
    return records_numel(B, T, H, K, V, every, rwkv7=variant_number == variant("rwkv7"))


@constant_result
def _register() -> bool:
    """attngen::delta_rule_train: the forward that saves its checkpoints, with its fake
    implementation and its autograd formula (once per process; run at trace time under
    torch.compile, which cannot trace a registration)."""
    global _registered
    if _registered:
        return True
    OP.packet()
    records_numel(0, 0, 0, 0, 0), records_numel(0, 0, 0, 0, 0, rwkv7=True)  # its constants read here, eagerly: the fake implementation sizes the records
    exported_constant("delta_rule_records_valid")  # the header's mark, which the backward reads
    exported_constant("delta_rule_rwkv7_record_keys")  # saves_records, from the fake implementation too
    # Read here, eagerly (under torch.compile too), for the traced backward's use_tensor_core_backward.
    _TENSOR_CORE_BUCKETS[:] = sorted({(int(m[1]), int(m[2])) for m in
                                      (re.search(r"_k(\d+)_v(\d+)_", name) for name in GATED_GRAD.instances()) if m})

    @torch.library.custom_op("attngen::delta_rule_train", mutates_args=())
    def train_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, a: torch.Tensor,
                 b: Optional[torch.Tensor], state: Optional[torch.Tensor], variant: int, scale: float,
                 every: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, H, K = q.shape
        checkpoints = q.new_empty(checkpoint_shape(B, T, H, K, v.shape[-1], every), dtype=torch.float32)
        V = v.shape[-1]
        records = q.new_empty(_records_numel(variant, q, V, every), dtype=torch.uint8)
        o, final = OP(q, k, v, w, a, b, state, variant, scale, True, checkpoints, False,
                      records if records.numel() else None)
        return o, final, checkpoints, records

    @train_op.register_fake
    def _fake(q, k, v, w, a, b, state, variant, scale, every):
        B, T, H, K = q.shape
        V = v.shape[-1]
        return (v.new_empty((B, T, H, V)), q.new_empty((B, H, K, V), dtype=torch.float32),
                q.new_empty(checkpoint_shape(B, T, H, K, V, every), dtype=torch.float32),
                q.new_empty(_records_numel(variant, q, V, every), dtype=torch.uint8))

    def setup_context(ctx, inputs, output):
        q, k, v, w, a, b, state, variant_, scale, _every = inputs
        ctx.variant, ctx.scale, ctx.has_state = variant_, scale, state is not None
        ctx.save_for_backward(q, k, v, w, a, b, output[2], output[3])
        # The checkpoints and records never get a gradient: without this autograd would zero
        # tensors of their size every backward; _backward takes None for o's and the final
        # state's.
        ctx.set_materialize_grads(False)

    train_op.register_autograd(_backward, setup_context=setup_context)
    _registered = True
    return True


def _backward(ctx, d_o, d_state, _d_checkpoints, _d_records):
    q, k, v, w, a, b, checkpoints, records = ctx.saved_tensors
    d_o = torch.zeros_like(v) if d_o is None else d_o.contiguous()
    d_state = None if d_state is None else d_state.float().contiguous()
    if ctx.variant == variant("rwkv7"):
        # The gradients come in the inputs' dtype (the op's fp32 sums rounded once, in the kernel).
        dq, dw, dk, da, db, dv, ds0 = GRAD(q, k, v, w, a, b, d_o.to(q.dtype), checkpoints, d_state, ctx.scale,
                                           ctx.has_state, records if records.numel() else None)
        return (dq, dk, dv, dw, da, db, ds0 if ctx.has_state else None, None, None, None)
    tensor_core_args = (q, k, v, w, a, d_o.to(q.dtype), checkpoints, d_state, ctx.scale, ctx.has_state)
    if use_tensor_core_backward(tensor_core_args):
        *grads, ds0 = GATED_GRAD(*tensor_core_args, records if records.numel() else None)
    elif use_chunked_backward(q.shape[0], q.shape[1], q.shape[2]):
        checkpoints = checkpoints_in_fp32(records, checkpoints, q.dtype)
        *grads, ds0 = gated_delta_chunked_backward(q, k, v, w, a, d_o, checkpoints, d_state, ctx.scale,
                                                   ctx.has_state, checkpoint_every())
    else:
        checkpoints = checkpoints_in_fp32(records, checkpoints, q.dtype)
        *grads, ds0 = _gated_delta_backward(q, k, v, w, a, d_o, checkpoints, d_state, ctx.scale, ctx.has_state,
                                            GRAD)
    grads.append(None)  # b: unused by gated_delta
    return (*grads, ds0 if ctx.has_state else None, None, None, None)


def gated_delta_as_rwkv7(q, k, v, g, beta):
    """Gated DeltaNet's step as RWKV-7's on tied vectors, in fp32: (q, k, v', w, a, b) with
    w = g on every key, a = k, b = -exp(g) beta k, v' = beta v."""
    qf, kf = q.float(), k.float()
    alpha = g.exp()
    w = g[..., None].expand(kf.shape).contiguous()
    b = -(alpha * beta)[..., None] * kf
    return qf, kf, beta[..., None] * v.float(), w, kf, b


def _gated_delta_backward(q, k, v, g, beta, d_o, checkpoints, d_state, scale, want_d_state0, grad_rwkv7):
    """Gated DeltaNet's gradients (dq, dk, dv, dg, dbeta, d_state0) from RWKV-7's on the tied
    vectors (`grad_rwkv7`: the delta_rule_grad op's signature, or a float64 reference's):
    w = g on every key gives dg = sum_k dw (plus b's term); a = k and b = -alpha beta k add
    da - alpha beta db to dk; v' = beta v gives dv = beta dv' and dbeta = v . dv' (plus b's)."""
    qf, kf, vb, w, a, b = gated_delta_as_rwkv7(q, k, v, g, beta)
    dq, dw, dk, da, db, dvb, ds0 = grad_rwkv7(qf, kf, vb, w, a, b, d_o.float(), checkpoints, d_state, scale,
                                              want_d_state0)
    alpha = g.exp()
    k_db = (kf * db).sum(-1)
    dk = dk + da - (alpha * beta)[..., None] * db
    dg = dw.sum(-1) - alpha * beta * k_db
    dbeta = (v.float() * dvb).sum(-1) - alpha * k_db
    dv = beta[..., None] * dvb
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype), ds0


def _wants_grad(tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _packed_rows(op_name: str, first: str, x: torch.Tensor, cu_seqlens) -> tuple[torch.Tensor, int, int]:
    """With cu_seqlens: (the row of a flattened [N, Tmax] batch each packed step goes to, N,
    Tmax), after the checks that read cu_seqlens on the host (they synchronize): a 1-D integer
    tensor starting at 0, never decreasing, ending at the packed steps of `first` ([1, T, H, ...])."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 \
            or cu_seqlens.dtype not in (torch.int32, torch.int64):
        got = (f"{cu_seqlens.dtype} of shape {list(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor)
               else type(cu_seqlens).__name__)
        raise ValueError(f"{op_name}: cu_seqlens must be a 1-D int32 or int64 tensor of N + 1 offsets, got {got}")
    if not isinstance(x, torch.Tensor) or x.dim() < 3 or x.shape[0] != 1:
        got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{op_name}: with cu_seqlens the sequences are packed along T of a batch of one: {first} "
                         f"must be [1, T, H, ...], got {got}")
    host = cu_seqlens.tolist()
    lengths = [end - start for start, end in zip(host, host[1:])]
    if host[0] != 0:
        raise ValueError(f"{op_name}: cu_seqlens[0] = {host[0]}; it must be 0")
    if any(n < 0 for n in lengths):
        i = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(f"{op_name}: cu_seqlens decreases at index {i + 1} ({host[i]} -> {host[i + 1]})")
    if host[-1] != x.shape[1]:
        raise ValueError(f"{op_name}: cu_seqlens[-1] = {host[-1]} does not match the {x.shape[1]} packed steps of "
                         f"{first}")
    N, longest, T = len(lengths), max(lengths, default=0), x.shape[1]
    cu = cu_seqlens.to(x.device, torch.int64)
    seq = torch.repeat_interleave(torch.arange(N, device=x.device), cu[1:] - cu[:-1], output_size=T)
    return torch.arange(T, device=x.device) - cu[seq] + seq * longest, N, longest


def _run_packed(op_name: str, tensors: dict, cu_seqlens, run):
    """Sequences packed along T (cu_seqlens) run as a zero-padded batch [N, Tmax, H, ...], their
    outputs packed back: `run` takes the padded tensors (the state as given, [N, H, K, V]) and
    returns (o, final state). Exact: a padded step follows its sequence's last and changes
    nothing (log decay 0, no correction, no key, no value), so the final state is the
    sequence's, and its rows of o are dropped. Differentiable (index_copy in, index_select out;
    equal lengths are views, no copy). The cost is that of N x Tmax steps, whatever the lengths."""
    first = next(iter(tensors))
    rows, N, longest = _packed_rows(op_name, first, tensors[first], cu_seqlens)
    packed_shape = tensors[first].shape[:2]
    equal = N * longest == packed_shape[1]   # equal lengths: the packed rows are the batch, viewed

    def pad(name, x):
        if x is None or name == "state":
            return x
        if not isinstance(x, torch.Tensor) or x.dim() < 3 or x.shape[:2] != packed_shape:
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{op_name}: with cu_seqlens {name} must be packed as {first} is, "
                             f"[{packed_shape[0]}, {packed_shape[1]}, H, ...], got {got}")
        if equal:
            return x[0].unflatten(0, (N, longest))
        out = x.new_zeros(N * longest, *x.shape[2:]).index_copy(0, rows, x[0])
        return out.view(N, longest, *x.shape[2:])

    o, s = run({name: pad(name, t) for name, t in tensors.items()})
    o = o.reshape(N * longest, *o.shape[2:])
    return (o if equal else o.index_select(0, rows))[None], s


def _run(op_name: str, tensors: dict, variant_name: str, scale: float, return_state: bool, qk_l2norm: bool = False,
         cu_seqlens=None):
    """Every tensor on a CUDA device (what needs no extension to say), then the op, whose
    generated checks name anything else: through attngen::delta_rule_train (which saves the
    checkpoints) where a gradient is wanted, straight to the op otherwise. `qk_l2norm` (the
    kernels normalise q and k) only without a gradient: the backward takes q and k normalised.
    With cu_seqlens, the packed sequences run as one padded batch (_run_packed)."""
    if cu_seqlens is not None:
        return _run_packed(op_name, tensors, cu_seqlens,
                           lambda padded: _run(op_name, padded, variant_name, scale, return_state, qk_l2norm))
    first = next(iter(tensors.values()))
    for name, t in tensors.items():
        if t is not None:
            check_tensor(op_name, name, t, first if t is not first else None)
    q, k, v, w, a, b, state = tensors.values()
    number = variant(variant_name)
    if _wants_grad(tensors.values()):
        assert not qk_l2norm, "the backward takes q and k normalised: normalise them before the op"
        _register()
        o, s, _, _ = torch.ops.attngen.delta_rule_train(q, k, v, w, a, b, state, number, scale, checkpoint_every())
        return o, (s if return_state else None)
    o, s = OP(q, k, v, w, a, b, state, number, scale, return_state, None, qk_l2norm)
    return o, (s if return_state else None)


def rwkv7(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
          b: torch.Tensor, state: Optional[torch.Tensor] = None, scale: float = 1.0,
          return_state: bool = True, cu_seqlens: Optional[torch.Tensor] = None):
    """RWKV-7's wkv: (o [B, T, H, V], final state [B, H, K, V] float32, or None).

    r, w, k, a, b: [B, T, H, K]; v: [B, T, H, V]; all of one dtype (fp32, fp16 or bf16; the
    state and the arithmetic are fp32). w is the log of the decay (w <= 0); as RWKV-LM passes
    them, a = -kk and b = kk * iclr. state: [B, H, K, V] float32 (default zeros). Any strides
    with a contiguous last dim. Differentiable in every input and the initial state, and
    through the returned state. cu_seqlens (int32 or int64 [N + 1], as flash-linear-attention
    takes it): N sequences packed along T of a batch of one, sequence i in steps cu_seqlens[i]
    .. cu_seqlens[i + 1] - 1, each from its own initial state; state and the final state are
    then [N, H, K, V]. The offsets are read on the host (a synchronization; under torch.compile a
    graph break), and the sequences run as one zero-padded [N, max length] batch.
    Gradients come in the inputs' dtype (summed in fp32, rounded once). In fp16, w's gradient
    carries the decay as a factor and underflows fp16's range (6e-5) at decays near 0, as any
    fp16 gradient of w does: use loss scaling, or bf16.
    """
    return _run("rwkv7", {"r": r, "k": k, "v": v, "w": w, "a": a, "b": b, "state": state}, "rwkv7",
                float(scale), bool(return_state), cu_seqlens=cu_seqlens)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                     use_qk_l2norm: bool = False, return_state: bool = True,
                     cu_seqlens: Optional[torch.Tensor] = None):
    """Gated DeltaNet: (o [B, T, H, V], final state [B, H, K, V] float32, or None).

    q, k: [B, T, H, K]; v: [B, T, H, V] (K and V may differ); one dtype (fp32, fp16, bf16).
    g (log alpha, <= 0) and beta: [B, T, H], taken as float32. scale defaults to K^-0.5.
    use_qk_l2norm normalises q and k over K first (in fp32, rounded back to their dtype): inside
    the kernels when no gradient is wanted, by torch before them otherwise (so that autograd
    differentiates the normalisation). Differentiable in every input and the initial state, and
    through the returned state. cu_seqlens packs N sequences along T of a batch of one, as in
    `rwkv7` (state and the final state [N, H, K, V]).
    """
    in_kernel = use_qk_l2norm and not _wants_grad((q, k, v, g, beta, state))
    if use_qk_l2norm and not in_kernel:
        q, k = (torch.nn.functional.normalize(x.float(), dim=-1).to(x.dtype) for x in (q, k))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = g.float() if isinstance(g, torch.Tensor) else g
    beta = beta.float() if isinstance(beta, torch.Tensor) else beta
    return _run("gated_delta_rule", {"q": q, "k": k, "v": v, "g": g, "beta": beta, "b": None, "state": state},
                "gated_delta", float(scale), bool(return_state), in_kernel, cu_seqlens)


def delta_net(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
              state: Optional[torch.Tensor] = None, scale: Optional[float] = None, use_qk_l2norm: bool = False,
              return_state: bool = True, cu_seqlens: Optional[torch.Tensor] = None):
    """DeltaNet, the delta rule with no decay, as flash-linear-attention's chunk_delta_rule:
    u = beta_t (v_t - S^T k_t); S <- S + k_t u^T; o_t = scale S^T q_t. `gated_delta_rule` with
    g = 0 (its kernels, its backward); the arguments are gated_delta_rule's without g."""
    if not isinstance(beta, torch.Tensor):
        raise ValueError(f"delta_net: beta must be a torch.Tensor, got {type(beta).__name__}")
    return gated_delta_rule(q, k, v, torch.zeros_like(beta, dtype=torch.float32), beta, state=state, scale=scale,
                            use_qk_l2norm=use_qk_l2norm, return_state=return_state, cu_seqlens=cu_seqlens)


def kda_as_rwkv7(q, k, v, g, beta):
    """Kimi Delta Attention's step as RWKV-7's on tied vectors: (r, w, k, v', a, b) = (q, g, k,
    beta v, exp(g) k, -beta k), made in fp32 and rounded to q's dtype, q and k repeated over the
    value heads of their group. RWKV-7's sa = S^T a then reads exp(g) k against the state before
    the decay, which is k against the decayed state, as KDA's correction does; b sa^T + k v'^T is
    its beta k (v - S^T k)^T."""
    H, HV = q.shape[2], v.shape[2]
    if HV != H:
        q, k = (x.repeat_interleave(HV // H, dim=2) for x in (q, k))
    def wide(x):  # at least fp32 (float64 stays: the references run this too)
        return x.to(torch.promote_types(x.dtype, torch.float32))
    gf, kf, bf = wide(g), wide(k), wide(beta)[..., None]
    dtype = q.dtype
    return q, gf.to(dtype), k, (bf * wide(v)).to(dtype), (gf.exp() * kf).to(dtype), (-bf * kf).to(dtype)


def _check_kda(q, k, v, g, beta) -> None:
    """KDA's shapes (what the rwkv7 op would not name in KDA's terms)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_tensor("kda", name, x, q if x is not q else None)
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"kda: q, k and v must share one dtype of float32, float16, bfloat16, got {q.dtype}, "
                         f"{k.dtype}, {v.dtype}")
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"kda: q and k must be [B, T, H, K] alike, got {list(q.shape)} and {list(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T) or v.shape[2] % max(H, 1):
        raise ValueError(f"kda: v must be [B={B}, T={T}, HV, V] with HV a multiple of H={H}, got {list(v.shape)}")
    HV = v.shape[2]
    if g.shape != (B, T, HV, K):
        raise ValueError(f"kda: g must be [B, T, HV, K] = {[B, T, HV, K]} (log decay per key channel), got "
                         f"{list(g.shape)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"kda: beta must be [B, T, HV] = {[B, T, HV]}, got {list(beta.shape)}")


def kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        state: Optional[torch.Tensor] = None, scale: Optional[float] = None, use_qk_l2norm: bool = False,
        return_state: bool = True, cu_seqlens: Optional[torch.Tensor] = None):
    """Kimi Delta Attention (KDA, Gated DeltaNet with a per-channel gate), as
    flash-linear-attention's chunk_kda / naive_recurrent_kda: (o [B, T, HV, V], final state
    [B, HV, K, V] float32, or None).

        S <- diag(exp(g_t)) S;  u = beta_t (v_t - S^T k_t);  S <- S + k_t u^T;  o_t = scale S^T q_t

    q, k: [B, T, H, K] of one dtype (fp32, fp16, bf16); v: [B, T, HV, V] of that dtype, HV a
    multiple of H (grouped values); g: [B, T, HV, K], the log decay per key channel (<= 0);
    beta: [B, T, HV]. scale defaults to K^-0.5. use_qk_l2norm normalises q and k over K first
    (in fp32, rounded to their dtype). state, cu_seqlens, return_state: as `rwkv7`.

    It runs on RWKV-7's kernels, KDA being RWKV-7 on tied vectors (`kda_as_rwkv7`: w = g,
    a = exp(g) k, b = -beta k, v scaled by beta), made in fp32 and rounded to q's dtype (g and
    the tied vectors carry that rounding in 16-bit storage). Differentiable in every input and the
    initial state: autograd goes through the ties and RWKV-7's backward. Plain DeltaNet is
    `delta_net` (`gated_delta_rule` with g = 0).
    """
    _check_kda(q, k, v, g, beta)
    if use_qk_l2norm:
        q, k = (torch.nn.functional.normalize(x.float(), dim=-1).to(x.dtype) for x in (q, k))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    r, w, k, v, a, b = kda_as_rwkv7(q, k, v, g, beta)
    return rwkv7(r, w, k, v, a, b, state=state, scale=float(scale), return_state=return_state, cu_seqlens=cu_seqlens)


def instances() -> list[str]:
    return OP.instances()


def delta_rule_with(instance: str, *args):
    """Run one named instance with the op's own arguments (tests, benchmarks)."""
    return OP.forced(instance, *args)
