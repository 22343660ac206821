"""Benchmarks flash attention (`make bench`), modeled on this CPU machine.

For each model's attention shape, sequence length, pass (forward; forward
and backward, a training step's attention) and TPU generation, it reports,
for our kernel and each anchor on the same shapes (one causal sequence):

- whether libtpu compiles it for that generation, and its VMEM;
- the MXU work the kernels execute against causal attention's own FLOPs
  (the skipped blocks), and the bytes of K and V they read against the
  K/V size times the number of query blocks (GQA without re-reading K and
  V per head), both counted from the kernels' own grids (grid_walk.py);
- a modeled time read from the compiled kernels' own schedules and the
  grid walk, combined as the pipeline runs them (pipeline.py).

These are MODELED figures, not TPU measurements. Writes
bench/results/flash_attention.md and .json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(REPO), str(REPO / "kernels"), str(BENCH)]
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ["JAX_PLATFORMS"] = "cpu"
import tpu_compile  # noqa: E402

tpu_compile.configure_environment()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import grid_walk  # noqa: E402
import pipeline  # noqa: E402
from runtime.generations import GENERATIONS  # noqa: E402


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    model: str
    q_heads: int
    kv_heads: int
    head_dim: int
    options: tuple = ()  # (name, value) pairs for flash_attention_varlen, besides causal

    @property
    def kwargs(self) -> dict:
        return dict(self.options)


SHAPES = [
    AttentionShape("Llama-2-7B (MHA)", 32, 32, 128),
    AttentionShape("Llama-3-8B", 32, 8, 128),
    AttentionShape("Qwen3-32B", 64, 8, 128),
    AttentionShape("Gemma-2-9B (global layer)", 16, 8, 256, (("softcap", 50.0),)),
    AttentionShape("gpt-oss-20b (sliding layer)", 64, 8, 64, (("window_size", (127, 0)), ("sinks", True))),
]
SEQUENCES = (2048, 8192, 32768)
PASSES = ("fwd", "fwd+bwd")
BENCH_GENERATIONS = ("v6e", "tpu7x")
KERNEL_NAME = "flash_attention"  # ours; anchors are matched by their own names


def ours(shape: AttentionShape, tokens: int, generation: str):
    """(fn(q, k, v, sinks), blocks): our varlen attention over one causal sequence."""
    from flash_attention import ops, tuning

    cu = jnp.asarray([0, tokens], jnp.int32)
    options = shape.kwargs
    has_sinks = options.pop("sinks", False)
    blocks = tuning.choose_blocks(tokens, tokens, shape.head_dim, shape.head_dim, shape.q_heads // shape.kv_heads, 2,
                                  generation)

    def fn(q, k, v, sinks):
        return ops.flash_attention_varlen(q, k, v, cu, cu, causal=True, sinks=sinks if has_sinks else None,
                                          generation=generation, interpret=False, **options)

    return fn, f"{blocks.block_q}x{blocks.block_k}"


def _program(fn, pass_name: str):
    if pass_name == "fwd":
        return fn
    def forward_backward(q, k, v, sinks):
        out, pullback = jax.vjp(fn, q, k, v, sinks)
        return pullback(out)

    return forward_backward


def causal_flops(shape: AttentionShape, tokens: int, pass_name: str) -> float:
    """QK^T and PV over the causal triangle (the forward); the backward adds
    2.5 times that (dq, dk, dv and the recomputed scores)."""
    forward = 2 * 2 * shape.q_heads * shape.head_dim * tokens * (tokens + 1) / 2
    return forward * (1 if pass_name == "fwd" else 3.5)


def bench_one(shape: AttentionShape, tokens: int, pass_name: str, generation: str, impl: str) -> dict:
    gen = GENERATIONS[generation]
    fn, tiling = ours(shape, tokens, generation)
    program = _program(fn, pass_name)
    d = shape.head_dim
    specs = [((tokens, shape.q_heads, d), jnp.bfloat16), ((tokens, shape.kv_heads, d), jnp.bfloat16),
             ((tokens, shape.kv_heads, d), jnp.bfloat16), ((shape.q_heads,), jnp.bfloat16)]
    row = dict(model=shape.model, tokens=tokens, pass_=pass_name, generation=generation, impl=impl, tiling=tiling,
               causal_flops=causal_flops(shape, tokens, pass_name))
    try:
        costs = grid_walk.kernel_costs(program, [jax.ShapeDtypeStruct(s, t) for s, t in specs], gen.mxu_width)
        report = tpu_compile.compile_for(program, specs, generation, KERNEL_NAME)
        parts = pipeline.program_seconds(costs, report.schedules, generation)
    except Exception as err:  # noqa: BLE001  (a row says what failed)
        return dict(row, error=str(err).splitlines()[0][:200])
    kv_bytes = 2 * tokens * shape.kv_heads * d * 2
    forward = costs[0]
    kv_read = sum(b for name, b in forward.bytes_by_operand.items() if name.startswith(("in1:", "in2:")))
    query_blocks = math.ceil(tokens / int(tiling.split("x")[0]))
    bound = max(row["causal_flops"] / gen.bf16_flops, kv_bytes / gen.hbm_bytes_per_s)
    return dict(row, compiles=True, vmem_used=max(k.vmem_bytes for k in report.kernels.values()),
                modeled_us=parts["modeled"] * 1e6, compute_us=parts["compute"] * 1e6, dma_us=parts["dma"] * 1e6,
                around_us=parts["around"] * 1e6, regions_mapped=parts["regions_mapped"],
                grid_steps=sum(c.grid_steps for c in costs),
                mxu_vs_causal=sum(c.dot_flops for c in costs) / row["causal_flops"],
                kv_reads_vs_query_blocks=kv_read / (kv_bytes * query_blocks),
                vs_roofline=parts["modeled"] / bound)


def write_markdown(results: list[dict], path: Path) -> None:
    lines = [
        "# flash_attention: modeled performance (NOT measured on a TPU)",
        "",
        "Modeled time is read from the compiled kernels themselves (bench/pipeline.py): libtpu's final",
        "bundles give each grid step's issue cycles, the grid walk gives each step's DMA bytes, combined as",
        "the double-buffered pipeline runs them. One causal sequence per row, bf16. `executed / causal`:",
        "the kernels' matmul FLOPs (at block shapes) over causal attention's own; `K/V reads`: bytes of K",
        "and V the forward reads over (K and V size) x (query blocks); `roofline`: modeled time over",
        "max(causal FLOPs at peak, K and V at full bandwidth).",
        "",
        "| model | tokens | pass | gen | impl | blocks | VMEM MiB | grid steps | executed / causal | K/V reads "
        "| compute us | DMA us | around us | modeled us | roofline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda r, key, f=".1f": format(r[key], f) if key in r else "-"
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['tokens']} | {r['pass_']} | {r['generation']} | {r['impl']} "
                         f"| {r['tiling']} | {r['error']} |" + " |" * 9)
            continue
        lines.append(f"| {r['model']} | {r['tokens']} | {r['pass_']} | {r['generation']} | {r['impl']} | {r['tiling']} "
                     f"| {r['vmem_used'] / 2**20:.1f} | {r['grid_steps']} | {fmt(r, 'mxu_vs_causal', '.2f')} "
                     f"| {fmt(r, 'kv_reads_vs_query_blocks', '.2f')} | {fmt(r, 'compute_us')} | {fmt(r, 'dma_us')} "
                     f"| {fmt(r, 'around_us')} | {fmt(r, 'modeled_us')} | {fmt(r, 'vs_roofline', '.1f')} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=[s.model for s in SHAPES])
    parser.add_argument("--tokens", nargs="*", type=int, default=list(SEQUENCES))
    parser.add_argument("--passes", nargs="*", default=list(PASSES), choices=list(PASSES))
    parser.add_argument("--generations", nargs="*", default=list(BENCH_GENERATIONS), choices=list(GENERATIONS))
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cases = [(s, t, p, g) for s in SHAPES if s.model in args.models for t in args.tokens for p in args.passes
             for g in args.generations]
    results, start = [], time.perf_counter()
    for i, (shape, tokens, pass_name, generation) in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {shape.model} {tokens} {pass_name} {generation} ({time.perf_counter() - start:.0f} s)",
              flush=True)
        results.append(bench_one(shape, tokens, pass_name, generation, "ours"))
        (args.out / "flash_attention.json").write_text(json.dumps(results, indent=1))
        write_markdown(results, args.out / "flash_attention.md")
    print(f"wrote {args.out / 'flash_attention.md'}: MODELED figures, not TPU measurements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
