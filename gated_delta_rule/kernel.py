"""The chunked gated delta rule forward as one Pallas TPU kernel.

The recurrence, per head, over a sequence's tokens t (state S [dk, dv], fp32):

    S <- exp(g_t) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t

Chunked (the WY / UT form of DeltaNet, as fla and transformers' torch reference compute it):
within a chunk of C tokens, with G the cumulative sum of g over the chunk, N the strictly lower
part of (beta k) k^T weighted by exp(G_i - G_j), and T = (I + N)^-1,

    u = T (beta v),  w = T (beta k exp(G)),  v' = u - w S,
    o = (q exp(G)) S + ((q k^T) * exp(G_i - G_j), i >= j) v',
    S <- exp(G_C) S + (k exp(G_C - G))^T v'.

The grid walks (head, chunk), chunks in order ("arbitrary"): the state lives in VMEM scratch
from a sequence's first chunk to its last. The chunks of a call are those of packed sequences
laid end to end, each sequence starting a chunk (ops.py lays them out); per chunk, scalar
prefetch says which sequence it belongs to and whether it is that sequence's first or last, or
past the live ones (skipped). Tokens past a sequence's end within its last chunk are zeros:
k = 0 and beta = 0 add nothing to the state and g = 0 decays nothing.

Everything is computed on fp32 values whatever the input dtype, the state kept in fp32, every
product summed in fp32. With fp32 inputs the products' operands are fp32 too (HIGHEST: six bf16
MXU passes), the reference's precision. With bf16 inputs they are rounded to bf16, one pass per
product, as fla's kernels compute them on GPUs: about 2^-8 of each term, the precision of the
inputs themselves. G, g's cumulative sum over each chunk, comes from the caller in fp32 (ops.py:
a chunk's G reaches hundreds, where bf16 would move every decay).
T = (I + N)^-1 = (I - N)(I + N^2)(I + N^4)... (N is nilpotent: N^C = 0): log2(C) squarings on
the MXU rather than C dependent row updates. A grid step takes a block of heads as one batch of
each product, so their independent chains interleave.

The backward walks the same grid with the chunks in reverse, the state's gradient in VMEM
scratch: each chunk is recomputed from the state that entered it (the forward kernel writes
those on request) and differentiated by jax.vjp of the one chunk function the forward runs.
The decode step (`recurrent_forward`) is a kernel of its own, a token per grid step.
"""

from __future__ import annotations

import functools
import math
import typing

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._shared.rings import consecutive_blocks

F32 = jnp.float32
EXACT = jax.lax.Precision.HIGHEST
# The chunk kernels' VMEM limit: the backward's vjp of a block of heads keeps its intermediates in
# VMEM, at 32 heads a step (ops.HEADS_PER_STEP) most of this, far above the default scoped limits;
# every generation has at least 64 MiB.
CHUNK_VMEM_LIMIT = 56 << 20


def _dot(a, b, contract=((2,), (1,)), low: bool = False):
    """a . b per head, accumulated in fp32 (3-D, the heads leading; `contract` names the contracted
    dims: ((2,), (1,)) is a @ b). `low`: the operands rounded to bf16, one MXU pass (as fla's
    kernels on bf16 inputs); else fp32 operands (HIGHEST: six passes), the reference's precision."""
    if low:
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    return jax.lax.dot_general(a, b, (contract, ((0,), (0,))), precision=None if low else EXACT,
                               preferred_element_type=F32)


def _column(row, eye):
    """[H, 1, C] rows as [H, C, 1] columns (the diagonal of eye * row, summed over lanes): no
    transpose."""
    return jnp.sum(eye * row, axis=2, keepdims=True)


