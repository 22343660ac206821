"""The JAX functions behind the torch ops; JAX users can call them directly.

`ragged_dot` is differentiable (`jax.custom_vjp`): the activations'
gradient is the same Pallas kernel with the weights' layout flipped, the
weights' gradient the transposed grouped matmul kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout

from ._shared.generations import GENERATIONS, current_generation, default_interpret
from ._shared.tuning import round_up
from . import fused
from .kernel import (INT4_GROUPS, MX_BLOCK, PACKED_CHUNK, SCALE_BLOCK, grouped_matmul, packed_k_step, ring_fits,
                     transposed_grouped_matmul)
from .tuning import choose_blocks, choose_weight_grad_blocks, forward_buffers, vmem_limit, weight_grad_buffers


def _resolve(generation, interpret):
    generation = generation or current_generation().name
    interpret = default_interpret() if interpret is None else interpret
    return generation, interpret


def _forward(lhs, rhs, group_sizes, transpose_rhs, generation, interpret, bias=None, fill_nan=None, rhs_scale=None,
             blocks=None):
    """blocks: the kernel's BlockSizes, or None: the generation's table (else its rule)."""
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    packed = rhs.dtype == jnp.uint8  # 4-bit weights, two per byte along K: MXFP4 or int4
    if m == 0:
        return jnp.zeros((0, 2 * n if packed and transpose_rhs else n), lhs.dtype)
    itemsize = jnp.dtype(lhs.dtype).itemsize
    given = blocks is not None
    blocks = blocks or choose_blocks(m, k, n, num_groups, generation, itemsize, transpose_rhs=transpose_rhs,
                                     weight_itemsize=rhs.dtype.itemsize)
    buffers = forward_buffers(blocks, itemsize)
    if packed and transpose_rhs:
        # lhs's gradient: N contracted, output columns in pairs of K (n counts pairs); pairs whole up
        # to half PACKED_MAX_BLOCK_K, else steps of it (its scales' block whole tiles)
        half = PACKED_MAX_BLOCK_K // 2
        blocks = dataclasses.replace(blocks, block_n=n if n <= half else half)
        buffers = forward_buffers(dataclasses.replace(blocks, block_n=2 * blocks.block_n), itemsize) \
            + 8 * PACKED_CHUNK * blocks.block_k * 4
    elif packed:
        # K whole up to PACKED_MAX_BLOCK_K (its scales' block is then all their rows), else steps of
        # it; the buffers as for weights of lhs's dtype, plus one chunk's decoding temporaries.
        step = packed_k_step(rhs_scale.dtype, 0 if rhs_scale.dtype == jnp.uint8 else k // rhs_scale.shape[1])
        if not given:
            blocks = dataclasses.replace(blocks, block_k=k if k <= PACKED_MAX_BLOCK_K else PACKED_MAX_BLOCK_K)
        elif blocks.block_k < k and blocks.block_k % step:
            raise ValueError(f"blocks.block_k is {blocks.block_k}: with 4-bit weights all of K ({k}) or a "
                             f"multiple of {step} (whole tiles of their scales)")
        buffers = forward_buffers(blocks, itemsize) + 8 * PACKED_CHUNK * blocks.block_n * 4
    ring_misfits = blocks.weight_buffers > 2 and not ring_fits(rhs.shape, transpose_rhs, packed, blocks)
    if ring_misfits and not given:  # a table entry's ring, for a call whose blocks are not whole: Pallas's two
        blocks = dataclasses.replace(blocks, weight_buffers=2)
    elif blocks.weight_buffers < 2 or ring_misfits:
        raise ValueError(f"blocks.weight_buffers is {blocks.weight_buffers} for weights {tuple(rhs.shape)} at "
                         f"block_k {blocks.block_k}, block_n {blocks.block_n}: 2, or more where every block is "
                         "whole (block_k all of K or dividing it, block_n likewise; not 4-bit weights in lhs's "
                         "gradient)")
    padded = round_up(m, blocks.block_m)
    lhs_padded = jnp.pad(lhs, ((0, padded - m), (0, 0))) if padded != m else lhs
    per_channel = rhs_scale is not None and rhs_scale.ndim == 2
    out = grouped_matmul(
        lhs_padded, rhs, group_sizes.astype(jnp.int32), blocks=blocks, transpose_rhs=transpose_rhs,
        out_dtype=lhs.dtype, vmem_limit=vmem_limit(buffers, generation), interpret=interpret,
        bias=bias, fill_nan=fill_nan, rhs_scale=rhs_scale if per_channel else None,
        rhs_block_scale=rhs_scale if rhs_scale is not None and not per_channel and not packed else None,
        rhs_packed_scale=rhs_scale if packed else None,
    )
    return out[:m]


PACKED_MAX_BLOCK_K = 4096  # K steps of 4-bit weights: a multiple of every packed_k_step (whole tiles of scales)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _ragged_dot(lhs, rhs, group_sizes, bias, fill_nan, rhs_scale, transpose_rhs, generation, interpret, blocks=None):
    """bias: [G, N] added to each group's rows inside the kernel, or None.
    fill_nan: a bool scalar, or None: rows past the groups are NaN, not zero.
    rhs_scale: float32 scales of a quantized rhs, or None: [G, N] per output channel, or
      [G, cdiv(N, 128), cdiv(K, 128)] per 128 x 128 block (N-major whatever rhs's layout); or
      of 4-bit weights (uint8 [G, K / 2, N]): uint8 e8m0 exponents [G, K / 32 (padded), N] (MXFP4),
      float32 [G, K / group, N] (int4).
    blocks: the forward kernel's BlockSizes, or None (the table's); the gradients take the table's."""
    return _forward(lhs, rhs, group_sizes, transpose_rhs, generation, interpret, bias, fill_nan, rhs_scale, blocks)


def _ragged_dot_fwd(lhs, rhs, group_sizes, bias, fill_nan, rhs_scale, transpose_rhs, generation, interpret,
                    blocks=None):
    out = _forward(lhs, rhs, group_sizes, transpose_rhs, generation, interpret, bias, fill_nan, rhs_scale, blocks)
    return out, (lhs, rhs, group_sizes, bias, rhs_scale)


