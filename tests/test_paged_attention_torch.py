"""paged_attention's torch layer: vLLM's two calls on torch tensors against the f32 reference,
the cache written in place, opcheck, and bad input named before any kernel runs."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import paged_attention
from paged_attention import ops, reference, torch_ops

PAGES, PAGE_SIZE, HKV, HQ, D = 14, 16, 2, 8, 64


def _batch(dtype=torch.float32, cache_dtype=None, seed=0):
    """Three live sequences (decode, chunked prefill, prefill) and one padding sequence, over
    shuffled pages; q has two padding tokens past the live ones."""
    g = torch.Generator().manual_seed(seed)
    q_lens, kv_lens = [1, 6, 9, 0], [20, 40, 9, 0]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    table = torch.randperm(PAGES, generator=g)[:12].reshape(4, 3).to(torch.int32)
    cache = lambda: torch.randn(PAGES, PAGE_SIZE, HKV, D, generator=g).to(cache_dtype or dtype)
    q = torch.randn(int(cu[-1]) + 2, HQ, D, generator=g).to(dtype)
    return q, cache(), cache(), torch.tensor(kv_lens, dtype=torch.int32), table, cu, 3


def _reference(q, k_cache, v_cache, kv_lens, table, cu, num_seqs, **options):
    as_jax = lambda t: jnp.asarray(t.float().numpy()) if t.is_floating_point() else jnp.asarray(t.numpy())
    options = {k: as_jax(v) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    out = reference.ragged_paged_attention(*(as_jax(t) for t in (q, k_cache, v_cache, kv_lens, table, cu)),
                                           num_seqs, **options)
    return torch.from_numpy(np.array(out))


OPTIONS = [
    {},
    dict(sliding_window=12, softcap=4.0, softmax_scale=0.1),
    dict(sinks=True),
]


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "window_softcap_scale", "sinks"])
def test_matches_the_reference_in_fp32(options):
    q, *rest = _batch()
    if options.get("sinks"):
        options = dict(options, sinks=torch.randn(HQ, generator=torch.Generator().manual_seed(3)))
    out = paged_attention.ragged_paged_attention(q, *rest, **options)
    expected = _reference(q, *rest, **options)
    assert out.shape == q.shape and out.dtype == q.dtype
    # f32 throughout: only reassociation separates them (the bound is 1e-4).
    assert (out - expected).abs().max() <= 2e-5 * expected.abs().max()
    assert not out[16:].any(), "tokens past the live sequences must get zeros"


def test_bf16_and_num_seqs_as_a_tensor():
    """bf16 q and cache; num_seqs given as a one-element int32 tensor (no host value needed).
    Within 2^-8 of max |v|: probabilities enter PV rounded to bf16, the output is rounded."""
    q, k, v, kv_lens, table, cu, live = _batch(torch.bfloat16)
    out = paged_attention.ragged_paged_attention(q, k, v, kv_lens, table, cu, torch.tensor([live], dtype=torch.int32))
    assert out.dtype == torch.bfloat16
    expected = _reference(q, k, v, kv_lens, table, cu, live)
    assert (out.float() - expected).abs().max() <= 2**-8 * v.float().abs().max()


def test_cache_write_is_in_place():
    """reshape_and_cache_flash changes exactly the slots given (a -1 slot is skipped), in the
    caller's tensors; int64 slot_mapping is accepted, as vLLM passes it; fp8 stores x / scale."""
    g = torch.Generator().manual_seed(1)
    key, value = torch.randn(5, HKV, D, generator=g), torch.randn(5, HKV, D, generator=g)
    slots = torch.tensor([3, -1, 17, PAGES * PAGE_SIZE - 1, 40], dtype=torch.int64)
    for cache_dtype, scale in ((torch.float32, None), (torch.float8_e4m3fn, 0.5)):
        k_cache = torch.randn(PAGES, PAGE_SIZE, HKV, D, generator=g).to(cache_dtype)
        v_cache = torch.randn(PAGES, PAGE_SIZE, HKV, D, generator=g).to(cache_dtype)
        k_before, v_before = k_cache.clone(), v_cache.clone()
        k_ptr = k_cache.data_ptr()
        paged_attention.reshape_and_cache_flash(key, value, k_cache, v_cache, slots, k_scale=scale, v_scale=scale)
        assert k_cache.data_ptr() == k_ptr
        for cache, before, new in ((k_cache, k_before, key), (v_cache, v_before, value)):
            flat, flat_before = cache.reshape(-1, HKV, D).float(), before.reshape(-1, HKV, D).float()
            written = slots[slots >= 0]
            stored = (new / (scale or 1.0)).to(cache_dtype).float()
            assert torch.equal(flat[written], stored[slots >= 0])
            untouched = torch.ones(flat.shape[0], dtype=torch.bool)
            untouched[written] = False
            assert torch.equal(flat[untouched], flat_before[untouched])


