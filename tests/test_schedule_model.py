"""The schedule model: libtpu's bundles read (kernels/tpu_schedule.py), the
pipeline sum (bench/pipeline.py), and the two joined through the grid walk."""

import json
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import bench
import calibration
import grid_walk
import pipeline
import tpu_compile
import tpu_schedule
from runtime.generations import GENERATIONS

# A hand-written schedule in libtpu's format: two entry bundles, a grid loop
# of 3 iterations (its exit test, immediate 3, comes before the inner
# loop's) holding a compute stage that skips to region 9, an inner loop of
# 4 iterations, and a pl.when region 7.
HAND_SCHEDULE = """\
     0   :  { %1 = vsyncpa [#allocation5], 0  ;;  %s0 = inlined_call_operand.hbm [shape: bf16[512,256], index: 0, kind: input, shape index: {}]  ;;  %s1 = inlined_call_operand.vmem [shape: f32[8,128], index: 1, kind: output, shape index: {}] }
   0x1   :  { %2 = smov.u32 0 }
   0x2 LB: > { %s3 = sadd.s32 1, %s4 ;; %p4 = scmp.ge.s32.totalorder %s3, 3 /* loop exit test */ } /* Start region 5 */
   0x3   : > { %5 = sbr.rel (%p1) target = $region9 }
   0x4   : > { }
   0x5   : > { }
   0x6   : > { }
   0x7   : > { }
   0x8 LB: >> { %v1 = vmatmul.mubr.bf16.gmra.mxu0 %v2 ;; %s6 = sadd.s32 1, %s7 } /* Start region 6 */
   0x9   : >> { %p2 = scmp.ge.s32.totalorder %s6, 4 /* loop exit test */ }
   0xa   : >> { %8 = sbr.rel (!%p2) target = $region6 }
   0xb   : >> { }
   0xc   : >> { }
   0xd   : >> { }
   0xe   : >> { }
   0xf   : > { %9 = sbr.rel (%p3) target = $region7 }
  0x10   :  {}
  0x11   :  {}
  0x12   :  {}
  0x13   :  {}
  0x14   : > { %v3 = vmatpush1.bf16.msra.mxu0 %v4  ;;  %12 = dma.hbm_to_vmem [thread:$0]  /*hbm=*/%s0, /*size_in_granules=*/16, /*vmem=*/%s1, /*dst_syncflagno=*/[#allocation1]  ;;  %13 = dma.vmem_to_vmem [thread:$0]  /*src=*/%s1, /*size_in_granules=*/64, /*dst=*/%s2 }
  0x15   : > { %v5 = vadd.f32 %v3, %v3 }
  0x16 PF: > { %v6 = vadd.f32 %v5, %v5 } /* Start/End empty region 7 */
  0x17 PF: > { %s8 = smov.u32 0 } /* Start/End empty region 9 */
  0x18   : > { %10 = sbr.rel (!%p4) target = $region5 }
  0x19   : > { }
  0x1a   : > { }
  0x1b   : > { }
  0x1c   : > { }
  0x1d   :  { %11 = vsyncpa [#allocation5], 1 }
"""


def test_reads_a_hand_written_schedule():
    s = tpu_schedule.read_schedule(HAND_SCHEDULE)
    assert s.bundles == 30
    assert s.grid_loop.start == 0x2 and s.grid_loop.end == 0x1d and s.grid_loop.trip_count == 3
    inner = 7  # 0x8..0xe: body and the back branch's 4 delay slots
    # One iteration: 27 bundles, the inner loop's 7 run 4 times.
    assert s.iteration_cycles == 27 - inner + 4 * inner
    assert s.outside_loop_cycles == 3
    # The compute stage: after 0x3's delay slots (0x8) up to region 9 (0x17).
    assert (s.stage.start, s.stage.end, s.stage.cycles, s.stage.matmuls) == (0x8, 0x17, 15 - inner + 4 * inner, 4)
    # The pl.when body: after 0xf's delay slots up to region 7.
    (region,) = s.regions
    assert (region.start, region.end, region.cycles, region.matmuls) == (0x14, 0x16, 2, 0)
    assert s.matmuls == 4 and s.weight_pushes == 1
    assert s.total_cycles == 3 + 3 * s.iteration_cycles
    # 0x14's DMA (16 granules of 32 bytes) runs once per iteration; the VMEM-to-VMEM one moves no HBM bytes.
    assert s.hbm_dma_bytes == 3 * 16 * 32
    np.testing.assert_array_equal(s.step_cycles(np.array([[True], [False]])),
                                  [s.iteration_cycles, s.iteration_cycles - 2])
    assert s.fill_drain_cycles == 3 + 2 * (s.iteration_cycles - s.stage.cycles)


