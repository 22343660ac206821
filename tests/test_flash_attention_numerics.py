"""flash_attention's kernels in Pallas interpret mode against the f32 reference:
outputs and gradients (q, k, v, sinks), every masking feature, packed
sequences of every shape transformers produces."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
from jax.experimental.pallas import tpu as pltpu

from flash_attention import kernel, ops, reference, tuning
from flash_attention.kernel import BlockSizes
from sampling import named, sample
from errors import max_abs, max_error

# Small blocks, so a few hundred tokens span several query and key blocks.
SMALL = BlockSizes(block_q=16, block_k=128)

# (name, query lengths, key lengths, Hq, Hkv, D, Dv, options). Lengths cover:
# an empty sequence; fewer queries than keys (generation: bottom-right
# causal); more queries than keys (the first queries see no key); one query
# per sequence (decode); sequences straddling blocks.
CASES = [
    ("causal_gqa", [37, 0, 100, 5], [37, 0, 130, 260], 4, 2, 64, 64, dict(causal=True)),
    ("window_softcap_sinks_mqa", [37, 100], [37, 230], 4, 1, 64, 32,
     dict(causal=True, window_size=(40, 40), softcap=5.0, sinks=True)),
    ("noncausal_two_sided_window", [37, 100], [50, 230], 2, 2, 80, 80, dict(window_size=(30, 7))),
    ("more_queries_than_keys", [60, 20], [20, 60], 2, 1, 96, 96, dict(causal=True, sinks=True)),
    ("decode", [1, 1, 1], [200, 3, 129], 8, 2, 128, 128, dict(causal=True, softmax_scale=0.3)),
    ("noncausal_deepseek_dims", [70], [150], 2, 2, 192, 128, dict()),
    # head_dim 256 with G > 1: the forward takes a KV head's query heads side by side in the
    # lanes (ops.IN_LANES_MIN_HEAD_DIM) and makes them rows in the kernel.
    ("gqa_heads_in_lanes_softcap", [37, 100], [37, 230], 4, 2, 256, 256, dict(causal=True, softcap=30.0, sinks=True)),
    # Gemma 4's global layers: head_dim 512, G = 4 (its 26B-A4B: 16 query heads over 2 KV heads).
    ("gemma4_global_d512", [20, 45], [20, 150], 8, 2, 512, 512, dict(causal=True)),
]

# fp32 inputs: every product and sum in f32 (HIGHEST), so only reassociation
# separates the kernel from the reference: 2e-5 of the largest value.
FP32_TOLERANCE = 2e-5


def _inputs(case, dtype, seed=0, extra_q=3, extra_k=5):
    _, lens_q, lens_k, hq, hkv, d, dv, options = case
    rng = np.random.default_rng(seed)
    # Tokens past the last sequence: padding the kernel must leave at zero (queries) or never see (keys).
    tq, tk = sum(lens_q) + extra_q, sum(lens_k) + extra_k
    q = jnp.asarray(rng.standard_normal((tq, hq, d)), dtype)
    k = jnp.asarray(rng.standard_normal((tk, hkv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((tk, hkv, dv)), dtype)
    cu = lambda lens: jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    options = dict(options)
    if options.get("sinks"):
        options["sinks"] = jnp.asarray(rng.standard_normal(hq), dtype)
    return q, k, v, cu(lens_q), cu(lens_k), options


# Sampled (tests/sampling.py): the two-sided window and MQA with every option run forward and
# backward in test_gradients_with_the_separate_dq_kernel (which shares the dkv kernel) and below.
@pytest.mark.parametrize("case", sample(CASES, {c[0] for c in CASES} - {"window_softcap_sinks_mqa",
                                                                       "noncausal_two_sided_window"}, key=named),
                         ids=named)
def test_forward_and_gradients_match_the_reference_in_fp32(case):
    """With the dkv kernel accumulating dq (the small shapes fit VMEM)."""
    _check_fp32(case)


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: c[0])
def test_gradients_with_the_separate_dq_kernel(case, monkeypatch):
    """Where a KV head's dq does not fit VMEM (long sequences), a dq kernel of its own."""
    monkeypatch.setattr(tuning, "FUSED_DQ_FRACTION", 0.0)
    _check_fp32(case)


