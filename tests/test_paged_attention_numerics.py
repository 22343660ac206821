"""paged_attention's kernel in Pallas interpret mode against the reference (f64): random mixes
of decode, prefill and chunked prefill over shuffled pages, every option, every cache dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
from jax.experimental.pallas import tpu as pltpu

from paged_attention import ops, reference, tuning
from paged_attention.kernel import BlockSizes
from sampling import sample
from errors import max_abs, max_error

# fp32: the kernel's products and sums in f32 (HIGHEST), the reference's in f64: only f32 rounding
# and reassociation separate them (the bound is 1e-4; this is 2e-5 of the largest value).
FP32_TOLERANCE = 2e-5

# (name, new tokens per sequence, context lengths (new tokens included), Hq, Hkv, D, page size,
# blocks, options). The lengths mix decode (1 new token), prefill (all new), chunked prefill
# (some cached), an idle sequence (0 new), sequences straddling query blocks and chunks.
CASES = [
    ("gqa_mixed", [1, 20, 0, 37, 1, 9], [30, 20, 5, 100, 128, 64], 4, 2, 64, 16, BlockSizes(8, 2), {}),
    ("mqa_window_softcap_sinks", [1, 33, 5], [70, 33, 90], 8, 1, 64, 16, BlockSizes(16, 2),
     dict(sliding_window=24, softcap=5.0, sinks=True, softmax_scale=0.2)),
    ("d128_page32_decode", [1, 1, 1, 1], [1, 33, 64, 95], 2, 2, 128, 32, BlockSizes(8, 1), {}),
    ("d256_mha_prefill", [40, 3], [40, 50], 2, 2, 256, 16, BlockSizes(16, 4), dict(sliding_window=17)),
]


def _inputs(case, dtype, cache_dtype=None, seed=0, extra_seqs=1, extra_tokens=3, pages_per_seq=None):
    """Sequences' pages shuffled over a cache with spare pages; the arrays padded with
    `extra_seqs` dead sequences past num_seqs and `extra_tokens` tokens past the last."""
    _, q_lens, kv_lens, hq, hkv, d, page_size, _, options = case
    rng = np.random.default_rng(seed)
    live = len(q_lens)
    pages_per_seq = pages_per_seq or -(-max(kv_lens) // page_size) + 1
    num_pages = (live + extra_seqs) * pages_per_seq + 3
    page_indices = rng.permutation(num_pages)[: (live + extra_seqs) * pages_per_seq]
    page_indices = page_indices.reshape(live + extra_seqs, pages_per_seq).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens + [0] * extra_seqs)]).astype(np.int32)
    kv = np.asarray(kv_lens + [0] * extra_seqs, np.int32)
    cache_dtype = cache_dtype or dtype
    q = jnp.asarray(rng.standard_normal((int(cu[-1]) + extra_tokens, hq, d)), dtype)
    k_cache = jnp.asarray(rng.standard_normal((num_pages, page_size, hkv, d)), jnp.float32).astype(cache_dtype)
    v_cache = jnp.asarray(rng.standard_normal((num_pages, page_size, hkv, d)), jnp.float32).astype(cache_dtype)
    options = dict(options)
    if options.get("sinks"):
        options["sinks"] = jnp.asarray(rng.standard_normal(hq), dtype)
    args = (q, k_cache, v_cache, jnp.asarray(kv), jnp.asarray(page_indices), jnp.asarray(cu), live)
    return args, options


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_matches_the_reference_in_fp32(case):
    args, options = _inputs(case, jnp.float32)
    out = ops.ragged_paged_attention(*args, blocks=case[7], **options)
    expected = reference.ragged_paged_attention(*args, **options)
    assert out.shape == args[0].shape and out.dtype == jnp.float32
    assert max_error(out, expected) <= FP32_TOLERANCE * max_abs(expected)
    live_tokens = int(args[5][args[6]])
    assert not np.any(np.asarray(out[live_tokens:])), "tokens past the live sequences must get zeros"


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c[0])
def test_bf16_is_the_reference_rounded(case):
    """bf16 q and cache are exact; scores and statistics are f32; the probabilities enter the
    PV matmul rounded to bf16 (2^-9 relative) and the output is rounded to bf16 (2^-9):
    within 2^-8 of max |v| per element."""
    args, options = _inputs(case, jnp.bfloat16)
    out = ops.ragged_paged_attention(*args, blocks=case[7], **options)
    assert out.dtype == jnp.bfloat16
    expected = reference.ragged_paged_attention(*args, **options)
    assert max_error(out, expected) <= 2**-8 * max_abs(args[2].astype(jnp.float32))


# A token-major 8-bit page of two KV heads fills an 8-bit tile; of one KV head, half of one (each
# page has an index of its own in the kernel's buffers either way).
@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c[0])
@pytest.mark.parametrize("cache_dtype", [jnp.float8_e4m3fn, jnp.int8], ids=["fp8", "int8"])
def test_quantized_cache_is_read_times_its_scale(cache_dtype, case):
    """The stored values enter the matmuls exactly (fp8 and int8 are exact in f32); k_scale
    scales the scores, v_scale the output, as the reference's dequantized cache does."""
    args, options = _inputs(case, jnp.float32, cache_dtype)
    if cache_dtype == jnp.int8:  # standard normal values would round to -3..3: use the range
        q, k, v, *rest = args
        rng = np.random.default_rng(5)
        k, v = (jnp.asarray(rng.integers(-127, 128, x.shape), jnp.int8) for x in (k, v))
        args = (q, k, v, *rest)
    scales = dict(k_scale=0.013, v_scale=0.021)
    out = ops.ragged_paged_attention(*args, blocks=case[7], **scales)
    expected = reference.ragged_paged_attention(*args, **scales)
    assert max_error(out, expected) <= FP32_TOLERANCE * max_abs(expected)


