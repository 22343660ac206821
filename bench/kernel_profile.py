"""What a Pallas kernel's control flow does at each grid step, read by running it.

The schedule model (bench/pipeline.py) gives each part of a compiled kernel
its cycles; for a kernel whose loops and branches depend on its data (a
paged attention's pages per sequence, a loop over blocks whose count is in
SMEM) it must also know how often each part runs. This runs the kernel in
Pallas's interpreter, on this CPU, with its jaxpr instrumented: every loop
body, every branch of a `lax.cond` / `pl.when` and every DMA start reports
itself, and the grid step it runs in. The counts are exact for the inputs
given; the data's values matter only where the control flow reads them.
It runs in the TPU interpreter (`pltpu.InterpretParams`), which keeps a
kernel's SMEM from one grid step to the next as a TPU does: the plain
interpreter starts each step from the inputs, and a kernel that keeps
flags there (jax's paged_attention) would be seen copying more.

`profile(fn, *args)` returns a `KernelProfile` per pallas_call `fn` runs:
its control nodes in program order (pre-order: a node's children follow
it) and, per grid step, how many times each ran and the bytes each DMA
moved.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax._src import core as jcore
from jax._src.pallas import core as pallas_core
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

INTERPRET = pltpu.InterpretParams()  # the TPU interpreter: SMEM persists across grid steps


@dataclasses.dataclass(frozen=True)
class Node:
    kind: str  # "loop" (a while / fori body), "branch" (one branch of a cond), "dma" (a DMA start)
    parent: int  # index of the node it runs inside, -1 at the kernel's top level
    branch: int = 0  # a branch's index in its cond (pl.when: its body is branch 1)
    empty: bool = False  # a branch with nothing in it (pl.when's branch 0): no code is laid out for it
    dma_bytes: int = 0  # a DMA's bytes
    reads_hbm: bool = False  # a DMA's source is in HBM (memory space ANY): a fetch, else a write-back


@dataclasses.dataclass
class KernelProfile:
    name: str
    grid: tuple[int, ...]
    nodes: list[Node]
    counts: np.ndarray  # [grid steps, nodes] int64: runs of each node at each step (row-major steps)

    def control_runs(self, schedule) -> np.ndarray | None:
        """[grid steps, schedule.controls]: how many times each of the compiled kernel's loops
        and forward regions (kernels/tpu_schedule.py) runs at each step, or None when they cannot
        be matched to the profile's nodes. In program order, each control takes the next node of
        its kind: a branch the compiler predicated instead (its instructions issue whether or
        not it runs, so they count with what holds it) has no control, and is passed over. A
        match must keep the nesting: a control's node runs inside the node of the control that
        holds it."""
        nodes = [i for i, n in enumerate(self.nodes) if n.kind != "dma" and not n.empty]
        matched, at = [], 0
        for control in schedule.controls:
            while at < len(nodes) and self.nodes[nodes[at]].kind != control.kind:
                if self.nodes[nodes[at]].kind == "loop":
                    return None  # a loop is never predicated
                at += 1
            if at == len(nodes):
                return None
            matched.append(nodes[at])
            at += 1
        if any(self.nodes[i].kind == "loop" for i in nodes[at:]):
            return None
        for j, control in enumerate(schedule.controls):
            holders = [i for i, c in enumerate(schedule.controls[:j]) if c.start <= control.start and control.end <= c.end]
            if holders and matched[holders[-1]] not in self._ancestors(matched[j]):
                return None
        return self.counts[:, matched]

    def _ancestors(self, index: int) -> list[int]:
        chain = []
        while (index := self.nodes[index].parent) >= 0:
            chain.append(index)
        return chain

    def dma_bytes(self, reads_hbm: bool = True) -> np.ndarray:
        """[grid steps] the bytes of the DMAs each step starts, from HBM (or to it)."""
        sizes = np.array([n.dma_bytes if n.kind == "dma" and n.reads_hbm == reads_hbm else 0 for n in self.nodes],
                         np.int64)
        return self.counts @ sizes


def _sub_jaxprs(eqn):
    """The jaxprs a call-like equation (jit, a custom rule) evaluates, to walk through."""
    return [v for v in eqn.params.values() if isinstance(v, jcore.ClosedJaxpr)]


class _Instrumenter:
    """Rewrites a kernel jaxpr so that each node reports (its index) when it runs."""

    def __init__(self, grid_mapping):
        self.grid_mapping = grid_mapping
        self.nodes: list[Node] = []
        self.runs: list[int] = []  # filled by the callbacks: node indices, and -1 - step at each step's start

    def _report(self, index):
        # (Unordered callbacks: the interpreter runs the kernel's ops one after another, so they
        # arrive in program order; the tests check counts that a reordering would break.)
        self.runs.append(int(index))

    def _traced(self, fn, avals):
        with pallas_core.tracing_grid_env(tuple(self.grid_mapping.grid), self.grid_mapping.vmapped_dims):
            return jax.make_jaxpr(fn)(*avals)

    def kernel(self, jaxpr):
        grid = tuple(self.grid_mapping.grid)
        body = self.rewrite(jaxpr, -1)

        def top(*args):
            step = 0
            for axis, size in enumerate(grid):
                step = step * size + pl.program_id(axis)
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
            elif eqn.primitive.name == "dma_start":
                src, dst = jax.tree_util.tree_unflatten(params["tree"], [v.aval for v in eqn.invars])[:2]
                index = self._node(Node("dma", parent, dma_bytes=math.prod(src.shape) * np.dtype(src.dtype).itemsize,
                                        reads_hbm=_in_hbm(src) and not _in_hbm(dst)))
                eqns += self._traced(lambda: jax.debug.callback(self._report, index), []).jaxpr.eqns
            elif _sub_jaxprs(eqn):
                params = {k: jcore.ClosedJaxpr(self.rewrite(v.jaxpr, parent), v.consts)
                          if isinstance(v, jcore.ClosedJaxpr) else v for k, v in params.items()}
            eqns.append(eqn.replace(params=params))
        return jaxpr.replace(eqns=eqns)

    def counts(self, steps: int) -> np.ndarray:
        counts = np.zeros((steps, len(self.nodes)), np.int64)
        step = 0
        for index in self.runs:
            if index < 0:
                step = -1 - index
            else:
                counts[step, index] += 1
        return counts


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
                params = dict(params, jaxpr=instrumenter.kernel(params["jaxpr"]), interpret=INTERPRET)
                outs = eqn.primitive.bind(*invals, **params)
                jax.block_until_ready(outs)
                grid = tuple(params["grid_mapping"].grid)
                found.append(KernelProfile(params.get("name") or "", grid, instrumenter.nodes,
                                           instrumenter.counts(math.prod(grid))))
            elif eqn.primitive.name in ("pjit", "jit", "closed_call", "core_call"):
                sub = params["jaxpr"]
                outs = run(sub.jaxpr, sub.consts, invals)
            else:
                outs = eqn.primitive.bind(*invals, **params)
                outs = outs if eqn.primitive.multiple_results else [outs]
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    run(closed.jaxpr, closed.consts, args)
    return found

