"""The JAX functions behind the torch ops; JAX users can call them directly.

`flash_attention_varlen` attends over sequences packed back to back
(`cu_seqlens`, the flash-attn convention); `flash_attention` over a dense
batch. Both are differentiable in q, k, v and the sinks (`jax.custom_vjp`):
the backward is one more Pallas kernel for dk and dv (which also
accumulates dq where a KV head's dq fits in VMEM), or two with a separate dq
kernel. A v5p megacore splits every kernel over its two cores: by KV head, or
where the KV heads do not split evenly (MQA, an odd count) each head's grid
steps in two halves (kernel.py).

Semantics (flash-attn 2's): a sequence's queries are its last positions
(causal masks are aligned to the bottom right when it has fewer queries than
keys); `window_size=(left, right)` lets the query at position p see keys
p - left .. p + right (-1: unbounded); `softcap` c maps a scaled score s to
c * tanh(s / c); a sink (one logit per query head) adds exp(sink) to the
softmax's denominator only. A query that sees no key gets zeros.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from ._shared.attention_math import LANES, heads_as_rows, heads_in_lanes, lanes_as_heads, rows_as_heads
from ._shared.generations import GENERATIONS, current_generation, default_interpret
from ._shared.tuning import round_up
from .kernel import BlockSizes, Options, backward, diagonal_slices, forward, parts_for
from .tuning import backward_vmem_limit, check_blocks, choose_blocks, fused_dq_split, window_span
from ._paged import ops as paged_ops

NO_KEY = jnp.iinfo(jnp.int32).max // 2  # row_lo of a query that sees nothing


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Steps:
    """A kernel's grid steps, flattened: every block of one side (query blocks
    for the forward and dq, key blocks for dkv) gets the run of blocks of the
    other side it meets, one step each, and one step even when the run is
    empty (to write its zeros). Only steps that meet are on the grid."""
    block: jax.Array  # [parts * max steps] the block (of this side) each step serves; past a part's end, its last
    first: jax.Array  # [blocks] the first step of each block
    count: jax.Array  # () the grid's steps per part: sum over the part's blocks of max(run length, 1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Schedule:
    """Which blocks meet, per query block and per key block (see kernel.py)."""
    kv_start: jax.Array  # [nQ] first key block a query block sees
    kv_count: jax.Array  # [nQ] how many key blocks it sees (0: none)
    lo_max: jax.Array  # [nQ] the largest row_lo of its rows
    hi_min: jax.Array  # [nQ] the smallest row_hi of its rows
    slice_hi_max: jax.Array  # [slices nQ] the largest row_hi of each slice (by tokens) of a query block
    q_start: jax.Array  # [nK] first query block that sees a key block
    q_count: jax.Array  # [nK] how many query blocks see it
    q_steps: Steps  # the forward's and dq's grid: per query block, its key blocks
    k_steps: Steps  # dkv's grid: per key block, its query blocks


def _steps(run_lengths: jax.Array, max_steps: int, parts: int) -> Steps:
    """parts = 2: the blocks cut in two runs of about as many steps, the second's steps from
    position max_steps on, and `count` the longer run's (see kernel.py's grid)."""
    steps = jnp.maximum(run_lengths, 1)
    end = jnp.cumsum(steps)
    total = end[-1]
    first = end - steps
    count = total
    if parts == 2:
        second = jnp.arange(steps.shape[0]) >= jnp.maximum(jnp.sum(end <= total // 2), 1)  # the second part's blocks
        split_at = jnp.max(jnp.where(second, 0, end))  # where the second part starts
        first = jnp.where(second, first - split_at + max_steps, first)
        count = jnp.maximum(split_at, total - split_at)
    step = jnp.arange(parts * max_steps, dtype=jnp.int32)
    block = jnp.searchsorted(first, step, side="right").astype(jnp.int32) - 1
    return Steps(block, first.astype(jnp.int32), count.astype(jnp.int32))


def token_ranges(cu_seqlens_q, cu_seqlens_k, num_q: int, num_k: int, causal: bool, left: int, right: int):
    """[num_q] int32 (lo, hi): the packed key positions each query token sees.

    A token past cu_seqlens_q[-1] (padding) sees nothing: lo > hi. Ranges
    are clipped to the num_k keys, so no cu_seqlens value, however wrong,
    makes a kernel read past the keys (`cu_seqlens_valid` reports it).
    """
    num_seqs = cu_seqlens_q.shape[0] - 1
    t = jnp.arange(num_q, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_seqlens_q, t, side="right").astype(jnp.int32) - 1, 0, num_seqs - 1)
    q_first, q_end = cu_seqlens_q[seq], cu_seqlens_q[seq + 1]
    k_first, k_end = cu_seqlens_k[seq], cu_seqlens_k[seq + 1]
    # The key position on the query's diagonal, bottom-right aligned.
    diagonal = k_first + (t - q_first) + ((k_end - k_first) - (q_end - q_first))
    lo, hi = k_first, k_end - 1
    if left >= 0:
        lo = jnp.maximum(lo, diagonal - left)
    if causal:
        hi = jnp.minimum(hi, diagonal)
    if right >= 0:
        hi = jnp.minimum(hi, diagonal + right)
    valid = t < cu_seqlens_q[-1]
    return jnp.where(valid, jnp.maximum(lo, 0), NO_KEY), jnp.where(valid, jnp.minimum(hi, num_k - 1), -1)


def cu_seqlens_valid(cu_seqlens: jax.Array, num_tokens: int | jax.Array) -> jax.Array:
    """() bool, on the device: starts at 0, never decreases, ends within the tokens."""
    return (cu_seqlens[0] == 0) & jnp.all(cu_seqlens[1:] >= cu_seqlens[:-1]) & (cu_seqlens[-1] <= num_tokens)


def make_schedule(lo, hi, block_q: int, block_k: int, num_k: int, parts: int = 1, *, slices: int) -> Schedule:
    """The block runs of `kernel.py` from the tokens' key ranges (on device); slices:
    `kernel.diagonal_slices` of the blocks."""
    lo_blocks, hi_blocks = lo.reshape(-1, block_q), hi.reshape(-1, block_q)
    sees = lo_blocks <= hi_blocks
    first = jnp.min(jnp.where(sees, lo_blocks, NO_KEY), axis=1)
    last = jnp.max(jnp.where(sees, hi_blocks, -1), axis=1)
    any_row = jnp.any(sees, axis=1)
    kv_start = jnp.where(any_row, first // block_k, 0).astype(jnp.int32)
    kv_count = jnp.where(any_row, last // block_k - first // block_k + 1, 0).astype(jnp.int32)
    # Key block j is seen by query block i iff it lies in i's run; the runs only move forward.
    j = jnp.arange(num_k // block_k, dtype=jnp.int32)[:, None]
    meets = (kv_start[None, :] <= j) & (j < kv_start[None, :] + kv_count[None, :])
    i = jnp.arange(lo_blocks.shape[0], dtype=jnp.int32)[None, :]
    q_first = jnp.min(jnp.where(meets, i, NO_KEY), axis=1)
    q_last = jnp.max(jnp.where(meets, i, -1), axis=1)
    seen = jnp.any(meets, axis=1)
    q_start = jnp.where(seen, q_first, 0).astype(jnp.int32)
    q_count = jnp.where(seen, q_last - q_first + 1, 0).astype(jnp.int32)
    max_steps = kv_count.shape[0] * q_count.shape[0]  # every pair meets, at most
    return Schedule(kv_start, kv_count, jnp.max(lo_blocks, axis=1).astype(jnp.int32),
                    jnp.min(hi_blocks, axis=1).astype(jnp.int32),
                    jnp.max(hi.reshape(-1, block_q // slices), axis=1).astype(jnp.int32), q_start, q_count,
                    _steps(kv_count, max_steps, parts_for(parts, kv_count.shape[0])),
                    _steps(q_count, max_steps, parts_for(parts, q_count.shape[0])))


# From this head dim (and value head dim) up an inference forward (see _forward) takes a KV
# head's query heads side by side in the lanes (attention_math.heads_in_lanes; the kernel makes
# them rows), below it as rows (heads_as_rows): whichever of XLA's copies cost less. MODELED at
# 8k, forward, softcap 50, lanes against rows: head_dim 256 with G = 2 (Gemma-2-9B) 1561 against
# 1659 us on v6e, 2925 against 3036 on tpu7x; G = 4, 3239 against 3500 and 5685 against 5901;
# head_dim 128 with G = 2, 4 (Llama-3-8B), 8 (Qwen3-32B, no softcap): rows faster by 2% to 10%.
IN_LANES_MIN_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class _Static:
    opts: Options
    blocks: BlockSizes
    causal: bool
    left: int
    right: int
    parts: int  # each KV head's grid steps split over a megacore's two cores (2) or not (1); see kernel.py
    fused_dq_vmem_limit: int | None  # see kernel.backward
    backward_vmem_limit: int | None  # see kernel.backward
    dq_split: int  # the backward runs each KV head's query heads in this many groups (tuning.fused_dq_split)
    interpret: object


def _heads_major(x, num: int):
    """[T, Hkv, D] -> [Hkv, num, D], padded."""
    x = jnp.pad(x, ((0, num - x.shape[0]), (0, 0), (0, 0))) if num != x.shape[0] else x
    return x.transpose(1, 0, 2)


def _prepare(q, k, cu_seqlens_q, cu_seqlens_k, st: _Static, groups: int):
    bq, bk = st.blocks.block_q, st.blocks.block_k
    num_q, num_k = round_up(q.shape[0], bq), round_up(k.shape[0], bk)
    lo, hi = token_ranges(cu_seqlens_q, cu_seqlens_k, num_q, k.shape[0], st.causal, st.left, st.right)
    schedule = make_schedule(lo, hi, bq, bk, num_k, st.parts, slices=diagonal_slices(bq * groups, bq, bk))
    row_lo = jnp.repeat(lo, groups)[None, :]
    row_hi = jnp.repeat(hi, groups)[None, :]
    return num_q, num_k, schedule, row_lo, row_hi


def _forward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, st: _Static, backward_follows: bool):
    """(out [Tq, Hq, Dv], lse [Hkv, 1, Tq_padded * G] f32). backward_follows: in the same XLA
    program (jax's vjp); it reads q and the output as rows (heads_as_rows), and XLA shares those
    copies with a forward that took them so (MODELED: Gemma-2-9B's training step at 8k on v6e,
    4070 us with q as rows in the forward, 4420 with q in lanes)."""
    groups = st.opts.groups
    num_q, num_k, schedule, row_lo, row_hi = _prepare(q, k, cu_seqlens_q, cu_seqlens_k, st, groups)
    hkv = k.shape[1]
    sink = sinks.astype(jnp.float32) if sinks is not None else jnp.zeros((hkv * groups,), jnp.float32)
    sink_rows = jnp.tile(sink.reshape(hkv, 1, groups), (1, st.blocks.block_q, 1)).reshape(hkv, -1, 1)
    in_lanes = not backward_follows and groups > 1 and all(d % LANES == 0 and d >= IN_LANES_MIN_HEAD_DIM
                                                   for d in (q.shape[2], v.shape[2]))
    to_kernel, from_kernel = (heads_in_lanes, lanes_as_heads) if in_lanes else (heads_as_rows, rows_as_heads)
    o, lse = forward(to_kernel(q, groups, num_q), _heads_major(k, num_k), _heads_major(v, num_k), row_lo,
                     row_hi, sink_rows, schedule, opts=st.opts, blocks=st.blocks, parts=st.parts,
                     interpret=st.interpret)
    return from_kernel(o, groups, q.shape[0]), lse


def _backward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, out, lse, grad_out, st: _Static):
    """(dq, dk, dv, dsinks or None) from the forward's output and log-sum-exp. Each KV head's
    query heads run as st.dq_split groups: to the kernels, Hkv * split KV heads of G / split."""
    split = st.dq_split
    groups, hkv = st.opts.groups // split, k.shape[1] * split
    num_q, num_k, schedule, row_lo, row_hi = _prepare(q, k, cu_seqlens_q, cu_seqlens_k, st, groups)
    if split > 1:  # rows t * G + g of a KV head -> rows t * G / split + g' of its groups
        lse = lse.reshape(k.shape[1], num_q, split, groups).transpose(0, 2, 1, 3).reshape(hkv, 1, -1)
    do_rows = heads_as_rows(grad_out.astype(q.dtype), groups, num_q)
    # D = rowsum(dO * O): the softmax backward's correction, in f32.
    out_rows = heads_as_rows(out, groups, num_q)
    di = jnp.sum(do_rows.astype(jnp.float32) * out_rows.astype(jnp.float32), axis=2)[:, None, :]
    dq, dk, dv = backward(heads_as_rows(q, groups, num_q), _heads_major(k, num_k), _heads_major(v, num_k), do_rows,
                          lse, di, row_lo, row_hi, schedule, opts=dataclasses.replace(st.opts, groups=groups),
                          blocks=st.blocks, parts=st.parts, fused_dq_vmem_limit=st.fused_dq_vmem_limit,
                          vmem_limit=st.backward_vmem_limit, interpret=st.interpret)
    if split > 1:  # each group's partial (f32), summed
        dk, dv = (g.reshape(k.shape[1], split, num_k, -1).sum(1).astype(x.dtype) for g, x in ((dk, k), (dv, v)))
    dk = dk.transpose(1, 0, 2)[: k.shape[0]]
    dv = dv.transpose(1, 0, 2)[: v.shape[0]]
    dsinks = None
    if sinks is not None:
        # d sink_h = -sum over the head's rows of exp(sink_h - lse) * D (rows seeing nothing have p = 0).
        p_sink = jnp.exp(sinks.astype(jnp.float32).reshape(hkv, 1, groups) - lse.reshape(hkv, -1, groups))
        dsinks = -jnp.sum(p_sink * di.reshape(hkv, -1, groups), axis=1).reshape(-1).astype(sinks.dtype)
    return rows_as_heads(dq, groups, q.shape[0]), dk, dv, dsinks


def _nan_unless(valid: jax.Array, *arrays):
    """The arrays (None passed through), NaN throughout where the offsets are not valid."""
    return tuple(None if a is None else jnp.where(valid, a, jnp.nan) for a in arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, valid, st: _Static):
    return _nan_unless(valid, _forward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, st, backward_follows=False)[0])[0]


def _attention_fwd(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, valid, st: _Static):
    out, lse = _forward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, st, backward_follows=True)
    return _nan_unless(valid, out)[0], (q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, valid, out, lse)


def _attention_bwd(st: _Static, residuals, grad_out):
    *inputs, valid, out, lse = residuals
    # NaN gradients too: jnp.where's own gradient would give invalid offsets zeros, a silent no-op step.
    return (*_nan_unless(valid, *_backward(*inputs, out, lse, grad_out, st)), None, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _static(q, k, v, softmax_scale, causal, window_size, softcap, sinks, blocks, generation, interpret) -> _Static:
    """The static description of a call (what a compile depends on)."""
    tq, hq, d = q.shape
    hkv = k.shape[1]
    generation = generation or current_generation().name
    interpret = default_interpret() if interpret is None else interpret
    groups = hq // hkv
    left, right = window_size
    cores = GENERATIONS[generation].cores_per_device
    parts = cores if hkv % cores else 1  # KV heads that split evenly over the cores need no more
    if blocks is None:
        blocks = choose_blocks(tq, k.shape[0], d, v.shape[2], groups, jnp.dtype(q.dtype).itemsize, generation,
                               window=window_span(causal, left, right), parts=parts)
    elif interpret is False:  # interpret mode runs any block sizes (the tests' small ones)
        check_blocks(blocks, groups)
    scale = float(softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d))
    rows = round_up(tq, blocks.block_q) * groups
    split, fused = (1, None) if parts > 1 else fused_dq_split(rows, d, v.shape[2], jnp.dtype(q.dtype).itemsize,
                                                              blocks, groups, generation)
    return _Static(Options(scale=scale, softcap=float(softcap), has_sinks=sinks is not None, groups=groups),
                   blocks, bool(causal), int(left), int(right), parts, fused,
                   backward_vmem_limit(d, v.shape[2], jnp.dtype(q.dtype).itemsize, blocks, groups // split, generation),
                   split, interpret)


def _offsets_valid(q, k, cu_seqlens_q, cu_seqlens_k, num_tokens):
    """Invalid cu_seqlens cannot make a kernel read out of bounds (see token_ranges); they make the
    results NaN, a report that needs no device-to-host round trip. They are judged against the
    tokens given: num_tokens [2] (q's, k's) where the arrays end in a bucketing caller's padding rows
    (a value, not a shape: no recompile per count), else the arrays' rows."""
    tokens_q, tokens_k = q.shape[0], k.shape[0]
    if num_tokens is not None:
        num_tokens = num_tokens.astype(jnp.int32)
        tokens_q, tokens_k = jnp.minimum(num_tokens[0], tokens_q), jnp.minimum(num_tokens[1], tokens_k)
    return cu_seqlens_valid(cu_seqlens_q, tokens_q) & cu_seqlens_valid(cu_seqlens_k, tokens_k)


def flash_attention_varlen(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: jax.Array | None = None,
    num_tokens: jax.Array | None = None,
    blocks: BlockSizes | None = None,
    generation: str | None = None,
    interpret=None,
) -> jax.Array:
    """Attention over packed sequences.

    q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv] with Hq a multiple of
    Hkv; cu_seqlens_q, cu_seqlens_k [S + 1] int32, starting at 0,
    non-decreasing, ending at most at the token count (invalid ones make
    the output and every gradient NaN); tokens past cu_seqlens_q[-1] get
    zeros, keys past cu_seqlens_k[-1] are never seen. sinks [Hq] or None
    (any float dtype; f32 keeps them exact). num_tokens [2] int32 or None:
    for a caller that pads q and k with rows to bucketed shapes, the tokens
    of q and of k before the padding, the counts cu_seqlens must stay
    within. Returns [Tq, Hq, Dv] in q's dtype. Differentiable in q, k, v
    and sinks.
    """
    if q.shape[0] == 0:
        return jnp.zeros((0, q.shape[1], v.shape[2]), q.dtype)
    st = _static(q, k, v, softmax_scale, causal, window_size, softcap, sinks, blocks, generation, interpret)
    cu_q, cu_k = cu_seqlens_q.astype(jnp.int32), cu_seqlens_k.astype(jnp.int32)
    return _attention(q, k, v, sinks, cu_q, cu_k, _offsets_valid(q, k, cu_q, cu_k, num_tokens), st)


def flash_attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale=None, causal=False,
                                   window_size=(-1, -1), softcap=0.0, sinks=None, num_tokens=None, blocks=None,
                                   generation=None, interpret=None):
    """flash_attention_varlen's output and what its backward needs, the
    softmax's log-sum-exp per row (f32): (out, lse). For callers that keep
    residuals themselves (the torch op)."""
    st = _static(q, k, v, softmax_scale, causal, window_size, softcap, sinks, blocks, generation, interpret)
    cu_q, cu_k = cu_seqlens_q.astype(jnp.int32), cu_seqlens_k.astype(jnp.int32)
    out, lse = _forward(q, k, v, sinks, cu_q, cu_k, st, backward_follows=False)  # the torch op runs its backward apart
    return _nan_unless(_offsets_valid(q, k, cu_q, cu_k, num_tokens), out)[0], lse


