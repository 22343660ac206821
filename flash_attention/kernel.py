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
that every row sees whole skips the mask arithmetic; on the causal diagonal
a pair of blocks runs in parts (slices of the rows by halves of the keys,
`diagonal_slices`) and skips those no row sees (`_run_step`). Without a
softcap the forward scales a query block by softmax_scale * log2(e) once
(`scaled_query`, into VMEM), which saves a multiply per score. (Scaling q in
XLA before the kernel saves as much inside it, but costs a pass over q that
the training step's backward cannot share: MODELED, gpt-oss-20b on v6e,
+179 us around its 8k training step's kernels.)

Statistics are kept in f32 whatever the input dtype, in base 2 (exp2 is the
EUP's operation; log2(e) is folded into the scale), each row's held
replicated over 128 lanes so that it meets the scores as whole vregs.
Attention sinks enter as the softmax's starting max and sum (m = sink,
l = 1). Per-row arrays (lse, D, the key ranges) live lane-dense in HBM
([.., 1, rows]); the forward and dq turn them into columns once per query
block, and dkv works on transposed scores [keys, rows] where they are
already in place (so P^T dO and dS^T Q need no transpose).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._shared.attention_math import (LANES, LOG2E, MASKED, as_columns, dot, lanes, scaled_query, scores,
                                     start_rows)

# The log-sum-exp stored for a row that sees no key: exp(s - EMPTY_LSE) is 0 in the backward
# (and EMPTY_LSE * log2(e) is still finite).
EMPTY_LSE = 0.5 * float(jnp.finfo(jnp.float32).max)
UPPER, BOTH = "upper", "both"  # which ends of the rows' key ranges a block's mask compares


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """How a call is tiled and compiled: the tuning table's choice (tuning.choose_blocks)."""
    block_q: int  # query tokens per block (its rows are block_q * G); a multiple of 16
    block_k: int  # key tokens per block; a multiple of 128
    # The kernels ("fwd", "dq", "dkv") compiled with libtpu's LP instruction scheduler: it moves a
    # kernel's schedule both ways, by up to about 10%, so the table chooses (bench/flash_tune.py).
    lp_kernels: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Options:
    """The static part of an attention call."""
    scale: float
    softcap: float  # 0: none
    has_sinks: bool
    groups: int  # query heads per KV head (G)


@dataclasses.dataclass(frozen=True)
class Part:
    """A static part of a step's pair of blocks: rows [row0, row0 + rows) of the query block,
    keys [key0, key0 + keys) of the key block."""
    row0: int
    rows: int
    key0: int
    keys: int

    @property
    def row_at(self):
        return pl.ds(self.row0, self.rows)

    @property
    def key_at(self):
        return pl.ds(self.key0, self.keys)


def _visible(lo_cols, hi_cols, part: Part, first_key: jax.Array, mask: str):
    """[part's rows, part's keys] bool: key `first_key + part.key0 + c` lies in its row's range
    ("upper": the range's start is known to lie before the block, only its end is compared).
    lo_cols and hi_cols: the block's rows' bounds as columns [rows, LANES] (`as_columns`)."""
    key = jax.lax.broadcasted_iota(jnp.int32, (part.rows, part.keys), 1)
    relative = lambda cols: lanes(cols[part.row_at, :] - (first_key + part.key0), part.keys)
    below_end = key <= relative(hi_cols)
    return below_end if mask == UPPER else below_end & (key >= relative(lo_cols))


def _visible_transposed(lo_ref, hi_ref, part: Part, first_key: jax.Array, mask: str):
    """_visible's transpose [part's keys, part's rows], from the block's rows' bounds lo_ref and
    hi_ref [1, rows]."""
    key = jax.lax.broadcasted_iota(jnp.int32, (part.keys, part.rows), 0) + part.key0
    below_end = key <= hi_ref[:, part.row_at] - first_key
    return below_end if mask == UPPER else below_end & (key >= lo_ref[:, part.row_at] - first_key)


# Every kernel's grid is (KV heads x parts, steps): a step pairs one block of its
# own side with one block of the other side it meets (`ops.Steps`), and the steps
# of one own-side block are consecutive, so its accumulators live in VMEM
# scratch from its first step to its last. Scalar prefetch, in this order:
# the steps' own-side block and each block's first step, then the other
# side's run (start, length) per own-side block, then lo_max and hi_min per
# query block and the largest row_hi of each slice of a query block (`diagonal_slices`).
#
# parts: 1, or 2 where a megacore's two cores would not get the same number of
# KV heads (MQA, an odd Hkv). Then each KV head's own-side blocks are cut in two
# runs of about as many steps, one per row of the grid's parallel axis: the step
# arrays hold the second part's steps from their middle on, and the shorter part
# idles past its end (its step is past its block's run: no DMA, compute or write).


def parts_for(parts: int, own_blocks: int) -> int:
    """A kernel with one own-side block runs it whole: an empty part would still write its
    output block back, over the other part's."""
    return parts if own_blocks > 1 else 1


def _global_step(h, p, step_block, parts: int):
    """Where grid step (h, p) is in the step arrays."""
    return (h % parts) * (step_block.shape[0] // parts) + p if parts > 1 else p


def _position(step_block, step_first, run_start, run_count, parts: int):
    """(own block, step within its run, the other side's block, the run's length) of this grid step."""
    p = _global_step(pl.program_id(0), pl.program_id(1), step_block, parts)
    own = step_block[p]
    j = p - step_first[own]
    return own, j, _clamped(run_start[own], run_count[own], j), run_count[own]


def _clamped(start, count, step):
    """Block `start + step`, held at the run's last block past its end (no new DMA)."""
    return start + jnp.minimum(step, jnp.maximum(count - 1, 0))


def splits_diagonal(rows_per_block: int, block_k: int) -> bool:
    """Whether diagonal blocks run in parts: each half of the rows and of the keys a whole
    number of lane tiles (the dkv kernel has the rows on its lanes)."""
    return rows_per_block % (2 * LANES) == 0 and block_k % (2 * LANES) == 0


# Parts narrower than this many keys run no more than 2 slices (MODELED: Gemma-2-9B on tpu7x, 1024 x
# 512 blocks, 4 slices of 256 x 256: 1.02x the compute of 2).
MIN_SLICED_KEYS = 512


def diagonal_slices(rows_per_block: int, block_q: int, block_k: int) -> int:
    """How many slices (by tokens) a query block's rows run in on the causal diagonal: 1 (no
    split), else 2, or more where a slice would hold more tokens than half a key block: parts
    square in tokens skip the most above the diagonal (MODELED: Llama-2-7B's forward on tpu7x,
    2048 x 1024 blocks: 4 slices execute 0.94x the FLOPs of 2 in 0.985x the cycles; 256-row
    slices cost more than they skip). Slices are whole bf16 row tiles. The forward and dq run
    each slice against each half of the keys, and so does dkv where a slice's rows are whole
    lane tiles (its rows are on the lanes), else halves of the rows (half the slices each)."""
    if not splits_diagonal(rows_per_block, block_k):
        return 1
    n = 2
    while (block_q // n > block_k // 2 >= MIN_SLICED_KEYS and block_q % (2 * n) == 0
           and rows_per_block // (2 * n) % 16 == 0):
        n *= 2
    return n


def _slices(schedule, rows: int, rows_per_block: int) -> int:
    """The diagonal slices the schedule was made for (ops.make_schedule: `diagonal_slices`)."""
    return schedule.slice_hi_max.shape[0] // (rows // rows_per_block)


def _run_step(j, count, body, lo_max, hi_min, slice_hi_max, q_block, first_key, whole: Part, slices: int,
              rows_on_lanes: bool = False):
    """Runs the step's body if the step is in its run, with the least work the blocks need:
    body(None, whole) where every row sees every key of the block, body(BOTH, whole) where
    some row's range starts inside the block, and where every row's range starts before it but
    some ends inside (the causal diagonal) body(UPPER, ...) over the whole block or, with
    `slices` > 1, over only the parts (a slice of the rows by a half of the keys) that some
    row sees: on a diagonal block of as many tokens as keys, the parts above the diagonal are
    skipped. With rows_on_lanes (dkv) a part's rows are whole lane tiles: the slices where they
    are (MODELED: Llama-2-7B's training step on tpu7x, 2048 x 1024 blocks, 4 slices against halves:
    10257 against 10561 us, 0.531x against 0.554x the dense FLOPs), else halves. Each part is a body of
    its own (a loop over slices hides which run from the bench's model of the schedule).
    lo_max, hi_min, slice_hi_max: the prefetched arrays, read at query block q_block."""
    runs = j < count
    starts_before = lo_max[q_block] <= first_key
    ends_after = hi_min[q_block] >= first_key + whole.keys - 1
    pl.when(runs & starts_before & ends_after)(lambda: body(None, whole))
    diagonal = runs & starts_before & jnp.logical_not(ends_after)
    if slices == 1:
        pl.when(diagonal)(lambda: body(UPPER, whole))
    else:
        half_keys = whole.keys // 2
        hi_max = lambda a: slice_hi_max[slices * q_block + a]  # a slice's largest row_hi
        if rows_on_lanes and whole.rows // slices % LANES:
            parts, per_part = 2, slices // 2
            part_hi_max = lambda a: functools.reduce(jnp.maximum, [hi_max(a * per_part + i) for i in range(per_part)])
        else:
            parts, part_hi_max = slices, hi_max
        part_rows = whole.rows // parts
        sees = lambda a, b: part_hi_max(a) >= first_key + b * half_keys  # rows' part a, keys' half b
        # Every part sees its keys' second half (so its first too): one body over the whole block.
        all_parts = functools.reduce(jnp.logical_and, [sees(a, 1) for a in range(parts)])
        pl.when(diagonal & all_parts)(lambda: body(UPPER, whole))
        split = diagonal & jnp.logical_not(all_parts)
        for a in range(parts):
            for b in range(2):
                part = Part(a * part_rows, part_rows, b * half_keys, half_keys)
                pl.when(split & sees(a, b))(functools.partial(body, UPPER, part))
    pl.when(runs & jnp.logical_not(starts_before))(lambda: body(BOTH, whole))


def _prefetch(steps, run_start, run_count, schedule):
    return steps.block, steps.first, run_start, run_count, schedule.lo_max, schedule.hi_min, schedule.slice_hi_max


@dataclasses.dataclass(frozen=True)
class _Maps:
    """Index maps of a grid of `parts` per KV head: grid indices (h, p), then the
    prefetched arrays (`_prefetch`)."""
    parts: int

    def head(self, h, *_):
        return h // self.parts

    def _own(self, h, p, block, *_):
        return block[_global_step(h, p, block, self.parts)]

    def _other(self, h, p, block, first, start, count, *_):
        g = _global_step(h, p, block, self.parts)
        own = block[g]
        return _clamped(start[own], count[own], g - first[own])

    def own(self, h, p, *prefetched):
        return self.head(h), self._own(h, p, *prefetched), 0

    def other(self, h, p, *prefetched):
        return self.head(h), self._other(h, p, *prefetched), 0

    def own_lanes(self, h, p, *prefetched):  # [Hkv, 1, rows] arrays: the block is on the lanes
        return self.head(h), 0, self._own(h, p, *prefetched)

    def own_row_lanes(self, h, p, *prefetched):  # [1, rows]
        return 0, self._own(h, p, *prefetched)

    def other_lanes(self, h, p, *prefetched):  # [Hkv, 1, rows] arrays: the block is on the lanes
        return self.head(h), 0, self._other(h, p, *prefetched)

    def other_row_lanes(self, h, p, *prefetched):  # [1, rows]
        return 0, self._other(h, p, *prefetched)

    def whole_head(self, h, *_):
        return self.head(h), 0, 0


def _column_scratch(rows_per_block, *dtypes):
    return [pltpu.VMEM((rows_per_block, LANES), dtype) for dtype in dtypes]


def _compiler_params(lp_scheduler: bool, **extra):
    flags = {"XLA_TPU_FORCE_LP_LLO_SCHEDULER": True} if lp_scheduler else None
    return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"), flags=flags, **extra)


def _shared_head(index_map, share: int):
    """index_map for an operand whose head is shared by `share` consecutive heads of the grid."""
    if share == 1:
        return index_map

    def shared(*grid_and_prefetched):
        head, *rest = index_map(*grid_and_prefetched)
        return head // share, *rest
    return shared


# ---------------------------------------------------------------- forward


def _forward_kernel(step_block, step_first, kv_start, kv_count, lo_max, hi_min, slice_hi_max,  # scalar prefetch
                    q_ref, k_ref, v_ref, lo_ref, hi_ref, sink_ref,  # inputs
                    o_ref, lse_ref,  # outputs
                    m_ref, l_ref, acc_ref, lo_cols, hi_cols, q_rows_ref,  # scratch
                    *, opts: Options, block_k: int, parts: int, slices: int):
    i, j, kv_block, count = _position(step_block, step_first, kv_start, kv_count, parts)
    rows_per_block, d = m_ref.shape[0], k_ref.shape[1]
    in_lanes = q_ref.shape != (rows_per_block, d)  # heads side by side: [block_q, G * D]

    @pl.when(j == 0)
    def _init():
        lo_cols[...] = as_columns(lo_ref[...])
        hi_cols[...] = as_columns(hi_ref[...])
        start_rows(m_ref, l_ref, acc_ref, sink_ref, opts.has_sinks)
        if in_lanes or not opts.softcap:
            q = q_ref[...].reshape(rows_per_block, d)
            q_rows_ref[...] = q if opts.softcap else scaled_query(q, opts.scale)  # a cap needs the unscaled product

    first_key = kv_block * block_k
    q_rows = q_rows_ref if in_lanes or not opts.softcap else q_ref

    def step(mask, part: Part):
        rows = part.row_at
        s, _ = scores(q_rows[rows, :], k_ref[part.key_at, :], opts.scale, opts.softcap, q_scaled=not opts.softcap)
        if mask:
            s = jnp.where(_visible(lo_cols, hi_cols, part, first_key, mask), s, MASKED)
        m_prev = m_ref[rows, :]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # A row that has seen no key yet (m_new still MASKED) gets p = 1 for its hidden keys here:
        # the first key it sees scales them away (alpha = 0), and _finish zeroes a row that sees none.
        p = jnp.exp2(s - lanes(m_new, part.keys))
        alpha = jnp.exp2(m_prev - m_new)
        l_ref[rows, :] = alpha * l_ref[rows, :] + jnp.sum(p, axis=1, keepdims=True)
        v = v_ref[part.key_at, :]
        acc_ref[rows, :] = lanes(alpha, acc_ref.shape[1]) * acc_ref[rows, :] + dot(p.astype(v.dtype), v, 1, 0)
        m_ref[rows, :] = m_new

    _run_step(j, count, step, lo_max, hi_min, slice_hi_max, i, first_key, Part(0, rows_per_block, 0, block_k), slices)

    @pl.when(j == jnp.maximum(count, 1) - 1)
    def _finish():
        m, l = m_ref[...], l_ref[...]
        # A row saw a key or a sink; a NaN score (which a max may skip, a sum does not) is passed on.
        seen = (m != MASKED) | jnp.isnan(l)
        l = jnp.where(seen, l, 1.0)
        out = acc_ref[...] / lanes(l, acc_ref.shape[1])
        o_ref[...] = jnp.where(lanes(seen, acc_ref.shape[1]), out, 0.0).reshape(o_ref.shape).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(seen, (m + jnp.log2(l)) / LOG2E, EMPTY_LSE).T[:1]  # lane-dense [1, rows]


def forward(q, k, v, row_lo, row_hi, sink_rows, schedule, *, opts: Options, blocks: BlockSizes, parts: int,
            interpret):
    """o in q's layout with Dv for D, in q's dtype, and lse [Hkv, 1, Tq*G] f32.

    q [Hkv, Tq*G, D] (attention_math.heads_as_rows) or, D and Dv multiples of 128,
    [Hkv, Tq, G*D] (heads_in_lanes); k [Hkv, Tk, D], v [Hkv, Tk, Dv]; row_lo, row_hi
    [1, Tq*G] int32; sink_rows [Hkv, block_q*G, 1] f32; schedule: the
    `ops.make_schedule` arrays. Per-row arrays are lane-dense [.., 1, rows]
    in HBM (a [rows, 1] array would pad each value to 128 lanes).
    """
    hkv, d, dv, groups = k.shape[0], k.shape[2], v.shape[2], opts.groups
    in_lanes = q.shape[2] != d
    rows = q.shape[1] * (groups if in_lanes else 1)
    rows_per_block = blocks.block_q * groups
    # a block of q and of o: block_q tokens' G heads as rows, or side by side
    q_block, o_block = ((blocks.block_q, groups * d), (blocks.block_q, groups * dv)) if in_lanes else (
        (rows_per_block, d), (rows_per_block, dv))
    bk = blocks.block_k
    steps = schedule.q_steps
    maps = _Maps(parts_for(parts, rows // rows_per_block))
    return pl.pallas_call(
        functools.partial(_forward_kernel, opts=opts, block_k=bk, parts=maps.parts,
                          slices=_slices(schedule, rows, rows_per_block)),
        out_shape=(jax.ShapeDtypeStruct((hkv, q.shape[1], o_block[1]), q.dtype),
                   jax.ShapeDtypeStruct((hkv, 1, rows), jnp.float32)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7,
            grid=(hkv * maps.parts, steps.count),
            in_specs=[
                pl.BlockSpec((None, *q_block), maps.own),
                pl.BlockSpec((None, bk, d), maps.other),
                pl.BlockSpec((None, bk, dv), maps.other),
                pl.BlockSpec((1, rows_per_block), maps.own_row_lanes),
                pl.BlockSpec((1, rows_per_block), maps.own_row_lanes),
                pl.BlockSpec((None, rows_per_block, 1), maps.whole_head),
            ],
            out_specs=[pl.BlockSpec((None, *o_block), maps.own),
                       pl.BlockSpec((None, 1, rows_per_block), maps.own_lanes)],
            scratch_shapes=[*_column_scratch(rows_per_block, jnp.float32, jnp.float32),  # m, l
                            pltpu.VMEM((rows_per_block, dv), jnp.float32),  # acc
                            *_column_scratch(rows_per_block, jnp.int32, jnp.int32),  # lo, hi
                            # q's block as rows, times scale * log2(e) without a cap; once per query block
                            pltpu.VMEM((rows_per_block, d) if in_lanes or not opts.softcap else (16, LANES),
                                       q.dtype)],
        ),
        compiler_params=_compiler_params("fwd" in blocks.lp_kernels),
        interpret=interpret,
        name="flash_attention_fwd",
    )(*_prefetch(steps, schedule.kv_start, schedule.kv_count, schedule), q, k, v, row_lo, row_hi, sink_rows)


# ---------------------------------------------------------------- backward


def _probabilities(q, k, lse2, visible, opts: Options):
    """P = exp(s - lse) [rows, block_k] in f32 (0 where not visible), and tanh of the cap's
    argument. lse2: the log-sum-exp times log2(e)."""
    s, t = scores(q, k, opts.scale, opts.softcap)
    p = jnp.exp2(s - lse2)
    return (p if visible is None else jnp.where(visible, p, 0.0)), t


def _score_grad(p, dp, di, t, opts: Options):
    """dL/d(q.k) for one block, less the softmax scale (dq and dk apply it once, at the end):
    softmax's backward, then the cap's."""
    ds = p * (dp - di)
    if opts.softcap:
        ds = ds * (1.0 - t * t)
    return ds


def _dq_kernel(step_block, step_first, kv_start, kv_count, lo_max, hi_min, slice_hi_max,
               q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, lo_ref, hi_ref,
               dq_ref,
               acc_ref, lse_cols, di_cols, lo_cols, hi_cols,
               *, opts: Options, block_k: int, parts: int, slices: int):
    i, j, kv_block, count = _position(step_block, step_first, kv_start, kv_count, parts)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        for cols, row in ((lse_cols, lse_ref), (di_cols, di_ref), (lo_cols, lo_ref), (hi_cols, hi_ref)):
            cols[...] = as_columns(row[...])

    first_key = kv_block * block_k

    def step(mask, part: Part):
        rows = part.row_at
        visible = _visible(lo_cols, hi_cols, part, first_key, mask) if mask else None
        k = k_ref[part.key_at, :]
        p, t = _probabilities(q_ref[rows, :], k, lanes(lse_cols[rows, :], part.keys), visible, opts)
        dp = dot(do_ref[rows, :], v_ref[part.key_at, :], 1, 1)
        ds = _score_grad(p, dp, lanes(di_cols[rows, :], part.keys), t, opts)
        acc_ref[rows, :] += dot(ds.astype(k.dtype), k, 1, 0)

    _run_step(j, count, step, lo_max, hi_min, slice_hi_max, i, first_key, Part(0, q_ref.shape[0], 0, block_k), slices)

    @pl.when(j == jnp.maximum(count, 1) - 1)
    def _finish():
        dq_ref[...] = (acc_ref[...] * opts.scale).astype(dq_ref.dtype)


def _dkv_kernel(step_block, step_first, q_start, q_count, lo_max, hi_min, slice_hi_max,
                k_ref, v_ref, q_ref, do_ref, lse_ref, di_ref, lo_ref, hi_ref,
                dk_ref, dv_ref, *rest,
                opts: Options, block_k: int, parts: int, slices: int, fuse_dq: bool):
    """Works on the transposed scores [block_k, rows] (keys on sublanes, query rows on lanes):
    dV += P^T dO and dK += dS^T Q then contract the rows with no transpose. The per-row
    inputs lse, D, lo and hi come as [1, rows]. With fuse_dq, it also adds dS K into an f32
    dq of all the KV head's rows, resident in VMEM from the head's first step to its last."""
    if fuse_dq:
        dq_ref, dk_acc, dv_acc, dq_acc = rest
    else:
        dk_acc, dv_acc = rest
    j, i, q_block, count = _position(step_block, step_first, q_start, q_count, parts)
    rows = q_ref.shape[0]

    if fuse_dq:
        @pl.when(pl.program_id(1) == 0)
        def _init_dq():
            dq_acc[...] = jnp.zeros_like(dq_acc)

    @pl.when(i == 0)
    def _init():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)

    first_key = j * block_k

    def step(mask, part: Part):
        rows_at, keys = part.row_at, part.key_at
        q, do = q_ref[rows_at, :], do_ref[rows_at, :]
        visible = _visible_transposed(lo_ref, hi_ref, part, first_key, mask) if mask else None
        k = k_ref[keys, :]
        p, t = _probabilities(k, q, lse_ref[:, rows_at], visible, opts)
        dv_acc[keys, :] += dot(p.astype(do.dtype), do, 1, 0)
        dp = dot(v_ref[keys, :], do, 1, 1)
        ds = _score_grad(p, dp, di_ref[:, rows_at], t, opts)
        dk_acc[keys, :] += dot(ds.astype(q.dtype), q, 1, 0)
        if fuse_dq:
            at = pl.ds(pl.multiple_of(q_block * rows + part.row0, LANES), part.rows)
            dq_acc[at, :] += dot(ds.astype(k.dtype), k, 0, 0)

    _run_step(i, count, step, lo_max, hi_min, slice_hi_max, q_block, first_key, Part(0, rows, 0, block_k), slices,
              rows_on_lanes=True)

    if fuse_dq:
        @pl.when(pl.program_id(1) == pl.num_programs(1) - 1)
        def _finish_dq():
            dq_ref[...] = (dq_acc[...] * opts.scale).astype(dq_ref.dtype)

    @pl.when(i == jnp.maximum(count, 1) - 1)
    def _finish():
        dk_ref[...] = (dk_acc[...] * opts.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def backward(q, k, v, do, lse, di, row_lo, row_hi, schedule, *, opts: Options, blocks: BlockSizes, parts: int,
             fused_dq_vmem_limit: int | None, vmem_limit: int | None, interpret):
    """(dq, dk, dv) in the inputs' layouts and dtypes. lse and di [Hkv, 1, Tq*G] f32, row_lo
    and row_hi [1, Tq*G] int32.

    fused_dq_vmem_limit: where a KV head's whole dq fits in VMEM, the dkv kernel accumulates
    it there too (dS^T's transpose times K: one matmul per step, where a separate dq kernel
    recomputes S and dP, three); None runs the separate dq kernel. With parts = 2 dq is never
    fused: each part would hold a partial dq of the whole head. vmem_limit: the separate dq
    kernel's and the unfused dkv's (tuning.backward_vmem_limit; None: Mosaic's default).

    q may hold more heads than k and v (ops' dq split): consecutive heads of q then share a KV
    head, and dk and dv come per head of q, in f32 (partial sums, for ops to add up)."""
    if parts > 1 and fused_dq_vmem_limit is not None:
        raise ValueError("a KV head split in parts cannot accumulate its dq in one VMEM buffer")
    hkv, rows, d = q.shape
    dv_dim = v.shape[2]
    share = hkv // k.shape[0]
    grad_dtype = (k.dtype, v.dtype) if share == 1 else (jnp.float32, jnp.float32)
    lse2 = lse * LOG2E  # the kernels' softmax is in base 2
    rows_per_block = blocks.block_q * opts.groups
    bk = blocks.block_k
    slices = _slices(schedule, rows, rows_per_block)
    maps = _Maps(parts_for(parts, rows // rows_per_block))

    # dq: per query block, its run of key blocks.
    steps = schedule.q_steps
    fuse_dq = fused_dq_vmem_limit is not None
    dq = None if fuse_dq else pl.pallas_call(
        functools.partial(_dq_kernel, opts=opts, block_k=bk, parts=maps.parts, slices=slices),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7,
            grid=(hkv * maps.parts, steps.count),
            in_specs=[
                pl.BlockSpec((None, rows_per_block, d), maps.own),
                pl.BlockSpec((None, bk, d), _shared_head(maps.other, share)),
                pl.BlockSpec((None, bk, dv_dim), _shared_head(maps.other, share)),
                pl.BlockSpec((None, rows_per_block, dv_dim), maps.own),  # dO
                pl.BlockSpec((None, 1, rows_per_block), maps.own_lanes),  # lse
                pl.BlockSpec((None, 1, rows_per_block), maps.own_lanes),  # D
                pl.BlockSpec((1, rows_per_block), maps.own_row_lanes),  # row_lo
                pl.BlockSpec((1, rows_per_block), maps.own_row_lanes),  # row_hi
            ],
            out_specs=pl.BlockSpec((None, rows_per_block, d), maps.own),
            scratch_shapes=[pltpu.VMEM((rows_per_block, d), jnp.float32),
                            *_column_scratch(rows_per_block, jnp.float32, jnp.float32, jnp.int32, jnp.int32)],
        ),
        compiler_params=_compiler_params("dq" in blocks.lp_kernels, vmem_limit_bytes=vmem_limit),
        interpret=interpret,
        name="flash_attention_dq",
    )(*_prefetch(steps, schedule.kv_start, schedule.kv_count, schedule), q, k, v, do, lse2, di, row_lo, row_hi)

    # dk, dv: per key block, the run of query blocks that see it.
    steps = schedule.k_steps
    maps = _Maps(parts_for(parts, k.shape[1] // bk))
    dk, dv, *fused_dq = pl.pallas_call(
        functools.partial(_dkv_kernel, opts=opts, block_k=bk, parts=maps.parts, slices=slices, fuse_dq=fuse_dq),
        out_shape=(jax.ShapeDtypeStruct((hkv, *k.shape[1:]), grad_dtype[0]),
                   jax.ShapeDtypeStruct((hkv, *v.shape[1:]), grad_dtype[1]),
                   *([jax.ShapeDtypeStruct(q.shape, q.dtype)] if fuse_dq else [])),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7,
            grid=(hkv * maps.parts, steps.count),
            in_specs=[
                pl.BlockSpec((None, bk, d), _shared_head(maps.own, share)),
                pl.BlockSpec((None, bk, dv_dim), _shared_head(maps.own, share)),
                pl.BlockSpec((None, rows_per_block, d), maps.other),
                pl.BlockSpec((None, rows_per_block, dv_dim), maps.other),  # dO
                pl.BlockSpec((None, 1, rows_per_block), maps.other_lanes),  # lse
                pl.BlockSpec((None, 1, rows_per_block), maps.other_lanes),  # D
                pl.BlockSpec((1, rows_per_block), maps.other_row_lanes),  # row_lo
                pl.BlockSpec((1, rows_per_block), maps.other_row_lanes),  # row_hi
            ],
            out_specs=[pl.BlockSpec((None, bk, d), maps.own), pl.BlockSpec((None, bk, dv_dim), maps.own),
                       # written once per head: one buffer (a second would only double its VMEM)
                       *([pl.BlockSpec((None, rows, d), maps.whole_head, pipeline_mode=pl.Buffered(1))]
                         if fuse_dq else [])],
            scratch_shapes=[pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, dv_dim), jnp.float32),
                            *([pltpu.VMEM((rows, d), jnp.float32)] if fuse_dq else [])],
        ),
        compiler_params=_compiler_params("dkv" in blocks.lp_kernels, vmem_limit_bytes=fused_dq_vmem_limit or vmem_limit),
        interpret=interpret,
        name="flash_attention_dkv",
    )(*_prefetch(steps, schedule.q_start, schedule.q_count, schedule), k, v, q, do, lse2, di, row_lo, row_hi)
    return (fused_dq[0] if fuse_dq else dq), dk, dv