# Gemma 4's global layers: head_dim 512 (four 128-lane rows per key in a token-major page), two KV
# heads, decode beside prefill, on the default blocks (the widest tuned entry's, cut to fit).
HEAD_DIM_512 = ("gemma4_global_d512", [1, 12, 1], [30, 12, 70], 4, 2, 512, 16, None, dict(sinks=True))


@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.int8], ids=["bf16", "fp8", "int8"])
def test_head_dim_512(cache_dtype):
    """bf16 q over each cache dtype against the reference over the same stored values: bf16's
    bound (test_bf16_is_the_reference_rounded) for every dtype, the stored values entering the
    matmuls exactly (int8 values in -127..127, distinct k and v scales)."""
    args, options = _inputs(HEAD_DIM_512, jnp.bfloat16, cache_dtype if cache_dtype != jnp.int8 else jnp.bfloat16)
    scales = {}
    if cache_dtype == jnp.int8:
        q, k, v, *rest = args
        rng = np.random.default_rng(6)
        k, v = (jnp.asarray(rng.integers(-127, 128, x.shape), jnp.int8) for x in (k, v))
        args, scales = (q, k, v, *rest), dict(k_scale=0.011, v_scale=0.017)
    out = ops.ragged_paged_attention(*args, **options, **scales)
    expected = reference.ragged_paged_attention(*args, **options, **scales)
    largest_v = max_abs(args[2].astype(jnp.float32)) * scales.get("v_scale", 1.0)
    assert max_error(out, expected) <= 2**-8 * largest_v


# Eight KV heads of head_dim 128, decode beside a short prefill, a window, sinks and a cap: a bf16
# cache's 32-bit words hold two heads of a token, an 8-bit cache's four, which decode blocks attend
# together (the kernel's `together`); each head its own q (distinct heads would hide no swap).
WORD_HEADS = ("word_heads", [1, 1, 1, 5], [40, 17, 64, 30], 16, 8, 128, 16, BlockSizes(4, 2),
              dict(sliding_window=28, sinks=True, softcap=8.0))


# jax 0.10.2's TPU interpreter cannot read through a bitcast view of a buffer ("'BitcastTransform'
# object has no attribute 'indices'"): these words' reads are checked in plain interpret mode only;
# the copies and waits around them are those every other TPU-interpreter case checks. Strict: the
# day jax reads them, this fails and the case joins test_kernel_passes_the_tpu_interpreter.
TPU_INTERPRETER_BITCAST = pytest.mark.xfail(raises=jax.errors.JaxRuntimeError, strict=True,
                                            reason="the TPU interpreter reads no bitcast view in jax 0.10.2")


