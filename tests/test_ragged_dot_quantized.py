"""ragged_dot with quantized weights (int8 and float8_e4m3fn, float32 scales per group and output
channel, or per 128 x 128 block as FineGrainedFP8 checkpoints hold them): the kernel reads the
weights as stored and scales the fp32 products. Against jax.lax.ragged_dot over the dequantized
weights, in interpret mode and the TPU interpreter; lhs's gradient; bad scales named; a
decode-sized call compiled for v6e reading a byte per weight."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import tpu_compile
from ragged_dot import ops
from runtime.generations import GENERATIONS
from errors import max_abs, max_error

# Unaligned K and N (the last blocks masked and clipped), an empty group, rows past the groups.
G, K, N, M = 3, 200, 300, 40
SIZES = (10, 0, 25)
# fp32: the dequantized weights are exact in fp32, the product in fp32 (HIGHEST) either way: only the
# summation order differs. bf16: the output's rounding, half an ulp (2^-8 of the largest value).
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2 ** -8}


def _weights(dtype, transpose_rhs, seed=0, per_block=False, k=K, n=N):
    """(rhs as stored, its scales distinct per group and channel, or per 128 x 128 block laid out as
    rhs, the dequantized weight [G, K, N] in fp32)."""
    rng = np.random.default_rng(seed)
    shape = (G, n, k) if transpose_rhs else (G, k, n)
    if dtype == jnp.int8:
        rhs = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
    else:
        rhs = jnp.asarray(rng.standard_normal(shape) * 4, jnp.float32).astype(dtype)
    if per_block:
        scale = rng.uniform(0.001, 0.02, (G, *(-(-d // 128) for d in shape[1:])))
        expanded = np.repeat(np.repeat(scale, 128, axis=1), 128, axis=2)[:, :shape[1], :shape[2]]
    else:
        scale = rng.uniform(0.001, 0.02, (G, n))
        expanded = scale[:, :, None] if transpose_rhs else scale[:, None, :]
    dequantized = rhs.astype(jnp.float32) * jnp.asarray(expanded, jnp.float32)
    scale = jnp.asarray(scale, jnp.float32)
    return rhs, scale, jnp.swapaxes(dequantized, 1, 2) if transpose_rhs else dequantized


def _reference(lhs, weight, sizes):
    return jax.lax.ragged_dot(lhs.astype(jnp.float32), weight, sizes, precision=jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("per_block", [False, True], ids=["per_channel", "per_block"])
@pytest.mark.parametrize("lhs_dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["KN", "NK"])
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "fp8"])
def test_matches_the_dequantized_weights(dtype, transpose_rhs, lhs_dtype, per_block):
    rhs, scale, weight = _weights(dtype, transpose_rhs, per_block=per_block)
    lhs = jnp.asarray(np.random.default_rng(1).standard_normal((M, K)), jnp.float32).astype(lhs_dtype)
    sizes = jnp.asarray(SIZES, jnp.int32)
    out = ops.ragged_dot(lhs, rhs, sizes, rhs_scale=scale, transpose_rhs=transpose_rhs)
    want = _reference(lhs, weight, sizes)
    assert out.shape == (M, N) and out.dtype == lhs_dtype
    assert max_error(out.astype(jnp.float32), want) <= TOLERANCE[lhs_dtype] * max_abs(want)
    assert not np.any(np.asarray(out[sum(SIZES):])), "rows past the groups are zero"


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["KN", "NK"])
def test_block_scales_follow_every_k_step_and_n_tile(transpose_rhs):
    """Blocks smaller than the weights: 3 K steps of 128 (the last one partial) and N tiles of 256
    (two scale blocks each, the last tile partial): each product takes its own blocks' scales."""
    from ragged_dot.kernel import BlockSizes

    k, n = 300, 400
    rhs, scale, weight = _weights(jnp.float8_e4m3fn, transpose_rhs, seed=5, per_block=True, k=k, n=n)
    lhs = jnp.asarray(np.random.default_rng(6).standard_normal((M, k)), jnp.float32)
    sizes = jnp.asarray(SIZES, jnp.int32)
    out = ops.ragged_dot(lhs, rhs, sizes, rhs_scale=scale, transpose_rhs=transpose_rhs,
                         blocks=BlockSizes(block_m=16, block_k=128, block_n=256))
    want = _reference(lhs, weight, sizes)
    assert max_error(out, want) <= TOLERANCE[jnp.float32] * max_abs(want)