def test_xla_op_traffic_falls_back_to_its_operands():
    """Where a DMA's size is known only at run time, an XLA op's traffic is
    its HBM operands once each, at full bandwidth when that outlasts its cycles."""
    s = tpu_schedule.read_schedule(HAND_SCHEDULE.replace(
        "%13 = dma.vmem_to_vmem", "%13 = dma.general (%p1), /*src=*/%s1, /*size_in_granules=*/%s5, /*dst=*/%s2 ;; %14 = dma.vmem_to_vmem"))
    assert s.hbm_dma_bytes is None and s.hbm_operand_bytes == 512 * 256 * 2
    gen = GENERATIONS["v6e"]
    assert pipeline.around_seconds({"op": s}, "v6e") == pytest.approx(
        max(s.total_cycles / gen.clock_hz, 512 * 256 * 2 / pipeline.copy_bytes_per_s("v6e")))


# An XLA op's loops in libtpu's format, their bounds in registers: a copy walking a VMEM buffer's
# address 64 rows a trip while the next address is within 4024 rows of its start (63 trips), then
# 8 rows a trip from where it stopped to row 4088 (8 trips); then a loop bounded by a value loaded
# at run time, behind a branch taken because a counter stored as 0 in SMEM reads 0 (it never runs).
XLA_LOOPS_SCHEDULE = """\
     0   :  { %s0 = inlined_call_operand.vmem [shape: f32[256,2048], index: 0, kind: input, shape index: {}]  ;;  %s1 = inlined_call_operand.vmem [shape: f32[256,2048], index: 1, kind: output, shape index: {}]  ;;  %s20 = smov.u32 0 /* materialized constant */ } /* entry bundle: %copy_fusion = fusion(%a) */
   0x1   :  { %s2 = scalar_lea.vmem %s0, 4088  ;;  %s3 = smov.u32 %s0 /* copy for cssa */  ;;  %4 = sst [smem:[#allocation1]] %s20 }
   0x2   :  { %s4 = sadd.s32 4294967232, %s2 }
   0x3 LB: > { %v1 = vld [vmem:[%s5] sm:$0xff]  ;;  %s6 = scalar_lea.vmem %s5, 64  ;;  %s5 = sphi %s3, %s7 /* phi copy */ } /* Start region 3 */
   0x4   : > { %p1 = scmp.gt.s32.totalorder %s6, %s4  ;;  %s7 = smov.u32 %s6 }
   0x5   : > { %2 = sbr.rel (!%p1) target = $region3 }
   0x6   : > { }
   0x7   : > { }
   0x8   : > { }
   0x9   : > { }
   0xa   :  { %s8 = smov.u32 %s6 }
   0xb LB: > { %v2 = vld [vmem:[%s9] sm:$0xff]  ;;  %s11 = scalar_lea.vmem %s9, 8  ;;  %s9 = sphi %s8, %s11 } /* Start region 4 */
   0xc   : > { %p2 = scmp.gt.s32.totalorder %s11, %s2 }
   0xd   : > { %3 = sbr.rel (!%p2) target = $region4 }
   0xe   : > { }
   0xf   : > { }
  0x10   : > { }
  0x11   : > { }
  0x12   :  { %s21 = sld [smem:[#allocation1]] }
  0x13   :  { %p5 = scmp.ge.s32.totalorder %s21, 0 }
  0x14   :  { %5 = sbr.rel (%p5) target = $region9 }
  0x15   :  { }
  0x16   :  { }
  0x17   :  { }
  0x18   :  { %s22 = sld [smem:[#allocation2]]  ;;  %s24 = smov.u32 0 }
  0x19 LB: > { %s23 = sphi %s24, %s25  ;;  %s25 = sadd.s32 1, %s23 } /* Start region 8 */
  0x1a   : > { %p6 = scmp.lt.s32.totalorder %s25, %s22 }
  0x1b   : > { %6 = sbr.rel (%p6) target = $region8 }
  0x1c   : > { }
  0x1d   : > { }
  0x1e   : > { }
  0x1f   : > { }
  0x20 PF:  { } /* Start/End empty region 9 */
  0x21   :  { }
"""


