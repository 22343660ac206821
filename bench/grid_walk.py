"""Counts what a Pallas TPU kernel moves and computes, from the kernel itself.

Given a JAX function and its inputs (the routing concrete, the data may be
abstract), `kernel_costs` finds each `pallas_call` in it, computes that
call's real scalar-prefetch values, and walks its grid in order the way the
TPU pipeline does:

- HBM traffic: an operand's block is copied in (or an output's written
  back) whenever its block index (or element offset, for `pl.Element`
  dims) differs from the previous grid step's; each copy moves the block
  clipped to the array's bounds (an element window's padding is not
  read). Block shapes and index maps are read from the pallas_call, not
  written by hand. Operands left in HBM (`pl.ANY`, `pltpu.HBM`) are not counted as blocks:
  the copies the kernel starts itself are counted where they are started at its top level or
  in its top-level conds (a ring of blocks), else they are its caller's to count
  (bench/kernel_profile.py).
- MXU work: each `dot_general` in the kernel body counts at its shapes
  padded to the MXU (rows to 8, contraction and columns to the MXU width),
  on the grid steps where it runs: a dot under `pl.when(cond)` counts on
  the steps whose condition (computed from the grid indices and scalar
  prefetch, as the kernel does) selects it.

- Per step, for the pipeline model (bench/pipeline.py): the bytes fetched
  before it, the bytes written back after it, and whether each top-level
  `pl.when` body of the kernel runs (its condition computed the same way),
  which selects the regions of the compiled schedule the step executes.

The walk models one TensorCore's sequential order; a v5p megacore splits
the "parallel" axes over two cores, which the time model accounts for.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from jax._src.pallas import core as pallas_core
from jax._src.state.discharge import discharge_state

# remat_opt: a custom_vjp with optimize_remat (tokamax's attention) runs its forward as `fwd_jaxpr`.
CALL_PRIMITIVES = {"pjit", "jit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call", "custom_vjp_call",
                   "custom_vmap_call", "remat_opt"}


@dataclasses.dataclass
class KernelCost:
    name: str
    grid: tuple[int, ...]
    grid_steps: int
    hbm_bytes: int  # all operands, clipped blocks, per copy
    bytes_by_operand: dict[str, int]
    mxu_flops: int  # padded to the MXU's shape
    dot_flops: int  # the dots at their block shapes, unpadded, on steps that run them
    work_steps: int  # grid steps that run at least one dot
    # Per grid step, in the TPU's order:
    fetch_bytes: np.ndarray  # input bytes copied in before the step
    write_bytes: np.ndarray  # output bytes written back after it
    fetch_largest: np.ndarray  # the largest of those copies (one block each), and of the writes
    write_largest: np.ndarray
    # The bodies of the kernel's top-level conds (see _when_runs), one column each:
    when_runs: np.ndarray  # bool [steps, bodies]: does each body run
    when_known: list[bool]  # False: the condition reads VMEM data (counted as running)
    when_has_dot: list[bool]  # whether each body holds a matmul
    when_on_grid_only: list[bool]  # the condition reads only grid indices (the compiler may fold it)
    dimension_semantics: tuple[str, ...]
    operand_shapes: tuple[str, ...]  # its operands and results as XLA prints them ("bf16[512,2048]")
    # MXU-padded FLOPs of each grid step (the pipeline model's floor on a step's time: the MXU's
    # peak), and whether they are all of the kernel's (False: a dot runs in a while loop).
    mxu_flops_per_step: np.ndarray | None = None
    dots_counted: bool = True
    when_copies_only: list[bool] = dataclasses.field(default_factory=list)  # a cond body only starts or waits for copies
    # The copies the kernel starts itself (`make_async_copy` at its top level or in its top-level
    # conds, e.g. a ring of weight blocks), in the order it starts them: the step that starts each
    # and its bytes; and per step, how many of them it waits for (a kernel waits for its copies in
    # the order it started them). None where a copy is started or waited for elsewhere (in a loop,
    # a nested cond) or under a condition the walk cannot know: then they are not counted here.
    copy_step: np.ndarray | None = None
    copy_bytes: np.ndarray | None = None
    copy_after_wait: np.ndarray | None = None  # whether it is started after its step's waits
    copy_waits: np.ndarray | None = None


def _sub_jaxpr(eqn):
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr", "call", "fwd_jaxpr"):
        value = eqn.params.get(key)
        if isinstance(value, jcore.ClosedJaxpr):
            return value
        if isinstance(value, jcore.Jaxpr):
            return jcore.ClosedJaxpr(value, ())
    return None


# Copies the function makes outside its kernels (padding rows or columns to
# whole blocks): each reads its input and writes its output through HBM.
COPY_PRIMITIVES = {"pad"}


def pallas_calls(fn, *args, copies: list | None = None):
    """[(pallas_call eqn, its input values)] in program order. Only what the
    scalar prefetch is computed from needs concrete values: pass the data
    operands as jax.ShapeDtypeStruct (the walk then never allocates them),
    and each pallas_call's outputs stay abstract too: the cost of a kernel
    depends on its scalar prefetch (routing), not on the data."""
    closed = jax.make_jaxpr(fn)(*args)
    found = []
    abstract = lambda x: isinstance(x, jax.ShapeDtypeStruct)

    def run(jaxpr, consts, values):
        env = {}
        read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
        for var, val in zip(jaxpr.constvars, consts):
            env[var] = val
        for var, val in zip(jaxpr.invars, values):
            env[var] = val
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            if eqn.primitive.name == "pallas_call":
                found.append((eqn, invals))
                outs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.outvars]
            elif eqn.primitive.name in CALL_PRIMITIVES and _sub_jaxpr(eqn) is not None:
                sub = _sub_jaxpr(eqn)
                outs = run(sub.jaxpr, sub.consts, invals)
            elif any(abstract(x) for x in invals):  # data we only need the shape of
                if eqn.primitive.name in COPY_PRIMITIVES and copies is not None:
                    copies.append(sum(v.aval.size * v.aval.dtype.itemsize
                                      for v in (eqn.invars[0], eqn.outvars[0])))
                outs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.outvars]
            else:
                outs = eqn.primitive.bind(*invals, **eqn.params)
                outs = outs if eqn.primitive.multiple_results else [outs]
            for var, val in zip(eqn.outvars, outs):
                env[var] = val
        return [read(v) for v in jaxpr.outvars]

    run(closed.jaxpr, closed.consts, args)
    return found


def _map_points(fn, points, chunk=1 << 16):
    """jit(vmap(fn)) over the grid points, in chunks to bound memory."""
    mapped = jax.jit(jax.vmap(fn))
    if not len(points):  # a grid with no steps (a kernel called on an empty part of the batch)
        out = jax.eval_shape(mapped, jax.ShapeDtypeStruct(points.shape, points.dtype))
        return np.zeros(out.shape, out.dtype)
    return np.concatenate([np.asarray(mapped(jnp.asarray(points[i:i + chunk])))
                           for i in range(0, len(points), chunk)])


def _grid_points(grid):
    """All grid points in the TPU's iteration order (last axis fastest)."""
    return np.indices(grid, dtype=np.int32).reshape(len(grid), -1).T


