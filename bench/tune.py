"""Fills ragged_dot's tuning tables (`make tune`), MODELED on this CPU machine.

For each model's experts (bench.MOE_SHAPES), token bucket and TPU
generation, it traces transformers' experts forward (and, for prefill, its
gradient) to find every grouped matmul the kernels look blocks up for, then
for each one:

1. takes the block choices the cost model (ragged_dot/tuning.py) rates best,
   allowing buffers up to what the chip's VMEM holds (`max_buffers`), not
   only Mosaic's default scoped limit the rule keeps to, plus the rule's;
2. rates each with the bench's schedule model (bench/pipeline.py): the
   grid walk on the real routing, and the compiled kernel's schedule. A
   kernel's schedule does not depend on its row count (checked: the same
   cycles at 4k to 64k rows), so each tiling is compiled once per
   generation and kept in bench/results/schedules_<generation>.json;
3. compiles the fastest with libtpu at the entry's own shapes; a choice
   that does not compile or exceeds its VMEM limit is dropped for the next.

Evidence goes to bench/results/tuning_<generation>.json; the table to
ragged_dot/tuned_blocks.py (generated from those files; do not edit it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import bench  # sets up sys.path and the CPU / libtpu environment

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import grid_walk  # noqa: E402
import pipeline  # noqa: E402
import tpu_compile  # noqa: E402
import tpu_schedule  # noqa: E402
from ragged_dot import ops, tuning  # noqa: E402
from runtime.generations import GENERATIONS  # noqa: E402

DECODE_TOKENS = [1, 2, 4, 8, 16, 32, 64]  # the buckets 1..64 sequences reach
PREFILL_TOKENS = [2048, 4096, 8192, 16384]
CANDIDATES = 4  # how many of the cost model's best each entry walks
HBM_OOM = "CompileTimeHbmOom"  # libtpu's error when a program's buffers exceed the chip's HBM
RESULTS = bench.BENCH / "results"
TABLE = bench.REPO / "ragged_dot" / "tuned_blocks.py"


@contextlib.contextmanager
def recording_calls():
    """Records the grouped matmuls `ops` runs while tracing: ("forward",
    lhs shape, rhs shape, transpose_rhs) or ("weight_grad", a shape, b shape)."""
    calls, forward, weight_grad = [], ops._forward, ops._weight_grad

    def record_forward(lhs, rhs, group_sizes, transpose_rhs, generation, interpret):
        calls.append(("forward", lhs.shape, rhs.shape, transpose_rhs))
        return forward(lhs, rhs, group_sizes, transpose_rhs, generation, interpret)

    def record_weight_grad(a, b, group_sizes, out_dtype, generation, interpret):
        calls.append(("weight_grad", a.shape, b.shape, None))
        return weight_grad(a, b, group_sizes, out_dtype, generation, interpret)

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
    """The distinct grouped-matmul calls of the experts forward (and backward)."""
    def forward(hidden, index, weights, up, down):
        return ops.experts_forward(hidden, index, weights, up, down, transposed=shape.gpt_oss_layout,
                                   generation=generation, interpret=False)

    def loss(*args):
        return jnp.sum(forward(*args).astype(jnp.float32))

    fn = jax.grad(loss, argnums=(0, 3, 4)) if training else forward
    with recording_calls() as calls:
        jax.eval_shape(fn, *experts_specs(shape, tokens))
    return list(dict.fromkeys(calls))


def call_fn(call, groups, generation):
    """(fn(a, b, group_sizes), table, key, model, buffers) of one recorded call."""
    kind, a_shape, b_shape, transpose_rhs = call
    if kind == "forward":
        n = b_shape[1] if transpose_rhs else b_shape[2]
        fn = lambda a, b, g: ops._forward(a, b, g, transpose_rhs, generation, False)
        return fn, tuning.TUNED, (*a_shape, n, groups, 2), tuning.modeled_seconds, tuning.forward_buffers
    # [rows, P], [rows, Q] -> [G, P, Q]
    fn = lambda a, b, g: ops._weight_grad(a, b, g, jnp.bfloat16, generation, False)
    return (fn, tuning.TUNED_WEIGHT_GRAD, (*a_shape, b_shape[1], groups, 2), tuning.modeled_weight_grad_seconds,
            tuning.weight_grad_buffers)


def fresh(fn):
    """A new function object: jax caches traces by function identity, and
    each candidate changes what the same call traces to."""
    return lambda *args: fn(*args)


def schedule_key(call, blocks) -> str:
    """What a kernel's compiled schedule depends on: everything but the row count."""
    kind, a_shape, b_shape, transpose_rhs = call
    return json.dumps([kind, list(a_shape[1:]), list(b_shape if kind == "forward" else b_shape[1:]), transpose_rhs,
                       list(blocks.__dict__.values())])


