"""The forward kernel's ring of weight blocks (`BlockSizes.weight_buffers` > 2): the kernel copies
the weights itself, several copies in flight, and must give exactly what Pallas's two-slot pipeline
gives; the bench's walk and pipeline model count its copies."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter

import grid_walk
import harness
import pipeline
from errors import max_abs, max_error
from ragged_dot import kernel, ops, reference
from ragged_dot.kernel import BlockSizes
from runtime.generations import DMA_LATENCY_S, GENERATIONS, pipeline_seconds

# Groups spanning several 16-row tiles (consecutive visits of one group share its copy), empty groups
# between and at the end, rows past the groups; 2 K steps and 3 N tiles of 128.
M, K, N = 100, 256, 384
SIZES = (0, 30, 0, 45, 1, 0, 20, 0)
BLOCKS = BlockSizes(16, 128, 128)


def _inputs(dtype, transpose_rhs, seed=0, k=K, n=N, groups=len(SIZES)):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((M, k)), dtype)
    # distinct weights per group, K and N (a copy from the wrong group, block or tile shows)
    rhs = jnp.asarray(rng.standard_normal((groups, n, k) if transpose_rhs else (groups, k, n)), dtype)
    return lhs, rhs, jnp.asarray(SIZES, jnp.int32)


@pytest.mark.parametrize("depth", [3, 4])
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["KN", "NK"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_ring_gives_the_two_slot_pipelines_result_exactly(dtype, transpose_rhs, depth):
    """Same blocks, same products in the same order: the ring changes only where the weights wait."""
    lhs, rhs, sizes = _inputs(dtype, transpose_rhs)
    run = lambda buffers: ops.ragged_dot(lhs, rhs, sizes, transpose_rhs=transpose_rhs,
                                         blocks=dataclasses.replace(BLOCKS, weight_buffers=buffers))
    got = run(depth)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(run(2).astype(jnp.float32)))
    want = reference.ragged_dot(lhs, rhs, sizes, transpose_rhs=transpose_rhs, out_dtype=jnp.float32)
    # fp32: reassociation over K (1e-5 of the largest output); bf16: the output's rounding (2^-8)
    assert max_error(got.astype(jnp.float32), want) <= (1e-5 if dtype == jnp.float32 else 2 ** -8) * max_abs(want)


@pytest.mark.parametrize("weights", ["int8_per_channel", "fp8_per_block", "int4"])
def test_quantized_weights_through_the_ring(weights):
    """Quantized weights go through the ring as stored (a byte, or half a byte, per weight), their
    scales beside them in Pallas's pipeline: the two-slot result exactly."""
    rng = np.random.default_rng(3)
    k, n = 2048, 256
    lhs = jnp.asarray(rng.standard_normal((M, k)), jnp.bfloat16)
    sizes = jnp.asarray(SIZES, jnp.int32)
    groups = len(SIZES)
    if weights == "int4":
        rhs, scale = ops.quantize_int4(jnp.asarray(rng.standard_normal((groups, k, n)), jnp.float32))
        blocks, transpose_rhs = BlockSizes(16, 1024, 128), False  # 2 K steps of 512 bytes
    else:
        dtype = jnp.int8 if weights.startswith("int8") else jnp.float8_e4m3fn
        rhs = jnp.asarray(rng.integers(-100, 100, (groups, n, k)) if dtype == jnp.int8
                          else rng.standard_normal((groups, n, k)), dtype)
        scale_shape = (groups, n) if weights.endswith("channel") else (groups, n // 128, k // 128)
        scale = jnp.asarray(rng.uniform(0.01, 0.02, scale_shape), jnp.float32)
        blocks, transpose_rhs = BlockSizes(16, 1024, 128), True
    run = lambda buffers: ops.ragged_dot(lhs, rhs, sizes, rhs_scale=scale, transpose_rhs=transpose_rhs,
                                         blocks=dataclasses.replace(blocks, weight_buffers=buffers))
    np.testing.assert_array_equal(np.asarray(run(3).astype(jnp.float32)), np.asarray(run(2).astype(jnp.float32)))


@pytest.mark.parametrize("sizes", [(1, 60, 0, 70), (0, 0, 0, 0)], ids=["ragged", "empty"])
def test_ring_passes_the_tpu_interpreter(sizes):
    """No race between a slot's copy and the product reading it, no copy out of the weights, no
    unwritten slot read (memory starts NaN): 2 N tiles (each restarts the ring) of 2 K steps."""
    rng = np.random.default_rng(4)
    m, k, n = 131, 1024, 1024
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((4, n, k)), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    blocks = BlockSizes(64, 512, 512, weight_buffers=3)
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    out = ops.ragged_dot(lhs, rhs, gs, transpose_rhs=True, interpret=params, blocks=blocks)
    assert tpu_interpreter.races.races_found is False
    out = np.asarray(out.astype(jnp.float32))
    assert not np.isnan(out).any(), "the kernel read a slot no copy filled"
    want = np.asarray(reference.ragged_dot(lhs, rhs, gs, transpose_rhs=True, out_dtype=jnp.float32))
    np.testing.assert_allclose(out, want, rtol=0, atol=2 ** -8 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("blocks,match", [
    (BlockSizes(16, 128, 128, weight_buffers=1), "weight_buffers is 1"),
    (BlockSizes(16, 128, 256, weight_buffers=3), "weight_buffers is 3 for weights \\(8, 256, 384\\)"),  # 256 ∤ 384
])
def test_a_ring_that_cannot_be_is_named(blocks, match):
    lhs, rhs, sizes = _inputs(jnp.float32, False)
    with pytest.raises(ValueError, match=match):
        ops.ragged_dot(lhs, rhs, sizes, blocks=blocks)


def test_walk_counts_the_rings_copies():
    """The ring copies the blocks Pallas's two-slot pipeline would (a new one wherever a step's group
    or K block differs from the step before), each a whole slot, each waited for once; the
    prologue's copies start before the first wait, the others after their step's wait."""
    lhs, rhs, sizes = _inputs(jnp.bfloat16, True)
    fn = lambda depth: lambda x, w, g: ops.ragged_dot(x, w, g, transpose_rhs=True, interpret=False, generation="v6e",
                                                      blocks=dataclasses.replace(BLOCKS, weight_buffers=depth))
    (cost,), _ = harness.walk(fn(3), (lhs, rhs, sizes), "v6e")
    (two_slot,), _ = harness.walk(fn(2), (lhs, rhs, sizes), "v6e")
    assert two_slot.copy_step is None
    slot = 128 * 128 * 2
    [pipelined] = [v for key, v in two_slot.bytes_by_operand.items() if "[8,384,256]" in key]
    copies = pipelined // slot
    assert copies >= 3 * sum(s > 0 for s in SIZES) * 2  # N tiles x groups with rows x K blocks, at least
    assert len(cost.copy_step) == copies and cost.copy_waits.sum() == copies and set(cost.copy_bytes) == {slot}
    assert list(cost.copy_after_wait[:3]) == [False, False, True]  # two started ahead, then one per wait
    assert cost.bytes_by_operand["own copies"] == pipelined


def test_copying_pipeline_without_copies_is_the_pipeline_sum():
    rng = np.random.default_rng(0)
    steps = 40
    compute = rng.uniform(0, 3e-6, steps)
    fetch = rng.integers(0, 4 << 20, steps) * (rng.uniform(size=steps) > 0.3)
    write = rng.integers(0, 1 << 20, steps) * (rng.uniform(size=steps) > 0.5)
    none = np.zeros(0, np.int64)
    got = pipeline.copying_pipeline_seconds(compute, fetch, write, none, none, none.astype(bool),
                                            np.zeros(steps, np.int64), 1.6e12, DMA_LATENCY_S)
    assert got == pytest.approx(pipeline_seconds(compute, fetch, write, 1.6e12, DMA_LATENCY_S), rel=1e-12)


@pytest.mark.parametrize("depth", [2, 3, 4])
@pytest.mark.parametrize("block_bytes", [6 << 20, 256 << 10], ids=["latency_hidden", "latency_bound"])
def test_a_ring_of_d_slots_overlaps_d_minus_one_latencies(depth, block_bytes):
    """A ring started depth - 1 copies ahead, each step copying b bytes and computing c: a step lasts
    max(c, b / bandwidth, (latency + b / bandwidth) / (depth - 1)); two slots are Pallas's pipeline."""
    steps, bandwidth, c = 400, 1.6e12, 0.1e-6
    copy_step = np.r_[np.zeros(depth - 1, np.int64), np.arange(steps - depth + 1)]
    after_wait = np.r_[np.zeros(depth - 1, bool), np.ones(steps - depth + 1, bool)]
    total = pipeline.copying_pipeline_seconds(np.full(steps, c), np.zeros(steps), np.zeros(steps), copy_step,
                                              np.full(steps, block_bytes), after_wait, np.ones(steps, np.int64),
                                              bandwidth, DMA_LATENCY_S)
    b = block_bytes / bandwidth
    assert total / steps == pytest.approx(max(c, b, (DMA_LATENCY_S + b) / (depth - 1)), rel=0.02)


def test_a_decode_step_compiled_with_a_ring_waits_less():
    """v6e, a decode step's gate_up as Qwen3-30B-A3B's at 16 tokens, scaled down (16 experts, an
    expert a step): the ring compiles, its regions line up with the walk, and the model puts it at
    its copies' time plus what no copy can hide (the last step's product; the latencies of the first
    blocks and of the last output; the kernel's entry and exit), where the two-slot pipeline pays a
    latency per expert."""
    groups, k, n = 16, 2048, 1536
    sizes = np.bincount(np.random.default_rng(0).integers(0, groups, 128), minlength=groups).astype(np.int32)
    args = (jax.ShapeDtypeStruct((128, k), jnp.bfloat16), jax.ShapeDtypeStruct((groups, n, k), jnp.bfloat16),
            jnp.asarray(sizes))
    parts = {}
    for depth in (2, 3):
        blocks = BlockSizes(128, k, n, weight_buffers=depth)
        fn = lambda x, w, g: ops.ragged_dot(x, w, g, transpose_rhs=True, generation="v6e", interpret=False,
                                            blocks=blocks)
        parts[depth] = harness.measure(fn, args, "v6e", "ragged_dot_tpu").parts
        assert parts[depth]["regions_mapped"]
    active = int((sizes > 0).sum())
    ring, latency = parts[3], pipeline.copy_latency_s("v6e")(k * n * 2)  # a weight block's
    unhidden = ring["compute"] / active + 3 * latency + ring["fill_drain"]
    assert ring["kernels"] <= 1.01 * (ring["dma"] + unhidden)
    assert parts[2]["kernels"] >= ring["kernels"] + 0.8 * active * latency


def test_a_copys_latency_grows_with_its_bytes_to_the_measured_one():
    """tpu7x: the fitted latency at the measured ring's 2 MiB copies and beyond, a share of it for
    smaller copies, never below Pallas's cost per step; the other generations keep that cost. A
    latency given as a function of the bytes is what the pipeline sums charge per copy."""
    latency = pipeline.copy_latency_s("tpu7x")
    measured, at = pipeline.COPY_LATENCY_S["tpu7x"]
    assert latency(at) == pytest.approx(measured) and latency(8 * at) == pytest.approx(measured)
    assert latency(at // 2) == pytest.approx(measured / 2) and latency(32 << 10) == pytest.approx(DMA_LATENCY_S)
    assert pipeline.copy_latency_s("v6e")(8 * at) == pytest.approx(DMA_LATENCY_S)
    compute, fetch, write = np.zeros(3), np.array([at, at // 2, 0]), np.zeros(3)
    assert pipeline_seconds(compute, fetch, write, 1e12, latency) == pytest.approx(
        at / 1e12 + measured + at / 2 / 1e12 + measured / 2)
    none = np.zeros(0, np.int64)
    assert pipeline.copying_pipeline_seconds(compute, fetch, write, none, none, none.astype(bool),
                                             np.zeros(3, np.int64), 1e12, latency) == pytest.approx(
        at / 1e12 + measured + at / 2 / 1e12 + measured / 2)
    # Blocks fetched together (the second step's: three eighths and one eighth of `at`) wait out the
    # latency of the largest, not of their sum.
    largest = (np.array([at, at * 3 // 8, 0]), np.zeros(3))
    for sum_of in (lambda: pipeline_seconds(compute, fetch, write, 1e12, latency, largest=largest),
                   lambda: pipeline.copying_pipeline_seconds(compute, fetch, write, none, none, none.astype(bool),
                                                             np.zeros(3, np.int64), 1e12, latency, largest)):
        assert sum_of() == pytest.approx(at / 1e12 + measured + at / 2 / 1e12 + measured * 3 / 8)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["KN", "NK"])
def test_a_ring_over_a_whole_unaligned_dim_compiles(transpose_rhs):
    """gpt-oss-20b's K of 2880 (not a multiple of 128) in one block, through a ring, the kernel
    given either layout (`ragged_dot` views weights as libtpu holds them, which keeps an unaligned
    dim off the lanes; the kernel itself may be handed any): where K is the weights' minor dim its
    copies must start at a static 0 (Mosaic takes no other offset into an unaligned lane dim).
    libtpu compiles it for v6e."""
    import tpu_compile

    k, n = 2880, 5760
    weights = ((32, n, k) if transpose_rhs else (32, k, n), jnp.bfloat16)
    blocks = BlockSizes(32, k, 1920, weight_buffers=4)
    fn = lambda x, w, g: ops._forward(x, w, g, transpose_rhs, "v6e", False, blocks=blocks)
    report = tpu_compile.compile_for(fn, [((64, k), jnp.bfloat16), weights, ((32,), jnp.int32)], "v6e",
                                     "ragged_dot_tpu")
    assert len(report.kernels) == 1
