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

Everything is computed in fp32 whatever the input dtype (the reference's precision).
T = (I + N)^-1 = (I - N)(I + N^2)(I + N^4)... (N is nilpotent: N^C = 0): log2(C) squarings on
the MXU rather than C dependent row updates.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

F32 = jnp.float32
EXACT = jax.lax.Precision.HIGHEST


def _dot(a, b, contract=((1,), (0,))):
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=EXACT, preferred_element_type=F32)


def _column(row, eye):
    """A [1, C] row as a [C, 1] column (the diagonal of eye * row, summed over lanes): no transpose."""
    return jnp.sum(eye * row, axis=1, keepdims=True)


def _chunk(q_ref, k_ref, v_ref, gb_ref, o_ref, state_ref, h, *, scale, l2norm, chunk):
    """One head's chunk: its output rows, and its state carried to the next chunk."""
    q = q_ref[h].astype(F32)
    k = k_ref[h].astype(F32)
    v = v_ref[h].astype(F32)
    if l2norm:  # as fla: x / sqrt(sum x^2 + 1e-6), in fp32
        q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=1, keepdims=True) + 1e-6)
        k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=1, keepdims=True) + 1e-6)
    q = q * scale
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    eye = (rows == cols).astype(F32)
    # G as a row: g times the upper-triangular ones (G_j = sum over m <= j of g_m).
    gb = gb_ref[h, 0]
    cum_row = _dot(gb[0:1], (rows <= cols).astype(F32))
    cum_col = _column(cum_row, eye)
    beta = _column(gb[1:2], eye)
    causal = rows >= cols
    # exp of masked differences only: above the diagonal G_i - G_j > 0 can overflow.
    decay = jnp.exp(jnp.where(causal, cum_col - cum_row, -jnp.inf))
    k_beta = k * beta
    n = jnp.where(rows > cols, _dot(k_beta, k, ((1,), (1,))) * decay, 0.0)
    inverse = eye - n
    power = n
    for _ in range(max(0, math.ceil(math.log2(chunk)) - 1)):
        power = _dot(power, power)
        inverse = _dot(inverse, eye + power)
    u = _dot(inverse, v * beta)
    w = _dot(inverse, k_beta * jnp.exp(cum_col))
    state = state_ref[h]
    v_new = u - _dot(w, state)
    scores = _dot(q, k, ((1,), (1,))) * decay
    o = _dot(q * jnp.exp(cum_col), state) + _dot(scores, v_new)
    o_ref[h] = o.astype(o_ref.dtype)
    total = cum_row[:, chunk - 1:chunk]  # [1, 1]: G at the chunk's last token
    k_decayed = k * jnp.exp(total - cum_col)
    state_ref[h] = state * jnp.exp(total) + _dot(k_decayed, v_new, ((0,), (0,)))


def _chunk_kernel(seq_ref, first_ref, last_ref,  # scalar prefetch, per chunk
                  q_ref, k_ref, v_ref, gb_ref, h0_ref,  # inputs
                  o_ref, ht_ref,  # outputs
                  state_ref,  # scratch
                  *, scale: float, l2norm: bool, chunk: int):
    c = pl.program_id(1)
    live = seq_ref[c] >= 0

    @pl.when(first_ref[c] == 1)
    def _():
        state_ref[...] = h0_ref[...].astype(F32)

    @pl.when(jnp.logical_not(live))
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(live)
    def _():
        # The heads of a block are independent chains of small matmuls: unrolled, their MXU
        # latencies overlap.
        for h in range(q_ref.shape[0]):
            _chunk(q_ref, k_ref, v_ref, gb_ref, o_ref, state_ref, h, scale=scale, l2norm=l2norm, chunk=chunk)

    @pl.when(last_ref[c] == 1)
    def _():
        ht_ref[...] = state_ref[...]


@functools.partial(jax.jit, static_argnames=("num_seqs", "scale", "l2norm", "chunk", "heads_per_step", "out_dtype",
                                             "interpret"))
