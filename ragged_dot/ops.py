"""The JAX functions behind the torch ops; JAX users can call them directly.

`ragged_dot` is differentiable (`jax.custom_vjp`): the activations'
gradient is the same Pallas kernel with the weights' layout flipped; the
weights' gradient is, for now, XLA's ragged dot with a ragged contracting
dimension (the Pallas `tgmm` kernel is issue 3).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ._shared.generations import current_generation
from ._shared.tuning import round_up
from .kernel import grouped_matmul
from .tuning import choose_blocks


def default_interpret():
    """Pallas runs compiled on a TPU and in interpret mode anywhere else."""
    return jax.devices()[0].platform != "tpu"


def _resolve(generation, interpret):
    generation = generation or current_generation().name
    interpret = default_interpret() if interpret is None else interpret
    return generation, interpret


def _forward(lhs, rhs, group_sizes, transpose_rhs, generation, interpret):
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if m == 0:
        return jnp.zeros((0, n), lhs.dtype)
    blocks = choose_blocks(m, k, n, num_groups, generation)
    padded = round_up(m, blocks.block_m)
    lhs_padded = jnp.pad(lhs, ((0, padded - m), (0, 0))) if padded != m else lhs
    out = grouped_matmul(
        lhs_padded, rhs, group_sizes.astype(jnp.int32),
        blocks=blocks, transpose_rhs=transpose_rhs, out_dtype=lhs.dtype, interpret=interpret,
    )
    return out[:m]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ragged_dot(lhs, rhs, group_sizes, transpose_rhs, generation, interpret):
    return _forward(lhs, rhs, group_sizes, transpose_rhs, generation, interpret)


def _ragged_dot_fwd(lhs, rhs, group_sizes, transpose_rhs, generation, interpret):
    out = _forward(lhs, rhs, group_sizes, transpose_rhs, generation, interpret)
    return out, (lhs, rhs, group_sizes)


def _ragged_dot_bwd(transpose_rhs, generation, interpret, residuals, grad_out):
    lhs, rhs, group_sizes = residuals
    grad_out = grad_out.astype(lhs.dtype)
    # d lhs[rows of g] = grad_out[rows] @ rhs[g]^T: the same kernel, layout flipped.
    grad_lhs = _forward(grad_out, rhs, group_sizes, not transpose_rhs, generation, interpret)
    # d rhs[g] = lhs[rows of g]^T @ grad_out[rows] (or its transpose).
    a, b = (grad_out, lhs) if transpose_rhs else (lhs, grad_out)
    grad_rhs = jax.lax.ragged_dot_general(
        a, b, group_sizes.astype(jnp.int32),
        jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((0,), (0,)), ((), ())),
            lhs_ragged_dimensions=[0],
            rhs_group_dimensions=[],
        ),
        preferred_element_type=jnp.float32,
    ).astype(rhs.dtype)
    return grad_lhs, grad_rhs, None


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


def _shape_of(name, shape, ndim):
    shape = tuple(shape)
    if len(shape) != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {shape}")
    return shape


def check_ragged_dot_shapes(lhs, rhs, group_sizes, transpose_rhs):
    """Shape checks shared by the JAX and torch entry points (shapes only)."""
    m, k = _shape_of("lhs", lhs, 2)
    rhs = _shape_of("rhs", rhs, 3)
    (groups,) = _shape_of("group_sizes", group_sizes, 1)
    if rhs[2 if transpose_rhs else 1] != k:
        raise ValueError(f"rhs {rhs} (transpose_rhs={transpose_rhs}) does not contract with lhs {(m, k)}")
    if groups != rhs[0]:
        raise ValueError(f"group_sizes has {groups} groups, rhs has {rhs[0]}")


def check_experts_shapes(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj):
    tokens, hidden = _shape_of("hidden_states", hidden_states, 2)
    experts, two_i, gate_up_hidden = _shape_of("gate_up_proj", gate_up_proj, 3)
    down = _shape_of("down_proj", down_proj, 3)
    index = _shape_of("top_k_index", top_k_index, 2)
    weights = _shape_of("top_k_weights", top_k_weights, 2)
    if gate_up_hidden != hidden or two_i % 2:
        raise ValueError(f"gate_up_proj {(experts, two_i, gate_up_hidden)} does not fit hidden_states {(tokens, hidden)}")
    if down != (experts, hidden, two_i // 2):
        raise ValueError(f"down_proj {down} should be {(experts, hidden, two_i // 2)}")
    if index != weights or index[0] != tokens:
        raise ValueError(f"top_k_index {index} and top_k_weights {weights} must both be [T, k] with T = {tokens}")


def ragged_dot(lhs, rhs, group_sizes, *, transpose_rhs=False, generation=None, interpret=None):
    """Grouped matmul with `jax.lax.ragged_dot` semantics.

    Args:
      lhs: [M, K], rows sorted by group.
      rhs: [G, K, N], or [G, N, K] with transpose_rhs (transformers' layout).
      group_sizes: int32 [G], rows per group, summing to at most M.
      generation: TPU generation whose block table to use ("v5e", "v5p",
        "v6e", "tpu7x"); default: the current device's.
      interpret: False compiles for the TPU; True or a
        `pltpu.InterpretParams` interprets (default: True off-TPU).

    Returns [M, N] in lhs's dtype (accumulated in fp32); rows past
    sum(group_sizes) are zero.
    """
    check_ragged_dot_shapes(lhs.shape, rhs.shape, group_sizes.shape, transpose_rhs)
    generation, interpret = _resolve(generation, interpret)
    return _ragged_dot(lhs, rhs, group_sizes, transpose_rhs, generation, interpret)


def route(top_k_index, num_experts):
    """Sorts (token, slot) pairs by expert.

    Returns (order, group_sizes): `order[r]` is the flat (token * k + slot)
    index of sorted row r; the expert-parallel sentinel id `num_experts`
    sorts last and is in no group, so its rows are never computed.
    """
    flat = top_k_index.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts + 1)[:num_experts]
    return order, group_sizes.astype(jnp.int32)


def experts_forward(
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
    *, generation=None, interpret=None,
):
    """Transformers' experts forward (gate_up [E, 2I, H] gate-then-up, down
    [E, H, I], SiLU, no bias) as two grouped matmuls.

    hidden_states [T, H], top_k_index int32 [T, k] (id E: routed to another
    shard, contributes zero), top_k_weights [T, k]. Returns [T, H].
    """
    check_experts_shapes(hidden_states.shape, top_k_index.shape, top_k_weights.shape,
                         gate_up_proj.shape, down_proj.shape)
    generation, interpret = _resolve(generation, interpret)
    num_tokens, top_k = top_k_index.shape
    num_experts = gate_up_proj.shape[0]
    order, group_sizes = route(top_k_index, num_experts)
    token_of_row = order // top_k
    x = hidden_states[token_of_row]
    gate_up = _ragged_dot(x, gate_up_proj, group_sizes, True, generation, interpret)
    gate, up = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
    act = (jax.nn.silu(gate) * up).astype(hidden_states.dtype)
    y = _ragged_dot(act, down_proj, group_sizes, True, generation, interpret)
    # Sentinel rows are zero already; zeroing their weight keeps it that way.
    routed_here = top_k_index.reshape(-1)[order] < num_experts
    weight = jnp.where(routed_here, top_k_weights.reshape(-1)[order].astype(jnp.float32), 0)
    weighted = y.astype(jnp.float32) * weight[:, None]
    unsorted = jnp.zeros_like(weighted).at[order].set(weighted)
    out = unsorted.reshape(num_tokens, top_k, -1).sum(axis=1)
    return out.astype(hidden_states.dtype)
