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

import bench  # sets up sys.path and the CPU / libtpu environment

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

import tpu_compile  # noqa: E402
from runtime.generations import GENERATIONS  # noqa: E402

import importlib  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import grid_walk  # noqa: E402
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


def accumulate_cycles(generation: str, block_m: int) -> int:
    """Issue cycles of a dense step that neither zeroes nor stores."""
    report = tpu_compile.compile_for(dense_matmul(block_m), [((DENSE_SIZE, DENSE_SIZE), jnp.bfloat16)] * 2,
                                     generation, "dense_calibration")
    (kernel,) = report.kernels.values()
    zero, store = kernel.schedule.regions
    return kernel.schedule.iteration_cycles - zero.cycles - store.cycles


def derived_clock_hz(generation: str) -> float:
    gen = GENERATIONS[generation]
    extra_cycles = accumulate_cycles(generation, 1024) - accumulate_cycles(generation, 512)
    extra_flops = 2 * 512 * DENSE_BLOCK * DENSE_BLOCK
    return gen.bf16_flops / gen.cores_per_device / extra_flops * extra_cycles


def case_program(case: dict):
    """(fn, abstract and concrete arguments) of one measured case: megablox's
    gmm (tokamax's Pallas kernel is its fork: same body and grid) at the
    recorded tiles, or the guide's dense matmul."""
    m, k, n = case["m"], case["k"], case["n"]
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    if case["kind"] == "dense":
        return dense_matmul(*case["tiling"], size=m), (bf16(m, k), bf16(k, n))
    if isinstance(case["group_sizes"], list):
        sizes = np.asarray(case["group_sizes"], np.int32)
    else:  # tokamax draws each row's group uniformly at random
        sizes = np.bincount(np.random.default_rng(0).choice(case["groups"], m), minlength=case["groups"]).astype(np.int32)
    if case["kind"] == "xla_ragged_dot":
        fn = lambda x, w, g: jax.lax.ragged_dot(x, w, g)
    else:
        megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
        tiling = tuple(case["tiling"])
        fn = lambda x, w, g: megablox.gmm(x, w, g, jnp.bfloat16, tiling=tiling)
    return fn, (bf16(m, k), bf16(case["groups"], k, n), jnp.asarray(sizes))


def model_case(case: dict) -> dict:
    fn, args = case_program(case)
    generation = case["generation"]
    costs = grid_walk.kernel_costs(fn, args, GENERATIONS[generation].mxu_width)
    if case["kind"] == "gmm":
        costs = [bench.as_tokamax(c) for c in costs]
    # The measurements' kernels set no VMEM limit; their runs raised Mosaic's
    # default (their tiles do not fit it): give them the chip's VMEM.
    vmem_kib = GENERATIONS[generation].vmem_bytes // 1024
    report = tpu_compile.compile_for(fn, [(a.shape, a.dtype) for a in args], generation, "",
                                     {"xla_tpu_scoped_vmem_limit_kib": str(vmem_kib)})
    schedules = report.schedules
    parts = pipeline.program_seconds(costs, schedules, generation)
    return dict(case, modeled_ms=parts["modeled"] * 1e3, ratio=parts["modeled"] * 1e3 / case["measured_ms"],
                compute_ms=parts["compute"] * 1e3, dma_ms=parts["dma"] * 1e3, xla_ops_ms=parts["around"] * 1e3,
                grid_steps=sum(c.grid_steps for c in costs), regions_mapped=parts["regions_mapped"])


def write_calibration(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(rows, indent=1))
    def summary(label, group):
        ratios = np.array([r["ratio"] for r in group])
        within = sum(1 / TARGET <= x <= TARGET for x in ratios)
        return (f"- {label}: **{within} of {len(group)} within {TARGET}x**; ratio geometric mean "
                f"{np.exp(np.log(ratios).mean()):.2f}, range {ratios.min():.2f} to {ratios.max():.2f}.")

    pallas = [r for r in rows if r["kind"] != "xla_ragged_dot"]
    xla = [r for r in rows if r["kind"] == "xla_ragged_dot"]
    lines = [
        "# Calibration: the schedule model against public TPU measurements",
        "",
        "Each row is a published measurement, reproduced with the model (bench/pipeline.py) at the same",
        "shapes, tiles and generation. The model's figure is MODELED on a CPU machine; the measured one is",
        "the source's. `ratio` = modeled / measured. The grouped matmuls were measured on tokamax's Pallas",
        "kernel, a fork of megablox's gmm with the same kernel body and grid, which is what we model; it runs",
        "its grid in an in-kernel pipeline under a grid-less pallas_call, so a v5p megacore runs it on one core.",
        "",
        summary("Pallas kernels (what the model is for)", pallas),
    ] + ([summary("XLA's own ragged_dot (ops around kernels are modeled the same way)", xla)] if xla else []) + [
        "",
        "| kernel | gen | M x K x N | groups | tiles | measured ms | modeled ms | ratio | kernel compute ms "
        "| kernel DMA ms | XLA ops ms | grid steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kind']} | {r['generation']} | {r['m']} x {r['k']} x {r['n']} | {r.get('groups', '-')} "
            f"| {'x'.join(map(str, r['tiling'])) or 'XLA'} | {r['measured_ms']:.3f} | {r['modeled_ms']:.3f} | {r['ratio']:.2f} "
            f"| {r['compute_ms']:.3f} | {r['dma_ms']:.3f} | {r['xla_ops_ms']:.3f} | {r['grid_steps']} |")
    lines += ["", "Sources:", ""] + [f"- {s}" for s in dict.fromkeys(r["source"] for r in rows)]
    lines += ["", WHY_OFF]
    (out / "calibration.md").write_text("\n".join(lines) + "\n")


WHY_OFF = """\
Where the model is off, and why (what it cannot see):
- Pallas kernels: it issues one bundle per cycle at the calibrated clock, so MXU-bound steps run at the
  published peak and stalls the static schedule does not show are missing; DMAs run at the published HBM
  bandwidth plus a fixed latency per step, so a bandwidth-bound kernel gets 100% of it (a streamed copy
  measured 3.21 TB/s on one tpu7x core, 87% of the 3.69 TB/s in our table: vllm-project/tpu-inference
  issue 3520). v5e and v5p come out 10-20% fast, tpu7x up to 27% slow. The guide's dense times include
  dispatch from Python (timeit).
- XLA's own ops: a loop whose count is known only at run time (XLA's ragged_dot loops over groups) is
  counted once, and a DMA whose size is in a register falls back to the op's HBM operands once each. So
  XLA ops with such loops are modeled far too fast (0.2-0.3x here): treat their figures as lower bounds.
  In our bench they are the small routing ops around the kernels; headline.md marks where they matter."""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["clock", "measured"])
    parser.add_argument("--generations", nargs="*", default=list(GENERATIONS), choices=list(GENERATIONS))
    parser.add_argument("--out", type=Path, default=bench.BENCH / "results")
    args = parser.parse_args(argv)
    if args.what == "clock":
        for generation in args.generations:
            clock = derived_clock_hz(generation)
            print(f"{generation}: {clock / 1e9:.3f} GHz derived, table has {GENERATIONS[generation].clock_hz / 1e9:.3f}")
        return 0
    rows = []
    for case in json.loads(CASES.read_text()):
        if case["generation"] in args.generations:
            rows.append(model_case(case))
            print(f"{case['kind']} {case['generation']} {case['m']}x{case['k']}x{case['n']}: modeled "
                  f"{rows[-1]['modeled_ms']:.3f} ms, measured {case['measured_ms']:.3f} ms", flush=True)
    write_calibration(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
