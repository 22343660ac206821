"""The thin torch layer: vLLM's two calls, `reshape_and_cache_flash` (write new tokens' K and V
into the paged caches, in place) and `ragged_paged_attention` (attend over the pages where they
lie), with argument checks that name the argument."""

from __future__ import annotations

import math

import jax
import torch

from . import ops
from ._build import OP_NAMESPACE
from ._shared.bridge import (check_same_device, check_tensor, is_whole, jax_custom_op, pad_offsets, pad_rows, rebind,
                             values_on_host)
from ._shared.tuning import bucket_size

QUERY_DTYPES = (torch.float32, torch.bfloat16)
CACHE_DTYPES = (torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int8)


def _attention_jax(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, kv_lens: jax.Array,
                   page_indices: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array, sinks: jax.Array,
                   kv_scales: jax.Array, softmax_scale: float, sliding_window: int, softcap: float, has_sinks: bool,
                   head_major: bool, *, interpret, generation) -> jax.Array:
    return ops.ragged_paged_attention(
        q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, num_seqs, softmax_scale=softmax_scale,
        sliding_window=sliding_window or None, softcap=softcap or None, sinks=sinks if has_sinks else None,
        k_scale=kv_scales[0], v_scale=kv_scales[1], cache_layout=_layout(head_major), generation=generation,
        interpret=interpret)


def _write_jax(key: jax.Array, value: jax.Array, key_cache: jax.Array, value_cache: jax.Array,
               slot_mapping: jax.Array, kv_scales: jax.Array, head_major: bool, *, interpret,
               generation) -> tuple[jax.Array, jax.Array]:
    return ops.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_scales[0], kv_scales[1],
                                       cache_layout=_layout(head_major), interpret=interpret)


def _layout(head_major: bool) -> str:
    """The ops' cache_layout of the ops' flag (a torch op's schema takes a bool, not a choice)."""
    return ops.CACHE_LAYOUTS[1] if head_major else ops.CACHE_LAYOUTS[0]


attention_op = jax_custom_op(f"{OP_NAMESPACE}::ragged_paged_attention", _attention_jax)
# On TPU the caches' buffers become the outputs (no copy of the cache); see bridge.rebind.
write_op = jax_custom_op(f"{OP_NAMESPACE}::reshape_and_cache_flash", _write_jax, donate=("key_cache", "value_cache"))


def _check_scale(name, scale):
    if scale is not None and not (isinstance(scale, (int, float)) and 0 < scale < math.inf):
        raise ValueError(f"{name} must be a positive float or None, got {scale!r}")


def _kv_scales(k_scale, v_scale, device) -> torch.Tensor:
    """[2] f32 on `device`: a quantized cache's k_scale and v_scale (1 for None), each a positive
    number or a one-element float tensor, as vLLM holds them. A tensor's value is checked only
    where reading it costs no device round trip; on a TPU a bad one makes the attention's output
    NaN (ops.ragged_paged_attention). The kernels take the scales as an operand, so changing them
    compiles nothing."""
    scales = []
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(scale, torch.Tensor):
            _check_scale(name, scale)
            scales.append(float(scale or 1.0))
            continue
        if scale.numel() != 1 or not scale.is_floating_point():
            raise ValueError(f"{name} must be a positive float or a one-element float tensor, got {scale.dtype} "
                             f"{tuple(scale.shape)}")
        if scale.device != device:
            raise ValueError(f"{name} is on {scale.device}, the caches on {device}")
        if values_on_host(scale) and not 0 < float(scale) < math.inf:
            raise ValueError(f"{name} must be positive and finite, got {float(scale)}")
        scales.append(scale.reshape(()).to(torch.float32))
    if not any(isinstance(s, torch.Tensor) for s in scales):
        return torch.tensor(scales, dtype=torch.float32, device=device)
    return torch.stack([s if isinstance(s, torch.Tensor) else torch.tensor(s, dtype=torch.float32, device=device)
                        for s in scales])


def _spec(t: torch.Tensor) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(t.shape), str(t.dtype).removeprefix("torch."))


