"""flash_attention's torch layer: opcheck, bad input, NaN, invalid offsets on
the device path, and the shapes a growing context compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import flash_attention
from flash_attention import ops, torch_ops


def _varlen(dtype=torch.float32, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype, requires_grad=requires_grad)
    q, k, v = make(30, 4, 64), make(50, 2, 64), make(50, 2, 64)
    return q, k, v, torch.tensor([0, 10, 30], dtype=torch.int32), torch.tensor([0, 20, 50], dtype=torch.int32)


def test_opcheck():
    q, k, v, cu_q, cu_k = _varlen(requires_grad=True)
    sinks = torch.randn(4, requires_grad=True)
    torch.library.opcheck(torch_ops.attention_op, (q, k, v, cu_q, cu_k, sinks, 0.125, True, -1, -1, 0.0, True))


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
    (dict(q=torch.randn(30, 4, 512), k=torch.randn(50, 2, 512), v=torch.randn(50, 2, 512)), ValueError, "up to 256"),
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


def test_invalid_offsets_give_nan_without_a_host_read():
    """What a TPU caller gets (the torch layer reads no device values): the
    JAX function makes the whole output NaN, and computes nothing out of
    bounds (interpret mode would fill an out-of-bounds read with NaN too, so
    the valid call below shows the same ranges read fine)."""
    q, k, v, cu_q, cu_k = (jnp.asarray(t.numpy()) for t in _varlen())
    for bad_q, bad_k in (([0, 10, 40], [0, 20, 50]), ([0, 10, 30], [0, 60, 50]), ([5, 10, 30], [0, 20, 50])):
        out = ops.flash_attention_varlen(q, k, v, jnp.asarray(bad_q, jnp.int32), jnp.asarray(bad_k, jnp.int32))
        assert np.isnan(np.asarray(out)).all()
    assert np.isfinite(np.asarray(ops.flash_attention_varlen(q, k, v, cu_q, cu_k))).all()


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
    q, k, v, cu_q, cu_k = (jnp.asarray(t.numpy()) for t in _varlen())
    statics = (0.125, True, -1, -1, 0.0, False)
    sinks = jnp.zeros((0,))
    forward = lambda q, k, v: torch_ops._attention_jax(q, k, v, cu_q, cu_k, sinks, *statics, interpret=True,
                                                       generation="v6e")
    out, lse = forward(q, k, v)
    backward = lambda *a: torch_ops._attention_backward_jax(q, k, v, cu_q, cu_k, sinks, *statics, *a,
                                                            interpret=True, generation="v6e")
    kernels = lambda fn, *a: {n for n in ("flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv")
                              if n in str(jax.make_jaxpr(fn)(*a))}
    assert kernels(forward, q, k, v) == {"flash_attention_fwd"}
    assert kernels(backward, out, lse, out, jnp.zeros_like(lse)) == {"flash_attention_dkv"}


def test_device_branch_reads_no_value_and_reports_bad_offsets(device_branch):
    """The branch TPU tensors take reads no value on the host (each read would be a sync in
    torch_tpu's eager mode; max_seqlen as a tensor included) and gives the JAX function's result;
    invalid offsets make the whole output NaN instead of raising."""
    q, k, v, cu_q, cu_k = _varlen()
    call = lambda cu_q: flash_attention.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=torch.tensor(20),
                                                               max_seqlen_k=torch.tensor(30), causal=True)
    good, bad = call(cu_q), call(torch.tensor([0, 10, 40], dtype=torch.int32))
    assert device_branch == [], f"the device branch read tensor values on the host: {device_branch}"
    want = ops.flash_attention_varlen(*(jnp.asarray(t.numpy()) for t in (q, k, v, cu_q, cu_k)), causal=True)
    np.testing.assert_allclose(good.numpy(), np.asarray(want), rtol=0, atol=1e-6)
    assert np.isnan(bad.numpy()).all()
