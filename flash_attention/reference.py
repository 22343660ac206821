"""Plain-JAX attention over packed sequences in f32: what the kernels must match."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def _positions(cu: np.ndarray, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, position in it) of each of `tokens` packed tokens; sequence -1 past cu[-1]."""
    index = np.arange(tokens)
    seq = np.searchsorted(cu, index, side="right") - 1
    seq = np.where(index < cu[-1], seq, -1)
    return seq, index - cu[np.maximum(seq, 0)]


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale=None, causal=False,
                     window_size=(-1, -1), softcap=0.0, sinks=None):
    """Same contract as ops.flash_attention_varlen, but returns f32; cu_seqlens are host values.
    Every sequence at once, one dense [heads, queries, keys] pass with the other sequences' keys
    masked (a handful of XLA programs however many sequences)."""
    cu_q, cu_k = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    tq, hq, d = q.shape
    hkv = k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    left, right = window_size
    f32 = lambda x: x.astype(jnp.float32)
    ks = jnp.repeat(f32(k), hq // hkv, axis=1)
    vs = jnp.repeat(f32(v), hq // hkv, axis=1)
    scores = jnp.einsum("qhd,khd->hqk", f32(q), ks, precision=jax.lax.Precision.HIGHEST) * scale
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    seq_q, pos_q = _positions(cu_q, tq)
    seq_k, col = _positions(cu_k, k.shape[0])
    lens_q, lens_k = np.diff(cu_q), np.diff(cu_k)
    row = (pos_q + (lens_k - lens_q)[np.maximum(seq_q, 0)])[:, None]  # bottom-right aligned position
    col = col[None, :]
    allowed = (seq_q[:, None] == seq_k[None, :]) & (seq_q[:, None] >= 0)
    if causal:
        allowed &= col <= row
    if left >= 0:
        allowed &= col >= row - left
    if right >= 0:
        allowed &= col <= row + right
    scores = jnp.where(allowed, scores, -jnp.inf)
    if sinks is not None:
        sink = jnp.broadcast_to(f32(sinks)[:, None, None], (hq, tq, 1))
        scores = jnp.concatenate([scores, sink], axis=2)
    top = jnp.max(scores, axis=2, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.exp(scores - top)
    total = jnp.sum(weights, axis=2, keepdims=True)
    probs = jnp.where(total > 0, weights / jnp.where(total > 0, total, 1.0), 0.0)[..., :k.shape[0]]
    out = jnp.einsum("hqk,khd->qhd", probs, vs, precision=jax.lax.Precision.HIGHEST)
    return jnp.where(seq_q[:, None, None] >= 0, out, 0.0)
