"""bench/harness.py: the one measurement every bench, tuner, headline and calibration row comes from."""

import ast
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

import harness

BENCH = Path(harness.__file__).resolve().parent
# The stages of a measurement: walking kernels, compiling, modeling a program, setting up libtpu.
STAGES = {"compile_for", "kernel_costs", "kernel_costs_and_copies", "pallas_calls", "analyze_call", "program_seconds",
          "configure_environment"}
# Where those stages are defined, and the one file that runs them.
OWNERS = {"harness.py", "grid_walk.py", "pipeline.py"}


def stage_calls(path: Path) -> list[str]:
    return [f"{path.name}:{node.lineno} {node.func.attr}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STAGES]


def test_no_bench_file_runs_a_measurement_stage_but_the_harness():
    """One harness: the benches, tuners, headline and calibration reach the walk, the compile and
    the schedule model only through bench/harness.py (no second copy of the pipeline)."""
    found = [call for path in sorted(BENCH.glob("*.py")) if path.name not in OWNERS for call in stage_calls(path)]
    assert not found, found
    assert stage_calls(BENCH / "harness.py")  # the check reads calls: it sees the harness's own


def _copy_kernel(rows: int, block: int):
    """rows x 128 f32 copied block by block: rows / block grid steps, each reading and writing a block."""
    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    return pl.pallas_call(body, grid=(rows // block,), in_specs=[pl.BlockSpec((block, 128), lambda i: (i, 0))],
                          out_specs=pl.BlockSpec((block, 128), lambda i: (i, 0)),
                          out_shape=jax.ShapeDtypeStruct((rows, 128), jnp.float32), name="harness_copy")


def test_measurement_parts_add_up_and_count_the_walked_grid():
    """A program of one Pallas kernel and one XLA op: the walk's steps and bytes, the compile's VMEM,
    the model's kernel and XLA parts summing to the modeled time; `walked=False` counts the kernel
    as an XLA op."""
    rows, block = 1024, 128
    fn = lambda x: _copy_kernel(rows, block)(x).sum(axis=0)
    args = [jax.ShapeDtypeStruct((rows, 128), jnp.float32)]
    m = harness.measure(fn, args, "v6e", "harness_copy", require_kernels=True)
    f = m.figures()
    assert f["grid_steps"] == rows // block
    assert f["hbm_bytes"] == 2 * rows * 128 * 4  # each block read once, written once
    assert 0 < f["vmem_used"] <= 4 * block * 128 * 4 + (1 << 20)  # two buffers each way, and Mosaic's own
    assert f["modeled_us"] == pytest.approx(f["kernel_us"] + f["around_us"])
    assert f["kernel_us"] > 0 and f["around_us"] > 0  # the sum over rows is XLA's
    assert len(m.kernel_schedules) == 1 and len(m.xla_ops) == len(m.schedules) - 1
    # The model alone, from the same walk and compile, is the measurement.
    assert harness.model(m.costs, m.report, "v6e").modeled_s == m.modeled_s
    unwalked = harness.measure(fn, args, "v6e", "harness_copy", walked=False)
    assert unwalked.costs == [] and unwalked.figures()["kernel_us"] == 0
    assert unwalked.figures()["around_us"] > f["around_us"]
    with pytest.raises(RuntimeError, match="no Pallas kernel"):
        harness.measure(lambda x: x.sum(axis=0), args, "v6e", require_kernels=True)


def test_walk_traces_on_the_target_chip():
    """The walk sees the program the compile compiles: traced with the target chip as jax's
    default device (kernels choose layouts and paths by the chip)."""
    seen = []

    def fn(x):
        seen.append(jax.config.jax_default_device)
        return _copy_kernel(256, 128)(x)

    harness.walk(fn, [jax.ShapeDtypeStruct((256, 128), jnp.float32)], "tpu7x")
    assert seen and seen[-1] is not None and "7" in seen[-1].device_kind


@jax.jit
def _sized_by_the_chip(x):
    """A kernel wrapper that picks its blocks by the chip it runs on (as tpu-inference's do), jitted:
    jax caches its trace by its arguments alone."""
    from jax.experimental.pallas import tpu as pltpu

    rows = 8 if pltpu.get_tpu_info().vmem_capacity_bytes > 100 << 20 else 16
    return pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2), grid=(64 // rows,),
                          in_specs=[pl.BlockSpec((rows, 128), lambda i: (i, 0))],
                          out_specs=pl.BlockSpec((rows, 128), lambda i: (i, 0)),
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), name=f"sized_{rows}")(x)


def test_profiled_measurement_sees_each_chips_blocks():
    """measure_profiled walks, profiles (on this CPU, the chip's answers given) and compiles the
    same program for each generation: v6e's 128 MiB of VMEM picks 8-row blocks, tpu7x's 64 MiB 16,
    a profile after another chip's included (jax's trace cache would hand it the other's)."""
    x = jnp.zeros((64, 128), jnp.float32)
    for generation, steps in (("v6e", 8), ("tpu7x", 4)):
        m, own, calls = harness.measure_profiled(_sized_by_the_chip, [jax.ShapeDtypeStruct(x.shape, x.dtype)], [x],
                                                 generation, "sized")
        assert [c.grid_steps for c in m.costs] == [steps] and own == [0] and m.modeled_s > 0


def test_error_row_keeps_the_first_line():
    row = harness.error_row(ValueError("VMEM exceeded\nmore detail"))
    assert row == {"error": "VMEM exceeded"}


def test_results_keep_every_row_not_redone_and_write_each_put_through(tmp_path):
    """One store for every bench's and tuner's results: a committed row survives a run that redoes
    others, or stops midway (each put is on disk before the next row is measured); a merged file's
    rows win; the file is written in the store's order."""
    path = tmp_path / "results.json"
    committed = [dict(model="a", gen="v6e", us=1.0), dict(model="b", gen="v6e", us=2.0)]
    path.write_text(json.dumps(committed))
    key = lambda r: (r["model"], r["gen"])
    results = harness.Results(path, key, order=lambda r: (r["gen"], r["model"]))
    assert ("a", "v6e") in results and results.get(("b", "v6e"))["us"] == 2.0
    results.put(dict(model="b", gen="v6e", us=3.0))
    assert json.loads(path.read_text()) == [committed[0], dict(model="b", gen="v6e", us=3.0)]
    with pytest.raises(ZeroDivisionError):  # a run that stops after one more row
        for model in ("c", "d"):
            results.put(dict(model=model, gen="tpu7x", us=1 / (model == "c")))
    again = harness.Results(path, key)
    assert [key(r) for r in again.rows] == [("c", "tpu7x"), ("a", "v6e"), ("b", "v6e")]
    other = tmp_path / "other.json"
    other.write_text(json.dumps([dict(model="a", gen="v6e", us=9.0)]))
    again.merge(other)
    assert again.get(("a", "v6e"))["us"] == 9.0 and len(again.rows) == 3
    assert not list(tmp_path.glob("*.tmp"))  # written whole, through a temporary file
