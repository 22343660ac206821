"""JAX entry points: ragged paged attention over a paged KV cache, and the cache write.

`ragged_paged_attention` attends the new tokens of many sequences, packed
back to back (`cu_q_lens`), over each sequence's pages of the cache
(`page_indices`, `kv_lens`): decode (one token), prefill and chunked
prefill mix in one call. `reshape_and_cache_flash` writes new tokens' K
and V into the cache at their slots. Names, arguments and semantics follow
vLLM's ops, so engine code ports over: a sequence's new tokens are its last
positions and attend causally; `sliding_window=W` lets the query at
position p see keys p - W + 1 .. p; `softcap` c maps a scaled score s to
c * tanh(s / c); a sink (one logit per query head) adds exp(sink) to the
softmax's denominator only; a quantized cache holds value / scale.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._shared.attention_math import heads_as_rows, rows_as_heads
from ._shared.generations import GENERATIONS, SMEM_BYTES, current_generation, default_interpret
from ._shared.tuning import round_up
from .kernel import TOKENS_PER_WRITE_STEP, BlockSizes, Options, write_cache
from .kernel import ragged_paged_attention as _kernel_call
from . import tuning

NO_KEY = jnp.iinfo(jnp.int32).max // 2  # a row_lo no key reaches: the row sees nothing
CACHE_DTYPES = (jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, jnp.int8)
QUERY_DTYPES = (jnp.bfloat16, jnp.float32)
# The layout the kernels read and write the caches in, in place: row-major. XLA gives a
# [pages, page_size, Hkv, D] array that layout when D fills 128 lanes; under 128 lanes (head_dim
# 64) its default puts another dimension minor-most, and every call would first copy the whole
# cache into this one. Allocate such a cache in it: jax.device_put(cache,
# Format(Layout(CACHE_MAJOR_TO_MINOR), sharding)). A page's rows then take 128 lanes in HBM
# (`kernel.page_bytes`), as vLLM's TPU cache pads head_dim to 128.
CACHE_MAJOR_TO_MINOR = (0, 1, 2, 3)


def cache_major_to_minor(kv_heads: int, cache_layout: str = "token_major") -> tuple[int, int, int, int]:
    """The layout to hold a cache in: CACHE_MAJOR_TO_MINOR, but for a token-major cache of one KV
    head (MQA). Row-major, its [1, D] rows would each pad to a whole tile of rows in HBM and the
    kernels' view of a page as [page_size, D] would be a copy of the cache per call; with the page's
    tokens second-minor the same elements lie as the kernels read them (as a head-major cache of
    one head holds them)."""
    return (0, 2, 1, 3) if kv_heads == 1 and cache_layout == "token_major" else CACHE_MAJOR_TO_MINOR
# How a cache's dims are ordered, each row-major. token_major [pages, page_size, Hkv, D] is vLLM's;
# head_major [pages, Hkv, page_size, D] keeps each KV head's rows of a page together, so the
# kernel reads a head as whole tiles where token-major needs strided loads (at decode of whole
# 32-bit words, several heads attended together; elsewhere of a packed dtype's rows, split and
# repacked: `kernel._kernel`). Both kernels take either (`cache_layout=`).
CACHE_LAYOUTS = ("token_major", "head_major")


def _check_layout(cache_layout: str):
    if cache_layout not in CACHE_LAYOUTS:
        raise ValueError(f"cache_layout must be one of {CACHE_LAYOUTS}, got {cache_layout!r}")


def cache_dims(cache, cache_layout: str = "token_major") -> tuple[int, int, int, int]:
    """(pages, page_size, Hkv, D) of a cache held in `cache_layout`."""
    _check_layout(cache_layout)
    pages, a, b, d = cache.shape
    return (pages, b, a, d) if cache_layout == "head_major" else (pages, a, b, d)


def cache_shape(num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                cache_layout: str = "token_major") -> tuple[int, int, int, int]:
    """The shape of a cache held in `cache_layout` (the inverse of `cache_dims`)."""
    _check_layout(cache_layout)
    page = (kv_heads, page_size) if cache_layout == "head_major" else (page_size, kv_heads)
    return (num_pages, *page, head_dim)


def _layout_text(cache_layout: str) -> str:
    return "[pages, kv_heads, page_size, head_dim]" if cache_layout == "head_major" else \
        "[pages, page_size, kv_heads, head_dim]"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Schedule:
    """The kernel's grid steps: per step, its query block, sequence and chunk of that sequence's
    pages, and whether it computes (a block with no live token gets one step that only writes
    zeros); part p runs steps part_first[p] .. part_first[p] + part_count[p] - 1."""
    block: jax.Array  # [max steps] int32
    seq: jax.Array
    chunk: jax.Array
    works: jax.Array  # 1: the step computes
    part_first: jax.Array  # [parts] int32
    part_count: jax.Array  # [parts] int32


def make_schedule(cu_q_lens, kv_lens, num_seqs, num_tokens: int, block_q: int, chunk: int, num_chunks: int,
                  sliding_window: int | None, parts: int = 1, only: str | None = None) -> Schedule:
    """The steps, on the device. num_tokens: the padded token count (a multiple of block_q);
    chunk: keys per chunk; num_chunks: chunks per sequence at most; parts: 2 cuts the steps in
    two runs at the block boundary nearest their middle (`parts_for`). only: "decode" (sequences
    with one new token) or "prefill" (more than one): those sequences' steps alone, and no step
    for a block without their tokens (the caller fills those rows); None: every sequence, and a
    step that writes zeros for each block without a live token."""
    num_blocks = num_tokens // block_q
    max_seqs = kv_lens.shape[0]
    live = jnp.arange(max_seqs) < num_seqs
    q_start, q_end = cu_q_lens[:-1], cu_q_lens[1:]
    q_len = jnp.where(live, q_end - q_start, 0)
    if only is not None:
        q_len = jnp.where((q_len == 1) == (only == "decode"), q_len, 0)
    first_block, last_block = q_start // block_q, (q_end - 1) // block_q
    # (block, sequence) pairs, sequence-major, which is block-major too: a sequence's tokens follow
    # the previous one's. Then one pair per block that holds no live token.
    seq_pairs = jnp.where(q_len > 0, last_block - first_block + 1, 0)
    seq_pair_end = jnp.cumsum(seq_pairs)
    total_seq_pairs = seq_pair_end[-1]
    live_blocks = pl.cdiv(cu_q_lens[jnp.minimum(num_seqs, max_seqs)], block_q)
    max_pairs = num_blocks + max_seqs
    p = jnp.arange(max_pairs, dtype=jnp.int32)
    # (searchsorted by comparing every pair, vectorized: its default binary search gathers once per
    # halving, which XLA runs element by element on a TPU.)
    s = jnp.clip(jnp.searchsorted(seq_pair_end, p, side="right", method="compare_all"), 0, max_seqs - 1).astype(jnp.int32)
    is_seq_pair = p < total_seq_pairs
    b = jnp.where(is_seq_pair, first_block[s] + p - (seq_pair_end[s] - seq_pairs[s]),
                  live_blocks + p - total_seq_pairs)
    is_pad_pair = ~is_seq_pair & (b < num_blocks) & (only is None)
    # The positions of the pair's first and last rows, and the chunks they see.
    offset = kv_lens[s] - q_len[s] - q_start[s]  # token t of sequence s is at position t + offset
    pos_first = jnp.maximum(q_start[s], b * block_q) + offset
    pos_last = jnp.minimum(q_end[s], (b + 1) * block_q) - 1 + offset
    key_first = jnp.maximum(pos_first - sliding_window + 1, 0) if sliding_window else jnp.zeros_like(pos_first)
    chunk_first = jnp.where(is_seq_pair, jnp.clip(key_first // chunk, 0, num_chunks - 1), 0)
    chunk_last = jnp.clip(pos_last // chunk, 0, num_chunks - 1)
    steps = jnp.where(is_seq_pair, jnp.maximum(chunk_last - chunk_first + 1, 1), is_pad_pair.astype(jnp.int32))
    step_end = jnp.cumsum(steps)
    max_steps = step_capacity(num_blocks, max_seqs, pair_chunks(num_chunks, chunk, block_q, sliding_window, only), only)
    count = jnp.clip(step_end[-1], 0, max_steps)  # inconsistent index arrays cannot run the grid past the arrays
    i = jnp.arange(max_steps, dtype=jnp.int32)
    pair = jnp.clip(jnp.searchsorted(step_end, i, side="right", method="compare_all"), 0, max_pairs - 1)
    in_pair = i - (step_end[pair] - steps[pair])
    block = jnp.clip(b[pair], 0, num_blocks - 1)
    if parts == 2:
        # With no step after the first starting a block (one block), part 1 gets every step.
        starts = (i > 0) & (i < count) & (block != block[jnp.maximum(i - 1, 0)])
        split = jnp.argmin(jnp.where(starts, jnp.abs(2 * i - count), jnp.iinfo(jnp.int32).max))
        part_first, part_count = jnp.stack([0, split]), jnp.stack([split, count - split])
    else:
        part_first, part_count = jnp.zeros((1,), jnp.int32), count[None]
    step_of_seq = pair < total_seq_pairs  # (is_seq_pair[pair], without a gather)
    return Schedule(block.astype(jnp.int32), jnp.where(step_of_seq, s[pair], 0).astype(jnp.int32),
                    jnp.clip(chunk_first[pair] + in_pair, 0, num_chunks - 1).astype(jnp.int32),
                    (step_of_seq & (i < count)).astype(jnp.int32), part_first.astype(jnp.int32),
                    part_count.astype(jnp.int32))


SMEM_RESERVE = 16 << 10  # left to Mosaic's own scalars


def pair_chunks(num_chunks: int, chunk: int, block_q: int, sliding_window: int | None, only: str | None) -> int:
    """The most chunks of `chunk` keys a pair (query block, sequence) steps through: every chunk,
    or under a sliding window those its rows' windows span (a block's rows span block_q positions,
    a decode pair's one; the window's first key and the last row's position may each fall in a
    chunk of their own)."""
    if not sliding_window:
        return num_chunks
    span = (1 if only == "decode" else block_q) - 1 + sliding_window - 1  # keys from the first seen to the last
    return min(num_chunks, span // chunk + 2)


def step_capacity(num_blocks: int, max_seqs: int, num_chunks: int, only: str | None) -> int:
    """The steps a call can have (`make_schedule`): a pair (query block, sequence) walks up to
    num_chunks chunks (`pair_chunks`), and a sequence's tokens span at most one more block than
    the blocks they fill; a decode sequence is one pair."""
    return max_seqs * num_chunks if only == "decode" else (num_blocks + max_seqs) * num_chunks


def smem_bytes(num_blocks: int, max_seqs: int, num_chunks: int, pages_per_block: int, only: str | None) -> int:
    """The step arrays (`make_schedule`: four int32 per possible step), kv_lens, the window starts
    and each step's two page-table rows, scalar-prefetched into SMEM. (libtpu counted 1157 KiB for
    a call this counted as 1154 KiB, before the window starts' 1 KiB.)"""
    return 4 * (4 * step_capacity(num_blocks, max_seqs, num_chunks, only) + 2 * max_seqs + 4 + 4 * pages_per_block)


