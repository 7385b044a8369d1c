"""GPU tier: every delta-rule instance (RWKV-7 and Gated DeltaNet) against the float64
recurrence of attngen.reference, on odd sizes, with state in and out, decays near 1 and near 0,
strided inputs and poisoned outputs; the dispatch, the op's errors, and torch.compile."""
import pytest
import torch

import attngen
from attngen import delta_rule, reference

from .conftest import DTYPES, TOL, family_manifest, log_decays, poison, rel_err

pytestmark = pytest.mark.gpu


def strided(x):
    """The same values through a [B, H, T, F] buffer permuted back: strides that are not contiguous."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def rwkv7_inputs(B, T, H, K, V, dtype, regime="mixed", seed=0):
    """As RWKV-7 makes them: a = -kk, b = kk * iclr with kk unit-norm (the state stays bounded)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    r, k = (torch.randn(B, T, H, K, device="cuda", generator=g) for _ in range(2))
    v = torch.randn(B, T, H, V, device="cuda", generator=g)
    w = log_decays((B, T, H, K), regime, g)
    kk = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=g), dim=-1)
    iclr = torch.rand(B, T, H, K, device="cuda", generator=g)
    return [x.to(dtype) for x in (r, w, k / K ** 0.5, v, -kk, kk * iclr)]


def gated_inputs(B, T, H, K, V, dtype, regime="mixed", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, H, K, device="cuda", generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=g), dim=-1)
    v = torch.randn(B, T, H, V, device="cuda", generator=g)
    gate = log_decays((B, T, H), regime, g)
    beta = torch.rand(B, T, H, device="cuda", generator=g)
    return [q.to(dtype), k.to(dtype), v.to(dtype), gate, beta]


def op_args(variant, inputs, state, scale, return_state=True, checkpoints=None, qk_l2norm=False):
    """The op's arguments (specs/delta_rule.yaml schema) for one variant's inputs."""
    if variant == "rwkv7":
        r, w, k, v, a, b = inputs
        return (r, k, v, w, a, b, state, delta_rule.variant("rwkv7"), scale, return_state, checkpoints, qk_l2norm)
    q, k, v, gate, beta = inputs
    return (q, k, v, gate, beta, None, state, delta_rule.variant("gated_delta"), scale, return_state, checkpoints,
            qk_l2norm)


def expected(variant, inputs, state, scale):
    if variant == "rwkv7":
        return reference.rwkv7(*inputs, state=state, scale=scale)
    return reference.gated_delta_rule(*inputs, state=state, scale=scale)


def instance_shapes(kind: str, kb: int) -> tuple:
    """(T, K, V, decay regime) each instance is checked on: K at its bucket and below
    (zero-filled keys), V not a multiple of the CTA's columns, T across chunk boundaries. The
    chunked kind covers rows of whole 16-byte pieces (K and V multiples of 8), and walks
    several 64-step chunks with a partial last one."""
    if kind.startswith("chunked"):
        return ((1, kb, kb, "mixed"), (65, kb - 8, 40, "near1"), (130, kb, 2 * kb + 8, "near0"), (300, kb, kb, "mixed"))
    return ((1, kb, kb, "mixed"), (65, kb - 4, 33, "near1"), (130, kb, 2 * kb + 8, "near0"))


def test_every_instance():
    """Each instance forced on the shapes of instance_shapes, state in and out, outputs poisoned."""
    failures, checked, expected_checks = [], 0, 0
    for name, row in sorted(family_manifest("delta_rule").items()):
        dtype, kb, variant = DTYPES[row["dtype"]], row["params"]["k"], row["variant"]
        shapes = instance_shapes(row["kind"], kb)
        expected_checks += len(shapes)
        for T, K, V, regime in shapes:
            make = rwkv7_inputs if variant == "rwkv7" else gated_inputs
            inputs = make(2, T, 3, K, V, dtype, regime, seed=T + K)
            state = torch.randn(2, 3, K, V, device="cuda") * 0.1
            scale = 0.5
            ref_o, ref_s = expected(variant, inputs, state, scale)
            poison(2 * T * 3 * V + 2 * 3 * K * V)
            o, s = delta_rule.delta_rule_with(name, *op_args(variant, inputs, state, scale))
            for what, got, want in (("o", o, ref_o), ("state", s, ref_s)):
                tol = TOL[dtype] if what == "o" else max(TOL[dtype], 1e-5)
                err = rel_err(got, want)
                if not err <= tol:
                    failures.append(f"{name} T={T} K={K} V={V} {regime} {what}: rel err {err:.2e}")
            checked += 1
    assert checked == expected_checks >= 3 * 36 and not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 1777])