def _block_dims(block_mapping):
    """(block size, index is an element offset, padding before the array) per dim."""
    dims = []
    for dim in block_mapping.block_shape:
        if isinstance(dim, pallas_core.Squeezed) or dim is None:
            dims.append((1, False, 0))
        elif isinstance(dim, pallas_core.Blocked):
            dims.append((dim.block_size, False, 0))
        elif isinstance(dim, pallas_core.Element):
            dims.append((dim.block_size, True, dim.padding[0]))
        elif isinstance(dim, int):
            dims.append((dim, False, 0))
        else:
            raise NotImplementedError(f"block dim {dim!r}")
    return dims


def _without_alignment_hints(closed):
    """The jaxpr with `pl.multiple_of` (a compiler hint with no batching
    rule) replaced by its input, so index maps can be vmapped."""
    jaxpr = closed.jaxpr
    alias = {}
    eqns = []
    for eqn in jaxpr.eqns:
        eqn = eqn.replace(invars=[alias.get(v, v) if not isinstance(v, jcore.Literal) else v for v in eqn.invars])
        if eqn.primitive.name == "multiple_of":
            alias[eqn.outvars[0]] = eqn.invars[0]
        else:
            eqns.append(eqn)
    outvars = [alias.get(v, v) if not isinstance(v, jcore.Literal) else v for v in jaxpr.outvars]
    return jcore.ClosedJaxpr(jaxpr.replace(eqns=eqns, outvars=outvars), closed.consts)