def _ragged_dot_bwd(transpose_rhs, generation, interpret, blocks, residuals, grad_out):
    lhs, rhs, group_sizes, bias, rhs_scale = residuals
    grad_bias, segment = None, None
    if bias is not None or rhs_scale is not None:  # each row's group (rows past the groups: segment G)
        segment = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(lhs.shape[0]), side="right")
    if bias is not None:  # d bias[g] = the sum of grad_out over g's rows (segment G dropped)
        grad_bias = jax.ops.segment_sum(grad_out.astype(jnp.float32), segment, num_segments=bias.shape[0] + 1)
        grad_bias = grad_bias[:-1].astype(bias.dtype)
    if rhs.dtype == jnp.uint8:
        # 4-bit weights: d lhs = grad_out @ (the decoded weights)^T, the kernel contracting the weights' minor
        # dim; frozen weights, no gradient for them or their exponents.
        grad_lhs = _forward(grad_out.astype(lhs.dtype), rhs, group_sizes, not transpose_rhs, generation, interpret,
                            rhs_scale=rhs_scale)
        return grad_lhs, None, None, grad_bias, None, None
    if rhs_scale is not None and rhs_scale.ndim == 3:
        # Per block: d lhs = grad_out @ (rhs * scales)^T, the same kernel with the layout and the
        # scales' [N blocks, K blocks] flipped. A quantized, frozen weight gets no gradient.
        grad_lhs = _forward(grad_out.astype(lhs.dtype), rhs, group_sizes, not transpose_rhs, generation, interpret,
                            rhs_scale=jnp.swapaxes(rhs_scale, 1, 2))
        return grad_lhs, None, None, grad_bias, None, None
    if rhs_scale is not None:
        # The weight is rhs * scale per output channel: d lhs = (grad_out * scale[row's group]) @ rhs^T.
        # A quantized, frozen weight gets no gradient (adapters train around it).
        scales = jnp.concatenate([rhs_scale, jnp.zeros((1, rhs_scale.shape[1]), rhs_scale.dtype)])[segment]
        grad_lhs = _forward((grad_out.astype(jnp.float32) * scales).astype(lhs.dtype), rhs, group_sizes,
                            not transpose_rhs, generation, interpret)
        return grad_lhs, None, None, grad_bias, None, None
    grad_out = grad_out.astype(lhs.dtype)
    # d lhs[rows of g] = grad_out[rows] @ rhs[g]^T: the same kernel, layout flipped.
    grad_lhs = _forward(grad_out, rhs, group_sizes, not transpose_rhs, generation, interpret)
    # d rhs[g] = lhs[rows of g]^T @ grad_out[rows] (or its transpose).
    a, b = (grad_out, lhs) if transpose_rhs else (lhs, grad_out)
    grad_rhs = _weight_grad(a, b, group_sizes, rhs.dtype, generation, interpret)
    return grad_lhs, grad_rhs, None, grad_bias, None, None


def _weight_grad(a, b, group_sizes, out_dtype, generation, interpret, blocks=None):
    """[M, P], [M, Q] -> [G, P, Q]: per group, a[rows]^T @ b[rows]. blocks: as _forward's."""
    m, p = a.shape
    q = b.shape[1]
    num_groups = group_sizes.shape[0]
    if m == 0:
        return jnp.zeros((num_groups, p, q), out_dtype)
    itemsize = jnp.dtype(a.dtype).itemsize
    blocks = blocks or choose_weight_grad_blocks(m, p, q, num_groups, generation, itemsize)
    return transposed_grouped_matmul(
        a, b, group_sizes.astype(jnp.int32), blocks=blocks, out_dtype=out_dtype,
        vmem_limit=vmem_limit(weight_grad_buffers(blocks, itemsize), generation),
        sub_rows=GENERATIONS[generation].mxu_width, interpret=interpret,
    )


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


def _shape_of(name, shape, ndim):
    shape = tuple(shape)
    if len(shape) != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {shape}")
    return shape


def weight_shape(shape, dtype, transpose_rhs=False) -> tuple[int, ...]:
    """The weights' logical [G, K, N] (or [G, N, K]) shape: 4-bit weights' bytes hold two each along K."""
    shape = tuple(shape)
    if dtype != jnp.uint8 or len(shape) != 3:
        return shape
    return (shape[0], shape[1], 2 * shape[2]) if transpose_rhs else (shape[0], 2 * shape[1], shape[2])


def check_ragged_dot_shapes(lhs, rhs, group_sizes, transpose_rhs, packed=False):
    """Shape checks shared by the JAX and torch entry points (shapes only; `packed`: rhs holds two
    4-bit weights per byte along K)."""
    m, k = _shape_of("lhs", lhs, 2)
    rhs = _shape_of("rhs", rhs, 3)
    (groups,) = _shape_of("group_sizes", group_sizes, 1)
    held = weight_shape(rhs, jnp.uint8, transpose_rhs) if packed else rhs
    if held[2 if transpose_rhs else 1] != k:
        packing = ", 4-bit: two weights per byte along K" if packed else ""
        raise ValueError(f"rhs {rhs} (transpose_rhs={transpose_rhs}{packing}) does not contract with lhs {(m, k)}")
    if groups != rhs[0]:
        raise ValueError(f"group_sizes has {groups} groups, rhs has {rhs[0]}")


# down_proj's hidden and intermediate dims may each be zero-padded to a multiple of this: a TPU holds
# [E, H, I] with both unaligned (Gemma 4's 2112 and 704) experts-minor, which the kernel cannot read
# without a copy of the whole tensor per call; padded, experts-major (quantize_experts pads so).
DOWN_PAD = 128