def test_rwkv7_through_the_dispatch(dtype, T):
    B, H, K = 2, 5, 64
    inputs = rwkv7_inputs(B, T, H, K, K, dtype, seed=T)
    inputs = [strided(x) for x in inputs]
    state = torch.randn(B, H, K, K, device="cuda") * 0.1
    ref_o, ref_s = reference.rwkv7(*inputs, state=state)
    poison(B * T * H * K + B * H * K * K)
    o, s = attngen.rwkv7(*inputs, state=state)
    assert o.dtype == dtype and o.shape == (B, T, H, K) and s.dtype == torch.float32
    assert rel_err(o, ref_o) <= TOL[dtype] and rel_err(s, ref_s) <= max(TOL[dtype], 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,K,V", [(1, 128, 128), (63, 128, 64), (1777, 64, 128), (4097, 128, 128)])
def test_gated_delta_through_the_dispatch(dtype, T, K, V):
    B, H = 1, 3
    q, k, v, gate, beta = gated_inputs(B, T, H, K, V, dtype, "near1" if T > 2000 else "mixed", seed=T)
    ref_o, ref_s = reference.gated_delta_rule(q, k, v, gate, beta)
    o, s = attngen.gated_delta_rule(q, k, v, gate, beta)
    assert rel_err(o, ref_o) <= TOL[dtype] and rel_err(s, ref_s) <= max(TOL[dtype], 1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gated_delta_chunked_kind_through_the_dispatch(dtype):
    """16-bit Gated DeltaNet of 256 steps or more takes the tensor-core chunked kind: its
    output and final state against float64, its checkpoints against the recurrent kind's, and
    rwkv7 and fp32 keep the recurrent kinds. (Below 256 steps the tuned table's short-sequence
    bucket decides, having timed both; tuned/sm_90a/delta_rule.yaml.)"""
    B, T, H, K, V = 2, 777, 3, 128, 128
    q, k, v, gate, beta = inputs = gated_inputs(B, T, H, K, V, dtype, seed=5)
    state = torch.randn(B, H, K, V, device="cuda") * 0.1
    args = op_args("gated_delta", inputs, state, 0.25)
    assert "_chunked_" in delta_rule.OP.select(*args)
    assert "_chunked_" not in delta_rule.OP.select(*op_args("gated_delta", [x.float() for x in inputs], state, 0.25))
    rwkv = rwkv7_inputs(B, T, H, K, V, dtype)
    assert "_chunked_" not in delta_rule.OP.select(*op_args("rwkv7", rwkv, state, 0.25))
    ref_o, ref_s = reference.gated_delta_rule(q, k, v, gate, beta, state=state, scale=0.25)
    poison(B * T * H * V + B * H * K * V)
    o, s = attngen.gated_delta_rule(q, k, v, gate, beta, state=state, scale=0.25)
    assert rel_err(o, ref_o) <= TOL[dtype] and rel_err(s, ref_s) <= TOL[dtype]
    got = checkpoints_of("gated_delta", inputs, state, 0.25)
    recurrent = next(n for n in delta_rule.instances() if "_recurrent_k128_" in n and "gated_delta" in n
                     and n.endswith(f"_{'bf16' if dtype == torch.bfloat16 else 'fp16'}_sm90a"))
    want = torch.full_like(got, float("nan"))
    delta_rule.delta_rule_with(recurrent, *op_args("gated_delta", inputs, state, 0.25, checkpoints=want))
    assert rel_err(got, want) <= TOL[dtype]



@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,V,regime", [(1777, 64, "mixed"), (300, 136, "near0"), (257, 64, "near1")])
def test_rwkv7_chunked_kind_on_long_sequences(dtype, T, V, regime):
    """RWKV-7's tensor-core chunked kind forced: output and final state against float64 over many
    16-step chunks (decays by products, and term by term near 0), two value blocks, and its
    checkpoints (the backward's input) against the recurrent kind's."""
    B, H, K = 2, 3, 64
    inputs = rwkv7_inputs(B, T, H, K, V, dtype, regime, seed=T)
    state = torch.randn(B, H, K, V, device="cuda") * 0.1
    suffix = f"_{'bf16' if dtype == torch.bfloat16 else 'fp16'}_sm90a"
    chunked = next(n for n in delta_rule.instances() if "_chunked_rwkv7_k64_" in n and n.endswith(suffix))
    recurrent = next(n for n in delta_rule.instances() if "rwkv7_recurrent_k64_" in n and n.endswith(suffix))
    ref_o, ref_s = reference.rwkv7(*inputs, state=state, scale=0.5)
    shape = delta_rule.checkpoint_shape(B, T, H, K, V)
    got, want = (torch.full(shape, float("nan"), device="cuda") for _ in range(2))
    poison(B * T * H * V + B * H * K * V)
    o, s = delta_rule.delta_rule_with(chunked, *op_args("rwkv7", inputs, state, 0.5, checkpoints=got))
    assert rel_err(o, ref_o) <= TOL[dtype] and rel_err(s, ref_s) <= TOL[dtype]
    delta_rule.delta_rule_with(recurrent, *op_args("rwkv7", inputs, state, 0.5, checkpoints=want))
    assert rel_err(got, want) <= TOL[dtype]


def l2normed(x):
    """What qk_l2norm makes of q or k: normalised in fp32, rounded to its dtype."""
    return torch.nn.functional.normalize(x.float(), dim=-1).to(x.dtype)


def test_every_gated_delta_instance_normalizes_q_and_k():
    """qk_l2norm: each Gated DeltaNet instance forced on unnormalised q and k (k scaled by 3,
    zero rows past T) against the float64 recurrence on the normalised ones; outputs poisoned."""
    failures, checked = [], 0
    for name, row in sorted(family_manifest("delta_rule").items()):
        if row["variant"] != "gated_delta":
            continue
        dtype, kb = DTYPES[row["dtype"]], row["params"]["k"]
        T, K, V = 130, kb - 8, 2 * kb + 8
        q, k, v, gate, beta = gated_inputs(2, T, 3, K, V, dtype, "near1", seed=K)
        k = (k.float() * 3).to(dtype)
        state = torch.randn(2, 3, K, V, device="cuda") * 0.1
        ref_o, ref_s = reference.gated_delta_rule(l2normed(q), l2normed(k), v, gate, beta, state=state, scale=0.5)
        poison(2 * T * 3 * V + 2 * 3 * K * V)
        o, s = delta_rule.delta_rule_with(name, *op_args("gated_delta", [q, k, v, gate, beta], state, 0.5,
                                                         qk_l2norm=True))
        for what, got, want in (("o", o, ref_o), ("state", s, ref_s)):
            err = rel_err(got, want)
            if not err <= max(TOL[dtype], 1e-5):
                failures.append(f"{name} {what}: rel err {err:.2e}")
        checked += 1
    assert checked >= 12 and not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype,T", [(torch.float32, 100), (torch.bfloat16, 300), (torch.float16, 77)])
def test_l2norm_in_the_kernels_equals_torchs(dtype, T):
    """use_qk_l2norm without a gradient (the kernels normalise) equals it with one (torch
    normalises before the op, for autograd)."""
    q, k, v, gate, beta = gated_inputs(2, T, 4, 128, 128, dtype, seed=11)
    k = (k.float() * 3).to(dtype)
    with torch.no_grad():
        fused, s_fused = attngen.gated_delta_rule(q, k, v, gate, beta, use_qk_l2norm=True)
    leaf = q.clone().requires_grad_()
    plain, s_plain = attngen.gated_delta_rule(leaf, k, v, gate, beta, use_qk_l2norm=True)
    tol = 1e-5 if dtype == torch.float32 else TOL[dtype]
    assert rel_err(fused, plain.detach()) <= tol and rel_err(s_fused, s_plain.detach()) <= tol
    with pytest.raises(ValueError, match="delta_rule: qk_l2norm is for gated_delta only"):
        delta_rule.OP(*op_args("rwkv7", rwkv7_inputs(1, 8, 2, 64, 64, dtype), None, 1.0, qk_l2norm=True))


def test_gated_delta_l2norm_and_chunked_state_handoff():
    """Two calls with the state handed over equal one call; use_qk_l2norm normalises q and k."""
    q, k, v, gate, beta = gated_inputs(2, 200, 4, 64, 64, torch.float32, seed=3)
    k = k * 3.0
    whole, s_whole = attngen.gated_delta_rule(q, k, v, gate, beta, use_qk_l2norm=True)
    first, s1 = attngen.gated_delta_rule(q[:, :77], k[:, :77], v[:, :77], gate[:, :77], beta[:, :77], use_qk_l2norm=True)
    second, s2 = attngen.gated_delta_rule(q[:, 77:], k[:, 77:], v[:, 77:], gate[:, 77:], beta[:, 77:], state=s1,
                                          use_qk_l2norm=True)
    assert rel_err(torch.cat([first, second], 1), whole) <= 1e-5 and rel_err(s2, s_whole) <= 1e-5
    qn, kn = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    ref_o, _ = reference.gated_delta_rule(qn, kn, v, gate, beta)
    assert rel_err(whole, ref_o) <= 1e-5


def test_dispatch_spreads_few_heads_over_narrow_ctas():
    """In fp32 (the default rules) few heads take 32-column CTAs, many heads the 64-column
    recurrent kind; in 16 bits the tuned table's winners for both buckets are the chunked kind
    (tuned/sm_90a/delta_rule.yaml)."""
    pick = lambda x: delta_rule.OP.select(*op_args("rwkv7", x, None, 1.0))  # noqa: E731
    small, large = (rwkv7_inputs(B, 16, H, 64, 64, torch.float32) for B, H in ((1, 4), (8, 64)))
    assert "_narrow_k64_cols32_" in pick(small) and "_recurrent_k64_cols64_" in pick(large)
    small, large = (rwkv7_inputs(B, 16, H, 64, 64, torch.bfloat16) for B, H in ((1, 4), (8, 64)))
    assert "_chunked_rwkv7_k64_" in pick(small) and "_chunked_rwkv7_k64_" in pick(large)


def test_backward_dispatch_spreads_few_heads_over_narrow_ctas():
    """fp32 steps few heads over narrow CTAs; 16 bits take the chunked kind at any head count
    (and the step-by-step kinds where its 16-byte rows do not hold)."""
    def pick(B, H, dtype, K=64):
        r, w, k, v, a, b = rwkv7_inputs(B, 16, H, K, 64, dtype)
        ckpt = torch.zeros(delta_rule.checkpoint_shape(B, 16, H, K, 64), device="cuda")
        return delta_rule.GRAD.select(r, k, v, w, a, b, v, ckpt, None, 1.0, False)
    assert "_narrow_k64_" in pick(1, 4, torch.float32) and "_recurrent_k64_" in pick(8, 64, torch.float32)
    assert "_chunked_rwkv7_k64_" in pick(1, 4, torch.bfloat16) and "_chunked_rwkv7_k64_" in pick(8, 64, torch.float16)
    assert "_narrow_k64_" in pick(1, 4, torch.bfloat16, K=60)


def test_empty_sequences_return_the_initial_state():
    inputs = rwkv7_inputs(2, 0, 3, 64, 64, torch.bfloat16)
    state = torch.randn(2, 3, 64, 64, device="cuda")
    o, s = attngen.rwkv7(*inputs, state=state)
    assert o.shape == (2, 0, 3, 64) and torch.equal(s, state)


def test_bad_inputs_name_the_argument():
    r, w, k, v, a, b = rwkv7_inputs(1, 8, 2, 64, 64, torch.bfloat16)
    with pytest.raises(ValueError, match=r"delta_rule: b is required by rwkv7"):
        delta_rule.OP(r, k, v, w, a, None, None, delta_rule.variant("rwkv7"), 1.0, True, None)
    with pytest.raises(ValueError, match=r"variant must be in \[0, 2\) \(0: rwkv7, 1: gated_delta\), got 5"):
        delta_rule.OP(r, k, v, w, a, b, None, 5, 1.0, True, None)
    with pytest.raises(ValueError, match=r"delta_rule: k has dtype Half but q has BFloat16"):
        attngen.rwkv7(r, w, k.half(), v, a, b)
    with pytest.raises(ValueError, match=r"delta_rule: v has shape \[1, 7, 2, 64\] but q has \[1, 8, 2, 64\]; B, T, H must agree"):
        attngen.rwkv7(r, w, k, v[:, :7], a, b)
    with pytest.raises(ValueError, match=r"delta_rule: state has shape \[1, 2, 64, 32\] but v has \[1, 8, 2, 64\]; V must agree"):
        attngen.rwkv7(r, w, k, v, a, b, state=torch.zeros(1, 2, 64, 32, device="cuda"))
    with pytest.raises(ValueError, match=r"g \(argument w\) must be \[B, T, H\] \(gated_delta: log alpha\)"):
        attngen.gated_delta_rule(r, k, v, w, w[..., 0])
    with pytest.raises(ValueError, match=r"K=4096"):   # 1024+ state floats a thread: no instance can hold them
        attngen.gated_delta_rule(*gated_inputs(1, 4, 1, 4096, 64, torch.float32)[:5])


def checkpoints_of(variant, inputs, state, scale, instance=None):
    """The forward's checkpoints for these inputs (through the dispatch, or `instance` forced)."""
    q, v = inputs[0], inputs[3] if variant == "rwkv7" else inputs[2]
    B, T, H, K = q.shape
    ckpt = torch.full(delta_rule.checkpoint_shape(B, T, H, K, v.shape[-1]), float("nan"), device="cuda")
    args = op_args(variant, inputs, state, scale, checkpoints=ckpt)
    delta_rule.delta_rule_with(instance, *args) if instance else delta_rule.OP(*args)
    return ckpt


def recurrent_forward(kb: int, dtype) -> str:
    """RWKV-7's recurrent forward instance of key bucket kb in dtype: fp32 states step by step."""
    suffix = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    return next(n for n in delta_rule.instances() if f"_rwkv7_recurrent_k{kb}_" in n and n.endswith(f"_{suffix}_sm90a"))


GRAD_NAMES = ("dq", "dw", "dk", "da", "db", "dv", "d_state0")


def storage_err(exact: torch.Tensor, dtype: torch.dtype) -> float:
    """What storing the exact gradient in `dtype` costs (rel_err): the unit roundoff where it
    is in range, more where it is not. fp16's range ends at 6e-5 (normal) / 6e-8 (subnormal), and
    at decays near 0 the decay's gradient (scaled by the decay) falls there, as it does in
    any fp16 gradient of w (torch's autograd included): loss scaling or bf16 is the cure.
    Zero for fp32 outputs, which hold the fp32 arithmetic unrounded."""
    if dtype == torch.float32:
        return 0.0
    return torch.finfo(dtype).eps / 2 + rel_err(exact.to(dtype), exact)


def recurrent_grad_rows() -> dict:
    """delta_rule_grad's step-by-step instances (the chunked kind has a test of its own)."""
    return {n: r for n, r in family_manifest("delta_rule_grad").items() if r["kind"] != "chunked_rwkv7"}


def test_every_grad_instance():
    """Each step-by-step delta_rule_grad instance forced against autograd of the float64
    reference: K at its bucket and below, V over several CTAs (their key-side terms added), T
    across windows and sub-windows, decays near 1 and near 0, the final state's gradient in and
    the initial state's out. The arithmetic is fp32 (within 1e-5); the gradients come in the
    inputs' dtype, rounded once, also where several CTAs of a (b, h) sum them (V past the
    instance's columns), so 16-bit ones may add their rounding (storage_err); the initial
    state's gradient stays fp32."""
    failures, worst, checked = [], {}, 0
    for name, row in sorted(recurrent_grad_rows().items()):
        dtype, kb = DTYPES[row["dtype"]], row["params"]["k"]
        for T, K, V, regime in ((1, kb, kb, "mixed"), (67, kb - 4, 33, "near1"), (130, kb, 2 * kb + 8, "near0")):
            inputs = rwkv7_inputs(2, T, 3, K, V, dtype, regime, seed=T + K)
            state = torch.randn(2, 3, K, V, device="cuda") * 0.1
            # The recurrent forward's checkpoints: the states rwkv7_grad rebuilds to fp32 rounding (the
            # chunked kind's carry its tensor-core rounding, ~1e-3, past this test's 1e-5 bound).
            ckpt = checkpoints_of("rwkv7", inputs, state, 0.5, recurrent_forward(kb, dtype))
            r, w, k, v, a, b = inputs
            d_o = torch.randn(v.shape, device="cuda").to(dtype)
            d_state = torch.randn(state.shape, device="cuda")
            want = reference.rwkv7_grad(r, k, v, w, a, b, d_o, ckpt, d_state, 0.5, True)
            poison(6 * 2 * T * 3 * max(K, V) + 2 * 3 * K * V)
            got = delta_rule.GRAD.forced(name, r, k, v, w, a, b, d_o, ckpt, d_state, 0.5, True)
            for what, x, y in zip(GRAD_NAMES, got, want):
                err = rel_err(x, y)
                worst[what] = max(worst.get(what, 0.0), err)
                want_dtype = torch.float32 if what == "d_state0" else dtype
                bound = 1e-5 + storage_err(y, want_dtype)
                if x.dtype != want_dtype:
                    failures.append(f"{name} {what}: dtype {x.dtype}, want {want_dtype}")
                if not err <= bound:
                    failures.append(f"{name} T={T} K={K} V={V} {regime} {what}: rel err {err:.2e}")
            checked += 1
    print("worst relative errors:", {k: f"{v:.1e}" for k, v in worst.items()})
    assert checked == 3 * len(recurrent_grad_rows()) >= 3 * 9 and not failures, "\n".join(failures[:20])



def test_every_chunked_rwkv7_grad_instance():
    """The chunked RWKV-7 backward (specs/delta_rule_grad.yaml chunked_rwkv7) forced against
    float64 autograd of the recurrence, on the recurrent forward's checkpoints: every gradient
    and the initial state's within the 16-bit bound (bf16 tensor-core operands), one step,
    across windows and a partial last chunk, decays near 1, mixed and near 0 (its pair matrices
    term by term), K and V below the bucket, outputs poisoned first; the gradients in the
    inputs' dtype, the initial state's in fp32."""
    names = [n for n, r in family_manifest("delta_rule_grad").items() if r["kind"] == "chunked_rwkv7"]
    assert len(names) == 2, names
    failures = []
    for name in names:
        dtype = torch.bfloat16 if name.endswith("_bf16_sm90a") else torch.float16
        for T, K, V, regime in ((1, 64, 64, "mixed"), (17, 56, 40, "near1"), (130, 64, 64, "near0"),
                                (300, 64, 64, "mixed")):
            inputs = rwkv7_inputs(2, T, 3, K, V, dtype, regime, seed=T + K)
            state = torch.randn(2, 3, K, V, device="cuda") * 0.1
            ckpt = checkpoints_of("rwkv7", inputs, state, 0.5, recurrent_forward(64, dtype))
            r, w, k, v, a, b = inputs
            d_o = torch.randn(v.shape, device="cuda").to(dtype)
            d_state = torch.randn(state.shape, device="cuda")
            want = reference.rwkv7_grad(r, k, v, w, a, b, d_o, ckpt, d_state, 0.5, True)
            poison(6 * 2 * T * 3 * max(K, V) + 2 * 3 * K * V)
            got = delta_rule.GRAD.forced(name, r, k, v, w, a, b, d_o, ckpt, d_state, 0.5, True)
            for what, x, y in zip(GRAD_NAMES, got, want):
                err = rel_err(x, y)
                want_dtype = torch.float32 if what == "d_state0" else dtype
                if x.dtype != want_dtype:
                    failures.append(f"{name} {what}: dtype {x.dtype}, not the inputs' (d_state0: float32)")
                if not err <= TOL[dtype] + storage_err(y, want_dtype):
                    failures.append(f"{name} T={T} K={K} V={V} {regime} {what}: rel err {err:.2e}")
    assert not failures, "\n".join(failures[:20])

def test_rwkv7_records_only_where_the_chunked_kind_fills_them():
    """A 16-bit RWKV-7 training forward allocates records for heads of at most
    delta_rule_rwkv7_record_keys keys (the chunked kind's 64) and none past them (no kind fills
    them there); Gated DeltaNet's at both head sizes; fp32 none. Training at K=128 still matches
    float64 autograd (the backward works from the checkpoints)."""
    keys = delta_rule.exported_constant("delta_rule_rwkv7_record_keys")
    assert keys == 64
    rwkv7, gated = delta_rule.variant("rwkv7"), delta_rule.variant("gated_delta")
    for K, want in ((64, True), (56, True), (128, False)):
        q = torch.empty(2, 300, 3, K, dtype=torch.bfloat16, device="cuda")
        assert (delta_rule._records_numel(rwkv7, q, K, 64) > 0) == want, K
        assert delta_rule._records_numel(gated, q, K, 64) > 0, K
        assert delta_rule._records_numel(rwkv7, q.float(), K, 64) == 0, K
    inputs = rwkv7_inputs(1, 70, 2, 128, 128, torch.bfloat16, "mixed", seed=3)
    leaves = [t.detach().requires_grad_() for t in inputs]
    out, _ = attngen.rwkv7(*leaves)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, d_out)
    ref_leaves = [t.detach().double().requires_grad_() for t in inputs]
    ref, _ = reference.rwkv7(*ref_leaves)
    want = torch.autograd.grad(ref, ref_leaves, d_out.double())
    for name, got, exp in zip("rwkvab", grads, want):
        assert rel_err(got, exp) <= TOL[torch.bfloat16], name


def test_rwkv7_saved_records():
    """RWKV-7's records (the delta_rule op's `records`, 16-bit): every chunked_rwkv7 forward
    instance fills them and marks their header, beside the fp32 checkpoints it still writes; the
    states of every fourth chunk are those checkpoints rounded to bf16; the chunked backward
    reads them (garbage past a marked header changes the gradients), ignores them unmarked
    (bit-equal to the backward without records), and on them every gradient is within the 16-bit
    bound of float64 autograd, as without them: one step, several windows with a partial last
    chunk, K and V below the bucket, decays near 0 (the pair matrices term by term); a
    step-by-step forward leaves the header zero."""
    header = delta_rule.exported_constant("delta_rule_records_header_bytes")
    chunk = delta_rule.exported_constant("delta_rule_rwkv7_record_chunk")
    forwards = [n for n in delta_rule.instances() if "_rwkv7_chunked_rwkv7_" in n]
    grads = {r["dtype"]: n for n, r in family_manifest("delta_rule_grad").items() if r["kind"] == "chunked_rwkv7"}
    assert forwards and len(grads) == 2, (forwards, grads)
    failures = []
    for name in forwards:
        dtype = torch.bfloat16 if name.endswith("_bf16_sm90a") else torch.float16
        grad_name = grads["bf16" if dtype == torch.bfloat16 else "fp16"]
        for B, T, H, K, V, regime in ((2, 1, 3, 64, 64, "mixed"), (2, 300, 3, 64, 64, "mixed"),
                                      (1, 130, 2, 56, 40, "near0")):
            inputs = rwkv7_inputs(B, T, H, K, V, dtype, regime, seed=T + K)
            state = torch.randn(B, H, K, V, device="cuda") * 0.1
            ckpt = torch.full(delta_rule.checkpoint_shape(B, T, H, K, V), float("nan"), device="cuda")
            records = torch.full((delta_rule.records_numel(B, T, H, K, V, rwkv7=True),), 7, dtype=torch.uint8,
                                 device="cuda")
            delta_rule.delta_rule_with(name, *op_args("rwkv7", inputs, state, 0.5, checkpoints=ckpt), records)
            where = f"{name} T={T} K={K} V={V} {regime}"
            if records[:4].tolist() != [1, 1, 1, 1]:
                failures.append(f"{where}: header {records[:4].tolist()}, not marked")
                continue
            if not torch.isfinite(ckpt).all():
                failures.append(f"{where}: the fp32 checkpoints were not written beside the records")
            n_chunks = (T + chunk - 1) // chunk
            states = records[header:header + 2 * B * H * n_chunks * K * V].view(torch.bfloat16).view(B, H, n_chunks, K, V)
            every = delta_rule.checkpoint_every() // chunk
            if not torch.equal(states[:, :, ::every], ckpt.to(torch.bfloat16)):
                failures.append(f"{where}: the saved states are not the checkpoints rounded to bf16")
            r, w, k, v, a, b = inputs
            d_o = torch.randn(v.shape, device="cuda").to(dtype)
            d_state = torch.randn(state.shape, device="cuda")
            grad_args = (r, k, v, w, a, b, d_o, ckpt, d_state, 0.5, True)
            want = reference.rwkv7_grad(r, k, v, w, a, b, d_o, ckpt, d_state, 0.5, True)
            poison(6 * B * T * H * max(K, V) + B * H * K * V)
            got = delta_rule.GRAD.forced(grad_name, *grad_args, records)
            own = delta_rule.GRAD.forced(grad_name, *grad_args)
            for what, x, y in zip(GRAD_NAMES, got, want):
                want_dtype = torch.float32 if what == "d_state0" else dtype
                if not rel_err(x, y) <= TOL[dtype] + storage_err(y, want_dtype):
                    failures.append(f"{where} {what}: rel err {rel_err(x, y):.2e} on the records")
            spoiled = records.clone()
            spoiled[header:] = 0x3c  # bf16 0.0115 everywhere: other states
            if torch.equal(delta_rule.GRAD.forced(grad_name, *grad_args, spoiled)[0], got[0]):
                failures.append(f"{where}: marked records not read")
            spoiled[:header] = 0
            if not all(torch.equal(x, y) for x, y in zip(delta_rule.GRAD.forced(grad_name, *grad_args, spoiled), own)):
                failures.append(f"{where}: unmarked records read")
    recurrent = recurrent_forward(64, torch.bfloat16)
    inputs = rwkv7_inputs(1, 70, 2, 64, 64, torch.bfloat16, "mixed", seed=1)
    records = torch.full((delta_rule.records_numel(1, 70, 2, 64, 64, rwkv7=True),), 1, dtype=torch.uint8, device="cuda")
    ckpt = torch.full(delta_rule.checkpoint_shape(1, 70, 2, 64, 64), float("nan"), device="cuda")
    delta_rule.delta_rule_with(recurrent, *op_args("rwkv7", inputs, None, 0.5, checkpoints=ckpt), records)
    assert records[:header].sum().item() == 0, f"{recurrent} left the header {records[:4].tolist()}"
    assert torch.isfinite(ckpt).all(), f"{recurrent} did not write the checkpoints"
    assert not failures, "\n".join(failures[:20])


GATED_GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "d_state0")