def fit_step_list_to_smem(blocks: BlockSizes, num_tokens: int, max_seqs: int, pages_per_seq: int,
                          only: str, page_size: int, sliding_window: int | None = None) -> BlockSizes:
    """The default path's blocks with the chunk doubled until the step list fits SMEM: short
    chunks over a long page table (256 sequences of 128k) would otherwise list more steps than
    SMEM holds. Explicit blocks are never changed."""
    def need(pages):
        chunks = pair_chunks(-(-pages_per_seq // pages), pages * page_size, blocks.block_q, sliding_window, only)
        return smem_bytes(-(-max(num_tokens, 1) // blocks.block_q), max_seqs, chunks, pages, only)

    pages = blocks.pages_per_block
    while pages < pages_per_seq and need(pages) > SMEM_BYTES - SMEM_RESERVE:
        pages = min(2 * pages, pages_per_seq)
    return dataclasses.replace(blocks, pages_per_block=pages)


def check_step_list_fits_smem(num_blocks: int, max_seqs: int, num_chunks: int, pages_per_block: int,
                              only: str | None = None) -> None:
    """Past SMEM's 1 MiB the compile fails: say so first, with what to change."""
    need = smem_bytes(num_blocks, max_seqs, num_chunks, pages_per_block, only)
    if need > SMEM_BYTES - SMEM_RESERVE:
        raise ValueError(
            f"the kernel's step list needs {need / 1024:.0f} KiB of SMEM, more than the "
            f"{(SMEM_BYTES - SMEM_RESERVE) / 1024:.0f} KiB it may use: {max_seqs} sequences x {num_chunks} chunks of "
            f"the page table (+ {num_blocks} query blocks). Pass fewer sequences per call, a shorter page table "
            f"(page_indices' width), or larger blocks (pages_per_block)")


def parts_for(generation: str, num_blocks: int) -> int:
    """Cores the steps are split over: a megacore's two where there are two query blocks to give
    them (a part with no block of its own would write another's back)."""
    return GENERATIONS[generation].cores_per_device if num_blocks > 1 else 1


def token_seqs(cu_q_lens, num_seqs, num_tokens: int):
    """[num_tokens] int32 each: the token index, its sequence, and whether that sequence is live."""
    max_seqs = cu_q_lens.shape[0] - 1
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right", method="compare_all").astype(jnp.int32) - 1, 0, max_seqs - 1)
    return t, seq, (t < cu_q_lens[jnp.minimum(num_seqs, max_seqs)]) & (seq < num_seqs)


def window_starts(cu_q_lens, kv_lens, sliding_window: int | None):
    """[S] int32: the first position each sequence's first new token sees (0 without a window)."""
    if not sliding_window:
        return jnp.zeros_like(kv_lens)
    return jnp.maximum(kv_lens - (cu_q_lens[1:] - cu_q_lens[:-1]) - sliding_window + 1, 0).astype(jnp.int32)


def token_ranges(cu_q_lens, kv_lens, num_seqs, num_tokens: int, key_stride: int, sliding_window: int | None):
    """[num_tokens] int32 (lo, hi): the keys each token sees, as global positions (kernel.py);
    a token past the live sequences' sees none (lo > hi)."""
    t, seq, live = token_seqs(cu_q_lens, num_seqs, num_tokens)
    position = t - cu_q_lens[seq] + kv_lens[seq] - (cu_q_lens[seq + 1] - cu_q_lens[seq])
    first = jnp.maximum(position - sliding_window + 1, 0) if sliding_window else jnp.zeros_like(position)
    return jnp.where(live, seq * key_stride + first, NO_KEY), jnp.where(live, seq * key_stride + position, -1)


def inputs_valid(cu_q_lens, kv_lens, page_indices, num_seqs, num_tokens: int, num_pages: int, max_len: int):
    """() bool, on the device: the index arrays describe the live sequences consistently, and
    every page they use is in the cache. Invalid ones make the output NaN (no kernel reads
    outside its inputs whatever they hold): a report without a device-to-host round trip."""
    max_seqs = kv_lens.shape[0]
    live = jnp.arange(max_seqs) < num_seqs
    q_len = cu_q_lens[1:] - cu_q_lens[:-1]
    page_size = max_len // page_indices.shape[1]
    used = jnp.arange(page_indices.shape[1])[None, :] < pl.cdiv(kv_lens, page_size)[:, None]
    pages_ok = (page_indices >= 0) & (page_indices < num_pages)
    return ((cu_q_lens[0] == 0) & (num_seqs >= 0) & (num_seqs <= max_seqs)
            & jnp.all(~live | ((q_len >= 0) & (q_len <= kv_lens) & (kv_lens <= max_len)))
            & (cu_q_lens[jnp.clip(num_seqs, 0, max_seqs)] <= num_tokens)
            & jnp.all(~(live[:, None] & used) | pages_ok))


def _check_cache_dtype(name, cache):
    if cache.dtype not in CACHE_DTYPES:
        raise TypeError(f"{name} must be one of {[jnp.dtype(d).name for d in CACHE_DTYPES]}, got {cache.dtype}")


def scale_operand(name: str, scale) -> jax.Array:
    """A cache's k_scale or v_scale as the f32 scalar the kernels take: None (an unquantized
    cache: 1), a positive number, or a one-element float array (its value is not read here: an
    engine's scales may live on the device)."""
    if scale is None:
        return jnp.ones((), jnp.float32)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{name} must be positive and finite, got {scale!r}")
        return jnp.asarray(scale, jnp.float32)
    if getattr(scale, "size", None) != 1 or not jnp.issubdtype(scale.dtype, jnp.floating):
        raise ValueError(f"{name} must be a positive float or a one-element float array, got "
                         f"{getattr(scale, 'dtype', type(scale).__name__)} {getattr(scale, 'shape', '')}")
    return jnp.asarray(scale, jnp.float32).reshape(())


def live_offsets(cu_q_lens, num_seqs):
    """cu_q_lens with every entry past num_seqs set to the live sequences' end: whatever an engine
    pads them with (vLLM pads with 1s), the padding sequences are empty and after the live ones,
    so searches over the offsets see them sorted."""
    entries = jnp.arange(cu_q_lens.shape[0])
    end = cu_q_lens[jnp.clip(num_seqs, 0, cu_q_lens.shape[0] - 1)]
    return jnp.where(entries <= num_seqs, cu_q_lens, end)


def check_shapes(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, sinks, cache_layout: str = "token_major"):
    """Shapes and dtypes, at trace time: a clear error naming the argument."""
    if q.ndim != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim], got shape {q.shape}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.ndim != 4:
            raise ValueError(f"{name} must be {_layout_text(cache_layout)}, got shape {cache.shape}")
        _check_cache_dtype(name, cache)
    if q.dtype not in QUERY_DTYPES:
        raise TypeError(f"q must be bfloat16 or float32, got {q.dtype}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ in pages, page_size or kv_heads")
    _, _, hkv, d = cache_dims(k_cache, cache_layout)
    if d != q.shape[2]:
        raise ValueError(f"q's head_dim {q.shape[2]} differs from k_cache's {d}")
    if q.shape[1] % hkv:
        raise ValueError(f"q's {q.shape[1]} heads are not a multiple of the cache's {hkv} KV heads")
    max_seqs = kv_lens.shape[0] if kv_lens.ndim == 1 else -1
    for name, array, shape in (("kv_lens", kv_lens, (max_seqs,)), ("cu_q_lens", cu_q_lens, (max_seqs + 1,)),
                               ("page_indices", page_indices, (max_seqs, page_indices.shape[-1]))):
        if array.dtype != jnp.int32:
            raise TypeError(f"{name} must be int32, got {array.dtype}")
        if array.shape != shape or max_seqs < 1:
            raise ValueError(f"{name} has shape {array.shape}; with kv_lens [S] it must be {shape}")
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be [{q.shape[1]}] (one per query head), got {sinks.shape}")


def ragged_paged_attention(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, softmax_scale=None,
                           sliding_window=None, softcap=None, sinks=None, k_scale=None, v_scale=None,
                           cache_layout: str = "token_major", blocks: BlockSizes | None = None,
                           generation: str | None = None, interpret=None):
    """Attention of the new tokens q [T, Hq, D] over the paged caches k_cache, v_cache
    [pages, page_size, Hkv, D] (bf16, f32, fp8 e4m3 or int8 with k_scale / v_scale), or
    [pages, Hkv, page_size, D] with cache_layout="head_major" (`CACHE_LAYOUTS`: faster).

    kv_lens [S] int32: each sequence's tokens, the new ones included; page_indices
    [S, pages_per_seq] int32; cu_q_lens [S + 1] int32: where each sequence's new tokens are
    in q; num_seqs: the live sequences (an int or a [1] / () int32 array; the arrays may be
    padded past it, and what they hold there is ignored). k_scale, v_scale: a quantized
    cache's scales, numbers or one-element float arrays. Returns [T, Hq, D] in q's dtype;
    tokens past the live sequences' get zeros. Index values and scales are checked on the
    device: invalid ones make the output NaN.
    generation: the TPU generation to run on (default: the current device's); on v5p the
    steps are split over the megacore's two cores. Without `blocks`, decode sequences (one new
    token) run in 8-row query blocks (`tuning.decode_blocks`) and the others in larger ones
    (`tuning.prefill_blocks`), two kernels over the batch, each stepping through its own sequences.
    Hold the caches in `cache_major_to_minor(Hkv, cache_layout)`: at head_dim 64, or with one KV
    head, another layout costs a copy of the whole cache per call.
    """
    check_shapes(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, sinks, cache_layout)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1 (or None), got {sliding_window}")
    if softcap is not None and softcap < 0:
        raise ValueError(f"softcap must be positive (or None / 0), got {softcap}")
    t, hq, d = q.shape
    num_pages, page_size, hkv, _ = cache_dims(k_cache, cache_layout)
    groups = hq // hkv
    interpret = default_interpret() if interpret is None else interpret
    generation = generation or current_generation().name
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
    scale = float(softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d))
    kv_scales = jnp.stack([scale_operand("k_scale", k_scale), scale_operand("v_scale", v_scale)])
    options = dict(scale=scale, softcap=float(softcap or 0.0), has_sinks=sinks is not None, groups=groups,
                   page_size=page_size, windowed=bool(sliding_window), head_major=cache_layout == "head_major")
    valid = inputs_valid(cu_q_lens, kv_lens, page_indices, num_seqs, t, num_pages, page_indices.shape[1] * page_size)
    valid &= jnp.all(kv_scales > 0) & jnp.all(jnp.isfinite(kv_scales))
    # Invalid index values: the kernels run no sequence, so that no copy reads outside the cache
    # (the kernel's copies trust the page indices of the sequences they run).
    run_seqs = jnp.where(valid, num_seqs, 0)
    cu_q_lens = live_offsets(cu_q_lens, run_seqs)
    attend = lambda blocks, only=None: _attend(
        q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, run_seqs, sinks, kv_scales, sliding_window, options,
        blocks, only, generation, interpret)
    if blocks is not None:
        out = attend(blocks)
    else:
        # Decode sequences in 8-row blocks, the others in larger ones: two kernels over one batch,
        # each stepping through its own sequences only; a token takes its sequence's kernel's row.
        table = (groups, page_size, page_indices.shape[1], d, k_cache.dtype, generation, sliding_window)
        _, seq, live = token_seqs(cu_q_lens, run_seqs, t)
        single = (cu_q_lens[seq + 1] - cu_q_lens[seq] == 1)[:, None, None]
        # The prefill kernel first: its step list is the longer, so an SMEM refusal names its count.
        fit = lambda blocks, only: fit_step_list_to_smem(blocks, t, kv_lens.shape[0], page_indices.shape[1], only,
                                                         page_size, sliding_window)
        prefill = attend(fit(tuning.prefill_blocks(*table), "prefill"), "prefill")
        out = jnp.where(single, attend(fit(tuning.decode_blocks(*table), "decode"), "decode"), prefill)
        out = jnp.where(live[:, None, None], out, 0).astype(q.dtype)
    return jnp.where(valid, out, jnp.nan)


def _attend(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, num_seqs, sinks, kv_scales, sliding_window,
            options: dict, blocks: BlockSizes, only: str | None, generation: str, interpret):
    """ragged_paged_attention with its blocks chosen: [T, Hq, D]. only: "decode" or "prefill",
    that kind of sequence alone (`make_schedule`), other tokens' rows left undefined."""
    t, hq, _ = q.shape
    page_size, groups = options["page_size"], options["groups"]
    hkv = hq // groups
    chunks = -(-page_indices.shape[1] // blocks.pages_per_block)
    # Sequences' global key positions are a whole number of chunks apart: a chunk's columns past
    # its sequence's pages must not reach the next sequence's positions.
    key_stride = chunks * blocks.pages_per_block * page_size
    opts = Options(key_stride=key_stride, **options)
    num_tokens = round_up(max(t, 1), blocks.block_q)  # the kernel's q has a spare block past these
    page_chunks = jnp.pad(page_indices, ((0, 0), (0, chunks * blocks.pages_per_block - page_indices.shape[1])))
    page_chunks = page_chunks.reshape(page_indices.shape[0], chunks, 1, blocks.pages_per_block)
    num_blocks = num_tokens // blocks.block_q
    check_step_list_fits_smem(num_blocks, kv_lens.shape[0],
                              pair_chunks(chunks, blocks.pages_per_block * page_size, blocks.block_q, sliding_window, only),
                              blocks.pages_per_block, only)
    schedule = make_schedule(cu_q_lens, kv_lens, num_seqs, num_tokens, blocks.block_q,
                             blocks.pages_per_block * page_size, chunks, sliding_window,
                             parts_for(generation, num_blocks), only)
    num_tokens += blocks.block_q
    lo, hi = token_ranges(cu_q_lens, kv_lens, num_seqs, num_tokens, key_stride, sliding_window)
    sink = sinks.astype(jnp.float32) if sinks is not None else jnp.zeros((hq,), jnp.float32)
    sink_rows = jnp.tile(sink.reshape(hkv, 1, groups), (1, blocks.block_q, 1)).reshape(hkv, -1, 1)
    out = _kernel_call(heads_as_rows(q, groups, num_tokens), k_cache, v_cache, kv_lens,
                       window_starts(cu_q_lens, kv_lens, sliding_window), page_chunks,
                       jnp.repeat(lo, groups)[:, None], jnp.repeat(hi, groups)[:, None], sink_rows, kv_scales, schedule,
                       opts=opts, blocks=blocks, interpret=interpret,
                       name="ragged_paged_attention" + (f"_{only}" if only else ""))
    return rows_as_heads(out, groups, t)


def quantize(x, dtype, scale):
    """x as a cache of `dtype` stores it: x / scale (scale None: 1; a number or a one-element
    array), rounded; int8 to the nearest integer and fp8 to the nearest value, each saturated at
    its largest magnitude."""
    x = x.astype(jnp.float32) / (1.0 if scale is None else jnp.asarray(scale, jnp.float32).reshape(()))
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return jnp.clip(jnp.round(x), info.min, info.max).astype(dtype)
    if dtype == jnp.float8_e4m3fn:
        largest = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -largest, largest)
    return x.astype(dtype)


def check_write_shapes(key, value, key_cache, value_cache, slot_mapping, cache_layout: str = "token_major"):
    """The cache write's shapes (anything with .shape and .dtype), at trace time, before anything
    is written: an error names each argument and the shapes the caller passed. key and value agree
    in tokens and match their caches' heads and head_dim; slot_mapping has at most key's tokens
    (vLLM's convention: key and value may be padded past the slots, and their extra rows are
    never written)."""
    for name, new, cache in (("key", key, key_cache), ("value", value, value_cache)):
        if len(new.shape) != 3 or len(cache.shape) != 4 or tuple(new.shape[1:]) != cache_dims(cache, cache_layout)[2:]:
            raise ValueError(f"{name} {tuple(new.shape)} must be [tokens, kv_heads, head_dim] matching {name}_cache's "
                             f"{_layout_text(cache_layout)} {tuple(cache.shape)}")
        _check_cache_dtype(f"{name}_cache", cache)
    if cache_dims(key_cache, cache_layout)[:3] != cache_dims(value_cache, cache_layout)[:3]:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} differ in "
                         "pages, page_size or kv_heads")
    if key.shape[0] != value.shape[0]:
        raise ValueError(f"key has {key.shape[0]} tokens and value {value.shape[0]} (key {tuple(key.shape)}, value "
                         f"{tuple(value.shape)}): they must agree")
    if len(slot_mapping.shape) != 1 or slot_mapping.shape[0] > key.shape[0]:
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must be [tokens] with at most key's "
                         f"{key.shape[0]} tokens (key {tuple(key.shape)}): one slot per token written")


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None, *,
                            cache_layout: str = "token_major", interpret=None):
    """(key_cache, value_cache) with the new tokens' key and value [T, Hkv, D] written at
    slot_mapping [N] int32, N <= T (page * page_size + row; -1: padding, skipped): token t < N
    goes to slot slot_mapping[t], and key's and value's rows from N on (a caller's padding) are
    never written. fp8 and int8 caches store x / k_scale and x / v_scale (numbers or one-element
    arrays). The caches are in `cache_layout` (`CACHE_LAYOUTS`) and aliased to the results: under
    jax.jit with the caches donated, they are written in place. A slot past the cache is never
    written, and not reported: a caller holding the slots on the host checks them there."""
    check_write_shapes(key, value, key_cache, value_cache, slot_mapping, cache_layout)
    if slot_mapping.dtype != jnp.int32:
        raise TypeError(f"slot_mapping must be int32, got {slot_mapping.dtype}")
    t = slot_mapping.shape[0]
    key = quantize(key[:t], key_cache.dtype, scale_operand("k_scale", k_scale))
    value = quantize(value[:t], value_cache.dtype, scale_operand("v_scale", v_scale))
    head_major = cache_layout == "head_major"
    if head_major or key_cache.shape[2] == 1:
        # A token's row of each head is one row of a page's tiles (head-major, or one KV head held
        # as cache_major_to_minor says), which a DMA cannot address in HBM (Mosaic's copies start
        # on whole tiles): XLA's scatter writes it, in place when the caches are donated. Slots of
        # -1 or past the cache land out of range and are dropped.
        pages, page_size = cache_dims(key_cache, cache_layout)[:2]
        slot = jnp.where(slot_mapping >= 0, slot_mapping, pages * page_size)
        page, row = slot // page_size, slot % page_size
        at = (lambda cache: cache.at[page, :, row]) if head_major else (lambda cache: cache.at[page, row])
        return tuple(at(cache).set(new, mode="drop") for new, cache in ((key, key_cache), (value, value_cache)))
    interpret = default_interpret() if interpret is None else interpret
    padded = round_up(max(t, 1), TOKENS_PER_WRITE_STEP)
    pad = lambda x, fill=0: jnp.pad(x, ((0, padded - t),) + ((0, 0),) * (x.ndim - 1), constant_values=fill)
    return write_cache(pad(key), pad(value), key_cache, value_cache, pad(slot_mapping, -1), interpret=interpret)
