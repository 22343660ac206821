"""The thin torch layer: flash-attn 2's entry points, argument checks with
clear errors, one differentiable op."""

from __future__ import annotations

import inspect
import math

import jax
import jax.numpy as jnp
import torch

from . import ops
from ._build import OP_NAMESPACE
from ._shared.bridge import check_same_device, check_tensor, jax_custom_op, pad_offsets, pad_rows, values_on_host
from ._shared.tuning import bucket_size

FLOAT_DTYPES = (torch.float32, torch.bfloat16)
MAX_HEAD_DIM = 512  # Gemma 4's global layers


def _attention_jax(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    num_tokens: jax.Array,
    sinks: jax.Array,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    has_sinks: bool,
    *,
    interpret,
    generation,
) -> tuple[jax.Array, jax.Array]:
    """(out, lse): the output, and the softmax statistics the backward reuses. num_tokens [2]
    int32: the tokens of q and of k the caller gave, before the bucket's padding rows (what
    cu_seqlens are checked against)."""
    return ops.flash_attention_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_left, window_right), softcap=softcap, sinks=sinks if has_sinks else None,
        num_tokens=num_tokens, generation=generation, interpret=interpret,
    )


def _attention_backward_jax(q, k, v, cu_seqlens_q, cu_seqlens_k, num_tokens, sinks, softmax_scale, causal,
                            window_left, window_right, softcap, has_sinks, out, lse, grad_out, grad_lse, *,
                            interpret, generation):
    """(dq, dk, dv, dsinks) from the forward's (out, lse): the forward does not run again."""
    dq, dk, dv, dsinks = ops.flash_attention_varlen_backward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, grad_out, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_left, window_right), softcap=softcap, sinks=sinks if has_sinks else None,
        num_tokens=num_tokens, generation=generation, interpret=interpret,
    )
    return dq, dk, dv, dsinks if has_sinks else jnp.zeros_like(sinks)


attention_op = jax_custom_op(f"{OP_NAMESPACE}::flash_attention_varlen", _attention_jax,
                             differentiable=("q", "k", "v", "sinks"), backward=_attention_backward_jax)


def _check_unsupported(dropout_p, alibi_slopes, return_attn_probs):
    if dropout_p:
        raise NotImplementedError(f"flash-attn-tpu has no attention dropout (dropout_p={dropout_p}); use 0.0")
    if alibi_slopes is not None:
        raise NotImplementedError("flash-attn-tpu does not support alibi_slopes")
    if return_attn_probs:
        raise NotImplementedError("flash-attn-tpu does not return attention probabilities (return_attn_probs=True)")


def _check_options(softmax_scale, window_size, softcap):
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive number or None, got {softmax_scale!r}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and w >= -1 for w in window_size)):
        raise ValueError(f"window_size must be (left, right) ints >= -1 (-1: unbounded), got {window_size!r}")
    if not (isinstance(softcap, (int, float)) and softcap >= 0 and math.isfinite(softcap)):
        raise ValueError(f"softcap must be a finite number >= 0 (0: none), got {softcap!r}")


