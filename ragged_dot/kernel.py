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
  visit merges its rows into it (the first visit starts from zeros);
- the visit axis of the grid has a dynamic length, the routing's real
  visit count (at most `num_m_tiles + num_groups`), so no grid step idles.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


SUB_M = 128  # rows per MXU pass the forward kernel can skip (see _kernel)


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
    visit_group = jnp.searchsorted(visit_end, clamped, side="right").astype(jnp.int32)
    visit_group = jnp.minimum(visit_group, len(sizes) - 1)
    visit_start = visit_end[visit_group] - tiles_per_group[visit_group]
    visit_tile = first_tile[visit_group] + (clamped - visit_start)

    # The rhs block a fill visit keeps: the last real group visited before it.
    is_real = visit_group < num_groups
    last_real = jax.lax.cummax(jnp.where(is_real, visit, -1), axis=0)
    weight_group = jnp.where(
        last_real >= 0, visit_group[jnp.maximum(last_real, 0)], 0
    )
    weight_group = jnp.minimum(weight_group, num_groups - 1)
    i32 = lambda x: x.astype(jnp.int32)
    return (
        i32(row_start),
        i32(row_end),
        i32(visit_group),
        i32(visit_tile),
        i32(weight_group),
        i32(num_visits)[None],
    )


def _kernel(
    row_start, row_end, visit_group, visit_tile, weight_group, num_visits,
    lhs_ref, rhs_ref, *refs,
    num_groups: int, transpose_rhs: bool, precision, k_size: int,
):
    bias_ref, out_ref, acc_ref = refs if len(refs) == 3 else (None, *refs)
    v, k = pl.program_id(1), pl.program_id(2)
    last_k = pl.num_programs(2) - 1
    group = visit_group[v]
    does_matmul = group < num_groups  # fill visits only store zeros

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    # The tile's rows are multiplied in sub-blocks of SUB_M rows, and a
    # sub-block holding none of this group's rows is skipped: a visit at a
    # group boundary costs the MXU at most one partial sub-block, not a
    # whole tile.
    block_m = acc_ref.shape[0]
    sub_m = min(block_m, SUB_M)
    tile_start = visit_tile[v] * block_m
    contract_rhs = 1 if transpose_rhs else 0
    for sub in range(block_m // sub_m):
        rows = pl.ds(sub * sub_m, sub_m)
        first_row = tile_start + sub * sub_m
        overlaps = jnp.logical_and(first_row < row_end[group], first_row + sub_m > row_start[group])

        @pl.when(jnp.logical_and(does_matmul, overlaps))
        def _():
            lhs, rhs = lhs_ref[rows, :], rhs_ref[...]
            block_k = lhs.shape[1]
            if k_size % block_k:  # the last K block runs past K: zero the overhang in both
                valid = k_size - k * block_k
                lhs = jnp.where(jax.lax.broadcasted_iota(jnp.int32, lhs.shape, 1) < valid, lhs, 0)
                rhs = jnp.where(jax.lax.broadcasted_iota(jnp.int32, rhs.shape, contract_rhs) < valid, rhs, 0)
            acc_ref[rows, :] += jax.lax.dot_general(
                lhs, rhs,
                (((1,), (contract_rhs,)), ((), ())),
                preferred_element_type=jnp.float32,
                precision=precision,
            )

    tile = visit_tile[v]
    first_visit_of_tile = jnp.logical_or(v == 0, visit_tile[jnp.maximum(v - 1, 0)] != tile)

    def store(previous):
        rows = tile * block_m + jax.lax.broadcasted_iota(jnp.int32, acc_ref.shape, 0)
        mine = jnp.logical_and(rows >= row_start[group], rows < row_end[group])
        # Fill visits never accumulated, so acc is zero there; they get no bias either.
        value = acc_ref[...]
        if bias_ref is not None:  # the epilogue: the group's bias, added in f32 before the cast
            value = value + jnp.where(does_matmul, bias_ref[...].astype(jnp.float32), 0.0)
        out_ref[...] = jnp.where(mine, value, previous).astype(out_ref.dtype)

    at_store = k == last_k

    @pl.when(jnp.logical_and(at_store, first_visit_of_tile))
    def _():
        store(jnp.zeros(acc_ref.shape, jnp.float32))

    @pl.when(jnp.logical_and(at_store, jnp.logical_not(first_visit_of_tile)))
    def _():
        store(out_ref[...].astype(jnp.float32))


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
) -> jax.Array:
    """The pallas_call. lhs rows must already be a multiple of block_m; K
    and N blocks need not divide K and N (edge blocks are masked or clipped).
    bias: [G, N] or None, added to each group's rows in the store's epilogue.

    `interpret` is False on a TPU, True for plain interpret mode, or a
    `pltpu.InterpretParams` for the TPU interpreter (race detection).
    """
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    bm, bk, bn = blocks.block_m, blocks.block_k, blocks.block_n
    assert m % bm == 0, (lhs.shape, blocks)
    k_steps = pl.cdiv(k, bk)
    prefetch = make_visits(group_sizes, m, bm)

    def k_block(v, kk, visit_group):
        # Fill visits do no matmul: they pin k to the last block, the one the
        # previous visit ended on, so they trigger no new DMA.
        return jnp.where(visit_group[v] >= num_groups, k_steps - 1, kk)

    def lhs_map(nn, v, kk, row_start, row_end, visit_group, visit_tile, weight_group, num_visits):
        return visit_tile[v], k_block(v, kk, visit_group)

    def rhs_map(nn, v, kk, row_start, row_end, visit_group, visit_tile, weight_group, num_visits):
        kb = k_block(v, kk, visit_group)
        if transpose_rhs:
            return weight_group[v], nn, kb
        return weight_group[v], kb, nn

    def out_map(nn, v, kk, row_start, row_end, visit_group, visit_tile, weight_group, num_visits):
        return visit_tile[v], nn

    def bias_map(nn, v, kk, row_start, row_end, visit_group, visit_tile, weight_group, num_visits):
        return weight_group[v], 0, nn

    rhs_block = (None, bn, bk) if transpose_rhs else (None, bk, bn)
    in_specs = [pl.BlockSpec((bm, bk), lhs_map), pl.BlockSpec(rhs_block, rhs_map)]
    operands = [lhs, rhs]
    if bias is not None:  # [G, 1, N]: a (1, bn) block per step, its group's
        in_specs.append(pl.BlockSpec((None, 1, bn), bias_map))
        operands.append(bias.reshape(num_groups, 1, n))
    precision = jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
    itemsize = jnp.dtype(lhs.dtype).itemsize
    flops = 2 * m * k * n  # upper bound: every row once
    cost = pl.CostEstimate(
        flops=flops,
        transcendentals=0,
        bytes_accessed=(m * k + num_groups * k * n) * itemsize
        + m * n * jnp.dtype(out_dtype).itemsize,
    )
    return pl.pallas_call(
        functools.partial(
            _kernel, num_groups=num_groups, transpose_rhs=transpose_rhs, precision=precision, k_size=k
        ),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(pl.cdiv(n, bn), prefetch[-1][0], k_steps),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((bm, bn), out_map),
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
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


def vmem_bytes(blocks: BlockSizes, itemsize: int, out_dtype) -> int:
    """VMEM the forward kernel's buffers take: double-buffered inputs and
    output, fp32 accumulator. The weights' gradient kernel takes the same
    with (block_m, block_k, block_n) read as (P block, rows block, Q block)."""
    bm, bk, bn = blocks.block_m, blocks.block_k, blocks.block_n
    out_item = jnp.dtype(out_dtype).itemsize
    return 2 * (bm * bk + bk * bn) * itemsize + 2 * bm * bn * out_item + bm * bn * 4


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
    group = jnp.minimum(jnp.searchsorted(visit_end, visit, side="right"), num_groups - 1)
    nominal = aligned[group] + (visit - (visit_end[group] - windows[group])) * block_m
    own_start = jnp.maximum(nominal, row_start[group])
    own_end = jnp.minimum(nominal + block_m, row_end[group])
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
