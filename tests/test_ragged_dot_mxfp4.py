"""ragged_dot and experts_forward with MXFP4 weights (gpt-oss's experts: two fp4 e2m1 codes per
byte along K, an e8m0 exponent per 32 weights): the kernel reads half a byte per weight and decodes
in VMEM. Against transformers' own dequantization (`convert_moe_packed_tensors`, what its Mxfp4
loader computes off CUDA) in interpret mode and the TPU interpreter, lhs's gradient too; bad input
named; a decode-sized call and its gradient compiled for v6e reading the packed bytes with no copy
before the kernel."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from jax.experimental.pallas import tpu as pltpu
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import tpu_compile
from sampling import sample
from ragged_dot import ops
from ragged_dot.kernel import MXFP4_PLANE_SCALE, BlockSizes, grouped_matmul, mxfp4_planes
from runtime.generations import GENERATIONS
from errors import max_abs, max_error

# K = 2112: 66 scales per column (padded to 96 rows as mxfp4_weights holds them); with blocks of
# 1024 the last K step is partial. N = 300: the last N tile partial. An empty group, rows past the
# groups.
G, K, N, M = 3, 2112, 300, 40
SIZES = (10, 0, 25)
# fp32: every decoded weight is exact in fp32 and the products run at HIGHEST: only the summation
# order differs. bf16: the output's rounding, half an ulp (2^-8 of the largest value).
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2 ** -8}


def _stored(seed=0, groups=G, k=K, n=N):
    """gpt-oss's stored experts: blocks uint8 [G, N, K / 32, 16] (every code, random), scales
    uint8 [G, N, K / 32] distinct per group, column and 32 weights (2^-9 .. 2^2)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (groups, n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(118, 130, (groups, n, k // 32), dtype=np.uint8)
    return blocks, scales


def _dequantized(blocks, scales):
    """transformers' dequantization in fp32: [G, K, N]."""
    weight = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    return jnp.asarray(weight.numpy())


def _reference(lhs, weight, sizes):
    return jax.lax.ragged_dot(lhs.astype(jnp.float32), weight, sizes, precision=jax.lax.Precision.HIGHEST)


def test_every_code_decodes_to_its_e2m1_value_times_its_scale():
    """Each byte's low nibble is the even K row, its high nibble the odd one; e2m1's subnormal (0.5)
    and signed zeros included; each group of 16 bytes (32 weights) takes its own scale."""
    codes = np.arange(256, dtype=np.uint8).reshape(16, 16).T  # column c: bytes 16c .. 16c + 15
    # One scale per column (16 bytes), 2^-119 .. 2^127, e8m0's whole range but its smallest (values
    # below float32's normal range, flushed on a TPU) and 255 (NaN): every plane value a normal float32.
    exponents = np.array([[8, 100, 120, 126, 127, 128, 129, 130, 140, 150, 160, 200, 240, 250, 254, 127]], np.int32)
    lo, hi = mxfp4_planes(jnp.asarray(codes), jnp.asarray(exponents), jnp.float32)
    values = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    power = np.exp2(exponents.astype(np.float64) - 127)
    for plane, nibbles in ((lo, codes & 15), (hi, codes >> 4)):  # the planes are the weights' 2^-6
        np.testing.assert_array_equal(np.asarray(plane, np.float64) * MXFP4_PLANE_SCALE, values[nibbles] * power)


@pytest.mark.parametrize("blocks", [None, BlockSizes(block_m=16, block_k=1024, block_n=128)],
                         ids=["table", "k_steps_and_n_tiles"])
@pytest.mark.parametrize("lhs_dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("padded", [True, False], ids=["held", "scales_unpadded"])
def test_matches_transformers_dequantized_weights(lhs_dtype, blocks, padded):
    stored_blocks, stored_scales = _stored()
    rhs, scales = ops.mxfp4_weights(jnp.asarray(stored_blocks), jnp.asarray(stored_scales))
    assert rhs.shape == (G, K // 2, N) and rhs.dtype == jnp.uint8 and scales.shape == (G, 96, N)
    if not padded:
        scales = scales[:, :K // 32].view(jnp.float8_e8m0fnu)  # and the e8m0 dtype, as torch may hold them
    lhs = jnp.asarray(np.random.default_rng(1).standard_normal((M, K)), jnp.float32).astype(lhs_dtype)
    sizes = jnp.asarray(SIZES, jnp.int32)
    out = ops.ragged_dot(lhs, rhs, sizes, rhs_scale=scales, blocks=blocks)
    want = _reference(lhs, _dequantized(stored_blocks, stored_scales), sizes)
    assert out.shape == (M, N) and out.dtype == lhs_dtype
    assert max_error(out.astype(jnp.float32), want) <= TOLERANCE[lhs_dtype] * max_abs(want)
    assert not np.any(np.asarray(out[sum(SIZES):])), "rows past the groups are zero"


def test_passes_the_tpu_interpreter():
    """Races, out-of-bounds DMAs and uninitialised reads (NaN-filled memory: the last K block's
    overhang must not reach the sum), three K steps and partial N tiles."""
    stored_blocks, stored_scales = _stored(seed=2)
    rhs, scales = ops.mxfp4_weights(jnp.asarray(stored_blocks), jnp.asarray(stored_scales))
    lhs = jnp.asarray(np.random.default_rng(3).standard_normal((M, K)), jnp.bfloat16)
    sizes = jnp.asarray(SIZES, jnp.int32)
    out = ops.ragged_dot(lhs, rhs, sizes, rhs_scale=scales, blocks=BlockSizes(16, 1024, 256),
                         interpret=pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan"))
    want = _reference(lhs, _dequantized(stored_blocks, stored_scales), sizes)
    assert max_error(out.astype(jnp.float32), want) <= TOLERANCE[jnp.bfloat16] * max_abs(want)


def test_experts_forward_matches_the_dequantized_experts():
    """gpt-oss's experts (transposed layout, interleaved clamped SwiGLU, biases), both projections
    MXFP4, against the same forward on transformers' dequantized fp32 weights."""
    rng = np.random.default_rng(4)
    tokens, hidden, inter, experts, top_k = 6, 128, 96, 4, 2
    up_blocks, up_scales = _stored(5, experts, hidden, 2 * inter)
    down_blocks, down_scales = _stored(6, experts, inter, hidden)
    up, up_scale = ops.mxfp4_weights(jnp.asarray(up_blocks), jnp.asarray(up_scales))
    down, down_scale = ops.mxfp4_weights(jnp.asarray(down_blocks), jnp.asarray(down_scales))
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1, (tokens, top_k)), jnp.float32)
    biases = (jnp.asarray(rng.standard_normal((experts, 2 * inter)), jnp.float32),
              jnp.asarray(rng.standard_normal((experts, hidden)), jnp.float32))
    gate = dict(activation=ops.CLAMPED_SWIGLU, interleaved=True, transposed=True, alpha=1.702, limit=7.0)
    got = ops.experts_forward(x, ids, weights, up, down, *biases, up_scale=up_scale, down_scale=down_scale, **gate)
    want = ops.experts_forward(x, ids, weights, _dequantized(up_blocks, up_scales),
                               _dequantized(down_blocks, down_scales), *biases, **gate)
    assert max_error(got, want) <= 1e-5 * max_abs(want)
    # A wrong shape is named as passed, with the weights its bytes hold.
    with pytest.raises(ValueError, match=r"down_proj \(4, 32, 128\) \(4-bit, two per byte: \(4, 64, 128\) weights\) should hold "
                                         r"\(4, 96, 128\) weights"):
        ops.experts_forward(x, ids, weights, up, down[:, :32], *biases, up_scale=up_scale, down_scale=down_scale, **gate)
    # MXFP4 bytes for one projection and weights for the other: named as such, not as a shape.
    with pytest.raises(ValueError, match=r"gate_up_proj is uint8 and down_proj float32: 4-bit experts \(uint8, MXFP4 or "
                                         r"int4\) hold both weights so, or neither does"):
        ops.experts_forward(x, ids, weights, up, _dequantized(down_blocks, down_scales), *biases, up_scale=up_scale,
                            **gate)


@pytest.mark.parametrize("change,match", [
    (dict(rhs_scale=None), r"rhs_scale must be its e8m0 exponents, uint8 or float8_e8m0fnu \(3, 66, 300\).*got none"),
    (dict(rhs_scale=jnp.ones((G, 66, N), jnp.float16)), r"or int4's float32 scales, got float16 \(3, 66, 300\)"),
    (dict(rhs_scale=jnp.ones((G, 67, N), jnp.uint8)), r"or 96 rows, padded as mxfp4_weights holds them"),
    (dict(rhs=jnp.ones((G, 1000, N), jnp.uint8), lhs=jnp.ones((M, 2000), jnp.bfloat16)),
     r"K = 2000\).*K a multiple of 32"),
    (dict(transpose_rhs=True, rhs=jnp.ones((G, N, K // 2), jnp.uint8)), r"in the \[G, N, K / 2\] layout"),
    (dict(lhs=jnp.ones((M, K), jnp.float16)), "lhs must be bfloat16 or float32"),
    (dict(rhs=jnp.ones((G, K, N), jnp.uint8)),
     r"rhs \(3, 2112, 300\) \(transpose_rhs=False, 4-bit: two weights per byte along K\) does not contract with "
     r"lhs \(40, 2112\)"),
])
def test_bad_input_is_named_before_any_kernel(change, match):
    args = dict(lhs=jnp.ones((M, K), jnp.bfloat16), rhs=jnp.ones((G, K // 2, N), jnp.uint8),
                group_sizes=jnp.asarray(SIZES, jnp.int32), rhs_scale=jnp.ones((G, 96, N), jnp.uint8))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        ops.ragged_dot(**args)


def test_lhs_gradient_and_none_for_the_frozen_weights():
    """d lhs = d out @ (the decoded weights)^T: the kernel contracting the weights' minor dim, the
    low nibbles giving the even columns and the high the odd (uint8 weights and exponents take no
    gradient in JAX)."""
    stored_blocks, stored_scales = _stored(seed=7)
    rhs, scales = ops.mxfp4_weights(jnp.asarray(stored_blocks), jnp.asarray(stored_scales))
    weight, sizes = _dequantized(stored_blocks, stored_scales), jnp.asarray(SIZES, jnp.int32)
    lhs = jnp.asarray(np.random.default_rng(8).standard_normal((M, K)), jnp.float32)
    cotangent = jnp.asarray(np.random.default_rng(9).standard_normal((M, N)), jnp.float32)
    got = jax.grad(lambda x: jnp.sum(ops.ragged_dot(x, rhs, sizes, rhs_scale=scales) * cotangent))(lhs)
    want = jax.grad(lambda x: jnp.sum(_reference(x, weight, sizes) * cotangent))(lhs)
    assert max_error(got, want) <= TOLERANCE[jnp.float32] * max_abs(want)
    assert not np.any(np.asarray(got[sum(SIZES):]))


@pytest.mark.parametrize("interpret", [True, pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")],
                         ids=["interpret", "tpu_interpreter"])
def test_lhs_gradient_kernel_over_pair_blocks_and_n_steps(interpret):
    """The gradient's kernel with blocks smaller than the weights: 3 blocks of 512 pairs (the last
    partial: its even and odd columns interleaved back and the overhang dropped) and 3 steps of 128
    along N (the last partial)."""
    stored_blocks, stored_scales = _stored(seed=10)
    rhs, scales = ops.mxfp4_weights(jnp.asarray(stored_blocks), jnp.asarray(stored_scales))
    weight = _dequantized(stored_blocks, stored_scales)
    rows = 48  # the kernel takes whole row tiles (ops pads M)
    grad_out = jnp.asarray(np.random.default_rng(11).standard_normal((rows, N)), jnp.float32)
    got = grouped_matmul(grad_out, rhs, jnp.asarray(SIZES, jnp.int32), blocks=BlockSizes(16, 128, 512),
                         transpose_rhs=True, out_dtype=jnp.float32, vmem_limit=32 << 20, interpret=interpret,
                         rhs_packed_scale=scales)
    want = jax.lax.ragged_dot(grad_out, jnp.swapaxes(weight, 1, 2), jnp.asarray(SIZES, jnp.int32),
                              precision=jax.lax.Precision.HIGHEST)
    assert got.shape == (rows, K)
    assert max_error(got, want) <= TOLERANCE[jnp.float32] * max_abs(want)


@pytest.mark.parametrize("pass_", sample(["forward", "lhs_gradient"], {"forward"}))
def test_decode_compiles_for_v6e_reading_half_a_byte_per_weight(pass_):
    """gpt-oss-20b's gate_up projection at a 64-token decode step (256 routed rows, 32 experts,
    H 2880, 2I 5760, held as mxfp4_weights returns them), forward and lhs's gradient: one kernel
    within v6e's VMEM whose weight and scale operands are the packed uint8 arrays in HBM, and no XLA
    op copies either. (make test compiles the forward; the gradient's kernel runs in the tests
    above.)"""
    hidden, up = 2880, 5760
    assert_packed_decode_compiles(pass_, 256, (32, hidden // 2, up), (32, ops.mxfp4_scale_rows(hidden), up), jnp.uint8)


def assert_packed_decode_compiles(pass_, rows, weights, scales, scale_dtype):
    """4-bit weights `weights` (uint8 [E, K / 2, N]) with scales `scales` of `scale_dtype`, `rows`
    routed rows, forward or lhs's gradient compiled for v6e: one kernel within VMEM whose weight and
    scale operands are the arrays in HBM, and no XLA op copies either."""
    experts, pairs, up = weights
    specs = [((rows, 2 * pairs), jnp.bfloat16), (weights, jnp.uint8), ((experts,), jnp.int32), (scales, scale_dtype)]

    def forward(lhs, rhs, sizes, scale):
        return ops.ragged_dot(lhs, rhs, sizes, rhs_scale=scale, generation="v6e", interpret=False)

    def lhs_gradient(lhs, rhs, sizes, scale, cotangent):
        return jax.vjp(lambda x: forward(x, rhs, sizes, scale), lhs)[1](cotangent)[0]

    fn = forward if pass_ == "forward" else lhs_gradient
    specs += [((rows, up), jnp.bfloat16)] if pass_ == "lhs_gradient" else []
    report = tpu_compile.compile_for(fn, specs, "v6e", "ragged_dot_tpu")
    assert len(report.kernels) == 1, report.kernels
    assert all(0 < k.vmem_bytes <= GENERATIONS["v6e"].vmem_bytes for k in report.kernels.values())
    operands = [s for kernel in report.kernels.values() if kernel.schedule for s in kernel.schedule.operand_shapes]
    scale_name = "u8" if scale_dtype == jnp.uint8 else "f32"
    held = [f"u8[{','.join(map(str, weights))}]", f"{scale_name}[{','.join(map(str, scales))}]"]
    assert all(h in operands for h in held), operands
    copies = [op for op in report.other_ops.values() if any(h in s for h in held for s in op.operand_shapes)]
    assert not copies, copies
