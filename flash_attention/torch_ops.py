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
