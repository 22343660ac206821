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
import math
import sys
import time
from pathlib import Path

import harness  # sets up sys.path and the CPU / libtpu environment
from harness import BENCH  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import charts  # noqa: E402
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


def ours(shape: AttentionShape, tokens: int, generation: str, pass_name: str):
    """(fn(q, k, v, sinks), tiling): our varlen attention over one causal sequence, and how its
    kernels are tiled and, where the pass runs them, which compile with libtpu's LP scheduler."""
    from flash_attention import ops, tuning

    cu = jnp.asarray([0, tokens], jnp.int32)
    options = shape.kwargs
    has_sinks = options.pop("sinks", False)
    blocks = tuning.choose_blocks(tokens, tokens, shape.head_dim, shape.head_dim, shape.q_heads // shape.kv_heads, 2,
                                  generation, window=tuning.window_span(True, *options.get("window_size", (-1, -1))))

    def fn(q, k, v, sinks):
        return ops.flash_attention_varlen(q, k, v, cu, cu, causal=True, sinks=sinks if has_sinks else None,
                                          generation=generation, interpret=False, **options)

    lp = [name for name in blocks.lp_kernels if pass_name != "fwd" or name == "fwd"]
    return fn, f"{blocks.block_q}x{blocks.block_k}" + (f" (LP scheduler: {', '.join(lp)})" if lp else "")


# ---------------------------------------------------------------- anchors
# Each anchor gets a sweep of block sizes, all under its own rules (none of them lets a caller
# raise Mosaic's scoped VMEM but tpu-inference's); its row is the fastest that compiles. The
# sweep reaches past where each anchor was fastest in a wider one (Llama-2-7B, 8k, v6e: all four
# at 1024x1024); jax's default 128x128 was 7-10x slower than their best there, so it is left
# out. Every anchor takes [B, S, H, D] here (B = 1) and runs causal attention scaled by
# 1/sqrt(D); what an anchor cannot do (sinks, windows, softcap, a backward) is n/a. The MHA-only
# kernels (jax's flash_attention, tpu-inference's) anchor the MHA shapes only: GQA shapes have
# splash and tokamax, which serve GQA natively. tokamax's fastest tiling is also rated with
# libtpu's default scheduler (its heuristics pick the LP one, its autotuner tries both; MODELED at
# 8k, the default was faster on every v6e row, by 2% to 8%, and slower on every tpu7x forward).
SWEEP = ((512, 512), (1024, 512), (1024, 1024), (2048, 1024))  # (query block, key block)


def _heads_major(x):
    return jnp.swapaxes(x, 1, 2)  # [B, S, H, D] <-> [B, H, S, D]


def jax_flash(shape: AttentionShape, block_q: int, block_k: int):
    """jax's Pallas TPU flash_attention: MHA only, [B, H, S, D], top-left causal (equal lengths here)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    if shape.options or shape.q_heads != shape.kv_heads:
        return None
    blocks = fa.BlockSizes(block_q=block_q, block_k_major=block_k, block_k=block_k, block_b=1,
                           block_q_major_dkv=block_q, block_k_major_dkv=block_k, block_k_dkv=block_k,
                           block_q_dkv=block_q, block_k_major_dq=block_k, block_k_dq=block_k, block_q_dq=block_q)

    def fn(q, k, v, sinks):
        out = fa.flash_attention(_heads_major(q), _heads_major(k), _heads_major(v),
                                 causal=True, sm_scale=shape.head_dim ** -0.5, block_sizes=blocks)
        return _heads_major(out)

    return fn


def splash(shape: AttentionShape, block_q: int, block_k: int):
    """jax's splash attention: GQA, static causal (and local) masks, softcap, sinks; no batch
    dimension (vmapped) and no softmax scale (q is pre-scaled)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    options = shape.kwargs
    left = options.get("window_size", (-1, 0))[0]

    def fn(q, k, v, sinks):
        tokens = q.shape[1]
        mask = sa.LocalMask((tokens, tokens), (left, 0), 0) if left >= 0 else sa.CausalMask((tokens, tokens))
        blocks = sa.BlockSizes(block_q=block_q, block_kv=block_k, block_kv_compute=block_k, block_q_dkv=block_q,
                               block_kv_dkv=block_k, block_kv_dkv_compute=block_k, block_q_dq=block_q,
                               block_kv_dq=block_k)
        # Built per call: the kernel holds its mask metadata as arrays of the trace it was made in.
        kernel = sa.make_splash_mha_single_device(sa.MultiHeadMask([mask] * shape.q_heads), block_sizes=blocks,
                                                  attn_logits_soft_cap=options.get("softcap"))
        q = q * jnp.asarray(shape.head_dim ** -0.5, q.dtype)
        if options.get("sinks"):
            out = jax.vmap(lambda q, k, v: kernel(q, k, v, None, sinks))(*map(_heads_major, (q, k, v)))
        else:
            out = jax.vmap(kernel)(*map(_heads_major, (q, k, v)))
        return _heads_major(out)

    return fn


