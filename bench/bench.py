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

from runtime.generations import GENERATIONS  # noqa: E402

STEP_OVERHEAD_S = 0.35e-6  # per grid step (DESIGN.md)


@dataclasses.dataclass(frozen=True)
class MoeShape:
    model: str
    hidden: int
    intermediate: int  # per expert
    experts: int
    top_k: int


# Expert shapes from the models' transformers configs (hidden_size,
# moe_intermediate_size or intermediate_size, num experts, experts per token).
MOE_SHAPES = [
    MoeShape("Qwen3-30B-A3B", 2048, 768, 128, 8),
    MoeShape("Qwen3-235B-A22B", 4096, 1536, 128, 8),
    MoeShape("Mixtral-8x7B", 4096, 14336, 8, 2),
    MoeShape("gpt-oss-20b", 2880, 2880, 32, 4),
    MoeShape("gpt-oss-120b", 2880, 2880, 128, 4),
    MoeShape("DeepSeek-V3", 7168, 2048, 256, 8),
]
PHASES = {"decode": 64, "prefill": 8192}  # tokens per step


def routing(shape: MoeShape, tokens: int, seed: int = 0) -> np.ndarray:
    """Group sizes of a uniform random top-k routing (k distinct experts per token)."""
    rng = np.random.default_rng(seed)
    choice = np.argsort(rng.random((tokens, shape.experts)), axis=1)[:, : shape.top_k]
    return np.bincount(choice.reshape(-1), minlength=shape.experts).astype(np.int32)


def matmuls(shape: MoeShape):
    """The experts layer's two grouped matmuls as (name, K, N), weights [G, N, K]."""
    return [("gate_up", shape.hidden, 2 * shape.intermediate), ("down", shape.intermediate, shape.hidden)]


def implementations(generation: str, rows: int, k: int, n: int, groups: int):
    """name -> (function(lhs, rhs, group_sizes), vmem limit in bytes)."""
    from ragged_dot import kernel, ops

    gmm = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm").gmm
    blocks = ops.choose_blocks(rows, k, n, groups, generation)
    ours_tiling = (blocks.block_m, blocks.block_k, blocks.block_n)
    scoped = GENERATIONS[generation].scoped_vmem_default
    return {
        "ours": (lambda l, r, g: ops.ragged_dot(l, r, g, transpose_rhs=True, generation=generation, interpret=False),
                 kernel._vmem_limit(blocks, 2, jnp.bfloat16), ours_tiling),
        "megablox 128^3": (lambda l, r, g: gmm(l, r, g, jnp.bfloat16, tiling=(128, 128, 128), transpose_rhs=True),
                           scoped, (128, 128, 128)),
        "megablox same tiles": (lambda l, r, g: gmm(l, r, g, jnp.bfloat16, tiling=ours_tiling, transpose_rhs=True),
                                scoped, ours_tiling),
    }


def modeled_seconds(cost, generation: str, parallel_extent: int) -> dict:
    gen = GENERATIONS[generation]
    # A "parallel" axis shorter than the core count leaves cores idle (v5p).
    cores_used = min(gen.cores_per_device, parallel_extent)
    compute_rate = gen.bf16_flops * cores_used / gen.cores_per_device
    mxu_s = cost.mxu_flops / compute_rate
    hbm_s = cost.hbm_bytes / gen.hbm_bytes_per_s
    steps_s = cost.grid_steps / cores_used * STEP_OVERHEAD_S
    return {"mxu_us": mxu_s * 1e6, "hbm_us": hbm_s * 1e6, "steps_us": steps_s * 1e6,
            "modeled_us": (max(mxu_s, hbm_s) + steps_s) * 1e6}


def bench_one(shape: MoeShape, phase: str, matmul, generation: str, compile_check: bool) -> list[dict]:
    import grid_walk

    name, k, n = matmul
    tokens = PHASES[phase]
    rows = tokens * shape.top_k
    sizes = routing(shape, tokens)
    gen = GENERATIONS[generation]
    lhs = jnp.zeros((rows, k), jnp.bfloat16)
    rhs = jnp.zeros((shape.experts, n, k), jnp.bfloat16)
    group_sizes = jnp.asarray(sizes)
    active = int((sizes > 0).sum())
    results = []
    for impl, (fn, vmem_limit, tiling) in implementations(generation, rows, k, n, shape.experts).items():
        row = dict(model=shape.model, phase=phase, tokens=tokens, matmul=name, generation=generation,
                   impl=impl, tiling="x".join(map(str, tiling)), rows=rows, K=k, N=n, groups=shape.experts,
                   active_groups=active, vmem_limit=vmem_limit,
                   min_bytes=2 * (active * k * n + rows * k + rows * n),
                   min_flops=2 * rows * k * n)
        try:
            (cost,) = grid_walk.kernel_costs(fn, (lhs, rhs, group_sizes), gen.mxu_width)
            row.update(hbm_bytes=cost.hbm_bytes, mxu_flops=cost.mxu_flops, grid=list(cost.grid),
                       grid_steps=cost.grid_steps, **modeled_seconds(cost, generation, cost.grid[0]))
        except Exception as err:  # noqa: BLE001  (a row says what failed)
            row.update(error=f"walk: {str(err).splitlines()[0][:160]}")
        if compile_check:
            try:
                report = tpu_compile.compile_for(
                    fn, [((rows, k), jnp.bfloat16), ((shape.experts, n, k), jnp.bfloat16),
                         ((shape.experts,), jnp.int32)], generation, "")
                kernels = [r for op, r in report.kernels.items() if "gmm" in op or "ragged_dot" in op]
                row.update(compiles=True, vmem_used=max((r.vmem_bytes for r in kernels), default=None),
                           bundles=sum(r.bundles or 0 for r in kernels) or None)
            except Exception as err:  # noqa: BLE001
                row.update(compiles=False, error=f"compile: {str(err).splitlines()[0][:160]}")
        results.append(row)
    return results


