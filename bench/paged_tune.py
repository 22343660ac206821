"""Fills paged attention's tuning table (`make tune-paged`), MODELED on this CPU machine.

Resumable: it skips the entries bench/results/paged_tuning_<generation>.json
already holds rated by the schedule model as it is now (`pipeline.MODEL_REVISION`;
`--redo` rates them again, as after a kernel change), so a re-rating resumes
where it stopped. Each entry compiles up to 6 programs: about 3 minutes per
entry on one core.

For each generation, head_dim (64, 128, 256), page size (16 to 256) and cache
dtype (bf16, fp8 e4m3, int8) it rates each kernel's candidates with the
bench's model (paged_bench.measure: compiled by libtpu for that generation,
its own schedule, its bytes) on 8 KV heads with 4 query heads each:
- the decode kernel's keys per chunk, on two decode batches (64 sequences at 8k, 256 at 2k:
  their times summed, as a server sees both);
- the prefill kernel's query rows and keys per chunk, on a prefill batch
  (4 chunks of 512 new tokens, 8k).
and keeps the fastest that compiles in both cache layouts (smaller blocks are
tried only where none fits the default scoped VMEM) and whose step list fits
SMEM at the table's limits (1024 batched tokens, 256 sequences, 32k context).

Evidence goes to bench/results/paged_tuning_<generation>.json, the table to
paged_attention/tuned_blocks.py (generated from those files; do not edit it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import harness  # sets up sys.path and the CPU / libtpu environment
import paged_bench  # noqa: E402
import pipeline  # noqa: E402

import jax.numpy as jnp  # noqa: E402

from paged_attention import ops, tuning  # noqa: E402
from paged_attention.kernel import BlockSizes  # noqa: E402
from runtime.generations import GENERATIONS  # noqa: E402

KV_HEADS, GROUPS = 8, 4
# The candidates: a first sweep (v6e, d128, 16-token pages, bf16) rated 256 keys per decode chunk
# and 128-row prefill blocks well behind these (1.2x and 1.5x the best).
DECODE_KEYS = (512, 1024, 2048)
PREFILL = ((256, 512), (256, 1024), (512, 1024))  # (query rows, keys)
# Tried only where none of those fits the generation's default scoped VMEM (v5e's 16 MiB at head_dim 256).
SMALLER = {"decode": ((0, 256),), "prefill": ((128, 256), (128, 512))}
LIMITS = tuning.SERVING_LIMITS  # batched tokens, sequences, context
RESULTS = harness.BENCH / "results"
TABLE = harness.REPO / "paged_attention" / "tuned_blocks.py"


def rating_batches(page_size: int) -> dict[str, list[paged_bench.Batch]]:
    return dict(decode=[paged_bench.Batch("decode 64 x 8k", 64, 0, 0, 8192, page_size),
                        paged_bench.Batch("decode 256 x 2k", 256, 0, 0, 2048, page_size)],
                prefill=[paged_bench.Batch("prefill 4 x 512, 8k", 0, 4, 512, 8192, page_size)])


def candidates(kind: str, page_size: int, smaller: bool = False) -> dict[tuple[int, int], BlockSizes]:
    """(rows, keys) -> the kernel's blocks, one per distinct choice at this page size."""
    if kind == "decode":
        return {(0, keys): BlockSizes(tuning.decode_block_q(GROUPS), keys // page_size)
                for _, keys in (SMALLER[kind] if smaller else [(0, k) for k in DECODE_KEYS]) if keys >= page_size}
    return {(rows, keys): BlockSizes(tuning.prefill_block_q(rows, GROUPS), keys // page_size)
            for rows, keys in (SMALLER[kind] if smaller else PREFILL) if keys >= page_size}


def fits_smem_at_limits(kind: str, blocks: BlockSizes, page_size: int) -> bool:
    chunks = -(-LIMITS["context"] // page_size // blocks.pages_per_block)
    num_blocks = -(-LIMITS["tokens"] // blocks.block_q)
    need = ops.smem_bytes(num_blocks, LIMITS["seqs"], chunks, blocks.pages_per_block, kind)
    return need <= ops.SMEM_BYTES - ops.SMEM_RESERVE


def tune_entry(head_dim: int, page_size: int, cache_dtype: str, generation: str) -> dict:
    shape = paged_bench.AttentionShape(f"d{head_dim} G{GROUPS}", KV_HEADS * GROUPS, KV_HEADS, head_dim)
    record = dict(key=[head_dim, page_size, cache_dtype], generation=generation, rated=today(),
                  model_revision=pipeline.MODEL_REVISION)
    for kind, batches in rating_batches(page_size).items():
        rated, tried = {}, {}
        for smaller in (False, True):
            for choice, blocks in candidates(kind, page_size, smaller).items():
                tried[choice] = blocks
                if not fits_smem_at_limits(kind, blocks, page_size):
                    rated[choice] = dict(error="step list past SMEM at the table's limits")
                    continue
                rated[choice] = rate(shape, batches, generation, cache_dtype, blocks)
                print(f"  {kind} {choice}: " + (f"{rated[choice]['modeled_us']:.1f} us" if "modeled_us" in rated[choice]
                                                else rated[choice]["error"]), flush=True)
            if any("modeled_us" in r for r in rated.values()):
                break
        ok = {c: r for c, r in rated.items() if "modeled_us" in r}
        if not ok:
            raise RuntimeError(f"no {kind} candidate compiles for {record['key']} on {generation}")
        # The table serves both cache layouts: the fastest candidate that compiles head-major too
        # (whose blocks take VMEM of their own).
        fastest = sorted(ok, key=lambda c: ok[c]["modeled_us"])
        best = next((c for c in fastest if compiles_head_major(shape, batches[0], generation, cache_dtype, tried[c])), None)
        if best is None:
            raise RuntimeError(f"no {kind} candidate compiles head-major for {record['key']} on {generation}")
        record[kind] = dict(best=list(best), vmem_used=ok[best]["vmem_used"],
                            candidates=[dict(choice=list(c), **r) for c, r in rated.items()])
    return record


def rate(shape, batches, generation: str, cache_dtype: str, blocks: BlockSizes) -> dict:
    """One candidate's figures on the batches: each modeled time (`per_batch`) and their sum, or the
    first batch's error."""
    rows = [paged_bench.measure(shape, batch, generation, jnp.dtype(cache_dtype), blocks) for batch in batches]
    failed = next((row for row in rows if "error" in row), None)
    if failed is not None:
        return dict(error=failed["error"])
    summed = {k: sum(row[k] for row in rows) for k in ("modeled_us", "compute_us", "dma_us", "around_us")}
    return dict(summed, vmem_used=max(row["vmem_used"] for row in rows),
                per_batch={batch.name: row["modeled_us"] for batch, row in zip(batches, rows)})


def compiles_head_major(shape, batch, generation: str, cache_dtype: str, blocks: BlockSizes) -> bool:
    """Whether the kernel compiles on head-major caches with these blocks (within VMEM)."""
    row = paged_bench.measure(shape, batch, generation, jnp.dtype(cache_dtype), blocks, cache_layout="head_major")
    print(f"    head-major {blocks}: " + ("compiles" if "error" not in row else row["error"][:120]), flush=True)
    return "error" not in row


def today() -> str:
    """The UTC date an entry is rated on (kept with it, for its reader)."""
    return time.strftime("%Y-%m-%d", time.gmtime())


def needs_rating(held: dict | None, redo: bool = False) -> bool:
    """Whether an entry is rated (again): not held yet, `redo`, or rated by an earlier schedule
    model (records from before revisions were kept are revision 1)."""
    return held is None or redo or held.get("model_revision", 1) != pipeline.MODEL_REVISION


def results_file(generation: str):
    return RESULTS / f"paged_tuning_{generation}.json"


def write_table() -> None:
    """Regenerates tuned_blocks.py from every paged_tuning_<generation>.json."""
    lines = [
        '"""Tuned block sizes for paged attention, per TPU generation: GENERATED by `make tune-paged`',
        "(bench/paged_tune.py) from bench/results/paged_tuning_<generation>.json. Do not edit by hand.",
        "",
        "Key: (head_dim, page_size, cache dtype), as `tuning.table_key` buckets a call; value: (decode",
        "keys, prefill query rows, prefill keys) per block, rows being query tokens times G. Each part is",
        "the candidate with the lowest MODELED time of its kernel on two decode batches or a prefill batch,",
        "compiled by libtpu for its generation (VMEM used in the comment).",
        '"""',
        "",
        "TUNED = {",
    ]
    for generation in GENERATIONS:
        path = results_file(generation)
        if not path.exists():
            continue
        lines.append(f"    {generation!r}: {{")
        for r in json.loads(path.read_text()):
            if "error" in r:
                continue
            value = (r["decode"]["best"][1], *r["prefill"]["best"])
            vmem = max(r["decode"]["vmem_used"], r["prefill"]["vmem_used"])
            lines.append(f"        {tuple(r['key'])}: {value},  # {vmem / 2**20:.1f} MiB")
        lines.append("    },")
    lines.append("}")
    harness.write_atomically(TABLE, "\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generations", nargs="*", default=list(GENERATIONS), choices=list(GENERATIONS))
    parser.add_argument("--head-dims", nargs="*", type=int, default=[128, 64, 256])  # the commonest first
    parser.add_argument("--page-sizes", nargs="*", type=int, default=list(tuning.TUNED_PAGE_SIZES))
    parser.add_argument("--cache-dtypes", nargs="*", default=list(tuning.TUNED_CACHE_DTYPES))
    parser.add_argument("--write-table", action="store_true", help="only regenerate tuned_blocks.py")
    parser.add_argument("--redo", action="store_true", help="rate again the entries the results already hold")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    for generation in [] if args.write_table else args.generations:
        records = harness.Results(results_file(generation), key=lambda r: tuple(r["key"]), order=lambda r: r["key"])
        for dtype in args.cache_dtypes:
            for d in args.head_dims:
                for page_size in args.page_sizes:
                    if not needs_rating(records.get((d, page_size, dtype)), args.redo):
                        continue
                    print(f"{generation} d={d} page {page_size} {dtype} ({time.perf_counter() - start:.0f} s)",
                          flush=True)
                    try:
                        records.put(tune_entry(d, page_size, dtype, generation))
                    except RuntimeError as err:  # kept as a record (not retried); the table leaves it to the rule
                        print(f"  untuned: {err}", flush=True)
                        records.put(dict(key=[d, page_size, dtype], generation=generation, rated=today(),
                                         model_revision=pipeline.MODEL_REVISION, error=str(err)))
    write_table()
    print(f"wrote {TABLE}: MODELED choices, not TPU measurements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
