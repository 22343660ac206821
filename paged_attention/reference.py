"""Ragged paged attention in plain numpy (f64, returned as f32), sequence by sequence: what the kernels must match."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def ragged_paged_attention(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           softmax_scale=None, sliding_window=None, softcap=None, sinks=None,
                           k_scale=None, v_scale=None):
    """Same contract as ops.ragged_paged_attention, but returns f32; the index arrays are host values.

    Token t of sequence s (cu_q_lens[s] <= t < cu_q_lens[s + 1]) is at position
    kv_lens[s] - q_len + (t - cu_q_lens[s]) of its sequence and sees the
    positions up to its own (and, with a window W, no earlier than W - 1
    before it). Key position j of sequence s is row j % page_size of page
    page_indices[s, j // page_size].
    """
    kv_lens, page_indices, cu_q = (np.asarray(a) for a in (kv_lens, page_indices, cu_q_lens))
    num_seqs = int(np.asarray(num_seqs).reshape(-1)[0])
    t_total, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    # numpy in f64 (rounded to f32 at the end): no XLA program per sequence length to compile.
    f64 = lambda x, s=None: np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64) * (1.0 if s is None else np.asarray(s, np.float64))
    queries, k_all, v_all = f64(q), f64(k_cache, k_scale), f64(v_cache, v_scale)
    sink = None if sinks is None else f64(sinks)[:, None, None]
    out = np.zeros((t_total, hq, v_cache.shape[3]), np.float64)
    for s in range(num_seqs):
        first, end = int(cu_q[s]), int(cu_q[s + 1])
        if end == first:
            continue
        length = int(kv_lens[s])
        pages = page_indices[s, : -(-length // page_size)]
        keys = k_all[pages].reshape(-1, hkv, d)[:length]
        values = v_all[pages].reshape(-1, hkv, v_cache.shape[3])[:length]
        keys, values = (np.repeat(x, hq // hkv, axis=1) for x in (keys, values))
        scores = np.einsum("qhd,khd->hqk", queries[first:end], keys) * scale
        if softcap:
            scores = softcap * np.tanh(scores / softcap)
        position = length - (end - first) + np.arange(end - first)[:, None]
        key = np.arange(length)[None, :]
        allowed = key <= position
        if sliding_window:
            allowed &= key > position - sliding_window
        scores = np.where(allowed, scores, -np.inf)
        top = np.max(scores, axis=2, keepdims=True)
        if sink is not None:
            top = np.maximum(top, sink)
        weights = np.exp(scores - top)
        total = np.sum(weights, axis=2, keepdims=True)
        if sink is not None:
            total = total + np.exp(sink - top)
        out[first:end] = np.einsum("hqk,khd->qhd", weights / total, values)
    return jnp.asarray(out.astype(np.float32))


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, quantize, k_scale=None, v_scale=None):
    """(key_cache, value_cache) with token t written at slot slot_mapping[t] (page * page_size +
    row); slots of -1 skipped, key's and value's rows past slot_mapping's never written.
    quantize(x, dtype, scale): x as a cache of that dtype stores it."""
    slots = np.asarray(slot_mapping)
    keep = slots >= 0

    def write(cache, new, scale):
        flat = np.array(cache.astype(jnp.float32)).reshape(-1, *cache.shape[2:])
        flat[slots[keep]] = np.asarray(quantize(new[: len(slots)][keep], cache.dtype, scale).astype(jnp.float32))
        return jnp.asarray(flat.reshape(cache.shape)).astype(cache.dtype)

    return write(key_cache, key, k_scale), write(value_cache, value, v_scale)