def tokamax_attention(shape: AttentionShape, block_q: int, block_k: int, experimental_scheduler: bool = True):
    """tokamax 0.0.12's Mosaic TPU attention (its own splash fork, GQA, [B, S, H, D], one fused
    backward kernel); softcap yes, sinks and windows no. experimental_scheduler: its forward
    compiled with libtpu's LP scheduler (its heuristics' choice; its autotuner tries both)."""
    from tokamax._src.ops.attention import pallas_mosaic_tpu as tpu_op
    from tokamax._src.ops.attention import pallas_mosaic_tpu_vjp as tpu_vjp

    options = shape.kwargs
    if "sinks" in options or "window_size" in options:
        return None
    # Its device check reads the default device, this CPU, also while the grid walk traces it: the
    # bench only traces it and compiles it for a TPU.
    for op_class in (tpu_op.PallasMosaicTpuFlashAttention, tpu_vjp.PallasMosaicTpuFlashAttentionVjp):
        op_class.supported_on = lambda self, device: True
    layout = tpu_op.splash.QKVLayout.HEAD_DIM_MINOR  # its heuristics' layout
    op = tpu_op.PallasMosaicTpuFlashAttention(
        config=tpu_op.Config(block_q=block_q, block_kv=block_k, block_kv_compute=block_k, q_layout=layout,
                             k_layout=layout, v_layout=layout, use_experimental_scheduler=experimental_scheduler),
        vjp=tpu_vjp.PallasMosaicTpuFlashAttentionVjp(
            config=tpu_vjp.Config(block_q_dkv=block_q, block_kv_dkv=block_k, block_kv_dkv_compute=block_k)))

    def fn(q, k, v, sinks):
        return op(q, k, v, is_causal=True, logits_scale=shape.head_dim ** -0.5,
                  logits_soft_cap=options.get("softcap"))

    return fn


def tokamax_splash(shape: AttentionShape, block_q: int, block_k: int):
    """tokamax 0.0.12's experimental splash (tokamax/_src/ops/experimental/tpu/splash_attention), the
    kernel its Ironwood microbenchmarks measured, called as its benchmark script calls it
    (tokamax/experimental/utils/tuning/tpu/splash_attention_benchmarking.py): its MQA kernel
    vmapped over the KV heads, base-2 exp, [B, H, S, D], no softmax scale (q is pre-scaled), its
    fused backward. Compute blocks of 512 keys (the benchmark's winners, bench/calibration.py) and
    libtpu's LP scheduler; softcap yes, sinks and windows no."""
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as tk_splash
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as tk_mask

    options = shape.kwargs
    if "sinks" in options or "window_size" in options:
        return None
    compute = min(512, block_k)
    config = tk_splash.SplashConfig(block_q=block_q, block_kv=block_k, block_kv_compute=compute, block_q_dkv=block_q,
                                    block_kv_dkv=block_k, block_kv_dkv_compute=compute, use_experimental_scheduler=True,
                                    use_base2_exp=True, attn_logits_soft_cap=options.get("softcap"))

    def fn(q, k, v, sinks):
        tokens, group = q.shape[1], shape.q_heads // shape.kv_heads
        # Built per call: the kernel holds its mask metadata as arrays of the trace it was made in.
        kernel = tk_splash.make_splash_mqa_single_device(tk_mask.CausalMask((tokens, tokens)), config=config)
        q = _heads_major(q * jnp.asarray(shape.head_dim ** -0.5, q.dtype))
        q = q.reshape(q.shape[0], shape.kv_heads, group, tokens, shape.head_dim)
        out = jax.vmap(jax.vmap(kernel))(q, _heads_major(k), _heads_major(v))  # over batch, then KV heads
        return _heads_major(out.reshape(q.shape[0], shape.q_heads, tokens, shape.head_dim))

    return fn