def _block_indices(block_mapping, points, prefetch):
    """Block index of one operand at every grid point: [steps, ndim]."""
    pure = discharge_state(_without_alignment_hints(block_mapping.index_map_jaxpr))
    num_out = len(block_mapping.block_shape)

    def one(point):
        outs = jcore.jaxpr_as_fun(pure)(*point, *prefetch)
        return jnp.stack([jnp.asarray(o, jnp.int32) for o in outs[:num_out]])

    return _map_points(one, points)


def _copy_bytes(block_mapping, indices, is_output: bool) -> np.ndarray:
    """Bytes copied per grid step: an input's block before the first step
    that uses it, an output's after the last step that writes it (where
    the block index changes next, or at the end)."""
    dims, is_element, pad_low = (np.asarray(x) for x in zip(*_block_dims(block_mapping)))
    shape = block_mapping.array_aval.shape
    itemsize = np.dtype(block_mapping.array_aval.dtype).itemsize
    changed = np.ones(len(indices), bool)
    if is_output:
        changed[:-1] = np.any(indices[1:] != indices[:-1], axis=1)
    else:
        changed[1:] = np.any(indices[1:] != indices[:-1], axis=1)
    # Element windows may hang over padding on either side: only the part
    # inside the array is copied.
    starts = np.where(is_element, indices[changed] - pad_low, indices[changed] * dims)
    ends = np.minimum(starts + dims, np.asarray(shape))
    sizes = np.maximum(ends - np.maximum(starts, 0), 0)
    per_step = np.zeros(len(indices), np.int64)
    per_step[changed] = np.prod(sizes, axis=1) * itemsize
    return per_step


def _trips(eqn) -> int:
    """Times a sub-jaxpr of `eqn` runs per run of `eqn`: a scan's length (a fori_loop with static
    bounds is a scan, unrolled or not), else once."""
    return int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else 1


def _dots(jaxpr, times: int = 1):
    """[(dot_general eqn, how many times it runs per run of `jaxpr`)]."""
    return [(e, times) for e in jaxpr.eqns if e.primitive.name == "dot_general"] + [
        d for e in jaxpr.eqns for sub in _branches(e) for d in _dots(sub, times * _trips(e))
    ]


def _dots_in_while(jaxpr) -> bool:
    """Whether a dot runs inside a while loop (a fori_loop with bounds known only at run time),
    whose trips the walk cannot count: its MXU work is then unknown."""
    for e in jaxpr.eqns:
        if e.primitive.name == "while" and _dots(e.params["body_jaxpr"].jaxpr):
            return True
        if any(_dots_in_while(sub) for sub in _branches(e)):
            return True
    return False


