"""flash_attention's torch layer: opcheck, bad input, NaN, invalid offsets on
the device path, the shapes a growing context compiles, and its arguments'
meaning (windows, default scale, f32 sinks) against the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from test_flash_attention_numerics import FP32_TOLERANCE

import flash_attention
from flash_attention import ops, reference, torch_ops
from errors import max_abs, max_error


def _varlen(dtype=torch.float32, requires_grad=False, head_dim=64, value_dim=64):
    g = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype, requires_grad=requires_grad)
    q, k, v = make(30, 4, head_dim), make(50, 2, head_dim), make(50, 2, value_dim)
    return q, k, v, torch.tensor([0, 10, 30], dtype=torch.int32), torch.tensor([0, 20, 50], dtype=torch.int32)


def _jax(t: torch.Tensor):
    return jnp.asarray(t.detach().numpy())


def _assert_matches_reference(out, q, k, v, cu_q, cu_k, **options):
    """fp32: the kernels' only error is reassociation (test_flash_attention_numerics' FP32_TOLERANCE)."""
    expected = reference.attention_varlen(*(_jax(t) for t in (q, k, v, cu_q, cu_k)), **options)
    assert max_error(_jax(out), expected) <= FP32_TOLERANCE * max_abs(expected)


def test_opcheck():
    q, k, v, cu_q, cu_k = _varlen(requires_grad=True)
    sinks = torch.randn(4, requires_grad=True)
    num_tokens = torch.tensor([30, 50], dtype=torch.int32)
    torch.library.opcheck(torch_ops.attention_op,
                          (q, k, v, cu_q, cu_k, num_tokens, sinks, 0.125, True, -1, -1, 0.0, True))


def _call(**changes):
    q, k, v, cu_q, cu_k = _varlen()
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=20, max_seqlen_k=30) | changes
    return flash_attention.flash_attn_varlen_func(**args)


BAD = [
    (dict(dropout_p=0.1), NotImplementedError, "dropout"),
    (dict(alibi_slopes=torch.ones(4)), NotImplementedError, "alibi_slopes"),
    (dict(return_attn_probs=True), NotImplementedError, "return_attn_probs"),
    (dict(q=torch.randn(30, 3, 64)), ValueError, "multiple"),  # 3 query heads over 2 KV heads
    (dict(q=torch.randn(30, 4, 32)), ValueError, "head dims"),
    (dict(q=torch.randn(30, 4, 64, 1)), ValueError, "q must have 3 dims"),
    (dict(v=torch.randn(40, 2, 64)), ValueError, "v must match k"),
    (dict(q=torch.randn(30, 4, 64, dtype=torch.float16)), TypeError, r"q must be one of \['float32', 'bfloat16'\]"),
    (dict(q=torch.randn(30, 4, 64, dtype=torch.bfloat16)), TypeError, "share a dtype"),
    (dict(q=torch.randn(30, 4, 640), k=torch.randn(50, 2, 640), v=torch.randn(50, 2, 640)), ValueError, "up to 512"),
    (dict(cu_seqlens_q=torch.tensor([0, 10, 30])), TypeError, "int32"),
    (dict(cu_seqlens_q=torch.tensor([1, 10, 30], dtype=torch.int32)), ValueError, "start at 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 20, 10], dtype=torch.int32)), ValueError, "decrease"),
    (dict(cu_seqlens_k=torch.tensor([0, 20, 60], dtype=torch.int32)), ValueError, "past the 50 tokens"),
    (dict(cu_seqlens_k=torch.tensor([0, 50], dtype=torch.int32), max_seqlen_k=None), ValueError, "one length"),
    (dict(max_seqlen_q=19), ValueError, "max_seqlen 19"),
    (dict(max_seqlen_k=torch.tensor(29)), ValueError, "max_seqlen 29"),
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(window_size=(4,)), ValueError, "window_size"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softmax_scale=0.0), ValueError, "softmax_scale"),
    (dict(s_aux=torch.randn(3)), ValueError, "s_aux"),
    (dict(s_aux=torch.zeros(4, dtype=torch.int32)), TypeError, "s_aux"),
    (dict(q=torch.randn(30, 4, 64).numpy()), TypeError, "q must be a torch.Tensor"),
    (dict(k=torch.randn(50, 2, 64, device="meta")), ValueError, "one device"),
    (dict(cu_seqlens_k=torch.tensor([0, 20, 50], dtype=torch.int32, device="meta")), ValueError, "cu_seqlens_k is on meta"),
]


@pytest.mark.parametrize("changes,error,message", BAD, ids=[f"{i}-{e.__name__}" for i, (_, e, _) in enumerate(BAD)])
def test_bad_input_raises_a_clear_error(changes, error, message):
    with pytest.raises(error, match=message):
        _call(**changes)


def test_dense_entry_point_checks_the_batch():
    q, k = torch.randn(2, 5, 4, 64), torch.randn(3, 5, 2, 64)
    with pytest.raises(ValueError, match="batch sizes differ"):
        flash_attention.flash_attn_func(q, k, k)


def test_nan_in_a_query_reaches_its_rows_only():
    q, k, v, cu_q, cu_k = _varlen()
    q[12, 1] = float("nan")
    out = flash_attention.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True)
    nan = torch.isnan(out).any(dim=2)
    assert nan[12, 1] and nan.sum() == 1


# Offsets _varlen's 30 queries and 50 keys make invalid: past the tokens but within the buckets the
# torch layer pads them to (32 and 64 rows), past the buckets too, decreasing, not starting at 0.
BAD_OFFSETS = {"q_past_tokens_in_bucket": ([0, 10, 31], [0, 20, 50]),
               "k_past_tokens_in_bucket": ([0, 10, 30], [0, 20, 60]),
               "q_past_bucket": ([0, 10, 40], [0, 20, 50]),
               "k_decreasing": ([0, 10, 30], [0, 60, 50]),
               "q_not_from_0": ([5, 10, 30], [0, 20, 50])}


def test_invalid_offsets_give_nan_without_a_host_read():
    """What a TPU caller gets (the torch layer reads no device values): the
    JAX function makes the whole output and every gradient NaN (the
    gradient of a NaN-masked output would otherwise be zeros: a silent
    no-op step), and computes nothing out of bounds (interpret mode would
    fill an out-of-bounds read with NaN too, so the valid call below shows
    the same ranges read fine). A caller that pads q and k to buckets itself
    passes the token counts it padded from (num_tokens)."""
    q, k, v, cu_q, cu_k = (_jax(t) for t in _varlen())
    sinks = jnp.zeros(4, jnp.float32)

    def out_and_grads(cu_q, cu_k, q=q, k=k, v=v, **extra):
        fn = lambda q, k, v, sinks: ops.flash_attention_varlen(q, k, v, jnp.asarray(cu_q, jnp.int32),
                                                               jnp.asarray(cu_k, jnp.int32), causal=True, sinks=sinks,
                                                               **extra)
        out, pullback = jax.vjp(fn, q, k, v, sinks)
        return [np.asarray(x) for x in (out, *pullback(jnp.ones_like(out)))]

    for name, (bad_q, bad_k) in BAD_OFFSETS.items():
        assert all(np.isnan(x).all() for x in out_and_grads(bad_q, bad_k)), name
    assert all(np.isfinite(x).all() for x in out_and_grads(cu_q, cu_k))
    padded = [jnp.pad(x, ((0, rows - x.shape[0]), (0, 0), (0, 0))) for x, rows in ((q, 32), (k, 64), (v, 64))]
    bad_q, bad_k = BAD_OFFSETS["k_past_tokens_in_bucket"]
    assert all(np.isnan(x).all() for x in out_and_grads(bad_q, bad_k, *padded, num_tokens=jnp.asarray([30, 50])))


def test_growing_context_compiles_few_shapes():
    """Decode of 4 sequences from 100 to 700 tokens of context: each call's
    token and sequence counts are padded to powers of two, so the op sees a
    handful of shapes, and max_seqlen never enters them."""
    seen = set()
    op = torch_ops.attention_op

    def record(*args):
        seen.add(tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args))
        return op(*args)

    torch_ops.attention_op = record
    try:
        for context in range(100, 701, 50):
            q, k = torch.randn(4, 4, 64), torch.randn(4 * context, 2, 64)
            cu_q = torch.arange(5, dtype=torch.int32)
            cu_k = torch.arange(5, dtype=torch.int32) * context
            flash_attention.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 1, context, causal=True)
    finally:
        torch_ops.attention_op = op
    assert len(seen) == 4  # 400 to 2800 keys, padded to 512, 1024, 2048 or 4096


def test_backward_reuses_the_forward_statistics():
    """The torch op returns the softmax's log-sum-exp with its output, and its
    backward runs the dkv kernel only (it accumulates dq too at this size): the
    forward is not run again."""
    q, k, v, cu_q, cu_k = (_jax(t) for t in _varlen())
    statics = (0.125, True, -1, -1, 0.0, False)
    num_tokens, sinks = jnp.asarray([30, 50], jnp.int32), jnp.zeros((0,))
    forward = lambda q, k, v: torch_ops._attention_jax(q, k, v, cu_q, cu_k, num_tokens, sinks, *statics,
                                                       interpret=True, generation="v6e")
    out, lse = forward(q, k, v)
    backward = lambda *a: torch_ops._attention_backward_jax(q, k, v, cu_q, cu_k, num_tokens, sinks, *statics, *a,
                                                            interpret=True, generation="v6e")
    kernels = lambda fn, *a: {n for n in ("flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv")
                              if n in str(jax.make_jaxpr(fn)(*a))}
    assert kernels(forward, q, k, v) == {"flash_attention_fwd"}
    assert kernels(backward, out, lse, out, jnp.zeros_like(lse)) == {"flash_attention_dkv"}


def _device_branch_call(cu_q, cu_k):
    """(output, dq, dk, dv, ds_aux) of a causal call with sinks through the torch layer, on _varlen's inputs."""
    q, k, v, *_ = _varlen(requires_grad=True)
    s_aux = torch.zeros(4, requires_grad=True)
    out = flash_attention.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=torch.tensor(20),
                                                 max_seqlen_k=torch.tensor(30), causal=True, s_aux=s_aux)
    out.sum().backward()
    return [t.detach().numpy() for t in (out, q.grad, k.grad, v.grad, s_aux.grad)]