def _chunk_math(q, k, v, cum_row, beta, state, *, scale: float, l2norm: bool, chunk: int, low: bool = False):
    """A block of heads' chunk on fp32 values: q, k [H, C, dk], v [H, C, dv], G (g's cumulative sum
    over the chunk) and beta [H, 1, C] rows, the states entering [H, dk, dv]. Returns the output
    rows [H, C, dv] and the states leaving. The heads are one batch of each product: their
    independent chains of small matmuls interleave, overlapping each other's MXU latency. A
    pure function of its operands: the backward kernel differentiates it (jax.vjp) rather than
    restating it. `low`: its products on bf16 operands (_dot). Products that share an operand
    are one matmul (rows stacked, or columns side by side): fewer operand pushes and pops."""
    dot = functools.partial(_dot, low=low)
    if l2norm:  # as fla: x / sqrt(sum x^2 + 1e-6), in fp32
        q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=2, keepdims=True) + 1e-6)
        k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=2, keepdims=True) + 1e-6)
    q = q * scale
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    eye = (rows == cols).astype(F32)
    cum_col = _column(cum_row, eye)
    beta = _column(beta, eye)
    # exp of masked differences only: above the diagonal G_i - G_j > 0 can overflow.
    decay = jnp.exp(jnp.where(rows >= cols, cum_col - cum_row, -jnp.inf))
    k_beta = k * beta
    kk_qk = dot(jnp.concatenate([k_beta, q], axis=1), k, ((2,), (2,)))  # (beta k) k^T over q k^T
    n = jnp.where(rows > cols, kk_qk[:, :chunk] * decay, 0.0)
    inverse = eye - n  # T, as the product of squarings the module's docstring gives
    power = n
    for _ in range(max(0, math.ceil(math.log2(chunk)) - 1)):
        power = dot(power, power)
        inverse = dot(inverse, eye + power)
    dv = v.shape[2]
    u_w = dot(inverse, jnp.concatenate([v * beta, k_beta * jnp.exp(cum_col)], axis=2))  # u beside w
    ws_qs = dot(jnp.concatenate([u_w[:, :, dv:], q * jnp.exp(cum_col)], axis=1), state)  # w S over (q exp(G)) S
    v_new = u_w[:, :, :dv] - ws_qs[:, :chunk]
    o = ws_qs[:, chunk:] + dot(kk_qk[:, chunk:] * decay, v_new)
    total = cum_row[:, :, chunk - 1:]  # [H, 1, 1]: G at the chunk's last token
    k_decayed = k * jnp.exp(total - cum_col)
    return o, state * jnp.exp(total) + dot(k_decayed, v_new, ((1,), (1,)))


def _heads(ref, live_rows):
    """A [C, heads, dim] block of tokens as [heads, C, dim] fp32, rows past the array's end zero."""
    x = jnp.swapaxes(ref[...].astype(F32), 0, 1)
    return x if live_rows is None else jnp.where(live_rows, x, 0.0)


def _put_heads(ref, x):
    """[heads, C, dim] into a [C, heads, dim] block of tokens."""
    ref[...] = jnp.swapaxes(x, 0, 1).astype(ref.dtype)


def _live_rows(config, c):
    """[C, 1]: which rows of chunk c's block lie within the arrays (the last block of a call whose
    token count is not a multiple of the chunk overhangs them; what it reads there is undefined),
    or None where every block is whole."""
    if config.tokens % config.chunk == 0:
        return None
    row = c * config.chunk + jax.lax.broadcasted_iota(jnp.int32, (config.chunk, 1), 0)
    return row < config.tokens


