"""The thin torch layer: argument checks with clear errors, one op per call site."""

from __future__ import annotations

import jax
import torch

from . import ops
from ._build import OP_NAMESPACE
from ._shared.bridge import as_int32_index, jax_custom_op
from ._shared.tuning import bucket_size

FLOAT_DTYPES = (torch.float32, torch.bfloat16)

# Activation modules known to compute x * sigmoid(x), by (module, class):
# matched by name so importing this kernel does not import transformers.
SILU_CLASSES = {("torch.nn.modules.activation", "SiLU"), ("transformers.activations", "SiLUActivation")}


def _ragged_dot_jax(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, transpose_rhs: bool, *, interpret, generation
) -> jax.Array:
    return ops.ragged_dot(
        lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, generation=generation, interpret=interpret
    )


def _experts_forward_jax(
    hidden_states: jax.Array,
    top_k_index: jax.Array,
    top_k_weights: jax.Array,
    gate_up_proj: jax.Array,
    down_proj: jax.Array,
    *,
    interpret,
    generation,
) -> jax.Array:
    return ops.experts_forward(
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
        generation=generation, interpret=interpret,
    )


ragged_dot_op = jax_custom_op(
    f"{OP_NAMESPACE}::ragged_dot", _ragged_dot_jax, differentiable=("lhs", "rhs")
)
experts_forward_op = jax_custom_op(
    f"{OP_NAMESPACE}::experts_forward",
    _experts_forward_jax,
    differentiable=("hidden_states", "top_k_weights", "gate_up_proj", "down_proj"),
)


def _check_tensor(name, tensor, dtypes=FLOAT_DTYPES):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if dtypes is not None and tensor.dtype not in dtypes:
        raise TypeError(f"{name} must be one of {[str(d) for d in dtypes]}, got {tensor.dtype}")


def _check_same_device(**tensors):
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must be on one device, got {devices}")


def ragged_dot(
    lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, *, transpose_rhs: bool = False
) -> torch.Tensor:
    """Grouped matmul: rows of `lhs` are sorted by group; the first
    group_sizes[0] rows are multiplied by rhs[0], the next by rhs[1], ...

    lhs [M, K]; rhs [G, K, N] (or [G, N, K] with transpose_rhs, how
    transformers stores expert weights: no transposed copy is made);
    group_sizes [G] int32/int64 with non-negative values summing to at most
    M. Returns [M, N] in lhs's dtype (fp32 accumulation); rows past
    sum(group_sizes) are zero. Differentiable in lhs and rhs.
    """
    _check_tensor("lhs", lhs)
    _check_tensor("rhs", rhs)
    _check_tensor("group_sizes", group_sizes, dtypes=None)
    if rhs.dtype != lhs.dtype:
        raise TypeError(f"rhs dtype {rhs.dtype} differs from lhs dtype {lhs.dtype}")
    _check_same_device(lhs=lhs, rhs=rhs, group_sizes=group_sizes)
    ops.check_ragged_dot_shapes(lhs.shape, rhs.shape, group_sizes.shape, transpose_rhs)
    m = lhs.shape[0]
    group_sizes = as_int32_index(group_sizes, "group_sizes", 0, m)
    if not torch.compiler.is_compiling() and int(group_sizes.sum()) > m:
        raise ValueError(f"group_sizes sum to {int(group_sizes.sum())}, more than lhs's {m} rows")
    # Rows past sum(group_sizes) cost no matmul, so padding M to a bucket is
    # cheap and bounds the shapes (compiles) the op sees.
    padded = bucket_size(m)
    out = ragged_dot_op(torch.nn.functional.pad(lhs, (0, 0, 0, padded - m)), rhs, group_sizes, transpose_rhs)
    return out[:m] if padded != m else out


def _unsupported(self, what):
    return NotImplementedError(
        f"ragged-dot-tpu experts_forward does not support {type(self).__name__} with {what}; "
        "supported: gate_up_proj [E, 2I, H] (gate then up), down_proj [E, H, I], SiLU, no bias"
    )


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The transformers experts forward; register it with
    `ALL_EXPERTS_FUNCTIONS.register(name, kernel.experts_forward)`.

    Layout: gate_up_proj [E, 2I, H] (gate then up), down_proj [E, H, I],
    SiLU, no bias (Qwen3-MoE, Mixtral, OLMoE, Qwen3.5-MoE). Expert id E in
    top_k_index marks a token routed to another expert-parallel shard; it
    contributes zero. One op per layer, differentiable.
    """
    if not getattr(self, "has_gate", True):
        raise _unsupported(self, "has_gate=False")
    if getattr(self, "has_bias", False):
        raise _unsupported(self, "has_bias=True")
    if getattr(self, "is_transposed", False):
        raise _unsupported(self, "is_transposed=True")
    if not getattr(self, "is_concatenated", True):
        raise _unsupported(self, "interleaved gate/up (is_concatenated=False)")
    act = getattr(self, "act_fn", None)
    if (type(act).__module__, type(act).__name__) not in SILU_CLASSES:
        raise _unsupported(self, f"activation {type(act).__name__}")
    gate_up, down = self.gate_up_proj, self.down_proj
    _check_tensor("hidden_states", hidden_states)
    _check_tensor("gate_up_proj", gate_up)
    _check_tensor("down_proj", down)
    _check_tensor("top_k_weights", top_k_weights, dtypes=FLOAT_DTYPES + (torch.float16,))
    _check_tensor("top_k_index", top_k_index, dtypes=None)
    ops.check_experts_shapes(hidden_states.shape, top_k_index.shape, top_k_weights.shape, gate_up.shape, down.shape)
    num_experts = gate_up.shape[0]
    _check_same_device(hidden_states=hidden_states, top_k_index=top_k_index, top_k_weights=top_k_weights,
                       gate_up_proj=gate_up, down_proj=down)
    if gate_up.dtype != hidden_states.dtype or down.dtype != hidden_states.dtype:
        raise TypeError(
            f"expert weights ({gate_up.dtype}, {down.dtype}) must match hidden_states' dtype {hidden_states.dtype}"
        )
    index = as_int32_index(top_k_index, "top_k_index", 0, num_experts)
    # Pad tokens to a bucket (bounded compiles). Padding tokens are routed to
    # the sentinel expert with weight 0: the kernel spends no matmul on them.
    tokens = hidden_states.shape[0]
    pad = bucket_size(tokens) - tokens
    if pad:
        hidden_states = torch.nn.functional.pad(hidden_states, (0, 0, 0, pad))
        index = torch.nn.functional.pad(index, (0, 0, 0, pad), value=num_experts)
        top_k_weights = torch.nn.functional.pad(top_k_weights, (0, 0, 0, pad))
    out = experts_forward_op(hidden_states, index, top_k_weights, gate_up, down)
    return out[:tokens] if pad else out