def test_every_gated_delta_grad_instance():
    """Each gated_delta_grad instance (the tensor-core backward) forced against the same
    algorithm in float64 on the same forward checkpoints (attngen/gated_delta_chunked_grad.py,
    itself held to float64 autograd by tests/test_gated_delta_chunked_grad.py): K and V at their
    buckets and below, several value blocks of the walk, one step, one chunk, a chunk and a step,
    a partial last chunk, decays near 1 and near 0, the final state's gradient in and the
    initial state's out, outputs poisoned first.
    Every tensor comes from a generator seeded by the case (none from torch's global one, whose
    state depends on the tests run before), and 8 heads: at one step dg and dbeta hold one value
    a (b, h), and their norm-relative error over 6 values (3 heads) moved between 3e-3 and 1.05e-2
    with the data alone (bf16 operands in sums of K x V terms), the kernels' outputs unchanged."""
    from attngen.gated_delta_chunked_grad import gated_delta_chunked_backward
    failures, worst, checked = [], {}, 0
    rows = family_manifest("gated_delta_grad")
    B, H = 2, 8
    for name, row in sorted(rows.items()):
        dtype, kb, vb = DTYPES[row["dtype"]], row["params"]["k"], row["params"]["v"]
        for T, K, V, regime in ((1, kb, vb, "mixed"), (64, kb - 8, vb, "near1"), (65, kb, vb - 24, "near0"),
                                (300, kb, vb, "mixed")):
            inputs = gated_inputs(B, T, H, K, V, dtype, regime, seed=T + K + V)
            gen = torch.Generator(device="cuda").manual_seed(T + K + V + 1)
            state = torch.randn(B, H, K, V, device="cuda", generator=gen) * 0.1
            ckpt = checkpoints_of("gated_delta", inputs, state, 0.5)
            q, k, v, gate, beta = inputs
            d_o = torch.randn(v.shape, device="cuda", generator=gen).to(dtype)
            d_state = torch.randn(state.shape, device="cuda", generator=gen)
            want = gated_delta_chunked_backward(*(x.double() for x in (q, k, v, gate, beta, d_o)), ckpt.double(),
                                                d_state.double(), 0.5, True, delta_rule.checkpoint_every(),
                                                torch.float64)
            poison(6 * B * T * H * max(K, V) + 4 * B * H * K * V * (T // 64 + 2))
            got = delta_rule.GATED_GRAD.forced(name, q, k, v, gate, beta, d_o, ckpt, d_state, 0.5, True)
            for what, x, y in zip(GATED_GRAD_NAMES, got, want):
                err = rel_err(x, y)
                worst[what] = max(worst.get(what, 0.0), err)
                if not err <= TOL[dtype]:
                    failures.append(f"{name} T={T} K={K} V={V} {regime} {what}: rel err {err:.2e}")
            assert got[0].dtype == dtype and got[3].dtype == torch.float32
            checked += 1
    print("worst relative errors:", {k: f"{v:.1e}" for k, v in worst.items()})
    assert checked == 4 * len(rows) >= 4 * 8 and not failures, "\n".join(failures[:20])


def test_gated_delta_saved_records():
    """The chunk records and states a training forward saves (the delta_rule op's `records`) and
    the backward reads in place of solving each chunk's system again and of the fp32
    checkpoints: every chunked Gated DeltaNet forward instance fills them and marks their
    header, the saved states are the fp32 checkpoints of the same run rounded to the dtype
    (which it then leaves unwritten), and the backward on them gives the gradients it gives on
    its own records and the fp32 checkpoints (dg within the 16-bit bound: its chunk-end term sums
    S * G from the rounded S; the others within 1e-5); they are read (garbage past a marked
    header changes the gradients) and ignored where unmarked (garbage past a zero header
    changes nothing); a step-by-step forward leaves the header zero and writes the checkpoints;
    checkpoints_in_fp32 picks by the header."""
    header = delta_rule.exported_constant("delta_rule_records_header_bytes")
    forwards = [n for n in delta_rule.instances() if "_gated_delta_chunked" in n]
    assert forwards, "no chunked Gated DeltaNet forward instance"
    failures = []
    for name in forwards:
        dtype = torch.bfloat16 if name.endswith("_bf16_sm90a") else torch.float16
        kb = int(name.split("_k")[1].split("_")[0])
        B, T, H, K, V = 2, 130, 3, kb - 8, 96
        inputs = gated_inputs(B, T, H, K, V, dtype, "mixed", seed=K)
        state = torch.randn(B, H, K, V, device="cuda") * 0.1
        plain = torch.empty(delta_rule.checkpoint_shape(B, T, H, K, V), device="cuda")
        delta_rule.delta_rule_with(name, *op_args("gated_delta", inputs, state, 0.5, checkpoints=plain))
        ckpt = torch.full(plain.shape, float("nan"), device="cuda")
        records = torch.full((delta_rule.records_numel(B, T, H, K, V),), 7, dtype=torch.uint8, device="cuda")
        delta_rule.delta_rule_with(name, *op_args("gated_delta", inputs, state, 0.5, checkpoints=ckpt), records)
        if records[:4].tolist() != [1, 1, 1, 1]:
            failures.append(f"{name}: header {records[:4].tolist()}, not marked")
            continue
        if not torch.equal(delta_rule.saved_states(records, dtype, tuple(plain.shape)), plain.to(dtype)):
            failures.append(f"{name}: the saved states are not the checkpoints rounded to {dtype}")
        if not torch.isnan(ckpt).all():
            failures.append(f"{name}: wrote the fp32 checkpoints beside the saved states")
        if not torch.equal(delta_rule.checkpoints_in_fp32(records, ckpt, dtype), plain.to(dtype).float()):
            failures.append(f"{name}: checkpoints_in_fp32 did not take the saved states")
        q, k, v, gate, beta = inputs
        d_o = torch.randn(v.shape, device="cuda").to(dtype)
        grad_args = (q, k, v, gate, beta, d_o, plain, torch.randn(state.shape, device="cuda"), 0.5, True)
        own = delta_rule.GATED_GRAD(*grad_args)
        saved = delta_rule.GATED_GRAD(*grad_args, records)
        for what, x, y in zip(GATED_GRAD_NAMES, saved, own):
            bound = TOL[dtype] if what == "dg" else 1e-5
            if not rel_err(x, y) <= bound:
                failures.append(f"{name} {what}: rel err {rel_err(x, y):.2e} against its own records and the checkpoints")
        spoiled = records.clone()
        spoiled[header:] = 0x3c  # 16-bit 1.0-ish everywhere: a different system
        if torch.equal(delta_rule.GATED_GRAD(*grad_args, spoiled)[0], own[0]):
            failures.append(f"{name}: marked records not read")
        spoiled[:header] = 0
        if not all(torch.equal(x, y) for x, y in zip(delta_rule.GATED_GRAD(*grad_args, spoiled), own)):
            failures.append(f"{name}: unmarked records read")
        if not torch.equal(delta_rule.checkpoints_in_fp32(spoiled, plain, dtype), plain):
            failures.append(f"{name}: checkpoints_in_fp32 took unmarked states")
    recurrent = next(n for n in delta_rule.instances() if "_gated_delta_recurrent_k64_" in n and n.endswith("_bf16_sm90a"))
    inputs = gated_inputs(1, 70, 2, 64, 64, torch.bfloat16, "mixed", seed=1)
    records = torch.full((delta_rule.records_numel(1, 70, 2, 64, 64),), 1, dtype=torch.uint8, device="cuda")
    ckpt = torch.full(delta_rule.checkpoint_shape(1, 70, 2, 64, 64), float("nan"), device="cuda")
    delta_rule.delta_rule_with(recurrent, *op_args("gated_delta", inputs, None, 0.5, checkpoints=ckpt), records)
    assert records[:header].sum().item() == 0, f"{recurrent} left the header {records[:4].tolist()}"
    assert torch.isfinite(ckpt).all(), f"{recurrent} did not write the checkpoints"
    assert not failures, "\n".join(failures[:20])


def loss_grads(fn, inputs, state, d_o, d_state):
    """Gradients of (o * d_o).sum() + (final * d_state).sum() in every input and the state."""
    leaves = [x.detach().clone().requires_grad_() for x in (*inputs, state)]
    o, final = fn(*leaves[:-1], state=leaves[-1])
    torch.autograd.backward([o, final], [d_o.to(o.dtype), d_state])
    return [x.grad for x in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", ["rwkv7", "gated_delta"])
@pytest.mark.parametrize("T,K,V", [(1, 64, 64), (7, 64, 64), (63, 128, 64), (65, 64, 128), (200, 128, 128)])
def test_backward_through_the_op(dtype, variant, T, K, V):
    """attngen.rwkv7 / gated_delta_rule differentiated by torch against float64 autograd of the
    reference on the same inputs: every input's gradient and the initial state's, with the
    final state in the loss; strided inputs; gradients in the inputs' dtypes."""
    check_backward(dtype, variant, T, K, V)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,K,V", [(1, 64, 64), (64, 128, 64), (65, 64, 128), (200, 128, 128)])
def test_gated_delta_chunked_backward_through_the_op(dtype, T, K, V, monkeypatch):
    """The same with Gated DeltaNet's backward by chunks in torch at every length (it runs where
    delta_rule.use_chunked_backward says, and the tensor-core backward does not run: fp32, head
    sizes no instance covers; here forced for 16-bit inputs too): one step, a whole chunk, a
    chunk and a step."""
    monkeypatch.setattr(delta_rule, "use_tensor_core_backward", lambda args: False)
    monkeypatch.setattr(delta_rule, "use_chunked_backward", lambda B, T, H: True)
    check_backward(dtype, "gated_delta", T, K, V)


def check_backward(dtype, variant, T, K, V):
    B, H = 2, 3
    make, fn, ref = ((rwkv7_inputs, attngen.rwkv7, reference.rwkv7) if variant == "rwkv7" else
                     (gated_inputs, attngen.gated_delta_rule, reference.gated_delta_rule))
    inputs = [strided(x) if x.dim() == 4 else x for x in make(B, T, H, K, V, dtype, seed=T + K)]
    # Seeded as the inputs are: drawn from the global generator, these depended on which tests
    # ran before (the bf16 Gated DeltaNet case at T = 1 passed in one run and left dbeta at
    # 1.14e-2 in the next).
    g = torch.Generator(device="cuda").manual_seed(1000 + T + K + V)
    state = torch.randn(B, H, K, V, device="cuda", generator=g) * 0.1
    d_o = torch.randn(B, T, H, V, device="cuda", generator=g).to(dtype)
    d_state = torch.randn(B, H, K, V, device="cuda", generator=g)
    scale = 0.5
    got = loss_grads(lambda *x, state: fn(*x, state=state, scale=scale), inputs, state, d_o, d_state)
    want = loss_grads(lambda *x, state: ref(*x, state=state, scale=scale), [x.double() for x in inputs],
                      state.double(), d_o.double(), d_state.double())
    names = ("r", "w", "k", "v", "a", "b") if variant == "rwkv7" else ("q", "k", "v", "g", "beta")
    # Gated DeltaNet in 16 bits runs its backward on tensor cores (gated_delta_grad), as RWKV-7
    # does within 64 keys and columns (delta_rule_grad's chunked_rwkv7): every gradient, the
    # fp32 tensors' (g, beta, the state) included, comes from 16-bit products, so all are held to
    # the 16-bit tolerance. Elsewhere an fp32 leaf's gradient is fp32 work.
    tensor_cores = dtype != torch.float32 and (variant == "gated_delta" or K <= 64 and V <= 64)
    for name, x, y, leaf in zip((*names, "state"), got, want, (*inputs, state)):
        assert x.dtype == leaf.dtype and x.shape == leaf.shape, name
        tol = TOL[dtype] if tensor_cores else max(TOL[leaf.dtype], 1e-5) if leaf.dtype != torch.float32 else 2e-5
        assert rel_err(x, y) <= tol, f"d{name}: rel err {rel_err(x, y):.2e}"


@pytest.mark.parametrize("variant,K", [("rwkv7", 64), ("gated_delta", 128)])
def test_long_sequence_backward_bf16(variant, K, monkeypatch):
    """Over 4097 steps (65 checkpoint windows, the last one step long), bf16: RWKV-7's
    recurrent backward, Gated DeltaNet's tensor-core one (65 chunks, the last of one step)."""
    make, fn, ref, names = ((rwkv7_inputs, attngen.rwkv7, reference.rwkv7, ("r", "w", "k", "v", "a", "b"))
                            if variant == "rwkv7" else
                            (gated_inputs, attngen.gated_delta_rule, reference.gated_delta_rule,
                             ("q", "k", "v", "g", "beta")))
    monkeypatch.setattr(delta_rule, "use_chunked_backward", lambda B, T, H: True)
    inputs = make(1, 4097, 2, K, 64, torch.bfloat16, "near1", seed=9)
    state = torch.randn(1, 2, K, 64, device="cuda") * 0.1
    d_o = torch.randn(1, 4097, 2, 64, device="cuda").to(torch.bfloat16)
    d_state = torch.randn(1, 2, K, 64, device="cuda")
    got = loss_grads(fn, inputs, state, d_o, d_state)
    want = loss_grads(ref, [x.double() for x in inputs], state.double(), d_o.double(), d_state.double())
    for name, x, y in zip((*names, "state"), got, want):
        assert rel_err(x, y) <= 1e-2, f"d{name}: rel err {rel_err(x, y):.2e}"


def test_chunked_training_hands_the_state_and_its_gradient_over():
    """Two calls with the state handed over, differentiated through the handover, give the
    gradients of one call."""
    q, k, v, gate, beta = (x.requires_grad_() for x in gated_inputs(1, 150, 2, 64, 64, torch.float32, seed=4))
    o, _ = attngen.gated_delta_rule(q, k, v, gate, beta)
    whole = torch.autograd.grad(o.square().sum(), (q, k, v, gate, beta))
    o1, s1 = attngen.gated_delta_rule(q[:, :70], k[:, :70], v[:, :70], gate[:, :70], beta[:, :70])
    o2, _ = attngen.gated_delta_rule(q[:, 70:], k[:, 70:], v[:, 70:], gate[:, 70:], beta[:, 70:], state=s1)
    split = torch.autograd.grad(o1.square().sum() + o2.square().sum(), (q, k, v, gate, beta))
    for name, x, y in zip(("q", "k", "v", "g", "beta"), split, whole):
        assert rel_err(x, y) <= 1e-5, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant,lengths,K,by_chunks", [
    ("rwkv7", [0, 1, 7, 65, 0, 130, 3], 64, False),
    ("gated_delta", [0, 1, 7, 65, 0, 130, 3], 128, False),
    ("gated_delta", [300, 0, 1, 577, 64], 64, True),   # bf16: the chunked forward kind and backward
    ("rwkv7", [65, 65, 65], 64, False),                # equal lengths: the batch as a view, no padding
])
def test_packed_sequences(dtype, variant, lengths, K, by_chunks, monkeypatch):
    """cu_seqlens: sequences of 0, 1 and odd lengths packed along T of a batch of one, each from
    its own initial state, against the float64 reference run on each alone: the output, the
    final states and the gradients of every input and initial state."""
    make, fn, ref = ((rwkv7_inputs, attngen.rwkv7, reference.rwkv7) if variant == "rwkv7" else
                     (gated_inputs, attngen.gated_delta_rule, reference.gated_delta_rule))
    monkeypatch.setattr(delta_rule, "use_chunked_backward", lambda B, T, H: by_chunks)
    N, H, V, T = len(lengths), 2, 64, sum(lengths)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    inputs = make(1, T, H, K, V, dtype, seed=T)
    state = torch.randn(N, H, K, V, device="cuda") * 0.1
    d_o, d_state = torch.randn(1, T, H, V, device="cuda").to(dtype), torch.randn(N, H, K, V, device="cuda")
    poison(T * H * V + N * H * K * V)
    got = loss_grads(lambda *x, state: fn(*x, state=state, scale=0.5, cu_seqlens=cu), inputs, state, d_o, d_state)
    want = loss_grads(lambda *x, state: reference.delta_rule_packed(ref, x, cu, state=state, scale=0.5),
                      [x.double() for x in inputs], state.double(), d_o.double(), d_state.double())
    with torch.no_grad():
        o, final = fn(*inputs, state=state, scale=0.5, cu_seqlens=cu)
        ref_o, ref_final = reference.delta_rule_packed(ref, inputs, cu, state=state, scale=0.5)
    tol = TOL[dtype]
    assert o.shape == (1, T, H, V) and final.shape == (N, H, K, V)
    assert rel_err(o, ref_o) <= tol and rel_err(final, ref_final) <= tol
    if 0 in lengths:
        empty = lengths.index(0)
        assert rel_err(final[empty], state[empty]) <= 1e-6, "an empty sequence's final state is its initial state"
    # Every gradient, g's and beta's (fp32 leaves) too, is bounded by the call's dtype: past 256
    # steps the 16-bit forward is the chunked kind, whose 16-bit records set the checkpoints'
    # accuracy (dg 9.0e-4 on the H200 at b676602), as in test_long_sequence_backward_bf16.
    limit = 2e-5 if dtype == torch.float32 else TOL[dtype]
    names = ("r", "w", "k", "v", "a", "b") if variant == "rwkv7" else ("q", "k", "v", "g", "beta")
    for name, x, y, leaf in zip((*names, "state"), got, want, (*inputs, state)):
        assert x.dtype == leaf.dtype and x.shape == leaf.shape, name
        assert rel_err(x, y) <= limit, f"d{name}: rel err {rel_err(x, y):.2e}"


def kda_inputs(B, T, H, HV, K, V, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, H, K, device="cuda", generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=g), dim=-1)
    v = torch.randn(B, T, HV, V, device="cuda", generator=g)
    gate = log_decays((B, T, HV, K), "mixed", g)
    beta = torch.rand(B, T, HV, device="cuda", generator=g)
    return [q.to(dtype), k.to(dtype), v.to(dtype), gate, beta]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,K,HV", [(1, 64, 2), (65, 64, 4), (300, 128, 2)])