def _refuse_whole_groups(monkeypatch, largest_group: int):
    """Makes the backward's dq fit VMEM only for groups of at most largest_group query heads (the
    tests' small blocks split)."""
    fits = tuning.fused_dq_vmem_limit
    monkeypatch.setattr(tuning, "MIN_SPLIT_ROWS", 0)
    monkeypatch.setattr(tuning, "fused_dq_vmem_limit",
                        lambda *args: None if args[5] > largest_group else fits(*args))


# Sampled (tests/sampling.py): MQA with a window, softcap and sinks; GQA and decode repeat its split.
@pytest.mark.parametrize("case", sample([CASES[0], CASES[1], CASES[4]], {"window_softcap_sinks_mqa"}, key=named),
                         ids=named)
def test_gradients_with_the_query_heads_split_in_groups(case, monkeypatch):
    """Where a KV head's dq does not fit VMEM but half of its query heads' does, the backward runs
    them as two groups, each a KV head of its own (tuning.fused_dq_split); dk and dv sum the
    groups' parts, the sinks' gradient comes from the regrouped log-sum-exp."""
    _refuse_whole_groups(monkeypatch, case[3] // case[4] // 2)
    blocks = BlockSizes(block_q=128, block_k=128)  # whole lanes of rows for half the heads
    q, k, v, *_, options = _inputs(case, jnp.float32)
    st = ops._static(q, k, v, None, options.get("causal", False), options.get("window_size", (-1, -1)), 0.0, None,
                     blocks, None, True)
    assert (st.dq_split, st.fused_dq_vmem_limit is not None) == (2, True)
    _check_fp32(case, blocks=blocks)


@pytest.mark.parametrize("case", [CASES[1], ("causal_three_kv_heads", [37, 100], [37, 130], 6, 3, 64, 64,
                                              dict(causal=True))], ids=lambda c: c[0])
def test_megacore_halves_match_the_reference(case):
    """On v5p, KV heads that do not split evenly over its two cores (MQA, 3 heads): each
    head's steps run in two halves (parts = 2), and dq in a kernel of its own."""
    q, k, v, cu_q, cu_k, options = _inputs(case, jnp.float32)
    assert ops._static(q, k, v, None, options.get("causal", False), (-1, -1), 0.0, None, SMALL, "v5p", True).parts == 2
    _check_fp32(case, generation="v5p")


# Blocks whose causal-diagonal pairs run in quarters (kernel.splits_diagonal): halves of 64
# query tokens (G = 2) by 128 keys, and of 256 tokens by 128 keys. The first sequence has one
# key more than queries, so a half's last row sees exactly the first key of a key half (the
# bound a quarter's skip compares); the others put the diagonal at other offsets.
QUARTER_CASES = [
    (BlockSizes(block_q=128, block_k=256),
     ("causal_gqa", [300, 5, 190], [301, 40, 190], 4, 2, 64, 64, dict(causal=True, sinks=True))),
    (BlockSizes(block_q=512, block_k=256),
     ("causal_mha_window", [600, 300], [601, 300], 1, 1, 64, 64, dict(causal=True, window_size=(300, -1)))),
]


# Sampled (tests/sampling.py): the 512-row block (MHA, a window); the 256-row GQA one repeats its quarters.
QUARTERS = sample(QUARTER_CASES, {"causal_mha_window"}, key=lambda c: c[1][0])


@pytest.mark.parametrize("blocks,case", QUARTERS, ids=[case[0] for _, case in QUARTERS])
def test_diagonal_quarters_match_the_reference(blocks, case):
    rows = blocks.block_q * case[3] // case[4]
    assert kernel.diagonal_slices(rows, blocks.block_q, blocks.block_k) == 2
    _check_fp32(case, blocks=blocks)


def test_diagonal_slices_match_the_reference(monkeypatch):
    """Four slices of 128 query tokens (G = 2) by halves of 128 keys (MIN_SLICED_KEYS lowered so
    that small blocks slice): the first sequence has one key more than queries, so a slice's last
    row sees exactly the first key of a key half; the second puts the diagonal elsewhere."""
    monkeypatch.setattr(kernel, "MIN_SLICED_KEYS", 128)
    jax.clear_caches()  # compiled calls do not key on the constant
    blocks = BlockSizes(block_q=512, block_k=256)
    assert kernel.diagonal_slices(blocks.block_q * 2, blocks.block_q, blocks.block_k) == 4
    _check_fp32(("causal_gqa_slices", [700, 300], [701, 300], 2, 1, 64, 64, dict(causal=True, sinks=True)),
                blocks=blocks)
    jax.clear_caches()


def _diagonal_sweep(block_q: int, block_k: int):
    """(query lengths, key lengths): a sequence of block_q queries over block_q + d keys for every d
    in 0..block_k, each in a query block of its own and starting at a key block (sequences with no
    query take up the keys between), so that a query block's first row sees up to every key of a
    key block in turn: its last, the one before, and so on."""
    lens_q, lens_k = [], []
    for d in range(block_k + 1):
        keys = block_q + d
        lens_q += [block_q, 0]
        lens_k += [keys, -keys % block_k]
    return lens_q, lens_k


def test_every_diagonal_offset_matches_the_reference():
    """Whether a key block is seen whole (no mask), on a diagonal (the rows' ends compared) or
    partly (both ends compared) hinges on where the rows' key ranges end and start against the
    block's keys: an off-by-one there shows at one offset only (at 16 x 128 blocks, 16 queries over
    142 keys: a block's first row sees up to the second-to-last key of a key block). Causal, a
    window to the left, a window on both sides."""
    # Key blocks of 16, not a TPU's 128: the same comparisons at every offset, for 1/8 the sequences.
    blocks = BlockSizes(block_q=16, block_k=16)
    lens_q, lens_k = _diagonal_sweep(blocks.block_q, blocks.block_k)
    for options in (dict(causal=True), dict(causal=True, window_size=(5, -1)), dict(window_size=(7, 3))):
        _check_fp32(("diagonal_sweep", lens_q, lens_k, 2, 1, 64, 64, options), blocks=blocks)


def _check_fp32(case, blocks=SMALL, **call):
    q, k, v, cu_q, cu_k, options = _inputs(case, jnp.float32)
    out = ops.flash_attention_varlen(q, k, v, cu_q, cu_k, blocks=blocks, **options, **call)
    expected = reference.attention_varlen(q, k, v, cu_q, cu_k, **options)
    assert out.shape == (q.shape[0], q.shape[1], v.shape[2]) and out.dtype == q.dtype
    assert max_error(out, expected) <= FP32_TOLERANCE * max_abs(expected)
    assert not np.any(np.asarray(out[int(cu_q[-1]):])), "padding queries must get zeros"

    # Gradients of a random projection of the output, including the padding rows'.
    weights = jnp.asarray(np.random.default_rng(1).standard_normal(out.shape), jnp.float32)
    sinks = options.pop("sinks", None)
    args = (q, k, v) + ((sinks,) if sinks is not None else ())

    def loss(fn, q, k, v, sinks=None, **extra):
        out = fn(q, k, v, cu_q, cu_k, sinks=sinks, **options, **extra)
        return jnp.sum(out.astype(jnp.float32) * weights)

    argnums = tuple(range(len(args)))
    ours = jax.grad(lambda *a: loss(ops.flash_attention_varlen, *a, blocks=blocks, **call), argnums)(*args)
    theirs = jax.grad(lambda *a: loss(reference.attention_varlen, *a), argnums)(*args)
    for name, got, want in zip(("q", "k", "v", "sinks"), ours, theirs):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        scale = max(1.0, max_abs(want))
        assert max_error(got, want) <= FP32_TOLERANCE * scale, name
    # Keys past cu_seqlens_k[-1] are never seen: their gradients are exactly zero.
    assert not np.any(np.asarray(ours[1][int(cu_k[-1]):])) and not np.any(np.asarray(ours[2][int(cu_k[-1]):]))


# Sampled (tests/sampling.py): MQA with every option, and head_dim 512.
@pytest.mark.parametrize("case", sample(CASES[:3] + CASES[-1:], {"window_softcap_sinks_mqa", "gemma4_global_d512"},
                                        key=named), ids=named)
def test_bf16_forward_is_the_reference_rounded(case):
    """bf16 inputs are exact; without a cap, q enters scaled by softmax_scale * log2(e) and
    rounded to bf16 once (the reference is given that q); scores and statistics are f32; the
    probabilities enter the PV matmul rounded to bf16 (2^-9 relative each), and the output is
    rounded to bf16 (2^-9 relative): within 2^-8 of max |v| per element."""
    q, k, v, cu_q, cu_k, options = _inputs(case, jnp.bfloat16)
    out = ops.flash_attention_varlen(q, k, v, cu_q, cu_k, blocks=SMALL, **options)
    assert out.dtype == jnp.bfloat16
    q_used = q.astype(jnp.float32)
    if not options.get("softcap"):
        factor = options.get("softmax_scale", q.shape[-1] ** -0.5) * math.log2(math.e)
        q_used = (q_used * factor).astype(jnp.bfloat16).astype(jnp.float32) / factor
    expected = reference.attention_varlen(q_used, k, v, cu_q, cu_k, **options)
    assert max_error(out, expected) <= 2**-8 * max_abs(v.astype(jnp.float32))


def test_bf16_accumulators_are_f32():
    """With q = 0 every probability is exactly 1/n in bf16 and f32 alike, so
    the output is the mean of v. The first key block holds v = 8 and the
    seven others v = 0.02: a bf16 accumulator (ulp 8 at 1024) would swamp
    their contributions (mean 1.0 instead of 1.0175); f32 keeps them. The
    same for dv across query blocks."""
    tq, tk, block = 64, 1024, BlockSizes(block_q=16, block_k=128)
    q = jnp.zeros((tq, 1, 128), jnp.bfloat16)
    k = jnp.asarray(np.random.default_rng(0).standard_normal((tk, 1, 128)), jnp.bfloat16)
    v = jnp.broadcast_to(jnp.where(jnp.arange(tk)[:, None, None] < 128, 8.0, 0.02), (tk, 1, 128)).astype(jnp.bfloat16)
    cu_q, cu_k = jnp.asarray([0, tq], jnp.int32), jnp.asarray([0, tk], jnp.int32)
    out = ops.flash_attention_varlen(q, k, v, cu_q, cu_k, blocks=block)
    exact = (128 * 8.0 + 896 * float(jnp.bfloat16(0.02))) / tk
    assert max_error(out, jnp.full(out.shape, exact)) <= 2**-8 * exact  # one bf16 rounding

    # dv_j = sum_i p_ij do_i = mean of do over the queries: the first query block's do is 8, the rest 0.02.
    do = jnp.broadcast_to(jnp.where(jnp.arange(tq)[:, None, None] < 16, 8.0, 0.02), (tq, 1, 128)).astype(jnp.bfloat16)
    _, pullback = jax.vjp(lambda v: ops.flash_attention_varlen(q, k, v, cu_q, cu_k, blocks=block), v)
    (dv,) = pullback(do)
    exact_dv = (16 * 8.0 + 48 * float(jnp.bfloat16(0.02))) / tk
    assert max_error(dv, jnp.full(dv.shape, exact_dv)) <= 2**-8 * exact_dv


def _bf16_gradients(q, k, v, do):
    """(out, dq, dk, dv) of one non-causal sequence at SMALL blocks, for the given output gradient."""
    cu_q, cu_k = jnp.asarray([0, q.shape[0]], jnp.int32), jnp.asarray([0, k.shape[0]], jnp.int32)
    out, pullback = jax.vjp(lambda q, k, v: ops.flash_attention_varlen(q, k, v, cu_q, cu_k, blocks=SMALL), q, k, v)
    return (out, *pullback(do))


def _rows(tokens, row):
    """[tokens, 1, D] bf16, every token the given row (exact in bf16)."""
    return jnp.broadcast_to(jnp.asarray(row, jnp.bfloat16), (tokens, 1, len(row)))


@pytest.mark.parametrize("d", [128, 512])
def test_bf16_backward_cancels_the_d_term_in_f32(d):
    """dS = P (dO.v - D) with D = rowsum(dO * O): with every v row u, O is u exactly (q = k = 1:
    every probability 1/n, u's exact multiples summed) and dO.v_j = D for every key, so dq and dk
    are 0. The kernels form dO.v and D from the same bf16 values in f32: they cancel to f32's
    rounding, far below the bound, 2^-16 of the terms that cancel (scale * D, with |k| = |q| = 1
    and as many queries as keys). D = 1 + 5 * 2^-10 rounds to bf16 by 0.75 * 2^-8 of itself: a
    D held in bf16 leaves 2^-8.4 of those terms in dq and dk. Also at Gemma 4's head_dim 512."""
    tokens = 256  # 16 query blocks, 2 key blocks
    u, w = np.zeros(d), np.zeros(d)
    u[:2], w[:2] = (1.0, 5 * 2**-10), (1.0, 1.0)
    d_term = float(np.dot(u, w))
    assert abs(float(jnp.bfloat16(d_term)) - d_term) >= 2**-9 * d_term  # the bf16 rounding a test must see
    ones = jnp.ones((tokens, 1, d), jnp.bfloat16)
    out, dq, dk, _ = _bf16_gradients(ones, ones, _rows(tokens, u), _rows(tokens, w))
    assert bool(jnp.all(out == _rows(tokens, u))), "O must be exact for D to be"
    bound = 2**-16 * d ** -0.5 * d_term
    assert max_error(dq, jnp.zeros_like(dq)) <= bound
    assert max_error(dk, jnp.zeros_like(dk)) <= bound


# Sampled (tests/sampling.py): each dq kernel once.
@pytest.mark.parametrize("dq_kernel,d", sample([("fused", 128), ("separate", 128), ("fused", 512)],
                                               {("separate", 128), ("fused", 512)}))
def test_bf16_gradients_accumulate_in_f32(dq_kernel, d, monkeypatch):
    """As test_bf16_accumulators_are_f32 for dv, for dk across query blocks and dq across key
    blocks. Every score is 0 (q = 0 for dq, k = 0 for dk), so every probability is 1/n; v_j = +-e0
    alternating makes O = 0 and D = 0, so dS_ij = +-(dO_i . e0) / n, exact in bf16. dk_j = scale
    * sum_i dS_ij q_i: the first query block's dO is 8 e0, the seven others' 0.02 e0, so each
    later block adds 0.25% of the first's sum, under half a bf16 ulp of it (2^-8 relative): a bf16
    accumulator keeps the first block's sum alone, 1.7% short. dq_i = scale * sum_j dS_ij k_j, with
    k_j = +-8 in the first key block, +-0.02 in the seven others, alike. Each result is rounded to
    bf16 once: within 2^-8 relative. Also at Gemma 4's head_dim 512."""
    if dq_kernel == "separate":
        monkeypatch.setattr(tuning, "FUSED_DQ_FRACTION", 0.0)
    blocks, small = 8, float(jnp.bfloat16(0.02))
    e0 = np.eye(d)[0]
    signs = lambda n: np.where(np.arange(n) % 2, -1.0, 1.0)[:, None, None]  # +1, -1, ... per token
    first_block_large = lambda n, block: np.where(np.arange(n)[:, None, None] < block, 8.0, small)
    bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)
    error = lambda got, exact: np.max(np.abs(np.asarray(got, np.float32) - exact) / np.abs(exact))

    tq, tk = blocks * SMALL.block_q, SMALL.block_k
    _, _, dk, _ = _bf16_gradients(bf16(np.ones((tq, 1, d))), bf16(np.zeros((tk, 1, d))), bf16(signs(tk) * e0),
                                  bf16(first_block_large(tq, SMALL.block_q) * e0))
    exact_dk = d ** -0.5 / tk * (SMALL.block_q * 8.0 + (tq - SMALL.block_q) * small) * signs(tk) * np.ones(d)
    assert error(dk, exact_dk) <= 2**-8, "dk"

    tq, tk = SMALL.block_q, blocks * SMALL.block_k
    k = bf16(first_block_large(tk, SMALL.block_k) * signs(tk) * np.ones(d))
    _, dq, _, _ = _bf16_gradients(bf16(np.zeros((tq, 1, d))), k, bf16(signs(tk) * e0), _rows(tq, e0))
    exact_dq = d ** -0.5 / tk * (SMALL.block_k * 8.0 + (tk - SMALL.block_k) * small) * np.ones((tq, 1, d))
    assert error(dq, exact_dq) <= 2**-8, "dq"


