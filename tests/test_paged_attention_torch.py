"""paged_attention's torch layer: vLLM's two calls on torch tensors against the f32 reference,
the cache written in place, opcheck, and bad input named before any kernel runs."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import paged_attention
from paged_attention import ops, reference, torch_ops
from sampling import sample

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


@pytest.mark.parametrize("as_tensors", [False, True], ids=["float_scales", "tensor_scales"])
def test_cache_write_is_in_place(as_tensors):
    """reshape_and_cache_flash changes exactly the slots given (a -1 slot is skipped), in the
    caller's tensors; int64 slot_mapping is accepted, as vLLM passes it; fp8 stores key / k_scale
    and value / v_scale (distinct scales, so that a swap shows), given as floats or as vLLM's
    one-element tensors."""
    g = torch.Generator().manual_seed(1)
    key, value = torch.randn(5, HKV, D, generator=g), torch.randn(5, HKV, D, generator=g)
    slots = torch.tensor([3, -1, 17, PAGES * PAGE_SIZE - 1, 40], dtype=torch.int64)
    for cache_dtype, k_scale, v_scale in ((torch.float32, None, None), (torch.float8_e4m3fn, 0.5, 0.125)):
        k_cache = torch.randn(PAGES, PAGE_SIZE, HKV, D, generator=g).to(cache_dtype)
        v_cache = torch.randn(PAGES, PAGE_SIZE, HKV, D, generator=g).to(cache_dtype)
        k_before, v_before = k_cache.clone(), v_cache.clone()
        k_ptr = k_cache.data_ptr()
        scales = [torch.tensor([x]) if as_tensors and x else x for x in (k_scale, v_scale)]
        paged_attention.reshape_and_cache_flash(key, value, k_cache, v_cache, slots, *scales)
        assert k_cache.data_ptr() == k_ptr
        for cache, before, new, scale in ((k_cache, k_before, key, k_scale), (v_cache, v_before, value, v_scale)):
            flat, flat_before = cache.reshape(-1, HKV, D).float(), before.reshape(-1, HKV, D).float()
            written = slots[slots >= 0]
            stored = (new / (scale or 1.0)).to(cache_dtype).float()
            assert torch.equal(flat[written], stored[slots >= 0])
            untouched = torch.ones(flat.shape[0], dtype=torch.bool)
            untouched[written] = False
            assert torch.equal(flat[untouched], flat_before[untouched])


@pytest.mark.parametrize("cache_layout", ops.CACHE_LAYOUTS)
def test_padded_key_and_value_write_only_the_slots_given(cache_layout):
    """vLLM pads key and value past slot_mapping's tokens (graph capture): 40 tokens of key
    and value with 35 slots (some -1) write exactly the live slots, never a padding row, and
    every other slot keeps the 7 the cache was filled with."""
    g = torch.Generator().manual_seed(11)
    key, value = torch.randn(40, HKV, D, generator=g), torch.randn(40, HKV, D, generator=g)
    slots = torch.randperm(PAGES * PAGE_SIZE, generator=g)[:35].to(torch.int32)
    slots[[3, 20]] = -1
    shape = ops.cache_shape(PAGES, PAGE_SIZE, HKV, D, cache_layout)
    k_cache, v_cache = torch.full(shape, 7.0), torch.full(shape, 7.0)
    paged_attention.reshape_and_cache_flash(key, value, k_cache, v_cache, slots, cache_layout=cache_layout)
    live = slots >= 0
    for cache, new in ((k_cache, key), (v_cache, value)):
        flat = (cache.transpose(1, 2) if cache_layout == "head_major" else cache).reshape(-1, HKV, D)
        assert torch.equal(flat[slots[live].long()], new[:35][live])
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[slots[live].long()] = False
        assert bool((flat[untouched] == 7.0).all()), "a slot not given was written"


# (what, argument edits, the error's words: the argument and the shapes as the caller passed them).
BAD_WRITES = [
    ("more slots than tokens", dict(slot_mapping=torch.arange(50, dtype=torch.int32)),
     r"slot_mapping \(50,\) must be \[tokens\] with at most key's 40 tokens"),
    ("value shorter than key", dict(value=torch.randn(30, HKV, D)), r"key has 40 tokens and value 30"),
    ("key heads", dict(key=torch.randn(40, 1, D)), r"key \(40, 1, 64\) must be .* key_cache's"),
    ("value head_dim", dict(value=torch.randn(40, HKV, 32)), r"value \(40, 2, 32\) must be .* value_cache's"),
    ("caches' pages", dict(value_cache=torch.zeros(PAGES - 1, PAGE_SIZE, HKV, D)),
     r"key_cache \(14, 16, 2, 64\) and value_cache \(13, 16, 2, 64\) differ"),
    ("slot past the cache", dict(slot_mapping=torch.tensor([0, 224], dtype=torch.int32)),
     r"slot_mapping values must be -1 \(skip\) or lie in \[0, 224\)"),
    ("slot dtype", dict(slot_mapping=torch.tensor([0.0, 1.0])), "slot_mapping must be one of"),
    ("k_scale of two", dict(k_scale=torch.tensor([0.5, 0.5])), "k_scale must be a positive float or a one-element"),
    ("v_scale negative", dict(v_scale=torch.tensor([-0.5])), "v_scale must be positive"),
    ("k_scale zero", dict(k_scale=0.0), "k_scale must be a positive float"),
]


@pytest.mark.parametrize("what,change,match", BAD_WRITES, ids=[b[0] for b in BAD_WRITES])
def test_bad_cache_write_raises_and_writes_nothing(what, change, match):
    """Each mismatch is an error naming the argument and the caller's own shapes (not the
    bucketed ones the op sees), raised before anything is written: the caches keep their bits."""
    g = torch.Generator().manual_seed(12)
    args = dict(key=torch.randn(40, HKV, D, generator=g), value=torch.randn(40, HKV, D, generator=g),
                key_cache=torch.randn(PAGES, PAGE_SIZE, HKV, D, generator=g),
                value_cache=torch.randn(PAGES, PAGE_SIZE, HKV, D, generator=g),
                slot_mapping=torch.arange(40, dtype=torch.int32))
    args.update(change)
    before = [args["key_cache"].clone(), args["value_cache"].clone()]
    with pytest.raises((ValueError, TypeError), match=match):
        paged_attention.reshape_and_cache_flash(**args)
    assert torch.equal(args["key_cache"], before[0]) and torch.equal(args["value_cache"], before[1])


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


def _pad_past_live(kv_lens, table, cu, live, max_seqs, how, seed=0):
    """The batch's arrays padded to max_seqs sequences past the `live` ones as engines pad them:
    "ones" (vLLM's TPU runner sets cu_q_lens past the live ones to 1), "zeros", "repeats" (the
    last live offset), or "garbage" (offsets, lengths and page indices anywhere, the pages far
    outside the cache)."""
    g = torch.Generator().manual_seed(seed)
    extra = max_seqs - live
    cu_tail = {"ones": torch.ones(extra), "zeros": torch.zeros(extra), "repeats": cu[live].repeat(extra),
               "garbage": torch.randint(-1000, 1000, (extra,), generator=g)}[how]
    kv_tail = torch.randint(-50, 10**4, (extra,), generator=g) if how == "garbage" else torch.zeros(extra)
    table_tail = (torch.randint(-(10**6), 10**6, (extra, table.shape[1]), generator=g) if how == "garbage"
                  else torch.zeros(extra, table.shape[1]))
    as_int = lambda t: t.to(torch.int32)
    return (as_int(torch.cat([kv_lens[:live], kv_tail])), as_int(torch.cat([table[:live], table_tail])),
            as_int(torch.cat([cu[:live + 1], cu_tail])))


@pytest.mark.parametrize("max_seqs", sample([8, 16], {16}))  # sampled (tests/sampling.py): 8 repeats 16
@pytest.mark.parametrize("how", ["ones", "zeros", "repeats", "garbage"])
def test_arrays_past_num_seqs_are_ignored(how, max_seqs):
    """Whatever kv_lens, page_indices and cu_q_lens hold past num_seqs, the live tokens get the
    reference's output and the others zeros (vLLM pads cu_q_lens with 1s: before they were
    ignored, every token after the first of such a batch got zeros)."""
    q, k, v, kv_lens, table, cu, live = _batch(seed=8)
    padded = _pad_past_live(kv_lens, table, cu, live, max_seqs, how)
    out = paged_attention.ragged_paged_attention(q, k, v, *padded, live)
    expected = _reference(q, k, v, kv_lens[:live], table[:live], cu[:live + 1], live)
    # f32 throughout, as test_matches_the_reference_in_fp32.
    assert (out - expected).abs().max() <= 2e-5 * expected.abs().max()


@pytest.mark.parametrize("as_tensors", [False, True], ids=["float_scales", "tensor_scales"])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
def test_quantized_caches_take_distinct_k_and_v_scales(cache_dtype, as_tensors):
    """k_scale scales the scores and v_scale the output, as the reference's dequantized cache
    does; they differ by 4x, so a swap or one scale used for both is far outside the bound. The
    scales come as floats or as vLLM's one-element f32 tensors."""
    q, k, v, kv_lens, table, cu, live = _batch(seed=9)
    if cache_dtype == torch.int8:
        g = torch.Generator().manual_seed(10)
        k, v = (torch.randint(-127, 128, x.shape, generator=g, dtype=torch.int8) for x in (k, v))
        k_scale, v_scale = 0.011, 0.044
    else:
        k, v = k.to(cache_dtype), v.to(cache_dtype)
        k_scale, v_scale = 0.5, 2.0
    scales = [torch.tensor([x]) if as_tensors else x for x in (k_scale, v_scale)]
    out = paged_attention.ragged_paged_attention(q, k, v, kv_lens, table, cu, live, k_scale=scales[0],
                                                 v_scale=scales[1])
    expected = _reference(q, k, v, kv_lens, table, cu, live, k_scale=k_scale, v_scale=v_scale)
    # The stored values are exact in f32: only reassociation separates them, as in fp32.
    assert (out - expected).abs().max() <= 2e-5 * expected.abs().max()


