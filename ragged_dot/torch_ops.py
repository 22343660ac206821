"""The thin torch layer: argument checks with clear errors, one op per call site."""

from __future__ import annotations

import jax
import torch

from . import ops
from ._build import OP_NAMESPACE
from ._shared.bridge import as_int32_index, check_same_device, check_tensor, jax_custom_op, values_on_host
from ._shared.tuning import bucket_size

FLOAT_DTYPES = (torch.float32, torch.bfloat16)

# Activation modules we know, by (module, class) -> ops.ACTIVATIONS name;
# matched by name so importing this kernel does not import transformers.
ACTIVATION_CLASSES = {
    ("torch.nn.modules.activation", "SiLU"): "silu",
    ("transformers.activations", "SiLUActivation"): "silu",
    ("torch.nn.modules.activation", "ReLU"): "relu",
    ("transformers.activations", "ReLUSquaredActivation"): "relu2",
    ("transformers.activations", "GELUTanh"): "gelu_tanh",
    ("transformers.activations", "PytorchGELUTanh"): "gelu_tanh",
    ("transformers.activations", "GELUActivation"): "gelu",
}
# Gates are named by (module, function name): torch.compile cannot trace `__qualname__`.
# Experts classes whose own _apply_gate we implement -> (gate, attributes read).
CUSTOM_GATES = {("transformers.models.gpt_oss.modeling_gpt_oss", "_apply_gate"): (ops.CLAMPED_SWIGLU, ("alpha", "limit"))}
DEFAULT_GATE = ("transformers.integrations.moe", "_default_apply_gate")


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
    up_proj: jax.Array,
    down_proj: jax.Array,
    up_bias: jax.Array,
    down_bias: jax.Array,
    activation: str,
    gated: bool,
    interleaved: bool,
    transposed: bool,
    alpha: float,
    limit: float,
    *,
    interpret,
    generation,
) -> jax.Array:
    return ops.experts_forward(
        hidden_states, top_k_index, top_k_weights, up_proj, down_proj, up_bias, down_bias,
        activation=activation, gated=gated, interleaved=interleaved, transposed=transposed,
        alpha=alpha, limit=limit, generation=generation, interpret=interpret,
    )


ragged_dot_op = jax_custom_op(
    f"{OP_NAMESPACE}::ragged_dot", _ragged_dot_jax, differentiable=("lhs", "rhs")
)
experts_forward_op = jax_custom_op(
    f"{OP_NAMESPACE}::experts_forward",
    _experts_forward_jax,
    differentiable=("hidden_states", "top_k_weights", "up_proj", "down_proj", "up_bias", "down_bias"),
)


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
    check_tensor("lhs", lhs, None, FLOAT_DTYPES)  # ranks: ops.check_ragged_dot_shapes, naming them too
    check_tensor("rhs", rhs, None, FLOAT_DTYPES)
    check_tensor("group_sizes", group_sizes, None, None)
    if rhs.dtype != lhs.dtype:
        raise TypeError(f"rhs dtype {rhs.dtype} differs from lhs dtype {lhs.dtype}")
    check_same_device(lhs=lhs, rhs=rhs, group_sizes=group_sizes)
    ops.check_ragged_dot_shapes(lhs.shape, rhs.shape, group_sizes.shape, transpose_rhs)
    m = lhs.shape[0]
    group_sizes = as_int32_index(group_sizes, "group_sizes", 0, m)
    # Rows past sum(group_sizes) cost no matmul, so padding M to a bucket is
    # cheap and bounds the shapes (compiles) the op sees.
    padded = bucket_size(m)
    if values_on_host(group_sizes):
        if int(group_sizes.sum(dtype=torch.int64)) > m:
            raise ValueError(f"group_sizes sum to {int(group_sizes.sum(dtype=torch.int64))}, more than lhs's {m} rows")
    elif padded != m:
        # The op's own check sees the bucket's rows: sizes summing past lhs's m rows but within the
        # bucket would read padding rows as data. Such sizes are made invalid (-1) on the device,
        # without a read on the host, so the output reports them as NaN.
        group_sizes = torch.where(group_sizes.sum(dtype=torch.int64) > m, -1, group_sizes)
    out = ragged_dot_op(torch.nn.functional.pad(lhs, (0, 0, 0, padded - m)), rhs, group_sizes, transpose_rhs)
    return out[:m] if padded != m else out


