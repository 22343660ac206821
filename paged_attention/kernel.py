"""Ragged paged attention: a Pallas TPU kernel that reads K and V where they lie in a paged cache.

Layout. As in flash attention, the G query heads of one KV head are stacked
as rows, token-major: q [T, Hq, D] is seen as [Hkv, T * G, D], so one K/V
chunk serves every head of its group in one matmul. The caches stay in
their own layout [pages, page_size, Hkv, D] in HBM; a step copies the pages
of one chunk (`pages_per_block` pages of one sequence, every KV head) into
VMEM, one DMA per page, in a loop over the pages its tokens see, while the
previous chunk is computed (two buffers).

Grid (parts, steps). The packed query tokens are cut into blocks of block_q
tokens; a block holds the tokens of one or more sequences. A step pairs a
query block with one chunk of one of its sequences' pages, and the steps
of a block are consecutive, so its softmax statistics and accumulator stay
in VMEM from its first step to its last (`ops.make_schedule`, on the
device). Chunks a block's rows cannot see (past its last token's position,
before a window) are not on the grid; pages past a sequence's length are
never copied, and a decode step computes a chunk its sequence fills only in
part `DECODE_COMPUTE_KEYS` at a time, over the parts its pages fill. A block
with no live token gets one step, to write its zeros.
On a megacore (v5p) the step list is cut in two parts at a block boundary
near its middle, one per core ("parallel"): each part starts its own chain
of copies, and a part shorter than the other idles through its last steps
on its own last block (no copy, no compute, no write to another part's
block).

Masking. Each row carries the range of keys it sees as positions in a
"global" key space where sequence s's position j is s * key_stride + j
(key_stride: the page table's length rounded up to whole chunks, so that no
chunk's columns reach another sequence), so one compare per bound also keeps
a row to its own sequence. Statistics are f32 in base 2, as in flash
attention; a sink enters as the softmax's starting max and sum.
Quantized caches: K's scale multiplies the softmax scale, V's divides the
softmax's sum, so the chunks enter the matmuls as they are stored. The two
scales are an operand (SMEM), not compile-time constants: a model whose layers
each have their own scales compiles the kernel once, and scales held in device
tensors (as serving engines hold them) are never read back to the host.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._shared.attention_math import LANES, MASKED, dot, lanes, scores, start_rows


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_q: int  # query tokens per block (its rows are block_q * G)
    pages_per_block: int  # pages per K/V chunk
    # Keys a step computes at a time in a chunk its sequence fills only in part, over the parts its
    # pages fill (a full chunk is computed at once): a multiple of the page size dividing the chunk.
    # None: DECODE_COMPUTE_KEYS for decode-sized blocks, else the whole chunk.
    compute_keys: int | None = None


@dataclasses.dataclass(frozen=True)
class Options:
    """The static part of a call."""
    scale: float  # the softmax scale (k_scale is an operand: `ragged_paged_attention`'s kv_scales)
    softcap: float  # 0: none
    has_sinks: bool
    groups: int  # query heads per KV head (G)
    page_size: int
    key_stride: int  # the stride of the global key positions: the sequences' chunks span it
    windowed: bool  # a sliding window: pages before a sequence's window start are not copied
    head_major: bool = False  # the caches are [pages, Hkv, page_size, D] (`ops.CACHE_LAYOUTS`)


# The most query rows (heads together times a block's rows) for which heads sharing a cache word
# are attended together (`_kernel`); decode blocks have 8 to 16 rows per head, prefill blocks 64 and more.
TOGETHER_MAX_ROWS = 64
# Keys a decode step computes at a time in a chunk its sequence fills only in part (its last), for
# as many as its pages hold: that chunk costs its pages' work, not a whole chunk's (a decode step's
# cycles go to loading its keys and values, MODELED). Prefill blocks compute their whole chunk.
DECODE_COMPUTE_KEYS = 256
PAGES_PER_TRIP = 8  # page copies a loop trip starts: its test and index updates are paid once for them all


def lane_tiles(d: int) -> int:
    """Rows a head's key of d lanes takes in the kernel's view of a page: Mosaic's strided load
    wants rows of at most 128 lanes, so a key of 256 lanes is two rows of 128."""
    return d // LANES if d > LANES and d % LANES == 0 else 1


def compute_pages(blocks: BlockSizes, page_size: int, rows: int) -> int:
    """Pages of its chunk a step computes at a time (`BlockSizes.compute_keys`); rows: a block's."""
    if blocks.compute_keys is not None:
        pages = blocks.compute_keys // page_size
        if blocks.compute_keys % page_size or pages < 1 or blocks.pages_per_block % pages:
            raise ValueError(f"compute_keys={blocks.compute_keys} must be a multiple of the page size ({page_size}) "
                             f"dividing a chunk's {blocks.pages_per_block * page_size} keys")
        return pages
    pages = max(1, DECODE_COMPUTE_KEYS // page_size)
    # (A chunk cut to a short page table may hold a number of pages the parts do not divide.)
    return pages if rows <= TOGETHER_MAX_ROWS and blocks.pages_per_block % pages == 0 else blocks.pages_per_block


def page_bytes(page_size: int, hkv: int, d: int, dtype) -> int:
    """The bytes one page copy moves: the page's rows, each padded to whole 128-lane tiles as the
    row-major cache holds them in HBM (`ops.CACHE_MAJOR_TO_MINOR`): head_dim 64 moves 2x its keys."""
    return page_size * hkv * -(-d // LANES) * LANES * jnp.dtype(dtype).itemsize


def chunk_pages(kv_len, seq_lo, chunk, pages_per_block: int, page_size: int):
    """(first, end): the pages of a sequence's chunk a step copies, first <= page < end: those
    holding keys its new tokens can see (none past kv_len, none before seq_lo, where a sliding
    window starts for its first new token; seq_lo None: no window, first is 0)."""
    chunk_start = chunk * pages_per_block * page_size
    first = 0 if seq_lo is None else jnp.clip((seq_lo - chunk_start) // page_size, 0, pages_per_block)
    return first, jnp.clip(pl.cdiv(kv_len - chunk_start, page_size), 0, pages_per_block)


def _global_step(part, i, part_first, part_count):
    """(step in the step arrays, whether it runs) of grid step (part, i): past its part's
    count, the part's last step, not run."""
    count = part_count[part]
    return part_first[part] + jnp.clip(i, 0, jnp.maximum(count - 1, 0)), i < count


def query_block(part, i, part_first, part_count, step_block, spare: int):
    """The query block grid step (part, i) reads and writes: its step's, or the spare block for a
    part with no step (whose write-back must not land on a block the other part computes)."""
    return jnp.where(part_count[part] == 0, spare, step_block[_global_step(part, i, part_first, part_count)[0]])


def _kernel(part_first, part_count, step_block, step_seq, step_chunk, step_works, kv_lens, seq_lo,  # scalar prefetch
            pages_now, pages_next, q_ref, lo_ref, hi_ref, sink_ref, kv_scales, k_hbm, v_hbm,  # inputs
            o_ref,  # output
            k_buf, v_buf, sems, m_ref, l_ref, acc_ref, lo_cols, hi_cols,  # scratch
            *, opts: Options, blocks: BlockSizes):
    part, i = pl.program_id(0), pl.program_id(1)
    g, runs = _global_step(part, i, part_first, part_count)
    count = part_count[part]
    ppb, page_size = blocks.pages_per_block, opts.page_size
    chunk = ppb * page_size
    hkv = q_ref.shape[0]
    slot = i % 2
    window_start = lambda seq: seq_lo[seq] if opts.windowed else None

    # Buffers [2, ppb, a page]: a page's address is a constant step from its trip's first, a few
    # scalar ops per copy (a step issues hundreds), and a page of part of a tile
    # (one KV head, 8-bit) lands on a tile of its own, as a DMA must.
    page_rows = lambda buf, into, p: buf.at[into, p]
    pages_rows = lambda buf, into, n: buf.at[into, pl.ds(0, n)]

    def strided_rows(buf, start: int, stride: int, pages):
        """Rows start, start + stride, ... of this step's token-major chunk ([2, ppb, page rows,
        lanes] buffers) in `pages` (a pl.ds) as [keys, lanes]: a strided load of whole rows in
        each page."""
        rows = buf.at[slot, pages][:, pl.ds(start, page_size, stride=stride), :]
        return rows.reshape(pages.size * page_size, rows.shape[-1])

    unroll = min(PAGES_PER_TRIP, ppb)

    def page_trips(step):
        """(first page, full trips of `unroll` pages, pages left) of the step's chunk: the pages its
        new tokens see. None is past kv_len or out of the cache: ops runs no sequence when an index
        it uses is out of range."""
        seq = step_seq[step]
        first, end = chunk_pages(kv_lens[seq], window_start(seq), step_chunk[step], ppb, page_size)
        full = (end - first) // unroll
        return first, full, end - first - full * unroll

    def loop(trips, body):
        jax.lax.fori_loop(0, trips, lambda j, carry: (body(j), carry)[1], None)

    def buffers():
        return enumerate(((k_hbm, k_buf), (v_hbm, v_buf)))

    def start(step, pages, into):
        """A copy per page, `unroll` to a trip (a guarded copy per page spent a branch on each)."""
        first, full, left = page_trips(step)

        def copy(p):
            page = pages[0, p]  # (read once: Mosaic loads it again for each use)
            for kind, (src, buf) in buffers():
                pltpu.make_async_copy(src.at[page], page_rows(buf, into, p), sems.at[kind, into]).start()

        loop(full, lambda j: [copy(first + j * unroll + u) for u in range(unroll)])
        loop(left, lambda j: copy(first + full * unroll + j))

    def wait(step, into):
        """A wait counts bytes, whichever pages they were: one wait per `unroll` pages."""
        _, full, left = page_trips(step)

        def wait_pages(n):
            for kind, (_, buf) in buffers():
                pltpu.make_async_copy(pages_rows(buf, into, n), pages_rows(buf, into, n), sems.at[kind, into]).wait()

        loop(full, lambda _: wait_pages(unroll))
        loop(left, lambda _: wait_pages(1))

    @pl.when(runs & (i == 0) & (step_works[g] == 1))
    def _first_copy():
        start(g, pages_now, slot)

    # The next step's chunk is copied while this one computes.
    nxt = jnp.minimum(g + 1, step_block.shape[0] - 1)

    @pl.when((i + 1 < count) & (step_works[nxt] == 1))
    def _next_copy():
        start(nxt, pages_next, 1 - slot)

    block = step_block[g]
    first_of_block = runs & ((i == 0) | (step_block[jnp.maximum(g - 1, 0)] != block))
    last_of_block = runs & ((i + 1 == count) | (step_block[nxt] != block))

    @pl.when(first_of_block)
    def _init():
        # Each row's bounds over 128 lanes, broadcast once per block: a row block of any multiple of
        # 8 rows (a decode block may hold 8) has its bounds as a column, not a lane-dense row.
        lo_cols[...] = jnp.broadcast_to(lo_ref[...], lo_cols.shape)
        hi_cols[...] = jnp.broadcast_to(hi_ref[...], hi_cols.shape)
        start_rows(m_ref, l_ref, acc_ref, sink_ref, opts.has_sinks)

    def zero_unfilled_values(seq, first, page_first, page_end, read_first, read_end):
        """V rows no copy of this step filled that its compute reads (pages read_first <= p <
        read_end before the sequence's window or past its end, the last page's rows past its
        end) hold what an earlier chunk, the cache's unwritten slots or uninitialised VMEM left:
        their scores are masked, but 0 * NaN is not 0, so they are zeroed in place (garbage K
        only reaches masked scores). A chunk the sequence fills writes nothing."""

        def zero_page(p):
            page = page_rows(v_buf, slot, p)
            page[...] = jnp.zeros(page.shape, page.dtype)

        loop(page_first - read_first, lambda j: zero_page(read_first + j))
        loop(read_end - page_end, lambda j: zero_page(page_end + j))
        filled = kv_lens[seq] - first - (page_end - 1) * page_size  # tokens of the last page copied

        @pl.when((page_end > page_first) & (filled < page_size))
        def _():
            page = page_rows(v_buf, slot, page_end - 1)  # [page_size * Hkv rows, D] or [Hkv, page_size, D]
            token = jax.lax.broadcasted_iota(jnp.int32, page.shape, 1 if opts.head_major else 0)
            if not opts.head_major:
                token = token // (page.shape[0] // page_size)
            page[...] = jnp.where(token < filled, page[...], jnp.zeros(page.shape, page.dtype))

    @pl.when(runs & (step_works[g] == 1))
    def _step():
        wait(g, slot)
        seq, first = step_seq[g], step_chunk[g] * chunk
        first_key = seq * opts.key_stride + first
        rows = lo_cols.shape[0]
        # Token-major pages of a packed dtype (bf16, 8-bit) hold `together` heads of a token in
        # each 32-bit word (heads minor, a head in one row of <= 128 lanes): a strided load of the
        # words, seen in the cache's dtype, is those heads' keys interleaved by token (row
        # together * t + e: token t of the group's head e). At decode's few rows those heads are
        # attended together, each row masked to its own head's columns: the scores and softmax
        # cover `together` times the columns, but no head is split out of the words (a strided
        # load of packed rows unpacks and repacks every row: about 1.5x the head-major
        # attention's cycles on v6e and tpu7x, MODELED). Prefill's many rows keep a head at a time.
        packing = 4 // k_buf.dtype.itemsize
        one_row_heads = k_buf.shape[-2] == page_size * hkv and v_buf.shape[-2] == page_size * hkv
        together = (packing if not opts.head_major and one_row_heads and hkv % packing == 0 and hkv > 1
                    and k_buf.dtype == v_buf.dtype and packing * rows <= TOGETHER_MAX_ROWS else 1)
        part_pages = compute_pages(blocks, page_size, rows)
        page_first, page_end = chunk_pages(kv_lens[seq], window_start(seq), step_chunk[g], ppb, page_size)
        part_first, part_end = page_first // part_pages, pl.cdiv(page_end, part_pages)
        # Value rows no copy filled must not reach the PV matmul (0 * NaN is not 0): zeroed in VMEM
        # once per partial chunk (`zero_unfilled_values`), or, for a head-major cache of 16 or 32
        # bits, masked as each head's values are read (there the mask rides on whole-tile loads and
        # the zeroing's stores cost more, MODELED on tpu7x).
        masks_values = opts.head_major and v_buf.dtype.itemsize > 1
        if not masks_values:
            read = (0, ppb) if part_pages == ppb else (part_first * part_pages, part_end * part_pages)
            zero_unfilled_values(seq, first, page_first, page_end, *read)

        def head_rows(buf, h, pages):
            """Keys (or values) of the chunk's `pages` (a pl.ds) for heads h .. h + together - 1.
            Head-major pages: whole tiles of each page. Token-major: every hkv-th row (or word),
            one strided load per 128 lanes (`lane_tiles`), no relayout. (Through .at[slot]:
            Mosaic refuses a dynamic index beside a strided one on packed dtypes.)"""
            if opts.head_major:
                return buf.at[slot, pages][:, h].reshape(pages.size * page_size, buf.shape[-1])
            n = buf.shape[2] // (page_size * hkv)
            if together > 1:
                words = strided_rows(buf.bitcast(jnp.uint32), h // together, hkv // together, pages)
                return pltpu.bitcast(words, buf.dtype)
            parts = [strided_rows(buf, h * n + j, hkv * n, pages) for j in range(n)]
            return parts[0] if n == 1 else jnp.concatenate(parts, axis=1)

        stack = lambda values: values[0] if together == 1 else jnp.concatenate(values, axis=0)
        score_scale = opts.scale * kv_scales[0]

        def attend(first_page, num_pages: int):
            """The online-softmax update of every head over the chunk's pages first_page ..
            first_page + num_pages - 1."""
            key0 = first_page * page_size
            width = together * num_pages * page_size
            cols = jax.lax.broadcasted_iota(jnp.int32, (together * rows, width), 1)
            bound = lambda ref, shift: lanes(jnp.tile(ref[...] - (first_key + key0) + shift, (together, 1)) * together,
                                             width)
            visible = (cols >= bound(lo_cols, 0)) & (cols < bound(hi_cols, 1))
            if together > 1:
                row_head = jax.lax.broadcasted_iota(jnp.int32, cols.shape, 0) // rows
                visible &= cols % together == row_head
            stored = None
            if masks_values:
                key = jax.lax.broadcasted_iota(jnp.int32, (num_pages * page_size, 1), 0) + key0
                stored = key < kv_lens[seq] - first
                if opts.windowed:
                    stored &= key >= page_first * page_size
            pages = pl.ds(first_page, num_pages)
            for h0 in range(0, hkv, together):  # the KV heads: a page holds them all, head-minor
                heads = range(h0, h0 + together)
                q = stack([q_ref[h] for h in heads])
                # An 8-bit cache goes into bf16 products as stored: Mosaic widens it on its way into
                # the MXU, where widening an fp8 chunk first, in the vector units, costs v6e about as
                # much again as the chunk's products. f32 products take it widened (exactly).
                k, v = (rows_ if q.dtype == jnp.bfloat16 and rows_.dtype.itemsize == 1 else rows_.astype(q.dtype)
                        for rows_ in (head_rows(k_buf, h0, pages), head_rows(v_buf, h0, pages)))
                if stored is not None:
                    v = jnp.where(stored, v, 0)
                s = jnp.where(visible, scores(q, k, score_scale, opts.softcap)[0], MASKED)
                m_prev = stack([m_ref[h] for h in heads])
                m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
                # A row that has seen no key yet (m_new still MASKED) gets p = 1 for its hidden keys
                # here: the first key it sees scales them away (alpha = 0), and _finish zeroes a row
                # that sees none.
                p = jnp.exp2(s - lanes(m_new, width))
                alpha = jnp.exp2(m_prev - m_new)
                l_new = alpha * stack([l_ref[h] for h in heads]) + jnp.sum(p, axis=1, keepdims=True)
                acc_new = (lanes(alpha, acc_ref.shape[2]) * stack([acc_ref[h] for h in heads])
                           + dot(p.astype(q.dtype), v, 1, 0))
                for e, h in enumerate(heads):
                    cut = slice(e * rows, (e + 1) * rows)
                    m_ref[h], l_ref[h], acc_ref[h] = m_new[cut], l_new[cut], acc_new[cut]

        if part_pages == ppb:
            attend(0, ppb)
        else:
            # A chunk its sequence fills is computed whole (one part at a time costs more per key).
            whole = (page_first == 0) & (page_end == ppb)
            pl.when(whole)(lambda: attend(0, ppb))
            pl.when(~whole)(lambda: loop(part_end - part_first,
                                         lambda j: attend((part_first + j) * part_pages, part_pages)))

    @pl.when(last_of_block)
    def _finish():
        width = acc_ref.shape[2]
        for h in range(o_ref.shape[0]):
            m, l = m_ref[h], l_ref[h]
            # A row saw a key or a sink; a NaN score (which a max may skip, a sum does not) is passed on.
            seen = (m != MASKED) | jnp.isnan(l)
            l = jnp.where(seen, l, 1.0) / kv_scales[1]
            o_ref[h] = jnp.where(lanes(seen, width), acc_ref[h] / lanes(l, width), 0.0).astype(o_ref.dtype)


def ragged_paged_attention(q, k_cache, v_cache, kv_lens, seq_lo, page_chunks, row_lo, row_hi, sink_rows, kv_scales,
                           schedule, *, opts: Options, blocks: BlockSizes, interpret, name="ragged_paged_attention"):
    """o [Hkv, T*G, Dv] in q's dtype; blocks no step covers hold whatever VMEM held.

    q [Hkv, T*G, D] (T a multiple of block_q, its last block a spare no step covers: a part with no
    step of its own idles there); k_cache [pages, page_size, Hkv, D] ([pages, Hkv, page_size, D]
    with opts.head_major), v_cache [.., Dv]; kv_lens [S] int32; seq_lo [S] int32: the first position a sequence's new
    tokens see (0 without a sliding window); page_chunks [S, chunks, 1, pages_per_block] int32
    (a sequence's page table cut in chunks); row_lo, row_hi [T*G, 1] int32 (global key
    positions); sink_rows [Hkv, block_q*G, 1] f32; kv_scales [2] f32: the caches' k_scale and
    v_scale (1 for an unquantized cache); schedule: `ops.make_schedule`'s step arrays.
    """
    hkv, rows, d = q.shape
    dv = v_cache.shape[3]
    rows_per_block = blocks.block_q * opts.groups
    spare = rows // rows_per_block - 1  # `query_block`
    ppb, page_size = blocks.pages_per_block, opts.page_size
    if opts.head_major:  # pages copied as they are, [Hkv, page_size, D]
        k_pages, v_pages = k_cache, v_cache
    else:
        # A page as [page_size * Hkv, D] (token-major, head-minor): the same bytes (XLA adds no copy,
        # checked in libtpu's compile), so a chunk's head is a strided load of whole rows.
        # (A head_dim past 128 lanes as rows of 128: `lane_tiles`.)
        k_pages, v_pages = (c.reshape(c.shape[0], page_size * hkv * lane_tiles(c.shape[3]),
                                      c.shape[3] // lane_tiles(c.shape[3])) for c in (k_cache, v_cache))
    buffer = lambda pages: pltpu.VMEM((2, ppb, *pages.shape[1:]), pages.dtype)  # two chunks of ppb pages
    parts = schedule.part_first.shape[0]
    last = schedule.block.shape[0] - 1

    def q_block(part, i, first, count, block, *_):
        return 0, query_block(part, i, first, count, block, spare), 0

    def row_block(part, i, first, count, block, *_):
        return query_block(part, i, first, count, block, spare), 0

    def chunk_now(part, i, first, count, block, seq, chunk, *_):
        g = _global_step(part, i, first, count)[0]
        return seq[g], chunk[g], 0, 0

    def chunk_next(part, i, first, count, block, seq, chunk, *_):
        n = jnp.minimum(_global_step(part, i, first, count)[0] + 1, last)
        return seq[n], chunk[n], 0, 0

    smem_chunk = lambda index_map: pl.BlockSpec((None, None, 1, ppb), index_map, memory_space=pltpu.SMEM)
    return pl.pallas_call(
        functools.partial(_kernel, opts=opts, blocks=blocks),
        out_shape=jax.ShapeDtypeStruct((hkv, rows, dv), q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=8,
            grid=(parts, jnp.maximum(jnp.max(schedule.part_count), 1)),
            in_specs=[
                smem_chunk(chunk_now),
                smem_chunk(chunk_next),
                pl.BlockSpec((hkv, rows_per_block, d), q_block),
                pl.BlockSpec((rows_per_block, 1), row_block),
                pl.BlockSpec((rows_per_block, 1), row_block),
                pl.BlockSpec((hkv, rows_per_block, 1), lambda *_: (0, 0, 0)),
                pl.BlockSpec(memory_space=pltpu.SMEM),
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec((hkv, rows_per_block, dv), q_block),
            scratch_shapes=[
                buffer(k_pages),
                buffer(v_pages),
                pltpu.SemaphoreType.DMA((2, 2)),  # (K or V, buffer)
                pltpu.VMEM((hkv, rows_per_block, LANES), jnp.float32),  # m
                pltpu.VMEM((hkv, rows_per_block, LANES), jnp.float32),  # l
                pltpu.VMEM((hkv, rows_per_block, dv), jnp.float32),  # acc
                pltpu.VMEM((rows_per_block, LANES), jnp.int32),  # lo
                pltpu.VMEM((rows_per_block, LANES), jnp.int32),  # hi
            ],
        ),
        # A part's steps carry the K/V copies from one to the next: they run in order on one core.
        # No run-time bounds check on the page copies: libtpu's checks cost about half of each
        # copy's issue cycles (a quarter of a v6e decode step's, modeled), and ops runs no sequence at all when an
        # index it uses is out of range, so no copy can address memory outside the cache.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             disable_bounds_checks=True),
        interpret=interpret,
        name=name,
    )(schedule.part_first, schedule.part_count, schedule.block, schedule.seq, schedule.chunk, schedule.works,
      kv_lens, seq_lo, page_chunks, page_chunks, q, row_lo, row_hi, sink_rows, kv_scales, k_pages, v_pages)


# ---------------------------------------------------------------- cache write

TOKENS_PER_WRITE_STEP = 8  # the copies one grid step starts before it waits for them


def _write_kernel(slots, key_ref, value_ref, _k_in, _v_in, k_out, v_out, sems, *, page_size: int):
    step = pl.program_id(0)
    num_slots = k_out.shape[0] * page_size
    copies = []
    for j in range(TOKENS_PER_WRITE_STEP):
        t = step * TOKENS_PER_WRITE_STEP + j
        slot = slots[t]
        page, row = slot // page_size, slot % page_size
        runs = (slot >= 0) & (slot < num_slots)  # -1: padding; past the cache: reported by ops, never written
        for src, dst, sem in ((key_ref, k_out, sems.at[0]), (value_ref, v_out, sems.at[1])):
            copies.append((runs, pltpu.make_async_copy(src.at[t], dst.at[page, row], sem)))
    for runs, copy in copies:
        pl.when(runs)(copy.start)
    for runs, copy in copies:
        pl.when(runs)(copy.wait)


def write_cache(key, value, k_cache, v_cache, slots, *, interpret):
    """(k_cache, v_cache) with key[t], value[t] ([T, Hkv, D], in the caches' dtypes; T a
    multiple of TOKENS_PER_WRITE_STEP) copied to slot slots[t] (page * page_size + row), in
    place: the caches are aliased to the outputs."""
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_write_kernel, page_size=k_cache.shape[1]),
        out_shape=(jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(key.shape[0] // TOKENS_PER_WRITE_STEP,),
            in_specs=[any_space] * 4,
            out_specs=[any_space] * 2,
            scratch_shapes=[pltpu.SemaphoreType.DMA((2,))],
        ),
        input_output_aliases={3: 0, 4: 1},  # operand indices count the scalar prefetch
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="reshape_and_cache",
    )(slots, key, value, k_cache, v_cache)
