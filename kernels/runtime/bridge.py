"""The torch-to-JAX bridge: one annotated JAX function becomes one torch op.

`jax_custom_op` turns a JAX function whose parameters are annotated
(`jax.Array` for tensors; `bool`, `int`, `float`, `str` for static values)
into a `torch.library.custom_op` that

- runs on CPU tensors through DLPack (zero copy for contiguous tensors),
  with Pallas in interpret mode;
- runs on TPU tensors through torch_tpu's `jax_op`, compiled by Mosaic;
- has a fake implementation derived from the JAX function itself
  (`jax.eval_shape`), so shapes have one source of truth;
- is differentiable in the arguments named `differentiable`: its backward
  is a second op running `jax.vjp` of the same function, so the gradient
  is whatever the JAX side defines (custom_vjp kernels included); or, given
  `backward`, a second op running that JAX function on the forward's
  inputs, outputs and cotangents (the forward then returns what its
  backward needs besides its result, and is not run again).

Every JAX function takes two trailing keyword-only parameters that the
bridge fills in and torch callers never see: `interpret` (True off-TPU)
and `generation` (the TPU generation whose block table to use).
"""

from __future__ import annotations

import functools
import inspect
import typing

import jax
import jax.numpy as jnp
import torch

from .generations import DEFAULT_GENERATION, generation_of_device_kind

BRIDGE_PARAMS = ("interpret", "generation")

# qualname of a differentiable op -> its backward op (for tests and tools).
BACKWARD_OPS: dict[str, typing.Any] = {}

_SCHEMA_TYPES = {bool: "bool", int: "int", float: "float", str: "str"}


def torch_dtype_to_jax(dtype: torch.dtype):
    return jnp.dtype(str(dtype).removeprefix("torch."))


def _jax_dtype_to_torch(dtype) -> torch.dtype:
    return getattr(torch, jnp.dtype(dtype).name)


def to_jax(tensor: torch.Tensor) -> jax.Array:
    """A CPU tensor as a JAX array, sharing memory when it is contiguous."""
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return jax.dlpack.from_dlpack(tensor)


def to_torch(array: jax.Array) -> torch.Tensor:
    return torch.from_dlpack(array)


def values_on_host(tensor: torch.Tensor) -> bool:
    """Whether a tensor's values may be read in Python: only where that costs no device round trip
    (a CPU tensor, outside torch.compile's tracing). Elsewhere (a TPU, eager by default and
    asynchronous) the kernels check index values on the device and report bad ones as NaN outputs."""
    return tensor.device.type == "cpu" and not torch.compiler.is_compiling()


def as_int32_index(tensor: torch.Tensor, name: str, low: int, high: int) -> torch.Tensor:
    """Index tensors reach JAX as int32 (JAX without x64 would narrow int64
    silently). Values must lie in [low, high]: checked here where
    `values_on_host`; elsewhere they are clamped to [low - 1, high + 1], so an
    out-of-range value (int64 past int32 included) stays out of range for the
    kernel's own check instead of wrapping into range."""
    if tensor.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {tensor.dtype}")
    if not values_on_host(tensor):
        return tensor.clamp(low - 1, high + 1).to(torch.int32)
    if tensor.numel():
        lo, hi = int(tensor.min()), int(tensor.max())
        if lo < low or hi > high:
            raise ValueError(f"{name} values must lie in [{low}, {high}], got range [{lo}, {hi}]")
    return tensor.to(torch.int32)