def _unheld_slots_nan(args):
    """args with every cache slot no live sequence holds NaN: a part of a chunk computed past its
    sequence's pages, or a value row left unzeroed, puts NaN in the output."""
    q, k, v, kv_lens, page_indices, *rest = args
    held = np.zeros(k.shape[:2], bool)
    for length, pages in zip(np.asarray(kv_lens)[:args[6]], np.asarray(page_indices)):
        positions = np.arange(length)
        held[pages[positions // k.shape[1]], positions % k.shape[1]] = True
    k, v = (jnp.where(held[:, :, None, None], x, jnp.nan).astype(x.dtype) for x in (k, v))
    return (q, k, v, kv_lens, page_indices, *rest)


@pytest.mark.parametrize("cache_dtype,interpret", [
    (jnp.bfloat16, True), (jnp.float8_e4m3fn, True), (jnp.int8, True),
    pytest.param(jnp.bfloat16, "tpu", marks=TPU_INTERPRETER_BITCAST)],
    ids=["bf16", "fp8", "int8", "bf16_tpu_interpreter"])
def test_heads_sharing_a_cache_word(cache_dtype, interpret):
    """Token-major caches whose 32-bit words hold several heads of a token: each head's rows
    against the reference over the same stored values, within bf16's bound
    (test_bf16_is_the_reference_rounded; int8 values in -127..127, distinct k and v scales), the
    slots no sequence holds NaN (bf16, fp8); the TPU interpreter's case is a strict xfail
    (TPU_INTERPRETER_BITCAST)."""
    args, options = _inputs(WORD_HEADS, jnp.bfloat16, cache_dtype if cache_dtype != jnp.int8 else jnp.bfloat16)
    scales = {}
    if cache_dtype != jnp.bfloat16:
        q, k, v, *rest = args
        if cache_dtype == jnp.int8:
            rng = np.random.default_rng(7)
            k, v = (jnp.asarray(rng.integers(-127, 128, x.shape), jnp.int8) for x in (k, v))
        args, scales = (q, k, v, *rest), dict(k_scale=0.011, v_scale=0.017)
    if cache_dtype != jnp.int8:  # a page's rows past its sequence's end are read with it: they must not reach
        args = _unheld_slots_nan(args)  # the output (0 * NaN)
    if interpret == "tpu":
        interpret = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    out = ops.ragged_paged_attention(*args, blocks=WORD_HEADS[7], interpret=interpret, **options, **scales)
    if not isinstance(interpret, bool):
        assert tpu_interpreter.races.races_found is False
        pltpu.reset_tpu_interpret_mode_state()
    expected = reference.ragged_paged_attention(*args, **options, **scales)
    largest_v = float(np.nanmax(np.abs(np.asarray(args[2]).astype(np.float64)))) * scales.get("v_scale", 1.0)  # held ones
    assert max_error(out, expected) <= 2**-8 * largest_v


# Chunks of 8 pages computed 2 pages at a time (`BlockSizes.compute_keys`): sequences ending mid-part,
# mid-chunk, on a chunk's end, after a few keys; a window starting in a later part of a chunk.
PARTS = ("decode_parts", [1, 1, 1, 1, 3], [5, 40, 97, 128, 60], 8, 2, 64, 16, BlockSizes(4, 8, compute_keys=32), {})


@pytest.mark.parametrize("window", [None, 50], ids=["no_window", "window"])
@pytest.mark.parametrize("cache_layout", ["token_major", "head_major"])
def test_a_chunk_is_computed_in_the_parts_its_pages_fill(cache_layout, window):
    """fp32, against the reference, the slots no sequence holds NaN: only the parts of a chunk
    that hold a sequence's keys are computed, the unfilled rows of those parts zeroed."""
    args, options = _inputs(PARTS, jnp.float32)
    args = _unheld_slots_nan(args)
    options = dict(options, sliding_window=window)
    q, k, v, *rest = args
    caches = (_head_major(k), _head_major(v)) if cache_layout == "head_major" else (k, v)
    out = ops.ragged_paged_attention(q, *caches, *rest, blocks=PARTS[7], cache_layout=cache_layout, **options)
    expected = reference.ragged_paged_attention(*args, **options)
    assert max_error(out, expected) <= FP32_TOLERANCE * max_abs(expected)


def test_chunk_parts_pass_the_tpu_interpreter():
    """The parts loop under the TPU interpreter: no race, no read past the chunk's buffer, no
    uninitialised row reaching the output (NaN here)."""
    args, options = _inputs(PARTS, jnp.float32)
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    out = ops.ragged_paged_attention(*args, blocks=PARTS[7], interpret=params, sliding_window=50, **options)
    assert tpu_interpreter.races.races_found is False
    pltpu.reset_tpu_interpret_mode_state()
    expected = reference.ragged_paged_attention(*args, sliding_window=50, **options)
    assert max_error(out, expected) <= FP32_TOLERANCE * max_abs(expected)


def test_a_pairs_chunks_under_a_window_are_at_most_pair_chunks():
    """The step list's capacity under a sliding window (`ops.pair_chunks`) bounds the chunks of
    every pair: rows at every position a block can hold, windows of every width up to three
    chunks, counted as make_schedule counts them (a capacity short of a pair's chunks would cut
    the step list)."""
    chunk, num_chunks = 32, 64
    for block_q, only in ((1, "decode"), (8, "prefill"), (8, None), (40, "prefill")):
        for window in range(1, 3 * chunk + 2):
            bound = ops.pair_chunks(num_chunks, chunk, block_q, window, only)
            worst = 0
            for pos_first in range(0, 4 * chunk):
                pos_last = pos_first + block_q - 1
                first = max(pos_first - window + 1, 0) // chunk
                worst = max(worst, pos_last // chunk - first + 1)
            assert worst <= bound, (block_q, window, worst, bound)
            assert bound <= worst + 1  # and it is not much looser


def test_compute_keys_that_do_not_divide_a_chunk_raise():
    args, _ = _inputs(PARTS, jnp.float32)
    for keys in (24, 48, 0):
        with pytest.raises(ValueError, match="compute_keys"):
            ops.ragged_paged_attention(*args, blocks=BlockSizes(4, 8, compute_keys=keys))


def test_chunks_longer_than_the_page_table_stay_in_their_sequence():
    """pages_per_block past pages_per_seq (the default blocks with short page tables): a chunk
    spans more positions than a sequence has, and must not reach the next sequence's keys
    (sequences share the query block here)."""
    case = ("short_table", [1, 6, 3], [20, 40, 7], 4, 2, 64, 16, BlockSizes(8, 4), {})
    args, options = _inputs(case, jnp.float32, pages_per_seq=3)
    out = ops.ragged_paged_attention(*args, blocks=case[7])
    expected = reference.ragged_paged_attention(*args)
    assert max_error(out, expected) <= FP32_TOLERANCE * max_abs(expected)


def _kernels_rows(fn, *args):
    """{pallas_call name: query rows per block} of the kernels fn runs."""
    import jax

    calls = [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == "pallas_call"]
    return {e.params["name"]: e.params["grid_mapping"].block_mappings[2].block_shape[1].block_size for e in calls}


DEFAULT_BLOCK_CASES = {"decode": ([1, 1, 0, 1], "v6e"), "mixed": ([1, 2, 1, 7], "v6e"), "prefill": ([3, 2, 0, 9], "v6e"),
                       "one_decode_v5p": ([0, 1, 0, 0], "v5p")}


# Sampled (tests/sampling.py): a batch of decode and prefill sequences, and v5p's one decode
# sequence; all-decode and all-prefill batches repeat the mixed one's two kernels.
DEFAULT_BLOCK_SAMPLE = sample(DEFAULT_BLOCK_CASES, {"mixed", "one_decode_v5p"})


@pytest.mark.parametrize("q_lens,generation", [DEFAULT_BLOCK_CASES[n] for n in DEFAULT_BLOCK_SAMPLE],
                         ids=DEFAULT_BLOCK_SAMPLE)
def test_default_blocks_run_decode_sequences_in_8_row_blocks(q_lens, generation):
    """Without blocks, decode sequences run in one kernel with 8-row query blocks and the others
    in another with 128-row ones, each over its own sequences: decode-only, mixed, prefill-only
    (the decode kernel has no step) and a single decode token (on v5p one core gets no step and
    idles on the spare block) all match the reference, and tokens of no live sequence are zero
    (a dead entry past num_seqs claims 5 of them)."""
    case = ("default", q_lens, [40, 17, 9, 130], 4, 1, 64, 16, None, {})
    args, options = _inputs(case, jnp.float32)
    q, k_cache, v_cache, kv_lens, page_indices, cu, live = args
    cu = cu.at[-1].set(cu[-2] + 5)  # the dead entry
    args = (q, k_cache, v_cache, kv_lens, page_indices, cu, live)
    call = lambda *a: ops.ragged_paged_attention(*a, generation=generation)
    prefill_rows = 4 * tuning.prefill_blocks(4, 16, page_indices.shape[1], 64, jnp.float32, generation).block_q
    assert _kernels_rows(call, *args) == {"ragged_paged_attention_decode": 8, "ragged_paged_attention_prefill": prefill_rows}
    out = call(*args)
    expected = reference.ragged_paged_attention(*args)
    assert max_error(out, expected) <= FP32_TOLERANCE * max_abs(expected)
    assert not np.any(np.asarray(out[int(cu[live]):])), "tokens past the live sequences must get zeros"


@pytest.mark.parametrize("cache_layout,cache_dtype", [("token_major", jnp.float32), ("head_major", jnp.float32),
                                                      ("head_major", jnp.float8_e4m3fn)],
                         ids=["token_major", "head_major", "head_major_fp8"])
def test_pages_past_a_sequence_are_never_read(cache_layout, cache_dtype):
    """Every page past a sequence's length (and the stale rows of its last page) holds NaN, and
    the page table past them points out of the cache: the output is the reference's, finite, in
    either cache layout (an 8-bit head-major cache's unfilled rows are zeroed in VMEM, an f32
    one's masked as read)."""
    case = CASES[0]
    (q, k_cache, v_cache, kv_lens, page_indices, cu, live), options = _inputs(case, jnp.float32, cache_dtype)
    page_size = k_cache.shape[1]
    kv, table = np.asarray(kv_lens), np.asarray(page_indices).copy()
    stale = np.ones(k_cache.shape[:2], bool)
    for s in range(live):
        used = -(-int(kv[s]) // page_size)
        for j in range(used):
            rows = min(page_size, int(kv[s]) - j * page_size)
            stale[table[s, j], :rows] = False
        table[s, used:] = k_cache.shape[0] + 7
    poison = jnp.asarray(stale)[:, :, None, None]
    k_cache, v_cache = (jnp.where(poison, jnp.nan, x).astype(x.dtype) for x in (k_cache, v_cache))
    layout = _head_major if cache_layout == "head_major" else lambda cache: cache
    args = (q, layout(k_cache), layout(v_cache), kv_lens, jnp.asarray(table), cu, live)
    out = ops.ragged_paged_attention(*args, blocks=case[7], cache_layout=cache_layout, **options)
    clean = (q, jnp.where(poison, 0.0, k_cache), jnp.where(poison, 0.0, v_cache), kv_lens, jnp.asarray(table), cu, live)
    expected = reference.ragged_paged_attention(*clean, **options)
    assert bool(jnp.isfinite(out).all())
    assert max_error(out, expected) <= FP32_TOLERANCE * max_abs(expected)


def test_bf16_accumulators_are_f32():
    """One query (q = 0: every probability is exactly 1/n in bf16 and f32 alike) over 1024 keys:
    the first 128 values are 8, the rest 0.02. A bf16 accumulator (ulp 8 at 1024) would swamp the
    small ones (mean 1.0 instead of 1.0175); f32 keeps them."""
    page_size, pages = 16, 64
    q = jnp.zeros((1, 1, 128), jnp.bfloat16)
    k_cache = jnp.asarray(np.random.default_rng(0).standard_normal((pages, page_size, 1, 128)), jnp.bfloat16)
    position = jnp.arange(pages * page_size).reshape(pages, page_size, 1, 1)
    v_cache = jnp.broadcast_to(jnp.where(position < 128, 8.0, 0.02), k_cache.shape).astype(jnp.bfloat16)
    out = ops.ragged_paged_attention(q, k_cache, v_cache, jnp.asarray([1024], jnp.int32),
                                     jnp.arange(pages, dtype=jnp.int32)[None, :], jnp.asarray([0, 1], jnp.int32), 1,
                                     blocks=BlockSizes(8, 8))
    exact = (128 * 8.0 + 896 * float(jnp.bfloat16(0.02))) / 1024
    assert max_error(out, jnp.full(out.shape, exact)) <= 2**-8 * exact


@pytest.mark.parametrize("what,edit", [
    ("a used page out of the cache", lambda a: a.update(page_indices=a["page_indices"].at[1, 0].set(10**6))),
    ("more new tokens than context", lambda a: a.update(kv_lens=a["kv_lens"].at[1].set(3))),
    ("decreasing cu_q_lens", lambda a: a.update(cu_q_lens=a["cu_q_lens"].at[2].set(0))),
    ("context past the page table", lambda a: a.update(kv_lens=a["kv_lens"].at[0].set(10**4))),
    ("num_seqs past the arrays", lambda a: a.update(num_seqs=99)),
])
def test_invalid_index_values_make_the_output_nan(what, edit):
    """Index values are checked on the device (no round trip to the host): the output is NaN,
    and no kernel reads outside its inputs (the TPU interpreter test checks the copies)."""
    case = CASES[0]
    args, options = _inputs(case, jnp.float32)
    names = ("q", "k_cache", "v_cache", "kv_lens", "page_indices", "cu_q_lens", "num_seqs")
    named = dict(zip(names, args))
    edit(named)
    out = ops.ragged_paged_attention(*(named[n] for n in names), blocks=case[7], **options)
    assert bool(jnp.isnan(out).all()), what


@pytest.mark.parametrize("what,edit,error", [
    ("q rank", lambda a: a.update(q=a["q"][0]), "q must be"),
    ("head dim", lambda a: a.update(q=a["q"][..., :32]), "head_dim"),
    ("heads", lambda a: a.update(q=a["q"][:, :3]), "not a multiple"),
    ("cache dtype", lambda a: a.update(k_cache=a["k_cache"].astype(jnp.float16)), "k_cache must be one of"),
    ("kv_lens dtype", lambda a: a.update(kv_lens=a["kv_lens"].astype(jnp.float32)), "kv_lens must be int32"),
    ("cu_q_lens length", lambda a: a.update(cu_q_lens=a["cu_q_lens"][:-1]), "cu_q_lens has shape"),
    ("page table rows", lambda a: a.update(page_indices=a["page_indices"][:-1]), "page_indices has shape"),
    ("cache shapes", lambda a: a.update(v_cache=a["v_cache"][:-1]), "differ"),
])
def test_bad_shapes_and_dtypes_raise(what, edit, error):
    case = CASES[0]
    args, _ = _inputs(case, jnp.float32)
    names = ("q", "k_cache", "v_cache", "kv_lens", "page_indices", "cu_q_lens", "num_seqs")
    named = dict(zip(names, args))
    edit(named)
    with pytest.raises((ValueError, TypeError), match=error):
        ops.ragged_paged_attention(*(named[n] for n in names), blocks=case[7])


def test_options_out_of_range_raise():
    args, _ = _inputs(CASES[0], jnp.float32)
    with pytest.raises(ValueError, match="sliding_window"):
        ops.ragged_paged_attention(*args, sliding_window=0)
    with pytest.raises(ValueError, match="softcap"):
        ops.ragged_paged_attention(*args, softcap=-1.0)
    with pytest.raises(ValueError, match="sinks"):
        ops.ragged_paged_attention(*args, sinks=jnp.zeros((3,), jnp.float32))
    with pytest.raises(ValueError, match="cache_layout must be one of"):
        ops.ragged_paged_attention(*args, cache_layout="page_major")
    # A token-major cache passed as head-major: its kv_heads (its page size, 16) do not divide q's 4 heads.
    with pytest.raises(ValueError, match="not a multiple of the cache's 16 KV heads"):
        ops.ragged_paged_attention(*args, cache_layout="head_major")
    q, k_cache, v_cache = args[:3]
    with pytest.raises(ValueError, match=r"\[pages, kv_heads, page_size, head_dim\]"):
        ops.reshape_and_cache_flash(q[:, :2], q[:, :2], k_cache, v_cache, jnp.zeros((q.shape[0],), jnp.int32),
                                    cache_layout="head_major")


# Without blocks: decode sequences in 8-row blocks beside a prefill in 128-row ones, two KV heads
# read as strided loads.
DEFAULT_CASE = ("gqa_default_blocks", [1, 1, 6, 0, 1], [70, 1, 90, 12, 33], 8, 2, 64, 16, None, {})
# A window starting in the second page of the first chunk: that chunk's first page is not copied,
# and its buffer rows are uninitialised (NaN here) when they are read.
WINDOW_SKIP_CASE = ("window_skips_a_page", [1], [40], 2, 1, 64, 16, BlockSizes(8, 2), dict(sliding_window=10))


@pytest.mark.parametrize("case", [CASES[1], DEFAULT_CASE, WINDOW_SKIP_CASE, "HEAD_DIM_512"],
                         ids=lambda c: c if isinstance(c, str) else c[0])
def test_kernel_passes_the_tpu_interpreter(case):
    """The TPU interpreter (race detection, DMA bounds, uninitialised memory as NaN) over a mixed
    batch with a window and sinks, over the default blocks' two kernels, over a page skipped
    before a window (the copies of one chunk overlap the compute of the previous), and at Gemma
    4's head_dim 512 on the default blocks (four lane rows per key)."""
    case = HEAD_DIM_512 if case == "HEAD_DIM_512" else case  # defined below the cases it joins
    args, options = _inputs(case, jnp.float32)
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    out = ops.ragged_paged_attention(*args, blocks=case[7], interpret=params, **options)
    assert tpu_interpreter.races.races_found is False
    pltpu.reset_tpu_interpret_mode_state()
    expected = reference.ragged_paged_attention(*args, **options)
    assert max_error(out, expected) <= FP32_TOLERANCE * max_abs(expected)


def test_a_page_index_out_of_the_cache_is_never_copied():
    """The kernel copies the pages of the sequences it runs without checking each index (nor does
    libtpu: its run-time bounds checks are off): with one used page past the cache, ops runs none,
    the output is NaN, and the TPU interpreter (which fails a copy outside its array) sees no copy."""
    (q, k_cache, v_cache, kv_lens, page_indices, cu, live), options = _inputs(CASES[2], jnp.float32)
    page_indices = page_indices.at[1, 1].set(k_cache.shape[0])
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    out = ops.ragged_paged_attention(q, k_cache, v_cache, kv_lens, page_indices, cu, live, blocks=CASES[2][7],
                                     interpret=params, **options)
    pltpu.reset_tpu_interpret_mode_state()
    assert bool(jnp.isnan(out).all())


def _garbage_past_live(args, max_seqs, seed=0):
    """args padded to max_seqs sequences past num_seqs with garbage: cu_q_lens entries below the
    live ones' end (vLLM's 1 first: a search over unsorted offsets misplaces the live tokens),
    positive and negative kv_lens, and page indices far outside the cache."""
    q, k_cache, v_cache, kv_lens, page_indices, cu, live = args
    rng = np.random.default_rng(seed)
    extra = max_seqs - live
    cu = np.concatenate([np.asarray(cu)[:live + 1], [1], rng.integers(-1000, 2, extra - 1)])
    kv = np.concatenate([np.asarray(kv_lens)[:live], rng.integers(-50, 10**4, extra)])
    # Within the page table's width, so that a scheduled padding sequence would copy its pages.
    kv[live] = page_indices.shape[1] * k_cache.shape[1]
    table = np.concatenate([np.asarray(page_indices)[:live],
                            rng.integers(k_cache.shape[0], 10**6, (extra, page_indices.shape[1]))])
    return (q, k_cache, v_cache, jnp.asarray(kv, jnp.int32), jnp.asarray(table, jnp.int32),
            jnp.asarray(cu, jnp.int32), live)


@pytest.mark.parametrize("max_seqs", sample([8, 16], {16}))  # sampled (tests/sampling.py): 8 repeats 16
@pytest.mark.parametrize("blocks", [CASES[0][7], None], ids=["explicit_blocks", "default_blocks"])
def test_garbage_past_num_seqs_is_ignored(blocks, max_seqs):
    """JAX callers (engines) pad their batch to a fixed sequence count: whatever the arrays hold
    past num_seqs, the output is the reference's over the live sequences."""
    args, options = _inputs(CASES[0], jnp.float32, extra_seqs=0)
    padded = _garbage_past_live(args, max_seqs)
    out = ops.ragged_paged_attention(*padded, blocks=blocks, **options)
    expected = reference.ragged_paged_attention(*args, **options)
    assert max_error(out, expected) <= FP32_TOLERANCE * max_abs(expected)


def test_padding_sequences_pages_are_never_copied():
    """The kernel's copies run with bounds checks off: a padding sequence's page table (here far
    outside the cache, its kv_len the table's whole width) must never be copied. The TPU
    interpreter fails a copy outside its array."""
    args, options = _inputs(CASES[1], jnp.float32, extra_seqs=0)
    padded = _garbage_past_live(args, 8, seed=1)
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    out = ops.ragged_paged_attention(*padded, blocks=CASES[1][7], interpret=params, **options)
    assert tpu_interpreter.races.races_found is False
    pltpu.reset_tpu_interpret_mode_state()
    expected = reference.ragged_paged_attention(*args, **options)
    assert max_error(out, expected) <= FP32_TOLERANCE * max_abs(expected)


def test_scales_as_arrays_compile_once():
    """k_scale and v_scale as device arrays (as engines hold them) under jax.jit: one trace serves
    every value, and each call reads the cache times its own scales. A non-positive scale makes
    the output NaN, as invalid indices do."""
    case = CASES[0]
    args, _ = _inputs(case, jnp.float32, jnp.float8_e4m3fn)
    traces = []

    @jax.jit
    def attend(k_scale, v_scale):
        traces.append(1)
        return ops.ragged_paged_attention(*args, blocks=case[7], k_scale=k_scale, v_scale=v_scale)

    for k_scale, v_scale in ((0.5, 2.0), (0.25, 0.125)):
        out = attend(jnp.float32(k_scale), jnp.asarray([v_scale], jnp.float32))
        expected = reference.ragged_paged_attention(*args, k_scale=k_scale, v_scale=v_scale)
        assert max_error(out, expected) <= FP32_TOLERANCE * max_abs(expected)
    assert len(traces) == 1
    assert bool(jnp.isnan(attend(jnp.float32(-1.0), jnp.float32(1.0))).all())
    with pytest.raises(ValueError, match="k_scale must be a positive float or a one-element float array"):
        ops.ragged_paged_attention(*args, k_scale=jnp.ones((2,), jnp.float32))
    with pytest.raises(ValueError, match="v_scale must be positive and finite"):
        ops.ragged_paged_attention(*args, v_scale=0.0)


def _head_major(cache):
    """A token-major cache [pages, page_size, Hkv, D] as the same values held head-major."""
    return cache.transpose(0, 2, 1, 3)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_head_major_cache_matches_the_reference_in_fp32(case):
    (q, k_cache, v_cache, *rest), options = _inputs(case, jnp.float32)
    out = ops.ragged_paged_attention(q, _head_major(k_cache), _head_major(v_cache), *rest, blocks=case[7],
                                     cache_layout="head_major", **options)
    expected = reference.ragged_paged_attention(q, k_cache, v_cache, *rest, **options)
    assert max_error(out, expected) <= FP32_TOLERANCE * max_abs(expected)


def test_head_major_cache_gives_the_token_major_bits():
    """bf16: the kernel reads the same rows of the same chunks, in the same order, whatever the
    cache's layout."""
    (q, k_cache, v_cache, *rest), options = _inputs(CASES[0], jnp.bfloat16)
    out = ops.ragged_paged_attention(q, _head_major(k_cache), _head_major(v_cache), *rest, blocks=CASES[0][7],
                                     cache_layout="head_major", **options)
    token_major = ops.ragged_paged_attention(q, k_cache, v_cache, *rest, blocks=CASES[0][7], **options)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(token_major.astype(jnp.float32)))


def test_head_major_cache_passes_the_tpu_interpreter():
    """Head-major pages copied whole into the chunk buffers, a page skipped before a window (its
    rows uninitialised, NaN), the next chunk's copies beside this one's compute: no race, no
    copy out of bounds, the reference's output."""
    (q, k_cache, v_cache, *rest), options = _inputs(WINDOW_SKIP_CASE, jnp.float32)
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    out = ops.ragged_paged_attention(q, _head_major(k_cache), _head_major(v_cache), *rest,
                                     blocks=WINDOW_SKIP_CASE[7], cache_layout="head_major", interpret=params, **options)
    assert tpu_interpreter.races.races_found is False
    pltpu.reset_tpu_interpret_mode_state()
    expected = reference.ragged_paged_attention(q, k_cache, v_cache, *rest, **options)
    assert max_error(out, expected) <= FP32_TOLERANCE * max_abs(expected)


WRITE_HEADS, WRITE_DIM = 2, 128


def _write_inputs(seed, pages, page_size, tokens, cache_dtype, heads=WRITE_HEADS):
    """Token-major caches, new keys and values (3x the caches' scale), and distinct slots shuffled
    over the pages."""
    rng = np.random.default_rng(seed)
    cache = lambda: jnp.asarray(rng.standard_normal((pages, page_size, heads, WRITE_DIM)),
                                jnp.float32).astype(cache_dtype)
    new = lambda: jnp.asarray(rng.standard_normal((tokens, heads, WRITE_DIM)) * 3, jnp.float32)
    k_cache, v_cache, key, value = cache(), cache(), new(), new()
    return k_cache, v_cache, key, value, rng.permutation(pages * page_size)[:tokens].astype(np.int32)


@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
def test_head_major_cache_write_matches_the_token_major_one(cache_dtype):
    """Head-major caches (written by XLA's scatter) hold what the token-major write kernel
    stores, slot for slot; -1 slots and a slot past the cache write nothing."""
    pages, page_size = 5, 16
    k_cache, v_cache, key, value, slots = _write_inputs(5, pages, page_size, 19, cache_dtype)
    slots[[2, 9]] = -1
    slots[5] = pages * page_size + 3  # past the cache
    scales = (None, None) if cache_dtype == jnp.bfloat16 else (0.05, 0.11)
    want = ops.reshape_and_cache_flash(key, value, k_cache, v_cache, jnp.asarray(slots), *scales)
    got = ops.reshape_and_cache_flash(key, value, _head_major(k_cache), _head_major(v_cache), jnp.asarray(slots),
                                      *scales, cache_layout="head_major")
    for g, w in zip(got, want):
        assert g.dtype == cache_dtype and g.shape == _head_major(w).shape
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(_head_major(w).astype(jnp.float32)))


@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.int8], ids=["bf16", "fp8", "int8"])
def test_cache_write_puts_each_token_at_its_slot(cache_dtype):
    """New tokens land at their slots (shuffled over pages, rows anywhere in a page), -1
    slots are skipped, every other slot keeps its value, and key's rows past slot_mapping's 21
    (a caller's padding) are never written; quantized caches store key / k_scale and
    value / v_scale (distinct, so that a swap shows) rounded (int8: to the nearest integer,
    saturated)."""
    hkv, d = WRITE_HEADS, WRITE_DIM
    k_cache, v_cache, key, value, slots = _write_inputs(3, 6, 16, 24, cache_dtype)
    slots = slots[:21]
    slots[[4, 11]] = -1
    k_scale, v_scale = (None, None) if cache_dtype == jnp.bfloat16 else (0.05, 0.11)
    k_new, v_new = ops.reshape_and_cache_flash(key, value, k_cache, v_cache, jnp.asarray(slots), k_scale, v_scale)
    k_want, v_want = reference.reshape_and_cache(key, value, k_cache, v_cache, slots, ops.quantize, k_scale, v_scale)
    for got, want in ((k_new, k_want), (v_new, v_want)):
        assert got.dtype == cache_dtype
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    # The stored values are the inputs over their scale, to the dtype's rounding.
    for cache, new, scale in ((k_new, key, k_scale), (v_new, value, v_scale)):
        stored = cache.reshape(-1, hkv, d)[slots[slots >= 0]].astype(jnp.float32) * (scale or 1.0)
        expected = new[:21][slots >= 0]
        if cache_dtype == jnp.int8:
            expected = jnp.clip(expected, -128 * scale, 127 * scale)
            assert max_error(stored, expected) <= scale / 2 + 1e-6
        else:
            # Half an ulp: 7 and 3 mantissa bits; fp8's subnormals are 2^-9 apart.
            relative, absolute = (2**-8, 0.0) if cache_dtype == jnp.bfloat16 else (2**-4, 2**-10 * scale)
            assert bool(jnp.all(jnp.abs(stored - expected) <= relative * jnp.abs(expected) + absolute))