def _operands(config, head_block, c, q_ref, k_ref, v_ref, gb_ref):
    """A block of value heads' q and k (their q/k heads': `group` value heads share one), v in
    fp32 and their G and beta rows. q's and k's blocks hold every q/k head: the step's are chosen
    among the head blocks' by the step's head block (the grid's first index)."""
    live = _live_rows(config, c)
    hb, group = config.heads_per_step, config.group
    shared = max(hb // group, 1)  # q/k heads of the step's value heads
    blocks = config.num_heads // hb

    def step_heads(x):  # [Hk, C, dk] -> the step's value heads' [hb, C, dk]
        if blocks > 1:
            x = sum(jnp.where(head_block == b, x[b * hb // group:b * hb // group + shared], 0.0) for b in range(blocks))
        return jnp.broadcast_to(x, (hb, *x.shape[1:])) if shared == 1 else jnp.repeat(x, group, axis=0)

    gb = gb_ref[:, 0]
    return (step_heads(_heads(q_ref, live)), step_heads(_heads(k_ref, live)), _heads(v_ref, live), gb[:, 0:1],
            gb[:, 1:2])


def _chunk_kernel(seq_ref, first_ref, last_ref,  # scalar prefetch, per chunk
                  q_ref, k_ref, v_ref, gb_ref, h0_ref,  # inputs
                  o_ref, ht_ref, *refs,  # outputs (and the states entering each chunk, if asked), scratch
                  config):
    *states_ref, state_ref = refs
    head_block, c = pl.program_id(0), pl.program_id(1)
    live = seq_ref[c] >= 0

    @pl.when(first_ref[c] == 1)
    def _():
        state_ref[...] = h0_ref[...].astype(F32)

    if states_ref:
        states_ref[0][...] = state_ref[...]

    @pl.when(jnp.logical_not(live))
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    # bf16 inputs: the chunk's products on bf16 operands, as fla's kernels; fp32 inputs: in fp32,
    # as the reference.
    low = q_ref.dtype == jnp.bfloat16

    @pl.when(live)
    def _():
        o, state_ref[...] = _chunk_math(*_operands(config, head_block, c, q_ref, k_ref, v_ref, gb_ref), state_ref[...],
                                        scale=config.scale, l2norm=config.l2norm, chunk=config.chunk, low=low)
        _put_heads(o_ref, o)

    @pl.when(last_ref[c] == 1)
    def _():
        ht_ref[...] = state_ref[...]


def _chunk_backward_kernel(seq_ref, first_ref, last_ref,  # scalar prefetch, per chunk
                           q_ref, k_ref, v_ref, gb_ref, states_ref, do_ref, dht_ref,  # inputs
                           dq_ref, dk_ref, dv_ref, dgb_ref, dh0_ref,  # outputs
                           dstate_ref,  # scratch: the gradient of the state leaving the chunk
                           config):
    """The chunks in reverse: each chunk's gradients from the gradient of its output rows and of
    the state leaving it (the final state's gradient at a sequence's last chunk), recomputing
    the chunk from the state that entered it; the state's gradient carried to the chunk before.
    dq and dk are per value head (the caller sums a q/k head's group)."""
    head_block, c = pl.program_id(0), pl.num_programs(1) - 1 - pl.program_id(1)
    live = seq_ref[c] >= 0

    @pl.when(last_ref[c] == 1)
    def _():
        dstate_ref[...] = dht_ref[...]

    @pl.when(jnp.logical_not(live))
    def _():
        for ref in (dq_ref, dk_ref, dv_ref, dgb_ref):
            ref[...] = jnp.zeros(ref.shape, ref.dtype)

    @pl.when(live)
    def _():
        math_of_chunk = functools.partial(_chunk_math, scale=config.scale, l2norm=config.l2norm, chunk=config.chunk,
                                          low=q_ref.dtype == jnp.bfloat16)
        operands = _operands(config, head_block, c, q_ref, k_ref, v_ref, gb_ref)
        _, pullback = jax.vjp(math_of_chunk, *operands, states_ref[...])
        do = _heads(do_ref, _live_rows(config, c))
        dq, dk, dv, dg, dbeta, dstate_ref[...] = pullback((do, dstate_ref[...]))
        for ref, d in ((dq_ref, dq), (dk_ref, dk), (dv_ref, dv)):
            _put_heads(ref, d)
        dgb_ref[:, 0, 0:1] = dg
        dgb_ref[:, 0, 1:2] = dbeta

    @pl.when(first_ref[c] == 1)
    def _():
        dh0_ref[...] = dstate_ref[...]


class _ChunkConfig(typing.NamedTuple):
    num_seqs: int
    scale: float
    l2norm: bool
    chunk: int
    heads_per_step: int
    group: int  # value heads per q/k head
    num_heads: int  # value heads
    tokens: int  # rows of q, k and v
    dk: int
    dv: int
    interpret: bool


def _chunk_blocks(config: _ChunkConfig, chunks: int, reverse: bool):
    """The (head block, chunk) grid and the blocks of a step: q's and k's tokens (every q/k head:
    a block of heads must fill whole sublane tiles), v's tokens (and o's, do's) and, per value
    head, dq's and dk's (the backward's), G and beta, a sequence's state (chunks past the live
    ones stay on the last sequence's block: a block an earlier step left is never revisited,
    where its output buffer would be written back again, stale), and a chunk's state. The
    backward walks the chunks in reverse."""
    hb, chunk, group, dk, dv = config.heads_per_step, config.chunk, config.group, config.dk, config.dv
    assert hb % group == 0 or group % hb == 0, (hb, group)
    at = (lambda c: chunks - 1 - c) if reverse else (lambda c: c)
    tokens = lambda h, c, *_: (at(c), h, 0)
    every_head = lambda h, c, *_: (at(c), 0, 0)
    per_chunk = lambda h, c, *_: (h, at(c), 0, 0)
    per_seq = lambda h, c, seq, *_: (jnp.where(seq[at(c)] >= 0, seq[at(c)], config.num_seqs - 1), h, 0, 0)
    qk = pl.BlockSpec((chunk, config.num_heads // group, dk), every_head)
    return ((config.num_heads // hb, chunks), [qk, qk, pl.BlockSpec((chunk, hb, dv), tokens)],
            pl.BlockSpec((chunk, hb, dk), tokens), pl.BlockSpec((hb, 1, 2, chunk), per_chunk),
            pl.BlockSpec((None, hb, dk, dv), per_seq), pl.BlockSpec((hb, None, dk, dv), per_chunk))


def _pallas_call(kernel, config: _ChunkConfig, grid, in_specs, out_specs, out_shape, name: str):
    """A chunk walk: three per-chunk scalars prefetched, the heads' state (or its gradient) in VMEM
    scratch, head blocks parallel and chunks in order."""
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=grid, in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((config.heads_per_step, config.dk, config.dv), F32)])
    return pl.pallas_call(functools.partial(kernel, config=config), grid_spec=grid_spec, out_shape=out_shape,
                          name=name, interpret=config.interpret,
                          compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                                               vmem_limit_bytes=CHUNK_VMEM_LIMIT))


def _chunk_call(config: _ChunkConfig, seq, first, last, q, k, v, gb, h0, *, with_states: bool):
    chunks = seq.shape[0]
    grid, qkv, _, gb_block, seq_state, chunk_state = _chunk_blocks(config, chunks, reverse=False)
    heads, dk, dv = h0.shape[1:]
    out_specs = [qkv[2], seq_state] + [chunk_state] * with_states
    out_shape = [jax.ShapeDtypeStruct(v.shape, q.dtype), jax.ShapeDtypeStruct((config.num_seqs, heads, dk, dv), F32),
                 jax.ShapeDtypeStruct((heads, chunks, dk, dv), F32)][:len(out_specs)]
    return _pallas_call(_chunk_kernel, config, grid, [*qkv, gb_block, seq_state], out_specs, out_shape,
                        "gated_delta_rule_chunk")(seq, first, last, q, k, v, gb, h0)


def _chunk_backward_call(config: _ChunkConfig, seq, first, last, q, k, v, gb, states, do, dht):
    """Gradients per value head: dq and dk [P, Hv, dk] (a q/k head's group not yet summed)."""
    grid, qkv, per_value_head, gb_block, seq_state, chunk_state = _chunk_blocks(config, seq.shape[0], reverse=True)
    per_head = jax.ShapeDtypeStruct((config.tokens, config.num_heads, config.dk), q.dtype)
    out_shape = [per_head, per_head, *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (v, gb, dht))]
    return _pallas_call(_chunk_backward_kernel, config, grid, [*qkv, gb_block, chunk_state, qkv[2], seq_state],
                        [per_value_head, per_value_head, qkv[2], gb_block, seq_state], out_shape,
                        "gated_delta_rule_chunk_backward")(seq, first, last, q, k, v, gb, states, do, dht)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunk_rule(config, seq, first, last, q, k, v, gb, h0):
    return tuple(_chunk_call(config, seq, first, last, q, k, v, gb, h0, with_states=False))


def _chunk_rule_forward(config, seq, first, last, q, k, v, gb, h0):
    # Only the inputs are kept: the backward recomputes the states entering each chunk (one
    # state per chunk and head would be kept otherwise).
    return _chunk_rule(config, seq, first, last, q, k, v, gb, h0), (seq, first, last, q, k, v, gb, h0)


def _chunk_rule_backward(config, residuals, cotangents):
    seq, first, last, q, k, v, gb, h0 = residuals
    do, dht = cotangents
    _, _, states = _chunk_call(config, seq, first, last, q, k, v, gb, h0, with_states=True)
    dq, dk, dv, dgb, dh0 = _chunk_backward_call(config, seq, first, last, q, k, v, gb, states, do, dht)
    # A q/k head's gradient: the sum over the value heads sharing it (in fp32).
    dq, dk = (d.astype(F32).reshape(config.tokens, -1, config.group, config.dk).sum(axis=2).reshape(q.shape)
              .astype(q.dtype) for d in (dq, dk))
    # A sequence with no chunk is never visited: its block holds nothing (ops.py passes its state
    # through, and the gradient with it).
    visited = jnp.any(seq[None, :] == jnp.arange(config.num_seqs, dtype=seq.dtype)[:, None], axis=1)
    dh0 = jnp.where(visited[:, None, None, None], dh0, 0.0).astype(h0.dtype)
    return None, None, None, dq, dk, dv, dgb, dh0


_chunk_rule.defvjp(_chunk_rule_forward, _chunk_rule_backward)


@functools.partial(jax.jit, static_argnames=("num_seqs", "scale", "l2norm", "chunk", "heads_per_step", "interpret"))
def chunk_forward(seq, first, last, q, k, v, gb, h0, *, num_seqs: int, scale: float, l2norm: bool,
                  chunk: int, heads_per_step: int, interpret: bool):
    """q, k [P, Hk, dk], v [P, H, dv] (the models' [B, T, heads, dim], B and T merged: as libtpu
    lays them out), a chunk every `chunk` tokens (the last one may overhang P); value
    head h takes q/k head h // (H / Hk), as the models' repeat_interleave lays them out. gb [H,
    chunks, 2, chunk] fp32 (G, g's cumulative sum within each chunk, then beta, 0 past P: one block
    whose two rows fill its tile's lanes), h0 [num_seqs, H, dk, dv] fp32; seq, first, last
    int32 [chunks]. A grid step takes `heads_per_step` heads (a divisor of H that H / Hk divides or
    that divides H / Hk, a multiple of 16 or all of them: whole sublane tiles) of one chunk.
    Returns o [P, H, dv] (q's dtype) and the final states [num_seqs, H, dk, dv] (fp32); a
    sequence with no chunk keeps whatever its final state block held (ops.py substitutes h0).
    Differentiable in q, k, v, gb and h0: the backward is a second kernel walking the chunks in
    reverse."""
    heads, dk, dv = h0.shape[1:]
    config = _ChunkConfig(num_seqs, scale, l2norm, chunk, heads_per_step, heads // q.shape[1], heads,
                          q.shape[0], dk, dv, interpret)
    return _chunk_rule(config, seq, first, last, q, k, v, gb, h0)


def _token_step(q, k, v, gb, state_in, state_out, o_ref, *, scale: float, l2norm: bool):
    """One token of every head: the recurrence's step, S <- exp(g) S + beta k (v - S^T k)^T,
    o = S^T q (q scaled), from the states in `state_in` to `state_out` (refs [H, dk, dv]; the same
    one where the state stays in VMEM). q, k [Hk, dk] (value head h takes q/k head h // group),
    v [H, dv], gb [H, 2] (g, beta); o_ref [H, dv]."""
    q, k, v = q.astype(F32), k.astype(F32), v.astype(F32)
    group = v.shape[0] // q.shape[0]
    if l2norm:  # as fla: x / sqrt(sum x^2 + 1e-6), in fp32
        q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=1, keepdims=True) + 1e-6)
        k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=1, keepdims=True) + 1e-6)
    q = q * scale
    decay = jnp.exp(gb[:, 0:1])
    # One token's products are matrix-vector: on the VPU, with q and k as columns (one transpose
    # for every head), rather than single-row passes through the MXU.
    q_cols, k_cols = q.T, k.T  # [dk, Hk]
    for h in range(v.shape[0]):
        state = state_in[h] * decay[h:h + 1]
        shared = h // group
        k_col = k_cols[:, shared:shared + 1]
        delta = (v[h:h + 1] - jnp.sum(state * k_col, axis=0, keepdims=True)) * gb[h:h + 1, 1:2]
        state = state + k_col * delta
        state_out[h] = state
        o_ref[h:h + 1] = jnp.sum(state * q_cols[:, shared:shared + 1], axis=0, keepdims=True).astype(o_ref.dtype)


