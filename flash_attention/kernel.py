"""Flash attention Pallas TPU kernels over packed variable-length sequences.

Layout. Queries of one KV head's G query heads are stacked as rows,
token-major: q [Hq, T, D] is seen as [Hkv, T * G, D] with row t * G + g for
token t of head hkv * G + g. One K/V block then serves all G heads in one
matmul (K and V are read once per query block, not once per head), and the
heads' gradients for K and V add up inside the matmul.

Masking. Each query row carries the range of packed key positions it may see,
[row_lo, row_hi] (causal, window and sequence boundaries folded in; empty
when row_lo > row_hi). The ranges only grow with the token, so a query block
sees one contiguous run of key blocks (`kv_start`, `kv_count` per query
block) and a key block is seen by one contiguous run of query blocks
(`q_start`, `q_count`). Both are computed on the device (`make_schedule` in
ops.py) and flattened into the grid's steps: a step per pair of blocks that
meet (and one for a block that meets none, to write its zeros), so blocks
outside the runs cost neither a DMA, nor compute, nor a grid step. A block
that every row sees whole skips the mask arithmetic.

Statistics are kept in f32 whatever the input dtype. Attention sinks enter
as the softmax's starting max and sum (m = sink, l = 1).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# A finite "minus infinity": exp(MASKED - m) is 0 and MASKED - MASKED is not NaN.
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)
# The log-sum-exp stored for a row that sees no key: exp(s - EMPTY_LSE) is 0 in the backward.
EMPTY_LSE = float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_q: int  # query tokens per block (its rows are block_q * G); a multiple of 16
    block_k: int  # key tokens per block; a multiple of 128


@dataclasses.dataclass(frozen=True)
class Options:
    """The static part of an attention call."""
    scale: float
    softcap: float  # 0: none
    has_sinks: bool
    groups: int  # query heads per KV head (G)


def _dot(a, b, contract_a: int, contract_b: int):
    """a . b contracted on one dim each, accumulated in f32 (all f32 passes for f32 inputs)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                               preferred_element_type=jnp.float32, precision=precision)


def _scores(q, k, opts: Options):
    """Scaled (and soft-capped) scores [rows, block_k] in f32, and tanh of the cap's argument."""
    s = _dot(q, k, 1, 1) * opts.scale
    if opts.softcap:
        t = jnp.tanh(s / opts.softcap)
        return opts.softcap * t, t
    return s, None


def _visible(lo_ref, hi_ref, first_key: jax.Array, block_k: int):
    """[rows, block_k] bool: key `first_key + c` lies in its row's range."""
    key = first_key + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    return (key >= lo_ref[...]) & (key <= hi_ref[...])


def _seen_whole(lo_max, hi_min, first_key, block_k):
    """Whether every row of the query block sees every key of the key block."""
    return (lo_max <= first_key) & (hi_min >= first_key + block_k - 1)


# Every kernel's grid is (KV heads, steps): a step pairs one block of its own
# side with one block of the other side it meets (`ops.Steps`), and the steps
# of one own-side block are consecutive, so its accumulators live in VMEM
# scratch from its first step to its last. Scalar prefetch, in this order:
# the steps' own-side block and each block's first step, then the other
# side's run (start, length) per own-side block, then lo_max and hi_min per
# query block.


def _position(step_block, step_first, run_start, run_count):
    """(own block, step within its run, the other side's block, the run's length) of this grid step."""
    p = pl.program_id(1)
    own = step_block[p]
    j = p - step_first[own]
    return own, j, _clamped(run_start[own], run_count[own], j), run_count[own]


def _clamped(start, count, step):
    """Block `start + step`, held at the run's last block past its end (no new DMA)."""
    return start + jnp.minimum(step, jnp.maximum(count - 1, 0))


def _run_step(j, count, body_whole, body_masked, whole):
    """Runs the step's body (without the mask where the block is seen whole) if it is in the run."""
    runs = j < count
    pl.when(runs & whole)(body_whole)
    pl.when(runs & jnp.logical_not(whole))(body_masked)


def _prefetch(steps, run_start, run_count, schedule):
    return steps.block, steps.first, run_start, run_count, schedule.lo_max, schedule.hi_min


# Index maps: grid indices (h, p), then the six prefetched arrays.
def _own_map(h, p, block, first, start, count, *_):
    return h, block[p], 0


def _other_map(h, p, block, first, start, count, *_):
    own = block[p]
    return h, _clamped(start[own], count[own], p - first[own]), 0


def _own_rows_map(h, p, block, *_):
    return block[p], 0


def _other_rows_map(h, p, block, first, start, count, *_):
    own = block[p]
    return _clamped(start[own], count[own], p - first[own]), 0


_PARAMS = dict(dimension_semantics=("parallel", "arbitrary"))


