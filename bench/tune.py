"""Fills ragged_dot's tuning tables (`make tune`), MODELED on this CPU machine.

For each model's experts (bench.MOE_SHAPES), token bucket and TPU
generation, it traces transformers' experts forward (and, for prefill, its
gradient) to find every grouped matmul the kernels look blocks up for, then
for each one:

1. takes the block choices the rule's model (`tuning.modeled_seconds`)
   rates best, allowing buffers up to what the chip's VMEM holds
   (`max_buffers`), not only Mosaic's default scoped limit the rule keeps
   to, plus the rule's own choice;
2. rates each with the bench's schedule model (bench/pipeline.py): the
   grid walk on the real routing, and the compiled kernel's schedule. A
   kernel's schedule does not depend on its row count (checked: the same
   cycles at 4k to 64k rows), so each tiling is compiled once per
   generation and kept in bench/results/schedules_<generation>.json;
3. compiles the fastest with libtpu at the entry's own shapes; a choice
   that does not compile or exceeds its VMEM limit is dropped for the next.

Before that (`--fit`, or when a generation has no fit yet) it fits the
rule's step cycles (`tuning.StepCycles`) to the compiled schedules of a
fixed sample of tilings (`fit_sample`), per generation, kernel, dtype and
weight layout,
into bench/results/step_cycles_<generation>.json.

Evidence goes to bench/results/tuning_<generation>.json; the table and the
fitted step cycles to ragged_dot/tuned_blocks.py (generated from those
files; do not edit it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

import harness  # sets up sys.path and the CPU / libtpu environment
import bench  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pipeline  # noqa: E402
import tpu_schedule  # noqa: E402
from ragged_dot import kernel, ops, tuning  # noqa: E402
from runtime.generations import GENERATIONS  # noqa: E402

DECODE_TOKENS = [1, 2, 4, 8, 16, 32, 64]  # the buckets 1..64 sequences reach
PREFILL_TOKENS = [2048, 4096, 8192, 16384]
CANDIDATES = 3  # how many of the rule model's best each entry rates with the bench
# Forward: each candidate is rated again with its weights through a ring of 4 slots (3 copies in
# flight). The model rates 3 and 4 alike wherever a block takes longer to copy than a latency, but
# measured rings need more in flight than its latency implies (calibration.md: 2 MiB copies reach
# most of tpu7x's bandwidth with 4 in flight, not with 2).
RING_DEPTHS = (4,)
HBM_OOM = "CompileTimeHbmOom"  # libtpu's error when a program's buffers exceed the chip's HBM
RESULTS = harness.BENCH / "results"
TABLE = harness.REPO / "ragged_dot" / "tuned_blocks.py"


@contextlib.contextmanager
def recording_calls():
    """Records the grouped matmuls `ops` runs while tracing: ("forward",
    lhs shape, rhs shape, transpose_rhs) or ("weight_grad", a shape, b shape)."""
    calls, forward, weight_grad = [], ops._forward, ops._weight_grad

    def record_forward(lhs, rhs, group_sizes, transpose_rhs, *args, **kwargs):
        calls.append(("forward", lhs.shape, rhs.shape, transpose_rhs))
        return forward(lhs, rhs, group_sizes, transpose_rhs, *args, **kwargs)

    def record_weight_grad(a, b, *args, **kwargs):
        calls.append(("weight_grad", a.shape, b.shape, None))
        return weight_grad(a, b, *args, **kwargs)

    ops._forward, ops._weight_grad = record_forward, record_weight_grad
    try:
        yield calls
    finally:
        ops._forward, ops._weight_grad = forward, weight_grad


def experts_specs(shape: bench.MoeShape, tokens: int):
    """experts_forward's inputs (bf16), in the model's weight layout."""
    h, i, e, k = shape.hidden, shape.intermediate, shape.experts, shape.top_k
    s = lambda *dims, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(dims, dtype)
    up, down = ((s(e, h, 2 * i), s(e, i, h)) if shape.gpt_oss_layout else (s(e, 2 * i, h), s(e, h, i)))
    return [s(tokens, h), s(tokens, k, dtype=jnp.int32), s(tokens, k), up, down]


def grouped_matmuls(shape: bench.MoeShape, tokens: int, generation: str, training: bool):
    """The distinct grouped-matmul calls of the experts forward (and backward) on the grouped path,
    which serves every step of experts the fused decode kernel does not take (`ops.fused_decode_applies`)."""
    def forward(hidden, index, weights, up, down):
        ids = jnp.clip(index, 0, shape.experts)
        return ops._grouped_experts(hidden, ids, weights, up, down, None, None, None, None, activation="silu",
                                    gated=True, interleaved=False, transposed=shape.gpt_oss_layout, alpha=0.0,
                                    limit=0.0, generation=generation, interpret=False)

    def loss(*args):
        return jnp.sum(forward(*args).astype(jnp.float32))

    fn = jax.grad(loss, argnums=(0, 3, 4)) if training else forward
    with recording_calls() as calls:
        jax.eval_shape(harness.on_target(fn, generation), *experts_specs(shape, tokens))
    return list(dict.fromkeys(calls))


def call_fn(call, groups, generation, dtype=jnp.bfloat16, blocks=None):
    """(fn(a, b, group_sizes), table, key) of one recorded call: fn runs its kernel with `blocks`
    (None: the entry the table holds for `key`)."""
    kind, a_shape, b_shape, transpose_rhs = call
    itemsize = jnp.dtype(dtype).itemsize
    if kind == "forward":
        n = b_shape[1] if transpose_rhs else b_shape[2]
        fn = lambda a, b, g: ops._forward(a, b, g, transpose_rhs, generation, False, blocks=blocks)
        return fn, tuning.TUNED, (*a_shape, n, groups, itemsize)
    # [rows, P], [rows, Q] -> [G, P, Q]
    fn = lambda a, b, g: ops._weight_grad(a, b, g, dtype, generation, False, blocks=blocks)
    return fn, tuning.TUNED_WEIGHT_GRAD, (*a_shape, b_shape[1], groups, itemsize)


def fresh(fn):
    """A new function object: jax caches traces by function identity, and
    each candidate changes what the same call traces to."""
    return lambda *args: fn(*args)


def schedule_key(call, blocks, dtype) -> str:
    """What a kernel's compiled schedule depends on: everything but the row count."""
    kind, a_shape, b_shape, transpose_rhs = call
    fields = list(blocks.__dict__.values())
    if blocks.weight_buffers == 2:  # Pallas's own pipeline: keyed as before rings were a choice
        fields.pop(list(blocks.__dict__).index("weight_buffers"))
    return json.dumps([kind, list(a_shape[1:]), list(b_shape if kind == "forward" else b_shape[1:]), transpose_rhs,
                       fields, jnp.dtype(dtype).name])