def test_device_branch_reads_no_value(device_branch):
    """The branch TPU tensors take reads no value on the host (each read would be a sync in
    torch_tpu's eager mode; max_seqlen as a tensor included), forward or backward, and gives the
    JAX function's result; with offsets that end exactly at the tokens given, everything is finite."""
    q, k, v, cu_q, cu_k = _varlen()
    out, *grads = _device_branch_call(cu_q, cu_k)
    assert device_branch == [], f"the device branch read tensor values on the host: {device_branch}"
    want = ops.flash_attention_varlen(*(_jax(t) for t in (q, k, v, cu_q, cu_k)), causal=True,
                                      sinks=jnp.zeros(4, jnp.float32))
    np.testing.assert_allclose(out, np.asarray(want), rtol=0, atol=1e-6)
    assert all(np.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("bad_q,bad_k", BAD_OFFSETS.values(), ids=BAD_OFFSETS.keys())
def test_device_branch_reports_invalid_offsets_as_nan(bad_q, bad_k, device_branch):
    """On that branch invalid offsets make the whole output and every gradient NaN instead of
    raising, judged against the tokens given, not the buckets the op pads them to: within a
    bucket, cu_seqlens_k past the keys would attend zero keys (finite and wrong) and
    cu_seqlens_q past the queries would read a padding query."""
    results = _device_branch_call(torch.tensor(bad_q, dtype=torch.int32), torch.tensor(bad_k, dtype=torch.int32))
    assert device_branch == [], f"the device branch read tensor values on the host: {device_branch}"
    for name, x in zip(("out", "dq", "dk", "dv", "ds_aux"), results):
        assert np.isnan(x).all(), name


@pytest.mark.parametrize("entry,options", [("varlen", dict(window_size=(3, 9))),
                                           ("varlen", dict(causal=True, window_size=(6, 0))),
                                           ("dense", dict(window_size=(0, 5))),
                                           ("dense", dict(causal=True, window_size=(4, -1)))])
def test_asymmetric_windows_match_the_reference(entry, options):
    """window_size=(left, right) reaches the kernels in that order: transformers only ever passes
    symmetric windows, so these are the calls that tell left from right."""
    q, k, v, cu_q, cu_k = _varlen()
    if entry == "varlen":
        out = flash_attention.flash_attn_varlen_func(q, k, v, cu_q, cu_k, **options)
    else:  # 2 sequences of 15 queries over 25 keys
        out = flash_attention.flash_attn_func(q.reshape(2, 15, 4, 64), k.reshape(2, 25, 2, 64),
                                              v.reshape(2, 25, 2, 64), **options).reshape(30, 4, 64)
        cu_q, cu_k = torch.tensor([0, 15, 30], dtype=torch.int32), torch.tensor([0, 25, 50], dtype=torch.int32)
    _assert_matches_reference(out, q, k, v, cu_q, cu_k, **options)


def test_default_scale_is_from_the_query_head_dim():
    """Without softmax_scale, 1/sqrt of q's head dim, not v's (192 and 128, as DeepSeek's)."""
    q, k, v, cu_q, cu_k = _varlen(head_dim=192, value_dim=128)
    out = flash_attention.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True)
    _assert_matches_reference(out, q, k, v, cu_q, cu_k, causal=True)


