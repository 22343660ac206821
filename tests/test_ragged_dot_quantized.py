"""ragged_dot with quantized weights (int8 and float8_e4m3fn, a float32 scale per group and output
channel): the kernel reads the weights as stored and scales the fp32 product. Against
jax.lax.ragged_dot over the dequantized weights, in interpret mode and the TPU interpreter;
lhs's gradient; bad scales named; a decode-sized call compiled for v6e reading a byte per weight."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import tpu_compile
from ragged_dot import ops
from runtime.generations import GENERATIONS

# Unaligned K and N (the last blocks masked and clipped), an empty group, rows past the groups.
G, K, N, M = 3, 200, 300, 40
SIZES = (10, 0, 25)
# fp32: the dequantized weights are exact in fp32, the product in fp32 (HIGHEST) either way: only the
# summation order differs. bf16: the output's rounding, half an ulp (2^-8 of the largest value).
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2 ** -8}


def _weights(dtype, transpose_rhs, seed=0):
    """(rhs as stored, scales [G, N] distinct per group and channel, the dequantized weight [G, K, N] in fp32)."""
    rng = np.random.default_rng(seed)
    shape = (G, N, K) if transpose_rhs else (G, K, N)
    if dtype == jnp.int8:
        rhs = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
    else:
        rhs = jnp.asarray(rng.standard_normal(shape) * 4, jnp.float32).astype(dtype)
    scale = jnp.asarray(rng.uniform(0.001, 0.02, (G, N)), jnp.float32)
    dequantized = rhs.astype(jnp.float32) * (scale[:, :, None] if transpose_rhs else scale[:, None, :])
    return rhs, scale, jnp.swapaxes(dequantized, 1, 2) if transpose_rhs else dequantized


def _reference(lhs, weight, sizes):
    return jax.lax.ragged_dot(lhs.astype(jnp.float32), weight, sizes, precision=jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("lhs_dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["KN", "NK"])
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "fp8"])
def test_matches_the_dequantized_weights(dtype, transpose_rhs, lhs_dtype):
    rhs, scale, weight = _weights(dtype, transpose_rhs)
    lhs = jnp.asarray(np.random.default_rng(1).standard_normal((M, K)), jnp.float32).astype(lhs_dtype)
    sizes = jnp.asarray(SIZES, jnp.int32)
    out = ops.ragged_dot(lhs, rhs, sizes, rhs_scale=scale, transpose_rhs=transpose_rhs)
    want = _reference(lhs, weight, sizes)
    assert out.shape == (M, N) and out.dtype == lhs_dtype
    assert jnp.max(jnp.abs(out.astype(jnp.float32) - want)) <= TOLERANCE[lhs_dtype] * jnp.max(jnp.abs(want))
    assert not np.any(np.asarray(out[sum(SIZES):])), "rows past the groups are zero"


def test_lhs_gradient_and_none_for_the_frozen_weights():
    """d lhs = (d out * scale of the row's group) @ rhs^T; rhs and its scales get no gradient."""
    rhs, scale, weight = _weights(jnp.int8, True)
    lhs = jnp.asarray(np.random.default_rng(2).standard_normal((M, K)), jnp.float32)
    sizes = jnp.asarray(SIZES, jnp.int32)
    cotangent = jnp.asarray(np.random.default_rng(3).standard_normal((M, N)), jnp.float32)
    got = jax.grad(lambda x: jnp.sum(ops.ragged_dot(x, rhs, sizes, rhs_scale=scale, transpose_rhs=True) * cotangent))(lhs)
    want = jax.grad(lambda x: jnp.sum(_reference(x, weight, sizes) * cotangent))(lhs)
    assert jnp.max(jnp.abs(got - want)) <= 1e-5 * jnp.max(jnp.abs(want))
    assert not np.any(np.asarray(got[sum(SIZES):]))
    d_scale = jax.grad(lambda s: jnp.sum(ops.ragged_dot(lhs, rhs, sizes, rhs_scale=s, transpose_rhs=True)))(scale)
    assert not np.any(np.asarray(d_scale))


def test_passes_the_tpu_interpreter():
    """Races, out-of-bounds DMAs and uninitialised reads (NaN-filled memory), int8 weights in
    transformers' [G, N, K] layout."""
    rhs, scale, weight = _weights(jnp.int8, True)
    lhs = jnp.asarray(np.random.default_rng(1).standard_normal((M, K)), jnp.bfloat16)
    sizes = jnp.asarray(SIZES, jnp.int32)
    out = ops.ragged_dot(lhs, rhs, sizes, rhs_scale=scale, transpose_rhs=True,
                         interpret=pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan"))
    want = _reference(lhs, weight, sizes)
    assert jnp.max(jnp.abs(out.astype(jnp.float32) - want)) <= TOLERANCE[jnp.bfloat16] * jnp.max(jnp.abs(want))


@pytest.mark.parametrize("change,match", [
    (dict(rhs_scale=None), "rhs_scale .* is required"),
    (dict(rhs_scale=jnp.ones((G, K), jnp.float32)), r"rhs_scale must be float32 \(3, 300\)"),
    (dict(rhs_scale=jnp.ones((G, N), jnp.bfloat16)), "rhs_scale must be float32"),
    (dict(rhs=jnp.ones((G, K, N), jnp.bfloat16)), "rhs_scale is for int8 or float8_e4m3fn weights"),
    (dict(lhs=jnp.ones((M, K), jnp.float16)), "lhs must be bfloat16 or float32"),
    (dict(rhs=jnp.ones((G, K, N), jnp.float8_e5m2)), "rhs is float8_e5m2: weights are floating point"),
])
def test_bad_scales_are_named_before_any_kernel(change, match):
    rhs, scale, _ = _weights(jnp.int8, False)
    args = dict(lhs=jnp.ones((M, K), jnp.bfloat16), rhs=rhs, group_sizes=jnp.asarray(SIZES, jnp.int32), rhs_scale=scale)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        ops.ragged_dot(**args)


@pytest.mark.parametrize("pass_", ["forward", "lhs_gradient"])
def test_decode_compiles_for_v6e_reading_a_byte_per_weight(pass_):
    """Qwen3-30B-A3B's gate_up projection at a 64-token decode step (512 routed rows, 128 experts,
    [E, N, K] int8), forward and lhs's gradient: one kernel within v6e's VMEM, whose weight operand
    is int8 in HBM (no dequantized copy before it)."""
    specs = [((512, 2048), jnp.bfloat16), ((128, 1536, 2048), jnp.int8), ((128,), jnp.int32), ((128, 1536), jnp.float32)]

    def forward(lhs, rhs, sizes, scale):
        return ops.ragged_dot(lhs, rhs, sizes, rhs_scale=scale, transpose_rhs=True, generation="v6e", interpret=False)

    def lhs_gradient(lhs, rhs, sizes, scale, cotangent):
        return jax.vjp(lambda x: forward(x, rhs, sizes, scale), lhs)[1](cotangent)[0]

    fn = forward if pass_ == "forward" else lhs_gradient
    specs += [((512, 1536), jnp.bfloat16)] if pass_ == "lhs_gradient" else []
    report = tpu_compile.compile_for(fn, specs, "v6e", "ragged_dot_tpu")
    assert len(report.kernels) == 1, report.kernels
    assert all(0 < k.vmem_bytes <= GENERATIONS["v6e"].vmem_bytes for k in report.kernels.values())
    operands = [s for kernel in report.kernels.values() if kernel.schedule for s in kernel.schedule.operand_shapes]
    assert "s8[128,1536,2048]" in operands, operands
    assert not any("bf16[128,1536,2048]" in s for op in report.other_ops.values() for s in op.operand_shapes)


@pytest.mark.parametrize("transposed", [False, True], ids=["transformers", "gpt_oss_layout"])
def test_experts_forward_matches_the_dequantized_experts(transposed):
    """Both projections int8 (per-expert, per-channel scales, distinct per projection) against the
    same forward on the dequantized fp32 weights, with biases; hidden_states' gradient too (the
    weights' path is tested against transformers' experts in test_ragged_dot_numerics)."""
    rng = np.random.default_rng(4)
    tokens, hidden, inter, experts, top_k = 6, 96, 40, 4, 2
    up_shape, down_shape = ((experts, hidden, 2 * inter), (experts, inter, hidden)) if transposed else \
        ((experts, 2 * inter, hidden), (experts, hidden, inter))
    quantize = lambda shape: jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
    up, down = quantize(up_shape), quantize(down_shape)
    up_scale = jnp.asarray(rng.uniform(0.001, 0.01, (experts, 2 * inter)), jnp.float32)
    down_scale = jnp.asarray(rng.uniform(0.001, 0.01, (experts, hidden)), jnp.float32)
    channel_axis = 2 if transposed else 1  # where a weight's output channels are
    dequantize = lambda w, s: w.astype(jnp.float32) * jnp.expand_dims(s, 3 - channel_axis)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
    index = jnp.asarray(np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k], jnp.int32)
    weights = jnp.asarray(rng.random((tokens, top_k)), jnp.float32)
    up_bias = jnp.asarray(rng.standard_normal((experts, 2 * inter)), jnp.float32)
    down_bias = jnp.asarray(rng.standard_normal((experts, hidden)), jnp.float32)

    def quantized(x):
        return ops.experts_forward(x, index, weights, up, down, up_bias, down_bias, transposed=transposed,
                                   up_scale=up_scale, down_scale=down_scale)

    def dequantized(x):
        return ops.experts_forward(x, index, weights, dequantize(up, up_scale), dequantize(down, down_scale),
                                   up_bias, down_bias, transposed=transposed)

    got, want = quantized(x), dequantized(x)
    assert jnp.max(jnp.abs(got - want)) <= 1e-5 * jnp.max(jnp.abs(want))
    cotangent = jnp.asarray(rng.standard_normal(got.shape), jnp.float32)
    grads = [jax.grad(lambda x: jnp.sum(f(x) * cotangent))(x) for f in (quantized, dequantized)]
    assert jnp.max(jnp.abs(grads[0] - grads[1])) <= 1e-5 * jnp.max(jnp.abs(grads[1]))
    with pytest.raises(ValueError, match="down_scale must be float32"):
        ops.experts_forward(x, index, weights, up, down, transposed=transposed, up_scale=up_scale,
                            down_scale=up_scale)
