"""bench/kernel_profile.py: per grid step, how often a kernel's loops, branches and DMAs run,
read by running it in Pallas's interpreter."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

import harness
import kernel_profile


def _kernel(trips_ref, x_hbm, o_ref, buf, sem):
    i = pl.program_id(0)

    def body(j, acc):
        return acc + j

    total = jax.lax.fori_loop(0, trips_ref[i], body, 0)  # a loop whose trips are data

    @pl.when(i == 1)
    def _():
        copy = pltpu.make_async_copy(x_hbm.at[pl.ds(0, 8)], buf, sem)
        copy.start()
        copy.wait()

    o_ref[...] = jnp.full(o_ref.shape, total, o_ref.dtype)


def _call(trips, x):
    return pl.pallas_call(
        _kernel,
        out_shape=jax.ShapeDtypeStruct((3 * 8, 128), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(3,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((8, 128), lambda i, *_: (i, 0)),
            scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())]),
        name="profiled",
    )(trips, x)


def test_counts_each_loop_trip_branch_and_dma_per_grid_step():
    trips = jnp.array([2, 0, 5], jnp.int32)
    (p,) = kernel_profile.profile(_call, trips, jnp.zeros((64, 128), jnp.float32))
    assert p.name == "profiled" and p.grid == (3,)
    kinds = [(n.kind, n.parent, n.branch) for n in p.nodes]
    loop, when = kinds.index(("loop", -1, 0)), kinds.index(("branch", -1, 1))  # pl.when's body: branch 1
    dma = kinds.index(("dma", when, 0))
    assert p.counts[:, loop].tolist() == [2, 0, 5]
    assert p.counts[:, when].tolist() == [0, 1, 0]
    assert p.nodes[dma].reads_hbm and p.moved[:, dma].tolist() == [0, 8 * 128 * 4, 0]
    assert p.dma_bytes().tolist() == [0, 8 * 128 * 4, 0]
    wait = kinds.index(("wait", when, 0))
    assert p.waited_bytes().tolist() == p.moved[:, wait].tolist() == [0, 8 * 128 * 4, 0]


def _dynamic_copy_kernel(n_ref, x_hbm, o_ref, buf, sem):
    n = n_ref[pl.program_id(0)]
    copy = pltpu.make_async_copy(x_hbm.at[pl.ds(0, n)], buf.at[pl.ds(0, n)], sem)  # n rows: a value
    copy.start()
    copy.wait()
    o_ref[...] = buf.reshape(4, 2, 128)[...].reshape(8, 128)  # a ref reshape: the interpreter has none


def _dynamic_copy(rows, x, interpret=False):
    return pl.pallas_call(
        _dynamic_copy_kernel,
        out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(2,), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((8, 128), lambda i, *_: (i, 0)),
            scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())]),
        interpret=pltpu.InterpretParams() if interpret else False, name="dynamic_copy")(rows, x)


def test_runs_only_the_control_and_counts_copies_of_any_size():
    """The profile runs the kernel's control alone: the vector work (here a ref reshape, which
    Pallas's interpreter cannot run) is cut out; a copy whose rows are a value reports its bytes
    as it runs."""
    rows, x = jnp.array([3, 5], jnp.int32), jnp.zeros((8, 128), jnp.float32)
    with pytest.raises(Exception):
        jax.block_until_ready(_dynamic_copy(rows, x, interpret=True))
    (p,) = kernel_profile.profile(_dynamic_copy, rows, x)
    assert p.dma_bytes().tolist() == [3 * 128 * 4, 5 * 128 * 4]


def test_rows_under_128_lanes_move_whole_tiles():
    """A row of 64 lanes fills a 128-lane tile in memory (head_dim 64's cache): its copy moves
    the tile."""
    def kernel(n_ref, x_hbm, o_ref, buf, sem):
        n = n_ref[pl.program_id(0)]
        copy = pltpu.make_async_copy(x_hbm.at[pl.ds(0, n)], buf.at[pl.ds(0, n)], sem)
        copy.start()
        copy.wait()
        o_ref[...] = buf[...]

    rows, x = jnp.array([3, 5], jnp.int32), jnp.zeros((8, 64), jnp.float32)
    narrow = lambda rows, x: pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((16, 64), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(2,), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((8, 64), lambda i, *_: (i, 0)),
            scratch_shapes=[pltpu.VMEM((8, 64), jnp.float32), pltpu.SemaphoreType.DMA(())]),
        name="narrow_copy")(rows, x)
    (p,) = kernel_profile.profile(narrow, rows, x)
    assert p.dma_bytes().tolist() == [3 * 128 * 4, 5 * 128 * 4]


def _vmem_control_kernel(x_ref, o_ref):
    trips = x_ref[0, 0].astype(jnp.int32)  # a loop bound read from VMEM, which the profile does not keep
    o_ref[...] = jnp.full(o_ref.shape, jax.lax.fori_loop(0, trips, lambda i, a: a + 1.0, 0.0), o_ref.dtype)


def test_control_read_from_vector_memory_is_refused():
    call = lambda x: pl.pallas_call(_vmem_control_kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))(x)
    with pytest.raises(NotImplementedError, match="not SMEM"):
        kernel_profile.profile(call, jnp.ones((8, 128), jnp.float32))


def test_jax_paged_attention_loops_over_each_sequences_blocks():
    """A real kernel: jax's paged_attention (its default, a loop per grid step over the sequence's
    blocks of pages) loops cdiv(length, block) times at each (sequence, KV head) step."""
    batch, pages_per_block, page_size = 4, 4, 16
    lengths = np.array([100, 37, 250, 16], np.int32)
    page_indices = np.random.default_rng(0).permutation(64).reshape(batch, 16).astype(np.int32)
    cache = jnp.ones((2, 64, page_size, 128), jnp.bfloat16)
    attend = functools.partial(paged_attention, pages_per_compute_block=pages_per_block)
    (p,) = kernel_profile.profile(attend, jnp.ones((batch, 8, 128), jnp.bfloat16), cache, cache, lengths, page_indices)
    assert p.grid == (1, batch, 2)
    outer = [i for i, n in enumerate(p.nodes) if n.kind == "loop" and n.parent == -1]
    assert len(outer) == 1
    blocks = -(-lengths // (pages_per_block * page_size))
    assert p.counts[:, outer[0]].tolist() == np.repeat(blocks, 2).tolist()
    # Each block's K and V pages are copied once, by the step before the one that needs them (the
    # TPU interpreter keeps the kernel's SMEM flags from step to step, as a TPU does).
    block_bytes = 2 * pages_per_block * page_size * 128 * 2  # K and V
    assert p.dma_bytes().sum() == 2 * blocks.sum() * block_bytes


def test_profile_runs_map_onto_the_compiled_schedule():
    """The profile's loop matched to the compiled kernel's (libtpu, v6e): the pl.when around the
    DMA is predicated (no branch of its own, so it is passed over), the guard around the loop
    dropped; a step's cycles are the iteration's own plus the loop body's per trip."""
    import tpu_compile

    trips = jnp.array([2, 0, 5], jnp.int32)
    (p,) = kernel_profile.profile(_call, trips, jnp.zeros((64, 128), jnp.float32))
    (compiled,) = tpu_compile.compile_for(_call, [((3,), jnp.int32), ((64, 128), jnp.float32)], "v6e",
                                          "profiled").kernels.values()
    schedule = compiled.schedule
    assert [c.kind for c in schedule.controls] == ["loop"]
    runs = p.control_runs(schedule)
    assert runs.tolist() == [[2], [0], [5]]
    body = schedule.controls[0].own_cycles
    assert body > 0
    cycles, whole_program = p.step_cycles(schedule)
    assert cycles.tolist() == [schedule.uncontrolled_cycles + t * body for t in (2, 0, 5)] and not whole_program