def flash_attention_varlen_backward(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, grad_out, *, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0, sinks=None, num_tokens=None,
                                    blocks=None, generation=None, interpret=None):
    """(dq, dk, dv, dsinks or None) from flash_attention_varlen_forward's (out, lse), without running the forward."""
    st = _static(q, k, v, softmax_scale, causal, window_size, softcap, sinks, blocks, generation, interpret)
    cu_q, cu_k = cu_seqlens_q.astype(jnp.int32), cu_seqlens_k.astype(jnp.int32)
    grads = _backward(q, k, v, sinks, cu_q, cu_k, out, lse, grad_out, st)
    return _nan_unless(_offsets_valid(q, k, cu_q, cu_k, num_tokens), *grads)


def flash_attention(q, k, v, **options) -> jax.Array:
    """Attention over a dense batch: q [B, Sq, Hq, D], k [B, Sk, Hkv, D],
    v [B, Sk, Hkv, Dv] -> [B, Sq, Hq, Dv]; options as `flash_attention_varlen`."""
    b, sq = q.shape[:2]
    sk = k.shape[1]
    cu_q = jnp.arange(b + 1, dtype=jnp.int32) * sq
    cu_k = jnp.arange(b + 1, dtype=jnp.int32) * sk
    flat = lambda x: x.reshape(-1, *x.shape[2:])
    out = flash_attention_varlen(flat(q), flat(k), flat(v), cu_q, cu_k, **options)
    return out.reshape(b, sq, *out.shape[1:])