def _token_kernel(seq_ref, first_ref, last_ref, flags_ref,  # scalar prefetch: per token; the call's flags
                  q_ref, k_ref, v_ref, gb_ref, h0_ref,  # inputs
                  o_ref, ht_ref,  # outputs
                  state_ref,  # scratch
                  *, scale: float, l2norm: bool):
    """A token of every head (`_token_step`), the state in VMEM scratch from a sequence's first
    token to its last."""
    t = pl.program_id(0)
    valid, last_seq_empty = flags_ref[0] == 1, flags_ref[1] == 1

    @pl.when(first_ref[t] == 1)
    def _():
        state_ref[...] = h0_ref[...].astype(F32)

    _token_step(q_ref[...], k_ref[...], v_ref[...], gb_ref[...], state_ref, state_ref, o_ref, scale=scale,
                l2norm=l2norm)

    @pl.when(last_ref[t] == 1)
    def _():
        ht_ref[...] = jnp.where(valid, state_ref[...], jnp.nan)

    # Tokens past the live ones stay on the last sequence's block; if that sequence has no token,
    # its block (h0's, aliased) is written back as it came.
    @pl.when((seq_ref[t] < 0) & last_seq_empty)
    def _():
        ht_ref[...] = h0_ref[...]


def _decode_kernel(q_ref, k_ref, v_ref, gb_ref, h0_ref, o_ref, ht_ref, *rings, scale: float, l2norm: bool, ring: int):
    """A token of each of a block of sequences (`_token_step`), each from its state's block to the
    new state's. With a `ring` of slots (`rings`: the slots and their semaphores), h0_ref is the
    states in HBM and the kernel copies each step's block itself (`consecutive_blocks`)."""
    if ring:
        h0_ref = consecutive_blocks(h0_ref, *rings)
    for s in range(q_ref.shape[0]):
        _token_step(q_ref[s], k_ref[s], v_ref[s], gb_ref[s], h0_ref.at[s], ht_ref.at[s], o_ref.at[s], scale=scale,
                    l2norm=l2norm)