def padded_down_shape(shape) -> tuple[int, ...]:
    """down_proj's [E, A, B] with A and B zero-padded to multiples of DOWN_PAD (as pad_experts and
    quantize_experts hold it)."""
    return (shape[0], *(-(-n // DOWN_PAD) * DOWN_PAD for n in shape[1:]))


def check_experts_shapes(hidden_states, top_k_index, top_k_weights, up_proj, down_proj,
                         up_bias=(0,), down_bias=(0,), *, gated=True, transposed=False, packed=False):
    """Shapes of an experts layer: up_proj [E, U, H] (U = 2I gated, else I)
    and down_proj [E, H, I], or [E, H, U] and [E, I, H] when transposed, its
    H and I each optionally zero-padded to a multiple of DOWN_PAD;
    biases [E, U] and [E, H], or empty for none. packed: both weights' bytes hold two 4-bit weights
    each along the contraction (errors name the shapes as passed, and the weights they hold)."""
    tokens, hidden = _shape_of("hidden_states", hidden_states, 2)
    name = "gate_up_proj" if gated else "up_proj"

    def weights(weight_name, shape):
        given = _shape_of(weight_name, shape, 3)
        if not packed:
            return given, f"{weight_name} {given}"
        held = weight_shape(given, jnp.uint8, not transposed)
        return held, f"{weight_name} {given} (4-bit, two per byte: {held} weights)"

    (up, up_named), (down, down_named) = weights(name, up_proj), weights("down_proj", down_proj)
    experts, up_out, up_in = (up[0], up[2], up[1]) if transposed else up
    if up_in != hidden or (gated and up_out % 2):
        raise ValueError(f"{up_named} does not fit hidden_states {(tokens, hidden)} (transposed={transposed})")
    inter = up_out // 2 if gated else up_out
    want = (experts, inter, hidden) if transposed else (experts, hidden, inter)
    padded = padded_down_shape(want)
    if not all(d in (w, p) for d, w, p in zip(down, want, padded)):
        either = f" (or zero-padded to multiples of {DOWN_PAD} in either dim)" if padded != want else ""
        raise ValueError(f"{down_named} should hold {want} weights{either}")
    for bias_name, bias, width in ((name + "_bias", up_bias, up_out), ("down_proj_bias", down_bias, hidden)):
        if tuple(bias) not in ((0,), (experts, width)):
            raise ValueError(f"{bias_name} {tuple(bias)} should be {(experts, width)}")
    index = _shape_of("top_k_index", top_k_index, 2)
    weights = _shape_of("top_k_weights", top_k_weights, 2)
    if index != weights or index[0] != tokens:
        raise ValueError(f"top_k_index {index} and top_k_weights {weights} must both be [T, k] with T = {tokens}")


def walkable_group_sizes(group_sizes: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """(sizes, valid), on the device: whether group_sizes is valid (non-negative, summing to at
    most num_rows), and sizes the kernels can walk whatever it holds: itself when valid, else
    all zero (every row past the groups: the forward kernel fills them with NaN when told to,
    so the whole output reports it, and no matmul runs).
    No kernel reads past num_rows either way. Sizes clipped to num_rows + 1 make a running sum
    pass num_rows before it could wrap int32 (num_rows < 2^30), so checking it is exact."""
    running = jnp.cumsum(jnp.clip(group_sizes, 0, num_rows + 1))
    valid = jnp.all(group_sizes >= 0) & jnp.all(running <= num_rows)
    return jnp.where(valid, group_sizes, 0).astype(jnp.int32), valid


def stored_order(shape, dtype) -> tuple[int, ...] | None:
    """The dims of an array of `shape` in the order (major to minor) a TPU holds it in HBM by
    default, or None off-TPU (row-major). libtpu may store a dim that is a multiple of 128 minor-most
    rather than an unaligned last dim (Gemma 4's gate_up_proj [128, 1408, 2112] is held as
    [128, 2112, 1408]). The target is jax's default device (the AOT topology's while compiling
    ahead of time), else the first device."""
    device = jax.config.jax_default_device
    if not isinstance(device, jax.Device):
        device = jax.devices(device)[0] if isinstance(device, str) else jax.devices()[0]
    if device.platform != "tpu":
        return None
    try:
        layout = device.client.get_default_layout(jnp.dtype(dtype), tuple(shape), device)
    except jax.errors.JaxRuntimeError:  # a client that does not say: take row-major
        return None
    return tuple(Layout.from_pjrt_layout(layout).major_to_minor)


def as_stored(rhs, transpose_rhs: bool, order=None):
    """(rhs, transpose_rhs) viewed in the order the weights are stored (`stored_order`, or `order`).

    A Pallas kernel takes its operands row-major, so weights [G, A, B] held as [G, B, A] reach it
    through a copy of the whole tensor on every call. Viewed swapped (transpose_rhs flipped, the
    same product) they are row-major as held: XLA makes the swap a bitcast, and the gradient
    flows back through it. Weights held with the group dim not major (libtpu stores Gemma 4's
    down_proj [128, 2112, 704] as [2112, 704, 128]) have no such view and are left as they are:
    XLA copies them."""
    if rhs.dtype == jnp.uint8:  # 4-bit: the kernel takes [G, K / 2, N] only (XLA copies another held layout)
        return rhs, transpose_rhs
    order = stored_order(rhs.shape, rhs.dtype) if order is None else tuple(order)
    if order == (0, 2, 1):
        return jnp.swapaxes(rhs, 1, 2), not transpose_rhs
    return rhs, transpose_rhs


def ragged_dot(lhs, rhs, group_sizes, *, rhs_scale=None, transpose_rhs=False, generation=None, interpret=None,
               blocks=None):
    """Grouped matmul with `jax.lax.ragged_dot` semantics.

    Args:
      lhs: [M, K], rows sorted by group (bf16 or fp32).
      rhs: [G, K, N], or [G, N, K] with transpose_rhs (transformers' layout): lhs's dtype, or
        quantized (int8, float8_e4m3fn) with rhs_scale; or 4-bit, uint8 [G, K / 2, N], two codes
        per byte along K (low nibble first), not transposed: MXFP4 (gpt-oss's experts, fp4 e2m1
        codes: `mxfp4_weights` lays out gpt-oss's stored blocks so, once), or int4 (two's
        complement codes: `quantize_int4` makes them from float weights).
      group_sizes: int32 [G], rows per group, summing to at most M.
      rhs_scale: float32 scales of int8 or fp8 weights, as quantized checkpoints hold them: [G, N],
        the weight is rhs times this per output channel; or one per SCALE_BLOCK x SCALE_BLOCK
        (128 x 128) block of rhs, laid out as rhs ([G, cdiv(K, 128), cdiv(N, 128)], or
        [G, cdiv(N, 128), cdiv(K, 128)] with transpose_rhs: FineGrainedFP8's weight_scale_inv).
        The kernel reads rhs as stored (a byte per weight) and scales the fp32 products; lhs's
        gradient flows, rhs gets none (a frozen quantized weight). MXFP4: uint8 (or
        float8_e8m0fnu) e8m0 exponents [G, K / 32, N], one per 32 weights along K; the kernel
        reads half a byte per weight and decodes them in VMEM; lhs's gradient flows, the weights get none.
        int4: float32 [G, K / group, N], a scale per `group` weights along K (group one of
        kernel.INT4_GROUPS, dividing K), decoded alike.
      generation: TPU generation whose block table to use ("v5e", "v5p",
        "v6e", "tpu7x"); default: the current device's.
      interpret: False compiles for the TPU; True or a
        `pltpu.InterpretParams` interprets (default: True off-TPU).
      blocks: the forward kernel's `kernel.BlockSizes` (block_m rows by block_k by block_n, as
        the weights are stored: see `as_stored`), or None for the generation's tuned table; the
        gradients take the table's.

    Returns [M, N] in lhs's dtype (accumulated in fp32); rows past
    sum(group_sizes) are zero. Invalid group_sizes (a negative size, a sum
    past M) make the whole output NaN: checked on the device, with no
    round trip to the host, and no kernel reads outside its inputs.
    """
    check_ragged_dot_shapes(lhs.shape, rhs.shape, group_sizes.shape, transpose_rhs, packed=rhs.dtype == jnp.uint8)
    check_rhs_scale(lhs.dtype, rhs, rhs_scale, transpose_rhs)
    generation, interpret = _resolve(generation, interpret)
    sizes, valid = walkable_group_sizes(group_sizes.astype(jnp.int32), lhs.shape[0])
    # The report is the kernel's own fill: a select over the output after the kernel changes how
    # libtpu compiles the kernel itself (in the bench its 4 predicated regions became 1), and one
    # over lhs before it is a pass over lhs (at prefill, 15% of the kernel's modeled time).
    rhs_scale = n_major(rhs_scale, transpose_rhs, rhs.dtype)
    rhs, transpose_rhs = as_stored(rhs, transpose_rhs)
    return _ragged_dot(lhs, rhs, sizes, None, jnp.logical_not(valid), rhs_scale, transpose_rhs, generation, interpret,
                       blocks)


QUANTIZED = (jnp.int8, jnp.float8_e4m3fn)  # weight dtypes that come with float32 scales
MXFP4_SCALES = (jnp.uint8, jnp.float8_e8m0fnu)  # MXFP4 weights' (uint8) e8m0 exponents, either dtype


def n_major(scale, transpose_rhs: bool, rhs_dtype):
    """Scales as the kernels take them: per channel [G, N] as given; per block, laid out as the
    weights, [G, N blocks, K blocks] (a swap of the small scale array when the weights are [G, K, N]);
    4-bit weights' scales [G, K / group, N] as given (MXFP4's e8m0 exponents as uint8)."""
    if scale is not None and scale.dtype in MXFP4_SCALES:
        return jax.lax.bitcast_convert_type(scale, jnp.uint8) if scale.dtype != jnp.uint8 else scale
    per_block = scale is not None and scale.ndim == 3 and rhs_dtype != jnp.uint8
    return jnp.swapaxes(scale, 1, 2) if per_block and not transpose_rhs else scale


def check_rhs_scale(lhs_dtype, rhs, rhs_scale, transpose_rhs, names=("lhs", "rhs", "rhs_scale")) -> None:
    """A quantized rhs needs its float32 scales, per output channel or per 128 x 128 block (see
    `ragged_dot`); other weights are floating point. names: the three arguments as the caller passed
    them."""
    lhs_name, rhs_name, scale_name = names
    if rhs.dtype == jnp.uint8:
        check_packed_scale(lhs_dtype, rhs, rhs_scale, transpose_rhs, names)
        return
    quantized = any(rhs.dtype == d for d in QUANTIZED)
    if not quantized and (not jnp.issubdtype(rhs.dtype, jnp.floating) or jnp.dtype(rhs.dtype).itemsize == 1):
        raise ValueError(f"{rhs_name} is {rhs.dtype}: weights are floating point, or int8 or float8_e4m3fn "
                         f"with {scale_name}, or uint8 (4-bit: MXFP4 or int4) with its {scale_name}")
    if rhs_scale is None:
        if quantized:
            raise ValueError(f"{rhs_name} is {rhs.dtype}: {scale_name} (its float32 scales, per output channel or "
                             f"per {SCALE_BLOCK} x {SCALE_BLOCK} block) is required")
        return
    per_channel = (rhs.shape[0], rhs.shape[1] if transpose_rhs else rhs.shape[2])
    per_block = (rhs.shape[0], *(-(-d // SCALE_BLOCK) for d in rhs.shape[1:]))
    if not quantized:
        raise ValueError(f"{scale_name} is for int8 or float8_e4m3fn weights, {rhs_name} is {rhs.dtype}")
    if tuple(rhs_scale.shape) not in (per_channel, per_block) or rhs_scale.dtype != jnp.float32:
        raise ValueError(f"{scale_name} must be float32 {per_channel} (per group and output channel) or "
                         f"{per_block} (per {SCALE_BLOCK} x {SCALE_BLOCK} block of {rhs_name}), "
                         f"got {rhs_scale.dtype} {tuple(rhs_scale.shape)}")
    if lhs_dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"{lhs_name} must be bfloat16 or float32 with quantized weights, got {lhs_dtype}")


def check_packed_scale(lhs_dtype, rhs, rhs_scale, transpose_rhs, names) -> None:
    """4-bit weights: uint8 [G, K / 2, N] (not transposed) with MXFP4's e8m0 exponents
    [G, K / 32, N], or int4's float32 scales [G, K / group, N]."""
    lhs_name, rhs_name, scale_name = names
    if transpose_rhs:
        raise ValueError(f"{rhs_name} is uint8 (4-bit) in the [G, N, K / 2] layout: the kernel takes it as "
                         f"[G, K / 2, N] (mxfp4_weights and quantize_int4 lay weights out so)")
    groups, k, n = weight_shape(rhs.shape, rhs.dtype)
    if rhs_scale is not None and rhs_scale.dtype == jnp.float32:  # int4 with a scale per group along K
        group = k // rhs_scale.shape[1] if rhs_scale.ndim == 3 and rhs_scale.shape[1] else 0
        if rhs_scale.ndim != 3 or (rhs_scale.shape[0], rhs_scale.shape[2]) != (groups, n) or group not in INT4_GROUPS \
                or group * rhs_scale.shape[1] != k:
            raise ValueError(f"{rhs_name} is uint8 (int4, K = {k}): {scale_name} must be float32 (G, K / group, N) "
                             f"= ({groups}, {k} / group, {n}), a scale per group of K rows, the group one of "
                             f"{INT4_GROUPS} dividing K; got {tuple(rhs_scale.shape)}")
        if lhs_dtype not in (jnp.bfloat16, jnp.float32):
            raise ValueError(f"{lhs_name} must be bfloat16 or float32 with quantized weights, got {lhs_dtype}")
        return
    rows = (k // MX_BLOCK, mxfp4_scale_rows(k))
    ok = rhs_scale is not None and rhs_scale.dtype in MXFP4_SCALES and rhs_scale.ndim == 3 and k % MX_BLOCK == 0
    if not ok or (rhs_scale.shape[0], rhs_scale.shape[2]) != (groups, n) or rhs_scale.shape[1] not in rows:
        got = "none" if rhs_scale is None else f"{rhs_scale.dtype} {tuple(rhs_scale.shape)}"
        raise ValueError(f"{rhs_name} is uint8 (MXFP4, K = {k}): {scale_name} must be its e8m0 exponents, uint8 or "
                         f"float8_e8m0fnu {(groups, rows[0], n)} (one per {MX_BLOCK} weights along K, K a multiple "
                         f"of {MX_BLOCK}; or {rows[1]} rows, padded as mxfp4_weights holds them), or int4's "
                         f"float32 scales, got {got}")
    if lhs_dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"{lhs_name} must be bfloat16 or float32 with quantized weights, got {lhs_dtype}")


def mxfp4_scale_rows(k: int) -> int:
    """MXFP4 scales' rows as `mxfp4_weights` holds them: K / 32 rounded up to whole uint8 tiles (32
    rows), which the kernel reads as stored; unpadded, XLA copies them into that tiling per call."""
    return round_up(k // MX_BLOCK, 32)


def mxfp4_weights(blocks, scales):
    """gpt-oss's stored MXFP4 experts (`*_blocks` uint8 [E, N, K / 32, 16], `*_scales` uint8 [E, N,
    K / 32], as transformers' Mxfp4 loader holds them) -> (weights uint8 [E, K / 2, N], scales uint8
    [E, mxfp4_scale_rows(K), N]), the layout `ragged_dot` and `experts_forward` (transposed) take:
    the same bytes K-major, so each 32-weight scale serves 16 rows of a block, the scales' rows
    padded with zeros (never read). A one-time transform at load."""
    experts, n, k_blocks, pairs = blocks.shape
    weights = jnp.swapaxes(blocks.reshape(experts, n, k_blocks * pairs), 1, 2)
    scales = jnp.swapaxes(n_major(scales, True, jnp.uint8), 1, 2)  # e8m0 as its bits (uint8)
    rows = mxfp4_scale_rows(k_blocks * MX_BLOCK)
    return weights, jnp.pad(scales, ((0, 0), (0, rows - k_blocks), (0, 0)))


def quantize_int4(weights, group: int = 128):
    """Float weights [G, K, N] -> (uint8 [G, K / 2, N], float32 [G, K / group, N]): int4 weights as
    `ragged_dot` takes them, symmetric per group of `group` K rows and output column (the group's
    largest magnitude maps to 7, codes rounded to nearest, -8 unused), two codes per byte along K,
    the even row in the low nibble."""
    g, k, n = weights.shape
    if group not in INT4_GROUPS or k % group:
        raise ValueError(f"group must be one of {INT4_GROUPS} and divide K ({k}), got {group}")
    grouped = weights.astype(jnp.float32).reshape(g, k // group, group, n)
    # An all-zero group keeps a normal scale (and quantizes to zeros).
    scale = jnp.maximum(jnp.max(jnp.abs(grouped), axis=2) / 7, jnp.finfo(jnp.float32).tiny)
    codes = jnp.clip(jnp.round(grouped / scale[:, :, None]), -8, 7).astype(jnp.int8).reshape(g, k // 2, 2, n)
    nibbles = jax.lax.bitcast_convert_type(codes, jnp.uint8) & 15
    return nibbles[:, :, 0] | (nibbles[:, :, 1] << 4), scale


def route(top_k_index, num_experts, top_k_weights=None):
    """Sorts (token, slot) pairs by expert.

    Returns (order, group_sizes): `order[r]` is the flat (token * k + slot)
    index of sorted row r; the expert-parallel sentinel id `num_experts`
    sorts last and is in no group, so its rows are never computed. With
    top_k_weights, also each sorted row's weight (sorted along: no gather).
    """
    flat = top_k_index.reshape(-1)
    group_sizes = jnp.bincount(flat, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    if top_k_weights is None:
        return jnp.argsort(flat, stable=True), group_sizes
    _, order, weights = jax.lax.sort((flat, jnp.arange(flat.shape[0], dtype=jnp.int32), top_k_weights.reshape(-1)),
                                     num_keys=1, is_stable=True)
    return order, group_sizes, weights


# Activations by name; the torch layer maps transformers' modules to these.
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),
}
# gpt-oss's gate: clamp, then gate * sigmoid(alpha * gate) * (up + 1).
CLAMPED_SWIGLU = "clamped_swiglu"


def apply_gate(h, *, activation, gated, interleaved, alpha, limit):
    """The expert's nonlinearity on the up projection h, in fp32. h is split before it is widened:
    XLA then fuses the widening, the gate and the product into one pass over h, where a widened h
    is written to HBM and read back (the gate reads two slices of it)."""
    if not gated:
        return ACTIVATIONS[activation](h.astype(jnp.float32))
    gate, up = (h[:, ::2], h[:, 1::2]) if interleaved else jnp.split(h, 2, axis=-1)
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if activation == CLAMPED_SWIGLU:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1) * gate * jax.nn.sigmoid(gate * alpha)
    return ACTIVATIONS[activation](gate) * up


def experts_forward(
    hidden_states, top_k_index, top_k_weights, up_proj, down_proj, up_bias=None, down_bias=None,
    *, activation="silu", gated=True, interleaved=False, transposed=False, alpha=0.0, limit=0.0,
    up_scale=None, down_scale=None, generation=None, interpret=None,
):
    """Transformers' experts forward as two grouped matmuls, for every layout
    transformers uses; a decode step of at most `fused.FUSED_TOKENS` tokens as
    one kernel where its experts allow (`fused_decode_applies`).

    hidden_states [T, H]; top_k_index int32 [T, k] (id E: routed to another
    expert-parallel shard, costs nothing, contributes zero); top_k_weights
    [T, k]. up_proj is gate_up_proj [E, 2I, H] (gate then up, or interleaved)
    when gated, else up_proj [E, I, H]; down_proj [E, H, I]; with
    `transposed` they are [E, H, U] and [E, I, H]. down_proj's H and I may
    each be zero-padded to a multiple of 128 (`DOWN_PAD`): a TPU holds it
    experts-major then, where with both unaligned it is held experts-minor
    and copied every call (`quantize_experts` pads so). Biases [E, U] and [E, H]
    (None or empty: no bias). activation: a key of ACTIVATIONS, or
    CLAMPED_SWIGLU with alpha and limit. up_scale and down_scale: float32
    scales of int8 or float8_e4m3fn weights, per output channel ([E, U],
    [E, H]) or per 128 x 128 block laid out as the weights; or 4-bit weights
    (transposed: uint8 [E, H / 2, U] and [E, I / 2, H]) with their MXFP4 e8m0
    exponents or int4 float32 group scales (see `ragged_dot`, `mxfp4_weights` and
    `quantize_int4`). Returns [T, H]. An id outside
    [0, E] makes the whole output NaN: checked on the device, with no round
    trip to the host (such rows are never multiplied: routing cannot place
    a row outside the groups).
    """
    up_bias = None if up_bias is None or up_bias.size == 0 else up_bias
    down_bias = None if down_bias is None or down_bias.size == 0 else down_bias
    up_name = "gate_up_proj" if gated else "up_proj"
    packed = up_proj.dtype == jnp.uint8
    if packed != (down_proj.dtype == jnp.uint8):  # the shapes below are read as 4-bit bytes or as weights
        raise ValueError(f"{up_name} is {up_proj.dtype} and down_proj {down_proj.dtype}: 4-bit experts (uint8, MXFP4 "
                         "or int4) hold both weights so, or neither does")
    check_experts_shapes(hidden_states.shape, top_k_index.shape, top_k_weights.shape, up_proj.shape, down_proj.shape,
                         (0,) if up_bias is None else up_bias.shape, (0,) if down_bias is None else down_bias.shape,
                         gated=gated, transposed=transposed, packed=packed)
    for weights, scale, names in ((up_proj, up_scale, ("hidden_states", up_name, "up_scale")),
                                  (down_proj, down_scale, ("hidden_states", "down_proj", "down_scale"))):
        check_rhs_scale(hidden_states.dtype, weights, scale, not transposed, names)
    if activation != CLAMPED_SWIGLU and activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; known: {sorted(ACTIVATIONS)} and {CLAMPED_SWIGLU!r}")
    generation, interpret = _resolve(generation, interpret)
    num_experts = up_proj.shape[0]
    ids = jnp.clip(top_k_index, 0, num_experts)  # what the kernels walk; invalid ids are reported below
    options = dict(activation=activation, gated=gated, interleaved=interleaved, transposed=transposed, alpha=alpha,
                   limit=limit, generation=generation, interpret=interpret)
    if fused_decode_applies(hidden_states, ids, up_proj, down_proj, up_bias, down_bias, up_scale, down_scale,
                            **options):
        out = _fused_decode(hidden_states, ids, top_k_weights, up_proj, down_proj, up_scale, down_scale,
                            tuple(options.items()))
    else:
        out = _grouped_experts(hidden_states, ids, top_k_weights, up_proj, down_proj, up_bias, down_bias, up_scale,
                               down_scale, **options)
    ids_valid = jnp.all((top_k_index >= 0) & (top_k_index <= num_experts))
    return jnp.where(ids_valid, out, jnp.nan).astype(hidden_states.dtype)


def fused_decode_applies(hidden_states, ids, up_proj, down_proj, up_bias, down_bias, up_scale, down_scale, *,
                         activation, gated, interleaved, transposed, generation, **_) -> bool:
    """Whether `experts_forward` runs as one kernel (`fused.fused_experts`): a step of at most
    FUSED_TOKENS tokens (where one kernel's single wait for its first copies and single last step
    beat the grouped path's two kernels, modeled on every generation), experts with gate then up
    rows, no biases, dims multiples of 128, held as laid out; in bf16 or float32 (the tokens' dtype),
    or int8 with a scale per output channel."""
    if (ids.shape[0] > fused.FUSED_TOKENS or not gated or interleaved or transposed or activation not in ACTIVATIONS
            or up_bias is not None or down_bias is not None):
        return False
    scaled = up_scale is not None
    if scaled:
        per_channel = up_scale.ndim == 2 and down_scale is not None and down_scale.ndim == 2
        if not (per_channel and up_proj.dtype == down_proj.dtype == jnp.int8
                and hidden_states.dtype in (jnp.bfloat16, jnp.float32)):
            return False
    elif not (hidden_states.dtype == up_proj.dtype == down_proj.dtype and up_proj.dtype in (jnp.bfloat16, jnp.float32)):
        return False
    num_experts, two_inter, hidden = up_proj.shape
    if down_proj.shape != (num_experts, hidden, two_inter // 2) or two_inter % (2 * fused.BLOCKS.chunk) or hidden % 128:
        return False
    row_major = (None, (0, 1, 2))
    return (stored_order(up_proj.shape, up_proj.dtype) in row_major
            and stored_order(down_proj.shape, down_proj.dtype) in row_major
            and fused.fits(hidden_states.shape[0], hidden, up_proj.dtype, generation, scaled))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _fused_decode(hidden_states, ids, top_k_weights, up_proj, down_proj, up_scale, down_scale, options):
    """The fused kernel forward; its gradient is the grouped path's (a decode step is rarely
    differentiated; the grouped kernels' backward serves it)."""
    o = dict(options)
    return fused.experts_forward_fused(hidden_states, ids, top_k_weights, up_proj, down_proj, up_scale, down_scale,
                                       activation=ACTIVATIONS[o["activation"]], generation=o["generation"],
                                       interpret=o["interpret"])


def _fused_decode_fwd(hidden_states, ids, top_k_weights, up_proj, down_proj, up_scale, down_scale, options):
    out = _fused_decode(hidden_states, ids, top_k_weights, up_proj, down_proj, up_scale, down_scale, options)
    return out, (hidden_states, ids, top_k_weights, up_proj, down_proj, up_scale, down_scale)


def _fused_decode_bwd(options, residuals, grad_out):
    hidden_states, ids, top_k_weights, up_proj, down_proj, up_scale, down_scale = residuals
    o = dict(options)
    if up_scale is None:
        grouped = lambda x, w, up, down: _grouped_experts(x, ids, w, up, down, None, None, None, None, **o)
        _, vjp = jax.vjp(grouped, hidden_states, top_k_weights, up_proj, down_proj)
        grad_x, grad_w, grad_up, grad_down = vjp(grad_out.astype(jnp.float32))
    else:  # quantized experts are frozen (adapters train around them): no gradient for them or their scales
        grouped = lambda x, w: _grouped_experts(x, ids, w, up_proj, down_proj, None, None, up_scale, down_scale, **o)
        _, vjp = jax.vjp(grouped, hidden_states, top_k_weights)
        (grad_x, grad_w), grad_up, grad_down = vjp(grad_out.astype(jnp.float32)), None, None
    return grad_x, None, grad_w, grad_up, grad_down, None, None


_fused_decode.defvjp(_fused_decode_fwd, _fused_decode_bwd)


def _grouped_experts(hidden_states, ids, top_k_weights, up_proj, down_proj, up_bias, down_bias, up_scale, down_scale,
                     *, activation, gated, interleaved, transposed, alpha, limit, generation, interpret):
    """`experts_forward` as two grouped matmuls around a sort of the rows by expert; float32 [T, H].
    ids: the top-k ids clipped to [0, E] (E: another shard's)."""
    num_tokens, top_k = ids.shape
    num_experts = up_proj.shape[0]
    # Each (token, slot)'s weight, zero where its expert is on another shard (its row is in no group).
    slot_weight = jnp.where(ids < num_experts, top_k_weights, 0)
    order, group_sizes, row_weight = route(ids, num_experts, slot_weight)
    slot_weight = slot_weight.astype(jnp.float32).reshape(-1)
    x = take_rows(hidden_states, order // top_k)

    def project(inputs, weights, bias, scale):
        # The bias is added in the kernel's epilogue, to its group's rows only: rows routed elsewhere
        # are in no group and stay exactly zero.
        scale = n_major(scale, not transposed, weights.dtype)
        weights, transpose_rhs = as_stored(weights, not transposed)
        return _ragged_dot(inputs, weights, group_sizes, bias, None, scale, transpose_rhs, generation, interpret)

    h = project(x, up_proj, up_bias, up_scale)
    act = apply_gate(h, activation=activation, gated=gated, interleaved=interleaved, alpha=alpha, limit=limit)
    # down_proj may be zero-padded (DOWN_PAD): the activations to its intermediate, its bias to its hidden.
    down_held = weight_shape(down_proj.shape, down_proj.dtype, not transposed)
    down_inter, down_hidden = (down_held[1], down_held[2]) if transposed else (down_held[2], down_held[1])
    act = jnp.pad(act, ((0, 0), (0, down_inter - act.shape[1])))
    if down_bias is not None:
        down_bias = jnp.pad(down_bias, ((0, 0), (0, down_hidden - down_bias.shape[1])))
    if down_scale is None and down_held_experts_minor(down_proj, num_tokens, generation):
        out = _down_as_held(act, slot_weight, jnp.argsort(order), ids, down_proj, down_bias, transposed,
                            hidden_states.dtype)
    else:
        y = project(act.astype(hidden_states.dtype), down_proj, down_bias, down_scale)
        out = combine_rows(y, order, row_weight, slot_weight, top_k)
    return out[:, :hidden_states.shape[1]]


def down_held_experts_minor(down_proj, num_tokens: int, generation: str) -> bool:
    """Whether the down projection reads down_proj as held, by `_down_as_held`: where the chip holds
    it with the experts dim not major (libtpu holds Gemma 4's [128, 2112, 704] as [2112, 704, 128],
    which no Pallas operand view reads without a copy of the whole tensor per call), for as many
    tokens as keep that one matmul over every expert's weights within the time of reading them
    (tokens <= the chip's bf16 FLOP/s over its HBM bytes/s: 560 on v6e, 240 on v5e). Past that,
    the grouped kernel, after XLA's copy."""
    order = stored_order(down_proj.shape, down_proj.dtype)
    chip = GENERATIONS[generation]
    return order is not None and order[0] != 0 and num_tokens <= chip.bf16_flops / chip.hbm_bytes_per_s


ONE_HOT_ROWS = 512  # `take_rows` gathers from a table of up to this many rows by a one-hot matmul


def take_rows(table, index):
    """table[index] for a [R, C] table: for a 16-bit table of up to ONE_HOT_ROWS rows (a decode
    step's tokens) a one-hot matmul, exact (one term per output, one MXU pass),
    which takes the MXU a fraction of the time a TPU takes to gather the rows; else a gather.

    A row whose source holds a non-finite entry is NaN whole (what a matmul of it gives anyway) and
    no other row sees it (`_dot_keeping_non_finite_rows_apart`): one token's overflow stays its own."""
    if table.shape[0] > ONE_HOT_ROWS or table.dtype.itemsize != 2:
        return table[index]
    one_hot = index[:, None] == jnp.arange(table.shape[0], dtype=index.dtype)[None, :]
    return _dot_keeping_non_finite_rows_apart(one_hot.astype(table.dtype), table, one_hot,
                                              preferred_element_type=jnp.float32).astype(table.dtype)


def _dot_keeping_non_finite_rows_apart(matrix, table, selects, **dot_options):
    """matrix @ table, where a non-finite entry of the table would reach every output row (0 x inf is
    NaN): the product takes the table's finite entries only, and an output row that `selects` (bool,
    as matrix) a row holding any other is NaN whole, so that row's overflow or NaN stays its own."""
    finite = jnp.isfinite(table)
    out = jnp.dot(matrix, jnp.where(finite, table, 0), **dot_options)
    spoilt = jnp.dot(selects.astype(table.dtype), jnp.logical_not(jnp.all(finite, axis=1)).astype(table.dtype),
                     preferred_element_type=jnp.float32)
    return jnp.where(spoilt[:, None] > 0, jnp.nan, out)


COMBINE_TOKENS = 256  # `combine_rows` sums a step of up to this many tokens by one matmul


def combine_rows(y, order, row_weight, slot_weight, top_k):
    """Each token's output: its slots' rows of y (sorted by expert, `order`) times their weights,
    summed in fp32. Up to COMBINE_TOKENS tokens of a 16-bit y: one matmul of a [tokens, rows] matrix
    holding each row's weight (row_weight: the weights sorted as the rows) in its token's row, by y
    (exact products of 16-bit weights; fp32 weights at full precision), with no gather or scatter of
    rows; a non-finite row of y makes its own token's output NaN and no other's
    (`_dot_keeping_non_finite_rows_apart`). Else the rows gathered back to token order (`take_rows`)
    and summed."""
    num_tokens = order.shape[0] // top_k
    if num_tokens > COMBINE_TOKENS or y.dtype.itemsize != 2:
        rows = take_rows(y, jnp.argsort(order)).astype(jnp.float32)
        return (rows * slot_weight[:, None]).reshape(num_tokens, top_k, -1).sum(axis=1)
    mine = (order // top_k)[None, :] == jnp.arange(num_tokens, dtype=order.dtype)[:, None]  # [tokens, rows]
    weights = jnp.where(mine, row_weight[None, :], 0)
    if row_weight.dtype.itemsize == 2:
        return _dot_keeping_non_finite_rows_apart(weights.astype(y.dtype), y, mine, preferred_element_type=jnp.float32)
    return _dot_keeping_non_finite_rows_apart(weights.astype(jnp.float32), y.astype(jnp.float32), mine,
                                              precision=jax.lax.Precision.HIGHEST)


def _down_as_held(act, slot_weight, unsort, ids, down_proj, down_bias, transposed, dtype):
    """The down projection, weighted and summed over each token's experts, as one matmul that
    contracts the intermediate and experts dims of down_proj where they lie (XLA reads it as held,
    no copy): the token's weighted activations scattered to their experts' positions, a [T, I, E]
    operand zero elsewhere. Each (token, expert) term is w * act rounded to the input dtype once,
    where the grouped path rounds act and weighs in f32: the same one rounding."""
    num_tokens, top_k = ids.shape
    num_experts = down_proj.shape[0]
    rows = (take_rows(act, unsort) * slot_weight[:, None]).reshape(num_tokens, top_k, -1).astype(dtype)
    experts = jax.nn.one_hot(ids, num_experts, dtype=dtype)  # the sentinel id E: a row of zeros
    exact = jax.lax.Precision.HIGHEST  # f32 operands stay f32 (bf16 ones are exact at any precision)
    # Each (token, expert) takes one slot's row times 1 (top-k ids are distinct): exact.
    scattered = jnp.einsum("tki,tke->tie", rows, experts, precision=exact, preferred_element_type=jnp.float32)
    scattered = scattered.astype(dtype)
    out = jnp.einsum("tie,eih->th" if transposed else "tie,ehi->th", scattered, down_proj, precision=exact,
                     preferred_element_type=jnp.float32)
    if down_bias is not None:
        routed = experts * slot_weight.reshape(num_tokens, top_k)[..., None]
        out = out + jnp.einsum("tke,eh->th", routed, down_bias.astype(jnp.float32), precision=exact)
    return out


def local_expert_ids(top_k_index, num_local_experts: int, shard):
    """Global expert ids -> this shard's ids: shard s holds experts [s * L, (s + 1) * L); ids
    held elsewhere (and the global sentinel) become the local sentinel L, which costs nothing."""
    local = top_k_index - shard * num_local_experts
    return jnp.where((local >= 0) & (local < num_local_experts), local, num_local_experts).astype(jnp.int32)


def expert_parallel_experts_forward(hidden_states, top_k_index, top_k_weights, up_proj, down_proj, up_bias=None,
                                    down_bias=None, *, axis_name, **options):
    """`experts_forward` with the experts split over the mesh axis `axis_name`, for use inside
    `jax.shard_map`: every shard sees all tokens (replicated), holds E / shards experts
    (up_proj, down_proj and biases sharded on their first dim), computes the slots routed to
    its experts and none of the others, and the shards' partial outputs are summed with one
    `psum`. top_k_index holds global ids. options: as experts_forward; quantized experts' scales
    (up_scale, down_scale) are split like their weights. `check_vma=False`: the Pallas kernels do
    not declare how their outputs vary over the mesh.

        mesh = jax.make_mesh((8,), ("expert",))
        specs = (P(), P(), P(), P("expert"), P("expert"))  # tokens, ids, weights; experts split
        ep = jax.jit(jax.shard_map(functools.partial(expert_parallel_experts_forward, axis_name="expert"),
                                   mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False))
        out = ep(*(jax.device_put(x, jax.NamedSharding(mesh, s)) for x, s in zip(args, specs)))
    """
    shard, num_local = jax.lax.axis_index(axis_name), up_proj.shape[0]
    local = local_expert_ids(top_k_index, num_local, shard)
    out = experts_forward(hidden_states, local, top_k_weights, up_proj, down_proj, up_bias, down_bias, **options)
    # Global ids outside [0, E] (E the global sentinel) would vanish into the local sentinels: report them.
    valid = jnp.all((top_k_index >= 0) & (top_k_index <= num_local * jax.lax.axis_size(axis_name)))
    return jax.lax.psum(jnp.where(valid, out, jnp.nan), axis_name)