def schedule_cache(generation: str) -> dict:
    file = RESULTS / f"schedules_{generation}.json"
    return json.loads(file.read_text()) if file.exists() else {}


def cached_schedule(cache: dict, fn, args, call, blocks, generation):
    """The compiled kernel's schedule and VMEM for one tiling (compiled on a
    miss), or None where libtpu refuses the tiling."""
    key = schedule_key(call, blocks, args[0].dtype)
    if key not in cache:
        file = RESULTS / f"schedules_{generation}.json"
        try:
            report = harness.compile(fn, args, generation, "ragged_dot_tpu")
            (kernel,) = report.kernels.values()
            cache[key] = dict(schedule=tpu_schedule.to_dict(kernel.schedule), vmem_used=kernel.vmem_bytes)
        except Exception as err:  # noqa: BLE001
            error = str(err).splitlines()[0][:200]
            if HBM_OOM in error:  # this entry's operands overflow the chip, whatever the tiling: not the tiling's fault
                raise
            cache[key] = dict(error=error)
        harness.write_atomically(file, json.dumps(cache, indent=0, sort_keys=True))
    entry = cache[key]
    return (tpu_schedule.from_dict(entry["schedule"]), entry["vmem_used"]) if "schedule" in entry else (None, None)


# The tilings the rule's step cycles are fitted to: every bm with a spread of
# (K block, N block) at two problem shapes (K = N = 2048; and 2880, gpt-oss's,
# whose blocks take the whole dim or leave a masked tail), for both kernels
# and dtypes (f32 only up to 1024x1024 weight blocks and at every other bm,
# the pass table interpolating between: its HIGHEST-precision steps take
# up to minutes each to compile). Rows and groups do not change a schedule.
FIT_ROWS, FIT_GROUPS = 4096, 8
FIT_BLOCK_M = (16, 64, 128, 256, 512, 1024)
FIT_BLOCK_M_F32 = (16, 128, 512)
FIT_KN = {2048: ((256, 256), (512, 512), (512, 1024), (1024, 512), (1024, 1024), (2048, 512), (512, 2048), (2048, 2048)),
          2880: ((2880, 2880), (1024, 1024), (2880, 512), (512, 2880))}