def check_tensor(name: str, t, rank: int | None, dtypes) -> None:
    """A torch.Tensor of `rank` dims and one of `dtypes` (None: either unchecked), else an error
    naming the argument."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if rank is not None and t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must be one of {[str(d).removeprefix('torch.') for d in dtypes]}, got {t.dtype}")


def check_same_device(**tensors) -> None:
    """All given tensors (None: absent) on one device, else an error listing them by name."""
    devices = {name: str(t.device) for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must be on one device, got {devices}")


def is_whole(t: torch.Tensor) -> bool:
    """Whether t owns its buffer (not a view of a larger tensor): only such a buffer can be donated
    to an op and become its output."""
    return t._base is None and not t.storage_offset() and t.is_contiguous()


def rebind(tensor: torch.Tensor, new: torch.Tensor) -> None:
    """Makes `tensor` hold `new`, the output of an op to which `tensor`'s buffer was donated. On
    TPU the op wrote its result in that buffer (input-output aliasing): the tensor is pointed at
    it, nothing is copied. On CPU (interpret mode, for tests) the result is copied in."""
    if tensor.device.type == "cpu":
        tensor.copy_(new)
    else:
        tensor.set_(new)


def pad_rows(x: torch.Tensor, num: int, value=0) -> torch.Tensor:
    """x with rows of `value` appended along dim 0 up to `num` rows (bucketed shapes)."""
    pad = [0, 0] * (x.dim() - 1) + [0, num - x.shape[0]]
    return torch.nn.functional.pad(x, pad, value=value) if num != x.shape[0] else x


def pad_offsets(cu: torch.Tensor, num: int) -> torch.Tensor:
    """Cumulative offsets extended to `num` entries with empty sequences (the last value repeated)."""
    return torch.cat([cu, cu[-1:].expand(num - cu.shape[0])]) if num != cu.shape[0] else cu


def tpu_generation() -> str:
    """The generation of the TPU that torch_tpu runs on, as JAX sees it."""
    return generation_of_device_kind(jax.devices("tpu")[0].device_kind).name


class _Signature:
    """The torch-visible part of an annotated JAX function's signature."""

    def __init__(self, jax_fn):
        sig = inspect.signature(jax_fn)
        hints = typing.get_type_hints(jax_fn)
        missing = [p for p in BRIDGE_PARAMS if p not in sig.parameters]
        if missing:
            raise TypeError(f"{jax_fn.__name__} must take keyword-only {missing}")
        self.params = [p for p in sig.parameters.values() if p.name not in BRIDGE_PARAMS]
        self.names = [p.name for p in self.params]
        self.types = {p.name: hints[p.name] for p in self.params}
        self.tensors = [n for n in self.names if self.types[n] is jax.Array]
        self.returns = hints["return"]
        self.returns_tuple = typing.get_origin(self.returns) is tuple

    def schema(self, names=None, types=None, returns=None) -> str:
        args = []
        types = types or self.types
        for name in names or self.names:
            kind = types[name]
            args.append(f"Tensor {name}" if kind is jax.Array else f"{_SCHEMA_TYPES[kind]} {name}")
        if returns is None:
            returns = "Tensor[]" if self.returns_tuple else "Tensor"
        return f"({', '.join(args)}) -> {returns}"


def _annotated(fn, names, types, returns):
    """Gives `fn(*args)` the annotated signature torch_tpu's jax_op requires."""
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=types[n]) for n in names]
    fn.__signature__ = inspect.Signature(params, return_annotation=returns)
    fn.__annotations__ = {**{n: types[n] for n in names}, "return": returns}
    return fn


class _Runner:
    """Runs one JAX function on torch tensors, on CPU or TPU."""

    def __init__(self, qualname: str, jax_fn, names, types, returns, donate=()):
        self.qualname = qualname
        self.donate_argnums = tuple(names.index(n) for n in donate)
        self.jax_fn = jax_fn
        self.names = names
        self.types = types
        self.returns = returns
        self.static = tuple(i for i, n in enumerate(names) if types[n] is not jax.Array)
        self._tpu_ops = {}

    @functools.cached_property
    def cpu_fn(self):
        fn = functools.partial(self.jax_fn, interpret=True, generation=DEFAULT_GENERATION)
        return jax.jit(fn, static_argnums=self.static)

    def tpu_fn(self, generation: str | None = None):
        """The torch_tpu `jax_op` for the TPU path, one per generation, made on
        first use (torch_tpu is imported lazily: CPU users never need it)."""
        generation = generation or tpu_generation()
        if generation not in self._tpu_ops:
            from torch_tpu._internal.pallas.pallas import jax_op

            jax_fn = self.jax_fn

            def on_tpu(*args):
                return jax_fn(*args, interpret=False, generation=generation)

            ns, name = self.qualname.split("::")
            annotated = _annotated(on_tpu, self.names, self.types, self.returns)
            self._tpu_ops[generation] = jax_op(f"{ns}::{name}_{generation}", annotated,
                                               donate_argnums=self.donate_argnums or None)
        return self._tpu_ops[generation]

    def __call__(self, *args):
        devices = {a.device.type for a in args if isinstance(a, torch.Tensor)}
        if len(devices) > 1:
            raise ValueError(f"{self.qualname}: tensors are on several devices: {sorted(devices)}")
        device = devices.pop() if devices else "cpu"
        if device == "cpu":
            out = self.cpu_fn(*(to_jax(a) if isinstance(a, torch.Tensor) else a for a in args))
            return [to_torch(o) for o in out] if isinstance(out, (tuple, list)) else to_torch(out)
        if device in ("tpu", "privateuseone"):
            out = self.tpu_fn()(*args)
            return list(out) if isinstance(out, tuple) else out
        raise ValueError(f"{self.qualname}: tensors on {device!r}; this kernel runs on TPU (and on CPU in interpret mode)")

    def fake(self, *args):
        """Output shapes from jax.eval_shape of the same function."""
        specs = [
            jax.ShapeDtypeStruct(tuple(a.shape), torch_dtype_to_jax(a.dtype)) if isinstance(a, torch.Tensor) else a
            for a in args
        ]
        statics = {i: specs[i] for i in self.static}
        dynamic = [s for i, s in enumerate(specs) if i not in statics]

        def call(*dyn):
            it = iter(dyn)
            full = [statics[i] if i in statics else next(it) for i in range(len(specs))]
            return self.jax_fn(*full, interpret=True, generation=DEFAULT_GENERATION)

        out = jax.eval_shape(call, *dynamic)
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        make = lambda s: torch.empty(s.shape, dtype=_jax_dtype_to_torch(s.dtype), device=device)
        return [make(o) for o in out] if isinstance(out, (tuple, list)) else make(out)


