"""The fused decode path of experts_forward (ragged_dot/fused.py): one kernel for a step of at most
`fused.FUSED_TOKENS` tokens. Numerics against float64, where it applies, its gradient, a token's
NaN, the TPU interpreter (races, out-of-bounds copies) and libtpu's compile on every generation."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
import sampling
import tpu_compile
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
from jax.experimental.pallas import tpu as pltpu

from ragged_dot import fused, ops
from ragged_dot._shared.generations import GENERATIONS

E, H, I, K = 8, 256, 256, 4  # two chunks of the intermediate dim per expert


def pallas_calls(fn, *args):
    names = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                names.append(eqn.params["name"])
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return names


def inputs(tokens, dtype, seed=0, experts=E, hidden=H, inter=I, top_k=K):
    """Distinct experts per token (one slot per token on another shard: id E), distinct weights."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    ids[:, -1] = experts
    normal = lambda *shape, s=1.0: jnp.asarray(rng.standard_normal(shape) * s, dtype)
    return (normal(tokens, hidden), jnp.asarray(ids, jnp.int32),
            jnp.asarray(rng.uniform(0.1, 1, (tokens, top_k)), dtype),
            normal(experts, 2 * inter, hidden, s=hidden**-0.5), normal(experts, hidden, inter, s=inter**-0.5))


def reference(hidden, ids, weights, up, down):
    """float64, token by token: sum over the token's slots on this shard of w * down (silu(gate) * up)."""
    x, w_up, w_down, w = (np.asarray(a, np.float64) for a in (hidden, up, down, weights))
    ids = np.asarray(ids)
    out = np.zeros(x.shape)
    for t in range(x.shape[0]):
        for slot, e in enumerate(ids[t]):
            if e < w_up.shape[0]:
                gate, upv = np.split(w_up[e] @ x[t], 2)
                out[t] += w[t, slot] * (w_down[e] @ (gate / (1 + np.exp(-gate)) * upv))
    return out


def forward(*args, **options):
    return ops.experts_forward(*args, generation="v6e", interpret=True, **options)


@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_fused_decode_matches_float64(tokens, dtype):
    """fp32: the products at full precision, summed in fp32 (2^-18 of the largest output). bf16: the
    gate's and up's products are bf16 inputs summed in fp32, the activations rounded to bf16 once,
    each expert's output rounded once, the output once (2^-6 of the largest, as the grouped path's
    test). A wrong expert, chunk or weight is off by the value itself."""
    args = inputs(tokens, dtype)
    assert pallas_calls(forward, *args) == ["fused_experts_tpu"]
    got = np.asarray(forward(*args), np.float32)
    want = reference(*args)
    bound = 2**-18 if dtype == jnp.float32 else 2**-6
    assert np.abs(got - want).max() <= bound * np.abs(want).max()