FIT_DTYPES = (jnp.bfloat16, jnp.float32)


def fit_sample(generation: str):
    """(call, blocks, dtype) of each tiling the fit compiles (those within the chip's VMEM)."""
    for dtype in FIT_DTYPES:
        for dim, kn in FIT_KN.items():
            calls = {("forward", True): ("forward", (FIT_ROWS, dim), (FIT_GROUPS, dim, dim), True),  # weights [G, N, K]
                     ("forward", False): ("forward", (FIT_ROWS, dim), (FIT_GROUPS, dim, dim), False),  # [G, K, N]
                     ("weight_grad", False): ("weight_grad", (FIT_ROWS, dim), (FIT_ROWS, dim), None)}
            for (kind, _), call in calls.items():
                for bm in FIT_BLOCK_M if dtype == jnp.bfloat16 else FIT_BLOCK_M_F32:
                    for bk, bn in kn:
                        blocks, itemsize = kernel.BlockSizes(bm, bk, bn), jnp.dtype(dtype).itemsize
                        if itemsize == 4 and bk * bn > 1024 * 1024:
                            continue
                        if tuning.BUFFERS[kind](blocks, itemsize) <= tuning.max_buffers(generation):
                            yield call, blocks, dtype


def sample_schedules(generation: str, cache: dict) -> list:
    """[(kind, blocks, (itemsize, transpose_rhs), (K, N), schedule)] of the fit sample, compiled on a cache miss."""
    points = []
    for call, blocks, dtype in fit_sample(generation):
        fn = call_fn(call, FIT_GROUPS, generation, dtype, blocks)[0]
        args = (jax.ShapeDtypeStruct(call[1], dtype), jax.ShapeDtypeStruct(call[2], dtype),
                jax.ShapeDtypeStruct((FIT_GROUPS,), jnp.int32))
        schedule, _ = cached_schedule(cache, fresh(fn), args, call, blocks, generation)
        if schedule is not None:
            points.append((call[0], blocks, (jnp.dtype(dtype).itemsize, bool(call[3])), (call[1][1], call[2][1]), schedule))
    return points


def measured_parts(schedule, kind: str) -> dict | None:
    """A kernel's step, cut as `tuning.StepCycles` models it, or None where
    Mosaic laid the step out otherwise (one region holding it all).

    The forward's pl.when bodies: a pass per K position (first, middle,
    last; one when K takes one step), the last one also storing, then the
    fill visits' store (then, where a block overhangs its dim, edge code the
    model leaves out). `mxu_pass` is the first pass (None with one K step:
    the fit takes the store back out of `last_pass`), `store` what the last
    adds. The weights' gradient's: the bodies with matmuls are its MXU
    passes, one before them zeroes the accumulator (none when Mosaic folds
    `k == 0` away), one after stores it."""
    cycles = [r.cycles for r in schedule.regions]
    passes = [i for i, r in enumerate(schedule.regions) if r.matmuls > 0]
    before, after = cycles[:passes[0]], cycles[passes[-1] + 1:]
    parts = dict(base=schedule.iteration_cycles - sum(cycles), fill_drain=schedule.fill_drain_cycles)
    if kind == "forward":
        if before or not after:
            return None
        first, last = (cycles[passes[0]] if len(passes) > 1 else None), cycles[passes[-1]]
        return dict(parts, mxu_pass=first, last_pass=last, store=None if first is None else last - first, zero=0,
                    fill=after[0])
    if not after:
        return None
    return dict(parts, mxu_pass=float(np.mean([cycles[i] for i in passes])), zero=before[0] if before else None,
                store=after[0], fill=0)


