"""Fills flash attention's tuning table (`make tune-flash`), MODELED on this CPU machine.

Resumable: it skips the entries bench/results/flash_tuning_<generation>.json
already holds (`--redo` rates them again). Each entry compiles up to 6
fwd+bwd programs: about 10 to 20 minutes on 2 cores.

For each generation, head_dim (64, 128, 256, 512), GQA ratio (1, 4, 8) and
sequence length (2k, 8k, 32k) it rates a few block shapes with the bench's
model (flash_bench.measure: each candidate compiled by libtpu for that
generation, its own schedule, the grid walk of one causal sequence) on a
training step's attention (forward and backward, bf16, 8 KV heads), and
keeps the fastest that compiles. A candidate is given as (query rows, keys)
per block, rows being block_q tokens times G. On the kept blocks it then
rates libtpu's LP scheduler for the forward kernel (2 more compiles;
`LP_RATINGS`, `rate_scheduler`, `lp_choice`): on the bench's 8k shapes on
tpu7x it moved the forward by -10% to +11% (MODELED), so each entry
chooses. `--scheduler` rates it alone on the entries the results already
hold.

head_dim 128 is rated over every candidate at 2k and 32k; head_dim 64, 256 and 512 over the
`FOLLOW` best of head_dim 128's ranking at the same G and length (all of them
if none of those compiles, as at 512 where they mostly run out of VMEM): on v6e, where every head_dim was rated in full at
2k and 8k, head_dim 128's best was the best at 64 and 256 in all 12 pairs. It
saves about half of a generation's compiles. Likewise head_dim 128 at 8k rates
the FOLLOW best of its 2k entry (`reference_key`): in all 13 entries rated in
full at 8k (v5e, v6e, tpu7x) the best was among them; not so from 8k to 32k
(tpu7x: 2 of 3 were not), so 32k rates every candidate.

Evidence goes to bench/results/flash_tuning_<generation>.json, the table to
flash_attention/tuned_blocks.py (generated from those files; do not edit it). The
2k and 8k records that FOLLOW and FOLLOWED_TOKENS rest on (rated over every candidate,
before `--redo` rated v6e's and tpu7x's again over fewer) are kept in FOLLOW_EVIDENCE.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import harness  # sets up sys.path and the CPU / libtpu environment
import flash_bench  # noqa: E402

from flash_attention import kernel, tuning  # noqa: E402
from runtime.generations import GENERATIONS  # noqa: E402

HEAD_DIMS = tuning.TUNED_HEAD_DIMS
GROUPS = tuning.TUNED_GROUPS
# Head dims rated at some G only (others take a narrower entry, cut: tuning.choose_blocks):
# Gemma 4's global layers, the only 512-wide heads, have 8 query heads per KV head.
GROUPS_OF = {512: (8,)}
TOKENS = tuning.TUNED_TOKENS
KV_HEADS = 8
CANDIDATES = ((512, 512), (1024, 512), (1024, 1024), (2048, 512), (2048, 1024), (4096, 512))  # (rows, keys)
REFERENCE_HEAD_DIM = 128  # rated over every candidate, first
FOLLOW = 2  # the other head_dims rate this many of its best
FOLLOWED_TOKENS = {8192: 2048}  # head_dim 128 at 8k rates the FOLLOW best of its 2k entry
LP_MARGIN = 0.01  # see lp_choice
# (the pass a kernel's LP scheduler is rated on, the kernel): the forward, on a forward alone. The
# backward's kernels are left at the default: on tpu7x's 8k entries LP moved them by -3% to +9%,
# and not as it did for the entry's own shape on other shapes of its bucket (head_dim 256, G = 4:
# dq -1.0%, dkv -3.1%; Gemma-2-9B, G = 2 with a softcap: dq +7.5%, dkv +0.5%), where the
# forward's gain held (-9.7% and -8.2%). All MODELED.
LP_RATINGS = (("fwd", "fwd"),)
RESULTS = harness.BENCH / "results"
TABLE = harness.REPO / "flash_attention" / "tuned_blocks.py"
FOLLOW_EVIDENCE = RESULTS / "flash_tuning_evidence.json"  # see above; tests/test_flash_tuning.py reads it


def candidate_blocks(rows: int, keys: int, groups: int, tokens: int) -> kernel.BlockSizes | None:
    """The candidate as block sizes, or None where it is not a distinct choice at this length."""
    align = tuning.query_align(groups)
    block_q = max(align, rows // groups // align * align)
    if block_q > tokens or keys > tokens:
        return None
    return kernel.BlockSizes(block_q=block_q, block_k=keys)


def followed(reference: dict | None, groups: int) -> list[tuple[int, int]] | None:
    """The (rows, keys) of the reference entry's FOLLOW fastest candidates, or None (rate them all)."""
    if reference is None:
        return None
    ranked = sorted((c for c in reference["candidates"] if "modeled_us" in c), key=lambda c: c["modeled_us"])
    return [(c["blocks"][0] * groups, c["blocks"][1]) for c in ranked[:FOLLOW]] or None


