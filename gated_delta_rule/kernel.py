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

Everything is computed on fp32 values whatever the input dtype, the state kept in fp32. With fp32
inputs every product is fp32 (HIGHEST: six bf16 MXU passes), the reference's precision. With
bf16 inputs the products take three passes, each fp32 operand split into two bf16 parts
(`_split_dot`, its gradients likewise): about 2^-16 of each term, far below the bf16 output's
own rounding, at half the MXU work that bounds the chunk.
T = (I + N)^-1 = (I - N)(I + N^2)(I + N^4)... (N is nilpotent: N^C = 0): log2(C) squarings on
the MXU rather than C dependent row updates.

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

F32 = jnp.float32
EXACT = jax.lax.Precision.HIGHEST


def _dot(a, b, contract=((1,), (0,)), split: bool = False):
    """a . b in fp32 (2-D; `contract` names the contracted dims: ((1,), (0,)) is a @ b). With
    `split`, three single-pass MXU products (_split_dot) rather than HIGHEST's six."""
    if split:
        return _split_dot(a, b, contract)
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=EXACT, preferred_element_type=F32)


def _split_product(a, b, contract):
    """Each fp32 operand as the sum of two bf16 parts; the parts' lo x lo dropped (about 2^-16 of
    each term)."""
    def parts(x):
        high = x.astype(jnp.bfloat16)
        return high, (x - high.astype(F32)).astype(jnp.bfloat16)

    (a_high, a_low), (b_high, b_low) = parts(a), parts(b)
    dot = lambda x, y: jax.lax.dot_general(x, y, (contract, ((), ())), preferred_element_type=F32)
    return dot(a_high, b_high) + (dot(a_high, b_low) + dot(a_low, b_high))


# The gradients of a split product are split products too (jax's own transpose of a bf16 dot
# would round the fp32 cotangent to bf16): for each contraction, (a's, b's) as
# (ct, other, contraction) with the operands in order.
_SPLIT_GRADIENTS = {
    ((1,), (0,)): (lambda a, b, ct: _split_product(ct, b, ((1,), (1,))),  # a @ b
                   lambda a, b, ct: _split_product(a, ct, ((0,), (0,)))),
    ((1,), (1,)): (lambda a, b, ct: _split_product(ct, b, ((1,), (0,))),  # a @ b.T
                   lambda a, b, ct: _split_product(ct, a, ((0,), (0,)))),
    ((0,), (0,)): (lambda a, b, ct: _split_product(b, ct, ((1,), (1,))),  # a.T @ b
                   lambda a, b, ct: _split_product(a, ct, ((1,), (0,)))),
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _split_dot(a, b, contract):
    return _split_product(a, b, contract)


def _split_dot_forward(a, b, contract):
    return _split_product(a, b, contract), (a, b)


def _split_dot_backward(contract, residuals, ct):
    a, b = residuals
    grad_a, grad_b = _SPLIT_GRADIENTS[contract]
    return grad_a(a, b, ct), grad_b(a, b, ct)


_split_dot.defvjp(_split_dot_forward, _split_dot_backward)


def _column(row, eye):
    """A [1, C] row as a [C, 1] column (the diagonal of eye * row, summed over lanes): no transpose."""
    return jnp.sum(eye * row, axis=1, keepdims=True)


def _chunk_math(q, k, v, g, beta, state, *, scale: float, l2norm: bool, chunk: int, split: bool = False):
    """One head's chunk on fp32 values: q, k [C, dk], v [C, dv], g and beta [1, C] rows, the state
    entering [dk, dv]. Returns the output rows [C, dv] and the state leaving. A pure function of
    its operands: the backward kernel differentiates it (jax.vjp) rather than restating it.
    `split`: its products in three bf16 passes (_dot), but for G's sums."""
    dot = functools.partial(_dot, split=split)
    if l2norm:  # as fla: x / sqrt(sum x^2 + 1e-6), in fp32
        q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=1, keepdims=True) + 1e-6)
        k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=1, keepdims=True) + 1e-6)
    q = q * scale
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    eye = (rows == cols).astype(F32)
    # G as a row: g times the upper-triangular ones (G_j = sum over m <= j of g_m); exact whatever
    # `split` (a chunk's G reaches hundreds: 2^-16 of it would move every decay).
    cum_row = _dot(g, (rows <= cols).astype(F32))
    cum_col = _column(cum_row, eye)
    beta = _column(beta, eye)
    causal = rows >= cols
    # exp of masked differences only: above the diagonal G_i - G_j > 0 can overflow.
    decay = jnp.exp(jnp.where(causal, cum_col - cum_row, -jnp.inf))
    k_beta = k * beta
    n = jnp.where(rows > cols, dot(k_beta, k, ((1,), (1,))) * decay, 0.0)
    inverse = eye - n
    power = n
    for _ in range(max(0, math.ceil(math.log2(chunk)) - 1)):
        power = dot(power, power)
        inverse = dot(inverse, eye + power)
    u = dot(inverse, v * beta)
    w = dot(inverse, k_beta * jnp.exp(cum_col))
    v_new = u - dot(w, state)
    scores = dot(q, k, ((1,), (1,))) * decay
    o = dot(q * jnp.exp(cum_col), state) + dot(scores, v_new)
    total = jnp.sum(g, axis=1, keepdims=True)  # [1, 1]: G at the chunk's last token
    k_decayed = k * jnp.exp(total - cum_col)
    return o, state * jnp.exp(total) + dot(k_decayed, v_new, ((0,), (0,)))