@pytest.mark.parametrize("per_block", [False, True], ids=["per_channel", "per_block"])
def test_lhs_gradient_and_none_for_the_frozen_weights(per_block):
    """d lhs = d out @ (the dequantized weights)^T; rhs and its scales get no gradient."""
    rhs, scale, weight = _weights(jnp.int8, True, per_block=per_block)
    lhs = jnp.asarray(np.random.default_rng(2).standard_normal((M, K)), jnp.float32)
    sizes = jnp.asarray(SIZES, jnp.int32)
    cotangent = jnp.asarray(np.random.default_rng(3).standard_normal((M, N)), jnp.float32)
    got = jax.grad(lambda x: jnp.sum(ops.ragged_dot(x, rhs, sizes, rhs_scale=scale, transpose_rhs=True) * cotangent))(lhs)
    want = jax.grad(lambda x: jnp.sum(_reference(x, weight, sizes) * cotangent))(lhs)
    assert max_error(got, want) <= 1e-5 * max_abs(want)
    assert not np.any(np.asarray(got[sum(SIZES):]))
    d_scale = jax.grad(lambda s: jnp.sum(ops.ragged_dot(lhs, rhs, sizes, rhs_scale=s, transpose_rhs=True)))(scale)
    assert not np.any(np.asarray(d_scale))


@pytest.mark.parametrize("dtype,per_block", [(jnp.int8, False), (jnp.float8_e4m3fn, True)],
                         ids=["int8_per_channel", "fp8_per_block"])