def fit_step_cycles(points: list, generation: str) -> dict:
    """{(kind, itemsize, transpose_rhs): StepCycles fields} from the sample's schedules: the
    MXU pass's median cycles per (rows per pass, weight tiles); least-squares
    lines for the rest."""
    def line(rows):  # rows: (features..., cycles) -> coefficients of (1, features...)
        data = np.asarray(rows, np.float64)
        design = np.column_stack([np.ones(len(data)), data[:, :-1]])
        return tuple(round(float(c), 3) for c in np.linalg.lstsq(design, data[:, -1], rcond=None)[0])

    at = lambda coef, x: coef[0] + coef[1] * x
    fitted = {}
    for kind, layout in sorted({(p[0], p[2]) for p in points}):
        mine = [(tuning.features(kind, b, *dims, generation), measured_parts(s, kind)) for k_, b, i, dims, s in points
                if (k_, i) == (kind, layout) and measured_parts(s, kind) is not None]
        zero = line([(f["acc"], m["zero"]) for f, m in mine if m["zero"] is not None])
        # The forward's store: its last pass less its first (in f32, or with a K tail masked, the
        # scheduler can lay the last pass out shorter than the first: no store is negative).
        store = line([(f["acc"], max(m["store"], 0)) for f, m in mine if m["store"] is not None])
        passes = {}
        for f, m in mine:
            # A forward with one K step stores in its only pass: take the store back out.
            cycles = m["mxu_pass"] if m["mxu_pass"] is not None else m["last_pass"] - at(store, f["acc"])
            passes.setdefault(f["pass_rows"], {}).setdefault(f["tiles"], []).append(cycles)
        fitted[(kind, *layout)] = dict(
            mxu_pass={rows: tuple((tiles, round(float(np.median(c)), 1)) for tiles, c in sorted(by_tiles.items()))
                      for rows, by_tiles in sorted(passes.items())},
            zero=zero,
            store=store,
            fill=line([(f["acc"], m["fill"]) for f, m in mine]),
            fill_drain=line([(f["acc"], m["fill_drain"]) for f, m in mine]),
            # Where Mosaic folded the zeroing into the step, take it back out.
            base=line([(f["rows"], f["ragged"], f["ragged"] * f["rows"], f["one_step"],
                        m["base"] - (0 if m["zero"] is not None else at(zero, f["acc"]))) for f, m in mine]),
        )
    return fitted


def step_errors(points: list, generation: str) -> list[float]:
    """Per sample tiling: (modeled - compiled) / compiled cycles of a step that
    runs every pass, zeroes and stores (the rule's model against the schedule)."""
    errors = []
    for kind, blocks, (itemsize, transpose_rhs), dims, schedule in points:
        m, c = measured_parts(schedule, kind), tuning.step_parts(kind, blocks, *dims, generation, itemsize, transpose_rhs)
        if m is None:
            continue
        passes = tuning.features(kind, blocks, *dims, generation)["passes"]
        if kind == "forward":  # one pass, the last K step's: it stores
            measured = m["base"] + m["last_pass"]
        else:
            measured = m["base"] + (m["zero"] or 0) + passes * m["mxu_pass"] + m["store"]
        errors.append((c["base"] + c["zero"] + passes * c["mxu_pass"] + c["store"]) / measured - 1)
    return errors


def fit_file(generation: str) -> Path:
    return RESULTS / f"step_cycles_{generation}.json"


