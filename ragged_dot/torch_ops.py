"""The thin torch layer: argument checks with clear errors, one op per call site."""

from __future__ import annotations

import jax
import numpy as np
import torch

from . import ops
from ._build import OP_NAMESPACE
from ._shared.bridge import (as_int32_index, check_same_device, check_tensor, jax_custom_op, torch_dtype_to_jax,
                             values_on_host)
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
# transformers' FP8 experts (FineGrainedFP8 checkpoints) gate by their config: gpt-oss's clamped
# SwiGLU when it has swiglu_alpha, the default gate when it has neither alpha nor limit.
FP8_EXPERTS_GATE = ("transformers.integrations.finegrained_fp8", "_apply_gate")


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
    up_scale: jax.Array,
    down_scale: jax.Array,
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
    none_if_empty = lambda x: None if x.size == 0 else x
    return ops.experts_forward(
        hidden_states, top_k_index, top_k_weights, up_proj, down_proj, up_bias, down_bias,
        activation=activation, gated=gated, interleaved=interleaved, transposed=transposed,
        alpha=alpha, limit=limit, up_scale=none_if_empty(up_scale), down_scale=none_if_empty(down_scale),
        generation=generation, interpret=interpret,
    )


ragged_dot_op = jax_custom_op(
    f"{OP_NAMESPACE}::ragged_dot", _ragged_dot_jax, differentiable=("lhs", "rhs")
)
experts_forward_op = jax_custom_op(
    f"{OP_NAMESPACE}::experts_forward",
    _experts_forward_jax,
    differentiable=("hidden_states", "top_k_weights", "up_proj", "down_proj", "up_bias", "down_bias"),
)
# Quantized experts are frozen: no gradient for their weights or scales.
quantized_experts_forward_op = jax_custom_op(
    f"{OP_NAMESPACE}::quantized_experts_forward",
    _experts_forward_jax,
    differentiable=("hidden_states", "top_k_weights", "up_bias", "down_bias"),
)
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)
# as transformers' FP8 experts name a weight's scales (weight times them); int4 experts
# (quantize_experts) name their float32 group scales so too
SCALE_SUFFIX = "_scale_inv"
# MXFP4 experts (mxfp4_checkpoint_config): uint8 weights, two fp4 codes per byte, with their e8m0
# exponents `<weight>_scales` (ops.mxfp4_weights' layout).
MXFP4_SCALE_SUFFIX = "_scales"
MXFP4_SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)


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
    if gated and gate_name == FP8_EXPERTS_GATE:
        if self.swiglu_alpha is not None:
            if self.swiglu_limit is None:  # transformers' own gate cannot run it either (a clamp of None)
                raise _unsupported(self, "swiglu_alpha without swiglu_limit")
            return dict(layout, activation=ops.CLAMPED_SWIGLU, alpha=float(self.swiglu_alpha),
                        limit=float(self.swiglu_limit))
        if self.limit is not None:
            raise _unsupported(self, "swiglu_limit without swiglu_alpha (a clamp before its activation)")
        gate_name = DEFAULT_GATE
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
    biases, its activation or gpt-oss's clamped SwiGLU; quantized weights
    (int8 or float8_e4m3fn, or int4 two per uint8, see `quantize_experts`) with their float32
    scales `<weight>_scale_inv`, or MXFP4 (uint8, see `mxfp4_checkpoint_config`) with
    their e8m0 exponents `<weight>_scales`. Expert id E in top_k_index marks a token routed to
    another expert-parallel shard; it costs nothing and contributes zero.
    One op per layer, differentiable (quantized weights are frozen).
    """
    layout = _experts_layout(self)
    up_name = "gate_up_proj" if layout["gated"] else "up_proj"
    up, down = getattr(self, up_name), self.down_proj
    if getattr(self, "has_bias", False):
        up_bias, down_bias = getattr(self, up_name + "_bias"), self.down_proj_bias
    else:
        up_bias = down_bias = hidden_states.new_empty(0)
    packed = torch.uint8 in (up.dtype, down.dtype)  # 4-bit: MXFP4 (with `_scales`) or int4 (`_scale_inv`)
    quantized = packed or up.dtype in QUANTIZED_DTYPES or down.dtype in QUANTIZED_DTYPES
    mxfp4 = packed and getattr(self, up_name + MXFP4_SCALE_SUFFIX, None) is not None
    suffix = MXFP4_SCALE_SUFFIX if mxfp4 else SCALE_SUFFIX
    up_scale, down_scale = (getattr(self, name + suffix, None) for name in (up_name, "down_proj"))
    if quantized and (up_scale is None or down_scale is None):
        raise ValueError(f"{type(self).__name__}: {up_name} is {up.dtype} and down_proj {down.dtype}: quantized "
                         f"experts need {up_name}{suffix} and down_proj{suffix} "
                         f"({'mxfp4_checkpoint_config' if mxfp4 else 'quantize_experts'})")
    weight_dtypes = (torch.uint8,) if packed else QUANTIZED_DTYPES if quantized else FLOAT_DTYPES
    tensors = {"hidden_states": hidden_states, "top_k_index": top_k_index, "top_k_weights": top_k_weights,
               up_name: up, "down_proj": down, up_name + "_bias": up_bias, "down_proj_bias": down_bias}
    if quantized:
        tensors.update({up_name + suffix: up_scale, "down_proj" + suffix: down_scale})
    for name, tensor in tensors.items():
        dtypes = {"top_k_index": None, "top_k_weights": FLOAT_DTYPES + (torch.float16,), up_name: weight_dtypes,
                  "down_proj": weight_dtypes, up_name + MXFP4_SCALE_SUFFIX: MXFP4_SCALE_DTYPES,
                  "down_proj" + MXFP4_SCALE_SUFFIX: MXFP4_SCALE_DTYPES}.get(name, FLOAT_DTYPES)
        check_tensor(name, tensor, None, dtypes)
    ops.check_experts_shapes(hidden_states.shape, top_k_index.shape, top_k_weights.shape, up.shape, down.shape,
                             up_bias.shape, down_bias.shape, gated=layout["gated"], transposed=layout["transposed"],
                             packed=packed)
    check_same_device(**tensors)
    must_match = (up_name + "_bias", "down_proj_bias") + (() if quantized else (up_name, "down_proj"))
    for name in must_match:
        if tensors[name].dtype != hidden_states.dtype:
            raise TypeError(f"{name} dtype {tensors[name].dtype} must match hidden_states' dtype {hidden_states.dtype}")
    if quantized:  # scales' shapes and dtypes, named as the module holds them
        spec = lambda t: jax.ShapeDtypeStruct(tuple(t.shape), torch_dtype_to_jax(t.dtype))
        for weight, scale, names in ((up, up_scale, ("hidden_states", up_name, up_name + suffix)),
                                     (down, down_scale, ("hidden_states", "down_proj", "down_proj" + suffix))):
            ops.check_rhs_scale(torch_dtype_to_jax(hidden_states.dtype), spec(weight), spec(scale),
                                not layout["transposed"], names)
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
    op, scales = (quantized_experts_forward_op, (up_scale, down_scale)) if quantized else \
        (experts_forward_op, (hidden_states.new_empty(0, dtype=torch.float32),) * 2)
    out = op(
        hidden_states, index, top_k_weights, up, down, up_bias, down_bias, *scales,
        layout["activation"], layout["gated"], layout["interleaved"], layout["transposed"],
        layout["alpha"], layout["limit"],
    )
    return out[:tokens] if pad else out


_QUANTIZED_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def _int4_experts(weight: torch.Tensor, out_axis: int, group_size: int, name: str):
    """An experts weight ([E, N, K] with out_axis 1, else [E, K, N]) -> (uint8 [E, K / 2, N],
    float32 [E, K / group_size, N]) on its device, by `ops.quantize_int4` (run on the host's CPU)."""
    k = weight.shape[3 - out_axis]
    if group_size not in ops.INT4_GROUPS or k % group_size:
        raise ValueError(f"{name}: group_size must be one of {ops.INT4_GROUPS} and divide its contraction ({k}), "
                         f"got {group_size}")
    k_major = weight.detach().transpose(1, 2) if out_axis == 1 else weight.detach()
    with jax.default_device(jax.devices("cpu")[0]):
        packed, scale = ops.quantize_int4(jax.numpy.asarray(k_major.float().cpu().numpy()), group_size)
        packed, scale = (torch.from_numpy(np.asarray(x).copy()).to(weight.device) for x in (packed, scale))
    return packed, scale


def _experts_modules(model: torch.nn.Module):
    """(module, its weights' names: gate_up_proj or up_proj, then down_proj) of every experts module."""
    for module in model.modules():
        names = [n for n in ("gate_up_proj", "up_proj", "down_proj") if isinstance(getattr(module, n, None), torch.nn.Parameter)]
        if "down_proj" in names and len(names) == 2 and getattr(module, "down_proj").ndim == 3:
            yield module, names  # (a dense MLP's down_proj is a Linear)


def _padded_down(down_proj: torch.Tensor) -> torch.Tensor:
    """down_proj [E, A, B] zero-padded to multiples of ops.DOWN_PAD in A and B: a TPU holds it
    experts-major then (with both unaligned, experts-minor: copied or read whole every call)."""
    _, a, b = ops.padded_down_shape(down_proj.shape)
    pads = (0, b - down_proj.shape[2], 0, a - down_proj.shape[1])  # the last dim first, as F.pad takes them
    return torch.nn.functional.pad(down_proj, pads) if any(pads) else down_proj


@torch.no_grad()
def pad_experts(model: torch.nn.Module) -> int:
    """Zero-pads every experts module's down_proj in place to multiples of 128 in its hidden and
    intermediate dims, for `experts_forward` on a TPU. A TPU holds Gemma 4 26B-A4B's
    [128, 2112, 704] (both dims unaligned) experts-minor, which no per-expert kernel reads in
    place: a decode step then reads every expert's down_proj in one XLA matmul. Padded, libtpu
    holds it experts-major and the kernel reads only the routed experts' weights. Gradients flow
    as before (the padding's are zero). Afterwards down_proj fits only `experts_forward` (not
    transformers' own experts implementations, nor a checkpoint's shapes). Returns how many
    modules were padded (none where both dims are multiples of 128 already)."""
    count = 0
    for module, _ in _experts_modules(model):
        down = module.down_proj
        if not down.is_floating_point():
            raise ValueError(f"{type(module).__name__}.down_proj is {down.dtype}: pad_experts pads floating-point "
                             "experts (quantize_experts pads the weights it quantizes)")
        padded = _padded_down(down.detach())
        if padded.shape != down.shape:
            module.down_proj = torch.nn.Parameter(padded, requires_grad=down.requires_grad)
            count += 1
    return count


@torch.no_grad()
def quantize_experts(model: torch.nn.Module, dtype: torch.dtype = torch.int8, group_size: int = 128) -> int:
    """Quantizes every experts module of `model` in place, for `experts_forward`: each expert's
    gate_up_proj (or up_proj) and down_proj become `dtype` (int8 or float8_e4m3fn) with a float32
    scale per expert and output channel, `<weight>_scale_inv` (the weight is the quantized one
    times it), symmetric: the channel's largest magnitude maps to the dtype's largest. The weights
    then take a byte each and are frozen. torch.int4: a float32 scale per `group_size` weights
    along the contraction and output channel (`ops.quantize_int4`), two codes per uint8, held
    K-major as the kernel reads them (the module is then `is_transposed`); half a byte per weight.
    down_proj's hidden and intermediate dims are zero-padded to multiples of 128: a TPU holds it
    with both unaligned (Gemma 4's 2112 and 704) experts-minor, which the kernel could only read
    through a copy of the whole tensor every call. Returns how many modules were quantized."""
    if dtype not in _QUANTIZED_MAX and dtype != torch.int4:
        raise ValueError(f"dtype must be one of {list(_QUANTIZED_MAX) + [torch.int4]}, got {dtype}")
    count = 0
    for module, names in _experts_modules(model):
        out_axis = 2 if getattr(module, "is_transposed", False) else 1
        for name in names:
            if not getattr(module, name).is_floating_point():
                raise ValueError(f"{type(module).__name__}.{name} is {getattr(module, name).dtype}: quantize_experts "
                                 "quantizes floating-point experts (these are quantized already)")
        weights = {name: getattr(module, name).detach().float() for name in names}
        weights["down_proj"] = _padded_down(weights["down_proj"])
        if dtype == torch.int4:
            for name in names:
                packed, scale = _int4_experts(weights[name], out_axis, group_size, f"{type(module).__name__}.{name}")
                setattr(module, name, torch.nn.Parameter(packed, requires_grad=False))
                setattr(module, name + SCALE_SUFFIX, torch.nn.Parameter(scale, requires_grad=False))
            module.is_transposed = True  # K-major, as the kernel reads 4-bit weights
            count += 1
            continue
        for name in names:
            weight = weights[name]
            # An all-zero channel keeps a normal scale (and quantizes to zeros).
            scale = (weight.abs().amax(dim=3 - out_axis) / _QUANTIZED_MAX[dtype]).clamp(min=torch.finfo(torch.float32).tiny)
            q = weight / scale.unsqueeze(3 - out_axis)
            q = q.round().clamp(-127, 127).to(dtype) if dtype == torch.int8 else q.to(dtype)
            setattr(module, name, torch.nn.Parameter(q, requires_grad=False))
            setattr(module, name + SCALE_SUFFIX, torch.nn.Parameter(scale, requires_grad=False))
        count += 1
    return count