def ratio_rows(results: list[dict]) -> None:
    """Adds ours / best anchor (modeled time) to our rows."""
    key = lambda r: (r["model"], r["phase"], r["matmul"], r["generation"])
    best_anchor = {}
    for r in results:
        if r["impl"] != "ours" and "modeled_us" in r:
            best_anchor[key(r)] = min(best_anchor.get(key(r), float("inf")), r["modeled_us"])
    for r in results:
        if r["impl"] == "ours" and "modeled_us" in r and key(r) in best_anchor:
            r["ratio_vs_best_anchor"] = r["modeled_us"] / best_anchor[key(r)]


def write_markdown(results: list[dict], path: Path) -> None:
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
        "| model | phase | matmul | gen | impl | tiles m x k x n | compiles | VMEM MiB used / limit "
        "| HBM MiB | min MiB | MXU GFLOP | grid steps | modeled us | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        compiles = {True: "yes", False: "NO", None: "-"}[r.get("compiles")]
        lines.append(
            f"| {r['model']} | {r['phase']} ({r['tokens']} tok) | {r['matmul']} | {r['generation']} | {r['impl']} "
            f"| {r['tiling']} | {compiles} | {mib(r.get('vmem_used'))} / {mib(r['vmem_limit'])} "
            f"| {mib(r.get('hbm_bytes'))} | {mib(r['min_bytes'])} "
            f"| {r.get('mxu_flops', 0) / 1e9:.1f} | {r.get('grid_steps', '-')} "
            f"| {r.get('modeled_us', float('nan')):.1f} | {r.get('ratio_vs_best_anchor', float('nan')):.2f} |"
        )
    errors = [r for r in results if "error" in r]
    if errors:
        lines += ["", "## Failures", ""]
        lines += [f"- {r['model']} {r['phase']} {r['matmul']} {r['generation']} {r['impl']}: {r['error']}" for r in errors]
    path.write_text("\n".join(lines) + "\n")


def write_chart(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = [r for r in results if r["impl"] == "ours" and "ratio_vs_best_anchor" in r]
    if not ours:
        return
    generations = sorted({r["generation"] for r in ours}, key=list(GENERATIONS).index)
    cases = sorted({(r["model"], r["phase"], r["matmul"]) for r in ours}, key=str)
    fig, ax = plt.subplots(figsize=(max(8, len(cases) * 0.6), 5))
    width = 0.8 / len(generations)
    for i, gen in enumerate(generations):
        values = {(r["model"], r["phase"], r["matmul"]): r["ratio_vs_best_anchor"] for r in ours if r["generation"] == gen}
        ax.bar([c + i * width for c in range(len(cases))], [values.get(c, np.nan) for c in cases], width, label=gen)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))])
    ax.set_xticklabels([f"{m}\n{p} {mm}" for m, p, mm in cases], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("modeled time: ours / best megablox (lower is better)")
    ax.set_title("ragged_dot vs megablox gmm - MODELED on CPU, not measured on a TPU")
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
    parser.add_argument("--no-compile", action="store_true", help="skip libtpu compiles (model only)")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    parser.add_argument("--tpu", action="store_true", help="time real runs on a TPU (needs one)")
    args = parser.parse_args(argv)
    shapes = [s for s in MOE_SHAPES if s.model in args.models]
    args.out.mkdir(parents=True, exist_ok=True)

    if args.tpu:
        results = run_on_tpu(shapes, args.phases)
        (args.out / "ragged_dot_tpu_measured.json").write_text(json.dumps(results, indent=1))
        return 0

    cases = [(s, p, m, g) for s in shapes for p in args.phases for m in matmuls(s) for g in args.generations]
    results, start = [], time.perf_counter()
    for i, (shape, phase, matmul, generation) in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {shape.model} {phase} {matmul[0]} {generation} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
        results += bench_one(shape, phase, matmul, generation, compile_check=not args.no_compile)
    ratio_rows(results)
    (args.out / "ragged_dot.json").write_text(json.dumps(results, indent=1))
    write_markdown(results, args.out / "ragged_dot.md")
    write_chart(results, args.out / "ragged_dot.png")
    print(f"wrote {args.out / 'ragged_dot.md'} and .png/.json: MODELED figures, not TPU measurements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
