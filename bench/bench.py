"""Benchmarks the grouped matmul (`make bench`), modeled on this CPU machine.

For each model's expert shapes, phase (decode, prefill), grouped matmul
(gate_up, down), pass (forward and both gradients) and TPU generation, it
reports, for our kernel and for each anchor (`implementations`) on the same
shapes and routing:

- whether libtpu compiles it for that generation, and the VMEM the
  compiler allocated against the limit;
- HBM bytes and MXU-padded FLOPs counted from the kernel's own grid, block
  specs and scalar prefetch (bench/grid_walk.py);
- a modeled time read from the compiled kernel's own schedule and the grid
  walk, combined as the pipeline runs them (bench/pipeline.py); the former
  formula, max(MXU time, HBM time) + 0.35 us per step, as a cross-check.

These are MODELED figures, not TPU measurements. On a TPU, `--tpu` times
real runs of the same shapes through torch_tpu (ours) and JAX (megablox).

Writes bench/results/ragged_dot.md, .json and a heatmap per generation.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import sys
import time
from pathlib import Path

import harness  # sets up sys.path and the environment (the CPU and libtpu, or a TPU with --tpu)
from harness import BENCH  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from runtime.generations import GENERATIONS  # noqa: E402

import charts  # noqa: E402
import pipeline  # noqa: E402



@dataclasses.dataclass(frozen=True)
class MoeShape:
    model: str
    hidden: int
    intermediate: int  # per expert
    experts: int
    top_k: int
    gpt_oss_layout: bool = False  # weights stored transposed: gate_up [E, H, 2I], down [E, I, H]


# Expert shapes from the models' transformers configs (hidden_size,
# moe_intermediate_size or intermediate_size, num experts, experts per token).
MOE_SHAPES = [
    MoeShape("Qwen3-30B-A3B", 2048, 768, 128, 8),
    MoeShape("Qwen3-235B-A22B", 4096, 1536, 128, 8),
    MoeShape("Mixtral-8x7B", 4096, 14336, 8, 2),
    MoeShape("gpt-oss-20b", 2880, 2880, 32, 4, gpt_oss_layout=True),
    MoeShape("gpt-oss-120b", 2880, 2880, 128, 4, gpt_oss_layout=True),
    MoeShape("DeepSeek-V3", 7168, 2048, 256, 8),
    # hidden 2112 and intermediate 704, not multiples of 128: the model card's config as listed by
    # apxml.com/models/gemma-4-26b-a4b (the Hub is unreachable from here).
    MoeShape("Gemma 4 26B-A4B", 2112, 704, 128, 8),
    # transformers 5.22's Qwen3_5MoeTextConfig defaults, documented as Qwen/Qwen3.5-35B-A3B's.
    MoeShape("Qwen3.5-35B-A3B", 2048, 512, 256, 8),
]
# Tokens per step. "small-decode": few rows per active expert (the decode
# bytes goal's regime); "decode": 64 sequences.
PHASES = {"small-decode": 16, "decode": 64, "prefill": 8192}


def routing(shape: MoeShape, tokens: int, seed: int = 0) -> np.ndarray:
    """Group sizes of a uniform random top-k routing (k distinct experts per token)."""
    rng = np.random.default_rng(seed)
    choice = np.argsort(rng.random((tokens, shape.experts)), axis=1)[:, : shape.top_k]
    return np.bincount(choice.reshape(-1), minlength=shape.experts).astype(np.int32)


def matmuls(shape: MoeShape):
    """The experts layer's two grouped matmuls as (name, K, N): x [rows, K] -> [rows, N]."""
    return [("gate_up", shape.hidden, 2 * shape.intermediate), ("down", shape.intermediate, shape.hidden)]


# The three grouped matmuls of a training step for weights w (stored
# [G, N, K], or [G, K, N] in gpt-oss's layout) and input x [rows, K]:
# forward y = x w^T, the activations' gradient dx = dy w, and the weights'
# gradient dw[g] = dy[rows g]^T x[rows g] (x^T dy in gpt-oss's layout).
PASSES = ("fwd", "dx", "dw")


def kernel_layout(shape: MoeShape, matmul, generation: str) -> bool:
    """Whether the kernel takes this matmul's weights as [G, K, N] (gpt-oss's layout): the model's
    layout, swapped where the chip holds the weights transposed and the experts view them as held
    (`ragged_dot.ops.as_stored`: Gemma 4's gate_up_proj)."""
    _, k, n = matmul
    weights = (shape.experts, k, n) if shape.gpt_oss_layout else (shape.experts, n, k)
    from ragged_dot import ops
    order = harness.on_target(lambda: ops.stored_order(weights, jnp.bfloat16), generation)()
    return shape.gpt_oss_layout != (order == (0, 2, 1))