def schedule_cache(generation: str) -> dict:
    file = RESULTS / f"schedules_{generation}.json"
    return json.loads(file.read_text()) if file.exists() else {}


def cached_schedule(cache: dict, fn, args, call, blocks, generation):
    """The compiled kernel's schedule and VMEM for one tiling (compiled on a
    miss), or None where libtpu refuses the tiling."""
    key = schedule_key(call, blocks)
    if key not in cache:
        file = RESULTS / f"schedules_{generation}.json"
        try:
            report = tpu_compile.compile_for(fn, [(x.shape, x.dtype) for x in args], generation, "ragged_dot_tpu")
            (kernel,) = report.kernels.values()
            cache[key] = dict(schedule=tpu_schedule.to_dict(kernel.schedule), vmem_used=kernel.vmem_bytes)
        except Exception as err:  # noqa: BLE001
            error = str(err).splitlines()[0][:200]
            if HBM_OOM in error:  # this entry's operands overflow the chip, whatever the tiling: not the tiling's fault
                raise
            cache[key] = dict(error=error)
        file.write_text(json.dumps(cache, indent=0, sort_keys=True))
    entry = cache[key]
    return (tpu_schedule.from_dict(entry["schedule"]), entry["vmem_used"]) if "schedule" in entry else (None, None)


def tune_call(shape, tokens, call, generation, cache=None):
    """Rates the cost model's best candidates with the schedule model,
    compiles the winner at the entry's shapes; returns the record."""
    fn, table, key, model, buffers = call_fn(call, shape.experts, generation)
    kind, a_shape, b_shape, _ = call
    rows, k, n, groups, itemsize = key
    ranked = tuning.ranked_blocks(model, buffers, rows, k, n, groups, generation, itemsize,
                                  tuning.max_buffers(generation))
    rule = (tuning.rule_blocks if kind == "forward" else tuning.rule_weight_grad_blocks)(
        rows, k, n, groups, generation, itemsize)
    candidates = list(dict.fromkeys(ranked[:CANDIDATES] + [rule]))
    gen = GENERATIONS[generation]
    cache = schedule_cache(generation) if cache is None else cache
    args = (jax.ShapeDtypeStruct(a_shape, jnp.bfloat16), jax.ShapeDtypeStruct(b_shape, jnp.bfloat16),
            jnp.asarray(bench.routing(shape, tokens)))
    record = dict(model=shape.model, tokens=tokens, kind=kind, key=list(key), generation=generation, candidates=[])
    rated = []
    for blocks in candidates:
        table[generation][key] = blocks
        try:
            (cost,), copies = grid_walk.kernel_costs_and_copies(fresh(fn), args, gen.mxu_width)
            schedule, vmem_used = cached_schedule(cache, fresh(fn), args, call, blocks, generation)
        except Exception as err:  # noqa: BLE001
            if HBM_OOM in str(err):
                record.update(too_big_for_hbm=str(err).splitlines()[0][:200])
                return record
            raise
        finally:
            del table[generation][key]
        formula_us = bench.modeled_seconds(cost, generation, cost.grid[0], copies)["modeled_us"]
        limit = tuning.vmem_limit(buffers(blocks, itemsize), generation)
        candidate = dict(blocks=list(blocks.__dict__.values()), formula_us=formula_us)
        if schedule is None or vmem_used > limit:
            candidate["rejected"] = "does not compile" if schedule is None else f"VMEM {vmem_used} > limit {limit}"
        else:
            # The padding copies outside the kernel at full bandwidth, as the bench counts them.
            candidate["modeled_us"] = (pipeline.kernel_seconds(cost, schedule, generation)["modeled"]
                                       + copies / gen.hbm_bytes_per_s) * 1e6
            rated.append((candidate["modeled_us"], buffers(blocks, itemsize), blocks))
        record["candidates"].append(candidate)
    rule_us = next((c.get("modeled_us") for c in record["candidates"] if c["blocks"] == list(rule.__dict__.values())), None)
    for us, need, blocks in sorted(rated, key=lambda w: (w[0], w[1])):
        table[generation][key] = blocks
        try:  # at the entry's own shapes: proves it fits this entry's HBM and VMEM
            report = tpu_compile.compile_for(fresh(fn), [(x.shape, x.dtype) for x in args], generation, "ragged_dot_tpu")
        except Exception as err:  # noqa: BLE001
            error = str(err).splitlines()[0][:200]
            if HBM_OOM in error:
                record.update(too_big_for_hbm=error)
                return record
            record.setdefault("rejected", []).append(dict(blocks=list(blocks.__dict__.values()), error=error))
            continue
        finally:
            del table[generation][key]
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