def test_xla_loops_bounded_by_registers_are_counted():
    """A loop's trips where its bound follows from constants and the op's addresses (the second
    copy starts where the first stopped); a loop behind a taken branch counted once (it never runs);
    a Pallas kernel's (a custom call's) such loops stay uncounted (they are profiled per step)."""
    s = tpu_schedule.read_schedule(XLA_LOOPS_SCHEDULE)
    loops = sorted([s.grid_loop] + [c for c in s.program_controls if c.kind == "loop" and c.start != s.grid_loop.start],
                   key=lambda loop: loop.start)
    assert [(loop.start, loop.end) for loop in loops] == [(0x3, 0xa), (0xb, 0x12), (0x19, 0x20)]
    assert s.grid_loop.trip_count == 63 and s.dynamic_inner_loops == 0
    assert s.total_cycles == 3 + 63 * 7 + 1 + 8 * 7 + 7 + 7 + 2
    kernel = tpu_schedule.read_schedule(XLA_LOOPS_SCHEDULE.replace("%copy_fusion = fusion(%a)", "%k = custom-call(%a)"))
    assert kernel.grid_loop.trip_count is None and kernel.dynamic_inner_loops == 2


def test_xla_scatter_copies_its_buffer_every_call():
    """XLA's scatter-add into a buffer in VMEM (the eager experts loop's `index_add_`) copies the
    buffer in loops bounded by registers: counted, twice the rows cost their copy's bundles again
    (a bundle stores at most two vregs in these loops: 512 more f32 vregs take 256 more bundles)."""
    def program(rows):
        rng = np.random.default_rng(0)
        tokens = [np.sort(rng.choice(rows, 16, replace=False)).astype(np.int32) for _ in range(2)]

        def layer(x, w):
            out = jnp.zeros((rows, 2048), jnp.float32)
            for e, token in enumerate(tokens):
                out = out.at[token].add(jnp.dot(x[token], w[e], preferred_element_type=jnp.float32))
            return out.astype(x.dtype)

        report = tpu_compile.compile_for(layer, [((rows, 2048), jnp.bfloat16), ((2, 2048, 2048), jnp.bfloat16)],
                                         "v6e", "")
        for op, sched in report.schedules.items():
            assert sched.dynamic_inner_loops == 0 and (sched.grid_loop is None or sched.grid_loop.trip_count), op
        return sum(sched.total_cycles for op, sched in report.schedules.items() if "scatter" in op)

    assert program(512) - program(256) >= 256

def test_pipeline_sum_matches_a_hand_count():
    """Three steps at 1 byte/s, no latency: fetch(0) = 2, then
    max(5, fetch(1) 3) + max(1, fetch(2) 4 + write(0) 6) + max(2, write(1) 0),
    then write(2) = 7."""
    compute = np.array([5.0, 1.0, 2.0])
    fetch = np.array([2, 3, 4])
    write = np.array([6, 0, 7])
    assert pipeline.pipeline_seconds(compute, fetch, write, bytes_per_s=1.0, latency_s=0.0) == 2 + 5 + 10 + 2 + 7
    # A latency adds to each DMA that moves bytes, hidden where compute is longer.
    assert pipeline.pipeline_seconds(compute, fetch, write, 1.0, latency_s=1.0) == 3 + 5 + 11 + 2 + 8


