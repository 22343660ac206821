"""Benchmarks paged attention (`make bench-paged`), modeled on this CPU machine.

For each attention shape, serving batch (decode-only, or decode mixed with
chunked prefill), TPU generation and cache dtype (bf16, fp8), it reports
for our kernel:

- whether libtpu compiles it for that generation, and its VMEM;
- the HBM bytes its grid moves (block-spec'd operands from the grid walk,
  bench/grid_walk.py; the page copies the kernel starts itself in its own
  loops, counted by running its control on the batch,
  bench/kernel_profile.py) against the K and V the sequences actually hold
  plus q and out;
- a modeled time read from the compiled kernel's own schedule and those
  bytes, combined as the pipeline runs them (bench/pipeline.py), plus the
  XLA ops around it (the step list, the layout changes);
- the same for the anchors: transformers' own path (the context gathered
  out of the pages, then flash-attn-tpu's varlen kernel); jax's
  paged_attention (decode); jax's ragged_paged_attention and tpu-inference's
  ragged paged attention v3, whose loops and copies are counted by running
  their control on the batch (bench/kernel_profile.py).

These are MODELED figures, not TPU measurements. Writes
bench/results/paged_attention.md and .json.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import harness  # sets up sys.path and the CPU / libtpu environment
from harness import BENCH  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from flash_bench import AttentionShape  # noqa: E402  (options: ragged_paged_attention's keywords here)
import charts  # noqa: E402
from runtime.generations import GENERATIONS  # noqa: E402

KERNEL_NAME = "ragged_paged_attention"
TRANSFORMERS = "transformers (gather + flash)"


SHAPES = [
    AttentionShape("Llama-3-8B", 32, 8, 128),
    AttentionShape("Qwen3-32B", 64, 8, 128),
    AttentionShape("gpt-oss-20b (sliding layer)", 64, 8, 64, (("sliding_window", 128), ("sinks", True))),
]


@dataclasses.dataclass(frozen=True)
class Batch:
    """A serving step: `decodes` sequences with one new token each and `prefills` sequences with a
    chunk of `prefill_chunk` new tokens, each with a context (its tokens, the new ones included)
    drawn evenly from [context / 2, context]."""
    name: str
    decodes: int
    prefills: int
    prefill_chunk: int
    context: int
    page_size: int = 16

    @property
    def seqs(self) -> int:
        return self.decodes + self.prefills

    @property
    def tokens(self) -> int:
        return self.decodes + self.prefills * self.prefill_chunk

    def routing(self) -> dict:
        """Concrete index arrays, as an engine passes them: decodes first, pages shuffled over a
        pool just large enough."""
        rng = np.random.default_rng(0)
        q_lens = np.array([1] * self.decodes + [self.prefill_chunk] * self.prefills, np.int32)
        kv_lens = rng.integers(self.context // 2, self.context + 1, self.seqs).astype(np.int32)
        kv_lens = np.maximum(kv_lens, q_lens)
        pages_per_seq = -(-self.context // self.page_size)
        num_pages = self.seqs * pages_per_seq
        page_indices = rng.permutation(num_pages).astype(np.int32).reshape(self.seqs, pages_per_seq)
        return dict(kv_lens=kv_lens, page_indices=page_indices,
                    cu_q_lens=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                    num_seqs=np.int32(self.seqs), num_pages=num_pages)


BATCHES = [
    Batch("decode 64 x 8k", 64, 0, 0, 8192),
    Batch("decode 256 x 2k", 256, 0, 0, 2048),
    Batch("mixed 256 dec + 3 x 256 pre, 4k", 256, 3, 256, 4096),
]
BENCH_GENERATIONS = ("v6e", "tpu7x")


def cache_specs(shape: AttentionShape, routing: dict, batch: Batch, dtype, cache_layout="token_major") -> list[tuple]:
    """K's and V's cache (shape, dtype, layout) as an engine holds them: in the layout our kernels
    read in place (under 128 lanes, libtpu's default layout would cost a whole copy per call),
    its dims ordered as `cache_layout` says (`ops.CACHE_LAYOUTS`)."""
    from paged_attention.ops import cache_major_to_minor, cache_shape

    dims = cache_shape(routing["num_pages"], batch.page_size, shape.kv_heads, shape.head_dim, cache_layout)
    return [(dims, dtype, cache_major_to_minor(shape.kv_heads, cache_layout))] * 2


def held_bytes(shape: AttentionShape, batch: Batch, routing: dict, cache_itemsize: int) -> dict:
    """What the step must move at least: the K and V the sequences hold (a sliding window's
    keys only), and q and out in bf16."""
    window = shape.kwargs.get("sliding_window")
    kv_lens = routing["kv_lens"].astype(np.int64)
    if window:
        q_lens = np.diff(routing["cu_q_lens"]).astype(np.int64)
        kv_lens = np.minimum(kv_lens, window + q_lens - 1)
    kv = int(kv_lens.sum()) * shape.kv_heads * shape.head_dim * 2 * cache_itemsize
    q_out = 2 * batch.tokens * shape.q_heads * shape.head_dim * 2
    return dict(kv=kv, q_out=q_out)


def ours(shape: AttentionShape, routing: dict, generation: str, cache_dtype, blocks=None, cache_layout="token_major"):
    """fn(q, k_cache, v_cache, sinks, kv_lens, page_indices, cu_q_lens, num_seqs) of our kernel."""
    from paged_attention import ops

    options = shape.kwargs
    has_sinks = options.pop("sinks", False)
    quantized = jnp.dtype(cache_dtype).itemsize == 1

    def fn(q, k_cache, v_cache, sinks, kv_lens, page_indices, cu_q_lens, num_seqs):
        return ops.ragged_paged_attention(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                                          sinks=sinks if has_sinks else None, k_scale=0.5 if quantized else None,
                                          v_scale=0.5 if quantized else None, blocks=blocks, generation=generation,
                                          cache_layout=cache_layout, interpret=False, **options)

    return fn


def our_inputs(shape: AttentionShape, batch: Batch, cache_dtype, cache_layout="token_major"):
    """(routing, data, index) of our kernel on the batch (`ours`' arguments): data the arrays'
    (shape, dtype[, layout]), index the index arrays."""
    routing = batch.routing()
    data = [((batch.tokens, shape.q_heads, shape.head_dim), jnp.bfloat16),
            *cache_specs(shape, routing, batch, cache_dtype, cache_layout), ((shape.q_heads,), jnp.float32)]
    return routing, data, [routing[k] for k in ("kv_lens", "page_indices", "cu_q_lens", "num_seqs")]


def measure(shape: AttentionShape, batch: Batch, generation: str, cache_dtype=jnp.bfloat16, blocks=None,
            cache_layout="token_major") -> dict:
    """Our kernels' compile, bytes and modeled time on one batch (blocks None: the default path,
    decode sequences and the others in kernels of their own). A step copies and waits for its
    chunk's pages in loops whose trips are the pages it needs: counted as they run, as the anchors'
    (`measure_profiled`)."""
    routing, data, index = our_inputs(shape, batch, cache_dtype, cache_layout)
    fn = ours(shape, routing, generation, cache_dtype, blocks, cache_layout)
    def tiling(eqn, cost):
        blocks = _blocks_of(eqn, shape)
        return f"{cost.name.removeprefix(KERNEL_NAME).strip('_') or 'all'} {blocks.block_q}q x {blocks.pages_per_block}p"

    return measure_profiled(fn, data, index, profile_args(data, index, (1, 2), routing), shape, batch, routing,
                            generation, KERNEL_NAME, kv_itemsize=jnp.dtype(cache_dtype).itemsize, describe=tiling)


def figures(m: "harness.Measurement", held: dict) -> dict:
    """A row's figures: the measurement's, and its kernels' HBM bytes against what the sequences hold."""
    figures = m.figures()
    return dict(figures, kv_held_bytes=held["kv"], hbm_vs_held=figures["hbm_bytes"] / (held["kv"] + held["q_out"]),
                floor_us=(held["kv"] + held["q_out"]) / GENERATIONS[m.generation].hbm_bytes_per_s * 1e6)


def context_rows(shape: AttentionShape, batch: Batch, routing: dict) -> np.ndarray:
    """The cache rows transformers' path gathers: each sequence's context in order (under a
    window, only the keys its new tokens can see), as rows of the cache seen as [pages x
    page_size, Hkv, D]."""
    window = shape.kwargs.get("sliding_window")
    q_lens = np.diff(routing["cu_q_lens"])
    rows = []
    for s, kv_len in enumerate(routing["kv_lens"]):
        first = max(0, kv_len - (window + q_lens[s] - 1)) if window else 0
        positions = np.arange(first, kv_len)
        rows.append(routing["page_indices"][s, positions // batch.page_size] * batch.page_size
                    + positions % batch.page_size)
    return np.concatenate(rows).astype(np.int32)


def measure_transformers_path(shape: AttentionShape, batch: Batch, generation: str) -> dict:
    """The anchor: transformers 5.22's continuous batching off CUDA. It gathers every sequence's
    context out of the paged cache (`index_select`), then calls a varlen flash attention: ours,
    flash-attn-tpu, the one TPU varlen kernel on the Hub, with its tuned blocks. Its cache is in
    the model's dtype (bf16), so there is no fp8 row. (Its cache write is left out, as ours is.)"""
    from flash_attention import ops as flash_ops

    routing = batch.routing()
    rows = context_rows(shape, batch, routing)
    q_lens = np.diff(routing["cu_q_lens"])
    kept = np.minimum(routing["kv_lens"], shape.kwargs["sliding_window"] + q_lens - 1) \
        if "sliding_window" in shape.kwargs else routing["kv_lens"]
    cu_k = np.concatenate([[0], np.cumsum(kept)]).astype(np.int32)
    options = shape.kwargs
    window = options.pop("sliding_window", None)
    has_sinks = options.pop("sinks", False)

    def fn(q, k_cache, v_cache, sinks, rows, cu_q, cu_k):
        gather = lambda c: jnp.take(c.reshape(-1, shape.kv_heads, shape.head_dim), rows, axis=0)
        return flash_ops.flash_attention_varlen(
            q, gather(k_cache), gather(v_cache), cu_q, cu_k, causal=True,
            window_size=(window - 1, window - 1) if window else (-1, -1), sinks=sinks if has_sinks else None,
            generation=generation, interpret=False, **options)

    # The cache in libtpu's default layout, as transformers' cache is held: its gather needs no other
    # (and libtpu 0.0.52 fails to compile it from a row-major one at head_dim 64).
    cache = ((routing["num_pages"], batch.page_size, shape.kv_heads, shape.head_dim), jnp.bfloat16)
    data = [((batch.tokens, shape.q_heads, shape.head_dim), jnp.bfloat16), cache, cache,
            ((shape.q_heads,), jnp.float32)]
    index = [rows, routing["cu_q_lens"], cu_k]
    try:
        m = harness.measure(fn, arguments(data, index), generation, "flash_attention")
    except Exception as err:  # noqa: BLE001  (a row says what failed)
        return harness.error_row(err)
    return dict(figures(m, held_bytes(shape, batch, routing, 2)), tiling="gather + flash-attn-tpu")


JAX_PAGED = "jax paged_attention"


def _jax_paged_prefetches(cost, schedule) -> dict:
    """Which `pl.when` bodies nested in jax paged_attention's block body run: of its two largest,
    the same page copies started, the first (the first block's) at the first step that attends,
    the second (the next block's) at every step that attends but the last; the small ones (its
    accumulators' init, the next block's index search) never, which flatters it slightly."""
    attends = np.flatnonzero(cost.when_runs[:, 0])
    children = schedule.regions[0].children
    first, next_block = sorted(np.argsort(children)[-2:])
    runs = np.zeros((cost.grid_steps, len(children)), bool)
    runs[attends[:1], first] = True
    runs[attends[:-1], next_block] = True
    return {0: runs}
JAX_PAGES_PER_BLOCK = (8, 16, 32, 64, 128)  # its tilings: pages per compute block (16-token pages: 128 to 2k keys)


def measure_jax_paged_attention(shape: AttentionShape, batch: Batch, generation: str) -> dict:
    """The decode anchor: jax's `paged_attention` (jax.experimental.pallas.ops.tpu, this jax's),
    bf16 cache in its own layout [Hkv, pages, page_size, D], at its fastest pages per compute
    block. It has no sliding window, sinks or prefill. Its grid-step variant is modeled
    (`inline_seq_dim=False`: a step per block of pages; the default runs a step's blocks in a loop
    whose trips the schedule cannot count). Each step that attends copies its block's pages of one
    KV head, K and V, the step before it starts them (`_jax_paged_prefetches`)."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
    from paged_attention import kernel

    if batch.prefills or set(shape.kwargs) - {"softcap"}:
        return dict(error="n/a: decode only, no sliding window or sinks")
    routing = batch.routing()
    head_page_bytes = 2 * kernel.page_bytes(batch.page_size, 1, shape.head_dim, jnp.bfloat16)  # K and V
    cache = ((shape.kv_heads, routing["num_pages"], batch.page_size, shape.head_dim), jnp.bfloat16)
    data = [((batch.seqs, shape.q_heads, shape.head_dim), jnp.bfloat16), cache, cache]
    index = [routing["kv_lens"], routing["page_indices"]]
    rows, failures = [], []
    for ppcb in (p for p in JAX_PAGES_PER_BLOCK if routing["page_indices"].shape[1] % p == 0):
        fn = lambda q, k, v, lengths, pages, ppcb=ppcb: paged_attention(
            q, k, v, lengths, pages, pages_per_compute_block=ppcb, inline_seq_dim=False,
            attn_logits_soft_cap=shape.kwargs.get("softcap"))
        try:
            args = arguments(data, index)
            costs, copies = harness.walk(fn, args, generation)
            attends = costs[0].when_runs[:, 0]  # its block body: the step's block holds keys
            pages = np.where(attends, ppcb * head_page_bytes, 0).astype(np.int64)
            costs[0].fetch_bytes = costs[0].fetch_bytes + pages
            costs[0].hbm_bytes += int(pages.sum())
            m = harness.measure(fn, args, generation, "paged_attention", costs=costs, copies=copies,
                                child_runs=_jax_paged_prefetches)
        except Exception as err:  # noqa: BLE001  (a tiling that fails is skipped; none left: the row says why)
            failures.append(harness.error_row(err))
            continue
        rows.append(dict(figures(m, held_bytes(shape, batch, routing, 2)), tiling=f"{ppcb} pages per block"))
    return min(rows, key=lambda r: r["modeled_us"]) if rows else failures[0]


JAX_RPA = "jax ragged_paged_attention"
TPU_INFERENCE = "tpu-inference RPA v3"
# A profile's cache (bench/kernel_profile.py): these kernels' control never reads a page index's
# value, only their copies do, and a profile leaves those out; so a small pool stands in for the
# batch's (indices wrapped into it) and the profile does not hold the batch's whole cache.
PROFILE_PAGES = 64
JAX_RPA_QUERIES = (8, 16, 32, 64, 128)  # its tilings: query tokens per block, then pages per block
JAX_RPA_PAGES = (8, 16, 32, 64)


def measure_profiled(fn, data: list, index: list, profile_args: list, shape: AttentionShape, batch: Batch,
                     routing: dict, generation: str, kernel_name: str, kv_itemsize: int = 2, describe=None,
                     **compile_options) -> dict:
    """A kernel whose loops run as its data says (bench/kernel_profile.py): its compile, its
    schedule's loops and branches counted as they ran on this batch, the bytes its copies moved
    (its own DMAs' sizes, as they ran), combined by the schedule model (bench/harness.py). data:
    (shape, dtype) of its array operands, index: its index arrays (concrete), following them; profile_args: all
    its arguments for the profile (concrete: zeros, caches of PROFILE_PAGES pages and the page
    indices wrapped into them). kv_itemsize: the cache's bytes per element. describe(eqn, cost):
    a kernel's tiling, for the row. compile_options: `harness.compile`'s (a cache donated
    and returned in place)."""
    try:
        m, own, calls = harness.measure_profiled(
            fn, arguments(data, index), profile_args, generation, kernel_name,
            layouts={i: spec[2] for i, spec in enumerate(data) if len(spec) > 2}, compile_options=compile_options)
    except Exception as err:  # noqa: BLE001  (a row says what failed)
        return harness.error_row(err)
    row = dict(figures(m, held_bytes(shape, batch, routing, kv_itemsize)), page_copy_bytes=sum(own))
    if describe is not None:
        row["tiling"] = " + ".join(describe(eqn, cost) for eqn, cost in zip(calls, m.costs))
    return row


def arguments(data: list, index: list) -> list:
    """A program's arguments: its arrays abstract (data: (shape, dtype[, layout])), its index arrays
    concrete (what its grid and loops read)."""
    return [jax.ShapeDtypeStruct(*spec[:2]) for spec in data] + [jnp.asarray(a) for a in index]


def profile_args(data: list, index: list, caches: tuple[int, ...], routing: dict) -> list:
    """Concrete arguments for a profile: zeros for the arrays, the caches (at positions `caches`)
    PROFILE_PAGES pages long, the page indices (`routing`'s, wherever they are) wrapped into them."""
    arrays = [jnp.zeros((PROFILE_PAGES, *spec[0][1:]) if i in caches else spec[0], spec[1])
              for i, spec in enumerate(data)]
    pages = routing["page_indices"]
    wrapped = [a % PROFILE_PAGES if a is pages or (a.size == pages.size and np.array_equal(a.ravel(), pages.ravel()))
               else a for a in index]
    return arrays + [jnp.asarray(a) for a in wrapped]


def measure_jax_ragged_paged_attention(shape: AttentionShape, batch: Batch, generation: str) -> dict:
    """jax's `ragged_paged_attention` (jax.experimental.pallas.ops.tpu, this jax's): bf16 cache in its
    own layout (K and V interleaved, [pages, page_size, 2 Hkv, D]), at its fastest query tokens per
    block (16 pages per block), then pages per block (at that): its tilings are searched one axis
    at a time. It has no sinks."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    options = dict(shape.kwargs)
    if options.pop("sinks", False):
        return dict(error="n/a: no sinks")
    routing = batch.routing()
    cache = lambda pages: (pages, batch.page_size, 2 * shape.kv_heads, shape.head_dim)
    q = (batch.tokens, shape.q_heads, shape.head_dim)
    data = [(q, jnp.bfloat16), (cache(routing["num_pages"]), jnp.bfloat16)]
    index = [routing["kv_lens"], routing["page_indices"], routing["cu_q_lens"], np.array([batch.seqs], np.int32)]

    def at(queries, pages):
        def fn(q, kv, kv_lens, page_indices, cu_q_lens, num_seqs):
            return ragged_paged_attention(q, kv, kv_lens, page_indices, cu_q_lens, num_seqs,
                                          sm_scale=shape.head_dim ** -0.5, soft_cap=options.get("softcap"),
                                          sliding_window=options.get("sliding_window"),
                                          num_kv_pages_per_block=pages, num_queries_per_block=queries)
        return dict(measure_profiled(fn, data, index, profile_args(data, index, (1,), routing), shape, batch,
                                     routing, generation, "ragged_paged_attention_kernel"),
                    tiling=f"{queries} tokens x {pages} pages per block")

    rows = []
    for queries in (q for q in JAX_RPA_QUERIES if q <= max(8, batch.tokens)):
        rows.append(at(queries, 16))
    best = min((r for r in rows if "error" not in r), key=lambda r: r["modeled_us"], default=None)
    if best is None:
        return rows[0]
    queries = int(best["tiling"].split()[0])
    rows += [at(queries, pages) for pages in JAX_RPA_PAGES if pages != 16]
    return min((r for r in rows if "error" not in r), key=lambda r: r["modeled_us"])


def measure_tpu_inference(shape: AttentionShape, batch: Batch, generation: str) -> dict:
    """tpu-inference's ragged paged attention v3 (vLLM's TPU kernel, tpu-inference 0.32.0): bf16
    cache in its own layout (K and V packed, get_kv_cache_shape), its own tuned blocks for the
    generation (its tables, as vLLM runs it), its cache update off (ours is a separate kernel, left
    out of the bench). head_dim 64 takes its variant for it (kernel_hd64, which has sinks); the
    other has no sinks."""
    import tpu_inference_kernels

    if not tpu_inference_kernels.installed():
        return dict(error="n/a: tpu-inference is not installed (make .venv/.installed-bench)")
    options = dict(shape.kwargs)
    sinks = options.pop("sinks", False)
    hd64 = shape.head_dim == 64
    if sinks and not hd64:
        return dict(error="n/a: sinks only at head_dim 64")
    rpa = tpu_inference_kernels.module("kernels.ragged_paged_attention.v3." + ("kernel_hd64" if hd64 else "kernel"),
                                       generation)
    routing = batch.routing()
    cache = lambda pages: rpa.get_kv_cache_shape(pages, batch.page_size, shape.kv_heads, shape.head_dim, jnp.bfloat16)
    new = (batch.tokens, shape.kv_heads, shape.head_dim)
    # Its cache held row-major, the layout it reads in place, and donated, as vLLM does: it returns
    # the cache (updated in place when it writes it), and either default would cost a whole copy.
    row_major = tuple(range(len(cache(1))))
    data = [((batch.tokens, shape.q_heads, shape.head_dim), jnp.bfloat16), (new, jnp.bfloat16), (new, jnp.bfloat16),
            (cache(routing["num_pages"]), jnp.bfloat16, row_major)] + [((shape.q_heads,), jnp.float32)] * hd64
    # Sequences in its order (decodes, prefills with no context, the rest), as its distribution says.
    index = [routing["kv_lens"], routing["page_indices"].reshape(-1), routing["cu_q_lens"],
             np.array([batch.decodes, batch.decodes, batch.seqs], np.int32)]
    common = dict(sm_scale=shape.head_dim ** -0.5, sliding_window=options.get("sliding_window"),
                  soft_cap=options.get("softcap"), vmem_limit_bytes=GENERATIONS[generation].vmem_bytes)

    if hd64:
        def fn(q, k, v, kv_cache, sink, kv_lens, page_indices, cu_q_lens, distribution):
            return rpa.ragged_paged_attention_hd64(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                                                   sink if sinks else None, **common)
    else:
        def fn(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution):
            return rpa.ragged_paged_attention(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                                              update_kv_cache=False, **common)

    return dict(measure_profiled(fn, data, index, profile_args(data, index, (3,), routing), shape, batch, routing,
                                 generation, "RPA", donate_argnums=(3,), out_layouts=(None, row_major)),
                tiling="its tuned blocks")



ANCHORS = {TRANSFORMERS: measure_transformers_path, JAX_PAGED: measure_jax_paged_attention,
           JAX_RPA: measure_jax_ragged_paged_attention, TPU_INFERENCE: measure_tpu_inference}

def _blocks_of(eqn, shape: AttentionShape):
    """A kernel's BlockSizes, read from its pallas_call: query rows per block over G, pages per chunk."""
    from paged_attention.kernel import BlockSizes

    mappings = eqn.params["grid_mapping"].block_mappings
    rows = mappings[2].block_shape[1].block_size  # q's block
    pages_per_block = mappings[0].block_shape[-1].block_size  # the page-table chunk
    return BlockSizes(rows // (shape.q_heads // shape.kv_heads), pages_per_block)


def eqn_name(eqn) -> str:
    return eqn.params.get("name") or str(eqn.params.get("metadata", ""))


DECODE_BYTES_GOAL = 1.05  # HBM bytes over the K/V held plus q and out, on decode batches
EIGHT_BIT_DECODE_GOAL = 0.6  # an 8-bit cache's decode time over bf16's, same layout and batch


OURS = {"token_major": "ours", "head_major": "ours head-major"}  # our rows' impl, by cache layout


def goal_lines(rows: list[dict]) -> list[str]:
    """The goals: decode's HBM bytes against what the sequences hold, an fp8 cache's page copies
    against a bf16 one's on the same batch, 8-bit caches' decode time against bf16's, and each of
    our layouts (bf16) against each anchor."""
    ok = [r for r in rows if "error" not in r and r["impl"] in OURS.values()]
    decode = [r for r in ok if r["batch"].startswith("decode")]
    lines = ["## Goals", ""]
    if decode:
        worst = max(decode, key=lambda r: r["hbm_vs_held"])
        verdict = "met" if worst["hbm_vs_held"] <= DECODE_BYTES_GOAL else "NOT met"
        lines.append(f"- Decode HBM bytes at most {DECODE_BYTES_GOAL}x held: {verdict} (worst {worst['hbm_vs_held']:.3f}, "
                     f"{worst['model']}, {worst['batch']}, {worst['generation']}, {worst['cache']}, {worst['impl']}).")
    key = lambda r: (r["model"], r["batch"], r["generation"])
    bf16 = {(r["impl"], *key(r)): r for r in ok if r["cache"] == "bfloat16"}
    ratios = [r["page_copy_bytes"] / bf16[(r["impl"], *key(r))]["page_copy_bytes"] for r in ok
              if r["cache"] == "float8_e4m3fn" and (r["impl"], *key(r)) in bf16]
    if ratios:
        lines.append(f"- fp8 cache's page copies against bf16's on the same batch: {min(ratios):.3f} to {max(ratios):.3f}x.")
    for cache in ("float8_e4m3fn", "int8"):
        versus = sorted((r["modeled_us"] / bf16[(r["impl"], *key(r))]["modeled_us"], r["impl"], *key(r)) for r in decode
                        if r["cache"] == cache and (r["impl"], *key(r)) in bf16)
        if versus:
            missed = [f"{', '.join(where)} ({v:.2f}x)" for v, *where in versus[::-1] if v > EIGHT_BIT_DECODE_GOAL]
            lines.append(f"- {cache} cache's decode at most {EIGHT_BIT_DECODE_GOAL}x bf16's modeled time (same layout): "
                         f"{versus[0][0]:.2f} to {versus[-1][0]:.2f}x, " + ("met." if not missed else
                         f"NOT met on {len(missed)} of {len(versus)}: " + "; ".join(missed) + "."))
    best = {}
    for impl in ANCHORS:
        for r in rows:
            if r["impl"] == impl and "error" not in r:
                best[key(r)] = min(best.get(key(r), math.inf), r["modeled_us"])
    for layout, name in OURS.items():
        mine = {key(r): r for (impl, *_), r in bf16.items() if impl == name}
        label = "Ours (bf16)" if layout == "token_major" else f"Ours, {layout.replace('_', '-')} cache (bf16)"
        for impl in ANCHORS:
            anchor = {key(r): r for r in rows if r["impl"] == impl and "error" not in r}
            versus = [(mine[k]["modeled_us"] / a["modeled_us"], k) for k, a in anchor.items() if k in mine]
            if versus:
                worst, where = max(versus)
                slower = sum(v > 1 for v, _ in versus)
                lines.append(f"- {label} against {impl}: {min(versus)[0]:.2f} to {worst:.2f}x its modeled time ("
                             + ("never slower" if not slower else
                                f"slower on {slower} of {len(versus)} shapes, most on {', '.join(where)}") + ").")
        versus = [(mine[k]["modeled_us"] / t, k) for k, t in best.items() if k in mine]
        if versus:
            slower = [", ".join(k) + f" ({v:.2f}x)" for v, k in sorted(versus, reverse=True) if v > 1]
            lines.append(f"- {label} no slower than the best anchor on every shape: "
                         + ("met." if not slower else "NOT met: slower on " + "; ".join(slower) + "."))
    return lines


def write_markdown(rows: list[dict], path: Path) -> None:
    lines = [
        "# paged_attention: modeled performance (NOT measured on a TPU)",
        "",
        "Modeled time is read from our compiled kernels (bench/pipeline.py): libtpu's final bundles give",
        "each grid step's issue cycles, its loops counted as they run on the batch (bench/kernel_profile.py,",
        "below); the bytes each step waits for are its block-spec'd operands (grid walk) and the pages it",
        "copies itself (as that run counts them). `floor`: the K/V the sequences hold plus q",
        "and out, at full HBM bandwidth; `HBM / held`: bytes moved over those (kernels only; XLA's ops are",
        "in `around`). 16-token pages; q in bf16. `ours`: caches in vLLM's token-major layout [pages,",
        "page_size, Hkv, D]; `ours head-major`: the same kernel over [pages, Hkv, page_size, D] caches",
        "(`cache_layout=\"head_major\"`). The anchors: transformers' continuous batching off CUDA,",
        "which gathers each sequence's context out of the pages, then runs a varlen flash attention (ours,",
        "flash-attn-tpu, with its tuned blocks); jax's paged_attention on decode batches (its own cache",
        "layout, its fastest pages per block, its prefetch bodies counted as they run, the small ones as",
        "never: a lower bound); jax's ragged_paged_attention (its fastest tiling) and tpu-inference's",
        "ragged paged attention v3 (vLLM's TPU kernel, its own tuned blocks), whose loops run as their",
        "data says: each is run on the batch in Pallas's TPU interpreter, its control alone",
        "(bench/kernel_profile.py), to count how often each compiled loop and branch runs and the bytes",
        "its copies move; those copies are taken to overlap its compute entirely (a lower bound).",
        "Where a goal is NOT met, paged_attention/CARD.md (Not yet) says why.",
        "",
        *goal_lines(rows),
        "",
        "## Every row",
        "",
        "| model | batch | gen | impl | cache | blocks | VMEM MiB | grid steps | HBM / held | compute us | DMA us "
        "| around us | modeled us | floor us |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r['generation']} | {r['impl']} | {r['cache']} | {r['error']} |"
                         + " |" * 8)
            continue
        lines.append(f"| {r['model']} | {r['batch']} | {r['generation']} | {r['impl']} | {r['cache']} | {r['tiling']} "
                     f"| {r['vmem_used'] / 2**20:.1f} "
                     f"| {r['grid_steps']} | {r['hbm_vs_held']:.3f} | {r['compute_us']:.0f} | {r['dma_us']:.0f} "
                     f"| {r['around_us']:.0f} | {r['modeled_us']:.0f} | {r['floor_us']:.0f} |")
    harness.write_atomically(path, "\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=[s.model for s in SHAPES])
    parser.add_argument("--batches", nargs="*", default=[b.name for b in BATCHES])
    parser.add_argument("--generations", nargs="*", default=list(BENCH_GENERATIONS), choices=list(GENERATIONS))
    parser.add_argument("--caches", nargs="*", default=["bfloat16", "float8_e4m3fn"], help="our cache dtypes")
    parser.add_argument("--layouts", nargs="*", default=list(OURS), choices=list(OURS), help="our cache layouts")
    parser.add_argument("--no-anchors", dest="anchors", action="store_const", const=[], default=list(ANCHORS),
                        help="our kernels only")
    parser.add_argument("--anchors", nargs="*", choices=list(ANCHORS), help="only these anchors")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = harness.Results(args.out / "paged_attention.json",
                              key=lambda r: (r["model"], r["batch"], r["generation"], r["cache"], r["impl"]))
    for shape in (s for s in SHAPES if s.model in args.models):
        for batch in (b for b in BATCHES if b.name in args.batches):
            for generation in args.generations:
                anchors = [(impl, "bfloat16") for impl in args.anchors]
                for impl, cache in [(OURS[l], c) for l in args.layouts for c in args.caches] + anchors:
                    layout = next((l for l, name in OURS.items() if name == impl), None)
                    figures = (ANCHORS[impl](shape, batch, generation) if layout is None
                               else measure(shape, batch, generation, jnp.dtype(cache), cache_layout=layout))
                    row = dict(model=shape.model, batch=batch.name, generation=generation, cache=cache, impl=impl,
                               **figures)
                    print(f"[{time.perf_counter() - start:.0f} s] {shape.model} {batch.name} {generation} {impl} "
                          f"{cache}: {row.get('modeled_us', row.get('error'))}", flush=True)
                    results.put(row)
                    write_markdown(results.rows, args.out / "paged_attention.md")
    charts.write("paged_attention", results.rows, args.out)
    print(f"wrote {args.out / 'paged_attention.md'} and a chart per generation: MODELED figures, not TPU measurements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