def _check_tensors(q, k, v, s_aux, rank: int):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, rank, FLOAT_DTYPES)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    hq, d = q.shape[-2:]
    hkv, dk = k.shape[-2:]
    if dk != d:
        raise ValueError(f"q and k head dims differ: {d} vs {dk}")
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"v must match k in every dim but the last, got {tuple(v.shape)} and {tuple(k.shape)}")
    if hq % hkv:
        raise ValueError(f"q's {hq} heads are not a multiple of k's {hkv}")
    if max(d, v.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(f"{_calling_layer()}head dims of any size up to {MAX_HEAD_DIM} are supported, got q and k's "
                         f"{d} and v's {v.shape[-1]}")
    if s_aux is not None:
        if not isinstance(s_aux, torch.Tensor) or s_aux.shape != (hq,):
            raise ValueError(f"s_aux (sinks) must be a tensor of shape ({hq},), got "
                             f"{tuple(s_aux.shape) if isinstance(s_aux, torch.Tensor) else type(s_aux).__name__}")
        if s_aux.dtype not in FLOAT_DTYPES + (torch.float16,):
            raise TypeError(f"s_aux must be a float tensor, got {s_aux.dtype}")
    check_same_device(q=q, k=k, v=v, s_aux=s_aux)


def _calling_layer() -> str:
    """'<attention class> (layer i): ' when a model's attention module is calling (transformers calls
    the entry points from its forward), so that an error names the layer; '' for direct calls.
    Walks the stack: for error messages only, never on a path that succeeds."""
    frame = inspect.currentframe()
    while frame is not None:
        caller = frame.f_locals.get("self")
        if isinstance(caller, torch.nn.Module) and hasattr(caller, "layer_idx"):
            return f"{type(caller).__name__} (layer {caller.layer_idx}): "
        frame = frame.f_back
    return ""


def _check_cu_seqlens(name, cu, num_tokens, device, max_seqlen):
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be a 1-D tensor of batch + 1 offsets")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device}, q on {device}")
    # Values are checked here only where reading them costs no device round trip; on a TPU an
    # invalid cu_seqlens makes the output and the gradients NaN instead (ops.cu_seqlens_valid).
    if not values_on_host(cu):
        return
    if int(cu[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(cu[0])}")
    lengths = cu[1:] - cu[:-1]
    if bool((lengths < 0).any()):
        raise ValueError(f"{name} must not decrease: {cu.tolist()}")
    if int(cu[-1]) > num_tokens:
        raise ValueError(f"{name} ends at {int(cu[-1])}, past the {num_tokens} tokens given")
    if isinstance(max_seqlen, torch.Tensor):
        max_seqlen = int(max_seqlen) if values_on_host(max_seqlen) else None
    if max_seqlen is not None and int(lengths.max()) > max_seqlen:
        raise ValueError(f"max_seqlen {max_seqlen} is below the longest sequence, {int(lengths.max())} tokens")


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, s_aux=None):
    """Attention over sequences packed back to back (flash-attn 2's varlen API).

    q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv] (Hq a multiple of Hkv:
    GQA and MQA without repeating k and v); cu_seqlens_q, cu_seqlens_k
    [B + 1] int32 offsets from 0 (tokens past the last offset are padding:
    their outputs are zero, their keys never seen). A sequence's queries are
    its last positions: causal is aligned to the bottom right.
    window_size=(left, right) lets position p see keys p - left .. p + right
    (-1: unbounded); softcap c maps a scaled score s to c * tanh(s / c);
    s_aux [Hq] (attention sinks) adds exp(s_aux[h]) to head h's softmax
    denominator. max_seqlen_* are checked on CPU tensors and otherwise
    unused (they never cause a recompile); deterministic is accepted (the
    kernels are deterministic). Returns [Tq, Hq, Dv] in q's dtype;
    differentiable in q, k, v and s_aux.
    """
    _check_unsupported(dropout_p, alibi_slopes, return_attn_probs)
    _check_options(softmax_scale, window_size, softcap)
    _check_tensors(q, k, v, s_aux, rank=3)
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device, max_seqlen_q)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device, max_seqlen_k)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one length, got {cu_seqlens_q.shape[0]} "
                         f"and {cu_seqlens_k.shape[0]}")
    tokens = q.shape[0]
    # Token and sequence counts padded to powers of two: a generate loop or a serving run
    # compiles a bounded set of shapes. Padding queries cost no matmul, padding keys are never read.
    num_q, num_k, num_offsets = bucket_size(tokens), bucket_size(k.shape[0]), bucket_size(cu_seqlens_q.shape[0])
    # The token counts given, so that the device checks cu_seqlens against them and not against the
    # padded buckets (offsets reaching into the padding would attend zero keys, or read a padding
    # query): one shape whatever the counts (no recompile), and filled on the device, so nothing
    # crosses between host and device.
    num_tokens = torch.full((2,), tokens, dtype=torch.int32, device=q.device)
    num_tokens[1] = k.shape[0]
    # Sinks stay in f32 whatever q's dtype: rounded to bf16, a sink s is off by up to 2^-8 |s|, which
    # scales its weight in the softmax by up to exp(2^-8 |s|). Autograd returns their gradient in s_aux's dtype.
    sinks = s_aux.to(torch.float32) if s_aux is not None else q.new_empty(0, dtype=torch.float32)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    out, _ = attention_op(pad_rows(q, num_q), pad_rows(k, num_k), pad_rows(v, num_k),
                       pad_offsets(cu_seqlens_q, num_offsets), pad_offsets(cu_seqlens_k, num_offsets), num_tokens,
                       sinks, scale, bool(causal), int(window_size[0]), int(window_size[1]), float(softcap),
                       s_aux is not None)
    return out[:tokens] if num_q != tokens else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, s_aux=None):
    """Attention over a dense batch (flash-attn 2's API): q [B, Sq, Hq, D],
    k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] -> [B, Sq, Hq, Dv]; options as
    flash_attn_varlen_func."""
    _check_unsupported(dropout_p, alibi_slopes, return_attn_probs)
    _check_tensors(q, k, v, s_aux, rank=4)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q and k batch sizes differ: {q.shape[0]} vs {k.shape[0]}")
    batch, seq_q, seq_k = q.shape[0], q.shape[1], k.shape[1]
    offsets = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    out = flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
                                 offsets * seq_q, offsets * seq_k, seq_q, seq_k, softmax_scale=softmax_scale,
                                 causal=causal, window_size=window_size, softcap=softcap, s_aux=s_aux)
    return out.reshape(batch, seq_q, *out.shape[1:])