def pass_operands(pass_name: str, rows: int, k: int, n: int, groups: int, gpt_oss_layout: bool):
    """Operand shapes of one pass, in the order the kernel takes them:
    (lhs, weights) for fwd/dx, (a, b) of a^T b for dw."""
    weights = (groups, k, n) if gpt_oss_layout else (groups, n, k)
    dw = ((rows, k), (rows, n)) if gpt_oss_layout else ((rows, n), (rows, k))
    return {"fwd": ((rows, k), weights), "dx": ((rows, n), weights), "dw": dw}[pass_name]


SWEEP = 3  # tilings of megablox's own sweep walked and compiled per case, beside 128^3 and ours'


def implementations(pass_name: str, generation: str, a_shape, b_shape, groups: int, gpt_oss_layout: bool):
    """(impls, at_tiling): impls maps a row name to (fn(a, b, group_sizes),
    vmem limit, tiling); at_tiling maps each anchor family to the entry of
    that anchor at a given tiling.

    Anchors, each under its own rules (megablox's API takes no VMEM limit,
    so its tilings must fit Mosaic's default scoped VMEM):
    - megablox at its default tiling 128^3, at ours, and the best of a sweep
      ("megablox sweep i": the `SWEEP` tilings our block rule's model rates
      best within the default scoped VMEM; bench_one reports the fastest as
      "megablox best");
    - tokamax 0.0.12's Mosaic ragged_dot at the config it picks itself
      (its tuned table, else 128^3) and at megablox's best tiling. It runs
      megablox's kernel body inside an in-kernel pipeline: its own compiled
      schedule is read, its grid is walked as megablox's at the same tiles;
    - tpu-inference's gmm (fwd and dx; it has no weights' gradient) at the
      tiling its own table or default rule picks and at megablox's best
      tiling, with the weights in its layout [G, K, N] (an engine stores
      them so once, at load).
    An entry is (fn, vmem limit, tiling) or, for an anchor taking the
    weights in another layout, (fn, vmem limit, tiling, weights' shape).
    """
    from ragged_dot import ops, tuning

    megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
    scoped = GENERATIONS[generation].scoped_vmem_default
    rows = a_shape[0]
    if pass_name == "dw":
        p, q = a_shape[1], b_shape[1]
        blocks = tuning.choose_weight_grad_blocks(rows, p, q, groups, generation)
        limit = tuning.vmem_limit(tuning.weight_grad_buffers(blocks, 2), generation)
        ours = lambda a, b, g: ops._weight_grad(a, b, g, jnp.bfloat16, generation, False)
        anchor = lambda t: lambda a, b, g: megablox.tgmm(a.T, b, g, jnp.bfloat16, tiling=t)
        ranked = tuning.ranked_blocks("weight_grad", rows, p, q, groups, generation, 2, scoped)
    else:
        # Weights [G, N, K] are contracted on their last dim in fwd; gpt-oss's in dx.
        transpose = (pass_name == "fwd") != gpt_oss_layout
        out_n = b_shape[1] if transpose else b_shape[2]
        blocks = tuning.choose_blocks(rows, a_shape[1], out_n, groups, generation, transpose_rhs=transpose)
        limit = tuning.vmem_limit(tuning.forward_buffers(blocks, 2), generation)
        ours = lambda x, w, g: ops.ragged_dot(x, w, g, transpose_rhs=transpose, generation=generation,
                                              interpret=False)
        anchor = lambda t: lambda x, w, g: megablox.gmm(x, w, g, jnp.bfloat16, tiling=t, transpose_rhs=transpose)
        ranked = tuning.ranked_blocks("forward", rows, a_shape[1], out_n, groups, generation, 2, scoped, transpose)
    tiles = lambda b: (b.block_m, b.block_k, b.block_n)
    tiling = tiles(blocks)
    at_tiling = {"megablox": lambda t: (anchor(t), scoped, t)}
    impls = {
        "ours": (ours, limit, tiling),
        "megablox 128^3": at_tiling["megablox"]((128, 128, 128)),
        "megablox ours' tiles": at_tiling["megablox"](tiling),
    }
    sweep = [t for t in dict.fromkeys(tiles(b) for b in ranked if not b.windows_at_group_start)
             if t not in ((128, 128, 128), tiling)][:SWEEP]
    impls.update({f"megablox sweep {i}": at_tiling["megablox"](t) for i, t in enumerate(sweep)})
    if pass_name != "dw":
        at_tiling["tokamax"] = lambda t: (_tokamax(transpose, t), scoped, t)
        impls["tokamax"] = at_tiling["tokamax"](_tokamax_tiling(a_shape, b_shape, transpose))
        tpu_inference = _tpu_inference_gmm()
        if tpu_inference is not None:
            # Its weights are [G, K, N]: an engine stores them so once, at load time.
            groups_, rest = b_shape[0], b_shape[1:]
            k_n = rest[::-1] if transpose else rest
            at_tiling["tpu-inference"] = lambda t: (
                lambda x, w, g: tpu_inference.gmm(x, w, g, jnp.bfloat16, tiling=t), scoped, t, (groups_, *k_n))
            impls["tpu-inference"] = at_tiling["tpu-inference"](tpu_inference.tiling_for(rows, *k_n, groups_))
    return impls, at_tiling