def tpu_inference_flash(shape: AttentionShape, block_q: int, block_k: int):
    """tpu-inference 0.32.0's flash attention (a forward-only fork of jax's, MHA, [B, H, S, D])."""
    module = _tpu_inference_flash_module()
    if shape.options or shape.q_heads != shape.kv_heads or module is None:
        return None
    blocks = module.BlockSizes(block_q=block_q, block_k_major=block_k, block_k=block_k, block_b=1)

    def fn(q, k, v, sinks):
        out = module.flash_attention(_heads_major(q), _heads_major(k), _heads_major(v),
                                     causal=True, sm_scale=shape.head_dim ** -0.5, block_sizes=blocks)
        return _heads_major(out)

    return fn


def _tpu_inference_flash_module():
    """Its kernel file, loaded past the package's vLLM imports (tpu_inference_kernels.py); None if
    not installed."""
    import tpu_inference_kernels

    if not tpu_inference_kernels.installed():
        return None
    return tpu_inference_kernels.module("kernels.flash_attention.kernel")


# name -> (fn of (shape, block_q, block_k) or None where n/a, kernel name in libtpu's report, has a backward)
ANCHORS = {
    "jax flash_attention": (jax_flash, "flash", True),
    "splash": (splash, "splash", True),
    "tokamax": (tokamax_attention, "splash", True),
    "tokamax splash (microbenchmark form)": (tokamax_splash, "splash", True),
    "tpu-inference flash": (tpu_inference_flash, "flash_attention", False),
}
IMPLS = ("ours", *ANCHORS)


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


def measure(program, shape: AttentionShape, tokens: int, generation: str, kernel_name: str) -> dict:
    """One program's row (bench/harness.py), with its walked kernels' counts."""
    d = shape.head_dim
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((1, tokens, shape.q_heads, d), (1, tokens, shape.kv_heads, d),
                                                             (1, tokens, shape.kv_heads, d), (shape.q_heads,))]
    try:
        m = harness.measure(program, args, generation, kernel_name, require_kernels=True)
    except Exception as err:  # noqa: BLE001  (a row says what failed)
        return harness.error_row(err)
    return dict(m.figures(), costs=m.costs)