def test_kda_forward_and_backward(dtype, T, K, HV):
    """attngen.kda (RWKV-7's kernels on KDA's tied vectors) against the float64 KDA recurrence:
    output, final state and every gradient, with grouped values (HV value heads over H = 1 or 2
    q, k heads), state in and out."""
    H = 2 if HV == 4 else 1
    inputs = kda_inputs(2, T, H, HV, K, 64, dtype, seed=T)
    state = torch.randn(2, HV, K, 64, device="cuda") * 0.1
    d_o, d_state = torch.randn(2, T, HV, 64, device="cuda").to(dtype), torch.randn(2, HV, K, 64, device="cuda")
    poison(2 * T * HV * 64 + 2 * HV * K * 64)
    got = loss_grads(lambda *x, state: attngen.kda(*x, state=state, scale=0.5), inputs, state, d_o, d_state)
    want = loss_grads(lambda *x, state: reference.kda(*x, state=state, scale=0.5), [x.double() for x in inputs],
                      state.double(), d_o.double(), d_state.double())
    with torch.no_grad():
        o, final = attngen.kda(*inputs, state=state, scale=0.5)
        ref_o, ref_final = reference.kda(*inputs, state=state, scale=0.5)
    tol = TOL[dtype]
    assert rel_err(o, ref_o) <= tol and rel_err(final, ref_final) <= tol
    limit = 2e-5 if dtype == torch.float32 else TOL[dtype]
    for name, x, y in zip(("q", "k", "v", "g", "beta", "state"), got, want):
        assert rel_err(x, y) <= limit, f"d{name}: rel err {rel_err(x, y):.2e}"


