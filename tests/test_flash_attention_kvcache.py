"""flash-attn-tpu's `flash_attn_with_kvcache` (flash-attn 2's inference API, run by the vendored
paged kernel), loaded as users load it: the built Hub tree, get_kernel offline.

Called as flash-attn's own tests call it (tests/test_flash_attn.py::test_flash_attn_kvcache):
contiguous and paged caches, new tokens appended at cache_seqlens (crossing a page, into a full
cache, at 0), cache_batch_idx, block tables padded with -1 past a row's blocks as transformers
pads them, GQA, MQA, windows, softcap, sinks, return_softmax_lse; against a plain torch
reference in float64 on the same (rounded) inputs, with the caches bit-identical to the
reference's writes everywhere. Bad index values are errors naming the argument on CPU tensors,
and NaN outputs on the device branch, and in both cases the caches are left untouched."""

import functools
import sys

import pytest
import torch

import build_collection
from sampling import sample  # noqa: E402

KERNELS = build_collection.load_manifest()["kernels"]
REPO = KERNELS["flash_attention"]["repo-id"]


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    return build_collection.load_from_hub(["flash_attention"], tmp_path_factory.mktemp("build"))["flash_attention"]


def reference(q, k_cache, v_cache, k, v, cache_seqlens, block_table=None, cache_batch_idx=None, causal=False,
              window_size=(-1, -1), softcap=0.0, softmax_scale=None, sinks=None):
    """(out [B, Sq, Hq, D] float64, lse [B, Hq, Sq] float64, k_cache, v_cache after the write):
    flash-attn 2's documented semantics, one row at a time, in float64."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    batch, seq_q, hq, d = q.shape
    hkv = k_cache.shape[2]
    new = 0 if k is None else k.shape[1]
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    outs, lses = [], []
    for b in range(batch):
        start = cache_seqlens if isinstance(cache_seqlens, int) else int(cache_seqlens[b])
        if block_table is not None:
            page = k_cache.shape[1]
            slot = lambda p: (int(block_table[b, p // page]), p % page)
        else:
            row = int(cache_batch_idx[b]) if cache_batch_idx is not None else b
            slot = lambda p: (row, p)
        for j in range(new):
            k_cache[slot(start + j)] = k[b, j]
            v_cache[slot(start + j)] = v[b, j]
        seq_k = start + new
        keys = torch.stack([k_cache[slot(p)] for p in range(seq_k)]) if seq_k else k_cache.new_zeros(0, hkv, d)
        values = torch.stack([v_cache[slot(p)] for p in range(seq_k)]) if seq_k else keys
        keys, values = (x.double().repeat_interleave(hq // hkv, dim=1) for x in (keys, values))
        s = torch.einsum("qhd,khd->hqk", q[b].double(), keys) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        position = torch.arange(seq_q)[:, None] + seq_k - seq_q
        key = torch.arange(seq_k)[None, :]
        left, right = window_size
        seen = torch.ones(seq_q, seq_k, dtype=torch.bool)
        if causal:
            seen &= key <= position
        elif right >= 0:
            seen &= key <= position + right
        if left >= 0:
            seen &= key >= position - left
        s = s.masked_fill(~seen, -torch.inf)
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None, None].expand(hq, seq_q, 1)], dim=-1)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.where(seen[None] if sinks is None else torch.cat(
            [seen, torch.zeros(seq_q, 1, dtype=torch.bool)], -1)[None], torch.exp(s - lse[..., None]), 0.0)
        o = torch.einsum("hqk,khd->qhd", p[..., :seq_k], values)
        outs.append(o)
        lses.append(torch.where(torch.isneginf(lse), torch.inf, lse))
    return torch.stack(outs), torch.stack(lses), k_cache, v_cache


# fp32: each output is a convex combination of value rows, summed in f32 over at most 64 keys
# here (each term's relative error a few f32 ulps): 2e-5 of the largest |v| (the paged kernel's own
# fp32 bound). bf16: inputs rounded to bf16 before the reference, f32 accumulation in the kernel, the
# output rounded to bf16 (2^-9 relative) and the probabilities entering the value matmul in bf16
# (2^-9 of each weight): 2^-8 of the largest |v|.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2 ** -8}


def _check(flash, q, k_cache, v_cache, k=None, v=None, lse_atol=1e-5, **kwargs):
    """Calls the kernel and the reference on copies of the same caches; outputs within the
    dtype's bound, lse (when asked) within lse_atol, caches bit-identical."""
    expected, expected_lse, expected_k, expected_v = reference(q, k_cache, v_cache, k, v, **kwargs)
    kc, vc = k_cache.clone(), v_cache.clone()
    ptr = kc.data_ptr()
    out, lse = flash.flash_attn_with_kvcache(q, kc, vc, k, v, return_softmax_lse=True, **kwargs)
    assert kc.data_ptr() == ptr, "the cache must be written in place"
    assert torch.equal(kc, expected_k) and torch.equal(vc, expected_v), "caches must change at the new tokens only"
    bound = TOLERANCE[q.dtype] * float(v_cache.abs().max() if k is None else torch.cat([v_cache.flatten(),
                                                                                          v.flatten()]).abs().max())
    err = (out.double() - expected).abs().max().item()
    assert out.shape == q.shape and out.dtype == q.dtype
    assert err <= bound, f"max error {err} past {bound}"
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    finite = torch.isfinite(expected_lse)
    assert torch.equal(torch.isfinite(lse), finite), "a query that sees nothing gets +inf lse"
    assert torch.all(lse[~finite] == torch.inf)
    torch.testing.assert_close(lse[finite].double(), expected_lse[finite], rtol=1e-6, atol=lse_atol)
    assert torch.equal(flash.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, **kwargs), out), \
        "without return_softmax_lse: the same output, alone"
    return out


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _paged_case(dtype=torch.float32, hq=4, hkv=2, d=32, seq_q=3, new=3, page=16, seqlens=(0, 14, 61)):
    """Three rows over shuffled pages of 16: row 0 empty, row 1's append crosses a page, row 2 fills
    its 4 blocks exactly (61 + 3 = 64). block_table is -1 past each row's blocks, as
    transformers pads it; the pages no row uses hold NaN, so a read of one shows."""
    num_blocks, width = 14, 5
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3)).to(torch.int32)
    table = torch.full((3, width), -1, dtype=torch.int32)
    counts = [-(-(s + new) // page) for s in seqlens]
    taken = 0
    for b, c in enumerate(counts):
        table[b, :c] = perm[taken:taken + c]
        taken += c
    k_cache = _randn(num_blocks, page, hkv, d, dtype=dtype, seed=1)
    v_cache = _randn(num_blocks, page, hkv, d, dtype=dtype, seed=2)
    k_cache[perm[taken:]] = torch.nan
    v_cache[perm[taken:]] = torch.nan
    for b, s in enumerate(seqlens):  # and the rows past each row's keys in its last block
        end = s + new
        if end % page:
            k_cache[table[b, end // page], end % page:] = torch.nan
            v_cache[table[b, end // page], end % page:] = torch.nan
    q = _randn(3, seq_q, hq, d, dtype=dtype, seed=4)
    k = _randn(3, new, hkv, d, dtype=dtype, seed=5) if new else None
    v = _randn(3, new, hkv, d, dtype=dtype, seed=6) if new else None
    return q, k_cache, v_cache, k, v, dict(cache_seqlens=torch.tensor(seqlens, dtype=torch.int32), block_table=table)


def _nan_safe_equal(a, b):
    return torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0))


PAGED = {
    "decode": dict(seq_q=1, new=1, seqlens=(0, 15, 63)),  # 15 + 1: the page's last row; 63 + 1: full
    "append_crosses_a_page": dict(),
    "mqa": dict(hq=4, hkv=1),
    "mha": dict(hq=2, hkv=2),
    "no_new_tokens": dict(new=0, seqlens=(0, 20, 64)),  # row 0 sees nothing: zeros, lse +inf
    "more_queries_than_keys": dict(seq_q=5, new=2, seqlens=(0, 1, 62)),  # row 0's first 3 queries see nothing
}


@pytest.mark.parametrize("case", PAGED)
@pytest.mark.parametrize("causal", sample([True, False], {True}))  # non-causal: test_paged_options
def test_paged_cache(flash, case, causal):
    q, k_cache, v_cache, k, v, kwargs = _paged_case(**PAGED[case])
    if not causal and q.shape[1] > 1 and case == "more_queries_than_keys":
        kwargs["window_size"] = (-1, 1)  # non-causal with a right window: each query its own prefix
    expected = reference(q, torch.nan_to_num(k_cache), torch.nan_to_num(v_cache), k, v, causal=causal, **kwargs)
    out = _check_nan_caches(flash, q, k_cache, v_cache, k, v, expected, causal=causal, **kwargs)
    if case == "no_new_tokens":
        assert torch.all(out[0] == 0), "a row with no keys gets zeros"


def _check_nan_caches(flash, q, k_cache, v_cache, k, v, expected, **kwargs):
    """_check for caches holding NaN where no row may read: the reference reads them NaN-free."""
    out_ref, lse_ref, k_ref, v_ref = expected
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = flash.flash_attn_with_kvcache(q, kc, vc, k, v, return_softmax_lse=True, **kwargs)
    written = ~torch.isnan(k_cache) | (k_ref != torch.nan_to_num(k_cache))
    assert torch.equal(kc[written], k_ref[written]) and torch.equal(vc[written], v_ref[written])
    assert torch.isnan(kc[~written]).all(), "rows no new token goes to keep their content"
    bound = TOLERANCE[q.dtype] * float(torch.nan_to_num(v_cache).abs().max().clamp(min=v.abs().max() if v is not None
                                                                                   else 0))
    assert not out.isnan().any()
    err = (out.double() - out_ref).abs().max().item()
    assert err <= bound, f"max error {err} past {bound}"
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite) and torch.all(lse[~finite] == torch.inf)
    torch.testing.assert_close(lse[finite].double(), lse_ref[finite], rtol=1e-6, atol=1e-5)
    return out


@pytest.mark.parametrize("options", [
    dict(causal=True, window_size=(4, 0)),  # 5 keys: the query and 4 before
    dict(causal=True, window_size=(0, 3)),  # causal ignores the right window: the query alone
    dict(causal=True, softcap=2.0, softmax_scale=0.7),
    dict(causal=True, sinks=True),
    dict(causal=False, window_size=(-1, 2)),  # non-causal, two keys past each query
    dict(causal=True, window_size=(6, 6), softcap=5.0, sinks=True),  # transformers' (w - 1, w - 1)
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_paged_options(flash, options):
    q, k_cache, v_cache, k, v, kwargs = _paged_case(seq_q=4, new=4, seqlens=(3, 13, 40))
    options = dict(options)
    if options.pop("sinks", False):
        options["sinks"] = _randn(q.shape[2], seed=9) * 2
    expected = reference(q, torch.nan_to_num(k_cache), torch.nan_to_num(v_cache), k, v, **kwargs, **options)
    if "sinks" in options:
        options["s_aux"] = options.pop("sinks")
    _check_nan_caches(flash, q, k_cache, v_cache, k, v, expected, **kwargs, **options)


def test_sinks_as_learnable_sink(flash):
    """transformers passes the sinks as learnable_sink to a function without s_aux (FA4's name)."""
    q, k_cache, v_cache, k, v, kwargs = _paged_case(seq_q=1, new=1)
    sinks = _randn(q.shape[2], seed=9)
    a = flash.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, s_aux=sinks, causal=True, **kwargs)
    b = flash.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, learnable_sink=sinks, causal=True,
                                      **kwargs)
    plain = flash.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, causal=True, **kwargs)
    assert torch.equal(a, b) and not torch.equal(a, plain)


@pytest.mark.parametrize("seqlen_cache", sample([64, 48, 40], {64, 40}))  # pages of 64, 16 and 8 tokens
@pytest.mark.parametrize("batch_idx", [False, True])
def test_contiguous_cache(flash, seqlen_cache, batch_idx):
    """[B_cache, S, Hkv, D] caches; cache_batch_idx picks each row's cache row (4 cache rows for 3
    batch rows); rows at 0, mid-way and filling the cache (S - 2 + 2 new tokens)."""
    hq, hkv, d, new = 4, 2, 32, 2
    k_cache = _randn(4, seqlen_cache, hkv, d, seed=1)
    v_cache = _randn(4, seqlen_cache, hkv, d, seed=2)
    q = _randn(3, 2, hq, d, seed=3)
    k, v = _randn(3, new, hkv, d, seed=4), _randn(3, new, hkv, d, seed=5)
    kwargs = dict(cache_seqlens=torch.tensor([0, 21, seqlen_cache - new], dtype=torch.int32), causal=True)
    if batch_idx:
        kwargs["cache_batch_idx"] = torch.tensor([3, 0, 2], dtype=torch.int32)
    _check(flash, q, k_cache, v_cache, k, v, **kwargs)


def test_contiguous_cache_int_seqlens_and_bf16(flash):
    """cache_seqlens as an int (every row); bf16 throughout, within bf16's bound."""
    k_cache = _randn(2, 32, 1, 64, dtype=torch.bfloat16, seed=1)
    v_cache = _randn(2, 32, 1, 64, dtype=torch.bfloat16, seed=2)
    q = _randn(2, 1, 8, 64, dtype=torch.bfloat16, seed=3)
    k, v = _randn(2, 1, 1, 64, dtype=torch.bfloat16, seed=4), _randn(2, 1, 1, 64, dtype=torch.bfloat16, seed=5)
    _check(flash, q, k_cache, v_cache, k, v, cache_seqlens=17, causal=True, lse_atol=1e-2)


def test_paged_bf16(flash):
    q, k_cache, v_cache, k, v, kwargs = _paged_case(dtype=torch.bfloat16)
    expected = reference(q, torch.nan_to_num(k_cache), torch.nan_to_num(v_cache), k, v, causal=True, **kwargs)
    out_ref, lse_ref, k_ref, v_ref = expected
    kc, vc = k_cache.clone(), v_cache.clone()
    out = flash.flash_attn_with_kvcache(q, kc, vc, k, v, causal=True, **kwargs)
    written = ~torch.isnan(k_cache) | (k_ref != torch.nan_to_num(k_cache))
    assert torch.equal(kc[written], k_ref[written]) and torch.equal(vc[written], v_ref[written])
    bound = 2 ** -8 * float(torch.nan_to_num(v_cache.float()).abs().max())
    assert (out.double() - out_ref).abs().max().item() <= bound


# Bad input: (what to change, the error's match). Each is an error naming the argument, raised
# before anything is written.
def _bad(case):
    q, k_cache, v_cache, k, v, kwargs = _paged_case()
    if case == "append_past_the_blocks":
        kwargs["cache_seqlens"] = torch.tensor([0, 14, 62], dtype=torch.int32)  # 62 + 3 > row 2's 4 blocks of 16
        return (q, k_cache, v_cache, k, v), kwargs, ValueError, \
            r"block_table\[2, 4\] = -1 is outside.*row 2 uses it: its cache_seqlens 62 \+ 3 new tokens span 5 blocks"
    if case == "append_past_the_table":
        kwargs["cache_seqlens"] = torch.tensor([0, 14, 78], dtype=torch.int32)  # 78 + 3 > the table's 5 blocks
        return (q, k_cache, v_cache, k, v), kwargs, ValueError, \
            r"cache_seqlens 78 \+ 3 new tokens \(k\) of batch row 2 is past block_table's 5 blocks of 16 tokens"
    if case == "block_index_out_of_range":
        kwargs["block_table"] = kwargs["block_table"].clone()
        kwargs["block_table"][1, 1] = 14
        return (q, k_cache, v_cache, k, v), kwargs, ValueError, r"block_table\[1, 1\] = 14 is outside"
    if case == "used_block_is_minus_one":
        kwargs["block_table"] = kwargs["block_table"].clone()
        kwargs["block_table"][2, 3] = -1
        return (q, k_cache, v_cache, k, v), kwargs, ValueError, r"block_table\[2, 3\] = -1 is outside"
    if case == "negative_seqlens":
        kwargs["cache_seqlens"] = torch.tensor([0, -1, 3], dtype=torch.int32)
        return (q, k_cache, v_cache, k, v), kwargs, ValueError, "cache_seqlens must be >= 0"
    if case == "k_heads_differ_from_the_cache":
        return (q, k_cache, v_cache, k[:, :, :1], v[:, :, :1]), kwargs, ValueError, r"^k \(3, 3, 1, 32\) must be"
    if case == "q_heads_not_a_multiple":
        return (q[:, :, :3], k_cache, v_cache, k, v), kwargs, ValueError, "q's 3 heads are not a multiple"
    if case == "head_dims_differ":
        return (q[..., :16], k_cache, v_cache, k, v), kwargs, ValueError, "q's head_dim 16 differs from k_cache's 32"
    if case == "contiguous_append_past_the_cache":
        kc, vc = k_cache.reshape(2, 112, 2, 32)[:2], v_cache.reshape(2, 112, 2, 32)[:2]
        args = (q[:2], kc.contiguous(), vc.contiguous(), k[:2], v[:2])
        return args, dict(cache_seqlens=torch.tensor([3, 110], dtype=torch.int32)), ValueError, \
            r"cache_seqlens 110 \+ 3 new tokens \(k\) of batch row 1 is past the cache's 112 tokens"
    if case == "cache_batch_idx_out_of_range":
        args = (q[:2], k_cache.reshape(2, 112, 2, 32).contiguous(), v_cache.reshape(2, 112, 2, 32).contiguous(),
                k[:2], v[:2])
        return args, dict(cache_seqlens=3, cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32)), ValueError, \
            r"cache_batch_idx values must lie in \[0, 2\)"
    raise AssertionError(case)


BAD = ["append_past_the_blocks", "append_past_the_table", "block_index_out_of_range", "used_block_is_minus_one", "negative_seqlens",
       "k_heads_differ_from_the_cache", "q_heads_not_a_multiple", "head_dims_differ",
       "contiguous_append_past_the_cache", "cache_batch_idx_out_of_range"]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_an_error_that_leaves_the_caches_untouched(flash, case):
    (q, k_cache, v_cache, k, v), kwargs, error, match = _bad(case)
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(error, match=match):
        flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, causal=True, **kwargs)
    assert _nan_safe_equal(k_cache, before[0]) and _nan_safe_equal(v_cache, before[1])


