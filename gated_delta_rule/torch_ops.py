"""The torch layer: fla's `chunk_gated_delta_rule` and `fused_recurrent_gated_delta_rule` arguments, checked
with clear errors, one op per call.

The chunked rule and the prefill convolution are differentiable (torch autograd runs the chunked
rule's backward kernel, and the convolution's gradient as XLA compiles it); the decode steps
(the recurrent rule, the convolution's update) are inference only.
"""

from __future__ import annotations

import functools
import types

import jax
import torch

from . import conv, ops
from ._build import OP_NAMESPACE
from ._shared.bridge import check_same_device, check_tensor, is_whole, jax_custom_op, rebind, values_on_host

FLOAT_DTYPES = (torch.float32, torch.bfloat16)


def _jax_entry(fn):
    def run(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, initial_state: jax.Array,
            cu_seqlens: jax.Array, scale: float, use_qk_l2norm_in_kernel: bool, *, interpret,
            generation) -> tuple[jax.Array, jax.Array]:
        # An empty initial_state or cu_seqlens stands for None (a torch op takes no optional tensors).
        return fn(q, k, v, g, beta, scale=scale, initial_state=initial_state if initial_state.size else None,
                  output_final_state=True, cu_seqlens=cu_seqlens if cu_seqlens.size else None,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, interpret=interpret)
    return run


chunk_op = jax_custom_op(f"{OP_NAMESPACE}::chunk_gated_delta_rule", _jax_entry(ops.chunk_gated_delta_rule),
                         differentiable=("q", "k", "v", "g", "beta", "initial_state"))
# The decode ops' JAX functions. initial_state kept (a view, bf16, or a torch.compile graph's
# input): a decode step writes the new states to a buffer of their own rather than XLA copying
# initial_state into the output first. In place: initial_state's buffer donated, the kernel updates
# the states in it (see fused_recurrent_gated_delta_rule).
recurrent_jax = _jax_entry(functools.partial(ops.fused_recurrent_gated_delta_rule, state_in_place=False))
recurrent_in_place_jax = _jax_entry(ops.fused_recurrent_gated_delta_rule)
recurrent_op = jax_custom_op(f"{OP_NAMESPACE}::fused_recurrent_gated_delta_rule", recurrent_jax)
recurrent_in_place_op = jax_custom_op(f"{OP_NAMESPACE}::fused_recurrent_gated_delta_rule_in_place",
                                      recurrent_in_place_jax, donate=("initial_state",))