# ---------------------------------------------------------------------------------------------
# flash_attn_with_kvcache (flash-attn 2's inference API), over paged-attention-tpu's kernel.


def _kvcache_jax(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array, page_table: jax.Array,
                 valid: jax.Array, sinks: jax.Array, seq_q: int, softmax_scale: float, causal: bool, window_left: int,
                 window_right: int, softcap: float, has_sinks: bool, return_lse: bool, *, interpret,
                 generation) -> tuple[jax.Array, jax.Array]:
    """(out, lse) of ops.flash_attention_with_kvcache (lse [0] unless return_lse); both NaN when
    `valid` [1] (the torch layer's device check of the index values) is 0."""
    out, lse = ops.flash_attention_with_kvcache(
        q, k_pages, v_pages, kv_lens, page_table, seq_q=seq_q, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_left, window_right), softcap=softcap, sinks=sinks if has_sinks else None,
        return_lse=return_lse, generation=generation, interpret=interpret)
    ok = valid[0] != 0
    lse = jnp.where(ok, lse, jnp.nan) if return_lse else jnp.zeros((0,), jnp.float32)
    return jnp.where(ok, out, jnp.nan).astype(q.dtype), lse


kvcache_op = jax_custom_op(f"{OP_NAMESPACE}::flash_attention_with_kvcache", _kvcache_jax)

MAX_CONTIGUOUS_PAGE = 256  # a contiguous cache is read as pages of at most this many tokens


def _contiguous_page_size(seqlen_cache: int) -> int:
    """The page size a contiguous cache [B, S, Hkv, D] is read in: the largest power of two that
    divides S, up to MAX_CONTIGUOUS_PAGE (the paged kernel's table is tuned for 16 to 256)."""
    return min(seqlen_cache & -seqlen_cache, MAX_CONTIGUOUS_PAGE)


