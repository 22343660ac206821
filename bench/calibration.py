"""Calibrates the schedule model (`make calibrate`), MODELED on this CPU machine.

The clock: no TPU clock figures are public, so each generation's
`clock_hz` (kernels/runtime/generations.py) is the rate at which libtpu's
own schedule of a dense bf16 matmul reaches the published bf16 peak per
core: `dense_matmul` with 512 and 1024 rows per block, the extra issue
cycles of a step that only accumulates (neither zeroing nor storing)
against the extra FLOPs. Run `python bench/calibration.py clock` to derive
it again (after a libtpu upgrade, say).

The check: `python bench/calibration.py measured` (part of `make bench`)
models every public TPU measurement of these kernels we could reproduce
(bench/calibration_cases.json, each with its source) and writes
bench/results/calibration.md: modeled / measured per case.
"""

from __future__ import annotations

import argparse
import sys

import harness  # sets up sys.path and the CPU / libtpu environment
import bench  # noqa: E402  (as_tokamax)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from runtime import rings  # noqa: E402
from runtime.generations import GENERATIONS  # noqa: E402

import dataclasses  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import pipeline  # noqa: E402

CASES = Path(__file__).resolve().parent / "calibration_cases.json"
DENSE_SIZE = 4096  # the clock's matmul: [4096, 4096] @ [4096, 4096], blocks block_m x 1024 x 1024
DENSE_BLOCK = 1024
TARGET = 1.3  # modeled within this factor of measured, either way