@functools.cache
def _tpu_inference_gmm():
    """vLLM's TPU grouped matmul (tpu-inference 0.32.0, a megablox fork with
    its own tuned table), loaded from its files: its package imports vLLM,
    which the bench does not install. None where it is not installed."""
    import types

    import tpu_inference_kernels

    if not tpu_inference_kernels.installed():
        return None
    gmm = tpu_inference_kernels.module("kernels.megablox.gmm")
    tuned = tpu_inference_kernels.module("kernels.megablox.tuned_block_sizes")
    tiling_for = lambda m, k, n, g: tuple(tuned.get_tuned_block_sizes(m, k, n, g, g, "bfloat16", "bfloat16", k))
    return types.SimpleNamespace(gmm=gmm.gmm, tiling_for=tiling_for)


def _tokamax_numbers(transpose_rhs: bool):
    return jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2 if transpose_rhs else 1]), ([], [])),
        lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def _tokamax_tiling(a_shape, b_shape, transpose_rhs: bool):
    """The tiles tokamax's Mosaic ragged_dot picks for these shapes (its tuned
    table, else its default); 128^3 where tokamax is not installed."""
    try:
        from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu
    except ImportError:
        return (128, 128, 128)
    spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    op = pallas_mosaic_tpu.PallasMosaicTpuRaggedDot()
    bound = op.bind(spec(a_shape), spec(b_shape), group_sizes=spec(b_shape[:1], jnp.int32),
                    ragged_dot_dimension_numbers=_tokamax_numbers(transpose_rhs))
    config = op._get_heuristics_config(bound)
    if config.input_buffer_count != 2:  # the pipeline model is double-buffered
        raise NotImplementedError(f"tokamax picks {config.input_buffer_count} input buffers")
    return config.tile_m, config.tile_k, config.tile_n


def _tokamax(transpose_rhs: bool, tiling):
    """tokamax's Mosaic ragged_dot at the given tiles."""
    numbers = _tokamax_numbers(transpose_rhs)

    def call(x, w, g):
        import tokamax  # requirements-bench.txt; only needed to compile it
        from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu

        tile_m, tile_k, tile_n = tiling
        config = pallas_mosaic_tpu.Config(tile_m=tile_m, tile_k=tile_k, tile_n=tile_n)
        op = pallas_mosaic_tpu.PallasMosaicTpuRaggedDot(config=config)
        return tokamax.ragged_dot_general(x, w, g, numbers, implementation=op)

    return call


STEP_OVERHEAD_S = 0.35e-6  # the formula's fixed cost per grid step (Pallas's TPU guide)


def formula_time(gen, flops: float, hbm_bytes: float, grid_steps: int, parallel_tiles: int) -> dict:
    """The former model (seconds): max(MXU time, HBM time) plus a fixed cost
    per grid step; a "parallel" axis shorter than the core count idles cores."""
    cores = min(gen.cores_per_device, parallel_tiles)
    mxu = flops / (gen.bf16_flops * cores / gen.cores_per_device)
    hbm = hbm_bytes / gen.hbm_bytes_per_s
    steps = grid_steps / cores * STEP_OVERHEAD_S
    return {"mxu": mxu, "hbm": hbm, "steps": steps, "total": max(mxu, hbm) + steps}


def modeled_seconds(cost, generation: str, parallel_extent: int, copy_bytes: int = 0) -> dict:
    """The formula model (max(MXU, HBM) + a fixed cost per step) applied to a
    walked kernel's counts, plus the padding copies outside it (at full
    bandwidth, not overlapped). Kept as a cross-check of the schedule model:
    the bench's `formula_us`, and the tuning records' `formula_us`."""
    gen = GENERATIONS[generation]
    parts = formula_time(gen, cost.mxu_flops, cost.hbm_bytes, cost.grid_steps, parallel_extent)
    parts["copy"] = copy_bytes / gen.hbm_bytes_per_s
    parts["total"] += parts["copy"]
    return {f"{'modeled' if key == 'total' else key}_us": value * 1e6 for key, value in parts.items()}


# Names of the Pallas kernels in libtpu's report: ours, megablox's, tokamax's and tpu-inference's.
KERNEL_NAMES = ("ragged_dot_tpu", "gmm", "tgmm")