def load_fit(generation: str) -> dict:
    """{(kind, itemsize, transpose_rhs): StepCycles fields} as written by `fit`."""
    fitted = {}
    for name, fields in json.loads(fit_file(generation).read_text())["fitted"].items():
        kind, itemsize, transpose_rhs = name.split()
        fields = dict(fields, mxu_pass={int(rows): tuple(map(tuple, points)) for rows, points in fields["mxu_pass"].items()})
        fitted[(kind, int(itemsize), transpose_rhs == "True")] = {
            key: tuple(v) if isinstance(v, list) else v for key, v in fields.items()}
    return fitted


def fit(generation: str) -> dict:
    """Fits the generation's step cycles, installs them in the rule, and
    writes them with the fit's errors."""
    points = sample_schedules(generation, schedule_cache(generation))
    fitted = fit_step_cycles(points, generation)
    tuning.STEP_CYCLES[generation] = fitted
    tuning.rule_blocks.cache_clear()
    tuning.rule_weight_grad_blocks.cache_clear()
    errors = np.asarray(step_errors(points, generation))
    record = dict(generation=generation, tilings=len(points), laid_out_otherwise=len(points) - len(errors),
                  max_abs_error=float(np.abs(errors).max()),
                  mean_abs_error=float(np.abs(errors).mean()),
                  fitted={" ".join(map(str, key)): fields for key, fields in fitted.items()})
    # JSON keys are strings: the table keys rows per pass as ints again (`load_fit`).
    harness.write_atomically(fit_file(generation), json.dumps(record, indent=1))
    return record


def tune_call(shape, tokens, call, generation, cache=None):
    """Rates the cost model's best candidates with the schedule model,
    compiles the winner at the entry's shapes; returns the record."""
    _, _, key = call_fn(call, shape.experts, generation)
    kind, a_shape, b_shape, _ = call
    rows, k, n, groups, itemsize = key
    buffers = tuning.BUFFERS[kind]
    transpose_rhs = bool(call[3])
    ranked = tuning.ranked_blocks(kind, rows, k, n, groups, generation, itemsize, tuning.max_buffers(generation),
                                  transpose_rhs)
    rule = (tuning.rule_blocks(rows, k, n, groups, generation, itemsize, transpose_rhs=transpose_rhs)
            if kind == "forward" else tuning.rule_weight_grad_blocks(rows, k, n, groups, generation, itemsize))
    candidates = list(dict.fromkeys(ranked[:CANDIDATES] + [rule]))
    if kind == "forward":  # each again with its weights through a ring, where its blocks are whole
        ringed = [dataclasses.replace(b, weight_buffers=depth) for b in candidates for depth in RING_DEPTHS]
        candidates += [b for b in ringed if kernel.ring_fits(b_shape, transpose_rhs, False, b)
                       and buffers(b, itemsize) <= tuning.max_buffers(generation)]  # as every entry: headroom
    cache = schedule_cache(generation) if cache is None else cache
    args = (jax.ShapeDtypeStruct(a_shape, jnp.bfloat16), jax.ShapeDtypeStruct(b_shape, jnp.bfloat16),
            jnp.asarray(bench.routing(shape, tokens)))
    record = dict(model=shape.model, tokens=tokens, kind=kind, key=list(key), transpose_rhs=transpose_rhs,
                  generation=generation, revision=KERNEL_REVISION[kind], model_revision=pipeline.MODEL_REVISION,
                  candidates=[])
    rated = []
    for blocks in candidates:
        fn = call_fn(call, shape.experts, generation, blocks=blocks)[0]
        try:
            (cost,), copies = harness.walk(fresh(fn), args, generation)
            schedule, vmem_used = cached_schedule(cache, fresh(fn), args, call, blocks, generation)
        except Exception as err:  # noqa: BLE001
            if HBM_OOM in str(err):
                record.update(too_big_for_hbm=str(err).splitlines()[0][:200])
                return record
            raise
        formula_us = bench.modeled_seconds(cost, generation, cost.grid[0], copies)["modeled_us"]
        limit = tuning.vmem_limit(buffers(blocks, itemsize), generation)
        candidate = dict(blocks=list(blocks.__dict__.values()), formula_us=formula_us,
                         rule_model_us=tuning.modeled_seconds(kind, rows, k, n, groups, blocks, generation, itemsize,
                                                              transpose_rhs) * 1e6)
        if schedule is None or vmem_used > limit:
            candidate["rejected"] = "does not compile" if schedule is None else f"VMEM {vmem_used} > limit {limit}"
        else:
            # The padding copies outside the kernel at what HBM delivers, as the bench counts them.
            candidate["modeled_us"] = (pipeline.kernel_seconds(cost, schedule, generation)["modeled"]
                                       + copies / pipeline.copy_bytes_per_s(generation)) * 1e6
            rated.append((candidate["modeled_us"], buffers(blocks, itemsize), blocks))
        record["candidates"].append(candidate)
    rule_us = next((c.get("modeled_us") for c in record["candidates"] if c["blocks"] == list(rule.__dict__.values())), None)
    for us, need, blocks in sorted(rated, key=lambda w: (w[0], w[1])):
        try:  # at the entry's own shapes: proves it fits this entry's HBM and VMEM
            report = harness.compile(fresh(call_fn(call, shape.experts, generation, blocks=blocks)[0]), args,
                                     generation, "ragged_dot_tpu")
        except Exception as err:  # noqa: BLE001
            error = str(err).splitlines()[0][:200]
            if HBM_OOM in error:
                record.update(too_big_for_hbm=error)
                return record
            record.setdefault("rejected", []).append(dict(blocks=list(blocks.__dict__.values()), error=error))
            continue
        (kernel_report,) = report.kernels.values()
        limit = tuning.vmem_limit(need, generation)
        if kernel_report.vmem_bytes > limit:
            record.setdefault("rejected", []).append(dict(blocks=list(blocks.__dict__.values()),
                                                          error=f"VMEM {kernel_report.vmem_bytes} > limit {limit}"))
            continue
        record.update(blocks=list(blocks.__dict__.values()), modeled_us=us, rule_modeled_us=rule_us,
                      vmem_used=kernel_report.vmem_bytes, vmem_limit=limit)
        return record
    raise RuntimeError(f"no candidate compiled for {record}")


