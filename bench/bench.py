"""Benchmarks the grouped matmul (`make bench`), modeled on this CPU machine.

For each model's expert shapes, phase (decode, prefill), grouped matmul
(gate_up, down) and TPU generation, it reports, for our kernel and for jax's
megablox `gmm` on the same shapes and routing:

- whether libtpu compiles it for that generation, and the VMEM the
  compiler allocated against the limit;
- HBM bytes and MXU-padded FLOPs counted from the kernel's own grid, block
  specs and scalar prefetch (bench/grid_walk.py);
- a modeled time: max(MXU time, HBM time) + 0.35 us per grid step.

These are MODELED figures, not TPU measurements. On a TPU, `--tpu` times
real runs of the same shapes through torch_tpu (ours) and JAX (megablox).

Writes bench/results/ragged_dot.md, .json and .png.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(REPO), str(REPO / "kernels"), str(BENCH)]
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
if "--tpu" not in sys.argv:
    os.environ["JAX_PLATFORMS"] = "cpu"
    import tpu_compile

    tpu_compile.configure_environment()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from runtime.generations import GENERATIONS, modeled_time  # noqa: E402



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


def pass_operands(pass_name: str, rows: int, k: int, n: int, groups: int, gpt_oss_layout: bool):
    """Operand shapes of one pass, in the order the kernel takes them:
    (lhs, weights) for fwd/dx, (a, b) of a^T b for dw."""
    weights = (groups, k, n) if gpt_oss_layout else (groups, n, k)
    dw = ((rows, k), (rows, n)) if gpt_oss_layout else ((rows, n), (rows, k))
    return {"fwd": ((rows, k), weights), "dx": ((rows, n), weights), "dw": dw}[pass_name]


def implementations(pass_name: str, generation: str, a_shape, b_shape, groups: int, gpt_oss_layout: bool):
    """name -> (fn(a, b, group_sizes), vmem limit, tiling, kernel names in
    libtpu's report). Anchors use megablox's default tiling (128, 128, 128)
    and ours; tokamax 0.0.12's Mosaic ragged_dot is megablox's kernel run
    inside an in-kernel pipeline, so its grid cannot be walked: it is
    compiled (VMEM) and its traffic is that of megablox at the same tiling."""
    from ragged_dot import ops, tuning

    megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
    scoped = GENERATIONS[generation].scoped_vmem_default
    rows = a_shape[0]
    if pass_name == "dw":
        blocks = tuning.choose_weight_grad_blocks(rows, a_shape[1], b_shape[1], groups, generation)
        tiling = (blocks.block_m, blocks.block_k, blocks.block_n)
        limit = tuning.vmem_limit(tuning.weight_grad_buffers(blocks, 2), generation)
        ours = lambda a, b, g: ops._weight_grad(a, b, g, jnp.bfloat16, generation, False)
        anchor = lambda t: lambda a, b, g: megablox.tgmm(a.T, b, g, jnp.bfloat16, tiling=t)
    else:
        # Weights [G, N, K] are contracted on their last dim in fwd; gpt-oss's in dx.
        transpose = (pass_name == "fwd") != gpt_oss_layout
        out_n = b_shape[1] if transpose else b_shape[2]
        blocks = tuning.choose_blocks(rows, a_shape[1], out_n, groups, generation)
        tiling = (blocks.block_m, blocks.block_k, blocks.block_n)
        limit = tuning.vmem_limit(tuning.forward_buffers(blocks, 2), generation)
        ours = lambda x, w, g: ops.ragged_dot(x, w, g, transpose_rhs=transpose, generation=generation,
                                              interpret=False)
        anchor = lambda t: lambda x, w, g: megablox.gmm(x, w, g, jnp.bfloat16, tiling=t, transpose_rhs=transpose)
    impls = {
        "ours": (ours, limit, tiling),
        "megablox 128^3": (anchor((128, 128, 128)), scoped, (128, 128, 128)),
        "megablox ours' tiles": (anchor(tiling), scoped, tiling),
    }
    if pass_name != "dw":
        impls["tokamax 128^3"] = (_tokamax(transpose), scoped, (128, 128, 128))
    return impls


def _tokamax(transpose_rhs: bool):
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2 if transpose_rhs else 1]), ([], [])),
        lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])

    def call(x, w, g):
        import tokamax  # requirements-bench.txt; only needed to compile it

        return tokamax.ragged_dot_general(x, w, g, numbers, implementation="mosaic")

    return call


def modeled_seconds(cost, generation: str, parallel_extent: int, copy_bytes: int = 0) -> dict:
    """The shared performance model applied to a walked kernel's counts, plus
    the padding copies outside it (at full bandwidth, not overlapped)."""
    gen = GENERATIONS[generation]
    parts = modeled_time(gen, cost.mxu_flops, cost.hbm_bytes, cost.grid_steps, parallel_extent)
    parts["copy"] = copy_bytes / gen.hbm_bytes_per_s
    parts["total"] += parts["copy"]
    return {f"{'modeled' if key == 'total' else key}_us": value * 1e6 for key, value in parts.items()}


IMPLS = ("ours", "megablox 128^3", "megablox ours' tiles", "tokamax 128^3")


def bench_one(shape: MoeShape, phase: str, matmul, pass_name: str, generation: str, compile_check: bool,
              only=IMPLS):
    import grid_walk

    name, k, n = matmul
    tokens = PHASES[phase]
    rows = tokens * shape.top_k
    sizes = routing(shape, tokens)
    gen = GENERATIONS[generation]
    a_shape, b_shape = pass_operands(pass_name, rows, k, n, shape.experts, shape.gpt_oss_layout)
    args = (jax.ShapeDtypeStruct(a_shape, jnp.bfloat16), jax.ShapeDtypeStruct(b_shape, jnp.bfloat16), jnp.asarray(sizes))
    active = int((sizes > 0).sum())
    out_elems = shape.experts * k * n if pass_name == "dw" else rows * (k if pass_name == "dx" else n)
    in_elems = rows * (k + n) if pass_name == "dw" else rows * a_shape[1] + active * k * n
    results = []
    impls = implementations(pass_name, generation, a_shape, b_shape, shape.experts, shape.gpt_oss_layout)
    for impl, (fn, vmem_limit, tiling) in impls.items():
        if impl not in only:
            continue
        row = dict(model=shape.model, phase=phase, tokens=tokens, matmul=name, pass_=pass_name,
                   generation=generation, impl=impl, tiling="x".join(map(str, tiling)), rows=rows, K=k, N=n,
                   groups=shape.experts, active_groups=active, vmem_limit=vmem_limit,
                   min_bytes=2 * (in_elems + out_elems), min_flops=2 * rows * k * n)
        walked = impl.replace("tokamax", "megablox")  # same kernel and grid (see implementations)
        try:
            walk_fn = impls[walked][0] if walked in impls else fn
            (cost,), copies = grid_walk.kernel_costs_and_copies(walk_fn, args, gen.mxu_width)
            row.update(hbm_bytes=cost.hbm_bytes + copies, mxu_flops=cost.mxu_flops, grid=list(cost.grid),
                       grid_steps=cost.grid_steps, **modeled_seconds(cost, generation, cost.grid[0], copies))
        except Exception as err:  # noqa: BLE001  (a row says what failed)
            row.update(error=f"walk: {str(err).splitlines()[0][:160]}")
        if compile_check:
            try:
                report = tpu_compile.compile_for(fn, [(x.shape, x.dtype) for x in args], generation, "")
                kernels = [r for op, r in report.kernels.items() if any(s in op for s in ("gmm", "ragged_dot"))]
                row.update(compiles=True, vmem_used=max((r.vmem_bytes for r in kernels), default=None),
                           bundles=sum(r.bundles or 0 for r in kernels) or None)
            except Exception as err:  # noqa: BLE001
                row.update(compiles=False, error=f"compile: {str(err).splitlines()[0][:160]}")
        results.append(row)
    return results


def case_of(r: dict) -> tuple:
    """The benchmark case a row measures; with its implementation, the row's identity."""
    return r["model"], r["phase"], r["matmul"], r["pass_"], r["generation"]


def ratio_rows(results: list[dict]) -> None:
    """Sets ours / best anchor (modeled time) and ours / roofline on our rows,
    from the rows present now (a ratio left from earlier rows is dropped)."""
    best_anchor = {}
    for r in results:
        # An anchor that libtpu refuses (megablox takes no VMEM limit: our larger tiles can overflow its
        # default scoped VMEM) is no competitor.
        if r["impl"] != "ours" and "modeled_us" in r and r.get("compiles") is not False:
            best_anchor[case_of(r)] = min(best_anchor.get(case_of(r), float("inf")), r["modeled_us"])
    for r in results:
        if r["impl"] == "ours":
            r.pop("ratio_vs_best_anchor", None)
        if r["impl"] == "ours" and "modeled_us" in r and case_of(r) in best_anchor:
            r["ratio_vs_best_anchor"] = r["modeled_us"] / best_anchor[case_of(r)]
        if r["impl"] == "ours" and "modeled_us" in r:
            gen = GENERATIONS[r["generation"]]
            bound = max(r["min_flops"] / gen.bf16_flops, r["min_bytes"] / gen.hbm_bytes_per_s) * 1e6
            r["vs_roofline"] = r["modeled_us"] / bound


def row_order(r: dict):
    """Table order: model, phase, matmul, pass, generation, implementation."""
    models = [s.model for s in MOE_SHAPES]
    return (models.index(r["model"]), list(PHASES).index(r["phase"]), r["matmul"] != "gate_up",
            PASSES.index(r["pass_"]), list(GENERATIONS).index(r["generation"]), IMPLS.index(r["impl"]))


def write_markdown(results: list[dict], path: Path) -> None:
    results = sorted(results, key=row_order)
    mib = lambda b: f"{b / 2**20:.1f}" if b is not None else "-"
    lines = [
        "# ragged_dot: modeled performance (NOT measured on a TPU)",
        "",
        "Every figure here comes from a CPU machine: HBM bytes and MXU-padded FLOPs are counted",
        "from each kernel's own grid, block specs and scalar prefetch; VMEM is what libtpu's",
        "compiler allocated in an ahead-of-time compile for the generation; modeled time is",
        "max(MXU time, HBM time) + 0.35 us per grid step, with DESIGN.md's per-device peak figures.",
        "Routing: uniform random top-k (seed 0). `ratio` = our modeled time / the best anchor's.",
        "",
        "Passes: fwd y = x w^T; dx = dy w (activations' gradient); dw = dy^T x per group (weights').",
        "`min MiB`: each input and output once, inactive experts' weights never; `roofline` = our modeled",
        "time / max(padded-free FLOPs at peak, min bytes at full bandwidth).",
        "",
        "| model | phase | matmul | pass | gen | impl | tiles m x k x n | compiles | VMEM MiB used / limit "
        "| HBM MiB | min MiB | MXU GFLOP | grid steps | modeled us | ratio | roofline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        compiles = {True: "yes", False: "NO", None: "-"}[r.get("compiles")]
        lines.append(
            f"| {r['model']} | {r['phase']} ({r['tokens']} tok) | {r['matmul']} | {r['pass_']} | {r['generation']} "
            f"| {r['impl']} "
            f"| {r['tiling']} | {compiles} | {mib(r.get('vmem_used'))} / {mib(r['vmem_limit'])} "
            f"| {mib(r.get('hbm_bytes'))} | {mib(r['min_bytes'])} "
            f"| {r.get('mxu_flops', 0) / 1e9:.1f} | {r.get('grid_steps', '-')} "
            f"| {r.get('modeled_us', float('nan')):.1f} | {r.get('ratio_vs_best_anchor', float('nan')):.2f} "
            f"| {r.get('vs_roofline', float('nan')):.2f} |"
        )
    lines += ["", "## Goals", ""] + goal_lines(results)
    errors = [r for r in results if "error" in r]
    if errors:
        lines += ["", "## Failures", ""]
        lines += [f"- {r['model']} {r['phase']} {r['matmul']} {r['pass_']} {r['generation']} {r['impl']}: {r['error']}"
                  for r in errors]
    path.write_text("\n".join(lines) + "\n")


def goal_lines(results: list[dict]) -> list[str]:
    """Each performance goal (issue 3), met or the rows where it is not."""
    ours = [r for r in results if r["impl"] == "ours" and "modeled_us" in r]
    name = lambda r: f"{r['model']} {r['phase']} ({r['rows']} rows, {r['active_groups']} active) {r['matmul']} " \
        f"{r['pass_']} {r['generation']}"
    goals = [
        ("modeled time <= best anchor (v6e, tpu7x)",
         [r for r in ours if r["generation"] in ("v6e", "tpu7x")],
         lambda r: r.get("ratio_vs_best_anchor", 0) <= 1.0 + 1e-9, lambda r: f"{r.get('ratio_vs_best_anchor'):.3f}"),
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
    lines += ["", ROOFLINE_WHY]
    return lines


ROOFLINE_WHY = """\
Why prefill rows miss the roofline, in the model's terms (time = max(MXU, HBM) + 0.35 us per grid step):
an expert's rows reach the MXU in whole passes, 128 rows in the forward kernel (the M side) and the MXU's
contraction width in the weights' gradient (256 on v6e and tpu7x), so each active expert costs up to one
partial pass beyond its rows, and at least one grid step per output tile. At 8192 tokens an expert gets
about 1024 rows (gpt-oss-20b: 32 experts, top-4), 512 (Qwen3: 128, top-8) or 256 (gpt-oss-120b: 128,
top-4; DeepSeek-V3: 256, top-8): the partial passes alone are 20-80% more MXU work than the FLOPs the
roofline counts.
Rows whose time the HBM bound sets can meet 1.25x; rows the MXU bounds (most on tpu7x, which has the
most bandwidth per FLOP; the weights' gradient, which pays 256-row passes) mostly do not."""


def roofline_why(r: dict) -> str:
    """Where a row's modeled time goes beyond the roofline: MXU work padded
    past the ideal FLOPs (partial MXU passes at group boundaries), bytes past
    the minimum, and the fixed cost of grid steps (at least one per active
    group)."""
    gen = GENERATIONS[r["generation"]]
    ideal_mxu_us = r["min_flops"] / gen.bf16_flops * 1e6
    ideal_hbm_us = r["min_bytes"] / gen.hbm_bytes_per_s * 1e6
    bound = "MXU" if r["mxu_us"] >= r["hbm_us"] else "HBM"
    return (f"{r['vs_roofline']:.2f}x: {bound}-bound; MXU work {r['mxu_flops'] / r['min_flops']:.2f}x ideal "
            f"({r['mxu_us']:.0f} vs {ideal_mxu_us:.0f} us), bytes {r['hbm_bytes'] / r['min_bytes']:.2f}x minimum "
            f"({r['hbm_us']:.0f} vs {ideal_hbm_us:.0f} us), {r['grid_steps']} grid steps = {r['steps_us']:.0f} us "
            f"({r['rows'] / r['active_groups']:.0f} rows per active group)")


def write_chart(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = [r for r in results if r["impl"] == "ours" and "ratio_vs_best_anchor" in r]
    if not ours:
        return
    generations = sorted({r["generation"] for r in ours}, key=list(GENERATIONS).index)
    cases = sorted({(r["model"], r["phase"], r["matmul"], r["pass_"]) for r in ours}, key=str)
    fig, ax = plt.subplots(figsize=(max(8, len(cases) * 0.6), 5))
    width = 0.8 / len(generations)
    for i, gen in enumerate(generations):
        values = {(r["model"], r["phase"], r["matmul"], r["pass_"]): r["ratio_vs_best_anchor"]
                  for r in ours if r["generation"] == gen}
        ax.bar([c + i * width for c in range(len(cases))], [values.get(c, np.nan) for c in cases], width, label=gen)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))])
    ax.set_xticklabels([f"{m}\n{p} {mm} {ps}" for m, p, mm, ps in cases], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("modeled time: ours / best anchor (lower is better)")
    ax.set_title("ragged_dot vs megablox and tokamax - MODELED on CPU, not measured on a TPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    parser.add_argument("--no-compile", action="store_true", help="skip libtpu compiles (model only)")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    parser.add_argument("--tpu", action="store_true", help="time real runs on a TPU (needs one)")
    parser.add_argument("--impls", nargs="*", default=list(IMPLS), choices=list(IMPLS))
    parser.add_argument("--append", action="store_true",
                        help="keep the results already in --out, replacing only the cases run now")
    parser.add_argument("--merge", nargs="+", type=Path, default=[],
                        help="only merge these results JSON files (of runs with other --out) into --out")
    args = parser.parse_args(argv)
    sys.argv = sys.argv[:1]  # tokamax parses absl flags from sys.argv on first use
    shapes = [s for s in MOE_SHAPES if s.model in args.models]
    args.out.mkdir(parents=True, exist_ok=True)

    if args.merge:
        merged = {}
        for path in [args.out / "ragged_dot.json", *args.merge]:
            merged.update({(*case_of(r), r["impl"]): r for r in (json.loads(path.read_text()) if path.exists() else [])})
        results = list(merged.values())
        ratio_rows(results)
        (args.out / "ragged_dot.json").write_text(json.dumps(sorted(results, key=row_order), indent=1))
        write_markdown(results, args.out / "ragged_dot.md")
        write_chart(results, args.out / "ragged_dot.png")
        return 0

    if args.tpu:
        results = run_on_tpu(shapes, args.phases)
        (args.out / "ragged_dot_tpu_measured.json").write_text(json.dumps(results, indent=1))
        return 0

    cases = [(s, p, m, ps, g) for s in shapes for p in args.phases for m in matmuls(s) for ps in args.passes
             for g in args.generations]
    results, start = [], time.perf_counter()
    if args.append and (args.out / "ragged_dot.json").exists():
        redone = {(s.model, p, m[0], ps, g, i) for s, p, m, ps, g in cases for i in args.impls}
        results = [r for r in json.loads((args.out / "ragged_dot.json").read_text())
                   if (*case_of(r), r["impl"]) not in redone]
    for i, (shape, phase, matmul, pass_name, generation) in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {shape.model} {phase} {matmul[0]} {pass_name} {generation} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
        results += bench_one(shape, phase, matmul, pass_name, generation, compile_check=not args.no_compile,
                             only=args.impls)
        ratio_rows(results)
        # Rewritten after every case, so a long run interrupted still leaves a table.
        (args.out / "ragged_dot.json").write_text(json.dumps(results, indent=1))
        write_markdown(results, args.out / "ragged_dot.md")
    write_chart(results, args.out / "ragged_dot.png")
    print(f"wrote {args.out / 'ragged_dot.md'} and .png/.json: MODELED figures, not TPU measurements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