# ---------------------------------------------------------------------------------------------
# flash_attn_with_kvcache: attention over a KV cache through paged-attention-tpu's kernel
# (vendored as `._paged`), flash-attn 2's semantics.


def kvcache_sequences(kv_lens, seq_q: int, causal: bool, window_right: int):
    """How flash-attn's batch rows become the paged kernel's sequences, on the device.

    kv_lens [B] int32: each row's keys (its cache's tokens and the new ones). A row's seq_q
    queries sit at positions kv_len - seq_q .. kv_len - 1. Causal (and any single query, which
    sees the same keys either way): one kernel sequence per row, whose new tokens are the row's
    last min(seq_q, kv_len) queries (the others see no key: zeros, as in flash-attn). Otherwise
    one kernel sequence per query, its keys the prefix the query sees (all kv_len keys, or up to
    position + window_right). Returns (per kernel sequence: row, kv_len, q_len; per query in
    row-major order: its kernel sequence and whether it sees any key)."""
    batch = kv_lens.shape[0]
    i = jnp.tile(jnp.arange(seq_q, dtype=jnp.int32), batch)
    row = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), seq_q)
    if causal or seq_q == 1:
        q_lens = jnp.clip(kv_lens, 0, seq_q)
        live = i >= seq_q - q_lens[row]
        return jnp.arange(batch, dtype=jnp.int32), kv_lens, q_lens, row, live
    position = i + kv_lens[row] - seq_q
    lens = kv_lens[row] if window_right < 0 else jnp.clip(position + window_right + 1, 0, kv_lens[row])
    live = lens > 0
    return row, jnp.where(live, lens, 0), live.astype(jnp.int32), jnp.arange(batch * seq_q, dtype=jnp.int32), live