def test_written_cache_is_what_attention_reads():
    """The serving step: write the new tokens' K and V, then attend over the pages."""
    q, k_cache, v_cache, kv_lens, table, cu, live = _batch(seed=4)
    g = torch.Generator().manual_seed(5)
    new_k, new_v = torch.randn(q.shape[0], HKV, D, generator=g), torch.randn(q.shape[0], HKV, D, generator=g)
    slots = torch.full((q.shape[0],), -1, dtype=torch.int32)
    for s in range(live):
        for t in range(int(cu[s]), int(cu[s + 1])):
            position = int(kv_lens[s]) - int(cu[s + 1] - cu[s]) + t - int(cu[s])
            slots[t] = table[s, position // PAGE_SIZE] * PAGE_SIZE + position % PAGE_SIZE
    expected_caches = [c.clone().reshape(-1, HKV, D) for c in (k_cache, v_cache)]
    for cache, new in zip(expected_caches, (new_k, new_v)):
        cache[slots[slots >= 0].long()] = new[slots >= 0]
    paged_attention.reshape_and_cache_flash(new_k, new_v, k_cache, v_cache, slots)
    out = paged_attention.ragged_paged_attention(q, k_cache, v_cache, kv_lens, table, cu, live)
    expected = _reference(q, *(c.reshape(k_cache.shape) for c in expected_caches), kv_lens, table, cu, live)
    assert (out - expected).abs().max() <= 2e-5 * expected.abs().max()


def test_opcheck():
    q, k, v, kv_lens, table, cu, live = _batch()
    args = (q[:16], k, v, kv_lens, table, cu, torch.tensor(live, dtype=torch.int32), torch.randn(HQ), 0.125, 0,
            0.0, True, 1.0, 1.0, False)
    torch.library.opcheck(torch_ops.attention_op, args)
    slots = torch.arange(8, dtype=torch.int32)
    torch.library.opcheck(torch_ops.write_op, (q[:8, :HKV], q[:8, :HKV], k, v, slots, 1.0, 1.0, False))


def test_head_major_caches_serve_the_same_step():
    """The serving step with head-major caches ([pages, Hkv, page_size, D]): the write lands
    where the token-major write does, in the caller's tensors, and attention gives the same bits."""
    q, k_cache, v_cache, kv_lens, table, cu, live = _batch(seed=6)
    g = torch.Generator().manual_seed(7)
    new_k, new_v = torch.randn(q.shape[0], HKV, D, generator=g), torch.randn(q.shape[0], HKV, D, generator=g)
    slots = torch.tensor([5, -1, 70, 71, 72, 73, 74, 75, 100, 101, 102, 103, 104, 105, 106, 107, 200, -1],
                         dtype=torch.int32)[:q.shape[0]]
    k_head, v_head = (c.transpose(1, 2).contiguous() for c in (k_cache, v_cache))
    k_ptr = k_head.data_ptr()
    paged_attention.reshape_and_cache_flash(new_k, new_v, k_cache, v_cache, slots)
    paged_attention.reshape_and_cache_flash(new_k, new_v, k_head, v_head, slots, cache_layout="head_major")
    assert k_head.data_ptr() == k_ptr
    assert torch.equal(k_head, k_cache.transpose(1, 2)) and torch.equal(v_head, v_cache.transpose(1, 2))
    out = paged_attention.ragged_paged_attention(q, k_head, v_head, kv_lens, table, cu, live, cache_layout="head_major")
    assert torch.equal(out, paged_attention.ragged_paged_attention(q, k_cache, v_cache, kv_lens, table, cu, live))
    with pytest.raises(ValueError, match="cache_layout must be one of"):
        paged_attention.ragged_paged_attention(q, k_head, v_head, kv_lens, table, cu, live, cache_layout="paged")


def _edit(arrays: dict, **changes):
    return {**arrays, **changes}


BAD = [
    ("cu_q_lens", dict(cu_q_lens=torch.tensor([1, 1, 7, 16, 16], dtype=torch.int32)), ValueError, "start at 0"),
    ("cu_q_lens", dict(cu_q_lens=torch.tensor([0, 7, 1, 16, 16], dtype=torch.int32)), ValueError, "not decrease"),
    ("cu_q_lens", dict(cu_q_lens=torch.tensor([0, 1, 7, 19, 19], dtype=torch.int32)), ValueError, "past the 18"),
    ("kv_lens", dict(kv_lens=torch.tensor([20, 5, 9, 0], dtype=torch.int32)), ValueError, "6 new tokens but kv_lens 5"),
    ("kv_lens", dict(kv_lens=torch.tensor([20, 49, 9, 0], dtype=torch.int32)), ValueError, "past page_indices' 3"),
    ("page_indices", dict(page_indices=torch.tensor([[0, 99, 2]] * 4, dtype=torch.int32)), ValueError,
     r"page_indices used by live sequences must lie in \[0, 14\)"),
    ("num_seqs", dict(num_seqs=5), ValueError, "num_seqs 5"),
    ("q", dict(q=torch.randn(18, 3, D)), ValueError, "not a multiple of the cache's 2 KV heads"),
    ("q", dict(q=torch.randn(18, HQ, 32)), ValueError, "head_dim 32 differs"),
    ("q", dict(q=torch.randn(18, HQ, D).half()), TypeError, "q must be one of"),
    ("kv_lens", dict(kv_lens=torch.tensor([20, 40, 9, 0])), TypeError, "kv_lens must be one of"),
    ("v_cache", dict(v_cache=torch.randn(PAGES, 8, HKV, D)), ValueError, "differ in pages, page_size"),
    ("sinks", dict(sinks=torch.randn(3)), ValueError, "sinks must be"),
    ("sliding_window", dict(sliding_window=0), ValueError, "sliding_window"),
    ("k_scale", dict(k_scale=-1.0), ValueError, "k_scale"),
]


@pytest.mark.parametrize("name,change,error,match", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_raises_naming_the_argument(name, change, error, match):
    q, k, v, kv_lens, table, cu, live = _batch()
    args = dict(q=q, k_cache=k, v_cache=v, kv_lens=kv_lens, page_indices=table, cu_q_lens=cu, num_seqs=live)
    with pytest.raises(error, match=match):
        paged_attention.ragged_paged_attention(**_edit(args, **change))


def test_bad_cache_write_raises():
    k = torch.zeros(PAGES, PAGE_SIZE, HKV, D)
    new = torch.zeros(2, HKV, D)
    with pytest.raises(ValueError, match=r"slot_mapping values must be -1 \(skip\) or lie in \[0, 224\)"):
        paged_attention.reshape_and_cache_flash(new, new, k, k.clone(), torch.tensor([0, 224]))
    with pytest.raises(TypeError, match="slot_mapping must be one of"):
        paged_attention.reshape_and_cache_flash(new, new, k, k.clone(), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="matching the cache"):
        paged_attention.reshape_and_cache_flash(torch.zeros(2, 1, D), new, k, k.clone(), torch.tensor([0, 1]))


def test_device_check_needs_no_host_values():
    """Index values the host does not check (a TPU tensor's) are checked on the device: an
    invalid page index makes the output NaN instead of reading outside the cache."""
    q, k, v, kv_lens, table, cu, live = _batch()
    bad = table.clone()
    bad[1, 1] = PAGES + 3
    out = ops.ragged_paged_attention(*(jnp.asarray(t.numpy()) for t in (q, k, v, kv_lens, bad, cu)), live)
    assert bool(jnp.isnan(out).all())


def test_token_and_sequence_counts_are_bucketed(monkeypatch):
    """Calls with 17 or 18 tokens over 3 or 4 sequences reach the kernel as one shape: a serving
    loop compiles a bounded set of programs."""
    shapes = set()
    op = torch_ops.attention_op

    def recorded(*args):
        shapes.add(tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
        return op(*args)

    monkeypatch.setattr(torch_ops, "attention_op", recorded)
    q, k, v, kv_lens, table, cu, live = _batch()
    for tokens, seqs in ((18, 4), (17, 4), (17, 3)):
        paged_attention.ragged_paged_attention(q[:tokens], k, v, kv_lens[:seqs], table[:seqs], cu[:seqs + 1], 3)
    assert len(shapes) == 1, shapes


def test_device_branch_reads_no_value_and_reports_bad_indices(device_branch):
    """The branch TPU tensors take reads no value on the host (each read would be a sync in
    torch_tpu's eager mode) and gives the reference's result; a page index past the cache makes
    the output NaN; an int64 slot past the cache (past int32 too) is not written anywhere."""
    q, k, v, kv_lens, table, cu, live = _batch()
    call = lambda table: paged_attention.ragged_paged_attention(q, k, v, kv_lens, table, cu, live)
    bad_table = table.clone()
    bad_table[1, 1] = PAGES + 3
    device_branch.clear()  # the reads building the inputs
    good, bad = call(table), call(bad_table)
    new, cache = torch.ones(2, HKV, D), torch.zeros(PAGES, PAGE_SIZE, HKV, D)
    paged_attention.reshape_and_cache_flash(new, new, cache, cache.clone(), torch.tensor([(1 << 32) + 3, -7]))
    assert device_branch == [], f"the device branch read tensor values on the host: {device_branch}"
    torch.testing.assert_close(good, _reference(q, k, v, kv_lens, table, cu, live), rtol=0, atol=1e-5)
    assert torch.isnan(bad).all() and not cache.any()