def test_a_profiled_kernels_copies_started_a_step_ahead_pay_one_latency():
    """A profiled kernel's own copies (`own_copies_step_seconds`), at 1 byte/s, latency 1:
    copying within each step, a step lasts max(compute, latency + bytes); copying the next step's pages before waiting for its
    own, the queue never runs dry while copies are the longer part: one latency in all."""
    compute, copies = np.array([2.0, 1.0, 6.0]), np.array([4, 4, 4])
    within = pipeline.own_copies_step_seconds(compute, copies, copies, 1.0, 1.0)
    assert within.tolist() == [5.0, 5.0, 6.0]
    # Step 0 starts its own and step 1's pages, steps 1 and 2 the next step's; each waits for its own.
    ahead = pipeline.own_copies_step_seconds(compute, [8, 4, 0], copies, 1.0, 1.0)
    # step 0 waits for what it started (overlapped: until 1 + 4); step 1's copy arrived at 9,
    # step 2's at 13 (the queue busy throughout), each computes after its wait.
    assert ahead.tolist() == [5.0, 9.0 + 1.0 - 5.0, 13.0 + 6.0 - 10.0]
    assert ahead.sum() == 1 + copies.sum() + compute[-1]
    # Waits that do not add up to the starts: each step read as waiting for what it started.
    assert pipeline.own_copies_step_seconds(compute, copies, [1, 1, 1], 1.0, 1.0).tolist() == within.tolist()


@pytest.mark.parametrize("steps", [1, 3])
def test_pipeline_repeats_equal_the_steps_run_back_to_back(steps):
    """The block rule runs one outer tile's steps `repeats` times: the same
    as the steps written out that many times (boundaries overlap too)."""
    rng = np.random.default_rng(steps)
    compute, fetch, write = rng.random(steps), rng.integers(0, 5, steps), rng.integers(0, 5, steps)
    written_out = pipeline.pipeline_seconds(np.tile(compute, 4), np.tile(fetch, 4), np.tile(write, 4), 2.0, 0.5)
    assert pipeline.pipeline_seconds(compute, fetch, write, 2.0, 0.5, repeats=4) == pytest.approx(written_out)


def test_regions_match_the_kernels_conds_and_mosaics_own_count_as_running():
    """Conds [k == 0 (folded: one k step), pass, store]; the schedule has
    the pass, the store, and a region Mosaic added (no matmuls)."""
    region = lambda matmuls: tpu_schedule.Region(0, 1, 10, matmuls)
    schedule = types.SimpleNamespace(regions=[region(4), region(0), region(0)])
    runs = np.array([[True, True, False], [True, False, True]])
    cost = types.SimpleNamespace(when_known=[True] * 3, when_runs=runs, when_has_dot=[False, True, False],
                                 when_on_grid_only=[True, False, False])
    np.testing.assert_array_equal(pipeline.region_runs(cost, schedule), [[True, False, True], [False, True, True]])
    # An added region holding matmuls is not Mosaic's bookkeeping: no match.
    schedule.regions[2] = region(1)
    assert pipeline.region_runs(cost, schedule) is None


def test_regions_of_predicated_bodies_are_dropped():
    """Conds [start a copy, wait for it, pass, fill]: Mosaic predicates the copies' bodies (no region)
    and here the fill's too; the schedule's one region is the pass, whose steps are its own."""
    region = lambda matmuls: tpu_schedule.Region(0, 1, 10, matmuls)
    runs = np.array([[True, True, True, False], [False, True, False, True], [False, False, True, False]])
    cost = types.SimpleNamespace(when_known=[True] * 4, when_runs=runs, when_has_dot=[False, False, True, False],
                                 when_on_grid_only=[False] * 4, when_copies_only=[True, True, False, False])
    with_fill = types.SimpleNamespace(regions=[region(4), region(0)])
    np.testing.assert_array_equal(pipeline.region_runs(cost, with_fill), runs[:, 2:])
    pass_only = types.SimpleNamespace(regions=[region(4)])
    np.testing.assert_array_equal(pipeline.region_runs(cost, pass_only), runs[:, 2:3])


def test_megacore_splits_the_first_parallel_axis():
    core = pipeline.core_of_step((1, 4, 3), ("parallel", "parallel", "arbitrary"), cores=2)
    np.testing.assert_array_equal(core.reshape(4, 3), [[0] * 3, [0] * 3, [1] * 3, [1] * 3])
    assert not pipeline.core_of_step((4, 3), ("arbitrary", "arbitrary"), cores=2).any()


