"""paged_attention compiled by libtpu (Mosaic and XLA:TPU, ahead of time) for each TPU
generation, within each chip's VMEM: a serving step of 1024 new tokens over 256 sequences with
room for 32k tokens of context each, and the cache write, in place."""

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import pytest
import tpu_compile

from paged_attention import ops, tuning
from paged_attention._shared.generations import GENERATIONS
from paged_attention.kernel import PAGES_PER_TRIP, BlockSizes
import sampling  # noqa: E402

SERVING = tuning.SERVING_LIMITS
POOL_BYTES = 2 << 30
COPY_BUNDLES_PER_PAGE = 9  # its K and V copies' issue and address arithmetic, on every generation

# (generation, Hq, Hkv, D, page size, cache dtype, options): `make test` compiles v6e's and v5p's (a
# megacore) prefill at head_dim 128, v6e's default path at head_dim 512, v5e's head_dim 64, tpu7x's
# head-major pages and its one-KV-head fp8 prefill, with 16-token pages; `make check-compile`
# (CHECK_ALL_COMPILES=1) every generation, each cache dtype, page size and head dim. Every case compiles the default path's two kernels
# (decode and prefill blocks) but those marked prefill_only: the two differ only in block rows, and
# each compile costs about 25 s.
SAMPLE = [(g, 32, 8, 128, 16, jnp.bfloat16, dict(prefill_only=True)) for g in ("v5p", "v6e")]
# v5e at head_dim 64 (gpt-oss's sliding layers), whose cache XLA would copy whole in its default layout.
SAMPLE.append(("v5e", 64, 8, 64, 16, jnp.bfloat16, dict(prefill_only=True, sliding_window=128, sinks=True)))
# tpu7x with head-major caches: a page's heads copied as they lie, each head's rows whole tiles.
SAMPLE.append(("tpu7x", 32, 8, 128, 16, jnp.bfloat16, dict(cache_layout="head_major")))
# Gemma 4's global layers: head_dim 512 (past the table's widest: its blocks cut to fit), 2 KV heads.
SAMPLE.append(("v6e", 16, 2, 512, 16, jnp.bfloat16, {}))
# One KV head with an fp8 cache, token-major: a page is half an 8-bit tile (a chunk's pages as one
# run of rows put every other page's copy mid-tile, which Mosaic refuses).
SAMPLE.append(("tpu7x", 8, 1, 128, 16, jnp.float8_e4m3fn, dict(prefill_only=True)))
MORE = [
    ("v6e", 32, 8, 128, 16, jnp.bfloat16, {}),
    # tpu7x at head_dim 256: a head's keys are two rows of 128 lanes in the kernel's view of a page.
    ("tpu7x", 16, 8, 256, 16, jnp.bfloat16, dict(prefill_only=True)),
    ("v5e", 32, 8, 128, 16, jnp.bfloat16, dict(prefill_only=True)),
    ("v6e", 32, 8, 128, 16, jnp.float8_e4m3fn, {}),
    ("v5e", 64, 8, 64, 32, jnp.int8, dict(sliding_window=128, sinks=True)),
    ("tpu7x", 16, 8, 256, 256, jnp.bfloat16, dict(softcap=30.0)),
    ("v5p", 8, 1, 128, 64, jnp.bfloat16, {}),
    ("v6e", 32, 8, 128, 16, jnp.float8_e4m3fn, dict(cache_layout="head_major")),
    ("v5e", 64, 8, 64, 16, jnp.bfloat16, dict(cache_layout="head_major", prefill_only=True, sliding_window=128,
                                              sinks=True)),
    ("tpu7x", 16, 8, 256, 32, jnp.bfloat16, dict(cache_layout="head_major", prefill_only=True)),
    ("v5p", 32, 8, 128, 16, jnp.bfloat16, dict(cache_layout="head_major")),
    ("tpu7x", 16, 2, 512, 256, jnp.bfloat16, {}),
    ("v6e", 32, 8, 512, 16, jnp.float8_e4m3fn, dict(prefill_only=True)),
    ("tpu7x", 16, 2, 512, 64, jnp.int8, dict(cache_layout="head_major")),
    ("v5e", 16, 2, 512, 16, jnp.bfloat16, {}),
    ("v5p", 16, 2, 512, 16, jnp.bfloat16, dict(prefill_only=True)),
    # 8-bit caches go into the bf16 products as stored, widened in the MXU's operand path: every
    # generation takes both (v5e's MXU has no fp8 of its own).
    ("v5e", 32, 8, 128, 16, jnp.float8_e4m3fn, dict(cache_layout="head_major")),
    ("v5p", 32, 8, 128, 16, jnp.float8_e4m3fn, {}),
    ("v5p", 32, 8, 128, 16, jnp.int8, dict(cache_layout="head_major")),
    ("v6e", 32, 8, 128, 16, jnp.int8, {}),
    ("tpu7x", 32, 8, 128, 16, jnp.float8_e4m3fn, {}),
    ("tpu7x", 32, 8, 128, 16, jnp.float8_e4m3fn, dict(cache_layout="head_major")),
    ("v5e", 8, 1, 128, 16, jnp.int8, {}),
]
CASES = SAMPLE + (MORE if sampling.ALL_COMPILES else [])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-d{c[3]}-page{c[4]}-{jnp.dtype(c[5]).name}"
                         + ("-head_major" if c[6].get("cache_layout") == "head_major" else "")
                         + ("-prefill_only" if c[6].get("prefill_only") else ""))