def test_kda_matches_flash_linear_attention():
    """Beside fla's chunk_kda on the same bf16 inputs (where fla is importable)."""
    fla_kda = pytest.importorskip("fla.ops.kda")
    q, k, v, gate, beta = kda_inputs(2, 300, 2, 4, 128, 128, torch.bfloat16, seed=5)
    state = torch.randn(2, 4, 128, 128, device="cuda") * 0.1
    o, final = attngen.kda(q, k, v, gate, beta, state=state)
    o_fla, final_fla = fla_kda.chunk_kda(q, k, v, gate, beta.to(q.dtype), initial_state=state, output_final_state=True)
    assert rel_err(o, o_fla.float()) <= 2e-2 and rel_err(final, final_fla.float()) <= 2e-2


def test_backward_inputs_the_grad_op_refuses_are_named():
    r, w, k, v, a, b = rwkv7_inputs(1, 100, 2, 64, 64, torch.bfloat16)
    ckpt = torch.zeros(delta_rule.checkpoint_shape(1, 100, 2, 64, 64), device="cuda")
    swapped = torch.zeros(1, 2, 2, 64, 64, device="cuda").transpose(1, 2)  # the right shape, not contiguous
    with pytest.raises(ValueError, match=r"delta_rule_grad: checkpoints must be a contiguous float32 "
                                         r"\[B, H, ceil\(T / 64\), K, V\] = \[1, 2, 2, 64, 64\]"):
        delta_rule.GRAD(r, k, v, w, a, b, v, swapped, None, 1.0, False)
    with pytest.raises(ValueError, match=r"delta_rule_grad: checkpoints has shape \[1, 2, 2, 64, 32\] but v has "
                                         r"\[1, 100, 2, 64\]; V must agree"):
        delta_rule.GRAD(r, k, v, w, a, b, v, ckpt[:, :, :, :, :32], None, 1.0, False)
    with pytest.raises(ValueError, match=r"delta_rule_grad: d_o has dtype Float but q has BFloat16"):
        delta_rule.GRAD(r, k, v, w, a, b, v.float(), ckpt, None, 1.0, False)