def schedule_fields(m: "harness.Measurement") -> dict:
    """A row's schedule-model fields (us), with its kernel's schedule figures."""
    schedule = m.kernel_schedules[0]
    figures = m.figures()
    return dict({k: figures[k] for k in ("modeled_us", "kernel_us", "around_us", "compute_us", "dma_us",
                                         "fill_drain_us", "regions_mapped")},
                bundles=schedule.bundles, step_cycles_max=schedule.iteration_cycles,
                matmuls_per_step=schedule.matmuls, weight_pushes_per_step=schedule.weight_pushes)


IMPLS = ("ours", "megablox 128^3", "megablox ours' tiles", "megablox best", "tokamax", "tpu-inference")
# Our rows from the last run before ragged-dot v2's forward (kept, not re-run: that kernel is gone),
# beside which the bench shows the redesign.
V1 = "ours v1"


def bench_one(shape: MoeShape, phase: str, matmul, pass_name: str, generation: str, compile_check: bool,
              only=IMPLS):
    name, k, n = matmul
    tokens = PHASES[phase]
    rows = tokens * shape.top_k
    sizes = routing(shape, tokens)
    layout = kernel_layout(shape, matmul, generation)
    a_shape, b_shape = pass_operands(pass_name, rows, k, n, shape.experts, layout)
    args = (jax.ShapeDtypeStruct(a_shape, jnp.bfloat16), jax.ShapeDtypeStruct(b_shape, jnp.bfloat16), jnp.asarray(sizes))
    active = int((sizes > 0).sum())
    out_elems = shape.experts * k * n if pass_name == "dw" else rows * (k if pass_name == "dx" else n)
    in_elems = rows * (k + n) if pass_name == "dw" else rows * a_shape[1] + active * k * n
    impls, at_tiling = implementations(pass_name, generation, a_shape, b_shape, shape.experts, layout)
    walks = {}  # megablox's walk per tiling: tokamax's is the same grid

    def measure(impl, fn, vmem_limit, tiling, *rhs_shape) -> dict:
        impl_args = (args[0], jax.ShapeDtypeStruct(rhs_shape[0], jnp.bfloat16), args[2]) if rhs_shape else args
        row = dict(model=shape.model, phase=phase, tokens=tokens, matmul=name, pass_=pass_name,
                   generation=generation, impl=impl, tiling="x".join(map(str, tiling)), rows=rows, K=k, N=n,
                   groups=shape.experts, active_groups=active, vmem_limit=vmem_limit,
                   min_bytes=2 * (in_elems + out_elems), min_flops=2 * rows * k * n)
        cost = report = None
        try:
            if family(impl) in ("ours", "tpu-inference"):
                (cost,), copies = harness.walk(fn, impl_args, generation)
            else:  # megablox's kernel (tokamax's too: see implementations), walked once per tiling
                if tiling not in walks:
                    walks[tiling] = harness.walk(at_tiling["megablox"](tiling)[0], args, generation)
                (cost,), copies = walks[tiling]
                cost = as_tokamax(cost) if family(impl) == "tokamax" else cost
            formula = modeled_seconds(cost, generation, cost.grid[0], copies)
            row.update(hbm_bytes=cost.hbm_bytes + copies, mxu_flops=cost.mxu_flops, grid=list(cost.grid),
                       grid_steps=cost.grid_steps, formula_us=formula.pop("modeled_us"), **formula)
        except Exception as err:  # noqa: BLE001  (a row says what failed)
            row.update(error=f"walk: {str(err).splitlines()[0][:160]}")
        if compile_check:
            try:
                report = harness.compile(fn, impl_args, generation)
                row.update(compiles=True, vmem_used=harness.vmem_used(report, KERNEL_NAMES))
            except Exception as err:  # noqa: BLE001
                row.update(compiles=False, error=f"compile: {str(err).splitlines()[0][:160]}")
        if cost is not None and report is not None:
            try:
                row.update(schedule_fields(harness.model([cost], report, generation, copies)))
            except Exception as err:  # noqa: BLE001
                row.update(error=f"schedule: {str(err).splitlines()[0][:160]}")
        return row

    wanted = lambda impl: family(impl) == "megablox" and "megablox best" in only or impl.split(" sweep")[0] in only
    results = [measure(impl, *entry) for impl, entry in impls.items() if wanted(impl)]
    # tokamax and tpu-inference run megablox's kernel body (or a fork of it): each also gets the
    # tiling megablox's sweep found best.
    megablox_best = fastest(r for r in results if family(r["impl"]) == "megablox")
    for anchor in ("tokamax", "tpu-inference"):
        own = [r for r in results if r["impl"] == anchor]
        if own and megablox_best is not None and megablox_best["tiling"] != own[0]["tiling"]:
            tiling = tuple(map(int, megablox_best["tiling"].split("x")))
            results.append(measure(f"{anchor} sweep 0", *at_tiling[anchor](tiling)))
    return best_of_sweep(results, only)