def results(generation: str) -> "harness.Results":
    """The generation's tuning records, one per (kind, key)."""
    return harness.Results(RESULTS / f"tuning_{generation}.json", key=lambda r: (r["kind"], tuple(r["key"])))


def records(generation: str) -> list[dict]:
    return results(generation).rows


# Which design of each kernel a record was rated on: 3, the forward whose weights may go through a
# ring (`BlockSizes.weight_buffers`); 2, its visits multiplying whole tiles (ragged-dot v2); 1, its
# 128-row sub-blocks before.
KERNEL_REVISION = {"forward": 3, "weight_grad": 1}


def rated_by_this_model(record: dict) -> bool:
    """Whether a record was rated on the kernel as it is now, by the bench's
    model as it is now (`pipeline.MODEL_REVISION`), its candidates shortlisted
    by the rule's current model (they carry its figures). Older records are
    tuned again, and stay in the table until then; a matmul too big for the
    chip stays so."""
    if "too_big_for_hbm" in record:
        return True
    return (record.get("revision", 1) == KERNEL_REVISION[record["kind"]]
            and record.get("model_revision", 1) == pipeline.MODEL_REVISION
            and any("rule_model_us" in c for c in record.get("candidates", [])))


def too_big_for_hbm(generation: str) -> set[tuple]:
    """(kind, key) of the matmuls whose operands overflow one chip's HBM
    (DeepSeek-V3's 15 GB of gate_up weights on a 16 GB v5e): no entry, a
    user shards those experts over chips (other, smaller keys)."""
    return {(r["kind"], tuple(r["key"])) for r in records(generation) if "too_big_for_hbm" in r}


