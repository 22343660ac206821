"""What the attention kernels share: the query layout (heads as rows), scores in base 2, row
statistics held over lanes."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# A finite "minus infinity": exp(MASKED - m) is 0 and MASKED - MASKED is not NaN.
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2E = math.log2(math.e)
LANES = 128  # a vreg's lanes: row statistics are kept replicated across them


def dot(a, b, contract_a: int, contract_b: int):
    """a . b contracted on one dim each, accumulated in f32 (all f32 passes for f32 inputs)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                               preferred_element_type=jnp.float32, precision=precision)


def scores(q, k, scale: float, softcap: float, q_scaled: bool = False):
    """The scaled (and soft-capped) scores times log2(e) [rows, keys] in f32, and tanh of the
    cap's argument (None without a cap). The kernels' softmax runs in base 2: exp2 is what the
    EUP computes, so folding log2(e) into the scale saves a multiply per score. q_scaled: q is
    already `scaled_query(q, scale)` (no cap), which saves the multiply per score."""
    raw = dot(q, k, 1, 1)
    if softcap:
        assert not q_scaled, "a capped score needs the unscaled product"
        t = jnp.tanh(raw * (scale / softcap))
        return (softcap * LOG2E) * t, t
    return (raw if q_scaled else raw * (scale * LOG2E)), None


def scaled_query(q, scale: float):
    """q times scale * log2(e), rounded once to q's dtype: the scores' multiply moved from
    [rows, keys] per key block to [rows, D] once per query block (in bf16 this rounds q once
    more, as splash attention's and tokamax's scaled queries do)."""
    return (q.astype(jnp.float32) * (scale * LOG2E)).astype(q.dtype)


def start_rows(m_ref, l_ref, acc_ref, sink_ref, has_sinks: bool):
    """The online softmax's state before a row's first key: max m, sum l and accumulator. A sink
    (a logit per head, held per row in sink_ref) enters as the starting max and sum (m = sink,
    l = 1); without one m is MASKED, so the first key seen scales the start away."""
    if has_sinks:
        m_ref[...] = jnp.broadcast_to(sink_ref[...] * LOG2E, m_ref.shape)
        l_ref[...] = jnp.ones_like(l_ref)
    else:
        m_ref[...] = jnp.full_like(m_ref, MASKED)
        l_ref[...] = jnp.zeros_like(l_ref)
    acc_ref[...] = jnp.zeros_like(acc_ref)


def as_columns(row):
    """A per-row value held lane-dense [1, rows] as a column repeated over 128 lanes
    [rows, LANES] (one transpose per block, on the XLU)."""
    return jnp.broadcast_to(row, (LANES, row.shape[1])).T


def lanes(x, width: int):
    """A row statistic held replicated over 128 lanes [rows, 128], as [rows, width]: whole vregs
    repeated, not a lane broadcast per use."""
    reps = -(-width // LANES)
    return (jnp.tile(x, (1, reps)) if reps > 1 else x)[:, :width]


def heads_as_rows(x, groups: int, num: int):
    """[T, Hq, D] -> [Hkv, num * G, D]: a KV head's G query heads as rows, token-major (row t * G + g
    is token t of head hkv * G + g), padded to num tokens. One K/V block then serves the whole
    group in one matmul."""
    t, hq, d = x.shape
    x = jnp.pad(x, ((0, num - t), (0, 0), (0, 0))) if num != t else x
    return x.reshape(num, hq // groups, groups, d).transpose(1, 0, 2, 3).reshape(hq // groups, num * groups, d)


def rows_as_heads(x, groups: int, t: int):
    """heads_as_rows' inverse: [Hkv, num * G, D] -> [t, Hq, D]."""
    hkv, rows, d = x.shape
    return x.reshape(hkv, rows // groups, groups, d).transpose(1, 0, 2, 3).reshape(-1, hkv * groups, d)[:t]


def heads_in_lanes(x, groups: int, num: int):
    """[T, Hq, D] -> [Hkv, num, G * D]: a KV head's G query heads side by side in each token's
    lanes, padded to num tokens: heads_as_rows' order once a kernel reshapes a block to
    [tokens * G, D] (Mosaic does that on chip where D is a multiple of 128). XLA makes this
    layout in one transpose, cheaper than heads_as_rows' copies at head_dim 256 and dearer at
    128 (MODELED; flash_attention/ops.py: IN_LANES_MIN_HEAD_DIM)."""
    t, hq, d = x.shape
    x = jnp.pad(x, ((0, num - t), (0, 0), (0, 0))) if num != t else x
    return x.reshape(num, hq // groups, groups * d).transpose(1, 0, 2)


def lanes_as_heads(x, groups: int, t: int):
    """heads_in_lanes' inverse: [Hkv, num, G * D] -> [t, Hq, D]."""
    hkv, num, width = x.shape
    return x.transpose(1, 0, 2).reshape(num, hkv * groups, width // groups)[:t]
