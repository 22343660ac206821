"""The torch layer: fla's `chunk_gated_delta_rule` arguments, checked with clear errors, one op per call.

Forward only: the op has no gradient yet (training Qwen3.5's linear-attention layers needs the
backward kernel, not written).
"""

from __future__ import annotations

import jax
import torch

from . import ops
from ._build import OP_NAMESPACE
from ._shared.bridge import check_same_device, check_tensor, jax_custom_op, values_on_host

FLOAT_DTYPES = (torch.float32, torch.bfloat16)


def _chunk_gated_delta_rule_jax(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, initial_state: jax.Array,
    cu_seqlens: jax.Array, scale: float, use_qk_l2norm_in_kernel: bool, *, interpret, generation,
) -> tuple[jax.Array, jax.Array]:
    # An empty initial_state or cu_seqlens stands for None (a torch op takes no optional tensors).
    o, final = ops.chunk_gated_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=initial_state if initial_state.size else None,
        output_final_state=True, cu_seqlens=cu_seqlens if cu_seqlens.size else None,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, interpret=interpret)
    return o, final


chunk_gated_delta_rule_op = jax_custom_op(f"{OP_NAMESPACE}::chunk_gated_delta_rule", _chunk_gated_delta_rule_jax)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, **kwargs):
    """The gated delta rule over whole or packed sequences, with fla's arguments and layout.

    q, k [B, T, Hk, dk]; v [B, T, Hv, dv] (Hk divides Hv: value head h reads q/k head
    h // (Hv // Hk)); g (log decay, <= 0) and beta [B, T, Hv]; initial_state [N, Hv, dk, dv];
    cu_seqlens int [N + 1] for N sequences packed in a batch of one. Returns (o [B, T, Hv, dv] in
    q's dtype, each sequence's final state [N, Hv, dk, dv] in fp32 or None unless
    output_final_state). Computed in fp32. Other keyword arguments (transformers passes its
    attention kwargs along) are ignored.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_tensor(name, t, 4 if name in "qkv" else 3, FLOAT_DTYPES)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"chunk_gated_delta_rule: {name} dtype {t.dtype} differs from q's {q.dtype}")
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
    o, final = chunk_gated_delta_rule_op(
        q, k, v, g, beta, empty if initial_state is None else initial_state,
        empty.to(torch.int32) if cu_seqlens is None else cu_seqlens.to(torch.int32),
        float(q.shape[-1] ** -0.5 if scale is None else scale), bool(use_qk_l2norm_in_kernel))
    return o, (final if output_final_state else None)