def bench_one(shape: AttentionShape, tokens: int, pass_name: str, generation: str, impls=IMPLS) -> list[dict]:
    gen = GENERATIONS[generation]
    base = dict(model=shape.model, tokens=tokens, pass_=pass_name, generation=generation,
                causal_flops=causal_flops(shape, tokens, pass_name),
                dense_flops=causal_flops(shape, tokens, pass_name) * 2 * tokens / (tokens + 1))
    kv_bytes = 2 * tokens * shape.kv_heads * shape.head_dim * 2
    bound = max(base["causal_flops"] / gen.bf16_flops, kv_bytes / gen.hbm_bytes_per_s) * 1e6
    rows = []

    def finish(row):
        costs = row.pop("costs", None)
        if "modeled_us" in row:
            executed = row.pop("dot_flops")
            row.update(mxu_vs_causal=executed / base["causal_flops"], mxu_vs_dense=executed / base["dense_flops"],
                       vs_roofline=row["modeled_us"] / bound)
        return row, costs

    if "ours" in impls:
        fn, tiling = ours(shape, tokens, generation, pass_name)
        flat = lambda q, k, v, sinks: fn(q[0], k[0], v[0], sinks)[None]
        row, costs = finish(dict(base, impl="ours", tiling=tiling,
                                 **measure(_program(flat, pass_name), shape, tokens, generation, KERNEL_NAME)))
        if costs:
            # K and V bytes the forward kernel reads, over (K and V size) x (query blocks).
            kv_read = sum(b for name, b in costs[0].bytes_by_operand.items() if name.startswith(("in1:", "in2:")))
            row["kv_reads_vs_query_blocks"] = kv_read / (kv_bytes * math.ceil(tokens / int(tiling.split("x")[0])))
        rows.append(row)
    for impl, (make, kernel_name, has_backward) in ANCHORS.items():
        if impl not in impls:
            continue
        tried = {}
        for block_q, block_k in SWEEP:
            tiling = f"{block_q}x{block_k}"
            try:
                fn = make(shape, block_q, block_k) if (has_backward or pass_name == "fwd") and block_k <= tokens else None
            except Exception as err:  # noqa: BLE001  (the anchor refuses this tiling)
                tried[tiling] = dict(base, impl=impl, tiling=tiling, error=str(err).splitlines()[0][:200])
                continue
            if fn is not None:
                tried[tiling] = finish(dict(base, impl=impl, tiling=tiling, **measure(
                    _program(fn, pass_name), shape, tokens, generation, kernel_name)))[0]
        ok = [r for r in tried.values() if "modeled_us" in r]
        if impl == "tokamax" and ok:
            # Its autotuner also tries libtpu's default scheduler (ours chooses per table entry):
            # rated at the sweep's fastest tiling.
            tiling = min(ok, key=lambda r: r["modeled_us"])["tiling"]
            block_q, block_k = map(int, tiling.split("x"))
            tiling += " default scheduler"
            tried[tiling] = finish(dict(base, impl=impl, tiling=tiling, **measure(
                _program(make(shape, block_q, block_k, experimental_scheduler=False), pass_name), shape, tokens,
                generation, kernel_name)))[0]
            ok = [r for r in tried.values() if "modeled_us" in r]
        if not tried:
            rows.append(dict(base, impl=impl, tiling="-", error="n/a: not supported"))
            continue
        best = dict(min(ok, key=lambda r: r["modeled_us"]) if ok else next(iter(tried.values())))
        best["candidates"] = {t: round(r["modeled_us"], 1) if "modeled_us" in r else None for t, r in tried.items()}
        rows.append(best)
    return rows


GOAL_TOKENS = 8192  # the FLOP and K/V read goals are set at this length
MAX_EXECUTED_VS_DENSE = 0.55  # causal: matmul FLOPs executed over dense attention's
MAX_KV_READS = 1.1  # GQA: K/V bytes read over (K and V size) x (query blocks)


def goal_rows(results: list[dict]) -> list[str]:
    """One line per goal and case: met, not met (with both sides' figures) or n/a."""
    lines = []
    cases = {}
    for r in results:
        cases.setdefault((r["model"], r["tokens"], r["pass_"], r["generation"]), {})[r["impl"]] = r
    for (model, tokens, pass_name, generation), rows in cases.items():
        ours_row = rows.get("ours", {})
        benched = [r for impl, r in rows.items() if impl != "ours"]
        anchors = [r for r in benched if "modeled_us" in r]
        case = f"| {model} | {tokens} | {pass_name} | {generation} "
        if "modeled_us" not in ours_row:
            lines.append(case + "| time no worse than the best anchor | - | - | n/a: ours not benched |")
            continue
        if anchors:
            best = min(anchors, key=lambda r: r["modeled_us"])
            verdict = "met" if ours_row["modeled_us"] <= best["modeled_us"] else "NOT met"
            lines.append(case + f"| time no worse than the best anchor | {ours_row['modeled_us']:.0f} us "
                         f"| {best['impl']} {best['tiling']}: {best['modeled_us']:.0f} us | {verdict} |")
        else:
            why = "none compiles or none supports it" if benched else "anchors not benched"
            lines.append(case + f"| time no worse than the best anchor | {ours_row['modeled_us']:.0f} us "
                         f"| {why} | n/a |")
        if tokens == GOAL_TOKENS:
            ratio = ours_row["mxu_vs_dense"]
            lines.append(case + f"| causal executes <= {MAX_EXECUTED_VS_DENSE}x dense FLOPs | {ratio:.3f}x | - "
                         f"| {'met' if ratio <= MAX_EXECUTED_VS_DENSE else 'NOT met'} |")
            reads = ours_row.get("kv_reads_vs_query_blocks")
            gqa = any(sh.model == model and sh.q_heads > sh.kv_heads for sh in SHAPES)
            if reads is not None and gqa:
                lines.append(case + f"| K/V reads <= {MAX_KV_READS}x (query blocks) x (K and V size) | {reads:.2f}x "
                             f"| - | {'met' if reads <= MAX_KV_READS else 'NOT met'} |")
    return lines