def test_dense_batch_is_the_packed_batch():
    """flash_attention over [B, S, ...] is flash_attention_varlen over the same sequences packed."""
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((3, 20, 4, 64)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((3, 50, 2, 64)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((3, 50, 2, 64)), jnp.float32)
    out = ops.flash_attention(q, k, v, causal=True, blocks=SMALL)
    cu_q, cu_k = jnp.arange(4, dtype=jnp.int32) * 20, jnp.arange(4, dtype=jnp.int32) * 50
    expected = reference.attention_varlen(q.reshape(60, 4, 64), k.reshape(150, 2, 64), v.reshape(150, 2, 64),
                                          cu_q, cu_k, causal=True)
    assert out.shape == (3, 20, 4, 64)
    assert max_error(out.reshape(60, 4, 64), expected) <= FP32_TOLERANCE * max_abs(expected)


def test_schedule_skips_blocks_no_query_sees():
    """Causal attention over one sequence of 8 key blocks: query block i sees
    key blocks 0 .. i only, and key block j is seen by query blocks j .. 7:
    36 of 64 block pairs, the causal triangle, are the grid's steps."""
    tokens, block = 1024, 128
    cu = jnp.asarray([0, tokens], jnp.int32)
    lo, hi = ops.token_ranges(cu, cu, tokens, tokens, causal=True, left=-1, right=-1)
    schedule = ops.make_schedule(lo, hi, block, block, tokens, slices=1)
    np.testing.assert_array_equal(schedule.kv_start, 0)
    np.testing.assert_array_equal(schedule.kv_count, np.arange(1, 9))
    np.testing.assert_array_equal(schedule.q_start, np.arange(8))
    np.testing.assert_array_equal(schedule.q_count, np.arange(8, 0, -1))
    assert int(schedule.q_steps.count) == int(schedule.k_steps.count) == 36
    np.testing.assert_array_equal(schedule.q_steps.block[:36], np.repeat(np.arange(8), np.arange(1, 9)))
    np.testing.assert_array_equal(schedule.k_steps.first, np.cumsum([0, 8, 7, 6, 5, 4, 3, 2]))
    # A window of 128 keys: each query block sees its own key block and the one before.
    lo, hi = ops.token_ranges(cu, cu, tokens, tokens, causal=True, left=127, right=-1)
    schedule = ops.make_schedule(lo, hi, block, block, tokens, slices=1)
    np.testing.assert_array_equal(schedule.kv_count, [1] + [2] * 7)
    assert int(schedule.q_steps.count) == 15
    # Queries past cu_seqlens_q[-1] = 500 see nothing: their block still gets one step, to write its zeros.
    lo, hi = ops.token_ranges(jnp.asarray([0, 500], jnp.int32), cu, tokens, tokens, causal=False, left=-1, right=-1)
    schedule = ops.make_schedule(lo, hi, 512, block, tokens, slices=1)
    np.testing.assert_array_equal(schedule.kv_count, [8, 0])
    assert int(schedule.q_steps.count) == 9


def test_schedule_in_two_parts_balances_the_steps():
    """parts = 2 (a megacore, KV heads that do not split evenly): the causal triangle's
    query blocks 0-4 (15 steps) in the first part, 5-7 (21 steps) from the arrays' middle
    on; the grid runs the longer part's count, the shorter idles on its last block."""
    tokens, block = 1024, 128
    cu = jnp.asarray([0, tokens], jnp.int32)
    lo, hi = ops.token_ranges(cu, cu, tokens, tokens, causal=True, left=-1, right=-1)
    steps = ops.make_schedule(lo, hi, block, block, tokens, parts=2, slices=1).q_steps
    middle = steps.block.shape[0] // 2
    assert int(steps.count) == 21
    np.testing.assert_array_equal(steps.block[:15], np.repeat(np.arange(5), np.arange(1, 6)))
    np.testing.assert_array_equal(steps.block[15:middle], 4)  # idle: past block 4's run
    np.testing.assert_array_equal(steps.block[middle:middle + 21], np.repeat([5, 6, 7], [6, 7, 8]))
    np.testing.assert_array_equal(steps.first, [0, 1, 3, 6, 10, middle, middle + 6, middle + 13])
    # One block: the second part is empty, and the first runs it all.
    one = ops.make_schedule(lo[:128], hi[:128], block, block, tokens, parts=2, slices=1).q_steps
    assert int(one.count) == 1 and int(one.first[0]) == 0


@pytest.mark.parametrize("dq_kernel", ["fused", "fused, heads in two groups", "separate", "megacore halves",
                                       "forward, heads in lanes", "fused, head_dim 512"])
def test_kernels_pass_the_tpu_interpreter(dq_kernel, monkeypatch):
    """The TPU interpreter (race detection, two cores, uninitialised memory as
    NaN) over the forward and backward of a packed, windowed case: GQA with dq
    accumulated by the dkv kernel and by a kernel of its own, and MQA on v5p,
    each KV head's steps in two halves, one per core; GQA whose backward runs each
    KV head's query heads in two groups; an inference forward at head_dim 256,
    its query heads in lanes; and GQA at Gemma 4's head_dim 512 (four lane rows)."""
    blocks = SMALL
    if dq_kernel == "separate":
        monkeypatch.setattr(tuning, "FUSED_DQ_FRACTION", 0.0)
    if dq_kernel == "fused, heads in two groups":
        _refuse_whole_groups(monkeypatch, 1)
        blocks = BlockSizes(block_q=128, block_k=128)  # whole lanes of rows for one head
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2, uninitialized_memory="nan")
    # Halves: 4 query blocks and 2 key blocks, so every kernel's two parts have steps.
    hkv, lens_k, generation = (1, [20, 240], "v5p") if dq_kernel == "megacore halves" else (2, [20, 100], None)
    head_dim = {"forward, heads in lanes": 256, "fused, head_dim 512": 512}.get(dq_kernel, 64)
    case = ("tpu_interpreter", [20, 40], lens_k, 4, hkv, head_dim, head_dim,
            dict(causal=True, window_size=(50, 50), sinks=True))
    q, k, v, cu_q, cu_k, options = _inputs(case, jnp.float32)
    split = ops._static(q, k, v, None, True, (50, 50), 0.0, None, blocks, generation, params).dq_split
    assert split == (2 if dq_kernel == "fused, heads in two groups" else 1)
    fn = lambda q, k, v: ops.flash_attention_varlen(q, k, v, cu_q, cu_k, blocks=blocks, interpret=params,
                                                    generation=generation, **options)
    if dq_kernel.startswith("forward"):
        out, grads = fn(q, k, v), ()
    else:
        out, pullback = jax.vjp(fn, q, k, v)
        grads = pullback(jnp.ones_like(out))
    assert tpu_interpreter.races.races_found is False
    pltpu.reset_tpu_interpret_mode_state()
    expected = reference.attention_varlen(q, k, v, cu_q, cu_k, **options)
    assert max_error(out, expected) <= FP32_TOLERANCE * max_abs(expected)
    assert all(bool(jnp.isfinite(g).all()) for g in grads), "a kernel read uninitialised memory"