def kvcache_lse(q, k_pages, kv_lens, page_table, *, seq_q: int, causal: bool, window_size, softmax_scale: float,
                softcap: float, sinks):
    """[B, Hq, seq_q] f32: each query's log-sum-exp of its scaled (and capped) scores, a sink
    included: plain XLA over the row's pages (the paged kernel keeps its softmax statistics in
    VMEM). A query that sees no key and has no sink gets +inf, as flash-attn's."""
    pages, page_size, hkv, d = k_pages.shape
    batch, width = page_table.shape
    hq = q.shape[1]
    keys = k_pages[jnp.clip(page_table, 0, pages - 1)].reshape(batch, width * page_size, hkv, d)
    qs = q.reshape(batch, seq_q, hkv, hq // hkv, d).astype(jnp.float32)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qs, keys.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    s = s.reshape(batch, hq, seq_q, width * page_size) * softmax_scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    position = (jnp.arange(seq_q)[None, :] + kv_lens[:, None] - seq_q)[:, None, :, None]  # [B, 1, Sq, 1]
    key = jnp.arange(width * page_size)[None, None, None, :]
    left, right = window_size
    seen = key < kv_lens[:, None, None, None]
    if causal:
        seen &= key <= position
    elif right >= 0:
        seen &= key <= position + right
    if left >= 0:
        seen &= key >= position - left
    s = jnp.where(seen, s, -jnp.inf)
    if sinks is not None:
        s = jnp.concatenate([s, jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None],
                                                 (batch, hq, seq_q, 1))], axis=-1)
    lse = jax.nn.logsumexp(s, axis=-1)
    return jnp.where(jnp.isneginf(lse), jnp.inf, lse)


