"""What a Pallas kernel's control flow does at each grid step, read by running it.

The schedule model (bench/pipeline.py) gives each part of a compiled kernel
its cycles; for a kernel whose loops and branches depend on its data (a
paged attention's pages per sequence, a loop over blocks whose count is in
SMEM) it must also know how often each part runs. This runs the kernel in
Pallas's interpreter, on this CPU, with its jaxpr instrumented: every loop
body, every branch of a `lax.cond` / `pl.when` and every DMA start and wait
reports itself, and the grid step it runs in. The counts are exact for the inputs
given; the data's values matter only where the control flow reads them.
It runs in the TPU interpreter (`pltpu.InterpretParams`), which keeps a
kernel's SMEM from one grid step to the next as a TPU does: the plain
interpreter starts each step from the inputs, and a kernel that keeps
flags there (jax's paged_attention) would be seen copying more.

Only the kernel's control is run: before the kernel runs, every operation
that neither decides a loop or branch nor writes SMEM is cut out of it
(`_sliced`): the vector work, the DMAs themselves (their starts and waits
still report their bytes). A decode batch of 64 sequences at 8k then runs in
seconds, and kernels with ops the interpreter lacks (jax's
ragged_paged_attention reshapes refs) run too, as long as those ops are not
part of the control. Control read from VMEM (never the case in the kernels
profiled so far) raises rather than reading memory the slice no longer
writes.

`profile(fn, *args)` returns a `KernelProfile` per pallas_call `fn` runs:
its control nodes in program order (pre-order: a node's children follow
it) and, per grid step, how many times each ran and the bytes each DMA
moved or waited for.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax._src import core as jcore
from jax._src.pallas import core as pallas_core
from jax._src.state import indexing
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import grid_walk
from runtime.attention_math import LANES

INTERPRET = pltpu.InterpretParams()  # the TPU interpreter: SMEM persists across grid steps
NO_LOOP_SIMPLIFIER = {"xla_disable_hlo_passes": "simplify-while-loops"}


@dataclasses.dataclass(frozen=True)
class Node:
    kind: str  # "loop" (a while / fori body), "branch" (one branch of a cond), "dma" (a DMA start), "wait" (a DMA wait)
    parent: int  # index of the node it runs inside, -1 at the kernel's top level
    branch: int = 0  # a branch's index in its cond (pl.when: its body is branch 1)
    empty: bool = False  # a branch with nothing in it (pl.when's branch 0): no code is laid out for it
    reads_hbm: bool = False  # a DMA's source is in HBM (memory space ANY): a fetch, else a write-back
    unrolled: int = 1  # a loop's iterations per compiled trip (a fori_loop's `unroll`)


@dataclasses.dataclass
class KernelProfile:
    name: str
    grid: tuple[int, ...]
    nodes: list[Node]
    counts: np.ndarray  # [grid steps, nodes] int64: runs of each node at each step (row-major steps)
    moved: np.ndarray  # [grid steps, nodes] int64: the bytes each DMA start moved (or wait waited for) at each step

    def control_runs(self, schedule, whole_program: bool = False) -> np.ndarray | None:
        """[grid steps, schedule.controls] (whole_program: schedule.program_controls): how many
        times each of the compiled kernel's loops and forward regions (kernels/tpu_schedule.py)
        runs at each step, or None when they cannot be matched to the profile's nodes. In program
        order, each control takes a later node of
        its kind: a branch the compiler predicated instead (its instructions issue whether or
        not it runs, so they count with what holds it) has no control, and is passed over; a
        loop never is. A match keeps the nesting both ways: a control's node runs inside the
        nodes of the controls that hold it, and inside no other matched node. The first match
        in program order is taken. Branches Mosaic lays out after the kernel's own, holding
        none of them (the pipeline's write-back of a block-spec'd output), match no node: they
        count as running at every step."""
        nodes = [i for i, n in enumerate(self.nodes) if n.kind in ("loop", "branch") and not n.empty]
        controls = schedule.program_controls if whole_program else schedule.controls
        holders = [{k for k in range(j) if controls[k].holds(c)} for j, c in enumerate(controls)]
        holding = set().union(*holders)
        mosaic = 0  # trailing top-level branches that hold nothing: maybe Mosaic's
        while mosaic < len(controls) and controls[-1 - mosaic].kind == "branch" and not holders[-1 - mosaic] \
                and len(controls) - 1 - mosaic not in holding:
            mosaic += 1

        # A branch holding one loop and what it holds, nothing else: the guard Mosaic puts around a
        # loop whose trip count is a value (it runs no trip when the count is 0). It may match no
        # node: it then runs as often as what holds it.
        guards = [c.kind == "branch" and j + 1 < len(controls) and controls[j + 1].kind == "loop"
                  and j in holders[j + 1] and all(j + 1 in holders[k] for k in range(j + 2, len(controls)) if j in holders[k])
                  for j, c in enumerate(controls)]

        def search(j: int, at: int, matched: list, end: int) -> list | None:
            if j == end:
                return matched if not any(self.nodes[i].kind == "loop" for i in nodes[at:]) else None
            skipped = {m for m, i in enumerate(matched) if i is None}
            for k in range(at, len(nodes)):
                node = self.nodes[nodes[k]]
                if node.kind == controls[j].kind:
                    ancestors = set(self._ancestors(nodes[k]))
                    if {m for m, i in enumerate(matched) if i in ancestors} == holders[j] - skipped:
                        found = search(j + 1, k + 1, matched + [nodes[k]], end)
                        if found is not None:
                            return found
                if node.kind == "loop":
                    break
            return search(j + 1, at, matched + [None], end) if guards[j] else None

        def runs(j: int, matched: list) -> np.ndarray:
            if matched[j] is not None:
                return self.counts[:, matched[j]]
            held_by = [m for m in holders[j] if matched[m] is not None]
            return self.counts[:, max(held_by)] if held_by else np.ones(len(self.counts), np.int64)

        for left in range(mosaic + 1):
            matched = search(0, 0, [], len(controls) - left)
            if matched is not None:
                columns = [runs(j, matched) for j in range(len(matched))] + [np.ones(len(self.counts), np.int64)] * left
                return np.stack(columns, axis=1) if columns else np.zeros((len(self.counts), 0), np.int64)
        return None

    def step_cycles(self, schedule) -> tuple[np.ndarray, bool] | None:
        """([grid steps] issue cycles of each step, its controls counted as they ran; whether the
        whole program is the step), or None: the profile does not match the compiled controls.
        A grid of one step may have no grid loop (its step is the whole program) or have one (a
        grid whose size is a value, however few steps it runs): the first reading that matches."""
        for whole in (True, False) if len(self.counts) == 1 else (False,):
            runs = self.control_runs(schedule, whole)
            if runs is not None:
                return schedule.profiled_step_cycles(runs, whole_program=whole), whole
        return None

    def _ancestors(self, index: int) -> list[int]:
        chain = []
        while (index := self.nodes[index].parent) >= 0:
            chain.append(index)
        return chain

    def dma_bytes(self, reads_hbm: bool = True) -> np.ndarray:
        """[grid steps] the bytes of the DMAs each step starts, from HBM (or to it)."""
        chosen = np.array([n.kind == "dma" and n.reads_hbm == reads_hbm for n in self.nodes], bool)
        return self.moved[:, chosen].sum(axis=1)

    def waited_bytes(self) -> np.ndarray:
        """[grid steps] the bytes each step's DMA waits wait for (a wait's descriptor's bytes:
        a DMA semaphore counts bytes, whichever copies brought them)."""
        chosen = np.array([n.kind == "wait" for n in self.nodes], bool)
        return self.moved[:, chosen].sum(axis=1)


def _sub_jaxprs(eqn):
    """The jaxprs a call-like equation (jit, a custom rule) evaluates, to walk through."""
    return [v for v in eqn.params.values() if isinstance(v, jcore.ClosedJaxpr)]


class _Instrumenter:
    """Rewrites a kernel jaxpr so that each node reports (its index) when it runs."""

    def __init__(self, grid_mapping):
        self.grid_mapping = grid_mapping
        self.nodes: list[Node] = []
        self.runs: list[tuple[int, int]] = []  # filled by the callbacks: (node, DMA bytes), (-1 - step, 0) at a step's start

    def _report(self, index, nbytes=0):
        # (Unordered callbacks: the interpreter runs the kernel's ops one after another, so they
        # arrive in program order; the tests check counts that a reordering would break.)
        self.runs.append((int(index), int(nbytes)))

    def _traced(self, fn, avals):
        with pallas_core.tracing_grid_env(tuple(self.grid_mapping.grid), self.grid_mapping.vmapped_dims):
            return jax.make_jaxpr(fn)(*avals)

    def kernel(self, jaxpr):
        grid = tuple(self.grid_mapping.grid)
        body = self.rewrite(jaxpr, -1)

        def top(*args):
            step = 0
            for axis in range(len(grid)):
                step = step * pl.num_programs(axis) + pl.program_id(axis)
            jax.debug.callback(self._report, -1 - step)
            return jcore.eval_jaxpr(body, (), *args)

        return self._traced(top, [v.aval for v in jaxpr.invars]).jaxpr

    def _node(self, node: Node) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def _reporting(self, closed, index):
        """closed, reporting `index` each time it runs (and its own nodes rewritten)."""
        inner = jcore.ClosedJaxpr(self.rewrite(closed.jaxpr, index), closed.consts)

        def body(*args):
            jax.debug.callback(self._report, index)
            return jcore.eval_jaxpr(inner.jaxpr, inner.consts, *args)

        return self._traced(body, [v.aval for v in closed.jaxpr.invars])

    def rewrite(self, jaxpr, parent: int):
        eqns = []
        for eqn in jaxpr.eqns:
            params = dict(eqn.params)
            if eqn.primitive.name == "while":
                params["body_jaxpr"] = self._reporting(params["body_jaxpr"], self._node(Node("loop", parent)))
            elif eqn.primitive.name == "cond":
                # Nodes in the order Mosaic lays the branches out (scf.if: "then", branch 1, first).
                branches = list(params["branches"])
                for i in reversed(range(len(branches))):
                    node = Node("branch", parent, i, empty=not branches[i].jaxpr.eqns)
                    branches[i] = self._reporting(branches[i], self._node(node))
                params["branches"] = tuple(branches)
            elif eqn.primitive.name in ("dma_start", "dma_wait"):
                eqns += self._dma_report(eqn, parent)
            elif eqn.primitive.name == "scan" and _scan_unroll(params) < params["length"]:
                # A fori_loop of static bounds, compiled as a loop (Mosaic unrolls only a whole one).
                node = Node("loop", parent, unrolled=_scan_unroll(params))
                params["jaxpr"] = self._reporting(params["jaxpr"], self._node(node))
            elif eqn.primitive.name == "run_scoped":  # scratch allocated for a region: its jaxpr is open
                params["jaxpr"] = self.rewrite(params["jaxpr"], parent)
            elif _sub_jaxprs(eqn):
                params = {k: jcore.ClosedJaxpr(self.rewrite(v.jaxpr, parent), v.consts)
                          if isinstance(v, jcore.ClosedJaxpr) else v for k, v in params.items()}
            eqns.append(eqn.replace(params=params))
        return jaxpr.replace(eqns=eqns)

    def _dma_report(self, eqn, parent: int) -> list:
        """The equations that report a DMA start (or wait) and its bytes. A DMA whose slice sizes
        are values (`pl.ds(start, n)` with n traced) reports them as it runs."""
        src_aval, dst_aval = jax.tree_util.tree_unflatten(eqn.params["tree"], [v.aval for v in eqn.invars])[:2]
        src = jax.tree_util.tree_unflatten(eqn.params["tree"], eqn.invars)[0]
        sizes = [s.size for t in getattr(src, "transforms", ()) for s in getattr(t, "indices", ())
                 if isinstance(s, indexing.Slice) and not isinstance(s.size, int)]
        static = [d for d in src_aval.shape if isinstance(d, int)]
        if len(static) + len(sizes) != len(src_aval.shape):
            raise NotImplementedError(f"a DMA of shape {src_aval.shape} whose sizes are not its slices'")
        if len(src_aval.shape) > 1 and src_aval.shape[-1] == static[-1] < LANES:
            static[-1] = LANES  # a row of fewer lanes fills a whole 128-lane tile in memory, and moves it
        itemsize = np.dtype(src_aval.dtype).itemsize
        if eqn.primitive.name == "dma_wait":
            index = self._node(Node("wait", parent))
        else:
            index = self._node(Node("dma", parent, reads_hbm=_in_hbm(src_aval) and not _in_hbm(dst_aval)))
        report = lambda *n: self._report(index, math.prod(static) * itemsize * math.prod(int(x) for x in n))
        traced = self._traced(lambda *n: jax.debug.callback(report, *n), [v.aval for v in sizes]).jaxpr
        rename = dict(zip(traced.invars, sizes))
        return [e.replace(invars=[rename.get(v, v) if isinstance(v, jcore.Var) else v for v in e.invars])
                for e in traced.eqns]

    def tallies(self, steps: int) -> tuple[np.ndarray, np.ndarray]:
        """[steps, nodes] runs of each node, and the bytes its DMAs moved."""
        counts = np.zeros((steps, len(self.nodes)), np.int64)
        moved = np.zeros_like(counts)
        step = 0
        for index, nbytes in self.runs:
            if index < 0:
                step = -1 - index
            else:
                counts[step, index] += 1
                moved[step, index] += nbytes
        trips = np.array([n.unrolled for n in self.nodes], np.int64)
        return counts // np.maximum(trips, 1), moved


def _scan_unroll(params) -> int:
    """A scan's iterations per compiled trip (Mosaic's reading of `unroll`: 0 or True is all)."""
    length, unroll = params["length"], params["unroll"]
    unroll = length if unroll is True or unroll == 0 else int(unroll)
    if length % unroll:
        raise NotImplementedError(f"a loop of {length} iterations unrolled by {unroll}: its remainder's trips")
    return unroll


_DROPPED = {"dma_start", "dma_wait", "semaphore_signal", "semaphore_wait", "delay"}  # the slice's timing-only ops
_STATE_WRITES = {"swap", "addupdate"}


def _memory_space(aval) -> str:
    return str(getattr(aval, "memory_space", "")).lower()


def _is_ref(var) -> bool:
    return isinstance(var, jcore.Var) and hasattr(var.aval, "memory_space") and hasattr(var.aval, "inner_aval")


def _zeros(aval) -> jcore.Literal:
    """A stand-in for a value nothing in the slice reads."""
    return jcore.Literal(np.zeros(aval.shape, aval.dtype), aval)


def _ref_key(aval) -> tuple:
    return tuple(aval.shape), str(aval.dtype), _memory_space(aval)


def _written_refs(jaxpr) -> set:
    """The kinds (`_ref_key`) of the refs outside SMEM that the kernel writes anywhere (a store, a
    DMA into it). Its control may read a ref of no such kind (an input block, which the pipeline
    copies in outside the slice): that read never sees a write the slice dropped."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _STATE_WRITES:
            found.add(_ref_key(eqn.invars[0].aval))
        elif eqn.primitive.name == "dma_start":
            found.add(_ref_key(jax.tree_util.tree_unflatten(eqn.params["tree"], [v.aval for v in eqn.invars])[1]))
        for sub in [*(b.jaxpr for b in eqn.params.get("branches", ())),
                    *(v.jaxpr if isinstance(v, jcore.ClosedJaxpr) else v for v in eqn.params.values()
                      if isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr)))]:
            found |= _written_refs(sub)
    return {key for key in found if "smem" not in key[2]}