def _branches(eqn) -> list:
    """The jaxprs (open: only their equations are read) that `eqn` runs inside a kernel body: a
    cond's branches, a call's body, a `run_scoped` region's (whose jaxpr closes over
    values of the kernel, as constvars)."""
    if eqn.primitive.name == "cond":
        return [b.jaxpr for b in eqn.params["branches"]]
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr", "call", "fwd_jaxpr"):
        value = eqn.params.get(key)
        if isinstance(value, (jcore.ClosedJaxpr, jcore.Jaxpr)):
            return [getattr(value, "jaxpr", value)]
    return []


def _dot_flops(eqn, mxu_width):
    """(MXU-padded, unpadded) FLOPs of one dot_general in the kernel body."""
    (lhs_contract, rhs_contract), (lhs_batch, _) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    k = math.prod(lhs[d] for d in lhs_contract)
    batch = math.prod(lhs[d] for d in lhs_batch)
    m = math.prod(s for d, s in enumerate(lhs) if d not in lhs_contract and d not in lhs_batch)
    n = math.prod(s for d, s in enumerate(rhs) if d not in rhs_contract and d not in eqn.params["dimension_numbers"][1][1])
    pad = lambda x, q: -(-x // q) * q
    return 2 * batch * pad(m, 8) * pad(k, mxu_width) * pad(n, mxu_width), 2 * batch * m * k * n


def _body_flops(jaxpr, mxu_width) -> tuple[int, int]:
    """(MXU-padded, unpadded) FLOPs of every dot in a body."""
    dots = [tuple(times * f for f in _dot_flops(d, mxu_width)) for d, times in _dots(jaxpr)]
    return sum(p for p, _ in dots), sum(u for _, u in dots)


def _work_per_step(kernel_jaxpr, when_runs, when_flops, mxu_width):
    """(MXU-padded FLOPs, unpadded FLOPs) per grid step: the dots outside
    the kernel's top-level conds run at every step, a cond body's dots at
    the steps where `_when_runs` says it runs."""
    always = [_dot_flops(e, mxu_width) for e in kernel_jaxpr.eqns if e.primitive.name == "dot_general"]
    always += [tuple(_trips(e) * f for f in _body_flops(sub, mxu_width)) for e in kernel_jaxpr.eqns
               if e.primitive.name != "cond" for sub in _branches(e)]
    padded = sum(p for p, _ in always) + when_runs @ np.array([p for p, _ in when_flops], np.int64).reshape(-1)
    unpadded = sum(u for _, u in always) + when_runs @ np.array([u for _, u in when_flops], np.int64).reshape(-1)
    return np.asarray(padded, np.int64), np.asarray(unpadded, np.int64)


def _when_runs(kernel_jaxpr, num_prefetch, points, prefetch, mxu_width, user_axes=None):
    """The bodies of the kernel's top-level conds, in the order Mosaic lays
    them out: whether each runs at each step, whether that is known, its
    dots' FLOPs, and whether its condition reads grid indices only. A
    `pl.when` has one body; a two-way `lax.cond` has two (the true branch
    first, as `scf.if` puts its "then" region first). A condition that
    reads VMEM data cannot be known statically: its bodies count as
    running (an upper bound)."""
    runs, known, flops, on_grid_only, copies_only = [], [], [], [], []
    for i, eqn in enumerate(kernel_jaxpr.eqns):
        if eqn.primitive.name != "cond":
            continue
        branches = eqn.params["branches"]
        bodies = [b for b in (1, 0) if b < len(branches) and branches[b].jaxpr.eqns]
        grid_only = not _condition_slice(kernel_jaxpr, i)[1] & set(kernel_jaxpr.invars)
        try:
            if len(branches) > 2:
                raise NotImplementedError("a switch of more than two branches")
            taken = _cond_index(kernel_jaxpr, i, num_prefetch, points, prefetch, user_axes)
            columns, ok = [taken == b for b in bodies], True
        except NotImplementedError:
            columns, ok = [np.ones(len(points), bool) for _ in bodies], False
        runs += columns
        known += [ok] * len(bodies)
        flops += [_body_flops(branches[b].jaxpr, mxu_width) for b in bodies]
        on_grid_only += [grid_only] * len(bodies)
        copies_only += [_copies_only(branches[b].jaxpr) for b in bodies]
    runs = np.stack(runs, axis=1) if runs else np.zeros((len(points), 0), bool)
    return runs, known, flops, on_grid_only, copies_only


def _copies_only(jaxpr) -> bool:
    """Whether a body only starts or waits for copies (and computes their scalar indices): Mosaic
    predicates such a body rather than branching around it."""
    def names(j):
        return {e.primitive.name for e in j.eqns}.union(*(names(sub) for e in j.eqns for sub in _branches(e)))
    used = names(jaxpr)
    return bool(used & {"dma_start", "dma_wait"}) and not used & {"swap", "dot_general", "cond", "while", "scan"}


def _copy_bytes_of(eqn) -> int | None:
    """Bytes one `dma_start` moves: its destination's shape after its indexing (None for a view the
    walk does not read, a bitcast or reshape of the destination, or a slice of a size known only
    as the kernel runs)."""
    _, dst, *_ = jax.tree_util.tree_unflatten(eqn.params["tree"], eqn.invars)
    transforms = getattr(dst, "transforms", ())
    if not all(hasattr(t, "get_indexer_shape") for t in transforms):
        return None
    shape = transforms[-1].get_indexer_shape() if transforms else dst.aval.shape
    if not all(isinstance(n, int) for n in shape):
        return None
    return math.prod(shape) * np.dtype((dst.ref if transforms else dst).aval.dtype).itemsize


def _has_dma(jaxpr) -> bool:
    return any(e.primitive.name in ("dma_start", "dma_wait") or any(_has_dma(sub) for sub in _branches(e))
               for e in jaxpr.eqns)


def _own_copies(kernel_jaxpr, when_runs, when_known, num_steps: int):
    """(copy_step, copy_bytes, copy_after_wait, copy_waits) of the copies the kernel starts itself
    (KernelCost), or Nones where they cannot be counted from the kernel's top-level conds."""
    unknown = None, None, None, None
    # per top-level start: whether it runs at each step, its bytes, whether a wait before it (in
    # program order) runs at the step; per wait, whether it runs
    starts, waits = [], []

    def start(runs, eqn):
        before = np.any(np.stack(waits, axis=1), axis=1) if waits else np.zeros(num_steps, bool)
        starts.append((runs, _copy_bytes_of(eqn), before))
    column = 0
    for eqn in kernel_jaxpr.eqns:
        if eqn.primitive.name == "cond":
            branches = eqn.params["branches"]
            for b in (1, 0):
                if b >= len(branches) or not branches[b].jaxpr.eqns:
                    continue
                body, runs, known = branches[b].jaxpr, when_runs[:, column], when_known[column]
                column += 1
                for inner in body.eqns:
                    if inner.primitive.name in ("dma_start", "dma_wait") and not known:
                        return unknown
                    if inner.primitive.name == "dma_start":
                        start(runs, inner)
                    elif inner.primitive.name == "dma_wait":
                        waits.append(runs)
                    elif _has_dma_in(inner):
                        return unknown
        elif eqn.primitive.name == "dma_start":
            start(np.ones(num_steps, bool), eqn)
        elif eqn.primitive.name == "dma_wait":
            waits.append(np.ones(num_steps, bool))
        elif _has_dma_in(eqn):
            return unknown
    if not starts or any(size is None for _, size, _ in starts):
        return unknown
    started = np.stack([runs for runs, _, _ in starts], axis=1)  # [steps, starts]: step-major is start order
    step, which = np.nonzero(started)
    sizes = np.array([size for _, size, _ in starts], np.int64)[which]
    after = np.stack([before for _, _, before in starts], axis=1)[step, which]
    waited = np.sum(np.stack(waits, axis=1), axis=1) if waits else np.zeros(num_steps, np.int64)
    if waited.sum() != len(step):  # a copy never waited for, or a wait for a copy not counted here
        return unknown
    return step.astype(np.int64), sizes, after, waited.astype(np.int64)


def _has_dma_in(eqn) -> bool:
    return any(_has_dma(sub) for sub in _branches(eqn))


def _condition_slice(kernel_jaxpr, eqn_index):
    """The equations the cond at `eqn_index` computes its predicate from
    (effects ignored), and every variable they read."""
    pred_var = kernel_jaxpr.eqns[eqn_index].invars[0]
    needed, kept = {pred_var}, []
    for eqn in reversed(kernel_jaxpr.eqns[:eqn_index]):
        if any(v in needed for v in eqn.outvars):
            kept.append(eqn)
            needed.update(v for v in eqn.invars if not isinstance(v, jcore.Literal))
    return kept, needed


def _cond_index(kernel_jaxpr, eqn_index, num_prefetch, points, prefetch, user_axes=None):
    """Which branch the cond at `eqn_index` takes at each grid step, computed
    from the grid indices and scalar prefetch the way the kernel does.
    user_axes: the grid axes the kernel's own program_id(i) / num_programs(i)
    name (a vmapped pallas_call prepends grid axes its body never sees: Mosaic
    lowers program_id(i) to the i-th axis that is not vmapped)."""
    pred_var = kernel_jaxpr.eqns[eqn_index].invars[0]
    kept, needed = _condition_slice(kernel_jaxpr, eqn_index)
    if needed & set(kernel_jaxpr.invars[num_prefetch:]):
        raise NotImplementedError("the condition reads VMEM data; cannot know its steps statically")
    # program_id / num_programs become inputs, so the slice runs outside a kernel.
    grid_inputs = [(e.primitive.name, e.params["axis"], e.outvars[0]) for e in kept
                   if e.primitive.name in ("program_id", "num_programs")]
    body = [e for e in kept[::-1] if e.primitive.name not in ("program_id", "num_programs")]
    sliced = kernel_jaxpr.replace(
        eqns=body, outvars=[pred_var], effects=frozenset(),
        invars=[v for _, _, v in grid_inputs] + list(kernel_jaxpr.invars[:num_prefetch]))
    pure = jcore.jaxpr_as_fun(discharge_state(jcore.ClosedJaxpr(sliced, ())))
    grid_shape = points.max(axis=0) + 1
    axes = list(range(points.shape[1])) if user_axes is None else list(user_axes)

    def one(point):
        grid_values = [point[axes[axis]] if name == "program_id" else jnp.int32(grid_shape[axes[axis]])
                       for name, axis, _ in grid_inputs]
        return jnp.asarray(pure(*grid_values, *prefetch)[0], jnp.int32)

    return _map_points(one, points)


_XLA_DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float64": "f64", "int8": "s8", "int16": "s16",
               "int32": "s32", "int64": "s64", "uint8": "u8", "uint32": "u32", "bool": "pred",
               "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2", "int4": "s4"}