def dense_matmul(block_m: int, block_k: int = DENSE_BLOCK, block_n: int = DENSE_BLOCK, size: int = DENSE_SIZE):
    """A dense bf16 matmul with an fp32 accumulator: MXU-bound steps."""
    def body(x_ref, w_ref, o_ref, acc_ref):
        @pl.when(pl.program_id(2) == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        acc_ref[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

        @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
        def _():
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    n, bm, bk, bn = size, block_m, block_k, block_n
    return pl.pallas_call(
        body, grid=(n // bm, n // bn, n // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, k: (i, k)), pl.BlockSpec((bk, bn), lambda i, j, k: (k, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)),
        out_shape=jax.ShapeDtypeStruct((n, n), jnp.bfloat16),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=60 << 20),
        name="dense_calibration")


DENSE_ARG = jax.ShapeDtypeStruct((DENSE_SIZE, DENSE_SIZE), jnp.bfloat16)


def accumulate_cycles(generation: str, block_m: int) -> int:
    """Issue cycles of a dense step that neither zeroes nor stores."""
    report = harness.compile(dense_matmul(block_m), [DENSE_ARG] * 2, generation, "dense_calibration")
    (kernel,) = report.kernels.values()
    zero, store = kernel.schedule.regions
    return kernel.schedule.iteration_cycles - zero.cycles - store.cycles


def derived_clock_hz(generation: str) -> float:
    gen = GENERATIONS[generation]
    extra_cycles = accumulate_cycles(generation, 1024) - accumulate_cycles(generation, 512)
    extra_flops = 2 * 512 * DENSE_BLOCK * DENSE_BLOCK
    return gen.bf16_flops / gen.cores_per_device / extra_flops * extra_cycles


def stream_fit(streams: list[dict]) -> dict | None:
    """The bandwidth and per-copy latency that reproduce the two measured rings (four and two copies
    in flight): with four the ring is bandwidth-bound (its bytes over the measured time); with two,
    each copy arrives a latency after the one two before it, so two steps last a latency and a copy."""
    rings = {r["slots"] - 1: r for r in streams if r["kind"] == "weight_stream" and "slots" in r}
    if not {2, 4} <= set(rings):
        return None
    wide, narrow = rings[4], rings[2]
    total = 3 * wide["k"] * wide["n"] * 2
    bandwidth = total / (wide["measured_ms"] * 1e-3)
    block = wide["tiling"][0] * wide["tiling"][1] * 2
    latency = 2 * narrow["measured_ms"] * 1e-3 / narrow["grid_steps"] - block / bandwidth
    return dict(bandwidth=bandwidth, share=bandwidth / GENERATIONS[wide["generation"]].hbm_bytes_per_s, latency=latency)


def weight_stream(block_rows: int, width: int, slots: int):
    """Weights [R, width] streamed from HBM in [block_rows, width] blocks, a block's first rows summed
    (no MXU work): a DMA-only ring of `slots` slots that the kernel fills itself
    (`runtime.rings.consecutive_blocks`, as the gated delta rule's decode does; ragged_dot's ring
    copies by a plan of its own): at each step it waits for its block, then starts the copy
    slots - 1 blocks ahead (slots - 1 in flight)."""
    def body(w_hbm, o_ref, buf, sems):
        i = pl.program_id(0)
        block = rings.consecutive_blocks(w_hbm, buf, sems)

        @pl.when(i == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += block[:8, :].astype(jnp.float32)

    def fn(w):
        return pl.pallas_call(
            body, grid=(w.shape[0] // block_rows,), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((8, width), lambda i: (0, 0)), out_shape=jax.ShapeDtypeStruct((8, width), jnp.float32),
            scratch_shapes=[pltpu.VMEM((slots, block_rows, width), w.dtype), pltpu.SemaphoreType.DMA((slots,))],
            name="weight_stream_calibration")(w)
    return fn


def dense_mlp(x, residual, norm, w_gate, w_up, w_down, eps=1e-6):
    """A dense gated MLP's decode step as jax.jit hands it to XLA (helion's XLA baseline): the
    residual added, RMSNorm, gate and up projections, SiLU times up, down projection, the residual
    added back; weights [in, out], the rounding points of the Qwen reference."""
    hidden = x.astype(jnp.float32) + residual.astype(jnp.float32)
    normed = (hidden * jax.lax.rsqrt(jnp.mean(hidden * hidden, axis=-1, keepdims=True) + eps)
              * norm.astype(jnp.float32)).astype(x.dtype)
    gate = jnp.dot(normed, w_gate, preferred_element_type=jnp.float32).astype(x.dtype)
    up = jnp.dot(normed, w_up, preferred_element_type=jnp.float32).astype(x.dtype)
    act = (jax.nn.silu(gate.astype(jnp.float32)).astype(x.dtype) * up)
    out = jnp.dot(act, w_down, preferred_element_type=jnp.float32) + hidden
    return out.astype(x.dtype), hidden


STREAM_KINDS = ("weight_stream", "xla_mlp")


def case_program(case: dict):
    """(fn, abstract and concrete arguments) of one measured case: megablox's
    gmm (tokamax's Pallas kernel is its fork: same body and grid) at the
    recorded tiles, the guide's dense matmul, or a decode step's weights
    streamed (a DMA ring over a dense MLP's weights, or that MLP
    compiled by XLA)."""
    m, k, n = case["m"], case["k"], case["n"]
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    if case["kind"] == "dense":
        return dense_matmul(*case["tiling"], size=m), (bf16(m, k), bf16(k, n))
    if case["kind"] == "weight_stream":  # gate, up and down's rows in the ring's order, one array
        rows, width = case["tiling"]
        return weight_stream(rows, width, case["slots"]), (bf16(3 * k * n // width, width),)
    if case["kind"] == "xla_mlp":
        return dense_mlp, (bf16(m, k), bf16(m, k), bf16(k), bf16(k, n), bf16(k, n), bf16(n, k))
    if isinstance(case["group_sizes"], list):
        sizes = np.asarray(case["group_sizes"], np.int32)
    else:  # tokamax draws each row's group uniformly at random
        sizes = np.bincount(np.random.default_rng(0).choice(case["groups"], m), minlength=case["groups"]).astype(np.int32)
    weights = (case["groups"], k, n)
    if case["kind"] == "xla_ragged_dot" and case.get("transpose_rhs"):  # weights [G, N, K], as transformers holds them
        weights = (case["groups"], n, k)
        numbers = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                                    lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
        fn = lambda x, w, g: jax.lax.ragged_dot_general(x, w, g, numbers)
    elif case["kind"] == "xla_ragged_dot":
        fn = lambda x, w, g: jax.lax.ragged_dot(x, w, g)
    else:
        megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
        tiling = tuple(case["tiling"])
        fn = lambda x, w, g: megablox.gmm(x, w, g, jnp.bfloat16, tiling=tiling)
    return fn, (bf16(m, k), bf16(*weights), jnp.asarray(sizes))


def model_case(case: dict) -> dict:
    fn, args = case_program(case)
    generation = case["generation"]
    costs, copies = harness.walk(fn, args, generation)
    if case["kind"] == "gmm":
        costs = [bench.as_tokamax(c) for c in costs]
    # The measurements' kernels set no VMEM limit; their runs raised Mosaic's
    # default (their tiles do not fit it): give them the chip's VMEM.
    m = harness.measure(fn, args, generation, compiler_options=harness.chip_vmem_option(generation), costs=costs,
                        copies=copies, group_sizes=np.asarray(args[2]) if len(args) > 2 else None)
    return _row(case, m, regions_mapped=m.parts["regions_mapped"])


def _row(case: dict, m: "harness.Measurement", **extra) -> dict:
    """A calibration row: the case, its modeled parts in ms and modeled / measured."""
    ms = lambda key: m.parts[key] * 1e3
    return dict(case, modeled_ms=ms("modeled"), ratio=ms("modeled") / case["measured_ms"], compute_ms=ms("compute"),
                dma_ms=ms("dma"), xla_ops_ms=ms("around"), grid_steps=m.figures()["grid_steps"], **extra)


# ---------------------------------------------------------------- attention
# tokamax's experimental splash (tokamax/_src/ops/experimental/tpu/splash_attention), the kernel its
# Ironwood microbenchmarks measured, called as its benchmark script calls it
# (tokamax/experimental/utils/tuning/tpu/splash_attention_benchmarking.py): q [B, Hq, S, Dqk],
# k and v [B, Hkv, S, D]; GQA through its MQA kernel vmapped over KV heads and batch, base-2 exp,
# causal mask; "bwd" is jax.grad of the output's mean with the forward's blocks fixed at
# (512, 1024, 512) and the fused backward's (dkv) blocks tuned. The script tunes every block in
# 256..8192, both layouts per operand and both schedulers; the rows here take the fastest of a
# sweep over the choices that led a wider one (MODELED at 4k and 8k: blocks past these and
# sequence-minor q or v were slower, layouts moved the time by under 5%; at 8k, 2048-row and
# 2048-key blocks and the default scheduler were 3-4% slower in the forward, 50% in the backward).
SPLASH_FWD_SWEEP = (  # (block_q, block_kv, block_kv_compute), (q, k, v layouts: H head-dim minor, S seq minor), LP scheduler
    ((1024, 1024, 512), "HSH", True), ((1024, 1024, 512), "HHH", True), ((2048, 1024, 512), "HHH", True))
SPLASH_BWD_FWD_BLOCKS = (512, 1024, 512)
SPLASH_BWD_SWEEP = (  # the dkv kernel's (block_q_dkv, block_kv_dkv, block_kv_dkv_compute), layouts, LP scheduler
    ((512, 1024, 512), "HHH", False), ((1024, 1024, 512), "HHH", False), ((1024, 1024, 512), "HSH", True))
# The fused backward writes dq as f32 partials, one per KV block: at 128k tokens and 1024-key blocks
# 275 GB, past a core's HBM (libtpu: CompileTimeHbmOom). The tuner there can only have run longer
# KV blocks.
SPLASH_BWD_SWEEP_LONG = (((512, 4096, 512), "HHH", False), ((1024, 4096, 512), "HHH", False))
LONG_TOKENS = 131072


def _layouts(letters: str):
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as splash

    return [splash.QKVLayout.HEAD_DIM_MINOR if c == "H" else splash.QKVLayout.SEQ_MINOR for c in letters]


def splash_benchmark_program(case: dict, blocks, layouts: str, lp: bool):
    """(fn, arg specs) of one row of tokamax's splash microbenchmark."""
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as splash
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as mask_lib

    s = case["tokens"]
    fwd_blocks, dkv_blocks = (blocks, (None,) * 3) if case["pass_"] == "fwd" else (SPLASH_BWD_FWD_BLOCKS, blocks)
    fwd_blocks, dkv_blocks = [tuple(min(b, s) if b else b for b in x) for x in (fwd_blocks, dkv_blocks)]
    q_layout, k_layout, v_layout = _layouts(layouts)
    config = splash.SplashConfig(block_q=fwd_blocks[0], block_kv=fwd_blocks[1], block_kv_compute=fwd_blocks[2],
                                 block_q_dkv=dkv_blocks[0], block_kv_dkv=dkv_blocks[1], block_kv_dkv_compute=dkv_blocks[2],
                                 q_layout=q_layout, k_layout=k_layout, v_layout=v_layout, use_experimental_scheduler=lp,
                                 use_base2_exp=True)
    kernel = splash.make_splash_mqa_single_device(mask_lib.CausalMask((s, s)), config=config)

    def forward(q, k, v):
        q = q.reshape(q.shape[:-3] + (k.shape[-3], -1) + q.shape[-2:])
        return jax.vmap(jax.vmap(kernel))(q, k, v)  # over batch, then over KV heads (MQA per KV head)

    fn = forward if case["pass_"] == "fwd" else jax.grad(lambda q, k, v: forward(q, k, v).mean(), argnums=(0, 1, 2))
    b, hq, hk, dqk, dv = case["batch"], case["q_heads"], case["kv_heads"], case["head_dim_qk"], case["head_dim_v"]
    return fn, [((b, hq, s, dqk), jnp.bfloat16), ((b, hk, s, dqk), jnp.bfloat16), ((b, hk, s, dv), jnp.bfloat16)]


def tokamax_attention_program(case: dict):
    """(fn, arg specs) of one row of tokamax's autotuning cache: its attention op ([B, S, H, D]) on
    its experimental splash at the cached config, causal, forward."""
    from tokamax._src.ops.attention import pallas_mosaic_tpu as tpu_op

    # Its device check reads the default device, this CPU: the model only traces it and compiles it for a TPU.
    tpu_op.PallasMosaicTpuFlashAttention.supported_on = lambda self, device: True
    c = case["config"]
    layout = tpu_op.splash.QKVLayout
    op = tpu_op.PallasMosaicTpuFlashAttention(config=tpu_op.Config(
        block_q=c["block_q"], block_kv=c["block_kv"], block_kv_compute=c["block_kv_compute"], q_layout=layout(c["q_layout"]),
        k_layout=layout(c["k_layout"]), v_layout=layout(c["v_layout"]),
        use_experimental_scheduler=c["use_experimental_scheduler"], use_base2_exp=True))
    fn = lambda q, k, v: op(q, k, v, is_causal=True, logits_scale=case["logits_scale"])
    b, s = case["batch"], case["tokens"]
    return fn, [((b, s, case["q_heads"], case["head_dim_qk"]), jnp.bfloat16),
                ((b, s, case["kv_heads"], case["head_dim_qk"]), jnp.bfloat16),
                ((b, s, case["kv_heads"], case["head_dim_v"]), jnp.bfloat16)]


def _attention_parts(fn, specs, generation: str) -> dict:
    """The program's modeled parts, per kernel too, and what the single MXU-calibrated clock gave
    (`before_ms`: every bundle at `clock_hz`, no MXU floor)."""
    m = harness.measure(fn, [jax.ShapeDtypeStruct(s, d) for s, d in specs], generation, "splash",
                        compiler_options=harness.chip_vmem_option(generation))
    uncounted = [dataclasses.replace(c, dots_counted=False) for c in m.costs]
    before = harness.model(uncounted, m.report, generation)
    per_kernel = lambda costs: {c.name.split("(")[0]: pipeline.kernel_seconds(c, s, generation)
                                for c, s in zip(costs, m.kernel_schedules)}
    return dict(parts=m.parts, before=before.parts, kernels=per_kernel(m.costs), before_kernels=per_kernel(uncounted),
                steps=m.figures()["grid_steps"], measurement=m)


def model_attention_case(case: dict, keep_programs: bool = False) -> dict:
    """A measured attention row, MODELED: tokamax's cache rows at their recorded config; the
    microbenchmark's rows at the fastest of their sweep. A "bwd" row is the backward pass: the
    jax.grad program less the forward kernel it reruns (the document's backward FLOPs are 2.5x the
    forward's, the backward's own, and its times are 2.1-2.3x the forward's; tokamax's cached VJP
    timings, which take the forward's residuals as given, are 2.2-2.4x its cached forward ones);
    the whole program is `program_ms`."""
    generation = case["generation"]
    if case["kind"] == "tokamax_attention":
        c = case["config"]
        tried = {"cached": (tokamax_attention_program(case), c)}
    else:
        sweep = (SPLASH_FWD_SWEEP if case["pass_"] == "fwd" else
                 SPLASH_BWD_SWEEP_LONG if case["tokens"] >= LONG_TOKENS else SPLASH_BWD_SWEEP)
        tried = {f"{'x'.join(map(str, b))} {lay}{' LP' if lp else ''}": (splash_benchmark_program(case, b, lay, lp), None)
                 for b, lay, lp in sweep}
    results = {}
    for label, ((fn, specs), _) in tried.items():
        try:
            got = _attention_parts(fn, specs, generation)
        except Exception as err:  # noqa: BLE001  (a candidate that does not compile is left out, and said)
            results[label] = dict(error=str(err).splitlines()[0][:160])
            continue
        # A backward row: the program less the forward kernel it reruns (the fused backward kernel
        # and XLA's ops: di, the sum of dq's per-KV-block partials).
        rerun = lambda ks: sum(k["modeled"] for name, k in ks.items() if case["pass_"] == "bwd" and "_fwd" in name)
        modeled = got["parts"]["modeled"] - rerun(got["kernels"])
        before = got["before"]["modeled"] - rerun(got["before_kernels"])
        results[label] = dict(modeled_ms=modeled * 1e3, before_ms=before * 1e3, program_ms=got["parts"]["modeled"] * 1e3,
                              steps=got["steps"], regions_mapped=got["parts"]["regions_mapped"])
        if keep_programs:
            results[label]["got"] = got
    ok = {k: r for k, r in results.items() if "modeled_ms" in r}
    if not ok:
        raise RuntimeError(f"no candidate of {case['kind']} {case['tokens']} compiles: {results}")
    label = min(ok, key=lambda k: ok[k]["modeled_ms"])
    best = ok[label]
    return dict(case, tiling=label, modeled_ms=best["modeled_ms"], ratio=best["modeled_ms"] / case["measured_ms"],
                before_ms=best["before_ms"], before_ratio=best["before_ms"] / case["measured_ms"],
                program_ms=best["program_ms"], grid_steps=best["steps"], regions_mapped=best["regions_mapped"],
                candidates={k: round(r["modeled_ms"], 3) if "modeled_ms" in r else r["error"] for k, r in results.items()},
                **({"got": best["got"]} if keep_programs else {}))


def derived_issue_clock_hz(generation: str = "tpu7x", rows: list[dict] | None = None) -> float:
    """The issue clock at which the model's forward times of tokamax's cached splash rows on
    `generation` (`fits_issue_clock`) match their measurements in geometric mean (the MXU floors
    held fixed): a bisection over the clock, each row's steps and schedules compiled once."""
    cases = [c for c in json.loads(CASES.read_text()) if c.get("fits_issue_clock") and c["generation"] == generation]
    programs = [(c, model_attention_case(c, keep_programs=True)["got"]) for c in cases]
    saved = dict(pipeline.ISSUE_CLOCK_HZ)

    def log_ratio(clock):
        pipeline.ISSUE_CLOCK_HZ[generation] = clock
        remodeled = lambda m: harness.model(m.costs, m.report, generation).modeled_s
        return np.mean([np.log(remodeled(g["measurement"]) * 1e3 / c["measured_ms"]) for c, g in programs])

    low, high = 0.5e9, 4e9
    try:
        for _ in range(30):
            mid = (low + high) / 2
            low, high = (low, mid) if log_ratio(mid) < 0 else (mid, high)
    finally:
        pipeline.ISSUE_CLOCK_HZ.clear()
        pipeline.ISSUE_CLOCK_HZ.update(saved)
    return (low + high) / 2


def vmatmul_pace_cycles(generation: str) -> float:
    """Cycles (of `clock_hz`) per vmatmul of the dense calibration matmul's accumulate step."""
    report = harness.compile(dense_matmul(1024), [DENSE_ARG] * 2, generation, "dense_calibration")
    (kernel,) = report.kernels.values()
    schedule = kernel.schedule
    return accumulate_cycles(generation, 1024) / (schedule.matmuls - sum(r.matmuls for r in schedule.regions))


ATTENTION_KINDS = ("splash", "tokamax_attention")


# ---------------------------------------------------------------- paged attention
def model_rpa_case(case: dict) -> dict:
    """Ragged paged attention v3 (tpu-inference 0.32.0's kernel, which sglang-jax's measured port
    follows) as the measurement ran it: every sequence `query` new tokens on `context` tokens of
    bf16 cache (its packed K/V layout, row-major, donated), all of them MIXED calls (its
    distribution), at the measured `m_block_sizes`; its own copies counted as they run
    (harness.measure_profiled), its cache update off (the tokens are already in the cache)."""
    import paged_bench
    import tpu_inference_kernels

    generation, seqs, query, context, page = (case[k] for k in ("generation", "seqs", "query", "context", "page_size"))
    rpa = tpu_inference_kernels.module("kernels.ragged_paged_attention.v3.kernel", generation)
    pages_per_seq = context // page
    num_pages = seqs * pages_per_seq
    pages = np.random.default_rng(0).permutation(num_pages).astype(np.int32).reshape(seqs, pages_per_seq)
    routing = dict(kv_lens=np.full(seqs, context, np.int32), page_indices=pages,
                   cu_q_lens=(np.arange(seqs + 1) * query).astype(np.int32), num_seqs=np.int32(seqs),
                   num_pages=num_pages)
    cache = rpa.get_kv_cache_shape(num_pages, page, case["kv_heads"], case["head_dim"], jnp.bfloat16)
    row_major = tuple(range(len(cache)))
    new = ((seqs * query, case["kv_heads"], case["head_dim"]), jnp.bfloat16)
    data = [((seqs * query, case["q_heads"], case["head_dim"]), jnp.bfloat16), new, new, (cache, jnp.bfloat16, row_major)]
    index = [routing["kv_lens"], pages.reshape(-1), routing["cu_q_lens"], np.array([0, 0, seqs], np.int32)]

    def fn(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution):
        return rpa.ragged_paged_attention(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                                          update_kv_cache=False, sm_scale=case["head_dim"] ** -0.5,
                                          sliding_window=case["sliding_window"], m_block_sizes=tuple(case["tiling"]),
                                          vmem_limit_bytes=GENERATIONS[generation].vmem_bytes)

    m = harness.measure_profiled(fn, paged_bench.arguments(data, index),
                                 paged_bench.profile_args(data, index, (3,), routing), generation, "RPA",
                                 layouts={3: row_major},
                                 compile_options=dict(donate_argnums=(3,), out_layouts=(None, row_major)))[0]
    return _row(case, m, hbm_bytes=m.figures()["hbm_bytes"])


RPA_KINDS = ("rpa_v3",)

# Measured kernels that no package this bench can install holds: listed with the reason, not modeled.
UNAVAILABLE = {
    "gmm_v2": "n/a: gmm_v2 (tokamax's experimental grouped matmul) is in neither tokamax 0.0.12, the newest this "
              "machine's package index holds, nor tpu-inference 0.32.0",
}


def _limit(r: dict) -> str:
    """A perf test's asserted limit, where the measured time is derived from it."""
    return f" (its test's limit, {r['limit_ms']} ms, over 1.1)" if "limit_ms" in r else ""


def _described(r: dict) -> str:
    """A case's kernel and shape, in a line."""
    if r["kind"] in ATTENTION_KINDS:
        return (f"{r['kind']} {r['generation']} {r.get('pass_', '')} {r['tokens']} tokens, head dims "
                f"{r['head_dim_qk']}/{r['head_dim_v']}")
    if r["kind"] == "gmm_v2":
        return (f"{r['kind']} {r['generation']} {r['pass_']} {r['m']} x {r['k']} x {r['n']}, {r['groups']} groups, "
                f"weights {r['weights']}{', activation ' + r['activation'] if r.get('activation') else ''}")
    return f"{r['kind']} {r['generation']} {r.get('m')} x {r.get('k')} x {r.get('n')}"




def write_calibration(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    harness.write_atomically(out / "calibration.json", json.dumps(rows, indent=1) + "\n")
    def summary(label, group):
        ratios = np.array([r["ratio"] for r in group])
        within = sum(1 / TARGET <= x <= TARGET for x in ratios)
        return (f"- {label}: **{within} of {len(group)} within {TARGET}x**; ratio geometric mean "
                f"{np.exp(np.log(ratios).mean()):.2f}, range {ratios.min():.2f} to {ratios.max():.2f}.")

    failed = [r for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    matmuls = [r for r in rows if r["kind"] not in ATTENTION_KINDS + STREAM_KINDS + RPA_KINDS]
    streams = [r for r in rows if r["kind"] in STREAM_KINDS]
    paged = [r for r in rows if r["kind"] in RPA_KINDS]
    pallas = [r for r in matmuls if r["kind"] != "xla_ragged_dot"]
    xla = [r for r in matmuls if r["kind"] == "xla_ragged_dot"]
    splash = [r for r in rows if r["kind"] == "splash"]
    cached = [r for r in rows if r["kind"] == "tokamax_attention"]
    lines = [
        "# Calibration: the schedule model against public TPU measurements",
        "",
        "Each row is a published measurement, reproduced with the model (bench/pipeline.py) at the same",
        "shapes, tiles and generation. The model's figure is MODELED on a CPU machine; the measured one is",
        "the source's. `ratio` = modeled / measured. The grouped matmuls were measured on tokamax's Pallas",
        "kernel, a fork of megablox's gmm with the same kernel body and grid, which is what we model; it runs",
        "its grid in an in-kernel pipeline under a grid-less pallas_call, so a v5p megacore runs it on one core.",
        "",
        "## Summary: the model against each group of measurements",
        "",
        summary("Pallas matmuls", pallas),
    ] + ([summary("attention, tokamax's Ironwood microbenchmarks (tpu7x; not used to fit anything)", splash)] if splash else []) + (
        [summary(f"attention, tokamax's autotuning cache on {g} (tpu7x's rows fit its issue clock)",
                 [r for r in cached if r["generation"] == g]) for g in dict.fromkeys(r["generation"] for r in cached)]) + (
        [summary("XLA's own ragged_dot (ops around kernels are modeled the same way)", xla)] if xla else []) + (
        [summary("a decode step's weights streamed from HBM (tpu7x: DMA rings, XLA's dense MLP)", streams)]
        if streams else []) + (
        [summary(label, group) for label, group in (
            ("ragged paged attention v3, full attention (sglang-jax's tpu7x measurements)",
             [r for r in paged if not r["sliding_window"]]),
            ("ragged paged attention v3, a 128-token window (the same)", [r for r in paged if r["sliding_window"]]))
         if group]) + [
        "",
        "## Matmuls",
        "",
        "| kernel | gen | M x K x N | groups | tiles | measured ms | modeled ms | ratio | kernel compute ms "
        "| kernel DMA ms | XLA ops ms | grid steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in matmuls:
        lines.append(
            f"| {r['kind']} | {r['generation']} | {r['m']} x {r['k']} x {r['n']} | {r.get('groups', '-')} "
            f"| {'x'.join(map(str, r['tiling'])) or ('XLA, weights [G, N, K]' if r.get('transpose_rhs') else 'XLA')} | {r['measured_ms']:.3f} | {r['modeled_ms']:.3f} | {r['ratio']:.2f} "
            f"| {r['compute_ms']:.3f} | {r['dma_ms']:.3f} | {r['xla_ops_ms']:.3f} | {r['grid_steps']} |")
    if splash or cached:
        lines += [
            "",
            "## Attention: tokamax's experimental splash",
            "",
            "Causal, bf16. `splash` rows: tokamax's Ironwood microbenchmarks (batch 1, 32 query heads, 8 KV heads,",
            "its benchmark script's program: the MQA kernel vmapped over KV heads), MODELED at the fastest of a small",
            "sweep under its own rules (`blocks`: block_q x block_kv x block_kv_compute of the forward, of the fused",
            "backward (dkv) kernel for `bwd`, whose forward runs at 512 x 1024 x 512 as the script fixes it; layouts",
            "of q, k, v: H head-dim minor, S sequence minor; LP: libtpu's LP scheduler). A `bwd` row is the backward",
            "pass: the jax.grad program less the forward kernel it reruns (the fused backward kernel and XLA's ops);",
            "`grad program ms` is the whole program.",
            "`tokamax_attention` rows: tokamax's attention op at the config its autotuner cached. `before fix`:",
            "the model with every bundle at the MXU-calibrated clock and no MXU floor (see below).",
            "",
            "| kernel | gen | pass | batch x tokens | heads q/kv | head dims qk/v | blocks | measured ms | MODELED ms "
            "| ratio | before fix ms | ratio before | grad program ms | grid steps |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in splash + cached:
            if r["kind"] == "tokamax_attention":
                c = r["config"]
                blocks = (f"{c['block_q']}x{c['block_kv']}x{c['block_kv_compute']} "
                          f"{''.join('HS'[x - 1] for x in (c['q_layout'], c['k_layout'], c['v_layout']))}"
                          f"{' LP' if c['use_experimental_scheduler'] else ''}")
            else:
                blocks = r["tiling"]
            program = f"{r['program_ms']:.3f}" if r["pass_"] == "bwd" else "-"
            lines.append(
                f"| {r['kind']} | {r['generation']} | {r['pass_']} | {r['batch']} x {r['tokens']} | {r['q_heads']}/{r['kv_heads']} "
                f"| {r['head_dim_qk']}/{r['head_dim_v']} | {blocks} | {r['measured_ms']:.3f} | {r['modeled_ms']:.3f} "
                f"| {r['ratio']:.2f} | {r['before_ms']:.3f} | {r['before_ratio']:.2f} | {program} | {r['grid_steps']} |")
    if failed:
        lines += ["", "The backward at 128k tokens: the benchmark script's program writes dq as f32 partials, one per KV",
                  "block of the fused backward: 275 GB at 1024-key blocks, past a core's 94.7 GB (libtpu:",
                  "CompileTimeHbmOom). At 4096-key blocks head dim 128 fits and is modeled; head dims 192 and 256 need",
                  "135 GB there, and longer blocks were not tried here (compile time)."]
        lines += ["", "Not modeled (no program of the row compiles, or its kernel is not to be had here):", ""] + [
            f"- {_described(r)}, measured {r['measured_ms']} ms{_limit(r)}: {r['error']}" for r in failed]
    if streams:
        lines += [
            "",
            "## Decode: weights streamed from HBM",
            "",
            "A decode step reads each weight once, so its time is the weights' bytes over what HBM delivers.",
            "helion's measurements on one tpu7x core, Qwen3-8B's dense MLP at one token (gate and up [4096, 12288],",
            "down [12288, 4096], bf16): `weight_stream`, its DMA-only ring of [256, 4096] (2 MiB) copies with D of",
            "them in flight (helion's ring depth: its slots, the prefetch distance in copies), modeled as a Pallas",
            "kernel that copies the same blocks in the same order itself, D in flight (ragged_dot's ring, which",
            "needs a slot more: it starts a copy before reading the slot it waited for); `xla_mlp`, the MLP",
            "(RMSNorm, projections, SiLU, residual) compiled by XLA.",
            "",
            "| kernel | gen | weights MiB | blocks | copies in flight | measured us | MODELED us | ratio | kernel DMA us "
            "| XLA ops us | grid steps |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in streams:
            lines.append(
                f"| {r['kind']} | {r['generation']} | {3 * r['k'] * r['n'] * 2 / 2**20:.0f} "
                f"| {'x'.join(map(str, r['tiling'])) or 'XLA'} | {r['slots'] - 1 if 'slots' in r else '-'} "
                f"| {r['measured_ms'] * 1e3:.1f} | {r['modeled_ms'] * 1e3:.1f} "
                f"| {r['ratio']:.2f} | {r['dma_ms'] * 1e3:.1f} | {r['xla_ops_ms'] * 1e3:.1f} | {r['grid_steps']} |")
        fit = stream_fit(streams)
        if fit:
            lines += ["", f"Both rings fit one line: a copy arrives its latency after it starts or its bytes' time after "
                      f"the copy before it, at {fit['bandwidth'] / 1e12:.2f} TB/s ({fit['share']:.0%} of the table's) "
                      f"with a latency of {fit['latency'] * 1e6:.2f} us. The model's copies take this fit "
                      f"(`kernels/runtime/generations.py`): {pipeline.HBM_SHARE:.0%} of each generation's table bandwidth, and on "
                      f"tpu7x a latency of {pipeline.COPY_LATENCY_S['tpu7x'][0] * 1e6:.2f} us for copies of "
                      f"{pipeline.COPY_LATENCY_S['tpu7x'][1] >> 20} MiB or more (less for smaller ones)."]
    if paged:
        lines += [
            "",
            "## Paged attention: ragged paged attention v3",
            "",
            "sglang-jax's measurements of its port of tpu-inference's ragged paged attention v3 (vLLM's TPU kernel)",
            "on one tpu7x device: a speculative decode's verify step, every sequence 4 new tokens on a 16k-token",
            "bf16 cache (one KV head of 256 for 16 query heads, pages of 256 tokens), run as the kernel's MIXED call",
            "at the tuned blocks (`blocks`: query tokens fetched, KV tokens fetched, query and KV tokens computed",
            "per step). MODELED with tpu-inference 0.32.0's kernel, the one the port follows, at those blocks.",
            "",
            "| kernel | gen | sequences | context | window | blocks | measured ms | MODELED ms | ratio | kernel DMA ms "
            "| kernel compute ms | KV read MB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in paged:
            lines.append(
                f"| {r['kind']} | {r['generation']} | {r['seqs']} | {r['context']} | {r['sliding_window'] or 'full'} "
                f"| {'x'.join(map(str, r['tiling']))} | {r['measured_ms']:.4f} | {r['modeled_ms']:.4f} | {r['ratio']:.2f} "
                f"| {r['dma_ms']:.4f} | {r['compute_ms']:.4f} | {r['hbm_bytes'] / 1e6:.0f} |")
    lines += ["", "Sources:", ""] + [f"- {s}" for s in dict.fromkeys(r["source"] for r in rows + failed)]
    lines += ["", WHY_OFF]
    harness.write_atomically(out / "calibration.md", "\n".join(lines) + "\n")


WHY_OFF = """\
Where the model is off, and why (what it cannot see):
- Pallas matmuls: MXU-bound steps run at the published peak (the calibrated clock, or on tpu7x the dense
  matmul's vmatmul pace), so stalls the static schedule does not show are missing; DMAs run at the fit
  of the decode rings below (89% of the published HBM bandwidth on every generation; on tpu7x a latency
  per copy of 1.13 us at 2 MiB and more, less for smaller copies, 0.3 us at least and on the other
  generations; a streamed copy measured 3.21 TB/s on one tpu7x core, 87% of
  the 3.69 TB/s in our table: vllm-project/tpu-inference issue 3520). At the published bandwidth and
  0.3 us everywhere, tpu7x's grouped matmuls were 0.83-1.02x. The guide's dense times include dispatch
  from Python (timeit).
- Attention on tpu7x: with every bundle at the MXU-calibrated 1.03 GHz (`before fix`) the splash forward
  came out 1.7-2.3x slow and its backward 1.6-2.0x, while on v6e the same kernel is within 6%: tpu7x's
  softmax bundles do not wait on the MXU, and now issue at their own clock (docs/performance-model.md,
  "tpu7x: two rates"). What remains: the model grows slower than the measurement with the sequence
  (forward 0.96-1.11x at 4k-8k, 1.17-1.25x at 32k, 1.26-1.36x at 128k; backward 0.99-1.30x at 4k-8k,
  1.23-1.42x at 32k, 1.08x at 128k). The copy fit (below) moved the backward up, at head dims 192 and
  256 the most (32k: 1.24x and 1.30x before it): its steps wait on copies that the fit (a share of the
  bandwidth, a latency that grows with a copy's bytes) makes slower than tpu7x moved them, and these
  rows do not tell which part overstates them. The measured time per 1024x1024
  block falls from 1.8 us at 4k to 1.35 us at 128k as the masked diagonal blocks thin out; the model's
  per-step cycles fall less steeply, so at 128k, where nearly every step is unmasked, its unmasked steps
  are what is about 1.35x slow. The 1k-token, 16-sequence cached row (one masked block per head, 128
  steps) is 0.69x: its steps are the least like the fit's.
- XLA's own ragged_dot: one loop over (row tile, group, column tile) whose index skips the pairs of a
  row tile and a group that share no row, so it runs a trip per pair that does (times the column
  tiles), which the group sizes give (`tpu_schedule.RaggedLoop`); each trip costs its body's cycles or
  its DMAs at what HBM delivers, whichever is longer, as every XLA op. On tpu7x that is 0.93-1.03x of the
  measured times, from 8 rows (decode: 8 experts of 4096 x 4096, one row each) to 393216, weights
  [G, K, N] or [G, N, K] (transformers' layout). Two limits: where XLA also tiles the contraction
  inside the loop (weights [G, N, K] with K 2048 and 7168 here), the space holds far more trips than
  the measured times allow, so the loop is counted once and the row is a lower bound (0.26-0.27x);
  on v5e (one point) the model is 0.56x: there the trips' cycles and DMAs (2.6 and 3.2 ms) add up
  to about the measured 5.6 ms, as if they did not overlap, while the model keeps the longer. Before the
  trips were counted (the loop once) the first four rows were 0.18-0.29x.
- A decode step's weights streamed (tpu7x): helion's ring of 2 MiB copies measured 3.29 TB/s with four in
  flight (89% of the table's 3.69 TB/s; a streamed copy in tpu-inference issue 3520: 3.21 TB/s) and 127 us
  with two, which a latency of about 1.1 us per 2 MiB copy explains (two in flight hide only part of
  it). The model's copies take that fit (`runtime/generations.py`: `HBM_SHARE`, `COPY_LATENCY_S`), so both
  rings are rows the fit reproduces rather than checks; at the published bandwidth and 0.3 us they were
  0.90x and 0.65x. The latency is not one for every copy: tokamax's splash backward on tpu7x, whose steps
  wait on copies of a few hundred KiB, measured about 1 us per step, less than that latency alone (with
  it on every copy the model put those rows 1.13-1.33x over their measurements), so the model's latency
  grows with a copy's bytes up to the ring's (an interpolation, no measurement between), never below
  0.3 us. What the fit implies: a step of Pallas's two-slot pipeline (one copy in flight) waiting on a
  copy of megabytes pays the whole latency, as at decode; a ring with three 2 MiB copies in flight
  (ragged_dot's ring entries) is bandwidth-bound. XLA's ops stream at the same share, so the MLP XLA
  streamed at 2.99 TB/s is modeled 0.91x: XLA rows that stream weights at decode (the headline's eager loop, grouped_mm,
  batched_mm) are modeled about a tenth faster than this measurement of XLA. These are one chip's
  points: the share is taken for the other generations, and their latency is not measured here.
- Ragged paged attention v3 (tpu7x): at full attention over 16k-token contexts, as our paged bench's rows
  run (long contexts, the cache read once), the model is within a tenth of the measured times. With a
  128-token window each sequence reads a page or two and the measured step is 2.4-3.8x the model's: the
  kernel copies its own pages, and the model overlaps such copies with its compute entirely (a lower
  bound), while here the copies, four small ones per sequence (its profile counts 16 and 128), have next
  to no compute to hide behind. Each charged the model's per-copy latency one after another, the rows
  would come out 0.75x and 1.19x: the measurements lie between the copies hidden and exposed. Our paged
  rows are not of this kind, but the windowed anchor rows (gpt-oss's sliding layer) are.
- Other XLA ops with a loop whose count is known only at run time are counted once, and a DMA whose size
  is in a register falls back to the op's HBM operands once each: treat such figures as lower bounds.
  In our bench they are the small routing ops around the kernels; headline.md marks where they matter."""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["clock", "issue-clock", "measured"])
    parser.add_argument("--generations", nargs="*", default=list(GENERATIONS), choices=list(GENERATIONS))
    parser.add_argument("--kinds", nargs="*", default=None,
                        help="only these case kinds (gmm, dense, xla_ragged_dot, splash, tokamax_attention); the "
                             "other rows of --out's calibration.json are kept")
    parser.add_argument("--tokens", nargs="*", type=int, default=None, help="only attention cases of these lengths")
    parser.add_argument("--passes", nargs="*", default=None, choices=["fwd", "bwd"], help="only attention cases of these passes")
    parser.add_argument("--out", type=Path, default=harness.BENCH / "results")
    args = parser.parse_args(argv)
    sys.argv = sys.argv[:1]  # tokamax parses absl flags from sys.argv on first use
    if args.what == "clock":
        for generation in args.generations:
            clock = derived_clock_hz(generation)
            print(f"{generation}: {clock / 1e9:.3f} GHz derived, table has {GENERATIONS[generation].clock_hz / 1e9:.3f}")
        return 0
    if args.what == "issue-clock":
        for generation in pipeline.ISSUE_CLOCK_HZ:
            print(f"{generation}: vmatmul pace {vmatmul_pace_cycles(generation):.3f} cycles derived, table has "
                  f"{pipeline.VMATMUL_PACE_CYCLES[generation]:.3f}; issue clock {derived_issue_clock_hz(generation) / 1e9:.3f} "
                  f"GHz derived, table has {pipeline.ISSUE_CLOCK_HZ[generation] / 1e9:.3f}", flush=True)
        return 0
    key = lambda c: json.dumps({k: v for k, v in c.items() if k not in ("source",)}, sort_keys=True)
    cases = json.loads(CASES.read_text())
    old = {}
    if (args.kinds, args.tokens, args.passes) != (None,) * 3 and (args.out / "calibration.json").exists():
        old = {key({k: v for k, v in r.items() if k in c}): r for r in json.loads((args.out / "calibration.json").read_text())
               for c in cases if all(r.get(k) == v for k, v in c.items())}
    rows = {i: old[key(c)] for i, c in enumerate(cases) if key(c) in old}  # kept until redone
    todo = [i for i, c in enumerate(cases) if c["generation"] in args.generations
            and (args.kinds is None or c["kind"] in args.kinds)
            and (args.tokens is None or c.get("tokens") in args.tokens)
            and (args.passes is None or c.get("pass_") in args.passes)]
    todo.sort(key=lambda i: cases[i].get("tokens", 0) > 32768)  # the longest sequences last
    for i in todo:
        case = cases[i]
        try:
            if case["kind"] in UNAVAILABLE:
                raise RuntimeError(UNAVAILABLE[case["kind"]])
            row = (model_attention_case(case) if case["kind"] in ATTENTION_KINDS
                   else model_rpa_case(case) if case["kind"] in RPA_KINDS else model_case(case))
        except Exception as err:  # noqa: BLE001  (a case none of whose programs compiles: the row says why)
            rows[i] = dict(case, error=str(err).splitlines()[0][:400])
            print(f"{case['kind']} {case['generation']}: {rows[i]['error']}", flush=True)
            write_calibration([rows[j] for j in sorted(rows)], args.out)
            continue
        rows[i] = row
        shape = (f"{case['tokens']} tokens {case.get('pass_', '')} d{case['head_dim_qk']}" if case["kind"] in ATTENTION_KINDS
                 else f"{case['seqs']} x {case['context']}" if case["kind"] in RPA_KINDS
                 else f"{case['m']}x{case['k']}x{case['n']}")
        print(f"{case['kind']} {case['generation']} {shape}: MODELED {row['modeled_ms']:.3f} ms, measured "
              f"{case['measured_ms']:.3f} ms ({row['ratio']:.2f}x)", flush=True)
        write_calibration([rows[j] for j in sorted(rows)], args.out)  # each row as it lands: a stopped run loses none
    write_calibration([rows[j] for j in sorted(rows)], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