def _sliced(jaxpr, live_out, written):
    """(jaxpr cut down to what its live outputs, its callbacks and its SMEM writes need, with the
    same inputs and outputs (the dead ones zeros); which inputs (constvars then invars) it reads;
    whether it holds a callback or SMEM write). written: `_written_refs` of the kernel."""
    needed = {v for v, live in zip(jaxpr.outvars, live_out) if live and isinstance(v, jcore.Var)}
    kept, effectful = [], False
    for eqn in reversed(jaxpr.eqns):
        name = eqn.primitive.name
        wanted = [v in needed for v in eqn.outvars]
        eqn, reads, roots = _sliced_eqn(eqn, wanted, written)
        if eqn is None:
            if any(wanted):
                raise NotImplementedError(f"the kernel's control reads the result of {name}, which the slice drops")
            continue
        effectful |= roots
        needed |= {v for v, r in zip(eqn.invars, reads) if r and isinstance(v, jcore.Var)}
        kept.append(eqn)
    outvars = [v if live or not isinstance(v, jcore.Var) else _zeros(v.aval) for v, live in zip(jaxpr.outvars, live_out)]
    reads = [v in needed for v in (*jaxpr.constvars, *jaxpr.invars)]
    return jaxpr.replace(eqns=kept[::-1], outvars=outvars), reads, effectful