def _device_branch(flash, monkeypatch):
    """The loaded module's torch layer takes the TPU branch on CPU tensors."""
    torch_ops = sys.modules[flash.__name__ + ".torch_ops"]
    monkeypatch.setattr(torch_ops, "values_on_host", lambda tensor: False)


def test_device_branch_reads_no_value(flash, device_branch, monkeypatch):
    """The TPU branch (no host read of any tensor value, conftest's counter) gives the host
    branch's outputs and caches, for a paged and a contiguous cache."""
    q, k_cache, v_cache, k, v, kwargs = _paged_case()
    host = k_cache.clone(), v_cache.clone()
    expected = flash.flash_attn_with_kvcache(q, *host, k, v, causal=True, return_softmax_lse=True, **kwargs)
    contiguous = (_randn(3, 32, 2, 32, seed=1), _randn(3, 32, 2, 32, seed=2))
    c_host = tuple(c.clone() for c in contiguous)
    c_expected = flash.flash_attn_with_kvcache(q, *c_host, k, v, cache_seqlens=torch.tensor([0, 7, 29]), causal=True)
    _device_branch(flash, monkeypatch)
    device_branch.clear()
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = flash.flash_attn_with_kvcache(q, kc, vc, k, v, causal=True, return_softmax_lse=True, **kwargs)
    c_out = flash.flash_attn_with_kvcache(q, *contiguous, k, v, cache_seqlens=torch.tensor([0, 7, 29]), causal=True)
    assert device_branch == [], f"the device branch read tensor values on the host: {device_branch}"
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1]) and torch.equal(c_out, c_expected)
    assert _nan_safe_equal(kc, host[0]) and _nan_safe_equal(vc, host[1])
    assert torch.equal(contiguous[0], c_host[0]) and torch.equal(contiguous[1], c_host[1])