def _query_side_specs(rows_per_block, dv, block_map, rows_map):
    """Specs of dO [rows, Dv], lse and D [rows, 1], row_lo and row_hi: the backward's per-query inputs."""
    return [pl.BlockSpec((None, rows_per_block, dv), block_map),
            pl.BlockSpec((None, rows_per_block, 1), block_map),
            pl.BlockSpec((None, rows_per_block, 1), block_map),
            pl.BlockSpec((rows_per_block, 1), rows_map),
            pl.BlockSpec((rows_per_block, 1), rows_map)]


# ---------------------------------------------------------------- forward


def _forward_kernel(step_block, step_first, kv_start, kv_count, lo_max, hi_min,  # scalar prefetch
                    q_ref, k_ref, v_ref, lo_ref, hi_ref, sink_ref,  # inputs
                    o_ref, lse_ref,  # outputs
                    m_ref, l_ref, acc_ref,  # scratch
                    *, opts: Options, block_k: int):
    i, j, kv_block, count = _position(step_block, step_first, kv_start, kv_count)

    @pl.when(j == 0)
    def _init():
        if opts.has_sinks:
            m_ref[...] = sink_ref[...]
            l_ref[...] = jnp.ones_like(l_ref)
        else:
            m_ref[...] = jnp.full_like(m_ref, MASKED)
            l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    first_key = kv_block * block_k

    def step(masked: bool):
        s, _ = _scores(q_ref[...], k_ref[...], opts)
        if masked:
            visible = _visible(lo_ref, hi_ref, first_key, block_k)
            s = jnp.where(visible, s, MASKED)
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        if masked:
            p = jnp.where(visible, p, 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        v = v_ref[...]
        acc_ref[...] = alpha * acc_ref[...] + _dot(p.astype(v.dtype), v, 1, 0)
        m_ref[...] = m_new

    _run_step(j, count, lambda: step(False), lambda: step(True), _seen_whole(lo_max[i], hi_min[i], first_key, block_k))

    @pl.when(j == jnp.maximum(count, 1) - 1)
    def _finish():
        l = l_ref[...]
        seen = l > 0.0
        o_ref[...] = (acc_ref[...] / jnp.where(seen, l, 1.0)).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(seen, m_ref[...] + jnp.log(jnp.where(seen, l, 1.0)), EMPTY_LSE)


def forward(q, k, v, row_lo, row_hi, sink_rows, schedule, *, opts: Options, blocks: BlockSizes,
            vmem_limit: int | None, interpret):
    """o [Hkv, T*G, Dv] in q's dtype and lse [Hkv, T*G, 1] f32.

    q [Hkv, Tq*G, D], k [Hkv, Tk, D], v [Hkv, Tk, Dv]; row_lo, row_hi
    [Tq*G, 1] int32; sink_rows [Hkv, block_q*G, 1] f32; schedule: the
    `ops.make_schedule` arrays.
    """
    hkv, rows, d = q.shape
    dv = v.shape[2]
    rows_per_block = blocks.block_q * opts.groups
    bk = blocks.block_k
    steps = schedule.q_steps
    return pl.pallas_call(
        functools.partial(_forward_kernel, opts=opts, block_k=bk),
        out_shape=(jax.ShapeDtypeStruct((hkv, rows, dv), q.dtype), jax.ShapeDtypeStruct((hkv, rows, 1), jnp.float32)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(hkv, steps.count),
            in_specs=[
                pl.BlockSpec((None, rows_per_block, d), _own_map),
                pl.BlockSpec((None, bk, d), _other_map),
                pl.BlockSpec((None, bk, dv), _other_map),
                pl.BlockSpec((rows_per_block, 1), _own_rows_map),
                pl.BlockSpec((rows_per_block, 1), _own_rows_map),
                pl.BlockSpec((None, rows_per_block, 1), lambda h, *_: (h, 0, 0)),
            ],
            out_specs=[pl.BlockSpec((None, rows_per_block, dv), _own_map),
                       pl.BlockSpec((None, rows_per_block, 1), _own_map)],
            scratch_shapes=[pltpu.VMEM((rows_per_block, 1), jnp.float32),
                            pltpu.VMEM((rows_per_block, 1), jnp.float32),
                            pltpu.VMEM((rows_per_block, dv), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(**_PARAMS, vmem_limit_bytes=vmem_limit),
        interpret=interpret,
        name="flash_attention_fwd",
    )(*_prefetch(steps, schedule.kv_start, schedule.kv_count, schedule), q, k, v, row_lo, row_hi, sink_rows)


# ---------------------------------------------------------------- backward


def _probabilities(q, k, lse, visible, opts: Options):
    """P = exp(s - lse) [rows, block_k] in f32 (0 where not visible), and tanh of the cap's argument."""
    s, t = _scores(q, k, opts)
    p = jnp.exp(s - lse)
    return (p if visible is None else jnp.where(visible, p, 0.0)), t


def _score_grad(p, dp, di, t, opts: Options):
    """dL/d(q.k) for one block: softmax's backward, then the cap's, then the scale."""
    ds = p * (dp - di)
    if opts.softcap:
        ds = ds * (1.0 - t * t)
    return ds * opts.scale


def _dq_kernel(step_block, step_first, kv_start, kv_count, lo_max, hi_min,
               q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, lo_ref, hi_ref,
               dq_ref,
               acc_ref,
               *, opts: Options, block_k: int):
    i, j, kv_block, count = _position(step_block, step_first, kv_start, kv_count)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    first_key = kv_block * block_k

    def step(masked: bool):
        visible = _visible(lo_ref, hi_ref, first_key, block_k) if masked else None
        k = k_ref[...]
        p, t = _probabilities(q_ref[...], k, lse_ref[...], visible, opts)
        dp = _dot(do_ref[...], v_ref[...], 1, 1)
        ds = _score_grad(p, dp, di_ref[...], t, opts)
        acc_ref[...] += _dot(ds.astype(k.dtype), k, 1, 0)

    _run_step(j, count, lambda: step(False), lambda: step(True), _seen_whole(lo_max[i], hi_min[i], first_key, block_k))

    @pl.when(j == jnp.maximum(count, 1) - 1)
    def _finish():
        dq_ref[...] = acc_ref[...].astype(dq_ref.dtype)


def _dkv_kernel(step_block, step_first, q_start, q_count, lo_max, hi_min,
                k_ref, v_ref, q_ref, do_ref, lse_ref, di_ref, lo_ref, hi_ref,
                dk_ref, dv_ref,
                dk_acc, dv_acc,
                *, opts: Options, block_k: int):
    j, i, q_block, count = _position(step_block, step_first, q_start, q_count)

    @pl.when(i == 0)
    def _init():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)

    first_key = j * block_k

    def step(masked: bool):
        visible = _visible(lo_ref, hi_ref, first_key, block_k) if masked else None
        q, do = q_ref[...], do_ref[...]
        p, t = _probabilities(q, k_ref[...], lse_ref[...], visible, opts)
        dv_acc[...] += _dot(p.astype(do.dtype), do, 0, 0)
        dp = _dot(do, v_ref[...], 1, 1)
        ds = _score_grad(p, dp, di_ref[...], t, opts)
        dk_acc[...] += _dot(ds.astype(q.dtype), q, 0, 0)

    whole = _seen_whole(lo_max[q_block], hi_min[q_block], first_key, block_k)
    _run_step(i, count, lambda: step(False), lambda: step(True), whole)

    @pl.when(i == jnp.maximum(count, 1) - 1)
    def _finish():
        dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def backward(q, k, v, do, lse, di, row_lo, row_hi, schedule, *, opts: Options, blocks: BlockSizes,
             vmem_limit: int | None, interpret):
    """(dq, dk, dv) in the inputs' layouts and dtypes. lse and di [Hkv, Tq*G, 1] f32."""
    hkv, rows, d = q.shape
    dv_dim = v.shape[2]
    rows_per_block = blocks.block_q * opts.groups
    bk = blocks.block_k
    params = pltpu.CompilerParams(**_PARAMS, vmem_limit_bytes=vmem_limit)

    # dq: per query block, its run of key blocks.
    steps = schedule.q_steps
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, opts=opts, block_k=bk),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(hkv, steps.count),
            in_specs=[
                pl.BlockSpec((None, rows_per_block, d), _own_map),
                pl.BlockSpec((None, bk, d), _other_map),
                pl.BlockSpec((None, bk, dv_dim), _other_map),
                *_query_side_specs(rows_per_block, dv_dim, _own_map, _own_rows_map),
            ],
            out_specs=pl.BlockSpec((None, rows_per_block, d), _own_map),
            scratch_shapes=[pltpu.VMEM((rows_per_block, d), jnp.float32)],
        ),
        compiler_params=params,
        interpret=interpret,
        name="flash_attention_dq",
    )(*_prefetch(steps, schedule.kv_start, schedule.kv_count, schedule), q, k, v, do, lse, di, row_lo, row_hi)

    # dk, dv: per key block, the run of query blocks that see it.
    steps = schedule.k_steps
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, opts=opts, block_k=bk),
        out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(hkv, steps.count),
            in_specs=[
                pl.BlockSpec((None, bk, d), _own_map),
                pl.BlockSpec((None, bk, dv_dim), _own_map),
                pl.BlockSpec((None, rows_per_block, d), _other_map),
                *_query_side_specs(rows_per_block, dv_dim, _other_map, _other_rows_map),
            ],
            out_specs=[pl.BlockSpec((None, bk, d), _own_map), pl.BlockSpec((None, bk, dv_dim), _own_map)],
            scratch_shapes=[pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, dv_dim), jnp.float32)],
        ),
        compiler_params=params,
        interpret=interpret,
        name="flash_attention_dkv",
    )(*_prefetch(steps, schedule.q_start, schedule.q_count, schedule), k, v, q, do, lse, di, row_lo, row_hi)
    return dq, dk, dv