def _looping_kernel(steps: int):
    """A grid of `steps`, a fori_loop of 5 matmuls, and a pl.when body on even steps."""
    def body(x_ref, w_ref, o_ref):
        o_ref[...] = jnp.zeros_like(o_ref)

        def accumulate(_, carry):
            o_ref[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)
            return carry

        jax.lax.fori_loop(0, 5, accumulate, 0)

        @pl.when(pl.program_id(0) % 2 == 0)
        def _():
            o_ref[...] = o_ref[...] * 2.0 + jnp.exp(o_ref[...])

    return pl.pallas_call(
        body, grid=(steps,),
        in_specs=[pl.BlockSpec((128, 256), lambda i: (i, 0)), pl.BlockSpec((256, 256), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((128, 256), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((128 * steps, 256), jnp.float32), name="looping_kernel")


def test_compiled_schedule_joins_the_grid_walk():
    """libtpu's schedule of a kernel with a known loop and pl.when: the grid
    loop runs steps + 2 iterations, the inner loop's trip count is read, its
    matmuls count 5 times, and odd steps skip the pl.when body."""
    steps = 4
    fn = _looping_kernel(steps)
    specs = [((128 * steps, 256), jnp.bfloat16), ((256, 256), jnp.bfloat16)]
    report = tpu_compile.compile_for(fn, specs, "v6e", "looping_kernel")
    (kernel,) = report.kernels.values()
    s = kernel.schedule
    assert s.grid_loop.trip_count == steps + 2
    assert s.dynamic_inner_loops == 0
    # The same vmatmuls in each of the 5 trips, all inside the compute stage.
    assert s.matmuls % 5 == 0 and s.matmuls > 0 and s.stage.matmuls == s.matmuls
    (region,) = s.regions
    assert region.matmuls == 0 and region.cycles > 0

    (cost,) = grid_walk.kernel_costs(fn, [jax.ShapeDtypeStruct(*spec) for spec in specs], mxu_width=256)
    runs = pipeline.region_runs(cost, s)
    np.testing.assert_array_equal(runs[:, 0], [True, False, True, False])
    cycles = s.step_cycles(runs)
    assert cycles[1] == cycles[0] - region.cycles
    # The weights are fetched once, x once per step; the output written once per step.
    np.testing.assert_array_equal(cost.fetch_bytes, [128 * 256 * 2 + 256 * 256 * 2] + [128 * 256 * 2] * 3)
    np.testing.assert_array_equal(cost.write_bytes, [128 * 256 * 4] * 4)
    parts = pipeline.kernel_seconds(cost, s, "v6e")
    assert parts["regions_mapped"] and parts["cores"] == 1
    assert parts["compute"] == pytest.approx(cycles.sum() / GENERATIONS["v6e"].clock_hz)
    assert parts["modeled"] >= max(parts["compute"], parts["dma"])


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_clock_reproduces_the_published_peak(generation):
    """The table's clock is the rate at which libtpu's schedule of a dense
    bf16 matmul's accumulate steps reaches the published peak per core."""
    assert calibration.derived_clock_hz(generation) == pytest.approx(GENERATIONS[generation].clock_hz, rel=0.005)


def test_headline_baselines_do_the_same_work():
    """The headline's baselines (transformers' grouped_mm, batched_mm and
    eager loop, written in JAX) compute our experts forward: a baseline
    doing less work would flatter them."""
    import headline

    h = headline.Headline(bench.MoeShape("tiny", 256, 128, 8, 2), "silu")
    hidden, index, weights, up, down = headline.inputs(h, tokens=64)
    rng = np.random.default_rng(1)
    data = lambda spec, scale: jnp.asarray(rng.standard_normal(spec.shape) * scale, jnp.bfloat16)
    args = (data(hidden, 1.0), index, jnp.asarray(rng.random(weights.shape), jnp.bfloat16),
            data(up, 256 ** -0.5), data(down, 128 ** -0.5))
    impls = headline.implementations(h, np.asarray(index), "v6e", interpret=True)
    ours = impls.pop("ours")
    want = np.asarray(ours(*args), np.float32)
    scale = np.abs(want).max()
    for name, fn in impls.items():
        # bf16 outputs of the same sums: a few bf16 roundings of the largest value.
        np.testing.assert_allclose(np.asarray(fn(*args), np.float32), want, atol=4 * 2**-8 * scale, err_msg=name)
    # The expert-parallel row models one chip's share: the eight chips' shares sum to the whole.
    local = h.experts // headline.CHIPS
    shares = [headline.expert_parallel_per_chip(h, args, "v6e", shard, interpret=True)[0](
        *args[:3], args[3][shard * local:(shard + 1) * local], args[4][shard * local:(shard + 1) * local])
        for shard in range(headline.CHIPS)]
    total = np.sum([np.asarray(part, np.float32) for part in shares], axis=0)
    np.testing.assert_allclose(total, want, atol=4 * 2**-8 * scale, err_msg="expert-parallel shares")
    # The quantized rows are ours on the same layer with a byte per weight: weights of eighths stored as
    # their multiples of 1/8 (exact in int8 and fp8 at these sizes) with every scale 1/8. MXFP4 and int4:
    # random 4-bit codes, every scale 2^-3, packed two per byte along K and K-major as ops.mxfp4_weights
    # and ops.quantize_int4 hold them.
    fp4_values = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    for impl, (dtype, scaling) in headline.QUANTIZED.items():
        fn, specs = headline.quantized(h, (hidden, index, weights, up, down), "v6e", dtype, scaling, interpret=True)
        if scaling in ("mxfp4", "int4"):  # random codes, packed as ops.mxfp4_weights and ops.quantize_int4 pack them
            codes = [rng.integers(0, 16, w.shape).astype(np.uint8) for w in args[3:]]  # [E, N, K]
            values = fp4_values if scaling == "mxfp4" else np.where(np.arange(16) >= 8, np.arange(16) - 16,
                                                                      np.arange(16)).astype(np.float32)
            eighths = [jnp.asarray(values[c] / 8, jnp.bfloat16) for c in codes]
            packed = [jnp.asarray(np.swapaxes(c[..., 0::2] | (c[..., 1::2] << 4), 1, 2)) for c in codes]
            eighth = 124 if scaling == "mxfp4" else 1 / 8  # 2^-3: an e8m0 exponent, or int4's float32 scale
            got = fn(*args[:3], *packed, *(jnp.full(spec.shape, eighth, spec.dtype) for spec in specs[5:]))
            want_4bit = np.asarray(ours(*args[:3], *eighths), np.float32)
            np.testing.assert_allclose(np.asarray(got, np.float32), want_4bit, atol=4 * 2**-8 * np.abs(want_4bit).max(),
                                       err_msg=impl)
            continue
        stored = [jnp.clip(jnp.round(w.astype(jnp.float32) * 8), -15, 15) for w in args[3:]]
        eighths = [(x / 8).astype(jnp.bfloat16) for x in stored]
        scales = [jnp.full(spec.shape, 1 / 8, jnp.float32) for spec in specs[5:]]
        got = fn(*args[:3], *(x.astype(dtype) for x in stored), *scales)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ours(*args[:3], *eighths), np.float32), atol=4 * 2**-8 * scale, err_msg=impl)
    # tpu-inference's quantized rows: its gmm in the same layer, on weights [E, K, N] of eighths (int4:
    # sevenths and less, -8 .. 7 times 1/8) with every scale 1/8, against ours on the same values.
    for impl, (dtype, scaling) in headline.ANCHOR_QUANTIZED.items():
        anchor = headline.tpu_inference_quantized(h, (hidden, index, weights, up, down), dtype, scaling, interpret=True)
        if anchor is None:
            continue  # tpu-inference not installed
        fn, specs = anchor
        limit = 8 if scaling == "int4" else 15
        stored = [jnp.clip(jnp.round(w.astype(jnp.float32) * 8), -limit, limit - 1) for w in args[3:]]
        eighths = [(x / 8).astype(jnp.bfloat16) for x in stored]
        got = fn(*args[:3], *(jnp.swapaxes(x, 1, 2).astype(dtype) for x in stored),
                 *(jnp.full(spec.shape, 1 / 8, jnp.float32) for spec in specs[5:]))
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ours(*args[:3], *eighths), np.float32),
                                   atol=4 * 2**-8 * scale, err_msg=impl)