@pytest.mark.parametrize("case", ["append_past_the_blocks", "append_past_the_table", "block_index_out_of_range", "used_block_is_minus_one",
                                  "negative_seqlens", "contiguous_append_past_the_cache",
                                  "cache_batch_idx_out_of_range"])
def test_device_branch_reports_bad_values_as_nan_and_writes_nothing(flash, device_branch, monkeypatch, case):
    (q, k_cache, v_cache, k, v), kwargs, _, _ = _bad(case)
    before = k_cache.clone(), v_cache.clone()
    _device_branch(flash, monkeypatch)
    device_branch.clear()
    out, lse = flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, causal=True, return_softmax_lse=True,
                                             **kwargs)
    assert device_branch == []
    assert out.isnan().all() and lse.isnan().all()
    assert _nan_safe_equal(k_cache, before[0]) and _nan_safe_equal(v_cache, before[1])


def test_unsupported_options_say_so(flash):
    q, k_cache, v_cache, k, v, kwargs = _paged_case()
    for extra, match in ((dict(rotary_cos=q, rotary_sin=q), "rotary"), (dict(cache_leftpad=q), "cache_leftpad"),
                         (dict(alibi_slopes=q), "alibi_slopes"),
                         (dict(causal=False, window_size=(2, 2)), "bounded left window")):
        with pytest.raises(NotImplementedError, match=match):
            flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **{"causal": True, **kwargs, **extra})