def family(impl: str) -> str:
    """The kernel a row runs: ours, megablox, tokamax or tpu-inference."""
    return impl.split(" ")[0]


def fastest(rows) -> dict | None:
    """The row with the lowest modeled time among those that compile."""
    ok = [r for r in rows if r.get("compiles") is not False and "modeled_us" in r]
    return min(ok, key=lambda r: r["modeled_us"]) if ok else None


def as_tokamax(cost):
    """megablox's walked grid as tokamax runs it: inside one grid-less
    pallas_call (an in-kernel pipeline), so no axis is split over a v5p
    megacore's two cores."""
    return dataclasses.replace(cost, dimension_semantics=("arbitrary",) * len(cost.grid))


def best_of_sweep(rows: list[dict], only) -> list[dict]:
    """Replaces each anchor's sweep rows by one row: "megablox best", the
    fastest megablox row that compiles (128^3 and ours' tiles count too);
    "tokamax" and "tpu-inference", the faster of their own pick and
    megablox's best tiling. Each keeps every tiling tried and its modeled
    time (`candidates`) and the anchor's own pick (`own_tiling`)."""
    kept = [r for r in rows if " sweep " not in r["impl"] and r["impl"] in only]
    for anchor, label in (("megablox", "megablox best"), ("tokamax", "tokamax"), ("tpu-inference", "tpu-inference")):
        tried = [r for r in rows if family(r["impl"]) == anchor]
        if label not in only or not tried:
            continue
        best = dict(fastest(tried) or dict(tried[0], error="no tiling compiles"))
        best.update(impl=label, own_tiling=tried[0]["tiling"],
                    candidates={r["tiling"]: round(r["modeled_us"], 2) if fastest([r]) else None for r in tried})
        kept = [r for r in kept if r["impl"] != label] + [best]
    return kept


def case_of(r: dict) -> tuple:
    """The benchmark case a row measures; with its implementation, the row's identity."""
    return r["model"], r["phase"], r["matmul"], r["pass_"], r["generation"]


def ratio_rows(results: list[dict]) -> None:
    """Sets ours / best anchor (modeled time), ours / roofline and ours / v1
    on our rows, from the rows present now (a ratio left from earlier rows is
    dropped)."""
    best_anchor = {}
    for r in results:
        # An anchor that libtpu refuses (megablox takes no VMEM limit: our larger tiles can overflow its
        # default scoped VMEM) is no competitor.
        if family(r["impl"]) != "ours" and "modeled_us" in r and r.get("compiles") is not False:
            if r["modeled_us"] < best_anchor.get(case_of(r), {}).get("modeled_us", float("inf")):
                best_anchor[case_of(r)] = r
    summary_keys = ("impl", "tiling", "modeled_us", "compute_us", "grid_steps", "step_cycles_max",
                    "weight_pushes_per_step")
    v1 = {case_of(r): r for r in results if r["impl"] == V1 and "modeled_us" in r}
    for r in results:
        if r["impl"] == "ours":
            r.pop("ratio_vs_best_anchor", None)
            r.pop("best_anchor", None)
            r.pop("ratio_vs_v1", None)
        if r["impl"] == "ours" and "modeled_us" in r and case_of(r) in v1:
            r["ratio_vs_v1"] = r["modeled_us"] / v1[case_of(r)]["modeled_us"]
        if r["impl"] == "ours" and "modeled_us" in r and case_of(r) in best_anchor:
            best = best_anchor[case_of(r)]
            r["ratio_vs_best_anchor"] = r["modeled_us"] / best["modeled_us"]
            r["best_anchor"] = {k: best.get(k) for k in summary_keys}
        if r["impl"] == "ours" and "modeled_us" in r:
            gen = GENERATIONS[r["generation"]]
            bound = max(r["min_flops"] / gen.bf16_flops, r["min_bytes"] / gen.hbm_bytes_per_s) * 1e6
            r["vs_roofline"] = r["modeled_us"] / bound


def row_order(r: dict):
    """Table order: model, phase, matmul, pass, generation, implementation."""
    models = [s.model for s in MOE_SHAPES]
    return (models.index(r["model"]), list(PHASES).index(r["phase"]), r["matmul"] != "gate_up",
            PASSES.index(r["pass_"]), list(GENERATIONS).index(r["generation"]), (*IMPLS, V1).index(r["impl"]))