def xla_shape(aval) -> str:
    name = np.dtype(aval.dtype).name
    return f"{_XLA_DTYPES.get(name, name)}[{','.join(map(str, aval.shape))}]"


def call_name(params) -> str:
    """A pallas_call's name, as the walk and the profile (bench/kernel_profile.py) report it."""
    return params.get("name") or str(params.get("metadata", ""))


def analyze_call(eqn, invals, mxu_width: int) -> KernelCost:
    grid_mapping = eqn.params["grid_mapping"]
    if grid_mapping.num_dynamic_grid_bounds:
        dynamic = iter(int(np.asarray(v).reshape(-1)[0]) for v in invals[: grid_mapping.num_dynamic_grid_bounds])
        grid = tuple(next(dynamic) if pallas_core.is_dynamic_dim(g) else g for g in grid_mapping.grid)
        invals = invals[grid_mapping.num_dynamic_grid_bounds:]
    else:
        grid = tuple(grid_mapping.grid)
    num_prefetch = grid_mapping.num_index_operands
    prefetch = [jnp.asarray(v) for v in invals[:num_prefetch]]
    points = _grid_points(grid)
    by_operand = {}
    fetch, write, fetch_largest, write_largest = (np.zeros(len(points), np.int64) for _ in range(4))
    for i, block_mapping in enumerate(grid_mapping.block_mappings):
        if str(getattr(block_mapping.block_aval, "memory_space", "")).lower() in ("any", "hbm"):
            continue  # left in HBM: the kernel copies what it needs itself, which its caller counts
        indices = _block_indices(block_mapping, points, prefetch)
        is_output = i >= grid_mapping.num_inputs
        per_step = _copy_bytes(block_mapping, indices, is_output)
        (write if is_output else fetch)[:] += per_step
        largest = write_largest if is_output else fetch_largest
        np.maximum(largest, per_step, out=largest)
        by_operand[f"{'out' if is_output else 'in'}{i}:{block_mapping.array_aval.str_short()}"] = int(per_step.sum())
    kernel_jaxpr = eqn.params["jaxpr"]
    vmapped = set(getattr(grid_mapping, "vmapped_dims", ()))
    user_axes = [a for a in range(len(grid)) if a not in vmapped]
    when_runs, when_known, when_flops, when_on_grid_only, when_copies_only = _when_runs(
        kernel_jaxpr, num_prefetch, points, prefetch, mxu_width, user_axes)
    padded, unpadded = _work_per_step(kernel_jaxpr, when_runs, when_flops, mxu_width)
    copy_step, copy_bytes, copy_after_wait, copy_waits = _own_copies(kernel_jaxpr, when_runs, when_known, len(points))
    if copy_bytes is not None:
        by_operand["own copies"] = int(copy_bytes.sum())
    params = eqn.params.get("compiler_params")
    params = params.get("mosaic_tpu", params) if isinstance(params, dict) else params
    semantics = tuple(getattr(params, "dimension_semantics", None) or ("arbitrary",) * len(grid))
    return KernelCost(
        name=call_name(eqn.params),
        grid=grid,
        grid_steps=len(points),
        hbm_bytes=sum(by_operand.values()),
        bytes_by_operand=by_operand,
        mxu_flops=int(padded.sum()),
        dot_flops=int(unpadded.sum()),
        work_steps=int((padded > 0).sum()),
        fetch_bytes=fetch,
        write_bytes=write,
        fetch_largest=fetch_largest,
        write_largest=write_largest,
        when_runs=when_runs,
        when_known=when_known,
        when_has_dot=[p > 0 for p, _ in when_flops],
        when_on_grid_only=when_on_grid_only,
        when_copies_only=when_copies_only,
        dimension_semantics=tuple(str(d).split(".")[-1].lower() for d in semantics),
        operand_shapes=tuple(xla_shape(v.aval) for v in (*eqn.invars, *eqn.outvars)),
        mxu_flops_per_step=padded,
        dots_counted=not _dots_in_while(kernel_jaxpr),
        copy_step=copy_step,
        copy_bytes=copy_bytes,
        copy_after_wait=copy_after_wait,
        copy_waits=copy_waits,
    )


def kernel_costs(fn, args, mxu_width: int) -> list[KernelCost]:
    return kernel_costs_and_copies(fn, args, mxu_width)[0]


def kernel_costs_and_copies(fn, args, mxu_width: int) -> tuple[list[KernelCost], int]:
    """Each kernel's cost, and the HBM bytes of the padding copies outside
    them (on data operands, which the walk keeps abstract)."""
    copies = []
    calls = pallas_calls(fn, *args, copies=copies)
    return [analyze_call(eqn, invals, mxu_width) for eqn, invals in calls], sum(copies)