def reference_key(head_dim: int, groups: int, tokens: int) -> tuple[int, int, int] | None:
    """The entry whose FOLLOW best candidates this one rates (see above), or None: all of them."""
    if head_dim != REFERENCE_HEAD_DIM:
        return REFERENCE_HEAD_DIM, groups, tokens
    return (head_dim, groups, FOLLOWED_TOKENS[tokens]) if tokens in FOLLOWED_TOKENS else None


def tune_entry(head_dim: int, groups: int, tokens: int, generation: str, reference: dict | None = None) -> dict:
    """reference: the record at `reference_key`, whose best candidates this entry rates first
    (`followed`)."""
    shape = rating_shape(head_dim, groups)
    rated = {}

    def rate(candidates):
        for rows, keys in candidates:
            blocks = candidate_blocks(rows, keys, groups, tokens)
            if blocks is None or (blocks.block_q, blocks.block_k) in rated:
                continue
            row = measure(shape, tokens, generation, blocks, "fwd+bwd")
            rated[(blocks.block_q, blocks.block_k)] = row
            print(f"  {blocks.block_q}x{blocks.block_k}: "
                  + (f"{row['modeled_us']:.1f} us" if "modeled_us" in row else row["error"]), flush=True)
        return {b: r for b, r in rated.items() if "modeled_us" in r}

    first = followed(reference, groups)
    ok = rate(first or CANDIDATES)
    if first and not ok:  # none of the reference's best fits here: rate the rest
        first, ok = None, rate(CANDIDATES)
    if not ok:
        raise RuntimeError(f"no candidate compiles for d={head_dim} G={groups} {tokens} tokens on {generation}")
    best = min(ok, key=lambda b: ok[b]["modeled_us"])
    record = dict(key=[head_dim, groups, tokens], generation=generation, best=[best[0] * groups, best[1]],
                  **({"rated": f"the {len(first)} best of {tuple(reference['key'])}"} if first else {}),
                  vmem_used=ok[best]["vmem_used"],
                  candidates=[dict(blocks=list(b), **{k: v for k, v in r.items() if k in (
                      "modeled_us", "compute_us", "dma_us", "around_us", "vmem_used", "error")})
                              for b, r in rated.items()])
    return dict(record, scheduler=rate_scheduler(record))


def rating_shape(head_dim: int, groups: int) -> flash_bench.AttentionShape:
    return flash_bench.AttentionShape(f"d{head_dim} G{groups}", KV_HEADS * groups, KV_HEADS, head_dim)


def measure(shape, tokens: int, generation: str, blocks: kernel.BlockSizes, pass_name: str) -> dict:
    """The bench's model of one causal sequence's attention with these blocks."""
    from flash_attention import ops
    import jax.numpy as jnp

    cu = jnp.asarray([0, tokens], jnp.int32)

    def attention(q, k, v, sinks):
        return ops.flash_attention_varlen(q[0], k[0], v[0], cu, cu, causal=True, blocks=blocks,
                                          generation=generation, interpret=False)[None]

    row = flash_bench.measure(flash_bench._program(attention, pass_name), shape, tokens, generation,
                              flash_bench.KERNEL_NAME)
    row.pop("costs", None)
    return row


def scheduler_rated(record: dict) -> bool:
    rated = record.get("scheduler", {})
    return all(name in rated.get(pass_name, {}) for pass_name, kernel_name in LP_RATINGS
               for name in ("default", kernel_name))


def rate_scheduler(record: dict) -> dict:
    """Rates libtpu's LP scheduler on the record's best blocks against the default one, a kernel
    at a time (LP_RATINGS), reusing the ratings the record has: {pass: {"default" or the
    kernel: modeled us, or the error}}."""
    (head_dim, groups, tokens), generation = record["key"], record["generation"]
    shape = rating_shape(head_dim, groups)
    base = candidate_blocks(*record["best"], groups, tokens)
    had, rated = record.get("scheduler", {}), {}
    for pass_name, kernel_name in LP_RATINGS:
        rates = rated.setdefault(pass_name, {})
        for name, lp_kernels in (("default", ()), (kernel_name, (kernel_name,))):
            if name in had.get(pass_name, {}):
                rates[name] = had[pass_name][name]
                continue
            row = measure(shape, tokens, generation, dataclasses.replace(base, lp_kernels=lp_kernels), pass_name)
            rates[name] = round(row["modeled_us"], 1) if "modeled_us" in row else row["error"]
            print(f"  {pass_name}, LP on {kernel_name if lp_kernels else 'none'}: {rates[name]}", flush=True)
    return rated