def test_each_process_compiles_into_its_own_dump_directory():
    """A child process inherits its parent's environment (pytest-xdist's workers, the controller's):
    sharing one libtpu dump directory, a worker cleared and read the other's files, and a test saw
    the other's `copy` op as its own. A child configured after its parent gets a directory of its own."""
    import os
    import subprocess
    import sys

    parent = tpu_compile.configure_environment()
    code = "import tpu_compile, os; print(tpu_compile.configure_environment()); print(os.environ['LIBTPU_INIT_ARGS'])"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=os.environ | {"PYTHONPATH": os.path.dirname(tpu_compile.__file__)})
    child_dump, child_flags = child.stdout.splitlines()
    assert child_dump != str(parent)
    assert f"--xla_jf_dump_to={child_dump}" in child_flags.split() and str(parent) not in child_flags


def test_walk_counts_a_static_loops_dots_once_per_trip():
    """A fori_loop with static bounds is a scan: its dot runs 5 times a step, and the MXU floor of
    the pipeline model needs all 5. With a bound known only at run time (a while loop) the walk
    cannot count them, and says so."""
    steps = 4
    fn = _looping_kernel(steps)
    specs = [jax.ShapeDtypeStruct((128 * steps, 256), jnp.bfloat16), jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)]
    (cost,) = grid_walk.kernel_costs(fn, specs, mxu_width=256)
    np.testing.assert_array_equal(cost.mxu_flops_per_step, [5 * 2 * 128 * 256 * 256] * steps)
    assert cost.mxu_flops == steps * 5 * 2 * 128 * 256 * 256 and cost.dots_counted

    def dynamic(n_ref, x_ref, w_ref, o_ref):
        o_ref[...] = jnp.zeros_like(o_ref)

        def accumulate(_, carry):
            o_ref[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)
            return carry

        jax.lax.fori_loop(0, n_ref[0], accumulate, 0)

    call = pl.pallas_call(
        dynamic, out_shape=jax.ShapeDtypeStruct((128, 256), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,),
            in_specs=[pl.BlockSpec((128, 256), lambda i, n: (0, 0)), pl.BlockSpec((256, 256), lambda i, n: (0, 0))],
            out_specs=pl.BlockSpec((128, 256), lambda i, n: (0, 0))))
    (cost,) = grid_walk.kernel_costs(call, [jnp.asarray([3], jnp.int32), *(jax.ShapeDtypeStruct((s, 256), jnp.bfloat16)
                                                                          for s in (128, 256))], mxu_width=256)
    assert not cost.dots_counted


