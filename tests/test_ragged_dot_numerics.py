"""Layer 1: the kernel's numerics in Pallas interpret mode against an fp32 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ragged_dot import ops, reference
from sampling import sample
from errors import max_abs, max_error

# (M, K, N, group_sizes): ragged, empty, unaligned groups; M not a
# multiple of 8 or 128; rows past sum(group_sizes); all rows in one group;
# every group empty; K split over several k blocks.
CASES = [
    (37, 256, 128, [5, 0, 20, 3]),
    (100, 128, 256, [0, 0, 50, 0, 30]),
    (64, 384, 128, [64]),
    (5, 128, 128, [0, 0, 0]),
    (131, 2048, 256, [1, 60, 0, 70]),
    (1, 128, 128, [0, 1]),
]

# fp32: the kernel accumulates in fp32 over K terms; 1e-5 relative to the
# output's scale covers reassociation. bf16: inputs are exact in bf16 and the
# product is accumulated in fp32, so the only error is rounding the output
# to bf16 (8 bits of mantissa): 2^-8 relative.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2**-8}


def _inputs(m, k, n, group_sizes, dtype, transpose_rhs, seed=0):
    rng = np.random.default_rng(seed)
    g = len(group_sizes)
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((g, n, k) if transpose_rhs else (g, k, n)), dtype)
    return lhs, rhs, jnp.asarray(group_sizes, jnp.int32)


def _assert_close(out, expected, dtype):
    out = np.asarray(out.astype(jnp.float32))
    expected = np.asarray(expected.astype(jnp.float32))
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(out, expected, rtol=0, atol=TOLERANCE[dtype] * scale)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["KN", "NK"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"m{c[0]}k{c[1]}n{c[2]}g{len(c[3])}")
def test_forward_matches_fp32_reference(case, transpose_rhs, dtype):
    m, k, n, group_sizes = case
    lhs, rhs, gs = _inputs(m, k, n, group_sizes, dtype, transpose_rhs)
    out = ops.ragged_dot(lhs, rhs, gs, transpose_rhs=transpose_rhs)
    assert out.shape == (m, n) and out.dtype == dtype
    expected = reference.ragged_dot(lhs, rhs, gs, transpose_rhs=transpose_rhs, out_dtype=jnp.float32)
    _assert_close(out, expected, dtype)
    total = sum(group_sizes)
    assert not np.any(np.asarray(out[total:], np.float32)), "rows past sum(group_sizes) must be zero"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"m{c[0]}k{c[1]}n{c[2]}g{len(c[3])}")
def test_weight_grad_kernel_matches_fp32_reference(case, dtype):
    """The transposed grouped matmul (weights' gradient): empty groups are
    exactly zero, every other group a[rows]^T @ b[rows]."""
    m, k, n, group_sizes = case
    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.standard_normal((m, k)), dtype)
    b = jnp.asarray(rng.standard_normal((m, n)), dtype)
    gs = jnp.asarray(group_sizes, jnp.int32)
    out = ops._weight_grad(a, b, gs, dtype, "v6e", True)
    assert out.shape == (len(group_sizes), k, n) and out.dtype == dtype
    _assert_close(out, reference.weight_grad(a, b, gs, jnp.float32), dtype)
    for g, size in enumerate(group_sizes):
        if size == 0:
            assert not np.any(np.asarray(out[g], np.float32)), f"empty group {g} must be zeros"


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["KN", "NK"])
def test_blocks_that_do_not_divide_k_and_n(transpose_rhs):
    """K = 300 and N = 200 in 128-wide blocks: the last K block's overhang
    is masked out of the sum, the last N block's is clipped on write; the
    same for the weights' gradient's P and Q edges."""
    from ragged_dot import kernel

    m, k, n, group_sizes = 64, 300, 200, [10, 0, 40]
    lhs, rhs, gs = _inputs(m, k, n, group_sizes, jnp.float32, transpose_rhs)
    blocks = kernel.BlockSizes(16, 128, 128)
    out = kernel.grouped_matmul(lhs, rhs, gs, blocks=blocks, transpose_rhs=transpose_rhs, out_dtype=jnp.float32,
                                vmem_limit=32 << 20, interpret=True)
    _assert_close(out, reference.ragged_dot(lhs, rhs, gs, transpose_rhs=transpose_rhs), jnp.float32)
    # The weights' gradient's windows hang over the inputs' last columns
    # (unspecified values that reach only output elements clipped on write).
    b = jnp.asarray(np.random.default_rng(3).standard_normal((m, n)), jnp.float32)
    for at_group_start in (True, False):
        grad = kernel.transposed_grouped_matmul(
            lhs, b, gs, blocks=kernel.BlockSizes(16, 128, 128, at_group_start), out_dtype=jnp.float32,
            vmem_limit=32 << 20, sub_rows=128, interpret=True)
        _assert_close(grad, reference.weight_grad(lhs, b, gs), jnp.float32)


@pytest.mark.parametrize("at_group_start", [True, False], ids=["group-start", "tiles"])
@pytest.mark.parametrize("sizes", [[5, 0, 50, 40], [0, 0, 0, 0], [128, 0, 0, 0], [1, 1, 17, 90]])
def test_weight_grad_windows(sizes, at_group_start):
    """64-row windows, starting at each group's first row (rounded down to
    16; the last one slides back inside M) or at fixed tiles, contracted in
    32-row sub-blocks: every group's rows are counted once."""
    from ragged_dot import kernel

    rng = np.random.default_rng(4)
    m, p, q = 112 if at_group_start else 128, 128, 256  # 112: the last window slides back
    sizes = np.diff(np.minimum(np.cumsum([0] + sizes), m)).tolist()  # at most m rows in all
    a = jnp.asarray(rng.standard_normal((m, p)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((m, q)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    blocks = kernel.BlockSizes(64, 128, 128, windows_at_group_start=at_group_start)
    out = kernel.transposed_grouped_matmul(a, b, gs, blocks=blocks, out_dtype=jnp.float32,
                                           vmem_limit=32 << 20, sub_rows=32, interpret=True)
    _assert_close(out, reference.weight_grad(a, b, gs), jnp.float32)


@pytest.mark.parametrize("align", [16, 32], ids=["group-start", "tiles"])
def test_weight_grad_visits_count_each_row_once(align):
    from ragged_dot.kernel import make_weight_grad_visits

    block_m, num_rows = 32, 96
    for sizes in ([5, 0, 20, 3], [0, 0, 0], [96], [16, 16, 0, 1], [1] * 10, [0, 90, 6]):
        group, window, lo, hi, nvis = (np.asarray(x) for x in
                                       make_weight_grad_visits(jnp.asarray(sizes, jnp.int32), num_rows, block_m, align))
        counted = np.zeros(num_rows, int)
        for v in range(int(nvis[0])):
            assert window[v] % align == 0 and 0 <= window[v] <= num_rows - block_m
            assert window[v] <= lo[v] and hi[v] <= window[v] + block_m  # owned rows inside the window
            counted[lo[v]:hi[v]] += 1
            assert np.all(np.repeat(np.arange(len(sizes)), sizes)[lo[v]:hi[v]] == group[v])
        assert np.all(counted[:sum(sizes)] == 1) and not counted[sum(sizes):].any()
        assert set(group[:nvis[0]]) == set(range(len(sizes)))  # empty groups too: their zeros get written
        assert nvis[0] <= num_rows // block_m + len(sizes)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["KN", "NK"])
def test_large_tiles_shared_by_several_groups(transpose_rhs):
    """512-row tiles, each visit multiplying the whole tile and storing its
    group's rows: groups starting and ending inside a tile, a small group
    inside one, empty groups."""
    from ragged_dot import kernel

    m, k, n, group_sizes = 1024, 256, 128, [5, 300, 0, 7, 500, 130]
    lhs, rhs, gs = _inputs(m, k, n, group_sizes, jnp.float32, transpose_rhs)
    out = kernel.grouped_matmul(lhs, rhs, gs, blocks=kernel.BlockSizes(512, 128, 128), transpose_rhs=transpose_rhs,
                                out_dtype=jnp.float32, vmem_limit=32 << 20, interpret=True)
    _assert_close(out, reference.ragged_dot(lhs, rhs, gs, transpose_rhs=transpose_rhs), jnp.float32)


def test_matches_jax_lax_ragged_dot():
    lhs, rhs, gs = _inputs(37, 256, 128, [5, 0, 20, 12], jnp.float32, False)
    expected = jax.lax.ragged_dot(lhs, rhs, gs, precision=jax.lax.Precision.HIGHEST)
    _assert_close(ops.ragged_dot(lhs, rhs, gs), expected, jnp.float32)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["KN", "NK"])
def test_gradients_match_reference(transpose_rhs):
    lhs, rhs, gs = _inputs(45, 256, 128, [10, 0, 30], jnp.float32, transpose_rhs)
    cot = jnp.asarray(np.random.default_rng(1).standard_normal((45, 128)), jnp.float32)

    def loss(fn):
        return lambda a, b: jnp.sum(fn(a, b) * cot)

    ours = jax.grad(loss(lambda a, b: ops.ragged_dot(a, b, gs, transpose_rhs=transpose_rhs)), (0, 1))(lhs, rhs)
    want = jax.grad(loss(lambda a, b: reference.ragged_dot(a, b, gs, transpose_rhs=transpose_rhs)), (0, 1))(lhs, rhs)
    for got, exp in zip(ours, want):
        _assert_close(got, exp, jnp.float32)


def test_visit_list_covers_each_row_once():
    """Every row of the padded M is stored by exactly one visit, and the
    visit count never exceeds the static grid length."""
    from ragged_dot.kernel import make_visits

    block_m, num_rows = 16, 96
    for sizes in ([5, 0, 20, 3], [0, 0, 0], [96], [16, 16, 0, 1], [1] * 10):
        starts, ends, vgroup, vtile, _, nvis = (np.asarray(a) for a in make_visits(jnp.asarray(sizes, jnp.int32), num_rows, block_m))
        stores = np.zeros(num_rows, int)
        for v in range(int(nvis[0])):
            rows = np.arange(vtile[v] * block_m, (vtile[v] + 1) * block_m)
            stores[rows[(rows >= starts[vgroup[v]]) & (rows < ends[vgroup[v]])]] += 1
        assert (stores == 1).all(), sizes
        assert int(nvis[0]) <= num_rows // block_m + len(sizes)


@pytest.mark.parametrize("shapes,message", [
    (((37,), (4, 256, 128), (4,)), "lhs must have 2 dims"),
    (((37, 256), (4, 128, 128), (4,)), "does not contract"),
    (((37, 256), (4, 256, 128), (3,)), "group_sizes has 3 groups, rhs has 4"),
])
def test_jax_entry_point_rejects_bad_shapes(shapes, message):
    lhs, rhs, gs = (jnp.zeros(s, jnp.int32 if len(s) == 1 and i == 2 else jnp.float32) for i, s in enumerate(shapes))
    with pytest.raises(ValueError, match=message):
        ops.ragged_dot(lhs, rhs, gs)


# ---- bf16: partial sums must stay in fp32 across K steps and row windows.
# The bound below is per element and derived from the inputs alone: rounding the exact result
# to bf16 (half an ulp: 2^-8 relative) plus fp32 summation of n exact bf16 products
# (n * 2^-24 of the sum of their magnitudes). A partial sum rounded to bf16 between steps
# adds 2^-8 of a partial's magnitude, far past the bound where the result is small.


def _exact_grouped(lhs, rhs, sizes):
    """float64 per-group products and their magnitudes: (sum a b, sum |a b|), [M, N]."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out, mag = np.zeros((lhs.shape[0], rhs.shape[-1])), np.zeros((lhs.shape[0], rhs.shape[-1]))
    for g, (lo, hi) in enumerate(zip(np.cumsum([0] + sizes[:-1]), np.cumsum(sizes))):
        out[lo:hi], mag[lo:hi] = lhs[lo:hi] @ rhs[g], np.abs(lhs[lo:hi]) @ np.abs(rhs[g])
    return out, mag


def _assert_within_bf16_rounding(got, exact, magnitude, terms):
    got = np.asarray(got.astype(jnp.float32), np.float64)
    bound = 2.0**-8 * np.abs(exact) + terms * 2.0**-24 * magnitude + 1e-30
    worst = np.max(np.abs(got - exact) / bound)
    assert worst <= 1, f"error {worst:.2f}x the bf16 rounding bound"


BF16_SIZES = [100, 0, 90, 50]  # groups straddling 128-row tiles; 16 rows past the last group


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["KN", "NK"])
def test_bf16_forward_keeps_fp32_partial_sums_over_k_steps(transpose_rhs):
    """K = 512 in four 128-wide steps, each tile visited once per group it holds."""
    from ragged_dot import kernel

    m, k, n = 256, 512, 256
    lhs, rhs, gs = _inputs(m, k, n, BF16_SIZES, jnp.bfloat16, transpose_rhs, seed=5)
    out = kernel.grouped_matmul(lhs, rhs, gs, blocks=kernel.BlockSizes(128, 128, 128), transpose_rhs=transpose_rhs,
                                out_dtype=jnp.bfloat16, vmem_limit=32 << 20, interpret=True)
    weights = np.asarray(rhs.astype(jnp.float32))
    exact, magnitude = _exact_grouped(lhs.astype(jnp.float32), weights.swapaxes(1, 2) if transpose_rhs else weights,
                                      BF16_SIZES)
    _assert_within_bf16_rounding(out, exact, magnitude, k)


@pytest.mark.parametrize("at_group_start", [True, False], ids=["group-start", "tiles"])
def test_bf16_weight_grad_keeps_fp32_partial_sums_over_windows(at_group_start):
    """Each group's rows span several 64-row windows, contracted in 32-row sub-blocks."""
    from ragged_dot import kernel

    rng = np.random.default_rng(6)
    m, p, q = 256, 128, 256
    a = jnp.asarray(rng.standard_normal((m, p)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((m, q)), jnp.bfloat16)
    out = kernel.transposed_grouped_matmul(a, b, jnp.asarray(BF16_SIZES, jnp.int32),
                                           blocks=kernel.BlockSizes(64, 128, 128, at_group_start),
                                           out_dtype=jnp.bfloat16, vmem_limit=32 << 20, sub_rows=32, interpret=True)
    a64, b64 = np.asarray(a.astype(jnp.float32), np.float64), np.asarray(b.astype(jnp.float32), np.float64)
    for g, (lo, hi) in enumerate(zip(np.cumsum([0] + BF16_SIZES[:-1]), np.cumsum(BF16_SIZES))):
        exact, magnitude = a64[lo:hi].T @ b64[lo:hi], np.abs(a64[lo:hi]).T @ np.abs(b64[lo:hi])
        _assert_within_bf16_rounding(out[g], exact, magnitude, hi - lo)


def test_bf16_gradients_within_bf16_rounding():
    """jax.grad through ops.ragged_dot in bf16 (the tables' blocks for v6e): the activations'
    gradient and the weights' gradient, each against float64."""
    m, k, n = 256, 512, 256
    lhs, rhs, gs = _inputs(m, k, n, BF16_SIZES, jnp.bfloat16, True, seed=7)
    cot = jnp.asarray(np.random.default_rng(8).standard_normal((m, n)), jnp.bfloat16)
    _, vjp = jax.vjp(lambda a, b: ops.ragged_dot(a, b, gs, transpose_rhs=True, generation="v6e"), lhs, rhs)
    grad_lhs, grad_rhs = vjp(cot)
    w = np.asarray(rhs.astype(jnp.float32), np.float64)  # [G, N, K]
    exact, magnitude = _exact_grouped(cot.astype(jnp.float32), w, BF16_SIZES)
    _assert_within_bf16_rounding(grad_lhs[:sum(BF16_SIZES)], exact[:sum(BF16_SIZES)], magnitude[:sum(BF16_SIZES)], n)
    c64, l64 = np.asarray(cot.astype(jnp.float32), np.float64), np.asarray(lhs.astype(jnp.float32), np.float64)
    for g, (lo, hi) in enumerate(zip(np.cumsum([0] + BF16_SIZES[:-1]), np.cumsum(BF16_SIZES))):
        exact, magnitude = c64[lo:hi].T @ l64[lo:hi], np.abs(c64[lo:hi]).T @ np.abs(l64[lo:hi])
        _assert_within_bf16_rounding(grad_rhs[g], exact, magnitude, hi - lo)


# ---- Weights at sizes that are not multiples of 128, viewed in the order a TPU stores them.
# Gemma 4's experts (hidden 2112, intermediate 704) scaled down with the same property: K and N
# not multiples of 128 (so every K and N block has a masked or clipped edge), one of them a
# multiple of 8 only (88 = 704 / 8), the other of 16 (176 = 2112 / 12).
UNALIGNED = [(200, 88), (176, 264)]
UNALIGNED_SIZES = [30, 0, 17, 50]  # 3 rows past the last group


@pytest.mark.parametrize("stored", ["row-major", "swapped"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["KN", "NK"])
@pytest.mark.parametrize("k,n", UNALIGNED, ids=lambda d: str(d))
def test_unaligned_weights_forward_and_gradients(k, n, transpose_rhs, dtype, stored, monkeypatch):
    """ops.ragged_dot at unaligned K and N, forward and both gradients, with the weights held
    row-major or swapped (as libtpu holds Gemma 4's gate_up_proj: the kernel then reads them
    with transpose_rhs flipped through a swapaxes, and the weights' gradient comes back through
    it in the weights' own shape). fp32: within TOLERANCE of the fp32 reference. bf16: each
    element within the bf16 rounding bound against float64 (see _assert_within_bf16_rounding)."""
    monkeypatch.setattr(ops, "stored_order", lambda shape, dtype: (0, 2, 1) if stored == "swapped" else None)
    m = 100
    lhs, rhs, gs = _inputs(m, k, n, UNALIGNED_SIZES, dtype, transpose_rhs, seed=11)
    cot = jnp.asarray(np.random.default_rng(12).standard_normal((m, n)), dtype)
    out, vjp = jax.vjp(lambda a, b: ops.ragged_dot(a, b, gs, transpose_rhs=transpose_rhs, generation="v6e"), lhs, rhs)
    grad_lhs, grad_rhs = vjp(cot)
    assert out.shape == (m, n) and grad_lhs.shape == lhs.shape and grad_rhs.shape == rhs.shape
    assert out.dtype == grad_lhs.dtype == grad_rhs.dtype == dtype
    total = sum(UNALIGNED_SIZES)
    assert not np.any(np.asarray(out[total:], np.float32)), "rows past sum(group_sizes) must be zero"
    if dtype == jnp.float32:
        ref = lambda a, b: reference.ragged_dot(a, b, gs, transpose_rhs=transpose_rhs)
        want, ref_vjp = jax.vjp(ref, lhs, rhs)
        for got, exp in zip((out, grad_lhs, grad_rhs), (want, *ref_vjp(cot))):
            _assert_close(got, exp, dtype)
        return
    w = np.asarray(rhs.astype(jnp.float32), np.float64)
    w_kn = w.swapaxes(1, 2) if transpose_rhs else w  # [G, K, N]
    exact, magnitude = _exact_grouped(lhs.astype(jnp.float32), w_kn, UNALIGNED_SIZES)
    _assert_within_bf16_rounding(out, exact, magnitude, k)
    exact, magnitude = _exact_grouped(cot.astype(jnp.float32), w_kn.swapaxes(1, 2), UNALIGNED_SIZES)
    _assert_within_bf16_rounding(grad_lhs[:total], exact[:total], magnitude[:total], n)
    assert not np.any(np.asarray(grad_lhs[total:], np.float32)), "rows past the groups get no gradient"
    c64, l64 = np.asarray(cot.astype(jnp.float32), np.float64), np.asarray(lhs.astype(jnp.float32), np.float64)
    for g, (lo, hi) in enumerate(zip(np.cumsum([0] + UNALIGNED_SIZES[:-1]), np.cumsum(UNALIGNED_SIZES))):
        exact, magnitude = l64[lo:hi].T @ c64[lo:hi], np.abs(l64[lo:hi]).T @ np.abs(c64[lo:hi])  # [K, N]
        if transpose_rhs:
            exact, magnitude = exact.T, magnitude.T
        _assert_within_bf16_rounding(grad_rhs[g], exact, magnitude, max(hi - lo, 1))


def test_weights_viewed_in_stored_order():
    """Only weights held with their last two dims swapped are viewed swapped (transpose_rhs
    flipped); row-major ones, and ones whose group dim is not major (no per-group view
    exists), are passed as they are."""
    w = jnp.zeros((4, 200, 88))
    for order, want_shape, want_transpose in [((0, 2, 1), (4, 88, 200), False), ((0, 1, 2), (4, 200, 88), True),
                                              ((1, 2, 0), (4, 200, 88), True), (None, (4, 200, 88), True)]:
        viewed, transpose = ops.as_stored(w, True, order)
        assert (viewed.shape, transpose) == (want_shape, want_transpose), order


# ---- The down projection read as held, experts minor-most (libtpu's layout for Gemma 4's down_proj).
# (name, tokens, hidden, intermediate, experts, top_k, options): Gemma 4's layout scaled down with
# its unaligned sizes, and gpt-oss's (transposed, interleaved, biases, clamp).
HELD_CASES = [
    ("gemma4", 13, 176, 88, 8, 2, dict(activation="gelu_tanh")),
    ("gpt_oss", 13, 200, 88, 8, 2, dict(activation="clamped_swiglu", interleaved=True, transposed=True,
                                        alpha=1.702, limit=7.0)),
]


def _held_inputs(case, dtype):
    _, t, h, i, e, k, options = case
    rng = np.random.default_rng(3)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    # Distinct experts per token; the last token's second slot routed to another shard (the sentinel E).
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)
    ids[-1, -1] = e
    weights = jnp.asarray(rng.random((t, k)), dtype)
    transposed = options.get("transposed", False)
    up, down = ((normal(e, h, 2 * i), normal(e, i, h)) if transposed else (normal(e, 2 * i, h), normal(e, h, i)))
    biases = (normal(e, 2 * i), normal(e, h)) if transposed else (None, None)
    return (normal(t, h), jnp.asarray(ids), weights, up, down * 0.1, *biases), options


# Sampled (tests/sampling.py): fp32; bf16 takes the same path.
@pytest.mark.parametrize("dtype", sample([jnp.float32, jnp.bfloat16], {jnp.float32}), ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", HELD_CASES, ids=lambda c: c[0])
def test_down_projection_read_as_held_matches_the_grouped_path(case, dtype, monkeypatch):
    """experts_forward with down_proj held experts minor-most (its down projection one matmul over
    every expert's weights, `ops._down_as_held`) against the grouped kernels' path: forward and the
    gradients of the hidden states, routing weights, weights and biases. fp32: within TOLERANCE.
    bf16: the two share the up projection and gate bit for bit (so the clamp decides alike); in the
    down projection each (token, expert) term rounds w * act once where the grouped path rounds act,
    and each result is rounded to bf16: the output within 2^-7 of its largest value (a bf16 ulp at
    the top of its binade, one rounding apart); the gradients, which carry that rounding through the
    gate's derivative into sums over the tokens' rows, within 2^-5 (measured: 2^-6.8). A wrong
    expert, row or weight is off by the value itself."""
    args, options = _held_inputs(case, dtype)
    down_shape = args[4].shape
    forward = lambda *a: ops.experts_forward(*a, **options, generation="v6e")
    cot = jnp.asarray(np.random.default_rng(4).standard_normal(args[0].shape), dtype)
    grouped, grouped_vjp = jax.vjp(forward, *args)
    monkeypatch.setattr(ops, "stored_order", lambda shape, dtype: (1, 2, 0) if shape == down_shape else None)
    assert ops.down_held_experts_minor(args[4], args[0].shape[0], "v6e")
    held, held_vjp = jax.vjp(forward, *args)
    assert held.shape == grouped.shape and held.dtype == dtype
    names = ("out", "hidden_states", "top_k_index", "top_k_weights", "up_proj", "down_proj", "up_bias", "down_bias")
    for name, got, want in zip(names, (held, *held_vjp(cot)), (grouped, *grouped_vjp(cot))):
        if name == "top_k_index" or got is None:
            continue
        got, want = got.astype(jnp.float32), want.astype(jnp.float32)
        scale = max_abs(want)
        bound = TOLERANCE[jnp.float32] * max(scale, 1.0) if dtype == jnp.float32 else \
            (2**-7 if name == "out" else 2**-5) * scale
        assert max_error(got, want) <= bound, name


@pytest.mark.parametrize("order,tokens,generation,want", [
    ((1, 2, 0), 64, "v6e", True), ((1, 2, 0), 559, "v6e", True), ((1, 2, 0), 561, "v6e", False),
    ((1, 2, 0), 241, "v5e", False), ((0, 2, 1), 64, "v6e", False), (None, 64, "v6e", False)])
def test_down_projection_read_as_held_only_while_its_matmul_fits_the_weights_read(order, tokens, generation, want,
                                                                                    monkeypatch):
    """One matmul over every expert's weights costs tokens x the grouped one's FLOPs: taken while
    that stays within the time to read the weights (v6e: 918 TFLOP/s over 1.64 TB/s, 560 tokens),
    and only for weights held experts minor-most."""
    monkeypatch.setattr(ops, "stored_order", lambda shape, dtype: order)
    down = jax.ShapeDtypeStruct((128, 2112, 704), jnp.bfloat16)
    assert ops.down_held_experts_minor(down, tokens, generation) == want


def test_given_blocks_are_the_forward_kernels():
    """ragged_dot(blocks=...) runs the forward kernel with those blocks (its grid: N tiles, visits,
    K steps) and the same result as the table's."""
    from ragged_dot.kernel import BlockSizes

    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal((40, 256)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((3, 256, 384)), jnp.float32)
    sizes = jnp.asarray([10, 0, 25], jnp.int32)
    blocks = BlockSizes(block_m=16, block_k=128, block_n=128)

    def grids(fn):
        found = []

        def walk(jaxpr):
            for eqn in jaxpr.eqns:
                if eqn.primitive.name == "pallas_call":
                    found.append(tuple(eqn.params["grid_mapping"].grid))
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    walk(sub)

        walk(jax.make_jaxpr(fn)(lhs).jaxpr)
        return found

    given = lambda x: ops.ragged_dot(x, rhs, sizes, blocks=blocks)
    assert grids(given)[0][0::2] == (3, 2)  # 384 / 128 column tiles, 256 / 128 K steps
    assert grids(given) != grids(lambda x: ops.ragged_dot(x, rhs, sizes))
    want = ops.ragged_dot(lhs, rhs, sizes)  # fp32: only the summation order differs (K in two steps)
    np.testing.assert_allclose(given(lhs), want, rtol=0, atol=1e-5 * max_abs(want))


@pytest.mark.parametrize("rows", [8, 512, 513], ids=["few", "one_hot_limit", "gathered"])
def test_take_rows_is_the_gather_and_keeps_a_rows_nan_its_own(rows):
    """take_rows equals table[index] bit for bit (a one-hot matmul up to ONE_HOT_ROWS rows of a
    16-bit table: one term per output), and a source row holding NaN or inf spoils only the rows
    taken from it (whole NaN through the matmul; as they are through the gather). The matmul's
    gradient is the gather's, summed in fp32."""
    rng = np.random.default_rng(7)
    table = jnp.asarray(rng.standard_normal((rows, 384)), jnp.bfloat16)
    index = jnp.asarray(rng.integers(0, rows, 600), jnp.int32)
    np.testing.assert_array_equal(np.asarray(ops.take_rows(table, index), np.float32),
                                  np.asarray(table[index], np.float32))
    spoilt = table.at[3, 5].set(jnp.nan).at[rows - 1, 0].set(jnp.inf)
    got, want = np.asarray(ops.take_rows(spoilt, index), np.float32), np.asarray(spoilt[index], np.float32)
    bad = np.isin(np.asarray(index), [3, rows - 1])
    np.testing.assert_array_equal(got[~bad], want[~bad])
    if rows > ops.ONE_HOT_ROWS:
        np.testing.assert_array_equal(got, want)
    else:
        assert np.isnan(got[bad]).all()
    if rows > ops.ONE_HOT_ROWS:
        return  # XLA's gather, and its gradient
    cotangent = jnp.asarray(rng.standard_normal((600, 384)), jnp.float32)
    grad = jax.grad(lambda t: jnp.sum(ops.take_rows(t, index).astype(jnp.float32) * cotangent))(table)
    want_grad = jnp.zeros((rows, 384), jnp.float32).at[index].add(cotangent)
    assert max_error(grad.astype(jnp.float32), want_grad) <= 2 ** -8 * max_abs(want_grad)


def test_a_tokens_nan_stays_its_own_at_decode():
    """bf16 decode (rows gathered and combined by one-hot matmuls): a token whose hidden state holds
    NaN, and one holding inf, leave every other token's output as it is without them."""
    rng = np.random.default_rng(8)
    t, h, i, e, k = 16, 256, 128, 8, 2
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape) * 0.1, jnp.bfloat16)
    ids = jnp.asarray(np.argsort(rng.random((t, e)), axis=1)[:, :k], jnp.int32)
    weights, up, down = normal(t, k), normal(e, 2 * i, h), normal(e, h, i)
    hidden = normal(t, h)
    clean = ops.experts_forward(hidden, ids, weights, up, down, generation="v6e", interpret=True)
    spoilt = ops.experts_forward(hidden.at[3, 7].set(jnp.nan).at[9, 0].set(jnp.inf), ids, weights, up, down,
                                 generation="v6e", interpret=True)
    others = np.setdiff1d(np.arange(t), [3, 9])
    np.testing.assert_array_equal(np.asarray(spoilt[others], np.float32), np.asarray(clean[others], np.float32))
    assert not np.isfinite(np.asarray(spoilt[np.array([3, 9])], np.float32)).any()


@pytest.mark.parametrize("tokens", [24, 300], ids=["summed_by_a_matmul", "gathered_back"])
@pytest.mark.parametrize("weight_dtype", [jnp.bfloat16, jnp.float32], ids=["bf16_weights", "fp32_weights"])
def test_experts_combine_matches_the_reference(tokens, weight_dtype):
    """bf16 experts: each token's output is its slots' down projections times their routing weights,
    summed, whether the step sums them by one matmul (up to COMBINE_TOKENS tokens) or gathers the
    rows back (more); a slot routed to another shard (id E) adds nothing. Against float64 on the
    same bf16 values: the kernels' bf16 rounding of each projection (2^-8 each, through the gate)
    and the output's, 2^-6 of the largest output."""
    rng = np.random.default_rng(9)
    h, i, e, k = 128, 128, 8, 2
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape) * 0.3, jnp.bfloat16)
    ids = np.argsort(rng.random((tokens, e)), axis=1)[:, :k]
    ids[::5, 1] = e  # on another shard
    weights = jnp.asarray(rng.uniform(0.1, 1, (tokens, k)), weight_dtype)
    hidden, up, down = normal(tokens, h), normal(e, 2 * i, h), normal(e, h, i)
    got = ops.experts_forward(hidden, jnp.asarray(ids, jnp.int32), weights, up, down, generation="v6e",
                              interpret=True)
    x, w_up, w_down, w = (np.asarray(a, np.float64) for a in (hidden, up, down, weights))
    want = np.zeros((tokens, h))
    for t in range(tokens):
        for slot in range(k):
            if ids[t, slot] < e:
                gate, upv = np.split(w_up[ids[t, slot]] @ x[t], 2)
                want[t] += w[t, slot] * (w_down[ids[t, slot]] @ (gate / (1 + np.exp(-gate)) * upv))
    assert max_error(np.asarray(got, np.float32), want) <= 2 ** -6 * max_abs(want)