def write_table(path: Path = TABLE) -> None:
    """Regenerates tuned_blocks.py from every tuning_<generation>.json and step_cycles_<generation>.json."""
    tables = {"forward": {g: {} for g in GENERATIONS}, "weight_grad": {g: {} for g in GENERATIONS}}
    for generation in GENERATIONS:
        for r in records(generation):
            if "blocks" in r:
                tables[r["kind"]][generation][tuple(r["key"])] = r
    lines = [
        '"""Tuned block sizes, per TPU generation: GENERATED by `make tune` (bench/tune.py)',
        "from bench/results/tuning_<generation>.json. Do not edit by hand.",
        "",
        "Key: (rows, K, N, groups, itemsize) for the grouped matmul, (rows, P, Q, groups,",
        "itemsize) for the weights' gradient. Each entry is the block choice with the lowest",
        "MODELED time among the block rule model's best, as the bench's model rates it (recorded in",
        "bench/results/tuning_<generation>.json), and was compiled by libtpu for its generation",
        "(VMEM used / limit in the comment).",
        "",
        "STEP_CYCLES: per generation, kernel, itemsize and weight layout, the `tuning.StepCycles` fitted to the",
        "compiled schedules of bench/tune.py's `fit_sample` (bench/results/step_cycles_<generation>.json).",
        '"""',
        "",
        "from .kernel import BlockSizes as B",
        "",
        "STEP_CYCLES = {",
    ]
    for generation in GENERATIONS:
        if fit_file(generation).exists():
            lines.append(f"    {generation!r}: {{")
            for key, fields in load_fit(generation).items():
                lines.append(f"        {key!r}: dict(")
                lines += [f"            {field}={value!r}," for field, value in fields.items()]
                lines.append("        ),")
            lines.append("    },")
    lines += ["}", ""]
    for kind, name in (("forward", "TUNED"), ("weight_grad", "TUNED_WEIGHT_GRAD")):
        lines.append(f"{name} = {{")
        for generation, entries in tables[kind].items():
            lines.append(f"    {generation!r}: {{")
            for key, r in sorted(entries.items()):
                lines.append(f"        {key}: B{tuple(r['blocks'])},  # {r['model']} {r['tokens']} tok, "
                             f"{r['modeled_us']:.1f} us, VMEM {r['vmem_used'] / 2**20:.1f}/{r['vmem_limit'] / 2**20:.1f} MiB")
            lines.append("    },")
        lines.append("}")
        lines.append("")
    harness.write_atomically(path, "\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=[s.model for s in bench.MOE_SHAPES])
    parser.add_argument("--generations", nargs="*", default=list(GENERATIONS), choices=list(GENERATIONS))
    parser.add_argument("--tokens", nargs="*", type=int, default=DECODE_TOKENS + PREFILL_TOKENS)
    parser.add_argument("--fit", action="store_true", help="fit the step cycles again (done anyway where missing)")
    parser.add_argument("--fit-only", action="store_true", help="fit, then stop")
    args = parser.parse_args(argv)
    shapes = [s for s in bench.MOE_SHAPES if s.model in args.models]
    start = time.perf_counter()
    for generation in args.generations:
        if args.fit or args.fit_only or not fit_file(generation).exists():
            record = fit(generation)
            write_table()
            print(f"{generation}: step cycles fitted to {record['tilings']} tilings, "
                  f"error mean {record['mean_abs_error']:.1%} max {record['max_abs_error']:.1%} "
                  f"[{time.perf_counter() - start:.0f} s]", flush=True)
        if args.fit_only:
            continue
        tuned = results(generation)
        done = {tuned.key(r) for r in tuned.rows if rated_by_this_model(r)}
        for shape in shapes:
            for tokens in args.tokens:
                training = tokens >= PREFILL_TOKENS[0]  # training steps run prefill-sized batches
                for call in grouped_matmuls(shape, tokens, generation, training):
                    key = (call[0], call_fn(call, shape.experts, generation)[2])
                    if key in done:  # another model or bucket had the same matmul
                        continue
                    record = tune_call(shape, tokens, call, generation)
                    done.add(key)
                    tuned.put(record)
                    write_table()
                    outcome = (f"{record['blocks']} {record['modeled_us']:.1f} us (rule {record['rule_modeled_us']})"
                               if "blocks" in record else "does not fit the chip's HBM: no entry")
                    print(f"{generation} {shape.model} {tokens} tok {record['kind']} {record['key']}: {outcome} "
                          f"[{time.perf_counter() - start:.0f} s]", flush=True)
    write_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