@functools.partial(jax.jit, static_argnames=("seqs_per_step", "scale", "l2norm", "out_dtype", "in_place", "ring",
                                             "interpret"))
def decode_forward(q, k, v, gb, h0, *, seqs_per_step: int, scale: float, l2norm: bool, out_dtype, in_place: bool,
                   ring: int = 0, interpret: bool = False):
    """A decode step: a token of each of B sequences, q, k [B, Hk, dk], v [B, H, dv], gb [B, H, 2]
    fp32 (g, beta), h0 [B, H, dk, dv] fp32. A grid step takes `seqs_per_step` sequences (a divisor
    of B), whose states' blocks are consecutive: fewer, larger copies of the same bytes. The states
    arrive through Pallas's pipeline (one copy in flight), or with `ring` > 2 through a ring of that
    many slots the kernel fills itself (ring - 1 copies in flight: a copy's latency overlaps the
    copies before it; the steps run in order on one core). Returns o [B, H, dv] (out_dtype) and the
    new states: with `in_place`, in h0's buffer (updated in place when h0 is donated; else XLA
    copies h0 there first; a step writes its sequences' states after every read of them), otherwise
    in a new buffer (every state is written, so nothing needs h0's values there)."""
    batch = q.shape[0]
    heads, dk, dv = h0.shape[1:]
    block = lambda x: pl.BlockSpec((seqs_per_step, *x.shape[1:]), lambda b: (b,) + (0,) * (x.ndim - 1))
    state_bytes = seqs_per_step * heads * dk * dv * 4
    ring = ring if ring > 2 else 0
    kernel = functools.partial(_decode_kernel, scale=scale, l2norm=l2norm, ring=ring)
    return pl.pallas_call(
        kernel,
        grid=(batch // seqs_per_step,),
        in_specs=[block(q), block(k), block(v), block(gb),
                  pl.BlockSpec(memory_space=pl.ANY) if ring else block(h0)],
        out_specs=[block(v), block(h0)],
        out_shape=[jax.ShapeDtypeStruct(v.shape, out_dtype), jax.ShapeDtypeStruct(h0.shape, F32)],
        scratch_shapes=[pltpu.VMEM((ring, seqs_per_step, heads, dk, dv), F32), pltpu.SemaphoreType.DMA((ring,))]
        if ring else [],
        # The states' blocks, in (double-buffered, or the ring) and out (double-buffered), and room for the rest.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary" if ring else "parallel",),
                                             vmem_limit_bytes=(max(ring, 2) + 2) * state_bytes + (16 << 20)),
        input_output_aliases={4: 1} if in_place else {},
        interpret=interpret,
        name="gated_delta_rule_decode",
    )(q, k, v, gb, h0)