def _check_kvcache_tensors(q, k_cache, v_cache, k, v, block_table, cache_batch_idx, sinks):
    check_tensor("q", q, 4, FLOAT_DTYPES)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, cache, 4, (q.dtype,))
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous: the new tokens are written into it in place")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have one shape")
    hq, d = q.shape[2:]
    hkv, dc = k_cache.shape[2:]
    if dc != d:
        raise ValueError(f"q's head_dim {d} differs from k_cache's {dc}")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"{_calling_layer()}head dims of any size up to {MAX_HEAD_DIM} are supported, got {d}")
    if hq % hkv:
        raise ValueError(f"q's {hq} heads are not a multiple of k_cache's {hkv} KV heads")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new tokens' keys and values) or both be None")
    if k is not None:
        for name, new in (("k", k), ("v", v)):
            check_tensor(name, new, 4, (q.dtype,))
            if new.shape[0] != q.shape[0] or new.shape[2:] != k_cache.shape[2:]:
                raise ValueError(f"{name} {tuple(new.shape)} must be [batch {q.shape[0]}, new tokens, KV heads "
                                 f"{hkv}, head_dim {d}] (q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)})")
        if k.shape != v.shape:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape")
    if block_table is not None:
        check_tensor("block_table", block_table, 2, (torch.int32,))
        if block_table.shape[0] != q.shape[0]:
            raise ValueError(f"block_table {tuple(block_table.shape)} must have one row per batch row ({q.shape[0]})")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx indexes a contiguous cache; with block_table (a paged cache) the "
                             "block table says where each row's tokens are")
    if cache_batch_idx is not None:
        check_tensor("cache_batch_idx", cache_batch_idx, 1, (torch.int32, torch.int64))
        if cache_batch_idx.shape[0] != q.shape[0]:
            raise ValueError(f"cache_batch_idx must have one entry per batch row ({q.shape[0]}), got "
                             f"{tuple(cache_batch_idx.shape)}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.shape != (hq,):
            raise ValueError(f"s_aux (sinks) must be a tensor of shape ({hq},), got "
                             f"{tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}")
        if sinks.dtype not in FLOAT_DTYPES + (torch.float16,):
            raise TypeError(f"s_aux must be a float tensor, got {sinks.dtype}")
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, block_table=block_table,
                      cache_batch_idx=cache_batch_idx, s_aux=sinks)