def _unsupported(self, what):
    return NotImplementedError(f"ragged-dot-tpu experts_forward does not support {type(self).__name__} with {what}")


def _experts_layout(self) -> dict:
    """The static description of an experts module, read from the flags and
    tensors transformers' `use_experts_implementation` sets."""
    if getattr(self, "has_post_expert_norm", False):
        raise _unsupported(self, "has_post_expert_norm=True")
    gated = getattr(self, "has_gate", True)
    layout = dict(gated=gated, interleaved=not getattr(self, "is_concatenated", True),
                  transposed=getattr(self, "is_transposed", False), alpha=0.0, limit=0.0)
    gate = getattr(type(self), "_apply_gate", None)
    gate_name = (gate.__module__, gate.__name__) if gate is not None else DEFAULT_GATE
    if gated and gate_name != DEFAULT_GATE:
        if gate_name not in CUSTOM_GATES:
            raise _unsupported(self, f"its own _apply_gate (from {gate_name[0]})")
        layout["activation"], attributes = CUSTOM_GATES[gate_name]
        layout.update({name: float(getattr(self, name)) for name in attributes})
        return layout
    act = getattr(self, "act_fn", None)
    key = (type(act).__module__, type(act).__name__)
    if key not in ACTIVATION_CLASSES:
        raise _unsupported(self, f"activation {type(act).__name__} (known: {sorted({c for _, c in ACTIVATION_CLASSES})})")
    layout["activation"] = ACTIVATION_CLASSES[key]
    return layout


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The transformers experts forward; register it with
    `ALL_EXPERTS_FUNCTIONS.register(name, kernel.experts_forward)`.

    Reads the layout from the module: gate_up_proj (gate then up, or
    interleaved) or up_proj without a gate, transposed or not, optional
    biases, its activation or gpt-oss's clamped SwiGLU. Expert id E in
    top_k_index marks a token routed to another expert-parallel shard; it
    costs nothing and contributes zero. One op per layer, differentiable.
    """
    layout = _experts_layout(self)
    up_name = "gate_up_proj" if layout["gated"] else "up_proj"
    up, down = getattr(self, up_name), self.down_proj
    if getattr(self, "has_bias", False):
        up_bias, down_bias = getattr(self, up_name + "_bias"), self.down_proj_bias
    else:
        up_bias = down_bias = up.new_empty(0)
    tensors = {"hidden_states": hidden_states, "top_k_index": top_k_index, "top_k_weights": top_k_weights,
               up_name: up, "down_proj": down, up_name + "_bias": up_bias, "down_proj_bias": down_bias}
    for name, tensor in tensors.items():
        dtypes = {"top_k_index": None, "top_k_weights": FLOAT_DTYPES + (torch.float16,)}.get(name, FLOAT_DTYPES)
        check_tensor(name, tensor, None, dtypes)
    ops.check_experts_shapes(hidden_states.shape, top_k_index.shape, top_k_weights.shape, up.shape, down.shape,
                             up_bias.shape, down_bias.shape, gated=layout["gated"], transposed=layout["transposed"])
    check_same_device(**tensors)
    for name in (up_name, "down_proj", up_name + "_bias", "down_proj_bias"):
        if tensors[name].dtype != hidden_states.dtype:
            raise TypeError(f"{name} dtype {tensors[name].dtype} must match hidden_states' dtype {hidden_states.dtype}")
    num_experts = up.shape[0]
    index = as_int32_index(top_k_index, "top_k_index", 0, num_experts)
    # Pad tokens to a bucket (bounded compiles). Padding tokens are routed to
    # the sentinel expert with weight 0: the kernel spends no matmul on them.
    tokens = hidden_states.shape[0]
    pad = bucket_size(tokens) - tokens
    if pad:
        hidden_states = torch.nn.functional.pad(hidden_states, (0, 0, 0, pad))
        index = torch.nn.functional.pad(index, (0, 0, 0, pad), value=num_experts)
        top_k_weights = torch.nn.functional.pad(top_k_weights, (0, 0, 0, pad))
    out = experts_forward_op(
        hidden_states, index, top_k_weights, up, down, up_bias, down_bias,
        layout["activation"], layout["gated"], layout["interleaved"], layout["transposed"],
        layout["alpha"], layout["limit"],
    )
    return out[:tokens] if pad else out