def _closed_sliced(closed, live_out, written):
    inner, reads, roots = _sliced(closed.jaxpr, live_out, written)
    return jcore.ClosedJaxpr(inner, closed.consts), reads[len(closed.jaxpr.constvars):], roots


def _dead_to_zeros(invars, reads):
    """An equation's operands with the unread values (not refs: a ref costs nothing to pass) as zeros."""
    return [v if r or not isinstance(v, jcore.Var) or _is_ref(v) else _zeros(v.aval) for v, r in zip(invars, reads)]


def _sliced_eqn(eqn, wanted, written):
    """(the equation as the slice keeps it or None, which operands it reads, whether it is or holds a
    callback or SMEM write)."""
    name, params = eqn.primitive.name, eqn.params
    if name == "debug_callback":
        return eqn, [True] * len(eqn.invars), True
    if name in _DROPPED:
        return None, None, False
    if name in _STATE_WRITES or name == "get":
        reads_smem = "smem" in _memory_space(eqn.invars[0].aval)
        if name in _STATE_WRITES and reads_smem:
            return eqn, [True] * len(eqn.invars), True
        if not any(wanted):
            return None, None, False
        if not reads_smem and _ref_key(eqn.invars[0].aval) in written:
            raise NotImplementedError(f"the kernel's control reads {_memory_space(eqn.invars[0].aval)} memory, not SMEM")
        return eqn, [True] * len(eqn.invars), False
    if name == "while":
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        cond, cond_reads, cond_roots = _closed_sliced(params["cond_jaxpr"], [True], written)
        live = [w or r for w, r in zip(wanted, cond_reads[nc:])]
        while True:
            body, body_reads, body_roots = _closed_sliced(params["body_jaxpr"], live, written)
            grown = [l or r for l, r in zip(live, body_reads[nb:])]
            if grown == live:
                break
            live = grown
        if not (any(live) or body_roots or cond_roots):
            return None, None, False
        reads = cond_reads[:nc] + body_reads[:nb] + live
        return eqn.replace(invars=_dead_to_zeros(eqn.invars, reads),
                           params=dict(params, cond_jaxpr=cond, body_jaxpr=body)), reads, body_roots or cond_roots
    if name == "scan":
        nc, ncarry = params["num_consts"], params["num_carry"]
        live = list(wanted[:ncarry])
        while True:
            body, body_reads, roots = _closed_sliced(params["jaxpr"], live + list(wanted[ncarry:]), written)
            grown = [l or r for l, r in zip(live, body_reads[nc:nc + ncarry])]
            if grown == live:
                break
            live = grown
        if not (any(wanted) or roots):
            return None, None, False
        reads = body_reads[:nc] + live + body_reads[nc + ncarry:]
        return eqn.replace(invars=_dead_to_zeros(eqn.invars, reads), params=dict(params, jaxpr=body)), reads, roots
    if name == "cond":
        sliced = [_closed_sliced(b, wanted, written) for b in params["branches"]]
        roots = any(r for _, _, r in sliced)
        if not (any(wanted) or roots):
            return None, None, False
        reads = [True] + [any(col) for col in zip(*(r for _, r, _ in sliced))]
        return eqn.replace(invars=_dead_to_zeros(eqn.invars, reads),
                           params=dict(params, branches=tuple(b for b, _, _ in sliced))), reads, roots
    if name == "run_scoped":
        body, reads, roots = _sliced(params["jaxpr"], wanted, written)
        if not (any(wanted) or roots):
            return None, None, False
        reads = reads[:len(eqn.invars)]  # its operands are the body's constvars
        return eqn.replace(invars=_dead_to_zeros(eqn.invars, reads), params=dict(params, jaxpr=body)), reads, roots
    if name in ("pjit", "jit", "closed_call", "core_call"):
        body, reads, roots = _closed_sliced(params["jaxpr"], wanted, written)
        if not (any(wanted) or roots):
            return None, None, False
        return eqn.replace(invars=_dead_to_zeros(eqn.invars, reads), params=dict(params, jaxpr=body)), reads, roots
    if any(wanted):
        return eqn, [True] * len(eqn.invars), False
    return None, None, False