def _check_kvcache_values(cache_seqlens, kv_lens, capacity, page_table, pages_used, num_pages, cache_batch_idx,
                          batch_cache, paged):
    """The index values, on CPU tensors: an error naming the argument, before anything is written."""
    if bool((cache_seqlens < 0).any()):
        raise ValueError(f"cache_seqlens must be >= 0, got {cache_seqlens.tolist()}")
    if bool((kv_lens > capacity).any()):
        row = int((kv_lens > capacity).nonzero()[0, 0])
        where = (f"block_table's {page_table.shape[1]} blocks of {capacity // page_table.shape[1]} tokens" if paged
                 else f"the cache's {capacity} tokens")
        raise ValueError(f"cache_seqlens {int(cache_seqlens[row])} + {int(kv_lens[row] - cache_seqlens[row])} new "
                         f"tokens (k) of batch row {row} is past {where}")
    if cache_batch_idx is not None and bool(((cache_batch_idx < 0) | (cache_batch_idx >= batch_cache)).any()):
        raise ValueError(f"cache_batch_idx values must lie in [0, {batch_cache}), got {cache_batch_idx.tolist()}")
    used = page_table[pages_used]
    if paged and used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
        bad = ((page_table < 0) | (page_table >= num_pages)) & pages_used
        row, col = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"block_table[{row}, {col}] = {int(page_table[row, col])} is outside k_cache's {num_pages} "
                         f"blocks, and batch row {row} uses it: its cache_seqlens {int(cache_seqlens[row])} + "
                         f"{int(kv_lens[row] - cache_seqlens[row])} new tokens span {int(pages_used[row].sum())} "
                         f"blocks of {capacity // page_table.shape[1]} (-1 and other values are allowed only past a "
                         "row's blocks)")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            s_aux=None, learnable_sink=None):
    """Attention over a KV cache, the new tokens appended to it in place (flash-attn 2's API).

    q [B, Sq, Hq, D]; k_cache, v_cache either contiguous [B_cache, S, Hkv, D] (row b is
    cache_batch_idx[b], default b) or paged [num_blocks, block_size, Hkv, D] with block_table
    [B, max_blocks] int32 (entries past a row's blocks may hold anything: transformers pads
    with -1). k, v [B, Sn, Hkv, D] (optional): written into the caches at positions
    cache_seqlens .. cache_seqlens + Sn - 1 of each row, in place; the attention then sees
    each row's cache_seqlens + Sn keys, its Sq queries being the last positions (causal
    aligned to the bottom right; a query that sees no key gets zeros). cache_seqlens: an int
    or [B] int32 (default 0). window_size=(left, right), softcap, softmax_scale, GQA/MQA as
    flash_attn_func; s_aux or learnable_sink [Hq]: attention sinks (as transformers passes
    them). return_softmax_lse=True also returns lse [B, Hq, Sq] f32 (+inf for a query that
    sees nothing). num_splits is accepted and unused. Not supported (NotImplementedError):
    rotary_cos/rotary_sin, cache_leftpad, alibi_slopes; a non-causal call with Sq > 1 and a
    bounded left window. Inference only (no gradient).

    Bad shapes raise before anything is written; so do bad index values in CPU tensors (an
    append past the cache, cache_batch_idx or a used block index outside the cache, negative
    cache_seqlens). In TPU tensors the values are checked on the device (no host read): bad
    ones write nothing and make the whole output NaN.
    """
    if rotary_cos is not None or rotary_sin is not None:
        raise NotImplementedError("flash-attn-tpu's flash_attn_with_kvcache does not apply rotary embeddings "
                                  "(rotary_cos, rotary_sin): rotate q and k before the call")
    if cache_leftpad is not None:
        raise NotImplementedError("flash-attn-tpu's flash_attn_with_kvcache does not support cache_leftpad")
    if alibi_slopes is not None:
        raise NotImplementedError("flash-attn-tpu does not support alibi_slopes")
    if s_aux is not None and learnable_sink is not None:
        raise ValueError("pass the sinks once: s_aux or learnable_sink")
    sinks = s_aux if s_aux is not None else learnable_sink
    _check_options(softmax_scale, window_size, softcap)
    _check_kvcache_tensors(q, k_cache, v_cache, k, v, block_table, cache_batch_idx, sinks)
    batch, seq_q, hq, d = q.shape
    hkv = k_cache.shape[2]
    paged = block_table is not None
    new = 0 if k is None else k.shape[1]
    device = q.device
    if cache_seqlens is None:
        cache_seqlens = 0
    if isinstance(cache_seqlens, torch.Tensor):
        check_tensor("cache_seqlens", cache_seqlens, 1, (torch.int32, torch.int64))
        check_same_device(q=q, cache_seqlens=cache_seqlens)
        if cache_seqlens.shape[0] != batch:
            raise ValueError(f"cache_seqlens must have one entry per batch row ({batch}), got "
                             f"{tuple(cache_seqlens.shape)}")
    elif not isinstance(cache_seqlens, int) or isinstance(cache_seqlens, bool):
        raise TypeError(f"cache_seqlens must be an int or an int32 tensor [B], got {type(cache_seqlens).__name__}")
    elif cache_seqlens < 0:
        raise ValueError(f"cache_seqlens must be >= 0, got {cache_seqlens}")
    else:
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    if not causal and seq_q > 1 and window_size[0] >= 0:
        raise NotImplementedError(
            f"window_size={tuple(window_size)} without causal and with {seq_q} queries per row: a bounded left "
            "window then differs per query, which the paged kernel's one window cannot express; use causal=True, "
            "one query per row, or left=-1")
    # The caches as pages, and each row's pages. A contiguous cache's row is pages of it (a view).
    if paged:
        k_pages, v_pages, page_table = k_cache, v_cache, block_table
        num_pages, page_size = k_cache.shape[:2]
    else:
        batch_cache, seqlen_cache = k_cache.shape[:2]
        page_size = _contiguous_page_size(seqlen_cache)
        per_row = seqlen_cache // page_size
        num_pages = batch_cache * per_row
        k_pages, v_pages = (c.view(num_pages, page_size, hkv, d) for c in (k_cache, v_cache))
        rows = (cache_batch_idx if cache_batch_idx is not None
                else torch.arange(batch, dtype=torch.int32, device=device))
        # Clamped before narrowing (an int64 index must not wrap into range); checked below.
        rows = rows.clamp(-1, batch_cache).to(torch.int32)
        page_table = rows[:, None] * per_row + torch.arange(per_row, dtype=torch.int32, device=device)[None, :]
    width = page_table.shape[1]
    capacity = width * page_size
    on_host = values_on_host(cache_seqlens) and values_on_host(page_table)
    if on_host:  # in int64, before any narrowing
        lens = cache_seqlens.long() + new
        used = torch.arange(width)[None, :] < ((lens + page_size - 1) // page_size)[:, None]
        _check_kvcache_values(cache_seqlens.long(), lens, capacity, page_table, used, num_pages, cache_batch_idx,
                              None if paged else batch_cache, paged)
    # Clamped: an int64 length must not wrap into range when narrowed (bad ones are caught below on the device).
    cache_seqlens = cache_seqlens.clamp(-1, capacity + 1).to(torch.int32)
    kv_lens = cache_seqlens + new
    if on_host:
        valid = None
    else:
        # On the device: a bad value writes nothing (each new row's old content is written back)
        # and makes the output NaN; nothing is read back to the host.
        in_cache = (page_table >= 0) & (page_table < num_pages)
        pages_used = torch.arange(width, device=device)[None, :] < ((kv_lens + page_size - 1) // page_size)[:, None]
        valid = ((cache_seqlens >= 0) & (kv_lens <= capacity)).all() & (in_cache | ~pages_used).all()
        if not paged:
            valid = valid & ((rows >= 0) & (rows < batch_cache)).all()
    if new:
        positions = cache_seqlens[:, None].long() + torch.arange(new, device=device)[None, :]
        blocks = page_table.gather(1, (positions // page_size).clamp(0, width - 1)).long()
        slots = (blocks * page_size + positions % page_size).reshape(-1)
        for cache, rows_new in ((k_cache, k), (v_cache, v)):
            flat = cache.view(-1, hkv, d)
            rows_new = rows_new.reshape(-1, hkv, d)
            if valid is not None:
                slots = slots.clamp(0, flat.shape[0] - 1)
                rows_new = torch.where(valid, rows_new, flat.index_select(0, slots))
            flat.index_copy_(0, slots, rows_new)
    valid_flag = (valid if valid is not None else torch.ones((), dtype=torch.bool, device=device))
    # Batch rows padded to powers of two: a decode loop compiles a bounded set of shapes. Padding
    # rows have no keys (kv_len 0): their queries see nothing, and no page of theirs is read.
    num = bucket_size(batch)
    sinks32 = sinks.to(torch.float32) if sinks is not None else q.new_empty(0, dtype=torch.float32)
    scale = float(softmax_scale) if softmax_scale is not None else d ** -0.5
    out, lse = kvcache_op(pad_rows(q.reshape(batch * seq_q, hq, d), num * seq_q), k_pages, v_pages,
                          pad_rows(kv_lens, num), pad_rows(page_table, num),
                          valid_flag.reshape(1).to(torch.int32), sinks32, seq_q, scale, bool(causal),
                          int(window_size[0]), int(window_size[1]), float(softcap), sinks is not None,
                          bool(return_softmax_lse))
    out = out[:batch * seq_q].reshape(batch, seq_q, hq, d)
    return (out, lse[:batch]) if return_softmax_lse else out
