"""Plain-JAX definitions of what the kernels compute. Tests compare against these."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_groups(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """Group id of each row; rows past sum(group_sizes) get G (no group)."""
    ends = jnp.cumsum(group_sizes)
    return jnp.searchsorted(ends, jnp.arange(num_rows), side="right")


def ragged_dot(lhs, rhs, group_sizes, *, transpose_rhs=False, out_dtype=None):
    """jax.lax.ragged_dot semantics, computed densely in fp32 (exact reference).

    out[i] = lhs[i] @ rhs[g(i)] for rows i inside group g(i); rows past
    sum(group_sizes) are zero.
    """
    out_dtype = out_dtype or lhs.dtype
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    groups = row_groups(group_sizes, lhs.shape[0])
    in_group = groups < rhs.shape[0]
    weights = rhs[jnp.minimum(groups, rhs.shape[0] - 1)].astype(jnp.float32)
    out = jnp.einsum(
        "mk,mkn->mn", lhs.astype(jnp.float32), weights, precision=jax.lax.Precision.HIGHEST
    )
    return jnp.where(in_group[:, None], out, 0).astype(out_dtype)


def experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj):
    """Transformers' eager experts forward for gate_up [E, 2I, H], down [E, H, I], SiLU.

    Per (token, slot): y = down[e] @ (silu(gate) * up), weighted and summed
    over slots in fp32. Expert id E (expert-parallel sentinel) contributes 0.
    """
    num_experts = gate_up_proj.shape[0]
    x = hidden_states.astype(jnp.float32)
    valid = top_k_index < num_experts
    e = jnp.where(valid, top_k_index, 0)
    gate_up = jnp.einsum("th,tkoh->tko", x, gate_up_proj[e].astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    act = jax.nn.silu(gate) * up
    y = jnp.einsum("tki,tkhi->tkh", act, down_proj[e].astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    w = jnp.where(valid, top_k_weights.astype(jnp.float32), 0)
    return jnp.sum(y * w[..., None], axis=1).astype(hidden_states.dtype)


def weight_grad(a, b, group_sizes, out_dtype=None):
    """out[g] = a[rows of g]^T @ b[rows of g] ([G, P, Q]), in fp32; empty groups are 0."""
    groups = row_groups(group_sizes, a.shape[0])
    one_hot = (groups[:, None] == jnp.arange(group_sizes.shape[0])[None, :]).astype(jnp.float32)
    out = jnp.einsum("mp,mq,mg->gpq", a.astype(jnp.float32), b.astype(jnp.float32), one_hot,
                     precision=jax.lax.Precision.HIGHEST)
    return out.astype(out_dtype or a.dtype)