# transformers' continuous batching: with the decode fast path open, every decode-only step
# calls flash_attn_with_kvcache with the paged cache and its block table (prefill steps take
# flash_attn_varlen_func). The tiny families as tests/test_flash_attention_models.py builds
# them; Gemma 2 and gpt-oss with full-attention layers only (transformers 5.22 gives sliding
# layers no block table, which turns the fast path off for the whole model: "*_sliding").
BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, intermediate_size=64, tie_word_embeddings=False)
GQA = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
FULL = ["full_attention", "full_attention"]
FAMILIES = {
    "llama": ("LlamaConfig", dict(BASE, **GQA)),
    "qwen3": ("Qwen3Config", dict(BASE, **GQA)),
    # MQA, head_dim 256, softcap
    "gemma2": ("Gemma2Config", dict(BASE, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                                    layer_types=FULL, attn_logit_softcapping=5.0, query_pre_attn_scalar=64)),
    # sinks, head_dim 64
    "gpt_oss": ("GptOssConfig", dict(BASE, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                     layer_types=FULL, num_local_experts=4, num_experts_per_tok=2)),
    "gemma2_sliding": ("Gemma2Config", dict(BASE, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                                            sliding_window=8, attn_logit_softcapping=5.0, query_pre_attn_scalar=64)),
}