def lp_choice(scheduler: dict) -> tuple[str, ...]:
    """The kernels whose LP scheduler rating is at least LP_MARGIN faster than the default's
    (which every other kernel is compiled with); one that did not compile is not taken."""
    def faster(rates, kernel_name):
        lp, default = rates[kernel_name], rates["default"]
        return isinstance(lp, float) and isinstance(default, float) and lp < (1 - LP_MARGIN) * default
    return tuple(kernel_name for pass_name, kernel_name in LP_RATINGS if faster(scheduler[pass_name], kernel_name))


def table_value(record: dict) -> tuple:
    """(rows, keys), then the kernels to compile with the LP scheduler where it was rated."""
    return tuple(record["best"]) + ((lp_choice(record["scheduler"]),) if scheduler_rated(record) else ())


def results_file(generation: str):
    return RESULTS / f"flash_tuning_{generation}.json"


def write_table() -> None:
    """Regenerates tuned_blocks.py from every flash_tuning_<generation>.json."""
    lines = [
        '"""Tuned block sizes for flash attention, per TPU generation: GENERATED by `make tune-flash`',
        "(bench/flash_tune.py) from bench/results/flash_tuning_<generation>.json. Do not edit by hand.",
        "",
        "Key: (head_dim, G, tokens), as `tuning.table_key` buckets a call; value: (query rows, keys) per",
        "block, rows being block_q tokens times G. Each entry is the candidate with the lowest MODELED",
        "forward-and-backward time of one causal sequence there, compiled by libtpu for its generation",
        "(VMEM used in the comment); then, where rated, the kernels that compile with libtpu's LP",
        "scheduler (kernel.BlockSizes.lp_kernels).",
        '"""',
        "",
        "TUNED = {",
    ]
    for generation in GENERATIONS:
        path = results_file(generation)
        if not path.exists():
            continue
        lines.append(f"    {generation!r}: {{")
        for record in json.loads(path.read_text()):
            lines.append(f"        {tuple(record['key'])}: {table_value(record)},  # {record['vmem_used'] / 2**20:.1f} MiB")
        lines.append("    },")
    lines.append("}")
    harness.write_atomically(TABLE, "\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generations", nargs="*", default=list(GENERATIONS), choices=list(GENERATIONS))
    parser.add_argument("--head-dims", nargs="*", type=int, default=list(HEAD_DIMS))
    parser.add_argument("--groups", nargs="*", type=int, default=list(GROUPS))
    parser.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    parser.add_argument("--write-table", action="store_true", help="only regenerate tuned_blocks.py")
    parser.add_argument("--redo", action="store_true", help="rate again the entries the results already hold")
    parser.add_argument("--scheduler", action="store_true",
                        help="rate the LP scheduler on the entries the results hold without it (their blocks kept)")
    args = parser.parse_args(argv)
    sys.argv = sys.argv[:1]
    start = time.perf_counter()
    for generation in [] if args.write_table else args.generations:
        records = harness.Results(results_file(generation), key=lambda r: tuple(r["key"]), order=lambda r: r["key"])
        head_dims = sorted(args.head_dims, key=lambda d: d != REFERENCE_HEAD_DIM)  # the reference first
        for t in args.tokens:
            for g in args.groups:
                for d in head_dims:
                    if g not in GROUPS_OF.get(d, (g,)):
                        continue
                    record = records.get((d, g, t))
                    if record and not args.redo:
                        if scheduler_rated(record) or not args.scheduler:
                            continue
                        print(f"{generation} d={d} G={g} {t} tokens: the scheduler", flush=True)
                        record["scheduler"] = rate_scheduler(record)
                    else:
                        print(f"{generation} d={d} G={g} {t} tokens ({time.perf_counter() - start:.0f} s)", flush=True)
                        record = tune_entry(d, g, t, generation, records.get(reference_key(d, g, t)))
                    records.put(record)
    write_table()
    print(f"wrote {TABLE}: MODELED choices, not TPU measurements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