def test_one_kv_head_cache_write_puts_each_token_at_its_slot():
    """One KV head (MQA, written by XLA's scatter: its rows are single rows of a page's tiles as
    ops.cache_major_to_minor holds it): each token at its slot, -1 and past-the-cache slots
    skipped, every other slot as it was."""
    k_cache, v_cache, key, value, slots = _write_inputs(4, 5, 16, 20, jnp.bfloat16, heads=1)
    slots[[3, 9]] = -1
    slots[12] = 5 * 16  # past the cache
    k_new, v_new = ops.reshape_and_cache_flash(key, value, k_cache, v_cache, jnp.asarray(slots))
    live = slots.copy()
    live[12] = -1
    k_want, v_want = reference.reshape_and_cache(key, value, k_cache, v_cache, live, ops.quantize, None, None)
    for got, want in ((k_new, k_want), (v_new, v_want)):
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


def test_cache_write_passes_the_tpu_interpreter():
    """Every copy within bounds, a slot past the cache never written, no race between a
    step's copies."""
    rng = np.random.default_rng(4)
    k_cache = jnp.zeros((3, 16, 2, 128), jnp.float32)  # 2 KV heads: the write kernel's path (one is XLA's scatter)
    key = jnp.asarray(rng.standard_normal((10, 2, 128)), jnp.float32)
    slots = jnp.asarray([0, 5, 17, -1, 47, 3 * 16 + 9, 30, 31, 2, 1], jnp.int32)  # 57: past the cache
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    k_new, _ = ops.reshape_and_cache_flash(key, key, k_cache, k_cache, slots, interpret=params)
    assert tpu_interpreter.races.races_found is False
    pltpu.reset_tpu_interpret_mode_state()
    flat = np.asarray(k_new).reshape(48, 2, 128)
    written = {int(s): t for t, s in enumerate(np.asarray(slots)) if 0 <= s < 48}
    for slot in range(48):
        np.testing.assert_array_equal(flat[slot], np.asarray(key[written[slot]]) if slot in written else 0.0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_megacore_split_matches_the_reference(case):
    """On v5p the steps run in two parts, one per core of the megacore, cut at a block boundary
    near the middle: both parts get steps (where there are two query blocks to give them), and
    the output is the reference's."""
    args, options = _inputs(case, jnp.float32)
    out = ops.ragged_paged_attention(*args, blocks=case[7], generation="v5p", **options)
    expected = reference.ragged_paged_attention(*args, **options)
    assert max_error(out, expected) <= FP32_TOLERANCE * max_abs(expected)
    q, _, _, kv_lens, _, cu, live = args
    block_q, page_size = case[7].block_q, case[6]
    num_tokens = -(-q.shape[0] // block_q) * block_q
    chunks = -(-args[4].shape[1] // case[7].pages_per_block)
    parts = ops.parts_for("v5p", num_tokens // block_q)
    schedule = ops.make_schedule(cu, kv_lens, jnp.int32(live), num_tokens, block_q, case[7].pages_per_block * page_size,
                                 chunks, options.get("sliding_window"), parts=parts)
    first, count = np.asarray(schedule.part_first), np.asarray(schedule.part_count)
    assert len(count) == parts == (2 if num_tokens > block_q else 1) and (count > 0).all()
    if parts == 2:
        blocks = np.asarray(schedule.block)
        assert first[1] == count[0] and blocks[first[1] - 1] != blocks[first[1]], "the parts share no query block"
        assert abs(int(count[0]) - int(count[1])) <= max(count) // 2, "cut near the middle"


@pytest.mark.parametrize("only", ["decode", "prefill"])
def test_megacore_parts_write_disjoint_blocks(only):
    """With one decode token and one short prefill, each kernel's steps fit one block: part 1 takes
    them and part 0, with none, reads and writes only the spare block past the tokens (its
    write-back on a block part 1 computes would race; the TPU interpreter ran part 0 first and did
    not report it)."""
    from paged_attention import kernel

    args, _ = _inputs(ONE_DECODE_CASE, jnp.float32)
    _, _, _, kv_lens, page_indices, cu, live = args
    choose = tuning.decode_blocks if only == "decode" else tuning.prefill_blocks
    blocks = choose(4, 16, 4, 64, jnp.float32, "v5p")
    num_tokens = -(-int(cu[-1]) // blocks.block_q) * blocks.block_q
    schedule = ops.make_schedule(cu, kv_lens, jnp.int32(live), num_tokens, blocks.block_q,
                                 blocks.pages_per_block * 16, 1, None, parts=2, only=only)
    spare = num_tokens // blocks.block_q
    written = [{int(kernel.query_block(p, i, schedule.part_first, schedule.part_count, schedule.block, spare))
                for i in range(max(int(schedule.part_count.max()), 1))} for p in (0, 1)]
    assert list(schedule.part_count) == [0, 1] and written == [{spare}, {0}]


ONE_DECODE_CASE = ("one_decode_default_blocks", [0, 1, 3], [9, 40, 20], 4, 1, 64, 16, None, {})


@pytest.mark.parametrize("case", [CASES[0], ONE_DECODE_CASE], ids=lambda c: c[0])
def test_megacore_split_passes_the_tpu_interpreter(case):
    """Two simulated cores running the two parts: no race between them (each writes only its own
    query blocks; a part with no step, as the decode kernel's first part with one decode token,
    idles on the spare block), no out-of-bounds DMA, no uninitialised read."""
    args, options = _inputs(case, jnp.float32)
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2, uninitialized_memory="nan")
    out = ops.ragged_paged_attention(*args, blocks=case[7], generation="v5p", interpret=params, **options)
    assert tpu_interpreter.races.races_found is False
    pltpu.reset_tpu_interpret_mode_state()
    expected = reference.ragged_paged_attention(*args, **options)
    assert max_error(out, expected) <= FP32_TOLERANCE * max_abs(expected)