def test_passes_the_tpu_interpreter(dtype, per_block):
    """Races, out-of-bounds DMAs and uninitialised reads (NaN-filled memory), weights in
    transformers' [G, N, K] layout."""
    rhs, scale, weight = _weights(dtype, True, per_block=per_block)
    lhs = jnp.asarray(np.random.default_rng(1).standard_normal((M, K)), jnp.bfloat16)
    sizes = jnp.asarray(SIZES, jnp.int32)
    out = ops.ragged_dot(lhs, rhs, sizes, rhs_scale=scale, transpose_rhs=True,
                         interpret=pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan"))
    want = _reference(lhs, weight, sizes)
    assert max_error(out.astype(jnp.float32), want) <= TOLERANCE[jnp.bfloat16] * max_abs(want)


@pytest.mark.parametrize("change,match", [
    (dict(rhs_scale=None), "rhs_scale .* is required"),
    (dict(rhs_scale=jnp.ones((G, K), jnp.float32)), r"rhs_scale must be float32 \(3, 300\)"),
    (dict(rhs_scale=jnp.ones((G, 3, 2), jnp.float32)), r"or \(3, 2, 3\) \(per 128 x 128 block of rhs\)"),
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
@pytest.mark.parametrize("dtype,scale_shape", [(jnp.int8, (128, 1536)), (jnp.float8_e4m3fn, (128, 12, 16))],
                         ids=["int8_per_channel", "fp8_per_block"])
def test_decode_compiles_for_v6e_reading_a_byte_per_weight(pass_, dtype, scale_shape):
    """Qwen3-30B-A3B's gate_up projection at a 64-token decode step (512 routed rows, 128 experts,
    [E, N, K] a byte per weight), forward and lhs's gradient: one kernel within v6e's VMEM, whose
    weight operand is int8 or fp8 in HBM (no dequantized copy before it)."""
    specs = [((512, 2048), jnp.bfloat16), ((128, 1536, 2048), dtype), ((128,), jnp.int32), (scale_shape, jnp.float32)]

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
    assert ("s8" if dtype == jnp.int8 else "f8e4m3fn") + "[128,1536,2048]" in operands, operands
    assert not any("bf16[128,1536,2048]" in s for op in report.other_ops.values() for s in op.operand_shapes)


def test_fp8_weights_go_into_the_product_unwidened_on_v6e():
    """v6e's Mosaic widens fp8 weights on their way into a bf16 product at no cost of its own, but an
    fp8 block widened first (astype) costs several times the product: the kernel gives the product
    the bytes as loaded. The decode step above with fp8 weights issues within a fifth of int8's
    cycles per grid step (widened first it issued about three times as many)."""
    cycles = {}
    for dtype in (jnp.int8, jnp.float8_e4m3fn):
        specs = [((512, 2048), jnp.bfloat16), ((128, 1536, 2048), dtype), ((128,), jnp.int32), ((128, 1536), jnp.float32)]
        fn = lambda lhs, rhs, sizes, scale: ops.ragged_dot(lhs, rhs, sizes, rhs_scale=scale, transpose_rhs=True,
                                                          generation="v6e", interpret=False)
        (kernel,) = tpu_compile.compile_for(fn, specs, "v6e", "ragged_dot_tpu").kernels.values()
        cycles[jnp.dtype(dtype).name] = kernel.schedule.iteration_cycles
    assert cycles["float8_e4m3fn"] <= 1.2 * cycles["int8"], cycles


@pytest.mark.parametrize("per_block", [False, True], ids=["int8_per_channel", "fp8_per_block"])
@pytest.mark.parametrize("transposed", [False, True], ids=["transformers", "gpt_oss_layout"])
def test_experts_forward_matches_the_dequantized_experts(transposed, per_block):
    """Both projections quantized (int8 with per-expert, per-channel scales, or fp8 with a scale per
    128 x 128 block laid out as the weights; distinct per projection) against the same forward on
    the dequantized fp32 weights, with biases; hidden_states' gradient too (the weights' path is
    tested against transformers' experts in test_ragged_dot_numerics)."""
    rng = np.random.default_rng(4)
    tokens, hidden, inter, experts, top_k = 6, 160, 72, 4, 2  # 2 x 2 blocks of 128 per weight
    up_shape, down_shape = ((experts, hidden, 2 * inter), (experts, inter, hidden)) if transposed else \
        ((experts, 2 * inter, hidden), (experts, hidden, inter))
    channel_axis = 2 if transposed else 1  # where a weight's output channels are

    def quantize(shape):
        """(weights, scales, the dequantized fp32 weights)."""
        if not per_block:
            w = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
            s = jnp.asarray(rng.uniform(0.001, 0.01, (shape[0], shape[channel_axis])), jnp.float32)
            return w, s, w.astype(jnp.float32) * jnp.expand_dims(s, 3 - channel_axis)
        w = jnp.asarray(rng.standard_normal(shape) * 4, jnp.float32).astype(jnp.float8_e4m3fn)
        s = rng.uniform(0.001, 0.01, (shape[0], *(-(-d // 128) for d in shape[1:])))
        expanded = np.repeat(np.repeat(s, 128, axis=1), 128, axis=2)[:, :shape[1], :shape[2]]
        return w, jnp.asarray(s, jnp.float32), w.astype(jnp.float32) * jnp.asarray(expanded, jnp.float32)

    (up, up_scale, up_fp32), (down, down_scale, down_fp32) = quantize(up_shape), quantize(down_shape)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
    index = jnp.asarray(np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k], jnp.int32)
    weights = jnp.asarray(rng.random((tokens, top_k)), jnp.float32)
    up_bias = jnp.asarray(rng.standard_normal((experts, 2 * inter)), jnp.float32)
    down_bias = jnp.asarray(rng.standard_normal((experts, hidden)), jnp.float32)

    def quantized(x):
        return ops.experts_forward(x, index, weights, up, down, up_bias, down_bias, transposed=transposed,
                                   up_scale=up_scale, down_scale=down_scale)

    def dequantized(x):
        return ops.experts_forward(x, index, weights, up_fp32, down_fp32, up_bias, down_bias, transposed=transposed)

    # down_proj's hidden and intermediate zero-padded to 256 and 128, as quantize_experts holds it
    # (its block scales cover the padding already), its bias unpadded: the same layer.
    pads = [(0, 128 - inter), (0, 256 - hidden)]
    padded_down = jnp.pad(down, [(0, 0), *(pads if transposed else pads[::-1])])
    # Per channel, the padding's channels have scales too (any: their weights are zero).
    padded_scale = down_scale if per_block else jnp.pad(down_scale, [(0, 0), pads[1]], constant_values=3.0)

    def padded(x):
        return ops.experts_forward(x, index, weights, up, padded_down, up_bias, down_bias, transposed=transposed,
                                   up_scale=up_scale, down_scale=padded_scale)

    want = dequantized(x)
    for f in (quantized, padded):
        assert max_error(f(x), want) <= 1e-5 * max_abs(want)
    cotangent = jnp.asarray(rng.standard_normal(want.shape), jnp.float32)
    want_grad = jax.grad(lambda x: jnp.sum(dequantized(x) * cotangent))(x)
    for f in (quantized, padded):
        assert max_error(jax.grad(lambda x: jnp.sum(f(x) * cotangent))(x), want_grad) <= 1e-5 * max_abs(want_grad)
    for bad in ([(0, 128 - inter - 1), (0, 0)], [(0, 0), (0, 256 - hidden + 8)]):  # not to the next multiple of 128
        wrong = jnp.pad(down, [(0, 0), *(bad if transposed else bad[::-1])])
        with pytest.raises(ValueError, match=r"down_proj .* should hold .* \(or zero-padded to multiples of 128"):
            ops.experts_forward(x, index, weights, up, wrong, transposed=transposed, up_scale=up_scale,
                                down_scale=padded_scale)
    with pytest.raises(ValueError, match="down_scale must be float32"):
        ops.experts_forward(x, index, weights, up, down, transposed=transposed, up_scale=up_scale,
                            down_scale=up_scale)


def test_a_byte_per_weight_cuts_tall_row_tiles():
    """The table's blocks were rated with bf16 weights: a decode entry with tiles taller than 128
    rows though it has a few rows per expert (the first found in the tables: several are, on v5e
    and v6e) has them cut to 128 rows with quantized weights (int8, fp8, or 4-bit ones held as
    uint8: an array of a byte per item); a Mixtral-8x7B prefill's 512-row tiles (4096 rows per
    expert) stay; the other sizes stay."""
    from ragged_dot import tuned_blocks, tuning

    generation, (rows, k, n, groups, _) = next(
        (gen, key) for gen, table in sorted(tuned_blocks.TUNED.items()) for key, b in sorted(table.items())
        if key[0] <= 4 * key[3] and b.block_m > 128 and key[-1] == 2)
    decode = dict(rows=rows, k=k, n=n, groups=groups, generation=generation, transpose_rhs=True)
    mixtral = dict(rows=32768, k=4096, n=28672, groups=8, generation="v5e", transpose_rhs=True)
    for case, want_m in ((decode, 128), (mixtral, 512)):
        bf16 = tuning.choose_blocks(**case)
        assert bf16.block_m > 128 if case is decode else bf16.block_m == 512, bf16  # the entry this test is about
        quantized = tuning.choose_blocks(**case, weight_itemsize=1)
        assert (quantized.block_m, quantized.block_k, quantized.block_n) == (want_m, bf16.block_k, bf16.block_n)


@pytest.mark.parametrize("down_dims,dtype", [((2176, 768), jnp.int8), ((2112, 704), jnp.int8), ((2176, 768), jnp.uint8),
                                             ((2176, 768), jnp.bfloat16)],
                         ids=["int8_padded", "int8_unpadded", "int4_padded", "bf16_padded"])
def test_gemma4_quantized_down_proj_is_read_as_held_on_v6e(down_dims, dtype):
    """Gemma 4 26B-A4B's experts (hidden 2112, intermediate 704, 128 experts, top 8) at a 64-token
    decode, int8 with a scale per channel, int4 with a scale per 64 along K, or bf16. A TPU holds
    down_proj [128, 2112, 704] (int4: [128, 352, 2112] bytes) experts-minor, both other dims
    unaligned: the kernel can only read it through a copy of the whole tensor each call (bf16:
    one XLA matmul reads every expert's). With both dims zero-padded to multiples of 128 (as
    quantize_experts and pad_experts hold it) it is held experts-major and no XLA op touches it."""
    tokens, hidden, inter, experts, top_k = 64, 2112, 704, 128, 8
    (down_hidden, down_inter), int4 = down_dims, dtype == jnp.uint8
    if int4:  # K-major, two codes per byte along K
        weights = [((experts, hidden // 2, 2 * inter), dtype), ((experts, down_inter // 2, down_hidden), dtype),
                   ((experts, hidden // 64, 2 * inter), jnp.float32), ((experts, down_inter // 64, down_hidden), jnp.float32)]
    else:
        weights = [((experts, 2 * inter, hidden), dtype), ((experts, down_hidden, down_inter), dtype)]
        weights += [((experts, 2 * inter), jnp.float32), ((experts, down_hidden), jnp.float32)] * (dtype == jnp.int8)
    specs = [((tokens, hidden), jnp.bfloat16), ((tokens, top_k), jnp.int32), ((tokens, top_k), jnp.bfloat16), *weights]

    def layer(x, index, weights, up, down, up_scale=None, down_scale=None):
        return ops.experts_forward(x, index, weights, up, down, activation="gelu_tanh", up_scale=up_scale,
                                   down_scale=down_scale, transposed=int4, generation="v6e", interpret=False)

    report = tpu_compile.compile_for(layer, specs, "v6e", "ragged_dot_tpu")
    elements = lambda shape: math.prod(int(n) for n in shape[shape.index("[") + 1:-1].split(",") if n)
    touching = {op: s.operand_shapes for op, s in report.other_ops.items()
                if any(elements(shape) == math.prod(weights[1][0]) for shape in s.operand_shapes)}
    assert bool(touching) == (down_dims == (hidden, inter)), touching