@functools.partial(jax.jit, static_argnames=("num_seqs", "scale", "l2norm", "out_dtype", "interpret"))
def recurrent_forward(seq, first, last, flags, q, k, v, gb, h0, *, num_seqs: int, scale: float, l2norm: bool,
                      out_dtype, interpret: bool):
    """Token by token: q, k [T, Hk, dk] (value head h takes q/k head h // (H / Hk)), v [T, H, dv],
    gb [T, H, 2] fp32 (g, beta), h0 [num_seqs, H,
    dk, dv] fp32; seq, first, last int32 [T] (each token's sequence, -1 past the live ones, and
    whether it is the sequence's first or last); flags int32 [2] (the offsets valid; the last
    sequence empty). The grid walks the tokens in order, every head in one step: for a decode step
    (a token per sequence) the work is the state's read and write, which one step per token reads
    once. Returns o [T, H, dv] (out_dtype) and the final states (fp32) in h0's buffer: a sequence
    with no token keeps its h0 (with h0 donated, the states are updated in place; else XLA copies
    h0 first); with flags[0] 0 every state a token reaches is NaN."""
    tokens, shared_heads, dk = q.shape
    heads, dv = v.shape[1:]
    per_token = lambda t, *_: (t, 0, 0)
    seq_block = lambda t, seq, *_: (jnp.where(seq[t] >= 0, seq[t], num_seqs - 1), 0, 0, 0)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(tokens,),
        in_specs=[
            pl.BlockSpec((None, shared_heads, dk), per_token),
            pl.BlockSpec((None, shared_heads, dk), per_token),
            pl.BlockSpec((None, heads, dv), per_token),
            pl.BlockSpec((None, heads, 2), per_token),
            pl.BlockSpec((None, heads, dk, dv), seq_block),
        ],
        out_specs=[
            pl.BlockSpec((None, heads, dv), per_token),
            pl.BlockSpec((None, heads, dk, dv), seq_block),
        ],
        scratch_shapes=[pltpu.VMEM((heads, dk, dv), F32)],
    )
    kernel = functools.partial(_token_kernel, scale=scale, l2norm=l2norm)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((tokens, heads, dv), out_dtype),
                   jax.ShapeDtypeStruct((num_seqs, heads, dk, dv), F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        input_output_aliases={8: 1},
        interpret=interpret,
        name="gated_delta_rule_recurrent",
    )(seq, first, last, flags, q, k, v, gb, h0)