def test_attention_compiles(case):
    _compile_serving_step(*case)


def _compile_serving_step(generation, hq, hkv, d, page_size, cache_dtype, options):
    """The default path (the tuning's blocks for this call) compiled at SERVING, within VMEM."""
    options = dict(options)
    has_sinks = options.pop("sinks", False)
    layout = options.get("cache_layout", "token_major")
    if options.pop("prefill_only", False):
        options["blocks"] = tuning.prefill_blocks(hq // hkv, page_size, SERVING["context"] // page_size, d,
                                                  cache_dtype, generation)
    quantized = cache_dtype in (jnp.float8_e4m3fn, jnp.int8)

    def attend(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, num_seqs, sinks):
        return ops.ragged_paged_attention(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                                          sinks=sinks if has_sinks else None, k_scale=0.5 if quantized else None,
                                          v_scale=0.5 if quantized else None, generation=generation,
                                          interpret=False, **options)

    pages_per_seq = SERVING["context"] // page_size
    # The pool a server shares among its sequences: an eighth of their room, at most POOL_BYTES a
    # cache (v5e's 16 GB holds no more at head_dim 256). Its size changes no kernel, only the indices.
    page_bytes = page_size * hkv * d * jnp.dtype(cache_dtype).itemsize
    num_pages = min(SERVING["seqs"] * pages_per_seq // 8, POOL_BYTES // page_bytes)
    cache = (ops.cache_shape(num_pages, page_size, hkv, d, layout), cache_dtype, ops.cache_major_to_minor(hkv, layout))
    specs = [((SERVING["tokens"], hq, d), jnp.bfloat16), cache, cache, ((SERVING["seqs"],), jnp.int32),
             ((SERVING["seqs"], pages_per_seq), jnp.int32), ((SERVING["seqs"] + 1,), jnp.int32), ((), jnp.int32),
             ((hq,), jnp.float32)]
    report = tpu_compile.compile_for(attend, specs, generation, "ragged_paged_attention")
    assert len(report.kernels) == (1 if "blocks" in options else 2), report.kernels
    for kernel in report.kernels.values():
        assert 0 < kernel.vmem_bytes <= GENERATIONS[generation].vmem_bytes
        # The page copies run unchecked (ops validates every index first): libtpu's checks would
        # cost a quarter of a v6e decode step's issue cycles (modeled).
        assert kernel.schedule is not None and kernel.schedule.bounds_checks == 0
        # A page's two copies issue in a few bundles: the kernel's buffers hold a page per index, so
        # each page's address is a constant step from its trip's first (a page's rows as a dynamic
        # slice of one run of rows took about 11 bundles a page).
        first_copies = next(c for c in kernel.schedule.controls if c.kind == "loop")
        assert first_copies.own_cycles <= COPY_BUNDLES_PER_PAGE * PAGES_PER_TRIP, first_copies
    assert_no_cache_copy(report, cache)


def assert_no_cache_copy(report, cache):
    """The kernels read (or write) a cache held in ops.cache_major_to_minor where it is: the program
    copies no cache-sized array into another layout (head_dim 64's default layout would, and one KV
    head's row-major one)."""
    elements = lambda shape: math.prod(int(n) for n in shape[shape.index("[") + 1:-1].split(",") if n)
    copies = {op: s.operand_shapes for op, s in report.other_ops.items() if op.startswith("copy")}
    copied = {op: shapes for op, shapes in copies.items() if any(elements(s) == math.prod(cache[0]) for s in shapes)}
    assert not copied, copied


TUNED_ENTRIES = [(g, key) for g, by_key in tuning.TUNED.items() for key in by_key]


@pytest.mark.parametrize("generation,key", TUNED_ENTRIES)
def test_tuned_entries_fit_smem_at_serving_limits(generation, key):
    """Every entry's two kernels keep their step lists within SMEM at SERVING (8 KV heads, G = 4;
    the compiles below and the sample above prove the bound against libtpu)."""
    d, page_size, dtype = key
    pages_per_seq = SERVING["context"] // page_size
    for only, choose in (("decode", tuning.decode_blocks), ("prefill", tuning.prefill_blocks)):
        check_serving_step_list_fits_smem(choose(4, page_size, pages_per_seq, d, dtype, generation), pages_per_seq,
                                          only)


def check_serving_step_list_fits_smem(blocks: BlockSizes, pages_per_seq: int, only: str, page_size: int = 16,
                                      window: int | None = None) -> None:
    """ops' SMEM check for a call at SERVING in `blocks` (under a sliding window: the chunks a
    pair's windows span): raises ValueError where it does not fit."""
    chunks = ops.pair_chunks(-(-pages_per_seq // blocks.pages_per_block), blocks.pages_per_block * page_size,
                             blocks.block_q, window, only)
    ops.check_step_list_fits_smem(-(-SERVING["tokens"] // blocks.block_q), SERVING["seqs"], chunks,
                                  blocks.pages_per_block, only)


@pytest.mark.parametrize("only,choose", [("decode", tuning.decode_blocks), ("prefill", tuning.prefill_blocks)])
def test_window_chunks_fit_smem_as_they_are(only, choose):
    """gpt-oss's window of 128 at SERVING: a pair steps only through the chunks its windows span,
    so window-sized chunks over a 32k page table fit SMEM as they are (listed for every chunk of
    the page table, they would not)."""
    pages_per_seq = SERVING["context"] // 32
    window_blocks = choose(8, 32, pages_per_seq, 64, jnp.int8, "v5e", 128)
    assert ops.fit_step_list_to_smem(window_blocks, SERVING["tokens"], SERVING["seqs"], pages_per_seq, only,
                                     32, 128) == window_blocks
    check_serving_step_list_fits_smem(window_blocks, pages_per_seq, only, 32, 128)
    with pytest.raises(ValueError, match="SMEM"):
        check_serving_step_list_fits_smem(window_blocks, pages_per_seq, only, 32)


@pytest.mark.parametrize("only,choose", [("decode", tuning.decode_blocks), ("prefill", tuning.prefill_blocks)])
def test_chunks_grow_until_the_step_list_fits_smem(only, choose):
    """A 128k page table at SERVING's tokens and sequences: 16-token pages in chunks of the
    default's keys list more steps than SMEM holds; the default path doubles them to the first
    size that fits."""
    pages_per_seq = 4 * SERVING["context"] // 16
    small = dataclasses.replace(choose(8, 16, pages_per_seq, 64, jnp.int8, "v5e"), pages_per_block=16)
    args = (SERVING["tokens"], SERVING["seqs"], pages_per_seq, only, 16)
    blocks = ops.fit_step_list_to_smem(small, *args)
    check = lambda b: check_serving_step_list_fits_smem(b, pages_per_seq, only)
    check(blocks)
    with pytest.raises(ValueError, match="SMEM"):
        check(small)
    with pytest.raises(ValueError, match="SMEM"):
        check(dataclasses.replace(blocks, pages_per_block=blocks.pages_per_block // 2))
    assert ops.fit_step_list_to_smem(blocks, *args) == blocks  # blocks that fit stay as they are


def test_an_untuned_wide_head_takes_a_narrower_entry_cut_to_its_vmem():
    """Head dims past the table's (Gemma 4's 512 on a generation not tuned there) take the
    widest narrower entry with its query rows and keys halved: the VMEM it was rated at (the
    full entry ran out of v6e's VMEM at 32 x 8 heads with an fp8 cache, `make check-compile`)."""
    checked = 0
    for generation, table in tuning.TUNED.items():
        for d, page_size, dtype in [k for k in table if k[0] == 256 and (512, *k[1:]) not in table]:
            want = tuple(max(x // 2, page_size) for x in table[(256, page_size, dtype)])
            assert tuning._entry(generation, 512, page_size, dtype, None) == want
            checked += 1
    assert checked
    assert tuning._entry("v6e", 512, 24, "bfloat16", None) == tuple(x // 2 for x in tuning.RULE)


@pytest.mark.parametrize("layout", ops.CACHE_LAYOUTS)
@pytest.mark.parametrize("generation,key", TUNED_ENTRIES if os.environ.get("PAGED_CHECK_ALL_TUNED") == "1" else [])
def test_tuned_entry_compiles_at_serving_limits(generation, key, layout):
    """`make check-tuned`: every entry, both kernels, in either cache layout, compiled by libtpu for
    its generation at SERVING."""
    d, page_size, dtype = key
    _compile_serving_step(generation, 32, 8, d, page_size, jnp.dtype(dtype), dict(cache_layout=layout))


@pytest.mark.parametrize("generation,cache_dtype,d,layout,hkv", [("v6e", jnp.bfloat16, 128, "token_major", 8),
                                                                 ("v5e", jnp.float8_e4m3fn, 64, "token_major", 8),
                                                                 ("tpu7x", jnp.bfloat16, 128, "head_major", 8),
                                                                 ("v5p", jnp.bfloat16, 128, "token_major", 1)])
def test_cache_write_compiles_in_place(generation, cache_dtype, d, layout, hkv):
    """With the caches donated and kept in ops.cache_major_to_minor (as an engine's step holds
    them), the write kernel updates them where they are: no copy of a cache in the program (one
    KV head too)."""
    scale = None if cache_dtype == jnp.bfloat16 else 0.5

    def write(key, value, k_cache, v_cache, slots):
        return ops.reshape_and_cache_flash(key, value, k_cache, v_cache, slots, scale, scale, cache_layout=layout,
                                           interpret=False)

    held = ops.cache_major_to_minor(hkv, layout)
    cache = (ops.cache_shape(4096, 16, hkv, d, layout), cache_dtype, held)
    specs = [((1000, hkv, d), jnp.bfloat16), ((1000, hkv, d), jnp.bfloat16), cache, cache, ((1000,), jnp.int32)]
    # Head-major caches, and one KV head's, are written by XLA's scatter (a copy cannot start
    # inside a page's tile).
    writer = "scatter" if layout == "head_major" or hkv == 1 else "reshape_and_cache"
    report = tpu_compile.compile_for(write, specs, generation, writer, donate_argnums=(2, 3),
                                     out_layouts=(held,) * 2)
    ops_compiled = list(report.schedules) + list(report.kernels) + list(report.other_ops)
    assert any(writer in op for op in ops_compiled), ops_compiled
    assert_no_cache_copy(report, cache)


def test_a_step_list_past_smem_is_refused_before_compiling():
    """The serving shape at 32k context fits SMEM (the compiles above); at 128k, with 128-row query
    blocks and 512 keys per chunk, its step list does not (libtpu: "Used 1.13M of 1.00M smem"): a
    ValueError says so, and what to change, before any compile."""
    def call(context):
        pages_per_seq = context // 16
        spec = lambda shape, dtype=jnp.int32: jax.ShapeDtypeStruct(shape, dtype)
        cache = spec((4096, 16, 8, 128), jnp.bfloat16)
        return jax.eval_shape(
            lambda *a: ops.ragged_paged_attention(*a, blocks=BlockSizes(32, 32), generation="v6e", interpret=False),
            spec((SERVING["tokens"], 32, 128), jnp.bfloat16), cache, cache, spec((SERVING["seqs"],)),
            spec((SERVING["seqs"], pages_per_seq)), spec((SERVING["seqs"] + 1,)), spec(()))

    assert call(SERVING["context"]).shape == (SERVING["tokens"], 32, 128)
    with pytest.raises(ValueError, match=r"step list needs 115\d KiB of SMEM.*fewer sequences per call"):
        call(4 * SERVING["context"])