def _input_bound_kernel(trips_ref, o_ref):
    trips = trips_ref[0, 0]  # a loop bound read from an input block in VMEM, of a kind nothing writes
    o_ref[...] = jnp.full(o_ref.shape, jax.lax.fori_loop(0, trips, lambda i, a: a + 1.0, 0.0), o_ref.dtype)


def test_control_read_from_an_input_block_is_kept():
    """tpu-inference's gated delta rule reads its block count from an input block in VMEM: the
    pipeline copies that block in, outside the slice, and nothing in the kernel writes a ref of its
    kind, so the read is kept and the loop counted per step."""
    call = lambda trips: pl.pallas_call(
        _input_bound_kernel, grid=(2,), in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32), name="input_bound")(trips)
    trips = jnp.concatenate([jnp.full((8, 128), 3, jnp.int32), jnp.full((8, 128), 6, jnp.int32)])
    (p,) = kernel_profile.profile(call, trips)
    (loop,) = [i for i, n in enumerate(p.nodes) if n.kind == "loop"]
    assert p.counts[:, loop].tolist() == [3, 6]


def _static_loops_kernel(x_ref, o_ref, buf, sem, *, unroll):
    def body(j, acc):  # a loop of static bounds, its body a copy (a node of its own) and a sum
        copy = pltpu.make_async_copy(x_ref.at[pl.ds(j * 8, 8)], buf, sem)
        copy.start()
        copy.wait()
        return acc + buf[...]

    o_ref[...] = jax.lax.fori_loop(0, 4, body, jnp.zeros(o_ref.shape, o_ref.dtype), unroll=unroll)

    def scoped(scoped_buf, scoped_sem):  # a run_scoped region's copy is seen too
        copy = pltpu.make_async_copy(x_ref.at[pl.ds(0, 8)], scoped_buf, scoped_sem)
        copy.start()
        copy.wait()
        o_ref[...] += scoped_buf[...]

    pl.run_scoped(scoped, pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(()))