def _check_index_values(kv_lens, page_indices, cu_q_lens, num_seqs, num_tokens, num_pages, page_size):
    """The index arrays' values, on CPU tensors, naming the argument; on a TPU invalid values make
    the output NaN instead (ops.inputs_valid), and no page outside the cache is ever read."""
    max_seqs = kv_lens.shape[0]
    if not 0 <= num_seqs <= max_seqs:
        raise ValueError(f"num_seqs {num_seqs} must lie in [0, {max_seqs}] (the sequences kv_lens holds)")
    if int(cu_q_lens[0]) != 0:
        raise ValueError(f"cu_q_lens must start at 0, got {int(cu_q_lens[0])}")
    q_lens = (cu_q_lens[1:] - cu_q_lens[:-1])[:num_seqs]
    if bool((q_lens < 0).any()):
        raise ValueError(f"cu_q_lens must not decrease: {cu_q_lens[:num_seqs + 1].tolist()}")
    if int(cu_q_lens[num_seqs]) > num_tokens:
        raise ValueError(f"cu_q_lens ends at {int(cu_q_lens[num_seqs])}, past the {num_tokens} tokens of q")
    lens = kv_lens[:num_seqs]
    if bool((q_lens > lens).any()):
        s = int((q_lens > lens).nonzero()[0, 0])
        raise ValueError(f"sequence {s} has {int(q_lens[s])} new tokens but kv_lens {int(lens[s])} (it must count "
                         "the new tokens too)")
    max_len = page_indices.shape[1] * page_size
    if bool((lens > max_len).any()):
        raise ValueError(f"kv_lens {int(lens.max())} is past page_indices' {page_indices.shape[1]} pages of "
                         f"{page_size} tokens")
    used = torch.arange(page_indices.shape[1]) < (lens[:, None] + page_size - 1) // page_size
    pages = page_indices[:num_seqs][used]
    if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
        raise ValueError(f"page_indices used by live sequences must lie in [0, {num_pages}), got "
                         f"[{int(pages.min())}, {int(pages.max())}]")


