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


def op_args(variant, inputs, state, scale, return_state=True):
    """The op's arguments (specs/delta_rule.yaml schema) for one variant's inputs."""
    if variant == "rwkv7":
        r, w, k, v, a, b = inputs
        return (r, k, v, w, a, b, state, delta_rule.variant("rwkv7"), scale, return_state)
    q, k, v, gate, beta = inputs
    return (q, k, v, gate, beta, None, state, delta_rule.variant("gated_delta"), scale, return_state)


def expected(variant, inputs, state, scale):
    if variant == "rwkv7":
        return reference.rwkv7(*inputs, state=state, scale=scale)
    return reference.gated_delta_rule(*inputs, state=state, scale=scale)


def test_every_instance():
    """Each instance forced on shapes it covers: K at its bucket and below (zero-filled keys),
    V not a multiple of the CTA's columns, T across chunk boundaries, state in and out."""
    failures, checked = [], 0
    for name, row in sorted(family_manifest("delta_rule").items()):
        dtype, kb, variant = DTYPES[row["dtype"]], row["params"]["k"], row["variant"]
        for T, K, V, regime in ((1, kb, kb, "mixed"), (65, kb - 4, 33, "near1"), (130, kb, 2 * kb + 8, "near0")):
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
    assert checked == 3 * len(family_manifest("delta_rule")) >= 3 * 36 and not failures, "\n".join(failures[:20])


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
    small = rwkv7_inputs(1, 16, 4, 64, 64, torch.bfloat16)
    large = rwkv7_inputs(8, 16, 64, 64, 64, torch.bfloat16)
    pick = lambda x: delta_rule.OP.select(*op_args("rwkv7", x, None, 1.0))  # noqa: E731
    assert "_narrow_k64_" in pick(small) and "_recurrent_k64_" in pick(large)


def test_empty_sequences_return_the_initial_state():
    inputs = rwkv7_inputs(2, 0, 3, 64, 64, torch.bfloat16)
    state = torch.randn(2, 3, 64, 64, device="cuda")
    o, s = attngen.rwkv7(*inputs, state=state)
    assert o.shape == (2, 0, 3, 64) and torch.equal(s, state)


def test_bad_inputs_name_the_argument():
    r, w, k, v, a, b = rwkv7_inputs(1, 8, 2, 64, 64, torch.bfloat16)
    with pytest.raises(ValueError, match=r"delta_rule: b is required by rwkv7"):
        delta_rule.OP(r, k, v, w, a, None, None, delta_rule.variant("rwkv7"), 1.0, True)
    with pytest.raises(ValueError, match=r"variant must be in \[0, 2\) \(0: rwkv7, 1: gated_delta\), got 5"):
        delta_rule.OP(r, k, v, w, a, b, None, 5, 1.0, True)
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


def test_a_gradient_request_raises():
    r, w, k, v, a, b = rwkv7_inputs(1, 8, 2, 64, 64, torch.float32)
    r.requires_grad_()
    o, _ = attngen.rwkv7(r, w, k, v, a, b)
    with pytest.raises(NotImplementedError, match="backward pass is not implemented"):
        o.sum().backward()


def test_torch_compile_fullgraph():
    q, k, v, gate, beta = gated_inputs(2, 33, 3, 64, 64, torch.bfloat16)
    fn = torch.compile(lambda *x: attngen.gated_delta_rule(*x)[0] * 2, fullgraph=True)
    torch.testing.assert_close(fn(q, k, v, gate, beta), attngen.gated_delta_rule(q, k, v, gate, beta)[0] * 2)