def test_f32_sinks_are_not_rounded_to_bf16():
    """bf16 q, k, v with f32 sinks near 8 (bf16's spacing there is 2^-4): rounded to bf16, 8.03 and
    9.97 would be off by 0.03. q = k = 0 makes every score 0, so a row's output is (1 - w) times
    v's mean, w = e^s / (e^s + n) the sink's weight (0.96 and 0.99 over n = 128 keys); a sink off
    by d moves it by w d relative (2.9%), and its gradient by (1 - 2w) d (2.8%). The kernels' own
    error is two bf16 roundings (the probabilities entering the PV matmul and the output, 2^-8
    relative each), so the bound is 2^-7 relative, and the f32 sinks' gradient, made from the bf16
    output (D = rowsum(dO O)), is bounded as much. Gradients come back in s_aux's dtype."""
    tq, tk = 16, 128
    g = torch.Generator().manual_seed(0)
    q, k = torch.zeros(tq, 2, 64, dtype=torch.bfloat16), torch.zeros(tk, 1, 64, dtype=torch.bfloat16)
    v = (1 + torch.rand(tk, 1, 64, generator=g)).to(torch.bfloat16)  # in [1, 2]: no cancellation in its mean
    cu_q, cu_k = torch.tensor([0, tq], dtype=torch.int32), torch.tensor([0, tk], dtype=torch.int32)
    sinks = torch.tensor([8.03, 9.97], requires_grad=True)

    def expected(sinks):
        args = [_jax(t.float()) for t in (q, k, v)] + [_jax(cu_q), _jax(cu_k)]
        out = lambda s: reference.attention_varlen(*args, sinks=s)
        return out(sinks), jax.grad(lambda s: jnp.sum(out(s)))(sinks)

    out = flash_attention.flash_attn_varlen_func(q, k, v, cu_q, cu_k, s_aux=sinks)
    out.float().sum().backward()
    assert sinks.grad.dtype == torch.float32
    want_out, want_grad = expected(_jax(sinks))
    relative = lambda got, want: max_abs((got.astype(jnp.float32) - want) / jnp.abs(want))
    bound = 2**-7
    assert relative(_jax(out.float()), want_out) <= bound
    assert relative(_jax(sinks.grad), want_grad) <= bound
    # The bound tells the sinks from their bf16 rounding.
    rounded_out, rounded_grad = expected(_jax(sinks).astype(jnp.bfloat16).astype(jnp.float32))
    assert relative(rounded_out, want_out) > 2 * bound and relative(rounded_grad, want_grad) > 2 * bound

    bf16_sinks = sinks.detach().to(torch.bfloat16).requires_grad_()
    flash_attention.flash_attn_varlen_func(q, k, v, cu_q, cu_k, s_aux=bf16_sinks).float().sum().backward()
    assert bf16_sinks.grad.dtype == torch.bfloat16