def _static_loops(x, unroll):
    return pl.pallas_call(
        functools.partial(_static_loops_kernel, unroll=unroll), out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())], name="static_loops")(x)


@pytest.mark.parametrize("unroll, trips", [(1, 4), (2, 2), (True, None)])
def test_static_loops_count_their_compiled_trips(unroll, trips):
    """A fori_loop of static bounds Mosaic compiles as a loop unless unrolled whole: a loop node
    counting its compiled trips (4 iterations unrolled by 2: 2 trips), matched to the compiled
    kernel's loop (libtpu, v6e); unrolled whole, no loop. A copy inside pl.run_scoped is counted."""
    import tpu_compile

    x = jnp.zeros((32, 128), jnp.float32)
    (p,) = kernel_profile.profile(lambda x: _static_loops(x, unroll), x)
    loops = [i for i, n in enumerate(p.nodes) if n.kind == "loop"]
    assert p.counts[:, loops].tolist() == ([[trips]] if trips else [[]])
    assert p.dma_bytes().tolist() == [(4 + 1) * 8 * 128 * 4]  # the loop's four copies, the scoped one
    (compiled,) = tpu_compile.compile_for(lambda x: _static_loops(x, unroll), [((32, 128), jnp.float32)], "v6e",
                                          "static_loops").kernels.values()
    cycles, _ = p.step_cycles(compiled.schedule)
    assert cycles.shape == (1,) and cycles[0] > 0


def test_the_walk_leaves_a_copy_of_a_run_time_size_to_the_profile():
    """The grid walk cannot size a copy whose rows are a value (tpu-inference's kernel copies so
    under a sliding window): it counts none of the kernel's own copies, which the profile counts
    as they run (above)."""
    rows, x = jnp.array([3, 5], jnp.int32), jnp.zeros((8, 128), jnp.float32)
    (cost,), _ = harness.walk(_dynamic_copy, [rows, x], "v6e")
    assert cost.copy_step is None
