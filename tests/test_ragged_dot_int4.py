"""ragged_dot and experts_forward with int4 weights (two's-complement codes two per byte along K, a
float32 scale per group of K rows and output column): the kernel reads half a byte per weight and
decodes in VMEM. Against jax.lax.ragged_dot over the dequantized weights in interpret mode and the
TPU interpreter, lhs's gradient too; `quantize_int4`'s layout and rounding; bad input named; a
decode-sized call compiled for v6e reading the packed bytes with no copy before the kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from errors import max_abs, max_error
from ragged_dot import ops
from ragged_dot.kernel import BlockSizes, grouped_matmul, int4_planes
from sampling import sample
from test_ragged_dot_mxfp4 import assert_packed_decode_compiles

# K = 2560: 20 groups of 128; with blocks of 1024 the last K step is partial (512). N = 300: the last
# N tile partial. An empty group, rows past the groups.
G, K, N, M = 3, 2560, 300, 40
GROUP = 128
SIZES = (10, 0, 25)


def _codes(seed, groups=G, k=K, n=N):
    """Every code (-8 .. 7) at random, and scales distinct per group, K group and column."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(-8, 8, (groups, k, n)).astype(np.int8)
    scales = rng.uniform(0.001, 0.02, (groups, k // GROUP, n)).astype(np.float32)
    return codes, scales


def _packed(codes):
    """Two codes per byte along K, the even row in the low nibble (the layout the kernel reads)."""
    nibbles = codes.view(np.uint8) & 15
    return jnp.asarray(nibbles[:, 0::2] | (nibbles[:, 1::2] << 4))


def _dequantized(codes, scales, dtype=np.float32):
    """The weights [G, K, N] in fp32; with dtype bf16, as the kernel forms them in bf16 (the scale
    rounded to bf16, then the product)."""
    scale = np.repeat(scales, GROUP, axis=1)
    if dtype == np.float32:
        return jnp.asarray(codes.astype(np.float32) * scale)
    bf16 = lambda x: jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
    return bf16(codes.astype(np.float32) * np.asarray(bf16(scale)))


def _reference(lhs, weight, sizes):
    return jax.lax.ragged_dot(lhs.astype(jnp.float32), weight, sizes, precision=jax.lax.Precision.HIGHEST)


def test_every_code_decodes_to_its_value_times_its_groups_scale():
    """Each byte's low nibble is the even K row, its high nibble the odd one, sign-extended (-8 .. 7);
    each group of 64 bytes (128 weights) takes its own scale, in fp32 exactly."""
    codes = np.arange(256, dtype=np.uint8).reshape(2, 128).T  # [128 bytes, 2 columns]: every byte
    scales = np.array([[0.5, 3.0], [0.25, -2.0]], np.float32)  # [2 groups of 64 bytes, 2 columns]
    lo, hi = int4_planes(jnp.asarray(codes), jnp.asarray(scales), jnp.float32, GROUP)
    signed = lambda nibble: np.where(nibble >= 8, nibble.astype(np.int32) - 16, nibble)
    scale = np.repeat(scales, GROUP // 2, axis=0)
    np.testing.assert_array_equal(np.asarray(lo), signed(codes & 15) * scale)
    np.testing.assert_array_equal(np.asarray(hi), signed(codes >> 4) * scale)


def test_quantize_int4_rounds_each_group_to_its_nearest_code():
    """`quantize_int4` packs as the kernel reads: codes within half a step of the weights, the
    group's largest magnitude at 7 steps; an all-zero group gives zeros."""
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((2, 256, 130)).astype(np.float32)
    weights[1, :GROUP, 5] = 0
    packed, scales = ops.quantize_int4(jnp.asarray(weights), GROUP)
    assert packed.shape == (2, 128, 130) and packed.dtype == jnp.uint8 and scales.shape == (2, 2, 130)
    lo, hi = int4_planes(packed.reshape(-1, 130), scales.reshape(-1, 130), jnp.float32, GROUP)
    got = np.stack([np.asarray(lo), np.asarray(hi)], axis=1).reshape(weights.shape)
    step = np.repeat(np.asarray(scales), GROUP, axis=1)
    assert np.all(np.abs(got - weights) <= step / 2 * (1 + 1e-6))
    largest = np.abs(weights).reshape(2, 2, GROUP, 130).max(axis=2)
    np.testing.assert_allclose(np.asarray(scales), np.where(largest > 0, largest / 7, np.finfo(np.float32).tiny),
                               rtol=1e-6)
    assert not np.any(got[1, :GROUP, 5])


@pytest.mark.parametrize("blocks", [None, BlockSizes(block_m=16, block_k=1024, block_n=128)],
                         ids=["table", "k_steps_and_n_tiles"])
@pytest.mark.parametrize("lhs_dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_matches_the_dequantized_weights(lhs_dtype, blocks):
    """fp32: the dequantized weights are exact in fp32, the products at HIGHEST: only the summation
    order differs (1e-5 of the largest output). bf16: against the weights as the kernel forms them in
    bf16 (each within 2^-7 of its exact value), the output's rounding, half an ulp (2^-8)."""
    codes, scales = _codes(0)
    lhs = jnp.asarray(np.random.default_rng(1).standard_normal((M, K)), jnp.float32).astype(lhs_dtype)
    sizes = jnp.asarray(SIZES, jnp.int32)
    out = ops.ragged_dot(lhs, _packed(codes), sizes, rhs_scale=jnp.asarray(scales), blocks=blocks)
    weight = _dequantized(codes, scales, np.float32 if lhs_dtype == jnp.float32 else jnp.bfloat16)
    exact = _dequantized(codes, scales)
    assert max_error(weight, exact) <= 2 ** -7 * max_abs(exact)
    want = _reference(lhs, weight, sizes)
    tolerance = 1e-5 if lhs_dtype == jnp.float32 else 2 ** -8
    assert out.shape == (M, N) and out.dtype == lhs_dtype
    assert max_error(out.astype(jnp.float32), want) <= tolerance * max_abs(want)
    assert not np.any(np.asarray(out[sum(SIZES):])), "rows past the groups are zero"


def test_passes_the_tpu_interpreter():
    """Races, out-of-bounds DMAs and uninitialised reads (NaN-filled memory: the last K block's
    overhang must not reach the sum), three K steps and partial N tiles."""
    codes, scales = _codes(2)
    lhs = jnp.asarray(np.random.default_rng(3).standard_normal((M, K)), jnp.float32)
    sizes = jnp.asarray(SIZES, jnp.int32)
    out = ops.ragged_dot(lhs, _packed(codes), sizes, rhs_scale=jnp.asarray(scales), blocks=BlockSizes(16, 1024, 256),
                         interpret=pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan"))
    want = _reference(lhs, _dequantized(codes, scales), sizes)
    assert max_error(out, want) <= 1e-5 * max_abs(want)


@pytest.mark.parametrize("interpret", [True, pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")],
                         ids=["interpret", "tpu_interpreter"])
def test_lhs_gradient_over_pair_blocks_and_n_steps(interpret):
    """d lhs = d out @ (the decoded weights)^T: through ragged_dot's gradient (no gradient for the
    frozen weights), and its kernel with blocks smaller than the weights: 3 blocks of 512 pairs (the
    last partial) and 3 steps of 128 along N (the last partial)."""
    codes, scales = _codes(7)
    rhs, scale, weight = _packed(codes), jnp.asarray(scales), _dequantized(codes, scales)
    sizes = jnp.asarray(SIZES, jnp.int32)
    rows = 48  # the kernel takes whole row tiles (ops pads M)
    grad_out = jnp.asarray(np.random.default_rng(8).standard_normal((rows, N)), jnp.float32)
    got = grouped_matmul(grad_out, rhs, sizes, blocks=BlockSizes(16, 128, 512), transpose_rhs=True,
                         out_dtype=jnp.float32, vmem_limit=32 << 20, interpret=interpret, rhs_packed_scale=scale)
    want = jax.lax.ragged_dot(grad_out, jnp.swapaxes(weight, 1, 2), sizes, precision=jax.lax.Precision.HIGHEST)
    assert got.shape == (rows, K)
    assert max_error(got, want) <= 1e-5 * max_abs(want)
    if interpret is True:
        lhs = jnp.asarray(np.random.default_rng(9).standard_normal((M, K)), jnp.float32)
        got = jax.grad(lambda x: jnp.sum(ops.ragged_dot(x, rhs, sizes, rhs_scale=scale) * grad_out[:M]))(lhs)
        want = jax.grad(lambda x: jnp.sum(_reference(x, weight, sizes) * grad_out[:M]))(lhs)
        assert max_error(got, want) <= 1e-5 * max_abs(want)
        assert not np.any(np.asarray(got[sum(SIZES):]))


def test_experts_forward_matches_the_dequantized_experts():
    """Both projections int4 (transposed layout, as quantize_experts holds them; groups of 32 and
    64, distinct per projection), with biases, against the same forward on the dequantized fp32
    weights; hidden_states' gradient too."""
    rng = np.random.default_rng(4)
    tokens, hidden, inter, experts, top_k = 6, 128, 96, 4, 2
    up_w = jnp.asarray(rng.standard_normal((experts, hidden, 2 * inter)), jnp.float32)
    down_w = jnp.asarray(rng.standard_normal((experts, inter, hidden)), jnp.float32)
    (up, up_scale), (down, down_scale) = ops.quantize_int4(up_w, 64), ops.quantize_int4(down_w, 32)
    dequantize = lambda packed, scale, group: jnp.stack(
        int4_planes(packed.reshape(-1, packed.shape[2]), scale.reshape(-1, scale.shape[2]), jnp.float32, group),
        axis=1).reshape(packed.shape[0], 2 * packed.shape[1], packed.shape[2])
    up_fp32, down_fp32 = dequantize(up, up_scale, 64), dequantize(down, down_scale, 32)
    assert max_error(up_fp32, up_w) <= max_abs(up_w) / 7  # half a step of the largest group's scale, and less
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1, (tokens, top_k)), jnp.float32)
    biases = (jnp.asarray(rng.standard_normal((experts, 2 * inter)), jnp.float32),
              jnp.asarray(rng.standard_normal((experts, hidden)), jnp.float32))

    def quantized(x):
        return ops.experts_forward(x, ids, weights, up, down, *biases, transposed=True, up_scale=up_scale,
                                   down_scale=down_scale)

    def dequantized(x):
        return ops.experts_forward(x, ids, weights, up_fp32, down_fp32, *biases, transposed=True)

    got, want = quantized(x), dequantized(x)
    assert max_error(got, want) <= 1e-5 * max_abs(want)
    cotangent = jnp.asarray(rng.standard_normal(got.shape), jnp.float32)
    grads = [jax.grad(lambda x: jnp.sum(f(x) * cotangent))(x) for f in (quantized, dequantized)]
    assert max_error(grads[0], grads[1]) <= 1e-5 * max_abs(grads[1])
    with pytest.raises(ValueError, match=r"down_scale must be float32 \(G, K / group, N\) = \(4, 96 / group, 128\)"):
        ops.experts_forward(x, ids, weights, up, down, transposed=True, up_scale=up_scale, down_scale=up_scale)
    # down_proj's intermediate zero-padded to 128 before quantizing, as quantize_experts holds it:
    # the same layer.
    padded, padded_scale = ops.quantize_int4(jnp.pad(down_fp32, [(0, 0), (0, 128 - inter), (0, 0)]), 32)
    got = ops.experts_forward(x, ids, weights, up, padded, *biases, transposed=True, up_scale=up_scale,
                              down_scale=padded_scale)
    assert max_error(got, want) <= 1e-5 * max_abs(want)


@pytest.mark.parametrize("change,match", [
    (dict(rhs_scale=jnp.ones((G, 21, N), jnp.float32)), r"rhs_scale must be float32 \(G, K / group, N\) = "
     r"\(3, 2560 / group, 300\).*got \(3, 21, 300\)"),  # 2560 / 21 rows: no whole group
    (dict(rhs_scale=jnp.ones((G, 2, N), jnp.float32)), r"the group one of \(32, 64, 128, 256, 512\)"),  # 1280 each
    (dict(rhs_scale=jnp.ones((G, 20, N - 1), jnp.float32)), r"got \(3, 20, 299\)"),
    (dict(rhs_scale=jnp.ones((G, 20, N), jnp.bfloat16)), r"or int4's float32 scales, got bfloat16 \(3, 20, 300\)"),
    (dict(lhs=jnp.ones((M, K), jnp.float16)), "lhs must be bfloat16 or float32"),
    (dict(transpose_rhs=True, rhs=jnp.ones((G, N, K // 2), jnp.uint8)), r"in the \[G, N, K / 2\] layout"),
])
def test_bad_input_is_named_before_any_kernel(change, match):
    args = dict(lhs=jnp.ones((M, K), jnp.bfloat16), rhs=jnp.ones((G, K // 2, N), jnp.uint8),
                group_sizes=jnp.asarray(SIZES, jnp.int32), rhs_scale=jnp.ones((G, K // GROUP, N), jnp.float32))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        ops.ragged_dot(**args)


@pytest.mark.parametrize("pass_", sample(["forward", "lhs_gradient"], {"forward"}))
def test_decode_compiles_for_v6e_reading_half_a_byte_per_weight(pass_):
    """Qwen3-30B-A3B's gate_up projection at a 64-token decode step (512 routed rows, 128 experts,
    H 2048, 2I 1536, held as quantize_int4 returns them, groups of 128), forward and lhs's gradient:
    one kernel within v6e's VMEM whose weight and scale operands are the arrays in HBM, and no XLA
    op copies either. (make test compiles the forward; the gradient's kernel runs in the tests
    above.)"""
    hidden, up = 2048, 1536
    assert_packed_decode_compiles(pass_, 512, (128, hidden // 2, up), (128, hidden // GROUP, up), jnp.float32)