def _operands(q_ref, k_ref, v_ref, gb_ref, h, group: int):
    """Value head h's q, k (its q/k head's: `group` value heads share one), v in fp32 and its g
    and beta rows."""
    gb = gb_ref[h, 0]
    return (q_ref[h // group].astype(F32), k_ref[h // group].astype(F32), v_ref[h].astype(F32), gb[0:1],
            gb[1:2])


def _chunk_kernel(seq_ref, first_ref, last_ref,  # scalar prefetch, per chunk
                  q_ref, k_ref, v_ref, gb_ref, h0_ref,  # inputs
                  o_ref, ht_ref, *refs,  # outputs (and the states entering each chunk, if asked), scratch
                  scale: float, l2norm: bool, chunk: int, group: int):
    *states_ref, state_ref = refs
    c = pl.program_id(1)
    live = seq_ref[c] >= 0

    @pl.when(first_ref[c] == 1)
    def _():
        state_ref[...] = h0_ref[...].astype(F32)

    if states_ref:
        states_ref[0][...] = state_ref[...]

    @pl.when(jnp.logical_not(live))
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    # bf16 inputs: the chunk's products in three bf16 passes (to about 2^-16, far below the bf16
    # output's rounding); fp32 inputs: in fp32, as the reference.
    split = q_ref.dtype == jnp.bfloat16

    @pl.when(live)
    def _():
        # The heads of a block are independent chains of small matmuls: unrolled, their MXU
        # latencies overlap.
        for h in range(v_ref.shape[0]):
            o, state_ref[h] = _chunk_math(*_operands(q_ref, k_ref, v_ref, gb_ref, h, group), state_ref[h],
                                          scale=scale, l2norm=l2norm, chunk=chunk, split=split)
            o_ref[h] = o.astype(o_ref.dtype)

    @pl.when(last_ref[c] == 1)
    def _():
        ht_ref[...] = state_ref[...]


def _chunk_backward_kernel(seq_ref, first_ref, last_ref,  # scalar prefetch, per chunk
                           q_ref, k_ref, v_ref, gb_ref, states_ref, do_ref, dht_ref,  # inputs
                           dq_ref, dk_ref, dv_ref, dgb_ref, dh0_ref,  # outputs
                           dstate_ref,  # scratch: the gradient of the state leaving the chunk
                           *, scale: float, l2norm: bool, chunk: int, group: int):
    """The chunks in reverse: each chunk's gradients from the gradient of its output rows and of
    the state leaving it (the final state's gradient at a sequence's last chunk), recomputing
    the chunk from the state that entered it; the state's gradient carried to the chunk before.
    dq and dk are per value head (the caller sums a q/k head's group)."""
    c = pl.num_programs(1) - 1 - pl.program_id(1)
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
        math_of_chunk = functools.partial(_chunk_math, scale=scale, l2norm=l2norm, chunk=chunk,
                                          split=q_ref.dtype == jnp.bfloat16)
        for h in range(v_ref.shape[0]):
            _, pullback = jax.vjp(math_of_chunk, *_operands(q_ref, k_ref, v_ref, gb_ref, h, group), states_ref[h])
            dq, dk, dv, dg, dbeta, dstate_ref[h] = pullback((do_ref[h].astype(F32), dstate_ref[h]))
            dq_ref[h] = dq.astype(dq_ref.dtype)
            dk_ref[h] = dk.astype(dk_ref.dtype)
            dv_ref[h] = dv.astype(dv_ref.dtype)
            dgb_ref[h, 0, 0:1] = dg
            dgb_ref[h, 0, 1:2] = dbeta

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
    interpret: bool


def _chunk_blocks(config: _ChunkConfig, v, dk: int, reverse: bool):
    """The (head block, chunk) grid and the blocks of a step: q's and k's tokens (the q/k heads of
    the step's value heads, each read once), v's tokens and, per value head, dq's and dk's (the
    backward's), g and beta, a sequence's state (chunks past the live ones stay on the last
    sequence's block: a block an earlier step left is never revisited, where its output buffer
    would be written back again, stale), and a chunk's state. The backward walks the chunks in
    reverse."""
    heads, padded, dv = v.shape
    chunks = padded // config.chunk
    hb, chunk, group = config.heads_per_step, config.chunk, config.group
    assert hb % group == 0 or group % hb == 0, (hb, group)
    shared = max(hb // group, 1)  # q/k heads a step reads
    at = (lambda c: chunks - 1 - c) if reverse else (lambda c: c)
    tokens = lambda h, c, *_: (h, at(c), 0)
    shared_tokens = lambda h, c, *_: (h * hb // group // shared, at(c), 0)
    per_chunk = lambda h, c, *_: (h, at(c), 0, 0)
    per_seq = lambda h, c, seq, *_: (jnp.where(seq[at(c)] >= 0, seq[at(c)], config.num_seqs - 1), h, 0, 0)
    qk = pl.BlockSpec((shared, chunk, dk), shared_tokens)
    return ((heads // hb, chunks), [qk, qk, pl.BlockSpec((hb, chunk, dv), tokens)],
            pl.BlockSpec((hb, chunk, dk), tokens), pl.BlockSpec((hb, 1, 2, chunk), per_chunk),
            pl.BlockSpec((None, hb, dk, dv), per_seq), pl.BlockSpec((hb, None, dk, dv), per_chunk))


def _pallas_call(kernel, config: _ChunkConfig, grid, in_specs, out_specs, out_shape, name: str):
    """A chunk walk: three per-chunk scalars prefetched, the heads' state (or its gradient) in VMEM
    scratch, head blocks parallel and chunks in order."""
    heads_per_step, dk, dv = in_specs[-1].block_shape[1:]
    grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=3, grid=grid, in_specs=in_specs, out_specs=out_specs,
                                             scratch_shapes=[pltpu.VMEM((heads_per_step, dk, dv), F32)])
    kernel = functools.partial(kernel, scale=config.scale, l2norm=config.l2norm, chunk=config.chunk,
                               group=config.group)
    return pl.pallas_call(kernel, grid_spec=grid_spec, out_shape=out_shape, name=name, interpret=config.interpret,
                          compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")))


def _chunk_call(config: _ChunkConfig, seq, first, last, q, k, v, gb, h0, *, with_states: bool):
    grid, qkv, _, gb_block, seq_state, chunk_state = _chunk_blocks(config, v, q.shape[2], reverse=False)
    heads, chunks, dk, dv = v.shape[0], grid[1], q.shape[2], v.shape[2]
    out_specs = [qkv[2], seq_state] + [chunk_state] * with_states
    out_shape = [jax.ShapeDtypeStruct(v.shape, q.dtype), jax.ShapeDtypeStruct((config.num_seqs, heads, dk, dv), F32),
                 jax.ShapeDtypeStruct((heads, chunks, dk, dv), F32)][:len(out_specs)]
    return _pallas_call(_chunk_kernel, config, grid, [*qkv, gb_block, seq_state], out_specs, out_shape,
                        "gated_delta_rule_chunk")(seq, first, last, q, k, v, gb, h0)


def _chunk_backward_call(config: _ChunkConfig, seq, first, last, q, k, v, gb, states, do, dht):
    """Gradients per value head: dq and dk [Hv, P, dk] (a q/k head's group not yet summed)."""
    grid, qkv, per_value_head, gb_block, seq_state, chunk_state = _chunk_blocks(config, v, q.shape[2], reverse=True)
    per_head = jax.ShapeDtypeStruct((v.shape[0], *q.shape[1:]), q.dtype)
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
    dq, dk = (d.astype(F32).reshape(q.shape[0], config.group, *q.shape[1:]).sum(axis=1).astype(q.dtype)
              for d in (dq, dk))
    # A sequence with no chunk is never visited: its block holds nothing (ops.py passes its state
    # through, and the gradient with it).
    visited = jnp.any(seq[None, :] == jnp.arange(config.num_seqs, dtype=seq.dtype)[:, None], axis=1)
    dh0 = jnp.where(visited[:, None, None, None], dh0, 0.0).astype(h0.dtype)
    return None, None, None, dq, dk, dv, dgb, dh0


_chunk_rule.defvjp(_chunk_rule_forward, _chunk_rule_backward)


@functools.partial(jax.jit, static_argnames=("num_seqs", "scale", "l2norm", "chunk", "heads_per_step", "interpret"))
def chunk_forward(seq, first, last, q, k, v, gb, h0, *, num_seqs: int, scale: float, l2norm: bool,
                  chunk: int, heads_per_step: int, interpret: bool):
    """q, k [Hk, P, dk], v [H, P, dv] in chunk layout (P = chunks * chunk tokens; value head h takes
    q/k head h // (H / Hk), as the models' repeat_interleave lays them out), gb [H, chunks,
    2, chunk] fp32 (g, then beta: one block whose two rows fill its tile's lanes), h0 [num_seqs,
    H, dk, dv] fp32; seq, first, last int32 [chunks]. A grid step takes `heads_per_step` heads
    (a divisor of H that H / Hk divides or that divides H / Hk) of one chunk. Returns o [H, P, dv]
    (q's dtype) and the final states
    [num_seqs, H, dk, dv] (fp32); a sequence with no chunk keeps whatever its final state block
    held (ops.py substitutes h0). Differentiable in q, k, v, gb and h0: the backward is a second
    kernel walking the chunks in reverse."""
    config = _ChunkConfig(num_seqs, scale, l2norm, chunk, heads_per_step, v.shape[0] // q.shape[0], interpret)
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


def _decode_kernel(q_ref, k_ref, v_ref, gb_ref, h0_ref, o_ref, ht_ref, *, scale: float, l2norm: bool):
    """A token of each of a block of sequences (`_token_step`), each from its state's block to the
    new state's."""
    for s in range(q_ref.shape[0]):
        _token_step(q_ref[s], k_ref[s], v_ref[s], gb_ref[s], h0_ref.at[s], ht_ref.at[s], o_ref.at[s], scale=scale,
                    l2norm=l2norm)


@functools.partial(jax.jit, static_argnames=("seqs_per_step", "scale", "l2norm", "out_dtype", "interpret"))
def decode_forward(q, k, v, gb, h0, *, seqs_per_step: int, scale: float, l2norm: bool, out_dtype, interpret: bool):
    """A decode step: a token of each of B sequences, q, k [B, Hk, dk], v [B, H, dv], gb [B, H, 2]
    fp32 (g, beta), h0 [B, H, dk, dv] fp32. A grid step takes `seqs_per_step` sequences (a divisor
    of B), whose states' blocks are consecutive: fewer, larger copies of the same bytes. Returns
    o [B, H, dv] (out_dtype) and the new states in h0's buffer (updated in place when h0 is
    donated)."""
    batch = q.shape[0]
    heads, dk, dv = h0.shape[1:]
    block = lambda x: pl.BlockSpec((seqs_per_step, *x.shape[1:]), lambda b: (b,) + (0,) * (x.ndim - 1))
    state_bytes = seqs_per_step * heads * dk * dv * 4
    kernel = functools.partial(_decode_kernel, scale=scale, l2norm=l2norm)
    return pl.pallas_call(
        kernel,
        grid=(batch // seqs_per_step,),
        in_specs=[block(q), block(k), block(v), block(gb), block(h0)],
        out_specs=[block(v), block(h0)],
        out_shape=[jax.ShapeDtypeStruct(v.shape, out_dtype), jax.ShapeDtypeStruct(h0.shape, F32)],
        # The states' blocks, in and out, double-buffered, and room for the rest.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                             vmem_limit_bytes=4 * state_bytes + (16 << 20)),
        input_output_aliases={4: 1},
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