def _cost(mxu_flops, dots_counted=True):
    return types.SimpleNamespace(mxu_flops_per_step=np.asarray(mxu_flops, np.float64), dots_counted=dots_counted)


@pytest.mark.parametrize("generation", list(GENERATIONS))
def test_a_step_never_beats_the_mxu_peak(generation):
    """Whatever its bundles, a step lasts at least its MXU work at the core's bf16 peak: a modeled
    time under the chip's peak is a bug."""
    gen = GENERATIONS[generation]
    peak = gen.bf16_flops / gen.cores_per_device
    cycles = np.array([100, 100])
    seconds = pipeline.step_compute_seconds(cycles, _cost([0, 1e12]), generation, matmuls=[0, 0])
    assert seconds[0] == pytest.approx(100 / pipeline.issue_clock_hz(generation))
    assert seconds[1] == pytest.approx(1e12 / peak)
    # A kernel whose dots the walk cannot count keeps the MXU-calibrated clock for every bundle.
    assert pipeline.step_compute_seconds(cycles, _cost([0, 0], False), generation)[0] == pytest.approx(100 / gen.clock_hz)


def test_tpu7x_issues_at_its_issue_clock_and_waits_on_the_mxu():
    """On tpu7x the calibrated clock holds for MXU-paced bundles only: a step's bundles issue at the
    issue clock, and its vmatmuls take the dense calibration matmul's pace per vmatmul."""
    gen = GENERATIONS["tpu7x"]
    assert pipeline.issue_clock_hz("tpu7x") > gen.clock_hz
    assert pipeline.issue_clock_hz("v6e") == GENERATIONS["v6e"].clock_hz
    cycles = np.array([2000, 2000])
    seconds = pipeline.step_compute_seconds(cycles, _cost([0, 0]), "tpu7x", matmuls=[0, 1000])
    assert seconds[0] == pytest.approx(2000 / pipeline.issue_clock_hz("tpu7x"))
    assert seconds[1] == pytest.approx(1000 * pipeline.VMATMUL_PACE_CYCLES["tpu7x"] / gen.clock_hz)


