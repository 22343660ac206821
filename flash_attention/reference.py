"""Plain-JAX attention, sequence by sequence, in f32: what the kernels must match."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale=None, causal=False,
                     window_size=(-1, -1), softcap=0.0, sinks=None):
    """Same contract as ops.flash_attention_varlen, but returns f32; cu_seqlens are host values."""
    cu_q, cu_k = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    tq, hq, d = q.shape
    hkv = k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    left, right = window_size
    f32 = lambda x: x.astype(jnp.float32)
    out = jnp.zeros((tq, hq, v.shape[2]), jnp.float32)
    for s in range(len(cu_q) - 1):
        qs = f32(q[cu_q[s]:cu_q[s + 1]])
        ks = jnp.repeat(f32(k[cu_k[s]:cu_k[s + 1]]), hq // hkv, axis=1)
        vs = jnp.repeat(f32(v[cu_k[s]:cu_k[s + 1]]), hq // hkv, axis=1)
        len_q, len_k = qs.shape[0], ks.shape[0]
        if len_q == 0:
            continue
        scores = jnp.einsum("qhd,khd->hqk", qs, ks, precision=jax.lax.Precision.HIGHEST) * scale
        if softcap:
            scores = softcap * jnp.tanh(scores / softcap)
        row = np.arange(len_q)[:, None] + (len_k - len_q)  # bottom-right aligned position
        col = np.arange(len_k)[None, :]
        allowed = np.ones((len_q, len_k), bool)
        if causal:
            allowed &= col <= row
        if left >= 0:
            allowed &= col >= row - left
        if right >= 0:
            allowed &= col <= row + right
        scores = jnp.where(allowed, scores, -jnp.inf)
        if sinks is not None:
            sink = jnp.broadcast_to(f32(sinks)[:, None, None], (hq, len_q, 1))
            scores = jnp.concatenate([scores, sink], axis=2)
        top = jnp.max(scores, axis=2, keepdims=True)
        top = jnp.where(jnp.isfinite(top), top, 0.0)
        weights = jnp.exp(scores - top)
        total = jnp.sum(weights, axis=2, keepdims=True)
        probs = jnp.where(total > 0, weights / jnp.where(total > 0, total, 1.0), 0.0)[..., :len_k]
        o = jnp.einsum("hqk,khd->qhd", probs, vs, precision=jax.lax.Precision.HIGHEST)
        out = out.at[cu_q[s]:cu_q[s + 1]].set(o)
    return out