def chunk_forward(seq, first, last, q, k, v, gb, h0, *, num_seqs: int, scale: float, l2norm: bool,
                  chunk: int, heads_per_step: int, out_dtype, interpret: bool):
    """q, k [H, P, dk], v [H, P, dv] in chunk layout (P = chunks * chunk tokens), gb [H, chunks,
    2, chunk] fp32 (g, then beta: one block whose two rows fill its tile's lanes), h0 [num_seqs,
    H, dk, dv] fp32; seq, first, last int32 [chunks]. A grid step takes `heads_per_step` heads
    (a divisor of H) of one chunk. Returns o [H, P, dv] (out_dtype) and the final states
    [num_seqs, H, dk, dv] (fp32); a sequence with no chunk keeps whatever its final state block
    held (ops.py substitutes h0)."""
    heads, padded, dk = q.shape
    dv = v.shape[-1]
    chunks = padded // chunk
    hb = heads_per_step
    # Chunks past the live ones stay on the last sequence's state block: a block an earlier step
    # left is never revisited (its output buffer would be written back again, stale).
    seq_block = lambda h, c, seq, first, last: (jnp.where(seq[c] >= 0, seq[c], num_seqs - 1), h, 0, 0)
    tokens = lambda h, c, *_: (h, c, 0)
    per_chunk = lambda h, c, *_: (h, c, 0, 0)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(heads // hb, chunks),
        in_specs=[
            pl.BlockSpec((hb, chunk, dk), tokens),
            pl.BlockSpec((hb, chunk, dk), tokens),
            pl.BlockSpec((hb, chunk, dv), tokens),
            pl.BlockSpec((hb, 1, 2, chunk), per_chunk),
            pl.BlockSpec((None, hb, dk, dv), seq_block),
        ],
        out_specs=[
            pl.BlockSpec((hb, chunk, dv), tokens),
            pl.BlockSpec((None, hb, dk, dv), seq_block),
        ],
        scratch_shapes=[pltpu.VMEM((hb, dk, dv), F32)],
    )
    kernel = functools.partial(_chunk_kernel, scale=scale, l2norm=l2norm, chunk=chunk)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((heads, padded, dv), out_dtype),
                   jax.ShapeDtypeStruct((num_seqs, heads, dk, dv), F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="gated_delta_rule_chunk",
    )(seq, first, last, q, k, v, gb, h0)


def _token_kernel(seq_ref, first_ref, last_ref,  # scalar prefetch, per token
                  q_ref, k_ref, v_ref, gb_ref, h0_ref,  # inputs
                  o_ref, ht_ref,  # outputs
                  state_ref,  # scratch
                  *, scale: float, l2norm: bool):
    """One token of every head: the recurrence's step, S <- exp(g) S + beta k (v - S^T k)^T,
    o = S^T q (q scaled), the state in VMEM scratch from a sequence's first token to its last."""
    t = pl.program_id(0)

    @pl.when(first_ref[t] == 1)
    def _():
        state_ref[...] = h0_ref[...].astype(F32)

    q = q_ref[...].astype(F32)  # [H, dk]
    k = k_ref[...].astype(F32)
    v = v_ref[...].astype(F32)  # [H, dv]
    if l2norm:  # as fla: x / sqrt(sum x^2 + 1e-6), in fp32
        q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=1, keepdims=True) + 1e-6)
        k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=1, keepdims=True) + 1e-6)
    q = q * scale
    gb = gb_ref[...]  # [H, 2]: g, beta
    decay = jnp.exp(gb[:, 0:1])
    # One token's products are matrix-vector: on the VPU, with q and k as columns (one transpose
    # for every head), rather than single-row passes through the MXU.
    q_cols, k_cols = q.T, k.T  # [dk, H]
    for h in range(q.shape[0]):
        state = state_ref[h] * decay[h:h + 1]
        k_col = k_cols[:, h:h + 1]
        delta = (v[h:h + 1] - jnp.sum(state * k_col, axis=0, keepdims=True)) * gb[h:h + 1, 1:2]
        state = state + k_col * delta
        state_ref[h] = state
        o_ref[h:h + 1] = jnp.sum(state * q_cols[:, h:h + 1], axis=0, keepdims=True).astype(o_ref.dtype)

    @pl.when(last_ref[t] == 1)
    def _():
        ht_ref[...] = state_ref[...]


@functools.partial(jax.jit, static_argnames=("num_seqs", "scale", "l2norm", "out_dtype", "interpret"))
def recurrent_forward(seq, first, last, q, k, v, gb, h0, *, num_seqs: int, scale: float, l2norm: bool, out_dtype,
                      interpret: bool):
    """Token by token: q, k [T, H, dk], v [T, H, dv], gb [T, H, 2] fp32 (g, beta), h0 [num_seqs, H,
    dk, dv] fp32; seq, first, last int32 [T] (each token's sequence, and whether it is the
    sequence's first or last). The grid walks the tokens in order, every head in one step: for a
    decode step (a token per sequence) the work is the state's read and write, which one step
    per token reads once. Returns o [T, H, dv] (out_dtype) and the final states (fp32; a sequence
    with no token keeps whatever its block held: ops.py substitutes h0)."""
    tokens, heads, dk = q.shape
    dv = v.shape[-1]
    per_token = lambda t, *_: (t, 0, 0)
    seq_block = lambda t, seq, first, last: (seq[t], 0, 0, 0)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(tokens,),
        in_specs=[
            pl.BlockSpec((None, heads, dk), per_token),
            pl.BlockSpec((None, heads, dk), per_token),
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
        interpret=interpret,
        name="gated_delta_rule_recurrent",
    )(seq, first, last, q, k, v, gb, h0)