def jax_custom_op(qualname: str, jax_fn, *, differentiable: typing.Sequence[str] = (), backward=None,
                  donate: typing.Sequence[str] = ()):
    """Declares the torch op `qualname` ("namespace::name") backed by `jax_fn`.

    `donate` names tensor arguments whose TPU buffers the op may reuse for its
    outputs (jax_op's donation): after a TPU call they are invalid, and the
    caller rebinds them to the outputs. On CPU nothing is donated.
    Returns the op; call it with the JAX function's torch-visible arguments.
    `backward(*inputs, *outputs, *cotangents, interpret=, generation=)`, if
    given, returns the gradients of the `differentiable` arguments, in order.
    """
    sig = _Signature(jax_fn)
    forward = _Runner(qualname, jax_fn, sig.names, sig.types, sig.returns, donate)
    op = torch.library.custom_op(qualname, mutates_args=(), schema=sig.schema())(forward)
    op.register_fake(forward.fake)
    if differentiable:
        _register_vjp(op, qualname, jax_fn, sig, differentiable, backward)
    return op


def _register_vjp(op, qualname, jax_fn, sig, differentiable, backward_fn=None):
    """Backward = a second op: `backward_fn` on the inputs, outputs and
    cotangents, or else jax.vjp of the same JAX function (which runs it again)."""
    unknown = set(differentiable) - set(sig.tensors)
    if unknown:
        raise TypeError(f"{qualname}: differentiable {sorted(unknown)} are not tensor arguments")
    diff_positions = [sig.names.index(n) for n in differentiable]
    num_outputs = len(typing.get_args(sig.returns)) if sig.returns_tuple else 1
    out_names = [f"out{i}" for i in range(num_outputs)] if backward_fn else []
    grad_names = [f"grad_out{i}" for i in range(num_outputs)]

    def vjp_fn(*args, interpret, generation):
        primals, cotangents = list(args[: len(sig.names)]), args[len(sig.names):]

        def f(*diff):
            full = list(primals)
            for pos, value in zip(diff_positions, diff):
                full[pos] = value
            return jax_fn(*full, interpret=interpret, generation=generation)

        _, pullback = jax.vjp(f, *(primals[p] for p in diff_positions))
        return tuple(pullback(tuple(cotangents) if sig.returns_tuple else cotangents[0]))

    def given_backward(*args, interpret, generation):
        return tuple(backward_fn(*args, interpret=interpret, generation=generation))

    names = sig.names + out_names + grad_names
    types = {**sig.types, **{n: jax.Array for n in out_names + grad_names}}
    returns = tuple[(jax.Array,) * len(diff_positions)]
    backward_runner = _Runner(qualname + "_vjp", given_backward if backward_fn else vjp_fn, names, types, returns)
    backward_op = torch.library.custom_op(
        qualname + "_vjp", mutates_args=(), schema=sig.schema(names=names, types=types, returns="Tensor[]")
    )(backward_runner)
    backward_op.register_fake(backward_runner.fake)
    BACKWARD_OPS[qualname] = backward_op

    def setup_context(ctx, inputs, output):
        ctx.inputs = inputs
        ctx.outputs = (list(output) if sig.returns_tuple else [output]) if backward_fn else []

    def backward(ctx, *grads):
        grads = grads[0] if sig.returns_tuple else grads
        if ctx.outputs:  # an output the caller did not use (a residual) gets no gradient: zeros
            grads = [torch.zeros_like(o) if g is None else g for g, o in zip(grads, ctx.outputs)]
        grads = [g.contiguous() for g in grads]
        diff_grads = iter(backward_op(*ctx.inputs, *ctx.outputs, *grads))
        return tuple(next(diff_grads) if i in diff_positions else None for i in range(len(sig.names)))

    op.register_autograd(backward, setup_context=setup_context)