def test_vmatmul_pace_is_the_dense_calibration_matmuls():
    assert calibration.vmatmul_pace_cycles("tpu7x") == pytest.approx(pipeline.VMATMUL_PACE_CYCLES["tpu7x"], rel=0.005)


def test_walk_reads_a_vmapped_kernels_own_program_ids():
    """vmap prepends grid axes a kernel's body never sees: Mosaic lowers its program_id(0) to the
    first axis that is not vmapped, so its pl.when bodies run where that axis says (read off the
    vmapped axis, a splash kernel vmapped over heads counted its masked body on 3/4 of its steps)."""
    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...]

        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = jnp.dot(x_ref[...], x_ref[...], preferred_element_type=jnp.float32)

    call = pl.pallas_call(body, grid=(4,), in_specs=[pl.BlockSpec((128, 128), lambda i: (i, 0))],
                          out_specs=pl.BlockSpec((128, 128), lambda i: (i, 0)),
                          out_shape=jax.ShapeDtypeStruct((512, 128), jnp.float32))
    (cost,) = grid_walk.kernel_costs(jax.vmap(call), [jax.ShapeDtypeStruct((3, 512, 128), jnp.float32)], mxu_width=128)
    assert cost.grid == (3, 4)
    np.testing.assert_array_equal(cost.when_runs[:, 0], np.tile([True, False, False, False], 3))


def test_xla_ragged_dot_runs_a_trip_per_row_tile_and_group_sharing_rows():
    """XLA's own ragged_dot as libtpu compiles it for tpu7x (calibration's 8192 x 4096 x 14336, 8
    groups): its loop is read as a ragged loop, runs one trip per (row tile, group) pair that
    shares rows times the column tiles, and the model then lands within the calibration target of
    the measured time (counted once, it was 0.18x)."""
    case = next(c for c in json.loads(calibration.CASES.read_text()) if c["kind"] == "xla_ragged_dot" and c["m"] == 8192)
    fn, args = calibration.case_program(case)
    report = tpu_compile.compile_for(fn, [(a.shape, a.dtype) for a in args], "tpu7x", "",
                                     {"xla_tpu_scoped_vmem_limit_kib": str(GENERATIONS["tpu7x"].vmem_bytes // 1024)})
    (loop,) = [s.ragged_loop for s in report.schedules.values() if s.ragged_loop]
    m, groups = case["m"], case["groups"]
    row_tiles = -(-m // loop.tile_rows)
    one_group = loop.trips([m] + [0] * (groups - 1))
    empty = loop.trips([0] * groups)
    # All rows in one group: each row tile pairs with it once; no rows: only the pipeline's stages.
    column_tiles = (one_group - empty) // row_tiles
    assert one_group == empty + row_tiles * column_tiles and 0 < empty <= 8
    # A group boundary inside a row tile adds a pair there: two groups split mid-tile.
    split = loop.trips([loop.tile_rows // 2, m - loop.tile_rows // 2] + [0] * (groups - 2))
    assert split == one_group + column_tiles
    ratio = calibration.model_case(case)["modeled_ms"] / case["measured_ms"]
    assert 1 / 1.3 <= ratio <= 1.3


def test_xla_ragged_dot_tiling_the_contraction_is_counted_once():
    """Weights [G, N, K] with a long K (transformers' layout at decode): XLA tiles K inside the
    loop too, and tokamax's measurements show such loops running far fewer trips than their space
    holds (calibration.md: 0.23x counted once, ~40x counted per trip), so no trip count is given."""
    numbers = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                                lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    report = tpu_compile.compile_for(lambda x, w, g: jax.lax.ragged_dot_general(x, w, g, numbers),
                                     [((512, 2048), jnp.bfloat16), ((128, 1536, 2048), jnp.bfloat16),
                                      ((128,), jnp.int32)], "tpu7x", "")
    (loop,) = [s.ragged_loop for s in report.schedules.values() if s.ragged_loop]
    assert loop.trips([4] * 128) is None