def write_markdown(results: list[dict], path: Path) -> None:
    goals = goal_rows(results)
    lines = [
        "# flash_attention: modeled performance (NOT measured on a TPU)",
        "",
        "Modeled time is read from the compiled kernels themselves (bench/pipeline.py): libtpu's final",
        "bundles give each grid step's issue cycles, the grid walk gives each step's DMA bytes, combined as",
        "the double-buffered pipeline runs them. One causal sequence per row, bf16. `executed / causal`:",
        "the kernels' matmul FLOPs (at block shapes) over causal attention's own; `K/V reads`: bytes of K",
        "and V the forward reads over (K and V size) x (query blocks); `roofline`: modeled time over",
        "max(causal FLOPs at peak, K and V at full bandwidth). Where a goal is NOT met,",
        "flash_attention/CARD.md (Status) says why.",
        "",
        "## Goals (MODELED)",
        "",
        "| model | tokens | pass | gen | goal | ours | best anchor | verdict |",
        "|---|---|---|---|---|---|---|---|",
        *goals,
        "",
        "## Every row",
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
    harness.write_atomically(path, "\n".join(lines) + "\n")


def _row_order(row: dict) -> tuple:
    models = [s.model for s in SHAPES]
    rank = lambda seq, x: seq.index(x) if x in seq else len(seq)
    return (rank(models, row["model"]), row["tokens"], rank(PASSES, row["pass_"]),
            rank(list(GENERATIONS), row["generation"]), rank(IMPLS, row["impl"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=[s.model for s in SHAPES])
    parser.add_argument("--tokens", nargs="*", type=int, default=list(SEQUENCES))
    parser.add_argument("--passes", nargs="*", default=list(PASSES), choices=list(PASSES))
    parser.add_argument("--generations", nargs="*", default=list(BENCH_GENERATIONS), choices=list(GENERATIONS))
    parser.add_argument("--impls", nargs="*", default=list(IMPLS), choices=list(IMPLS))
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    parser.add_argument("--merge", nargs="+", type=Path, default=[],
                        help="only merge these results JSON files (of runs with other --out) into --out's, theirs winning")
    args = parser.parse_args(argv)
    sys.argv = sys.argv[:1]  # tokamax parses absl flags from sys.argv on first use
    cases = [(s, t, p, g) for s in SHAPES if s.model in args.models for t in args.tokens for p in args.passes
             for g in args.generations]
    results = harness.Results(args.out / "flash_attention.json", order=_row_order,
                              key=lambda r: (r["model"], r["tokens"], r["pass_"], r["generation"], r["impl"]))
    for path in args.merge:
        results.merge(path)
    if args.merge:
        cases = []
        results.save()
    start = time.perf_counter()
    for i, (shape, tokens, pass_name, generation) in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {shape.model} {tokens} {pass_name} {generation} ({time.perf_counter() - start:.0f} s)",
              flush=True)
        results.put(*bench_one(shape, tokens, pass_name, generation, args.impls))
        write_markdown(results.rows, args.out / "flash_attention.md")
    write_markdown(results.rows, args.out / "flash_attention.md")
    charts.write("flash_attention", results.rows, args.out)
    print(f"wrote {args.out / 'flash_attention.md'} and a chart per generation: MODELED figures, not TPU measurements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