def _in_hbm(ref) -> bool:
    """A (transformed) ref's memory space is HBM: `pl.ANY` or `pltpu.HBM`."""
    space = str(getattr(getattr(ref, "ref", ref), "memory_space", "")).lower()
    return "any" in space or "hbm" in space


def profile(fn, *args, name_contains: str = "") -> list[KernelProfile]:
    """Runs fn(*args) (concrete arrays), each pallas_call whose name contains `name_contains` in
    Pallas's interpreter with its control flow reporting; one KernelProfile per such call, in
    program order."""
    closed = jax.make_jaxpr(fn)(*args)
    found = []

    def run(jaxpr, consts, values):
        env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, values))
        read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            params = eqn.params
            if eqn.primitive.name == "pallas_call" and name_contains in (params.get("name") or ""):
                instrumenter = _Instrumenter(params["grid_mapping"])
                kernel = instrumenter.kernel(params["jaxpr"])
                kernel = _sliced(kernel, [], _written_refs(kernel))[0]
                params = dict(params, jaxpr=kernel, interpret=INTERPRET)
                run_kernel = jax.jit(lambda *operands: eqn.primitive.bind(*operands, **params))
                # (XLA's CPU compiler, simplifying a while loop whose carry the slice left nearly empty,
                # drops the loop's operands but not the sharding of the interpreter's callbacks, and
                # its verifier then fails: that pass is left out.)
                outs = run_kernel.lower(*invals).compile(NO_LOOP_SIMPLIFIER)(*invals)
                jax.block_until_ready(outs)
                dynamic = iter(int(np.asarray(v).reshape(-1)[0]) for v in invals)  # its dynamic bounds lead
                grid = tuple(next(dynamic) if pallas_core.is_dynamic_dim(g) else g for g in params["grid_mapping"].grid)
                found.append(KernelProfile(grid_walk.call_name(params), grid, instrumenter.nodes,
                                           *instrumenter.tallies(math.prod(grid))))
            elif eqn.primitive.name in ("pjit", "jit", "closed_call", "core_call"):
                sub = params["jaxpr"]
                outs = run(sub.jaxpr, sub.consts, invals)
            elif eqn.primitive.name in ("custom_vjp_call", "custom_jvp_call"):  # the forward as defined
                sub = params["call_jaxpr"]
                outs = run(sub.jaxpr, sub.consts, invals)
            elif eqn.primitive.name == "with_memory_space_constraint":  # a placement hint, not run eagerly
                outs = invals[:1]
            else:
                outs = eqn.primitive.bind(*invals, **params)
                outs = outs if eqn.primitive.multiple_results else [outs]
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    run(closed.jaxpr, closed.consts, args)
    return found