@pytest.mark.parametrize("change,fused_runs", [
    (lambda a, o: (a, o), True),
    (lambda a, o: ((*inputs(3, jnp.bfloat16)[:3], *a[3:]), o), False),  # past FUSED_TOKENS
    (lambda a, o: ((*a, jnp.ones((E, 2 * I)), jnp.ones((E, H))), o), False),  # biases
    (lambda a, o: (a, {**o, "interleaved": True}), False),
    (lambda a, o: (inputs(1, jnp.bfloat16, inter=192), o), False),  # an intermediate dim not a multiple of 128
    (lambda a, o: (a, {**o, "activation": "gelu_tanh"}), True),
    (lambda a, o: ((*a[:3], jnp.zeros(a[3].shape, jnp.float8_e4m3fn), jnp.zeros(a[4].shape, jnp.float8_e4m3fn)),
                   {**o, "up_scale": jnp.ones((E, 2 * I // 128, H // 128)), "down_scale": jnp.ones((E, H // 128, I // 128))}),
     False),  # fp8 with a scale per 128 x 128 block
], ids=["decode", "three_tokens", "biases", "interleaved", "unaligned", "gelu", "fp8_blocks"])
def test_fused_decode_applies_where_it_is_one_kernel(change, fused_runs):
    args, options = change(inputs(1, jnp.bfloat16), {})
    names = pallas_calls(lambda *a: forward(*a, **options), *args)
    assert (names == ["fused_experts_tpu"]) == fused_runs, names


def test_fused_decode_gradients_are_the_grouped_paths(monkeypatch):
    """Its gradient is the grouped kernels' backward of the same step (fp32: equal to rounding)."""
    args = inputs(2, jnp.float32, seed=1)
    cot = jnp.asarray(np.random.default_rng(2).standard_normal(args[0].shape), jnp.float32)
    out, vjp = jax.vjp(forward, *args)
    monkeypatch.setattr(fused, "FUSED_TOKENS", 0)
    grouped = lambda *a: forward(*a)  # a new function: jax traces it afresh
    assert "fused_experts_tpu" not in pallas_calls(grouped, *args)
    want_out, want_vjp = jax.vjp(grouped, *args)
    np.testing.assert_allclose(out, want_out, rtol=0, atol=2**-18 * np.abs(want_out).max())
    for name, got, want in zip(("hidden", "ids", "weights", "gate_up", "down"), vjp(cot), want_vjp(cot)):
        if name != "ids":
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * max(1.0, np.abs(want).max()), err_msg=name)


def test_a_tokens_or_experts_nan_stays_its_own():
    """A token whose hidden state holds NaN (or inf) is NaN whole, the other token as without it; an
    expert whose weights hold NaN spoils the tokens routed to it only (every token's rows meet every
    live expert's weights in the kernel: those of tokens not routed there are dropped, not weighed
    by zero)."""
    hidden, ids, weights, up, down = args = inputs(2, jnp.bfloat16, seed=3)
    clean = np.asarray(forward(*args), np.float32)
    for bad in (jnp.nan, jnp.inf):
        spoilt = np.asarray(forward(hidden.at[0, 5].set(bad), *args[1:]), np.float32)
        np.testing.assert_array_equal(spoilt[1], clean[1])
        assert np.isnan(spoilt[0]).all()
    token_1s = sorted(set(np.asarray(ids[1, :-1]).tolist()) - set(np.asarray(ids[0]).tolist()))[0]
    spoilt = np.asarray(forward(hidden, ids, weights, up, down.at[token_1s, 3, 0].set(jnp.nan)), np.float32)
    np.testing.assert_array_equal(spoilt[0], clean[0])
    assert np.isnan(spoilt[1, 3])


def test_each_routed_experts_weights_are_copied_once():
    """The kernel's copies, counted by running its control (bench/kernel_profile.py): each routed
    expert's gate, up and down weights once, no other bytes, whatever the unused live slots hold."""
    import kernel_profile

    hidden, ids, weights, up, down = inputs(2, jnp.bfloat16, seed=5)
    ids = ids.at[1, 0].set(ids[0, 0])  # one expert shared: a live slot unused
    (p,) = kernel_profile.profile(lambda *a: ops.experts_forward(*a, generation="v6e", interpret=False),
                                  hidden, ids, weights, up, down, name_contains="fused_experts_tpu")
    routed = len(set(np.asarray(ids).reshape(-1).tolist()) - {E})
    fetched = sum(int(p.moved[:, j].sum()) for j, n in enumerate(p.nodes) if n.kind == "dma" and n.reads_hbm)
    assert fetched == routed * 3 * I * H * 2


def quantized(weights):
    """int8 weights [E, N, K] with a float32 scale per expert and output channel [E, N]."""
    w = np.asarray(weights, np.float32)
    scale = np.abs(w).max(axis=2) / 127
    return jnp.asarray(np.round(w / scale[..., None]), jnp.int8), jnp.asarray(scale, jnp.float32)


# Sampled (tests/sampling.py): bf16 tokens at one token (fp32 tokens with int8 experts run in
# test_transformers_models.py's decode through get_kernel).
@pytest.mark.parametrize("dtype,tokens", sampling.sample(
    [(jnp.bfloat16, 1), (jnp.bfloat16, 2), (jnp.float32, 1), (jnp.float32, 2)],
    {(jnp.bfloat16, 1)}), ids=lambda c: str(c) if isinstance(c, int) else jnp.dtype(c).name)
def test_int8_experts_match_float64(dtype, tokens):
    """int8 experts with a scale per output channel (what `quantize_experts` holds), bf16 or fp32
    tokens: against float64 on the dequantized weights, within the bounds of the test above (the
    int8 codes are exact in the product; the scales multiply its fp32 sums). A scale taken from the
    wrong chunk, expert or projection is off by the ratio of two scales."""
    hidden, ids, weights, up, down = inputs(tokens, dtype, seed=6)
    (up_q, up_scale), (down_q, down_scale) = quantized(up), quantized(down)
    args = (hidden, ids, weights, up_q, down_q)
    run = lambda *a: forward(*a, up_scale=up_scale, down_scale=down_scale)
    assert pallas_calls(run, *args) == ["fused_experts_tpu"]
    dequantized = lambda q, scale: np.asarray(q, np.float64) * np.asarray(scale, np.float64)[..., None]
    want = reference(hidden, ids, weights, dequantized(up_q, up_scale), dequantized(down_q, down_scale))
    got = np.asarray(run(*args), np.float32)
    assert np.abs(got - want).max() <= (2**-18 if dtype == jnp.float32 else 2**-6) * np.abs(want).max()
    # The gradient of the tokens and their routing weights (the experts frozen): the grouped path's.
    cot = jnp.asarray(np.random.default_rng(7).standard_normal(hidden.shape), dtype)
    grads = jax.vjp(lambda x, w: run(x, ids, w, up_q, down_q), hidden, weights)[1](cot)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused, "FUSED_TOKENS", 0)
        want_grads = jax.vjp(lambda x, w: forward(x, ids, w, up_q, down_q, up_scale=up_scale,
                                                  down_scale=down_scale), hidden, weights)[1](cot)
    for got, want in zip(grads, want_grads):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_no_race_no_out_of_bounds():
    """The TPU interpreter: races between the ring's copies and the steps reading them, copies out of
    bounds, and unwritten VMEM read (as NaN) would show; a step with a repeated expert (two tokens
    sharing one) leaves the last live slots unused."""
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    try:
        hidden, ids, weights, up, down = inputs(2, jnp.bfloat16, seed=4)
        ids = ids.at[1, 0].set(ids[0, 0])  # shared by both tokens
        got = ops.experts_forward(hidden, ids, weights, up, down, generation="v6e", interpret=params)
        assert tpu_interpreter.races.races_found is False
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    want = reference(hidden, ids, weights, up, down)
    assert np.abs(np.asarray(got, np.float32) - want).max() <= 2**-6 * np.abs(want).max()
    try:  # every slot on another shard: no expert walked, the output zero
        nowhere = ops.experts_forward(hidden, jnp.full_like(ids, E), weights, up, down, generation="v6e",
                                      interpret=params)
        assert tpu_interpreter.races.races_found is False
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    np.testing.assert_array_equal(np.asarray(nowhere, np.float32), 0)


# Qwen3-30B-A3B's and DeepSeek-V3's experts at one token: the VMEM of the largest hidden dim
# (DeepSeek-V3's 21 GB of experts a layer do not fit v5e's HBM).
# (int8 on tpu7x and v6e: the chips its decode rows are benched on.)
MODELS = {"Qwen3-30B-A3B": (128, 2048, 768, 8), "DeepSeek-V3": (256, 7168, 2048, 8)}
CASES = [(m, g, d) for m in MODELS for g in sorted(GENERATIONS) for d in ("bfloat16", "int8")
         if (m, g) != ("DeepSeek-V3", "v5e") and (d == "bfloat16" or g in ("v6e", "tpu7x"))]


@pytest.mark.parametrize("model,generation,dtype", [pytest.param(*c, id="-".join(c)) for c in (
    CASES if sampling.ALL_COMPILES else [("Qwen3-30B-A3B", "tpu7x", "bfloat16"), ("Qwen3-30B-A3B", "v6e", "int8")])])
def test_fused_decode_compiles_and_fits_vmem(model, generation, dtype):
    experts, hidden, inter, top_k = MODELS[model]
    specs = [((1, hidden), jnp.bfloat16), ((1, top_k), jnp.int32), ((1, top_k), jnp.bfloat16),
             ((experts, 2 * inter, hidden), dtype), ((experts, hidden, inter), dtype)]
    scales = [((experts, 2 * inter), jnp.float32), ((experts, hidden), jnp.float32)] if dtype == "int8" else []
    forward = lambda x, ids, w, up, down, *s: ops.experts_forward(
        x, ids, w, up, down, **dict(zip(("up_scale", "down_scale"), s)), generation=generation, interpret=False)
    report = tpu_compile.compile_for(forward, specs + scales, generation, "fused_experts_tpu")
    (used,) = [r.vmem_bytes for r in report.kernels.values()]
    itemsize = jnp.dtype(dtype).itemsize
    ring = fused.BLOCKS.depth * 3 * fused.BLOCKS.chunk * hidden * itemsize  # the gate, up and down slots
    need = fused.vmem_need(1, hidden, dtype, fused.BLOCKS, bool(scales))  # what the kernel asks its limit for
    assert ring <= used <= need <= GENERATIONS[generation].vmem_bytes, (ring, used, need)


@pytest.mark.parametrize("tokens", sampling.sample([1, 2], {1}))
def test_fused_decode_is_modeled_faster_than_the_grouped_path(tokens, monkeypatch):
    """Why FUSED_TOKENS: Qwen3-30B-A3B's experts layer on tpu7x at one and two tokens (uniform random
    routing), each program compiled by libtpu and rated by the schedule model: one kernel beats the
    grouped path's two kernels and the ops around them. MODELED."""
    import harness

    experts, hidden, inter, top_k = MODELS["Qwen3-30B-A3B"]
    ids = np.argsort(np.random.default_rng(0).random((tokens, experts)), axis=1)[:, :top_k].astype(np.int32)
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    args = (spec(tokens, hidden), jnp.asarray(ids), spec(tokens, top_k), spec(experts, 2 * inter, hidden),
            spec(experts, hidden, inter))
    modeled = {}
    for path, limit in (("fused", fused.FUSED_TOKENS), ("grouped", 0)):
        monkeypatch.setattr(fused, "FUSED_TOKENS", limit)
        step = lambda *a: ops.experts_forward(*a, generation="tpu7x", interpret=False)  # traced afresh
        modeled[path] = harness.measure(step, args, "tpu7x").figures()["modeled_us"]
    assert modeled["fused"] < modeled["grouped"], modeled