def ragged_paged_attention(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, softmax_scale=None,
                           sliding_window=None, softcap=None, sinks=None, k_scale=None, v_scale=None,
                           cache_layout="token_major"):
    """Attention of the new tokens of many sequences over their pages of the KV cache.

    q [T, Hq, D] (bf16 or f32): the new tokens of all sequences back to back; k_cache, v_cache
    [num_pages, page_size, Hkv, D] (bf16, f32, fp8 e4m3 or int8 holding value / scale), or
    [num_pages, Hkv, page_size, D] with cache_layout="head_major" (faster: see ops.CACHE_LAYOUTS);
    kv_lens [S] int32: each sequence's tokens, the new ones included; page_indices
    [S, pages_per_seq] int32; cu_q_lens [S + 1] int32: where each sequence's new tokens are in q;
    num_seqs: the live sequences (an int, or a one-element int32 tensor; the arrays may be padded
    past it, and what they hold there is ignored). A sequence's new tokens are its last positions
    and attend causally. sliding_window=W: a query at position p sees keys p - W + 1 .. p; softcap
    c maps a scaled score s to c * tanh(s / c); sinks [Hq] (kept in f32) add exp(sinks[h]) to the
    softmax's denominator; k_scale, v_scale: a quantized cache's scales, floats or one-element
    float tensors. Returns [T, Hq, D] in q's dtype; tokens past the live sequences get zeros.
    """
    check_tensor("q", q, 3, QUERY_DTYPES)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, cache, 4, CACHE_DTYPES)
    for name, t, rank in (("kv_lens", kv_lens, 1), ("page_indices", page_indices, 2), ("cu_q_lens", cu_q_lens, 1)):
        check_tensor(name, t, rank, (torch.int32,))
    if sinks is not None:
        check_tensor("sinks", sinks, 1, QUERY_DTYPES + (torch.float16,))
    num_seqs_tensor = num_seqs if isinstance(num_seqs, torch.Tensor) else None
    if num_seqs_tensor is not None and (num_seqs_tensor.numel() != 1 or num_seqs_tensor.dtype != torch.int32):
        raise ValueError(f"num_seqs must be an int or a one-element int32 tensor, got {num_seqs_tensor.dtype} "
                         f"{tuple(num_seqs_tensor.shape)}")
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, kv_lens=kv_lens, page_indices=page_indices,
                   cu_q_lens=cu_q_lens, num_seqs=num_seqs_tensor, sinks=sinks)
    _check_scale("softmax_scale", softmax_scale)
    kv_scales = _kv_scales(k_scale, v_scale, k_cache.device)
    if sliding_window is not None and not (isinstance(sliding_window, int) and sliding_window >= 1):
        raise ValueError(f"sliding_window must be an int >= 1 or None, got {sliding_window!r}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap >= 0):
        raise ValueError(f"softcap must be a float >= 0 or None, got {softcap!r}")
    # Shapes (heads, head_dim, page and sequence counts) are checked by ops, with the same names.
    ops.check_shapes(*(_spec(t) for t in (q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens)),
                     None if sinks is None else _spec(sinks), cache_layout)
    tokens, seqs = q.shape[0], kv_lens.shape[0]
    on_host = values_on_host(kv_lens)
    if on_host:
        live = int(num_seqs_tensor) if num_seqs_tensor is not None else int(num_seqs)
        _check_index_values(kv_lens, page_indices, cu_q_lens, live, tokens, *ops.cache_dims(k_cache, cache_layout)[:2])
    if num_seqs_tensor is None:
        num_seqs_tensor = torch.tensor([num_seqs], dtype=torch.int32, device=q.device)
    if not on_host:
        # The op's own check sees the bucketed counts below: num_seqs past kv_lens' S sequences, or
        # live tokens past q's T, would pass it and read padding as data. Such a call is made
        # invalid (num_seqs -1) on the device, without a read on the host: its output is NaN.
        n = num_seqs_tensor.reshape(1)
        end = cu_q_lens.gather(0, n.clamp(0, seqs).long())
        num_seqs_tensor = torch.where((n > seqs) | (end > tokens), -1, n)
    # Token and sequence counts padded to powers of two: a serving loop compiles a bounded set
    # of shapes. Padding tokens and sequences are past num_seqs' tokens: never computed.
    num_q, num_s = bucket_size(tokens), bucket_size(seqs)
    out = attention_op(
        pad_rows(q, num_q), k_cache, v_cache, pad_rows(kv_lens, num_s), pad_rows(page_indices, num_s),
        pad_offsets(cu_q_lens, num_s + 1),
        num_seqs_tensor.reshape(()), sinks.float() if sinks is not None else q.new_empty(0, dtype=torch.float32),
        kv_scales, float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5,
        int(sliding_window or 0), float(softcap or 0.0), sinks is not None, cache_layout == "head_major")
    return out[:tokens] if num_q != tokens else out


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None,
                            cache_layout="token_major") -> None:
    """Writes new tokens' key and value [T, Hkv, D] into key_cache and value_cache
    [num_pages, page_size, Hkv, D] ([num_pages, Hkv, page_size, D] with
    cache_layout="head_major") in place, at slot_mapping [N] (int32 or int64, N <= T:
    page * page_size + offset; -1 skips the token, as padding). As in vLLM, key and value may
    be padded past N tokens (for graph capture): their rows from N on are never written.
    fp8 and int8 caches store value / scale (k_scale, v_scale: floats or one-element float
    tensors). Shapes are checked before anything is written. On TPU the caches must be whole
    tensors, not views of a larger one: their buffers are reused in place."""
    for name, t in (("key", key), ("value", value)):
        check_tensor(name, t, 3, QUERY_DTYPES)
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_tensor(name, t, 4, CACHE_DTYPES)
        if t.device.type != "cpu" and not is_whole(t):
            raise ValueError(f"{name} is a view of a larger tensor: on TPU the write reuses the cache's own buffer, "
                             "so pass the whole cache tensor")
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64))
    check_same_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    ops.check_write_shapes(*(_spec(t) for t in (key, value, key_cache, value_cache)),
                           jax.ShapeDtypeStruct(tuple(slot_mapping.shape), "int32"), cache_layout)
    kv_scales = _kv_scales(k_scale, v_scale, key_cache.device)
    pages, page_size = ops.cache_dims(key_cache, cache_layout)[:2]
    num_slots = pages * page_size
    if values_on_host(slot_mapping) and slot_mapping.numel():
        bad = (slot_mapping < -1) | (slot_mapping >= num_slots)
        if bool(bad.any()):
            raise ValueError(f"slot_mapping values must be -1 (skip) or lie in [0, {num_slots}), got "
                             f"{int(slot_mapping[bad][0])}")
    tokens = slot_mapping.shape[0]
    num = bucket_size(tokens)
    # Clamped before narrowing: an int64 slot past the cache must not wrap into it (-1 and num_slots are skipped).
    slots = pad_rows(slot_mapping.clamp(-1, num_slots).to(torch.int32), num, value=-1)
    # key's and value's rows past the slots (a caller's padding) are dropped here; the bucket's
    # padding rows get slot -1.
    new_k, new_v = write_op(pad_rows(key[:tokens], num), pad_rows(value[:tokens], num), key_cache, value_cache,
                            slots, kv_scales, cache_layout == "head_major")
    rebind(key_cache, new_k)
    rebind(value_cache, new_v)
