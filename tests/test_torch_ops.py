"""The torch layer: opcheck, torch.compile, the TPU (jax_op) path, and bad input."""

import jax
import jax.numpy as jnp
import pytest
import torch

import ragged_dot
from ragged_dot import torch_ops
from ragged_dot._shared.bridge import BACKWARD_OPS


def _ragged_inputs(dtype=torch.float32, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    lhs = torch.randn(37, 128, generator=g, dtype=dtype, requires_grad=requires_grad)
    rhs = torch.randn(3, 256, 128, generator=g, dtype=dtype, requires_grad=requires_grad)
    return lhs, rhs, torch.tensor([10, 0, 20], dtype=torch.int32)


def _experts_inputs(requires_grad=False):
    g = torch.Generator().manual_seed(0)
    t, h, i, e, k = 6, 128, 128, 4, 2
    hidden = torch.randn(t, h, generator=g, requires_grad=requires_grad)
    index = torch.randint(0, e + 1, (t, k), generator=g, dtype=torch.int32)  # e = sentinel
    weights = torch.rand(t, k, generator=g, requires_grad=requires_grad)
    gate_up = torch.randn(e, 2 * i, h, generator=g, requires_grad=requires_grad) / 10
    down = torch.randn(e, h, i, generator=g, requires_grad=requires_grad) / 10
    return hidden, index, weights, gate_up, down


SILU_LAYOUT = ("silu", True, False, False, 0.0, 0.0)  # activation, gated, interleaved, transposed, alpha, limit


def _experts_op_args(hidden, index, weights, gate_up, down):
    """The experts op's arguments for the common layout (no bias, not quantized, SiLU)."""
    no_scale = hidden.new_empty(0, dtype=torch.float32)
    return (hidden, index, weights, gate_up, down, gate_up.new_empty(0), down.new_empty(0), no_scale, no_scale,
            *SILU_LAYOUT)


def test_opcheck_ragged_dot():
    lhs, rhs, gs = _ragged_inputs(requires_grad=True)
    torch.library.opcheck(torch_ops.ragged_dot_op, (lhs, rhs, gs, True))


def test_opcheck_experts_forward():
    torch.library.opcheck(torch_ops.experts_forward_op, _experts_op_args(*_experts_inputs(requires_grad=True)))


def test_torch_compile_fullgraph_matches_eager():
    lhs, rhs, gs = _ragged_inputs()
    compiled = torch.compile(lambda a, b, c: torch_ops.ragged_dot_op(a, b, c, True) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(lhs, rhs, gs), torch_ops.ragged_dot_op(lhs, rhs, gs, True) * 2)
    args = _experts_op_args(*_experts_inputs())
    compiled = torch.compile(torch_ops.experts_forward_op, fullgraph=True)
    torch.testing.assert_close(compiled(*args), torch_ops.experts_forward_op(*args))


def test_experts_forward_sentinel_contributes_zero():
    hidden, index, weights, gate_up, down = _experts_inputs()
    out = torch_ops.experts_forward_op(*_experts_op_args(hidden, index, weights, gate_up, down))
    # Reference: dense per-slot loop, skipping the sentinel id.
    want = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for s in range(index.shape[1]):
            e = int(index[t, s])
            if e == gate_up.shape[0]:
                continue
            gate, up = (gate_up[e] @ hidden[t]).chunk(2)
            want[t] += weights[t, s] * (down[e] @ (torch.nn.functional.silu(gate) * up))
    assert (index == gate_up.shape[0]).any(), "inputs must exercise the sentinel"
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


OPS_AND_ARGS = {
    "ragged_dot": (torch_ops.ragged_dot_op, lambda: (*_ragged_inputs(), True)),
    "experts_forward": (torch_ops.experts_forward_op, lambda: _experts_op_args(*_experts_inputs())),
}


def _spec(x):
    if isinstance(x, torch.Tensor):
        return jax.ShapeDtypeStruct(tuple(x.shape), jnp.dtype(str(x.dtype).removeprefix("torch.")))
    return x


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize("name", sorted(OPS_AND_ARGS))
def test_tpu_path_registers_and_exports_mosaic(name, generation):
    """On TPU tensors an op runs through torch_tpu's jax_op. Running needs a
    TPU; here each op, forward and backward, registers with jax_op and
    exports a TPU module that carries our Mosaic kernel."""
    op, make_args = OPS_AND_ARGS[name]
    args = make_args()
    backward = BACKWARD_OPS[op._qualname]
    grads = [torch.ones_like(op(*args))]
    for custom_op, op_args in ((op, args), (backward, (*args, *grads))):
        tpu_op = custom_op._init_fn.tpu_fn(generation)
        assert tpu_op._qualname.endswith(f"_{generation}")
        exported = tpu_op._init_fn.exported(*map(_spec, op_args))
        assert exported.platforms == ("tpu",)
        module = exported.mlir_module()
        assert "tpu_custom_call" in module and "ragged_dot_tpu" in module, custom_op._qualname


BAD_RAGGED = [
    (lambda l, r, g: (l[0], r, g), ValueError, "lhs must have 2 dims"),
    (lambda l, r, g: (l, r[0], g), ValueError, "rhs must have 3 dims"),
    (lambda l, r, g: (l.half(), r, g), TypeError, "lhs must be one of"),
    (lambda l, r, g: (l, r.bfloat16(), g), TypeError, "rhs dtype"),
    (lambda l, r, g: (l, r, g.float()), TypeError, "group_sizes must be int32 or int64"),
    (lambda l, r, g: (l, r, torch.tensor([10, -1, 20])), ValueError, "group_sizes values must lie in"),
    (lambda l, r, g: (l, r, torch.tensor([10, 0, 30])), ValueError, "sum to 40, more than lhs's 37 rows"),
    (lambda l, r, g: (l, r, torch.tensor([10, 0, 1 << 32])), ValueError, r"values must lie in \[0, 37\]"),  # not wrapped
    (lambda l, r, g: (l, r, g[:2]), ValueError, "group_sizes has 2 groups, rhs has 3"),
    (lambda l, r, g: (l[:, :64], r, g), ValueError, "does not contract"),
    (lambda l, r, g: (l.to("meta"), r, g), ValueError, "one device"),
]


@pytest.mark.parametrize("make,error,message", BAD_RAGGED, ids=[b[2] for b in BAD_RAGGED])
def test_ragged_dot_bad_input(make, error, message):
    with pytest.raises(error, match=message):
        ragged_dot.ragged_dot(*make(*_ragged_inputs()), transpose_rhs=True)


def test_ragged_dot_int64_group_sizes_and_entry_point():
    lhs, rhs, gs = _ragged_inputs()
    torch.testing.assert_close(
        ragged_dot.ragged_dot(lhs, rhs, gs.long(), transpose_rhs=True), torch_ops.ragged_dot_op(lhs, rhs, gs, True)
    )


class _Experts(torch.nn.Module):
    """A stand-in carrying the attributes transformers' experts modules carry."""

    def __init__(self, gate_up, down, **flags):
        super().__init__()
        self.gate_up_proj, self.down_proj = torch.nn.Parameter(gate_up), torch.nn.Parameter(down)
        self.act_fn = torch.nn.SiLU()
        self.has_gate, self.has_bias, self.is_transposed, self.is_concatenated = True, False, False, True
        self.has_post_expert_norm = False
        for key, value in flags.items():
            setattr(self, key, value)


class _OwnGate(_Experts):
    def _apply_gate(self, gate_up):
        return gate_up[:, : gate_up.shape[1] // 2]


BAD_EXPERTS = [
    (dict(has_post_expert_norm=True), {}, NotImplementedError, "has_post_expert_norm=True"),
    (dict(act_fn=torch.nn.GELU()), {}, NotImplementedError, "activation GELU"),
    (dict(act_fn=torch.nn.Tanh()), {}, NotImplementedError, "activation Tanh"),
    (dict(cls=_OwnGate), {}, NotImplementedError, "_OwnGate with its own _apply_gate"),
    (dict(has_bias=True, gate_up_proj_bias=torch.zeros(4, 7), down_proj_bias=torch.zeros(4, 128)), {},
     ValueError, r"gate_up_proj_bias \(4, 7\) should be \(4, 256\)"),
    (dict(is_transposed=True), {}, ValueError, "does not fit hidden_states"),
    ({}, dict(index=lambda i: i + 5), ValueError, "top_k_index values must lie in"),
    ({}, dict(index=lambda i: i - 1 - i.abs()), ValueError, "top_k_index values must lie in"),
    ({}, dict(index=lambda i: i.long() + (1 << 32)), ValueError, r"top_k_index values must lie in \[0, 4\]"),
    ({}, dict(index=lambda i: i.float()), TypeError, "top_k_index must be int32 or int64"),
    ({}, dict(weights=lambda w: w[:, :1]), ValueError, "must both be"),
    ({}, dict(hidden=lambda h: h[:, :64]), ValueError, "does not fit hidden_states"),
    ({}, dict(hidden=lambda h: h.bfloat16()), TypeError, "must match hidden_states' dtype"),
    ({}, dict(hidden=lambda h: h[0]), ValueError, "hidden_states must have 2 dims"),
]


@pytest.mark.parametrize("flags,edits,error,message", BAD_EXPERTS, ids=[b[3] for b in BAD_EXPERTS])
def test_experts_forward_bad_input(flags, edits, error, message):
    hidden, index, weights, gate_up, down = _experts_inputs()
    module = flags.pop("cls", _Experts)(gate_up, down, **flags)
    hidden = edits.get("hidden", lambda x: x)(hidden)
    index = edits.get("index", lambda x: x)(index)
    weights = edits.get("weights", lambda x: x)(weights)
    with pytest.raises(error, match=message):
        ragged_dot.experts_forward(module, hidden, index, weights)


def test_experts_forward_int64_index_matches_op():
    hidden, index, weights, gate_up, down = _experts_inputs()
    out = ragged_dot.experts_forward(_Experts(gate_up, down), hidden, index.long(), weights)
    torch.testing.assert_close(out, torch_ops.experts_forward_op(*_experts_op_args(hidden, index, weights, gate_up, down)))


def test_token_counts_compile_a_bounded_number_of_variants():
    """A decode loop over batch sizes 1..64 and a prefill over prompt lengths
    up to 8192 reach the op as at most 16 shapes (counted in the op's jit
    cache: 14 power-of-two buckets), and padding does not change results."""
    e, h, i, k = 8, 64, 32, 2
    g = torch.Generator().manual_seed(0)
    module = _Experts(torch.randn(e, 2 * i, h, generator=g) / 8, torch.randn(e, h, i, generator=g) / 8)

    def inputs(tokens):
        return (torch.randn(tokens, h, generator=g), torch.randint(0, e, (tokens, k), generator=g),
                torch.rand(tokens, k, generator=g))

    cpu_fn = torch_ops.experts_forward_op._init_fn.cpu_fn
    before = cpu_fn._cache_size()
    lengths = list(range(1, 65)) + [100, 127, 129, 500, 1000, 1025, 2047, 3000, 4097, 6000, 8191, 8192]
    for tokens in lengths:
        out = ragged_dot.experts_forward(module, *inputs(tokens))
        assert out.shape == (tokens, h)
    assert cpu_fn._cache_size() - before <= 16

    for tokens in (3, 1025):  # padded to 4 and 2048: same as the unpadded op
        hidden, index, weights = inputs(tokens)
        torch.testing.assert_close(
            ragged_dot.experts_forward(module, hidden, index, weights),
            torch_ops.experts_forward_op(*_experts_op_args(hidden, index.int(), weights, module.gate_up_proj,
                                                           module.down_proj)))


def test_nan_routing_weight_propagates_to_its_token_only():
    hidden, index, weights, gate_up, down = _experts_inputs()
    index = index.clamp(max=gate_up.shape[0] - 1)  # every slot routed here
    weights[2, 1] = float("nan")
    out = ragged_dot.experts_forward(_Experts(gate_up, down), hidden, index, weights)
    assert torch.isnan(out[2]).all(), "a NaN routing weight must not be hidden"
    assert not torch.isnan(out[torch.arange(len(out)) != 2]).any()


BAD_DEVICE_VALUES = {
    "group_sizes summing past lhs's rows": dict(gs=lambda gs: gs + 20),
    # 38 of lhs's 37 rows: within the 64 rows of its bucket, which the op sees.
    "group_sizes summing one past lhs's rows": dict(gs=lambda gs: gs + torch.tensor([0, 0, 8], dtype=gs.dtype)),
    "a negative group size": dict(gs=lambda gs: gs - torch.tensor([0, 1, 0], dtype=gs.dtype)),
    "int64 group sizes past int32 (they would wrap into range)": dict(gs=lambda gs: gs.long() + (1 << 32)),
    "an expert id past the sentinel": dict(index=lambda i: i + 5),
    "a negative expert id": dict(index=lambda i: i - 1 - i.abs()),
    "int64 expert ids past int32 (they would wrap into range)": dict(index=lambda i: i.long() + (1 << 32)),
}


def _device_branch_outputs(gs=lambda x: x, index=lambda x: x):
    """(ragged_dot, experts_forward) through the public torch entry points."""
    lhs, rhs, sizes = _ragged_inputs()
    hidden, ids, weights, gate_up, down = _experts_inputs()
    return (ragged_dot.ragged_dot(lhs, rhs, gs(sizes), transpose_rhs=True),
            ragged_dot.experts_forward(_Experts(gate_up, down), hidden, index(ids), weights))


def test_device_branch_reads_no_value_on_the_host(device_branch):
    """TPU tensors take a branch that never reads an index value in Python (each read would be a
    device-to-host sync in torch_tpu's eager mode) and gives the host branch's results."""
    on_device = _device_branch_outputs()
    assert device_branch == [], f"the device branch read tensor values on the host: {device_branch}"
    device_branch.clear()
    lhs, rhs, sizes = _ragged_inputs()
    hidden, ids, weights, gate_up, down = _experts_inputs()
    torch.testing.assert_close(on_device[0], torch_ops.ragged_dot_op(lhs, rhs, sizes, True))
    torch.testing.assert_close(on_device[1], torch_ops.experts_forward_op(
        *_experts_op_args(hidden, ids, weights, gate_up, down)))


@pytest.mark.parametrize("bad", BAD_DEVICE_VALUES.values(), ids=BAD_DEVICE_VALUES.keys())
def test_device_branch_reports_bad_values_as_nan(device_branch, bad):
    """Where the host may not read them, bad index values make the op's whole output NaN, read
    without a sync, and no kernel reads outside its inputs (the kernels walk clamped values)."""
    outputs = _device_branch_outputs(**bad)
    assert device_branch == []
    bad_output = outputs[0] if "gs" in bad else outputs[1]
    assert bool(torch.isnan(bad_output).all())


def test_a_token_routed_only_to_the_sentinel_gets_exactly_zero_with_biases():
    """Rows routed to another shard (id E) get no bias: with biases, a token whose every slot is
    the sentinel must come out exactly zero, and the others must match the dense reference."""
    hidden, index, weights, gate_up, down = _experts_inputs()
    e = gate_up.shape[0]
    index[0] = e
    index[1:] = index[1:] % e  # the others routed here
    g = torch.Generator().manual_seed(9)
    up_bias, down_bias = torch.randn(e, gate_up.shape[1], generator=g), torch.randn(e, down.shape[1], generator=g)
    module = _Experts(gate_up, down, has_bias=True, gate_up_proj_bias=up_bias, down_proj_bias=down_bias)
    out = ragged_dot.experts_forward(module, hidden, index, weights)
    assert not out[0].any(), "a token routed only to the sentinel must be exactly zero"
    expected = torch.zeros_like(hidden)
    for t in range(1, hidden.shape[0]):
        for slot in range(index.shape[1]):
            x = index[t, slot]
            gate, up = (hidden[t] @ gate_up[x].T + up_bias[x]).chunk(2)
            expected[t] += weights[t, slot] * ((torch.nn.functional.silu(gate) * up) @ down[x].T + down_bias[x])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-4)


def test_padding_tokens_cost_no_matmul(monkeypatch):
    """The torch layer pads 6 tokens to the next bucket (8); the padding must be routed to the
    sentinel, so the groups the kernel walks hold exactly the 6 x k real rows."""
    hidden, index, weights, gate_up, down = _experts_inputs()
    index = index % gate_up.shape[0]  # every real slot routed here
    walked = []
    route = ragged_dot.ops.route

    def recorded(*args):
        order, group_sizes, *rest = route(*args)
        jax.debug.callback(lambda sizes: walked.append(int(sizes.sum())), group_sizes)
        return order, group_sizes, *rest

    monkeypatch.setattr(ragged_dot.ops, "route", recorded)
    jax.clear_caches()  # trace again, with the recording route
    ragged_dot.experts_forward(_Experts(gate_up, down), hidden, index, weights)
    jax.effects_barrier()  # the callback may run after the result is ready
    jax.clear_caches()  # later calls trace the real route again
    assert walked == [index.numel()], f"the kernel walked {walked} rows for {index.numel()} routed slots"


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["KN", "NK"])
def test_a_group_full_of_inf_stays_in_its_group(transpose_rhs):
    """Group 1's rows and weights are all inf; groups 0 and 2 share m tiles with it and must
    match a per-group torch reference, in the output and in both gradients."""
    lhs, rhs, _ = _ragged_inputs()
    if not transpose_rhs:
        rhs = rhs.transpose(1, 2).contiguous()
    sizes = [10, 7, 20]
    lhs[10:17], rhs[1] = float("inf"), float("inf")
    others = torch.cat([torch.arange(10), torch.arange(17, 37)])
    cotangent = torch.zeros(37, 256)
    cotangent[others] = torch.randn(len(others), 256, generator=torch.Generator().manual_seed(4))

    def run(fn):
        a, b = lhs.clone().requires_grad_(), rhs.clone().requires_grad_()
        out = fn(a, b)
        out.backward(cotangent)  # zero on group 1's (inf) rows: its gradient must stay out of the others
        return out[others], a.grad[others], b.grad[[0, 2]]

    def per_group(a, b):
        weights = b.transpose(1, 2) if transpose_rhs else b
        return torch.cat([part @ weights[g] for g, part in enumerate(a.split(sizes))])

    ours = run(lambda a, b: ragged_dot.ragged_dot(a, b, torch.tensor(sizes), transpose_rhs=transpose_rhs))
    for got, want in zip(ours, run(per_group)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())