@pytest.fixture
def decode_fast_path_open(monkeypatch):
    """transformers 5.22 opens its block-table decode path only for flash attention 2/3 on CUDA or
    XPU (`ensure_decode_fast_path_is_available`): its device check is opened here, as if
    transformers admitted TPUs (any flash implementation, XPU "available"); nothing else changes."""
    from transformers.generation.continuous_batching import initialization

    requested = initialization.is_flash_attention_requested
    monkeypatch.setattr(initialization, "is_torch_xpu_available", lambda: True)
    monkeypatch.setattr(initialization, "is_flash_attention_requested",
                        lambda config=None, requested_attention_implementation=None, version=None:
                        requested(config, requested_attention_implementation))


# Sampled (tests/sampling.py): Qwen3 (GQA) and Gemma 2 with sliding layers (the fast path off); Llama
# repeats Qwen3, gpt-oss's sinks and windows, full-attention Gemma 2's MQA, head_dim 256 and softcap
# are in the direct tests above (and gpt-oss's generate_batch in test_flash_attention_models.py).
@pytest.mark.parametrize("family", sample(FAMILIES, {"qwen3", "gemma2_sliding"}))
def test_generate_batch_decodes_through_flash_attn_with_kvcache(flash, decode_fast_path_open, monkeypatch, family,
                                                                caplog):
    import copy

    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers import modeling_flash_attention_utils as fa_utils
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssPreTrainedModel

    monkeypatch.setattr(GptOssPreTrainedModel, "_compatible_flash_implementations",
                        [*GptOssPreTrainedModel._compatible_flash_implementations, REPO])
    # transformers takes flash_attn_with_kvcache from the module get_kernel returns (this one):
    # each call is counted, with its block table and new tokens.
    served, calls = flash.flash_attn_with_kvcache, []

    @functools.wraps(served)  # transformers passes the keywords its signature names
    def counted(q, k_cache, v_cache, k=None, v=None, **kwargs):
        calls.append((q.shape[0], kwargs.get("block_table") is not None, k is not None))
        return served(q, k_cache, v_cache, k, v, **kwargs)

    monkeypatch.setattr(flash, "flash_attn_with_kvcache", counted)
    monkeypatch.setattr(fa_utils, "_loaded_implementation", None)  # transformers loads the kernel again
    config_class, kwargs = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**kwargs)
    with caplog.at_level("WARNING"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=REPO, dtype=torch.float32).eval()
        fa_utils.lazy_import_flash_attention(REPO)
    assert model.config._attn_implementation == REPO, "transformers replaced our implementation"
    assert "does not support block tables" not in caplog.text
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa" if model._supports_sdpa else "eager")
    prompts = [torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 19, 12, 3)]
    generation = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    # 16-token pages (contexts cross pages while decoding), a 16-token budget per step (the
    # 19-token prompt is prefilled in chunks; requests join at different steps).
    batching = ContinuousBatchingConfig(page_size=16, num_blocks=32, max_batch_tokens=16)
    with torch.no_grad():
        batched = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=batching)
    layers = config.num_hidden_layers
    if family.endswith("_sliding"):
        assert not calls, "sliding layers have no block table in transformers 5.22: the fast path stays off"
    else:
        assert calls and len(calls) % layers == 0, "every layer of a decode step is served by flash_attn_with_kvcache"
        assert all(table and new for _, table, new in calls), "with the block table and the new tokens"
        assert max(b for b, _, _ in calls) > 1, "several requests decode in one step"
    assert len(batched) == len(prompts)
    with torch.no_grad():
        for prompt, result in zip(prompts, sorted(batched.values(), key=lambda r: int(r.request_id.split("_")[-1]))):
            alone = reference.generate(torch.tensor([prompt]), generation_config=generation)
            assert result.generated_tokens == alone[0, len(prompt):].tolist(), result.error