def _call(op, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel):
    """(o, the final states), arguments checked before the op runs."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_tensor(name, t, 4 if name in "qkv" else 3, FLOAT_DTYPES)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from q's {q.dtype}")
    if initial_state is not None:
        check_tensor("initial_state", initial_state, 4, FLOAT_DTYPES)
    if cu_seqlens is not None:
        check_tensor("cu_seqlens", cu_seqlens, 1, (torch.int32, torch.int64))
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens)
    # cu_seqlens' dtype is checked above; its shape goes to the shared check as int32's.
    ops.check_shapes(q, k, v, g, beta, initial_state,
                     None if cu_seqlens is None else jax.ShapeDtypeStruct(tuple(cu_seqlens.shape), "int32"))
    if cu_seqlens is not None and values_on_host(cu_seqlens):
        ops.check_cu_seqlens(cu_seqlens.numpy(), q.shape[1])
    empty = q.new_empty(0, dtype=torch.float32)
    o, final = op(
        q, k, v, g, beta, empty if initial_state is None else initial_state,
        empty.to(torch.int32) if cu_seqlens is None else cu_seqlens.to(torch.int32),
        float(q.shape[-1] ** -0.5 if scale is None else scale), bool(use_qk_l2norm_in_kernel))
    return o, final


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, **kwargs):
    """The gated delta rule over whole or packed sequences, with fla's arguments and layout.

    q, k [B, T, Hk, dk]; v [B, T, Hv, dv] (Hk divides Hv: value head h reads q/k head
    h // (Hv // Hk)); g (log decay, <= 0) and beta [B, T, Hv]; initial_state [N, Hv, dk, dv];
    cu_seqlens int [N + 1] for N sequences packed in a batch of one. Returns (o [B, T, Hv, dv] in
    q's dtype, each sequence's final state [N, Hv, dk, dv] in fp32 or None unless
    output_final_state). Computed in fp32, chunk by chunk (prefill). Other keyword arguments
    (transformers passes its attention kwargs along) are ignored.
    """
    o, final = _call(chunk_op, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel)
    return o, (final if output_final_state else None)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                     cu_seqlens=None, use_qk_l2norm_in_kernel=False, **kwargs):
    """The same as `chunk_gated_delta_rule`, token by token: for decode steps (a token or a few
    per sequence), where chunks would pad each sequence to a chunk's length.

    An fp32 initial_state that owns its buffer is updated in place to the final states (and
    returned as them): on TPU its buffer is donated to the kernel, which writes the new states
    there, so a decode step neither copies the states first nor allocates new ones (transformers'
    cache then copies them onto themselves: nothing). A view, a bf16 state, or a call being
    traced by torch.compile (where a tensor's buffer cannot be swapped) leave it untouched: the
    new states come back in a buffer of their own (a decode step copies nothing first)."""
    # (Tracing asked first: torch.compile cannot trace is_whole's storage_offset.)
    in_place = (not torch.compiler.is_compiling() and initial_state is not None
                and initial_state.dtype == torch.float32 and is_whole(initial_state))
    o, final = _call(recurrent_in_place_op if in_place else recurrent_op, q, k, v, g, beta, scale, initial_state,
                     cu_seqlens, use_qk_l2norm_in_kernel)
    if in_place:
        rebind(initial_state, final)
        final = initial_state
    return o, (final if output_final_state else None)


def _conv_fn_jax(hidden_states: jax.Array, weight: jax.Array, bias: jax.Array, seq_idx: jax.Array,
                 activation: str, *, interpret, generation) -> jax.Array:
    # Empty bias or seq_idx, and "" for the activation, stand for None.
    return conv.causal_conv1d_fn(hidden_states, weight, bias if bias.size else None, activation or None,
                                 seq_idx if seq_idx.size else None)


def _conv_update_jax(hidden_states: jax.Array, conv_state: jax.Array, weight: jax.Array, bias: jax.Array,
                     activation: str, *, interpret, generation) -> tuple[jax.Array, jax.Array]:
    return conv.causal_conv1d_update(hidden_states, conv_state, weight, bias if bias.size else None, activation or None)


conv_fn_op = jax_custom_op(f"{OP_NAMESPACE}::causal_conv1d_fn", _conv_fn_jax,
                           differentiable=("hidden_states", "weight", "bias"))
conv_update_op = jax_custom_op(f"{OP_NAMESPACE}::causal_conv1d_update", _conv_update_jax)


def _conv_args(hidden_states, weight, bias, activation, **tensors):
    """Checked before any op runs: (bias, or an empty tensor for None; activation, or "" for None)."""
    check_tensor("hidden_states", hidden_states, 3, FLOAT_DTYPES)
    check_tensor("weight", weight, 2, FLOAT_DTYPES)
    if bias is not None:
        check_tensor("bias", bias, 1, FLOAT_DTYPES)
    conv.check_activation(activation)
    check_same_device(hidden_states=hidden_states, weight=weight, bias=bias, **tensors)
    return weight.new_empty(0) if bias is None else bias, activation or ""


def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, seq_idx=None, **kwargs):
    """The short causal depthwise convolution over whole sequences, as transformers' `causal_conv1d_fn`:
    hidden_states [B, D, T], weight [D, taps], bias [D] or None, activation None or "silu"; with
    seq_idx [B, T] (int: each token's sequence), no tap reads across a sequence's start. Computed in
    weight's dtype; returns [B, D, T] in hidden_states' dtype. Other keyword arguments are ignored."""
    if seq_idx is not None:
        check_tensor("seq_idx", seq_idx, 2, (torch.int32, torch.int64))
    bias, activation = _conv_args(hidden_states, weight, bias, activation, seq_idx=seq_idx)
    if seq_idx is not None:
        seq_idx = seq_idx.to(torch.int32)
    conv.check_shapes(hidden_states.shape, weight.shape, tuple(bias.shape) if bias.numel() else None,
                      None if seq_idx is None else tuple(seq_idx.shape))
    return conv_fn_op(hidden_states, weight, bias, hidden_states.new_empty(0, dtype=torch.int32)
                      if seq_idx is None else seq_idx, activation)


def causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None, **kwargs):
    """A decode step of the same convolution, as transformers' `causal_conv1d_update`: hidden_states
    [B, D, T] continue conv_state [B, D, S] (the last S inputs), which is updated in place to the new
    last S inputs. Returns [B, D, T] in hidden_states' dtype."""
    check_tensor("conv_state", conv_state, 3, FLOAT_DTYPES)
    bias, activation = _conv_args(hidden_states, weight, bias, activation, conv_state=conv_state)
    conv.check_shapes(hidden_states.shape, weight.shape, tuple(bias.shape) if bias.numel() else None,
                      conv_state=tuple(conv_state.shape))
    out, new_state = conv_update_op(hidden_states, conv_state, weight, bias, activation)
    conv_state.copy_(new_state)
    return out


class ChunkGatedDeltaRule(torch.nn.Module):
    """`chunk_gated_delta_rule` as the layer that kernels' `kernelize` puts in place of transformers'
    `torch_chunk_gated_delta_rule` (Qwen3.5's, Qwen3.5-MoE's and Qwen3-Next's prefill), mapped as
    `LayerRepository(repo_id, layer_name="chunk_gated_delta_rule", version=...)`.

    kernelize accepts a layer only if its forward takes transformers' arguments, as many and of the
    same kinds, so this forward has transformers' signature rather than fla's: `chunk_size` is
    ignored (the kernel's chunk is 64 tokens) and packed sequences' `cu_seqlens` come in kwargs. It
    runs bound to transformers' module (kernelize swaps the forward, not the module): no state here.
    """

    has_backward = True
    can_torch_compile = True  # a custom op with a fake implementation: torch.compile keeps one graph

    def forward(self, query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
        return chunk_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                      output_final_state=output_final_state,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)


class FusedRecurrentGatedDeltaRule(torch.nn.Module):
    """`fused_recurrent_gated_delta_rule` as the layer kernelize puts in place of transformers'
    `torch_recurrent_gated_delta_rule` (the decode step: one token with the cached state), mapped
    as `LayerRepository(repo_id, layer_name="fused_recurrent_gated_delta_rule", version=...)`;
    transformers' signature, as for `ChunkGatedDeltaRule`."""

    has_backward = False  # decode only: kernelize(mode=Mode.TRAINING) keeps transformers' torch code
    can_torch_compile = True

    def forward(self, query, key, value, g, beta, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
        return fused_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                                output_final_state=output_final_state,
                                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)


class CausalConv1dFn(torch.nn.Module):
    """`causal_conv1d_fn` as the layer kernelize puts in place of transformers' (prefill)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states, weight, bias=None, activation=None, **kwargs):
        return causal_conv1d_fn(hidden_states, weight, bias, activation, **kwargs)


class CausalConv1dUpdate(torch.nn.Module):
    """`causal_conv1d_update` as the layer kernelize puts in place of transformers' (decode)."""

    has_backward = False  # decode only
    can_torch_compile = True

    def forward(self, hidden_states, conv_state, weight, bias=None, activation=None):
        return causal_conv1d_update(hidden_states, conv_state, weight, bias, activation)


# What kernels' LayerRepository(layer_name=...) loads: `<kernel module>.layers.<layer_name>`.
layers = types.SimpleNamespace(chunk_gated_delta_rule=ChunkGatedDeltaRule,
                               fused_recurrent_gated_delta_rule=FusedRecurrentGatedDeltaRule,
                               causal_conv1d_fn=CausalConv1dFn, causal_conv1d_update=CausalConv1dUpdate)