def records(generation: str) -> list[dict]:
    file = RESULTS / f"tuning_{generation}.json"
    return json.loads(file.read_text()) if file.exists() else []


def too_big_for_hbm(generation: str) -> set[tuple]:
    """(kind, key) of the matmuls whose operands overflow one chip's HBM
    (DeepSeek-V3's 15 GB of gate_up weights on a 16 GB v5e): no entry, a
    user shards those experts over chips (other, smaller keys)."""
    return {(r["kind"], tuple(r["key"])) for r in records(generation) if "too_big_for_hbm" in r}


def write_table(path: Path = TABLE) -> None:
    """Regenerates tuned_blocks.py from every tuning_<generation>.json."""
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
        "MODELED time among the cost model's best, as the bench's model rates it (recorded in",
        "bench/results/tuning_<generation>.json), and was compiled by libtpu for its generation",
        "(VMEM used / limit in the comment).",
        '"""',
        "",
        "from .kernel import BlockSizes as B",
        "",
    ]
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
    path.write_text("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=[s.model for s in bench.MOE_SHAPES])
    parser.add_argument("--generations", nargs="*", default=list(GENERATIONS), choices=list(GENERATIONS))
    parser.add_argument("--tokens", nargs="*", type=int, default=DECODE_TOKENS + PREFILL_TOKENS)
    args = parser.parse_args(argv)
    shapes = [s for s in bench.MOE_SHAPES if s.model in args.models]
    start = time.perf_counter()
    for generation in args.generations:
        file = RESULTS / f"tuning_{generation}.json"
        done_records = records(generation)
        done = {(r["kind"], tuple(r["key"])) for r in done_records}
        for shape in shapes:
            for tokens in args.tokens:
                training = tokens >= PREFILL_TOKENS[0]  # training steps run prefill-sized batches
                for call in grouped_matmuls(shape, tokens, generation, training):
                    key = (call[0], call_fn(call, shape.experts, generation)[2])
                    if key in done:  # another model or bucket had the same matmul
                        continue
                    record = tune_call(shape, tokens, call, generation)
                    done.add(key)
                    done_records.append(record)
                    file.write_text(json.dumps(done_records, indent=1))
                    write_table()
                    outcome = (f"{record['blocks']} {record['modeled_us']:.1f} us (rule {record['rule_modeled_us']})"
                               if "blocks" in record else "does not fit the chip's HBM: no entry")
                    print(f"{generation} {shape.model} {tokens} tok {record['kind']} {record['key']}: {outcome} "
                          f"[{time.perf_counter() - start:.0f} s]", flush=True)
    write_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