def test_sinks_stay_in_fp32():
    """bf16 q with f32 sinks: a sink of 8.03 rounded to bf16 (8.0) would move every output by
    about 3% (the sink's weight dominates the 20-40 keys' here), far past bf16's own 2^-8 of the
    largest output; kept in f32, the output is the f32 reference's, rounded."""
    q, k, v, kv_lens, table, cu, live = _batch(torch.bfloat16, seed=13)
    sinks = torch.full((HQ,), 8.03) + torch.arange(HQ) * 0.01
    out = paged_attention.ragged_paged_attention(q, k, v, kv_lens, table, cu, live, sinks=sinks)
    expected = _reference(q, k, v, kv_lens, table, cu, live, sinks=sinks)
    assert (out.float() - expected).abs().max() <= 2**-8 * expected.abs().max()


def test_opcheck():
    q, k, v, kv_lens, table, cu, live = _batch()
    scales = torch.tensor([0.5, 2.0])
    args = (q[:16], k, v, kv_lens, table, cu, torch.tensor(live, dtype=torch.int32), torch.randn(HQ), scales, 0.125, 0,
            0.0, True, False)
    torch.library.opcheck(torch_ops.attention_op, args)
    slots = torch.arange(8, dtype=torch.int32)
    torch.library.opcheck(torch_ops.write_op, (q[:8, :HKV], q[:8, :HKV], k, v, slots, scales, False))


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
    torch_tpu's eager mode) and gives the reference's result, with the scales as tensors and
    vLLM's padding past num_seqs; a page index past the cache or a negative scale makes the
    output NaN; an int64 slot past the cache (past int32 too) is not written anywhere, nor is a
    padding row of key past slot_mapping."""
    q, k, v, kv_lens, table, cu, live = _batch()
    padded = _pad_past_live(kv_lens, table, cu, live, 8, "ones")
    scale = lambda x: torch.tensor([x])
    call = lambda table, k_scale=1.0: paged_attention.ragged_paged_attention(
        q, k, v, padded[0], table, padded[2], live, k_scale=scale(k_scale), v_scale=scale(2.0))
    bad_table = padded[1].clone()
    bad_table[1, 1] = PAGES + 3
    new, cache = torch.ones(3, HKV, D), torch.zeros(PAGES, PAGE_SIZE, HKV, D)
    device_branch.clear()  # the reads building the inputs
    good, bad, bad_scale = call(padded[1]), call(bad_table), call(padded[1], -1.0)
    paged_attention.reshape_and_cache_flash(new, new, cache, cache.clone(), torch.tensor([(1 << 32) + 3, -7]),
                                            scale(0.5), scale(0.25))
    assert device_branch == [], f"the device branch read tensor values on the host: {device_branch}"
    torch.testing.assert_close(good, _reference(q, k, v, kv_lens, table, cu, live, v_scale=2.0), rtol=0, atol=1e-5)
    assert torch.isnan(bad).all() and torch.isnan(bad_scale).all() and not cache.any()


# Calls the op's bucketed shapes would take as valid: past the caller's own counts.
PAST_THE_CALLERS_COUNTS = {
    # q's 15 tokens reach the op as 16: the live sequences end at 16.
    "live tokens past q's": lambda q, kv_lens, table, cu, live: (q[:15], kv_lens, table, cu, live),
    # kv_lens' 3 sequences reach the op as 4.
    "num_seqs past kv_lens'": lambda q, kv_lens, table, cu, live: (q, kv_lens[:3], table[:3], cu[:4],
                                                                    torch.tensor([4], dtype=torch.int32)),
}


@pytest.mark.parametrize("edit", PAST_THE_CALLERS_COUNTS.values(), ids=PAST_THE_CALLERS_COUNTS.keys())
def test_device_branch_checks_the_callers_counts(device_branch, edit):
    """On the device the index values are checked against the caller's token and sequence
    counts, not the bucketed ones the op sees: past them, the output is NaN (on CPU, an error)."""
    q, k, v, kv_lens, table, cu, live = _batch()
    q, kv_lens, table, cu, live = edit(q, kv_lens, table, cu, live)
    device_branch.clear()
    out = paged_attention.ragged_paged_attention(q, k, v, kv_lens, table, cu, live)
    assert device_branch == []
    assert torch.isnan(out).all()
