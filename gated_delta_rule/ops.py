"""JAX entry point: the gated delta rule over whole or packed sequences, chunked.

`chunk_gated_delta_rule` takes fla's arguments as transformers passes them (Qwen3.5,
Qwen3-Next): q, k [B, T, Hk, dk], v [B, T, Hv, dv], g (log decay, <= 0) and beta [B, T, Hv],
an optional initial state [N, Hv, dk, dv], and `cu_seqlens` [N + 1] for N sequences packed
in a batch of one. Hk divides Hv: value head h reads q and k head h // (Hv // Hk), as the
models' `repeat_interleave` lays them out. It returns o [B, T, Hv, dv] in q's dtype and, with
`output_final_state`, each sequence's final state [N, Hv, dk, dv] in fp32; everything inside
is computed on fp32 values (kernel.py says at which precision). The kernel reads the tokens where
they lie when every sequence's chunks do: one sequence, or a batch's rows (no `cu_seqlens`) of
whole chunks; otherwise (packed sequences, rows ending within a chunk) each sequence's tokens are
gathered into chunks of its own.

`fused_recurrent_gated_delta_rule` takes the same arguments and computes the same, token by
token: for decode steps (a token or a few per sequence), where the chunked form would pad each
sequence to a chunk. Its final states take initial_state's buffer: updated in place when the
caller donates it (as an engine keeps its states), else XLA copies the states there first. With
`state_in_place=False` a decode step (a token per sequence, no `cu_seqlens`) writes them to a new
buffer instead, for a caller that keeps initial_state: no copy either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ._shared.generations import GENERATIONS, current_generation, default_interpret
from .kernel import chunk_forward, decode_forward, recurrent_forward

CHUNK = 64  # tokens per chunk: fla's and transformers' reference's
# Most heads a chunked grid step takes (their products batched, see kernel._chunk_kernel): more
# interleave more chains, but the backward's VMEM grows with them.
HEADS_PER_STEP = 32
SEQS_PER_STEP = 4  # sequences a decode grid step takes, when the batch allows (see kernel.decode_forward)
DECODE_RING = 3  # slots of the decode kernel's ring of states on a chip of one core: two copies in flight
HEAD_SPLITS = 4  # grid steps a decode step of one sequence takes, a quarter of its heads each


def _shape_error(name: str, got, want: str):
    return ValueError(f"chunk_gated_delta_rule: {name} has shape {tuple(got)}, expected {want}")


def check_shapes(q, k, v, g, beta, initial_state, cu_seqlens) -> int:
    """Raises a ValueError naming the argument whose shape disagrees; returns the number of sequences."""
    if q.ndim != 4:
        raise _shape_error("q", q.shape, "[batch, tokens, heads, head_dim]")
    batch, tokens, hk, dk = q.shape
    if k.shape != q.shape:
        raise _shape_error("k", k.shape, f"q's {tuple(q.shape)}")
    if v.ndim != 4 or v.shape[:2] != (batch, tokens):
        raise _shape_error("v", v.shape, f"[{batch}, {tokens}, value_heads, value_dim]")
    hv, dv = v.shape[2:]
    if hv % hk:
        raise ValueError(f"chunk_gated_delta_rule: v's {hv} heads are not a multiple of q's and k's {hk}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (batch, tokens, hv):
            raise _shape_error(name, x.shape, f"[{batch}, {tokens}, {hv}] (v's batch, tokens and heads)")
    if cu_seqlens is not None:
        if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
            raise _shape_error("cu_seqlens", cu_seqlens.shape, "[sequences + 1]")
        if batch != 1:
            raise ValueError(f"chunk_gated_delta_rule: with cu_seqlens the sequences are packed in a batch of "
                             f"one, got batch {batch}")
        if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
            raise ValueError(f"chunk_gated_delta_rule: cu_seqlens must be integers, got {cu_seqlens.dtype}")
    seqs = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is not None and initial_state.shape != (seqs, hv, dk, dv):
        raise _shape_error("initial_state", initial_state.shape, f"[{seqs}, {hv}, {dk}, {dv}] (sequences, v's heads, "
                           "k's head_dim, v's head_dim)")
    return seqs


def check_cu_seqlens(cu_seqlens, tokens: int) -> None:
    """Values of a host-side cu_seqlens (a traced one is taken as given: reading it would sync)."""
    if isinstance(cu_seqlens, jax.core.Tracer):
        return
    cu = np.asarray(cu_seqlens)
    if cu[0] != 0 or cu[-1] != tokens or np.any(np.diff(cu) < 0):
        raise ValueError(f"chunk_gated_delta_rule: cu_seqlens must rise from 0 to the {tokens} tokens, got "
                         f"{cu.tolist()}")


def chunk_layout(cu_seqlens, tokens: int, seqs: int, chunk: int):
    """Where each sequence's chunks go: (seq, first, last) int32 per chunk (seq -1 past the live
    chunks) and, per chunk slot, the token it holds (`tokens` for padding). Every sequence starts a
    chunk; the count of chunks is a static bound, ceil(tokens / chunk) + seqs - 1 (packed)."""
    cu = cu_seqlens.astype(jnp.int32)
    lens = cu[1:] - cu[:-1]
    per_seq = (lens + chunk - 1) // chunk
    ends = jnp.cumsum(per_seq)
    starts = ends - per_seq
    count = -(-tokens // chunk) + max(seqs - 1, 0)
    c = jnp.arange(count, dtype=jnp.int32)
    live = c < ends[-1]
    s = jnp.clip(jnp.searchsorted(ends, c, side="right"), 0, seqs - 1).astype(jnp.int32)
    i = c - starts[s]
    seq = jnp.where(live, s, -1)
    first = (live & (i == 0)).astype(jnp.int32)
    last = (live & (i == per_seq[s] - 1)).astype(jnp.int32)
    offset = jnp.arange(chunk, dtype=jnp.int32)
    valid = live[:, None] & (offset[None, :] < (lens[s] - i * chunk)[:, None])
    token = jnp.where(valid, cu[s][:, None] + i[:, None] * chunk + offset[None, :], tokens)
    return seq, first, last, token


def even_chunk_layout(batch: int, tokens: int, chunk: int):
    """chunk_layout's (seq, first, last) for `batch` sequences of `tokens` each (no cu_seqlens),
    known when tracing: every sequence takes ceil(tokens / chunk) chunks of its own."""
    per_seq = max(1, -(-tokens // chunk))
    c = np.arange(batch * per_seq)
    at = c % per_seq
    return (jnp.asarray(c // per_seq, jnp.int32), jnp.asarray(at == 0, jnp.int32),
            jnp.asarray(at == per_seq - 1, jnp.int32))


def _arguments(q, k, v, g, beta, scale, initial_state, cu_seqlens, interpret):
    """Both entry points' arguments, checked and defaulted: (sequences, cu_seqlens (each batch row
    a sequence by default), scale, interpret, the initial states in fp32 (zeros by default))."""
    seqs = check_shapes(q, k, v, g, beta, initial_state, cu_seqlens)
    batch, tokens, hk, dk = q.shape
    hv, dv = v.shape[2:]
    if cu_seqlens is None:
        cu_seqlens = jnp.arange(batch + 1, dtype=jnp.int32) * tokens
    else:
        check_cu_seqlens(cu_seqlens, tokens)
    h0 = (jnp.zeros((seqs, hv, dk, dv), jnp.float32) if initial_state is None
          else jnp.asarray(initial_state, jnp.float32))
    return (seqs, jnp.asarray(cu_seqlens), dk ** -0.5 if scale is None else float(scale),
            default_interpret() if interpret is None else interpret, h0)


def _valid(cu, tokens: int):
    """Whether offsets on the device rise from 0 to at most the token count (not checked on the
    host: that would sync). Where they do not, every output is NaN rather than silently wrong;
    tokens past the last offset are padding, ignored."""
    return (cu[0] == 0) & jnp.all(cu[1:] >= cu[:-1]) & (cu[-1] <= tokens)


def _outputs(o, final, h0, cu, tokens: int, output_final_state, packed: bool):
    """(o, final states or None) of the chunked kernel. A sequence with no tokens is never visited:
    its state passes through. Unpacked rows are valid offsets, each a sequence of one token or
    more, known when tracing."""
    if not packed:
        return o, final if output_final_state else None
    valid = _valid(cu, tokens)
    o = jnp.where(valid, o, jnp.nan).astype(o.dtype)
    if not output_final_state:
        return o, None
    return o, jnp.where(valid, jnp.where((cu[1:] == cu[:-1])[:, None, None, None], h0, final), jnp.nan)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, *, chunk_size: int = CHUNK,
                           heads_per_step: int | None = None, generation: str | None = None, interpret=None):
    packed = cu_seqlens is not None
    seqs, cu, scale, interpret, h0 = _arguments(q, k, v, g, beta, scale, initial_state, cu_seqlens, interpret)
    batch, tokens, hv, dv = v.shape
    hk, dk = q.shape[2:]
    total = batch * tokens
    if total == 0:  # no token: every state passes through
        return jnp.zeros(v.shape, q.dtype), (h0 if output_final_state else None)
    # The kernel reads [B, T, H, d] as it lies, B and T merged.
    rows = lambda x: jnp.asarray(x).reshape(total, *x.shape[2:])
    if not packed and (batch == 1 or tokens % chunk_size == 0):  # each sequence's chunks where they lie
        seq, first, last = even_chunk_layout(batch, tokens, chunk_size)
        chunked, unchunked = rows, lambda o: o
        padded = seq.shape[0] * chunk_size
        chunked_gb = lambda x: jnp.pad(rows(x), [(0, padded - total), (0, 0)])
    else:  # each sequence's tokens gathered into chunks of its own
        seq, first, last, token = chunk_layout(cu, total, seqs, chunk_size)
        index = token.reshape(-1)
        chunked = chunked_gb = lambda x: rows(x).at[index].get(mode="fill", fill_value=0)

        def unchunked(o):
            return jnp.zeros((total, hv, dv), o.dtype).at[index].set(o, mode="drop")

    chunks = seq.shape[0]
    # [H, chunks, 2, C]: g's cumulative sum within each chunk (G), then beta, in fp32 (XLA's sums:
    # the kernel would take them as a matmul of six passes per head and chunk).
    per_chunk = lambda x: jnp.moveaxis(chunked_gb(jnp.asarray(x, jnp.float32)).reshape(chunks, chunk_size, hv), 2, 0)
    gb = jnp.stack([jnp.cumsum(per_chunk(g), axis=-1), per_chunk(beta)], axis=2)
    o, final = chunk_forward(seq, first, last, chunked(q), chunked(k), chunked(v), gb, h0, num_seqs=seqs, scale=scale,
                             l2norm=bool(use_qk_l2norm_in_kernel), chunk=chunk_size,
                             heads_per_step=_heads_per_step(heads_per_step, hv, hv // hk, generation),
                             interpret=interpret)
    return _outputs(unchunked(o).reshape(batch, tokens, hv, dv), final, h0, cu, total, output_final_state, packed)


def _heads_per_step(asked: int | None, heads: int, group: int, generation: str | None) -> int:
    """Value heads a chunked grid step takes: a divisor of the heads that a q/k head's group of
    value heads divides or that divides it (a step reads whole q/k heads), a multiple of 16 or all
    of them (a block of heads fills whole sublane tiles, bf16's or fp32's). By default the most up
    to HEADS_PER_STEP, leaving a block for each core of a megacore where one fits."""
    def fits(hb):
        return heads % hb == 0 and (hb % group == 0 or group % hb == 0) and (hb == heads or hb % 16 == 0)
    if asked is None:
        cores = GENERATIONS[generation or current_generation().name].cores_per_device
        candidates = [hb for hb in range(min(heads, HEADS_PER_STEP), 0, -1) if fits(hb)] or [heads]
        return next((hb for hb in candidates if heads // hb >= cores), candidates[0])
    if asked < 1 or not fits(asked):
        raise ValueError(f"heads_per_step={asked}: a divisor of the {heads} value heads that their q/k heads' "
                         f"groups of {group} divide or that divides {group}, a multiple of 16 unless it is all "
                         f"{heads}")
    return asked


def _seqs_per_step(batch: int) -> int:
    """Sequences a decode grid step takes: the largest divisor of the batch up to SEQS_PER_STEP."""
    return max(n for n in range(1, min(batch, SEQS_PER_STEP) + 1) if batch % n == 0)


def _decode_plan(batch: int, shared_heads: int, generation: str | None = None) -> tuple[int, int, int]:
    """(head splits, sequences per grid step, ring) of a decode step. On a chip of one core the
    states come through a ring of DECODE_RING slots that the kernel fills itself, so that a copy's
    latency overlaps the copies before it (Pallas's pipeline keeps one in flight and waits out each
    one's latency: on tpu7x, a few megabytes' copies wait longer than they take); and one sequence
    goes as HEAD_SPLITS sequences of a quarter of its heads each (their recurrences are independent;
    value head h reads q/k head h // group, so a quarter of each stays together), so that its copies
    overlap too. A megacore (v5p) splits the sequences over its two cores through Pallas's pipeline."""
    if GENERATIONS[generation or current_generation().name].cores_per_device > 1:
        return 1, _seqs_per_step(batch), 0
    splits = HEAD_SPLITS if batch == 1 and shared_heads % HEAD_SPLITS == 0 else 1
    seqs = 1 if splits > 1 else _seqs_per_step(batch)
    return splits, seqs, DECODE_RING if batch * splits > seqs else 0


def token_layout(cu_seqlens, tokens: int, seqs: int):
    """Per token: its sequence (-1 past the live ones), whether it is its sequence's first and last
    token, and whether it is live."""
    cu = cu_seqlens.astype(jnp.int32)
    t = jnp.arange(tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu[1:], t, side="right"), 0, seqs - 1).astype(jnp.int32)
    live = t < cu[-1]
    first = (live & (t == cu[seq])).astype(jnp.int32)
    last = (live & (t == cu[seq + 1] - 1)).astype(jnp.int32)
    return jnp.where(live, seq, -1), first, last, live


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                     cu_seqlens=None, use_qk_l2norm_in_kernel=False, *, state_in_place=True,
                                     interpret=None):
    out_dtype = q.dtype
    seqs, cu, scale, interpret, h0 = _arguments(q, k, v, g, beta, scale, initial_state, cu_seqlens, interpret)
    batch, tokens, hv, dv = v.shape
    total = batch * tokens
    seq, first, last, live = token_layout(cu, total, seqs)
    valid = _valid(cu, total)
    flags = jnp.stack([valid, cu[-1] == cu[-2]]).astype(jnp.int32)
    flat = lambda x: jnp.asarray(x).reshape(total, *x.shape[2:])
    gb = jnp.stack([flat(jnp.asarray(g, jnp.float32)), flat(jnp.asarray(beta, jnp.float32))], axis=-1)
    if cu_seqlens is None and tokens == 1:  # a decode step: a token per sequence, several sequences a grid step
        splits, seqs_per_step, ring = _decode_plan(batch, q.shape[2])
        split = lambda x: x.reshape(batch * splits, x.shape[1] // splits, *x.shape[2:])  # heads as sequences
        o, final = decode_forward(split(flat(q)), split(flat(k)), split(flat(v)), split(gb), split(h0),
                                  seqs_per_step=seqs_per_step, scale=scale, l2norm=bool(use_qk_l2norm_in_kernel),
                                  out_dtype=out_dtype, in_place=bool(state_in_place), ring=ring, interpret=interpret)
        return o.reshape(batch, tokens, hv, dv), (final.reshape(h0.shape) if output_final_state else None)
    # The states come back in h0's buffer, NaN where the offsets are not valid: no pass over them here.
    o, final = recurrent_forward(seq, first, last, flags, flat(q), flat(k), flat(v), gb, h0, num_seqs=seqs,
                                 scale=scale, l2norm=bool(use_qk_l2norm_in_kernel), out_dtype=out_dtype,
                                 interpret=interpret)
    o = jnp.where(valid & live[:, None, None], o, jnp.where(valid, 0, jnp.nan)).astype(out_dtype)
    return o.reshape(batch, tokens, hv, dv), (final if output_final_state else None)