def test_torch_compile_fullgraph():
    q, k, v, gate, beta = gated_inputs(2, 33, 3, 64, 64, torch.bfloat16)
    fn = torch.compile(lambda *x: attngen.gated_delta_rule(*x)[0] * 2, fullgraph=True)
    torch.testing.assert_close(fn(q, k, v, gate, beta), attngen.gated_delta_rule(q, k, v, gate, beta)[0] * 2)


def assert_compiled_step_matches_eager(op, inputs, loss_of=lambda o: o.square().sum()):
    """A loss over op's output and final state compiled in one graph (its backward through
    AOTAutograd) gives eager's gradients in every input."""
    def loss(*x):
        o, s = op(*x)
        return loss_of(o) + s.sum()
    compiled = torch.compile(loss, fullgraph=True)
    grads = []
    for fn in (compiled, loss):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        fn(*leaves).backward()
        grads.append([x.grad for x in leaves])
    for name, x, y in zip(range(len(inputs)), *grads):
        assert rel_err(x, y) <= 1e-6, name


@pytest.mark.parametrize("variant", ["rwkv7", "gated_delta"])
def test_torch_compile_fullgraph_training_step(variant, monkeypatch):
    """Forward and loss compiled in one graph give eager's gradients (for fp32 Gated DeltaNet the
    chunked backward's torch products)."""
    make, op = (rwkv7_inputs, attngen.rwkv7) if variant == "rwkv7" else (gated_inputs, attngen.gated_delta_rule)
    monkeypatch.setattr(delta_rule, "use_chunked_backward", lambda B, T, H: True)  # Gated DeltaNet's: 2 chunks
    assert_compiled_step_matches_eager(op, make(2, 70, 3, 64, 64, torch.float32, seed=6))


def test_torch_compile_fullgraph_training_step_tensor_cores():
    """The same for 16-bit Gated DeltaNet: the backward AOTAutograd traces (with fake tensors:
    use_tensor_core_backward decides from the head sizes there) runs the tensor-core
    gated_delta_grad op."""
    assert_compiled_step_matches_eager(attngen.gated_delta_rule, gated_inputs(2, 130, 3, 128, 64, torch.bfloat16, seed=6),
                                       lambda o: o.float().square().sum())