def flash_attention_with_kvcache(q, k_pages, v_pages, kv_lens, page_table, *, seq_q: int, softmax_scale=None,
                                 causal: bool = False, window_size=(-1, -1), softcap: float = 0.0, sinks=None,
                                 return_lse: bool = False, generation: str | None = None, interpret=None):
    """flash-attn's attention over a KV cache (its cache already holding the new tokens), run by
    paged-attention-tpu's kernel over the pages where they lie.

    q [B * seq_q, Hq, D]: each row's queries back to back, its last positions; k_pages, v_pages
    [pages, page_size, Hkv, D]; kv_lens [B] int32: each row's keys; page_table [B, width] int32:
    the pages of each row (entries past a row's keys are never read, whatever they hold).
    window_size (left, right) as flash-attn's (-1: unbounded); causal ignores right; a
    non-causal call with more than one query per row takes an unbounded left. Returns
    (out [B * seq_q, Hq, D] in q's dtype, lse [B, Hq, seq_q] f32 or None). Index values are
    checked on the device by the paged kernel's ops: inconsistent ones make the output NaN."""
    left, right = window_size
    if not causal and seq_q > 1 and left >= 0:
        raise NotImplementedError(
            f"window_size={tuple(window_size)} without causal and with {seq_q} queries per row: a bounded left "
            "window then differs per query, which the paged kernel's one window cannot express; use causal=True, "
            "one query per row, or left=-1")
    hq, d = q.shape[1:]
    scale = float(softmax_scale if softmax_scale is not None else d ** -0.5)
    seq_rows, seq_kv, seq_q_lens, token_seq, live = kvcache_sequences(kv_lens, seq_q, causal, right)
    # The queries that see a key first, in order (each kernel sequence's new tokens back to back),
    # the others after every live sequence's tokens, where the kernel writes zeros.
    live_i = live.astype(jnp.int32)
    dest = jnp.where(live, jnp.cumsum(live_i) - live_i, jnp.sum(live_i) + jnp.cumsum(1 - live_i) - (1 - live_i))
    packed = jnp.zeros_like(q).at[dest].set(q, unique_indices=True)
    cu_q_lens = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(seq_q_lens).astype(jnp.int32)])
    sliding = left + 1 if left >= 0 and (causal or seq_q == 1) else None
    out = paged_ops.ragged_paged_attention(
        packed, k_pages, v_pages, seq_kv.astype(jnp.int32), page_table[seq_rows], cu_q_lens, seq_rows.shape[0],
        softmax_scale=scale, sliding_window=sliding, softcap=softcap or None, sinks=sinks, generation=generation,
        interpret=interpret)[dest]
    lse = None
    if return_lse:
        lse = kvcache_lse(q, k_pages, kv_lens, page_table, seq_q=seq_q, causal=causal or seq_q == 1,
                          window_size=window_size, softmax_scale=scale, softcap=softcap, sinks=sinks)
    return out, lse
