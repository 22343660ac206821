"""The grouped-matmul Pallas TPU kernel: out[rows of group g] = lhs[rows] @ rhs[g].

Rows of `lhs` are sorted by group. The m axis is cut into tiles of
`block_m` rows; a tile that straddles a group boundary is visited once per
group it holds, and each visit stores only its own group's rows. The rows
after the last group (`sum(group_sizes)` up to the padded M) form one more
"fill" group whose visits store zeros without any matmul. The visit list is
computed once per call on the device (`make_visits`), handed to the kernel
through scalar prefetch, and drives the block index maps, so:

- an empty group costs nothing: its weights are never read;
- consecutive visits to one m tile keep its output block in VMEM, and each
  visit multiplies the whole tile in one MXU pass per K step (the weights
  pushed once) and stores the rows from its group's first onwards: rows
  before it are earlier visits', rows past it are overwritten by later ones;
- the visit axis of the grid has a dynamic length, the routing's real
  visit count (at most `num_m_tiles + num_groups`), so no grid step idles.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu



SCALE_BLOCK = 128  # block-scaled weights (FineGrainedFP8's weight_scale_inv): a scale per 128 x 128 block
MX_BLOCK = 32  # MXFP4 (OCP microscaling, gpt-oss's experts): a power-of-two scale per 32 weights along K
PACKED_CHUNK = 256  # byte rows (512 of K) of 4-bit weights the kernel decodes and multiplies at a time
MXFP4_PLANE_SCALE = 64.0  # mxfp4_planes' values are the weights' 2^-6: the products multiply by 2^6
INT4_GROUPS = (32, 64, 128, 256, 512)  # int4 weights: K rows per float32 scale (each divides PACKED_CHUNK's 512)


def mxfp4_planes(packed, scales, dtype):
    """MXFP4 weights as two planes in `dtype`: packed uint8 [R, C] holds two fp4 e2m1 codes per byte,
    the low nibble K row 2r and the high nibble row 2r + 1; scales int32 [cdiv(R, 16), C] are e8m0
    exponents, one per 32 K rows (16 bytes). Returns (lo, hi) [R, C]: code value x 2^(scale - 127)
    x 2^-6 (MXFP4_PLANE_SCALE: the caller multiplies its products back), exact in bf16 (two
    significant bits times a power of two) for scales 8 to 254; below, values under float32's normal
    range flush to zero as on a TPU; 255 (e8m0's NaN) gives inf or NaN.

    Each code becomes an fp8 e4m3 byte by moving its bits (sign; exponent e1 e0 under two zero bits;
    mantissa m over two zero bits): the same value times 2^-6, e2m1's subnormal (0.5) landing on
    e4m3's. The bit moves run on the bytes as loaded (four to a 32-bit lane), the widening is the
    one fp8 weights take; the scale's power is a float32 built from its bits."""
    rows, cols = packed.shape
    lo = ((packed & 0x08) << 4) | ((packed & 0x07) << 2)
    hi = (packed & 0x80) | ((packed & 0x70) >> 2)
    factor = jax.lax.bitcast_convert_type(scales << 23, jnp.float32)  # 2^(scale - 127); 255: inf
    half = MX_BLOCK // 2
    factor = jnp.broadcast_to(factor[:, None, :], (factor.shape[0], half, cols)).reshape(-1, cols)[:rows]
    factor = factor.astype(dtype)
    widen = lambda bits: jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(dtype) * factor
    return widen(lo), widen(hi)


def int4_planes(packed, scales, dtype, group: int):
    """int4 weights as two planes in `dtype`: packed uint8 [R, C] holds two two's-complement 4-bit
    codes per byte, the low nibble K row 2r and the high nibble row 2r + 1; scales float32
    [cdiv(R, group // 2), C], one per `group` K rows. Returns (lo, hi) [R, C]: code x scale,
    computed in `dtype` (in bf16 the scale is rounded to bf16, then the product: a weight within
    2^-8 of its value, as a model dequantized to bf16 holds it).

    Each nibble is read in place as the top half of an int8 (the low one shifted up, the high one
    masked), which is 16 times its code, and widened as int8 weights are; the 16 is taken out of the
    scale (exactly: a power of two). That is several times less vector work than MXFP4's path
    through fp8 (which Mosaic widens in many vector ops on v6e), and less than sign-extending each
    nibble first."""
    rows, cols = packed.shape
    sixteen_times = lambda bits: jax.lax.bitcast_convert_type(bits, jnp.int8).astype(dtype)
    half = group // 2
    factor = jnp.broadcast_to(scales[:, None, :] * (1 / 16), (scales.shape[0], half, cols)).reshape(-1, cols)[:rows]
    factor = factor.astype(dtype)
    return sixteen_times(packed << 4) * factor, sixteen_times(packed & 0xF0) * factor


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_m: int  # rows of lhs per tile (multiple of 16 for bf16 packing)
    block_k: int  # contraction slice per grid step (multiple of 128, or all of K)
    block_n: int  # output columns per grid step (multiple of 128, or all of N)
    # Weights' gradient only: start each group's row windows at the group's
    # first row (less MXU work at group boundaries) instead of at block_m
    # tiles (a tile two groups share is read once). Which wins depends on
    # the generation's FLOP/byte balance; the tuning decides.
    windows_at_group_start: bool = False
    # Forward only: how many of the weights' blocks can be in VMEM at once. Pallas's pipeline keeps
    # two (one computed on, the next arriving), so every step waits out one copy's latency where
    # the step's own work is shorter (a decode step, which reads an expert's weights for a few
    # rows). With more, the kernel copies the weights itself through a ring of that many slots,
    # that many minus one copies in flight. Needs whole blocks (`ring_fits`).
    weight_buffers: int = 2


def _groups_of(visit, visit_end):
    """Each visit's group (the first whose exclusive end visit is past it,
    clipped to the last group) and a function giving each visit its group's
    value of a [groups] array. Both compare every visit with every group: on
    a TPU a [V, G] compare and sum takes a few cycles where a search or a
    gather takes microseconds."""
    num_groups = visit_end.shape[0]
    group = jnp.minimum(jnp.sum(visit_end[None, :] <= visit[:, None], axis=1, dtype=jnp.int32), num_groups - 1)
    mine = group[:, None] == jnp.arange(num_groups, dtype=jnp.int32)[None, :]
    return group, lambda values: jnp.sum(jnp.where(mine, values[None, :], 0), axis=1)


def make_visits(group_sizes: jax.Array, num_rows: int, block_m: int):
    """The (group, m tile) visit list for rows sorted by group.

    Args:
      group_sizes: int32 [G], rows per group; their sum is at most num_rows.
      num_rows: M padded to a multiple of block_m.
      block_m: rows per tile.

    Returns int32 arrays, in the order the kernel takes them:
      row_start, row_end [G + 1]: each group's row range; group G is the
        fill group covering rows sum(group_sizes) .. num_rows.
      visit_group [V]: the group a visit serves (G for fill).
      visit_tile [V]: the m tile it touches (non-decreasing in the visit).
      weight_group [V]: which rhs block to have in VMEM: the visit's group,
        or for fill visits the last real group (no DMA).
      num_visits [1]: how many of the V = num_tiles + G slots are visits:
        the kernel's grid length.
    """
    num_groups = group_sizes.shape[0]
    num_tiles = num_rows // block_m
    total = jnp.sum(group_sizes)
    sizes = jnp.concatenate([group_sizes, (num_rows - total)[None]])
    row_end = jnp.cumsum(sizes)
    row_start = row_end - sizes
    first_tile = jnp.minimum(row_start // block_m, num_tiles - 1)
    end_tile = (row_end + block_m - 1) // block_m
    tiles_per_group = jnp.where(sizes > 0, end_tile - first_tile, 0)
    visit_end = jnp.cumsum(tiles_per_group)  # exclusive end visit of each group
    num_visits = visit_end[-1]

    max_visits = num_tiles + num_groups  # each of G boundaries adds <= 1 visit
    visit = jnp.arange(max_visits, dtype=jnp.int32)
    # Past-the-end visits repeat the last real one: same blocks, no DMA.
    clamped = jnp.minimum(visit, jnp.maximum(num_visits - 1, 0))
    visit_group, of_group = _groups_of(clamped, visit_end)
    visit_tile = of_group(first_tile - (visit_end - tiles_per_group)) + clamped

    # The rhs block a fill visit keeps: the last real group's (fill visits
    # come last, the fill group being the last in row order).
    is_real = visit_group < num_groups
    last_real = jnp.max(jnp.where(is_real, visit_group, 0))
    weight_group = jnp.minimum(jnp.where(is_real, visit_group, last_real), num_groups - 1)
    i32 = lambda x: x.astype(jnp.int32)
    return (
        i32(row_start),
        i32(row_end),
        i32(visit_group),
        i32(visit_tile),
        i32(weight_group),
        i32(num_visits)[None],
    )


class RingPlan(NamedTuple):
    """The weights' copies of a ring (`BlockSizes.weight_buffers` > 2), in the kernel's step order
    within one n tile (step = visit * k_steps + k): int32 arrays in SMEM."""
    copy_of_step: jax.Array  # [S]: the copy whose block the step multiplies
    step_waits: jax.Array  # [S]: 1 where the step is its copy's first (waits for it)
    copy_group: jax.Array  # [S]: each copy's group
    copy_k_block: jax.Array  # [S]: each copy's K block
    num_copies: jax.Array  # [1]


def make_ring_plan(visit_group, weight_group, num_visits, num_groups: int, k_steps: int) -> RingPlan:
    """The copies the steps need: one wherever a step's weight block (group, K block) differs from
    the previous step's, as Pallas's pipeline would copy them. Steps past the last visit repeat its
    block."""
    steps = jnp.arange(visit_group.shape[0] * k_steps, dtype=jnp.int32)
    per_step = lambda values: jnp.broadcast_to(values[:, None], (values.shape[0], k_steps)).reshape(-1)  # no gather
    k_block = jnp.where(per_step(visit_group) >= num_groups, k_steps - 1, steps % k_steps)  # as the pipeline's k_block
    group = per_step(weight_group)
    real = steps < num_visits[0] * k_steps
    new = real & ((steps == 0) | (group != jnp.roll(group, 1)) | (k_block != jnp.roll(k_block, 1)))
    copy = jnp.cumsum(new, dtype=jnp.int32) - 1
    # Each copy's block, from the step that starts needing it: a compare and sum over [copies, steps]
    # (as `_groups_of`: a scatter or gather takes far longer on a TPU).
    first_needs = new[None, :] & (copy[None, :] == steps[:, None])
    of_copy = lambda values: jnp.sum(jnp.where(first_needs, values[None, :], 0), axis=1, dtype=jnp.int32)
    return RingPlan(copy, new.astype(jnp.int32), of_copy(group), of_copy(k_block), jnp.sum(new, dtype=jnp.int32)[None])


def _weight_ring(plan: RingPlan, rhs_hbm, slots, sems, depth: int, transpose_rhs: bool):
    """Copies this step's weight block through a ring of `depth` slots and returns the slot holding
    it. The first step of an n tile starts the first depth - 1 copies; a step that is its copy's
    first waits for it and starts the copy depth - 1 ahead, into the slot the previous copy's steps
    (all done) used. Every condition is top level, read from the plan (the bench's walk counts the
    copies each step starts from them)."""
    nn, v, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    step = v * pl.num_programs(2) + k
    rows, cols = slots.shape[1:]

    # A block spanning its whole dim starts at a static 0: Mosaic takes an offset into a dim that is
    # not a multiple of 128 lanes only so (gpt-oss's K of 2880 as the minor dim).
    start = lambda block, size, dim: 0 if size >= dim else block * size

    def copy(c):
        row_block, col_block = (nn, plan.copy_k_block[c]) if transpose_rhs else (plan.copy_k_block[c], nn)
        source = rhs_hbm.at[plan.copy_group[c], pl.ds(start(row_block, rows, rhs_hbm.shape[1]), rows),
                            pl.ds(start(col_block, cols, rhs_hbm.shape[2]), cols)]
        return pltpu.make_async_copy(source, slots.at[c % depth], sems.at[c % depth])

    for first in range(depth - 1):
        @pl.when(jnp.logical_and(step == 0, first < plan.num_copies[0]))
        def _():
            copy(first).start()

    mine = plan.copy_of_step[step]
    waits = plan.step_waits[step] == 1

    @pl.when(waits)
    def _():
        copy(mine).wait()

    @pl.when(jnp.logical_and(waits, mine + depth - 1 < plan.num_copies[0]))
    def _():
        copy(mine + depth - 1).start()

    return slots.at[mine % depth]


def _kernel(
    row_start, row_end, visit_group, visit_tile, weight_group, num_visits, fill_nan, *refs,
    num_groups: int, transpose_rhs: bool, precision, k_size: int, has_bias: bool, has_scale: bool,
    has_block_scale: bool, packed: bool, int4_group: int, ring: int,
):
    refs = list(refs)
    ring_plan = [refs.pop(0) for _ in range(len(RingPlan._fields))] if ring else None
    lhs_ref, rhs_ref = refs.pop(0), refs.pop(0)
    if ring:  # rhs_ref is the weights in HBM; the last two refs the ring's slots and their semaphores
        rhs_ref = _weight_ring(RingPlan(*ring_plan), rhs_ref, *refs[-2:], ring, transpose_rhs)
        refs = refs[:-2]
    bias_ref = refs.pop(0) if has_bias else None
    scale_ref = refs.pop(0) if has_scale else None
    block_scale_ref = refs.pop(0) if has_block_scale else None
    # 4-bit weights (packed: MXFP4, or int4 with int4_group K rows per scale): lhs_ref holds lhs's even
    # columns, lhs_odd_ref its odd ones (the low and high nibbles' K rows); lhs's gradient
    # (transpose_rhs) reads lhs whole
    lhs_odd_ref = refs.pop(0) if packed and not transpose_rhs else None
    packed_scale_ref = refs.pop(0) if packed else None
    out_ref, acc_ref = refs[0], (refs[1] if len(refs) > 1 else None)
    nn, v, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k_steps = pl.num_programs(2)
    group = visit_group[v]
    does_matmul = group < num_groups  # fill visits only store zeros
    contract_rhs = 1 if transpose_rhs else 0
    block_m, block_k = lhs_ref.shape

    if int4_group:
        planes, half, plane_scale = functools.partial(int4_planes, group=int4_group), int4_group // 2, 1.0
    else:
        planes, half, plane_scale = mxfp4_planes, MX_BLOCK // 2, MXFP4_PLANE_SCALE
    packed_scales = lambda: packed_scale_ref[...] if int4_group else packed_scale_ref[...].astype(jnp.int32)

    def packed_product(last: bool):
        """lhs's even columns times the low nibbles' plane plus its odd columns times the high ones',
        PACKED_CHUNK byte rows at a time (the planes' temporaries stay that small in VMEM)."""
        rows = rhs_ref.shape[0]
        valid = k_size % (2 * block_k) // 2 if last and k_size % (2 * block_k) else rows  # the last K block's overhang
        lhs_even, lhs_odd = lhs_ref[...], lhs_odd_ref[...]
        scales = packed_scales()
        total = None
        for start in range(0, min(rows, valid), PACKED_CHUNK):
            end = min(start + PACKED_CHUNK, rows)
            lo, hi = planes(rhs_ref[start:end, :], scales[start // half:-(-end // half)], lhs_ref.dtype)
            a, b = lhs_even[:, start:end], lhs_odd[:, start:end]
            if end > valid:  # zero the overhang in both operands: past K, either may hold anything
                a, b = (jnp.where(start + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) < valid, x, 0) for x in (a, b))
                lo, hi = (jnp.where(start + jax.lax.broadcasted_iota(jnp.int32, w.shape, 0) < valid, w, 0)
                          for w in (lo, hi))
            dot = lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32, precision=precision)
            part = dot(a, lo) + dot(b, hi)
            total = part if total is None else total + part
        return total * plane_scale if plane_scale != 1 else total

    def packed_transposed_product(last: bool):
        """lhs's gradient through 4-bit weights [pairs, N] (contracting N, their minor dim): the
        low nibbles' plane gives the even output columns, the high the odd; a block's output holds
        its even columns then its odd ones (the caller interleaves them)."""
        lhs = lhs_ref[...]
        valid = k_size % block_k if last and k_size % block_k else block_k  # the last N block's overhang
        if valid < block_k:
            lhs = jnp.where(jax.lax.broadcasted_iota(jnp.int32, lhs.shape, 1) < valid, lhs, 0)
        scales = packed_scales()
        rows = rhs_ref.shape[0]
        even, odd = [], []
        for start in range(0, rows, PACKED_CHUNK):
            end = min(start + PACKED_CHUNK, rows)
            chunk = planes(rhs_ref[start:end, :], scales[start // half:-(-end // half)], lhs_ref.dtype)
            for out, plane in zip((even, odd), chunk):
                if valid < block_k:
                    plane = jnp.where(jax.lax.broadcasted_iota(jnp.int32, plane.shape, 1) < valid, plane, 0)
                out.append(jax.lax.dot_general(lhs, plane, (((1,), (1,)), ((), ())),
                                               preferred_element_type=jnp.float32, precision=precision))
        both = jnp.concatenate(even + odd, axis=1)
        return both * plane_scale if plane_scale != 1 else both

    def product(last: bool):
        if packed:
            return packed_transposed_product(last) if transpose_rhs else packed_product(last)
        lhs, rhs = lhs_ref[...], rhs_ref[...]
        # Quantized weights (int8, fp8) go into a bf16 product as they are: Mosaic widens them on the
        # way into the MXU (on v6e an fp8 block widened first costs several times the product, modeled).
        # Widened to lhs's dtype in VMEM (exactly) for fp32 products, and where the last K block's
        # overhang must be zeroed (fp8's bytes there may be NaN). Their scale multiplies the fp32
        # product at the store, or (lhs's gradient) was folded into lhs by the caller.
        if rhs.dtype.itemsize == 1 and (lhs.dtype == jnp.float32 or (last and k_size % block_k)):
            rhs = rhs.astype(lhs.dtype)
        if last and k_size % block_k:  # the last K block runs past K: zero the overhang in both
            valid = k_size % block_k
            lhs = jnp.where(jax.lax.broadcasted_iota(jnp.int32, lhs.shape, 1) < valid, lhs, 0)
            rhs = jnp.where(jax.lax.broadcasted_iota(jnp.int32, rhs.shape, contract_rhs) < valid, rhs, 0)
        dot = lambda a, b: jax.lax.dot_general(a, b, (((1,), (contract_rhs,)), ((), ())),
                                               preferred_element_type=jnp.float32, precision=precision)
        if block_scale_ref is None:
            return dot(lhs, rhs)
        # Each SCALE_BLOCK x SCALE_BLOCK block of the weights has its own scale: one product per
        # SCALE_BLOCK-wide slice of K, each column scaled by its block's scale, then summed (in fp32).
        scales = block_scale_rows()
        total = None
        for j in range(scales.shape[0]):
            cut = slice(j * SCALE_BLOCK, min((j + 1) * SCALE_BLOCK, block_k))
            part = dot(lhs[:, cut], rhs[:, cut] if transpose_rhs else rhs[cut, :]) * scales[j:j + 1, :]
            total = part if total is None else total + part
        return total

    def block_scale_rows():
        """[K slices of this step, block_n]: the scale of each slice's block of each output column,
        picked from the group's [N blocks, K blocks] scales by two one-hot matmuls (exact at HIGHEST;
        a lane-dynamic slice does not lower)."""
        scales = block_scale_ref[...]
        slices, n_blocks, k_blocks = pl.cdiv(block_k, SCALE_BLOCK), scales.shape[0], scales.shape[1]
        block_n = out_ref.shape[1]
        iota = lambda shape, dim: jax.lax.broadcasted_iota(jnp.int32, shape, dim)
        pick_k = (iota((slices, k_blocks), 0) + k * slices == iota((slices, k_blocks), 1)).astype(jnp.float32)
        pick_n = (iota((n_blocks, block_n), 0) == (nn * block_n + iota((n_blocks, block_n), 1)) // SCALE_BLOCK)
        highest = dict(preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
        per_slice = jax.lax.dot_general(pick_k, scales, (((1,), (1,)), ((), ())), **highest)  # [slices, N blocks]
        return jnp.dot(per_slice, pick_n.astype(jnp.float32), **highest)

    def store(value):
        # Rows before the group's first belong to earlier visits of this tile:
        # keep them. Rows after its last belong to later visits, which write
        # them; so do the first visit's rows of other groups.
        rows = visit_tile[v] * block_m + jax.lax.broadcasted_iota(jnp.int32, out_ref.shape, 0)
        if scale_ref is not None:
            value = value * scale_ref[...]
        if bias_ref is not None:
            value = value + bias_ref[...].astype(jnp.float32)
        out_ref[...] = jnp.where(rows >= row_start[group], value.astype(out_ref.dtype), out_ref[...])

    last_k = k == k_steps - 1
    if acc_ref is None:  # one K step: multiply and store in one region

        @pl.when(does_matmul)
        def _():
            store(product(last=True))
    else:
        @pl.when(jnp.logical_and(does_matmul, k == 0))
        def _():
            acc_ref[...] = product(last=False)

        @pl.when(jnp.logical_and(does_matmul, jnp.logical_and(k > 0, jnp.logical_not(last_k))))
        def _():
            acc_ref[...] += product(last=False)

        @pl.when(jnp.logical_and(does_matmul, last_k))
        def _():
            store(acc_ref[...] + product(last=True))

    @pl.when(jnp.logical_and(jnp.logical_not(does_matmul), last_k))
    def _():
        rows = visit_tile[v] * block_m + jax.lax.broadcasted_iota(jnp.int32, out_ref.shape, 0)
        fill = jnp.where(fill_nan[0] != 0, jnp.nan, 0.0).astype(out_ref.dtype)
        out_ref[...] = jnp.where(rows >= row_start[group], fill, out_ref[...])


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    blocks: BlockSizes,
    transpose_rhs: bool,
    out_dtype,
    vmem_limit: int,
    interpret,
    bias: jax.Array | None = None,
    fill_nan: jax.Array | None = None,
    rhs_scale: jax.Array | None = None,
    rhs_block_scale: jax.Array | None = None,
    rhs_packed_scale: jax.Array | None = None,
) -> jax.Array:
    """The pallas_call. lhs rows must already be a multiple of block_m; K
    and N blocks need not divide K and N (edge blocks are masked or clipped).
    bias: [G, N] or None, added to each group's rows in the store's epilogue.
    rhs_scale: float32 [G, N] or None: rhs (int8 or fp8) times this per output
    channel is the weight; the product is scaled in the store's epilogue.
    rhs_block_scale: float32 [G, cdiv(N, SCALE_BLOCK), cdiv(K, SCALE_BLOCK)] or
    None: rhs times its SCALE_BLOCK x SCALE_BLOCK block's scale is the weight
    (block_k a multiple of SCALE_BLOCK, or all of K).
    rhs_packed_scale: None, or rhs holds 4-bit weights, uint8 [G, K / 2, N] with two codes per byte
    along K, and these are their scales: uint8 [G, K / MX_BLOCK (or more rows), N], MXFP4's e8m0
    exponents (fp4 e2m1 codes, see `mxfp4_planes`); or float32 [G, K / group, N], int4 codes with
    a scale per `group` K rows (one of INT4_GROUPS, see `int4_planes`). block_k all of K or a
    multiple of `packed_k_step`, so the scales' blocks are whole tiles. With transpose_rhs (lhs's
    gradient, lhs [M, N]) the output is [M, K], its columns in pairs: block_n counts pairs, all of
    them or a multiple of half a K step.
    fill_nan: a bool scalar on the device, or None (False): the rows past the
    groups are NaN instead of zero (how callers report invalid group sizes
    without a pass over any array: they pass all sizes zero).

    `interpret` is False on a TPU, True for plain interpret mode, or a
    `pltpu.InterpretParams` for the TPU interpreter (race detection).
    """
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    bm, bk, bn = blocks.block_m, blocks.block_k, blocks.block_n
    assert m % bm == 0, (lhs.shape, blocks)
    packed = rhs_packed_scale is not None
    int4_group = 0
    if packed:
        int4_group = 0 if rhs_packed_scale.dtype == jnp.uint8 else 2 * rhs.shape[1] // rhs_packed_scale.shape[1]
        group, step = int4_group or MX_BLOCK, packed_k_step(rhs_packed_scale.dtype, int4_group)
        assert (bn >= n or bn % (step // 2) == 0 if transpose_rhs else k % group == 0 and (bk >= k or bk % step == 0)), \
            (rhs.shape, rhs_packed_scale.shape, blocks)
    out_cols = 2 * bn if packed and transpose_rhs else bn  # lhs's gradient: a block's even columns, then its odd
    k_steps = pl.cdiv(k, bk)
    fill_flag = jnp.zeros((1,), jnp.int32) if fill_nan is None else jnp.asarray(fill_nan, jnp.int32).reshape(1)
    visits = make_visits(group_sizes, m, bm)
    prefetch = (*visits, fill_flag)
    ring = blocks.weight_buffers if blocks.weight_buffers > 2 else 0
    if ring:  # a slot holds a whole block of the weights as stored: K (bytes of 4-bit weights) by N, or N by K
        k_rows, n_cols = min(bk, k) // (2 if packed else 1), min(bn, n)
        slot = (n_cols, k_rows) if transpose_rhs else (k_rows, n_cols)
        assert ring_fits(rhs.shape, transpose_rhs, packed, blocks), (rhs.shape, blocks)
        prefetch += tuple(make_ring_plan(visits[2], visits[4], visits[5], num_groups, k_steps))

    def k_block(v, kk, visit_group):
        # Fill visits do no matmul: they pin k to the last block, the one the
        # previous visit ended on, so they trigger no new DMA.
        return jnp.where(visit_group[v] >= num_groups, k_steps - 1, kk)

    def lhs_map(nn, v, kk, row_start, row_end, visit_group, visit_tile, weight_group, *_):
        return visit_tile[v], k_block(v, kk, visit_group)

    def rhs_map(nn, v, kk, row_start, row_end, visit_group, visit_tile, weight_group, *_):
        kb = k_block(v, kk, visit_group)
        if transpose_rhs:
            return weight_group[v], nn, kb
        return weight_group[v], kb, nn

    def out_map(nn, v, kk, row_start, row_end, visit_group, visit_tile, weight_group, *_):
        return visit_tile[v], nn

    def per_channel_map(nn, v, kk, row_start, row_end, visit_group, visit_tile, weight_group, *_):
        return weight_group[v], 0, nn

    def per_group_map(nn, v, kk, row_start, row_end, visit_group, visit_tile, weight_group, *_):
        return weight_group[v], 0, 0

    rhs_block = (None, bn, bk) if transpose_rhs else (None, bk, bn)
    in_specs = [pl.BlockSpec((bm, bk), lhs_map), pl.BlockSpec(rhs_block, rhs_map)]
    operands = [lhs, rhs]
    if packed and not transpose_rhs:  # K in pairs: a K block is bk / 2 bytes of rhs and bk / 2 of each of lhs's halves
        bk = min(bk, k)
        in_specs = [pl.BlockSpec((bm, bk // 2), lhs_map), pl.BlockSpec((None, bk // 2, bn), rhs_map)]
        operands = [lhs[:, 0::2], rhs]
    if ring:  # the kernel copies the weights' blocks itself (`_weight_ring`)
        in_specs[1] = pl.BlockSpec(memory_space=pl.ANY)
    for per_channel in (bias, rhs_scale):  # [G, 1, N]: a (1, bn) block per step, its group's
        if per_channel is not None:
            in_specs.append(pl.BlockSpec((None, 1, bn), per_channel_map))
            operands.append(per_channel.reshape(num_groups, 1, n))
    if rhs_block_scale is not None:  # the group's whole [N blocks, K blocks]: read once per group
        assert bk % SCALE_BLOCK == 0 or k_steps == 1, blocks
        in_specs.append(pl.BlockSpec((None, *rhs_block_scale.shape[1:]), per_group_map))
        operands.append(rhs_block_scale)
    if packed and transpose_rhs:  # lhs's gradient: a block of pairs takes a scale row per group / 2 pairs
        scale_rows = rhs_packed_scale.shape[1] if bn >= n else bn // (group // 2)
        in_specs.append(pl.BlockSpec((None, scale_rows, bk), rhs_map))
        operands.append(rhs_packed_scale)
    elif packed:
        scale_rows = rhs_packed_scale.shape[1] if bk >= k else bk // group  # one K step: all (padded) rows
        in_specs += [pl.BlockSpec((bm, bk // 2), lhs_map), pl.BlockSpec((None, scale_rows, bn), rhs_map)]
        operands += [lhs[:, 1::2], rhs_packed_scale]
    precision = jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
    width = 2 * n if out_cols != bn else n  # output columns (lhs's gradient through 4-bit weights: two per pair)
    flops = 2 * m * k * width  # upper bound: every row once
    scale_bytes = 0 if rhs_packed_scale is None else rhs_packed_scale.size * rhs_packed_scale.dtype.itemsize
    cost = pl.CostEstimate(
        flops=flops,
        transcendentals=0,
        bytes_accessed=m * k * lhs.dtype.itemsize + rhs.size * rhs.dtype.itemsize + scale_bytes
        + m * width * jnp.dtype(out_dtype).itemsize,
    )
    n_blocks = pl.cdiv(n, bn)
    out = pl.pallas_call(
        functools.partial(
            _kernel, num_groups=num_groups, transpose_rhs=transpose_rhs, precision=precision, k_size=k,
            has_bias=bias is not None, has_scale=rhs_scale is not None, has_block_scale=rhs_block_scale is not None,
            packed=packed, int4_group=int4_group, ring=ring,
        ),
        out_shape=jax.ShapeDtypeStruct((m, n if out_cols == bn else n_blocks * out_cols), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(n_blocks, visits[-1][0], k_steps),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((bm, out_cols), out_map),
            scratch_shapes=([pltpu.VMEM((bm, out_cols), jnp.float32)] if k_steps > 1 else [])
            + ([pltpu.VMEM((ring, *slot), rhs.dtype), pltpu.SemaphoreType.DMA((ring,))] if ring else []),
        ),
        compiler_params=pltpu.CompilerParams(
            # n tiles are independent (v5p splits them over its two cores);
            # visits revisit output tiles and k accumulates: sequential.
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=vmem_limit,
        ),
        cost_estimate=cost,
        interpret=interpret,
        name="ragged_dot_tpu",
    )(*prefetch, *operands)
    if out_cols == bn:
        return out
    # lhs's gradient through 4-bit weights: each block's even columns then odd ones, interleaved
    out = out.reshape(m, n_blocks, 2, bn).swapaxes(2, 3).reshape(m, n_blocks * bn * 2)
    return out[:, :2 * n]


def ring_fits(rhs_shape, transpose_rhs: bool, packed: bool, blocks: BlockSizes) -> bool:
    """Whether the weights can go through a ring (`BlockSizes.weight_buffers`): every block whole
    (block_k all of K or dividing it, block_n likewise), and not 4-bit weights in lhs's gradient."""
    n, k = (rhs_shape[1], rhs_shape[2]) if transpose_rhs else (rhs_shape[2], rhs_shape[1] * (2 if packed else 1))
    whole = lambda block, dim: block >= dim or dim % block == 0
    return not (packed and transpose_rhs) and whole(blocks.block_k, k) and whole(blocks.block_n, n)


def packed_k_step(scale_dtype, int4_group: int) -> int:
    """The K step of 4-bit weights whose scales' blocks are whole tiles (32 rows of uint8, 8 of
    float32): 1024 for MXFP4 (a scale per 32), 8 groups for int4."""
    return 32 * MX_BLOCK if jnp.dtype(scale_dtype) == jnp.uint8 else 8 * int4_group


def vmem_bytes(blocks: BlockSizes, itemsize: int, out_dtype) -> int:
    """VMEM the forward kernel's buffers take: double-buffered lhs and output, the weights' blocks
    (`weight_buffers` of them), fp32 accumulator. The weights' gradient kernel takes the same
    with (block_m, block_k, block_n) read as (P block, rows block, Q block)."""
    bm, bk, bn = blocks.block_m, blocks.block_k, blocks.block_n
    out_item = jnp.dtype(out_dtype).itemsize
    return (2 * bm * bk + blocks.weight_buffers * bk * bn) * itemsize + 2 * bm * bn * out_item + bm * bn * 4


ROW_ALIGN = 16  # a weight-gradient window starts on a packed-row boundary (16 bf16 rows)


def make_weight_grad_visits(group_sizes: jax.Array, num_rows: int, block_m: int, align: int):
    """The visit list of `transposed_grouped_matmul`: each group's rows are
    read in windows of block_m rows, the first starting at the group's first
    row rounded down to `align` (ROW_ALIGN: a group costs the MXU at most one
    partial window; block_m: windows are fixed tiles, and consecutive visits
    to one tile share its copy). An empty group gets one visit that only
    writes its zero gradient.

    Returns int32 arrays: visit_group [V]; window [V], the first row each
    visit's window reads; own_start, own_end [V], the rows it counts (its
    group's rows not counted by the group's earlier windows); num_visits [1].
    V = cdiv(num_rows, block_m) + G bounds the visit count.
    """
    assert num_rows % align == 0 and num_rows >= block_m and block_m % align == 0, (num_rows, block_m, align)
    num_groups = group_sizes.shape[0]
    row_end = jnp.cumsum(group_sizes)
    row_start = row_end - group_sizes
    aligned = row_start // align * align
    windows = jnp.maximum(pl.cdiv(row_end - aligned, block_m), 1)
    visit_end = jnp.cumsum(windows)
    num_visits = visit_end[-1]

    max_visits = pl.cdiv(num_rows, block_m) + num_groups
    visit = jnp.minimum(jnp.arange(max_visits, dtype=jnp.int32), num_visits - 1)  # past the end: repeat the last
    group, of_group = _groups_of(visit, visit_end)
    nominal = of_group(aligned - (visit_end - windows) * block_m) + visit * block_m
    own_start = jnp.maximum(nominal, of_group(row_start))
    own_end = jnp.minimum(nominal + block_m, of_group(row_end))
    # A window running past the last row slides back; own_start keeps the
    # rows it re-reads from being counted twice.
    window = jnp.minimum(nominal, num_rows - block_m)
    i32 = lambda x: x.astype(jnp.int32)
    return i32(group), i32(window), i32(own_start), i32(own_end), i32(num_visits)[None]


def weight_grad_rows(m: int, blocks: BlockSizes) -> int:
    """The rows `transposed_grouped_matmul`'s windows need the inputs to have."""
    if blocks.windows_at_group_start:
        return max(pl.cdiv(m, ROW_ALIGN) * ROW_ALIGN, blocks.block_m)
    return pl.cdiv(m, blocks.block_m) * blocks.block_m


def _weight_grad_kernel(
    visit_group, window, own_start, own_end, num_visits,
    a_ref, b_ref, out_ref, acc_ref, *, precision, sub_rows: int,
):
    v = pl.program_id(2)
    last_v = pl.num_programs(2) - 1
    group = visit_group[v]
    first_of_group = jnp.logical_or(v == 0, visit_group[jnp.maximum(v - 1, 0)] != group)
    last_of_group = jnp.logical_or(v == last_v, visit_group[jnp.minimum(v + 1, last_v)] != group)

    @pl.when(first_of_group)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    # The window is contracted in sub-blocks of sub_rows (the MXU's
    # contraction width); those past the visit's rows are skipped.
    block_m = a_ref.shape[0]
    sub = min(block_m, sub_rows)
    lo, hi = own_start[v], own_end[v]
    for s in range(block_m // sub):
        first = window[v] + s * sub

        @pl.when(jnp.logical_and(jnp.logical_and(lo < hi, first < hi), first + sub > lo))
        def _():
            rows = first + jax.lax.broadcasted_iota(jnp.int32, (sub, 1), 0)
            mine = jnp.logical_and(rows >= lo, rows < hi)
            # Zero the other rows in both operands: 0 * inf must not leak in.
            a = jnp.where(mine, a_ref[pl.ds(s * sub, sub), :], 0)
            b = jnp.where(mine, b_ref[pl.ds(s * sub, sub), :], 0)
            acc_ref[...] += jax.lax.dot_general(
                a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
            )

    @pl.when(last_of_group)
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def transposed_grouped_matmul(
    a: jax.Array,
    b: jax.Array,
    group_sizes: jax.Array,
    *,
    blocks: BlockSizes,
    out_dtype,
    vmem_limit: int,
    sub_rows: int,
    interpret,
) -> jax.Array:
    """out[g] = a[rows of g]^T @ b[rows of g]: [M, P], [M, Q] -> [G, P, Q].

    The weights' gradient of a grouped matmul (megablox calls it tgmm).
    Grid (P tiles and Q tiles, in the order below, then visits): each
    output block accumulates over its group's row windows
    (`make_weight_grad_visits`) and is written once, at the group's last
    visit; empty groups get one visit that writes zeros.
    Here block_m is the window's rows, block_k tiles P and block_n tiles Q;
    edge blocks past P or Q are clipped on write. sub_rows: rows per MXU
    pass (its contraction width).

    The windows are element-indexed; past the inputs' last row (up to
    `weight_grad_rows`) and last column they read unspecified values, which
    never reach a stored output element: rows outside a visit are masked,
    and columns past P or Q only feed output elements clipped on write.
    """
    m, p = a.shape
    q = b.shape[1]
    num_groups = group_sizes.shape[0]
    bm, bp, bq = blocks.block_m, blocks.block_k, blocks.block_n
    assert b.shape[0] == m and bm % ROW_ALIGN == 0 and bm % min(bm, sub_rows) == 0, (a.shape, b.shape, blocks)
    rows = weight_grad_rows(m, blocks)
    align = ROW_ALIGN if blocks.windows_at_group_start else bm
    prefetch = make_weight_grad_visits(group_sizes, rows, bm, align)

    # Windows may overhang the last row and column (see above): no copy.
    windows = lambda block, dim: (pl.Element(bm, (0, rows - m)), pl.Element(block, (0, -dim % block)))

    # Element offsets Mosaic can prove aligned: a whole-dim block (which
    # need not be a multiple of 128) always starts at 0.
    column = lambda tile, block, dim: 0 if block >= dim else tile * block

    # Grid (outer tile, inner tile, visit). When one window holds every row,
    # the outer tile's input is read once and the inner one's once per outer
    # tile: put the side that costs less to re-read inside.
    p_tiles, q_tiles = pl.cdiv(p, bp), pl.cdiv(q, bq)
    p_outer = p + q * p_tiles <= q + p * q_tiles
    tiles = (lambda i, j: (i, j)) if p_outer else (lambda i, j: (j, i))  # -> (P tile, Q tile)

    def a_map(i, j, v, visit_group, window, own_start, own_end, num_visits):
        return pl.multiple_of(window[v], align), column(tiles(i, j)[0], bp, p)

    def b_map(i, j, v, visit_group, window, own_start, own_end, num_visits):
        return pl.multiple_of(window[v], align), column(tiles(i, j)[1], bq, q)

    def out_map(i, j, v, visit_group, window, own_start, own_end, num_visits):
        return visit_group[v], *tiles(i, j)

    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    itemsize = jnp.dtype(a.dtype).itemsize
    return pl.pallas_call(
        functools.partial(_weight_grad_kernel, precision=precision, sub_rows=sub_rows),
        out_shape=jax.ShapeDtypeStruct((num_groups, p, q), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(*tiles(p_tiles, q_tiles), prefetch[-1][0]),
            in_specs=[pl.BlockSpec(windows(bp, p), a_map), pl.BlockSpec(windows(bq, q), b_map)],
            out_specs=pl.BlockSpec((None, bp, bq), out_map),
            scratch_shapes=[pltpu.VMEM((bp, bq), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit,
        ),
        cost_estimate=pl.CostEstimate(
            flops=2 * m * p * q, transcendentals=0,
            bytes_accessed=(m * p + m * q) * itemsize + num_groups * p * q * jnp.dtype(out_dtype).itemsize,
        ),
        interpret=interpret,
        name="ragged_dot_tpu_weight_grad",
    )(*prefetch, a, b)