def write_markdown(results: list[dict], path: Path) -> None:
    results = sorted(results, key=row_order)
    mib = lambda b: f"{b / 2**20:.1f}" if b is not None else "-"
    num = lambda r, key, fmt=".1f": format(r[key], fmt) if key in r else "-"
    lines = [
        "# ragged_dot: modeled performance (NOT measured on a TPU)",
        "",
        "Every figure here comes from a CPU machine and the compiler. Modeled time is read from the",
        "compiled kernel itself (bench/pipeline.py): libtpu's final VLIW bundles give each grid step's",
        "issue cycles (the `pl.when` bodies a step skips are left out), the grid walk gives the bytes",
        "each step fetches and writes back, and the two are combined as the double-buffered pipeline",
        "runs them; XLA's ops around the kernel (routing metadata, padding) add their scheduled cycles.",
        "bench/results/calibration.md compares the model with every public TPU measurement we could",
        "reproduce. `formula us` is the earlier model (max(MXU, HBM) + 0.35 us per step), kept as a",
        "cross-check. Routing: uniform random top-k (seed 0).",
        "",
        "Anchors, each under its own rules: megablox `gmm`/`tgmm` at 128^3, at our tiles, and the best",
        "of a sweep (`megablox best`: 128^3, ours' and the 3 tilings our block rule's model rates best",
        "within Mosaic's default scoped VMEM, which megablox's API cannot raise); tokamax 0.0.12's Mosaic",
        "ragged_dot, the faster of the config it picks (its tuned table, else 128^3) and megablox's best",
        "tiling (it runs on one core of a v5p megacore; its schedule's regions do not map to its body, so",
        "its rows count every region as running: an upper bound); tpu-inference 0.32.0's gmm (fwd and",
        "dx), the faster of the tiling its own table picks and megablox's best, with the weights in its",
        "layout. `candidates` in the JSON lists each tiling tried. An anchor libtpu refuses is no",
        "competitor; a row with no compiling anchor is n/a.",
        "",
        "Passes: fwd y = x w^T; dx = dy w (activations' gradient); dw = dy^T x per group (weights').",
        "`min MiB`: each input and output once, inactive experts' weights never; `roofline` = our modeled",
        "time / max(FLOPs at peak, min bytes at full bandwidth).",
        "",
        "`ours v1`: our rows from the last run of ragged-dot v1 (its forward multiplied each tile in 128-row",
        "sub-blocks, a weight push each; its routing metadata used searches and gathers), kept beside v2's",
        "whole-tile forward: `ours / v1` in the summary.",
        "",
        "## Summary",
        "",
    ] + summary_lines(results) + ["", "## Goals", ""] + goal_lines(results) + [
        "",
        "## Every row",
        "",
        "| model | phase | matmul | pass | gen | impl | tiles m x k x n | compiles | VMEM MiB used / limit "
        "| HBM MiB | min MiB | grid steps | bundles | step cycles (all run) | vmatmul / push per step "
        "| compute us | DMA us | around us | modeled us | formula us | ratio | roofline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        compiles = {True: "yes", False: "NO", None: "-"}[r.get("compiles")]
        lines.append(
            f"| {r['model']} | {r['phase']} ({r['tokens']} tok) | {r['matmul']} | {r['pass_']} | {r['generation']} "
            f"| {r['impl']} | {r['tiling']} | {compiles} | {mib(r.get('vmem_used'))} / {mib(r['vmem_limit'])} "
            f"| {mib(r.get('hbm_bytes'))} | {mib(r['min_bytes'])} | {r.get('grid_steps', '-')} "
            f"| {r.get('bundles', '-')} | {r.get('step_cycles_max', '-')} "
            f"| {r.get('matmuls_per_step', '-')} / {r.get('weight_pushes_per_step', '-')} "
            f"| {num(r, 'compute_us')} | {num(r, 'dma_us')} | {num(r, 'around_us')} | {num(r, 'modeled_us')} "
            f"| {num(r, 'formula_us')} | {num(r, 'ratio_vs_best_anchor', '.2f')} | {num(r, 'vs_roofline', '.2f')} |"
        )
    errors = [r for r in results if "error" in r]
    if errors:
        lines += ["", "## Failures", ""]
        lines += [f"- {r['model']} {r['phase']} {r['matmul']} {r['pass_']} {r['generation']} {r['impl']}: {r['error']}"
                  for r in errors]
    path.write_text("\n".join(lines) + "\n")


def summary_lines(results: list[dict]) -> list[str]:
    """Per generation and pass: how our modeled time compares with the best
    anchor's and with the roofline."""
    ours = [r for r in results if r["impl"] == "ours" and "modeled_us" in r]
    lines = ["| gen | pass | rows | ours <= best anchor | n/a (no anchor) | geomean ours / best anchor "
             "| worst | geomean ours / roofline | geomean ours / v1 (worst) |", "|---|---|---|---|---|---|---|---|---|"]
    geomean = lambda xs: float(np.exp(np.mean(np.log(xs)))) if xs else float("nan")
    for generation in GENERATIONS:
        for pass_name in PASSES:
            rows = [r for r in ours if r["generation"] == generation and r["pass_"] == pass_name]
            if not rows:
                continue
            ratios = [r["ratio_vs_best_anchor"] for r in rows if "ratio_vs_best_anchor" in r]
            vs_v1 = [r["ratio_vs_v1"] for r in rows if "ratio_vs_v1" in r]
            lines.append(
                f"| {generation} | {pass_name} | {len(rows)} | {sum(x <= 1 + 1e-9 for x in ratios)} "
                f"| {len(rows) - len(ratios)} | {geomean(ratios):.2f} | {max(ratios, default=float('nan')):.2f} "
                f"| {geomean([r['vs_roofline'] for r in rows]):.2f} "
                + (f"| {geomean(vs_v1):.2f} ({max(vs_v1):.2f}) |" if vs_v1 else "| - (not re-run since v1) |"))
    unmapped = {}
    for r in results:
        if r.get("regions_mapped") is False:
            unmapped[r["impl"]] = unmapped.get(r["impl"], 0) + 1
    if unmapped:
        lines += ["", "Rows whose schedule regions could not be matched to the kernel's `pl.when` bodies count every "
                  "region as running (an upper bound on compute): "
                  + ", ".join(f"{impl} {n}" for impl, n in sorted(unmapped.items())) + "."]
    return lines


def goal_lines(results: list[dict]) -> list[str]:
    """Each performance goal (issue 3): met, missed (and why), or n/a."""
    ours = [r for r in results if r["impl"] == "ours" and "modeled_us" in r]
    name = lambda r: f"{r['model']} {r['phase']} ({r['rows']} rows, {r['active_groups']} active) {r['matmul']} " \
        f"{r['pass_']} {r['generation']}"
    anchor_rows = [r for r in ours if r["generation"] in ("v6e", "tpu7x")]
    goals = [
        ("modeled time <= best anchor (v6e, tpu7x)",
         [r for r in anchor_rows if "ratio_vs_best_anchor" in r],
         lambda r: r["ratio_vs_best_anchor"] <= 1.0 + 1e-9, anchor_why),
        ("decode, <= 4 rows per active expert: HBM bytes <= 1.1x minimum",
         [r for r in ours if r["phase"].endswith("decode") and r["rows"] <= 4 * r["active_groups"]],
         lambda r: r["hbm_bytes"] <= 1.1 * r["min_bytes"], lambda r: f"{r['hbm_bytes'] / r['min_bytes']:.3f}x"),
        ("prefill 8192 tokens: modeled time <= 1.25x roofline",
         [r for r in ours if r["phase"] == "prefill" and r["tokens"] == 8192],
         lambda r: r["vs_roofline"] <= 1.25, roofline_why),
    ]
    lines = []
    for title, rows, ok, value in goals:
        misses = [r for r in rows if not ok(r)]
        lines.append(f"- {title}: {len(rows) - len(misses)} of {len(rows)} rows meet it"
                     + ("." if not misses else "; not met:"))
        lines += [f"  - {name(r)}: {value(r)}" for r in misses]
    no_anchor = [r for r in anchor_rows if "ratio_vs_best_anchor" not in r]
    if no_anchor:
        lines.append(f"- n/a, no anchor compiles: {len(no_anchor)} rows")
        lines += [f"  - {name(r)}" for r in no_anchor]
    return lines


def anchor_why(r: dict) -> str:
    """Where our time goes next to the best anchor's: issue cycles of a full
    step and the MXU weight pushes they hold."""
    best = r.get("best_anchor") or {}
    return (f"{r['ratio_vs_best_anchor']:.3f}x {best.get('impl', '')} {best.get('tiling', '')}: ours {r['modeled_us']:.0f} us "
            f"(compute {r['compute_us']:.0f}, DMA {r['dma_us']:.0f}; {r['grid_steps']} steps of up to "
            f"{r['step_cycles_max']} cycles, {r['weight_pushes_per_step']} weight pushes), anchor "
            f"{best.get('modeled_us', float('nan')):.0f} us (compute {best.get('compute_us', float('nan')):.0f}; "
            f"{best.get('grid_steps', '-')} steps of up to {best.get('step_cycles_max', '-')} cycles, "
            f"{best.get('weight_pushes_per_step', '-')} weight pushes)")


def roofline_why(r: dict) -> str:
    """Where a row's modeled time goes beyond the roofline."""
    gen = GENERATIONS[r["generation"]]
    ideal_mxu_us = r["min_flops"] / gen.bf16_flops * 1e6
    ideal_hbm_us = r["min_bytes"] / gen.hbm_bytes_per_s * 1e6
    return (f"{r['vs_roofline']:.2f}x: compute {r['compute_us']:.0f} us against {ideal_mxu_us:.0f} at peak, "
            f"DMA {r['dma_us']:.0f} us against {ideal_hbm_us:.0f} for the minimum bytes, around "
            f"{r['around_us']:.0f} us ({r['rows'] / r['active_groups']:.0f} rows per active group)")


def run_on_tpu(shapes, phases, repeats: int = 20) -> list[dict]:
    """Wall-clock times on a real TPU (run this on a TPU VM)."""
    import torch  # torch_tpu must autoload: do not set TORCH_DEVICE_BACKEND_AUTOLOAD=0 for --tpu

    import ragged_dot

    gmm = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm").gmm
    rows_out = []
    for shape in shapes:
        for phase in phases:
            tokens = PHASES[phase]
            sizes = routing(shape, tokens)
            for name, k, n in matmuls(shape):
                rows = tokens * shape.top_k
                lhs = torch.randn(rows, k, dtype=torch.bfloat16, device="tpu")
                rhs = torch.randn(shape.experts, n, k, dtype=torch.bfloat16, device="tpu") / k**0.5
                group_sizes = torch.from_numpy(sizes).to("tpu")
                run = lambda: ragged_dot.ragged_dot(lhs, rhs, group_sizes, transpose_rhs=True)
                jl, jr, jg = (jnp.asarray(x.cpu().float().numpy(), d) for x, d in
                              ((lhs, jnp.bfloat16), (rhs, jnp.bfloat16), (group_sizes, jnp.int32)))
                anchor = jax.jit(lambda a, b, c: gmm(a, b, c, jnp.bfloat16, transpose_rhs=True))
                for impl, fn, sync in (("ours", run, torch.accelerator.synchronize),
                                       ("megablox", lambda: anchor(jl, jr, jg), None)):
                    out = fn()
                    (sync() if sync else jax.block_until_ready(out))
                    start = time.perf_counter()
                    for _ in range(repeats):
                        out = fn()
                    (sync() if sync else jax.block_until_ready(out))
                    us = (time.perf_counter() - start) / repeats * 1e6
                    rows_out.append(dict(model=shape.model, phase=phase, matmul=name, impl=impl, measured_us=us))
                    print(f"{shape.model} {phase} {name} {impl}: {us:.1f} us (measured)", flush=True)
    return rows_out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=[s.model for s in MOE_SHAPES])
    parser.add_argument("--phases", nargs="*", default=list(PHASES), choices=list(PHASES))
    parser.add_argument("--generations", nargs="*", default=list(GENERATIONS), choices=list(GENERATIONS))
    parser.add_argument("--passes", nargs="*", default=list(PASSES), choices=list(PASSES))
    parser.add_argument("--no-compile", action="store_true",
                        help="skip libtpu compiles: only the formula cross-check, no schedule model")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    parser.add_argument("--tpu", action="store_true", help="time real runs on a TPU (needs one)")
    parser.add_argument("--impls", nargs="*", default=list(IMPLS), choices=list(IMPLS))
    parser.add_argument("--merge", nargs="+", type=Path, default=[],
                        help="only merge these results JSON files (of runs with other --out) into --out")
    args = parser.parse_args(argv)
    sys.argv = sys.argv[:1]  # tokamax parses absl flags from sys.argv on first use
    shapes = [s for s in MOE_SHAPES if s.model in args.models]
    args.out.mkdir(parents=True, exist_ok=True)

    results = harness.Results(args.out / "ragged_dot.json", key=lambda r: (*case_of(r), r["impl"]), order=row_order)
    for path in args.merge:
        results.merge(path)

    def write() -> None:
        ratio_rows(results.rows)
        results.save()
        write_markdown(results.rows, args.out / "ragged_dot.md")

    if args.merge:
        write()
        charts.write("ragged_dot", results.rows, args.out)
        return 0

    if args.tpu:
        measured = run_on_tpu(shapes, args.phases)
        harness.write_atomically(args.out / "ragged_dot_tpu_measured.json", json.dumps(measured, indent=1))
        return 0

    cases = [(s, p, m, ps, g) for s in shapes for p in args.phases for m in matmuls(s) for ps in args.passes
             for g in args.generations]
    start = time.perf_counter()
    for i, (shape, phase, matmul, pass_name, generation) in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {shape.model} {phase} {matmul[0]} {pass_name} {generation} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
        # The case's rows of the implementations run replace their namesakes; every other row is kept.
        results.put(*bench_one(shape, phase, matmul, pass_name, generation, compile_check=not args.no_compile,
                               only=args.impls), save=False)
        write()
    charts.write("ragged_dot", results.rows, args.out)
    print(f"wrote {args.out / 'ragged_dot.md'}, .json and a chart per generation: MODELED figures, not TPU "
          "measurements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
