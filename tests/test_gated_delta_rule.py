"""The gated delta rule's chunked forward (gated_delta_rule/) against transformers' own torch
reference functions (Qwen3.5's): fp32 and bf16, lengths that are not a multiple of the chunk,
initial and final states, packed sequences (one of them empty), value heads sharing q/k heads,
the TPU interpreter, libtpu's compile, and bad input."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
from jax.experimental.pallas import tpu as pltpu
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

import tpu_compile
from gated_delta_rule import kernel, ops
from runtime.generations import GENERATIONS
import sampling  # noqa: E402

# fp32: the kernel and the reference both chunk; they differ in summation order and in how the
# chunk's triangular system is solved (the reference: a triangular solve; ours: a product of
# squarings). Measured <= 3e-7 of the largest output; 1e-5 allows for longer sums, still far
# below what a misplaced decay or a dropped token moves (>= 1e-2 of it).
FP32_TOLERANCE = 1e-5
# bf16 output of an fp32 computation (the recurrent rule, the convolution): one rounding (2^-8
# relative), twice for margin.
BF16_TOLERANCE = 2 * 2**-8
# bf16 inputs to the chunked rule: its products take bf16 operands with fp32 sums (as fla's kernels), each
# operand rounded to 2^-9, a term to about 2^-8; the output is rounded once more to bf16. Measured
# <= 3.4e-3 of the largest output and 4.4e-3 of the largest state entry (fp32) at 150 to 2048
# tokens; 2^-7 allows twice a term's error. Structural errors are the fp32 tests' to catch; these
# guard the precision of the sums (G's sums in bf16 move every decay: far outside).
CHUNK_BF16_TOLERANCE = 2**-7


def _inputs(batch, tokens, hk, hv, dk, dv, seqs=None, seed=0, dtype=np.float32):
    """Random inputs as the models make them: g = -exp(A) softplus(.) (<= 0), beta = sigmoid(.) in (0, 1),
    keys of norm about 1 (the rule is stable where beta |k|^2 < 2: callers that do not normalise
    in the kernel pass normalised keys)."""
    rng = np.random.default_rng(seed)
    x = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    g = -np.exp(x(hv) * 0.5) * np.log1p(np.exp(x(batch, tokens, hv)))
    beta = 1 / (1 + np.exp(-x(batch, tokens, hv)))
    state = x(seqs or batch, hv, dk, dv)
    cast = lambda a: a.astype(dtype)
    return (cast(x(batch, tokens, hk, dk)), cast(x(batch, tokens, hk, dk) * dk**-0.5), cast(x(batch, tokens, hv, dv)),
            g.astype(np.float32), cast(beta.astype(np.float32)), state)


def _torch(fn, q, k, v, g, beta, state, l2norm=True):
    """A transformers reference on torch tensors; q and k repeated to v's heads as the models do."""
    t = lambda a: torch.from_numpy(np.array(a, np.float32))  # a copy: jax arrays are read-only
    repeat = v.shape[2] // q.shape[2]
    q, k = (t(a).repeat_interleave(repeat, dim=2) for a in (q, k))
    o, final = fn(q, k, t(v), g=t(g), beta=t(beta), initial_state=None if state is None else t(state),
                  output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    return o.numpy(), final.numpy()


def _error(got, want):
    return float(np.abs(np.asarray(got, np.float32) - want).max() / np.abs(want).max())


def _check_each_sequence(reference, cu, inputs, states, o, final):
    """Each packed sequence's output and final state against `reference` run on it alone; an
    empty sequence's state passed through."""
    for n in range(len(cu) - 1):
        a, b = cu[n], cu[n + 1]
        if a == b:
            np.testing.assert_array_equal(np.asarray(final[n]), states[n])
            continue
        want_o, want_state = _torch(reference, *(x[:, a:b] for x in inputs), states[n:n + 1])
        assert _error(o[:, a:b], want_o) <= FP32_TOLERANCE, n
        assert _error(final[n:n + 1], want_state) <= FP32_TOLERANCE, n


@pytest.mark.parametrize("case", [
    # batch, tokens, q/k heads, v heads, dk, dv, l2norm, initial state
    (2, 100, 2, 2, 32, 16, True, True),  # 100 tokens: a partial last chunk
    (1, 128, 1, 2, 64, 64, False, False),  # two value heads on one q/k head, no state given
    (1, 33, 2, 4, 128, 128, True, True),  # one partial chunk, the models' head dims
])
def test_forward_matches_the_references_in_fp32(case):
    batch, tokens, hk, hv, dk, dv, l2norm, with_state = case
    q, k, v, g, beta, state = _inputs(batch, tokens, hk, hv, dk, dv)
    state = state if with_state else None
    o, final = ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                          use_qk_l2norm_in_kernel=l2norm, interpret=True)
    # The chunked reference, and the token-by-token recurrence that defines the rule.
    for name, fn in (("chunked", torch_chunk_gated_delta_rule), ("recurrent", torch_recurrent_gated_delta_rule)):
        want_o, want_state = _torch(fn, q, k, v, g, beta, state, l2norm)
        assert o.dtype == jnp.float32 and final.dtype == jnp.float32
        assert _error(o, want_o) <= FP32_TOLERANCE, (name, _error(o, want_o))
        assert _error(final, want_state) <= FP32_TOLERANCE, (name, _error(final, want_state))


def test_bf16_inputs_take_bf16_products_with_fp32_sums():
    """bf16 q, k, v and beta: the products on bf16 operands with fp32 sums; the output (bf16) and
    the state (fp32) within their tolerances of the fp32 result of the same bf16 values."""
    q, k, v, g, beta, state = _inputs(1, 150, 2, 2, 128, 128, seed=1)
    bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)
    o, final = ops.chunk_gated_delta_rule(bf16(q), bf16(k), bf16(v), g, bf16(beta), initial_state=state,
                                          output_final_state=True, use_qk_l2norm_in_kernel=True, interpret=True)
    as_f32 = lambda a: np.asarray(bf16(a), np.float32)
    want_o, want_state = _torch(torch_chunk_gated_delta_rule, as_f32(q), as_f32(k), as_f32(v), g, as_f32(beta), state)
    assert o.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    assert _error(o, want_o) <= CHUNK_BF16_TOLERANCE
    assert _error(final, want_state) <= CHUNK_BF16_TOLERANCE


def test_packed_sequences_keep_their_own_states():
    """Four sequences packed in one row (one empty, one spanning three chunks, none aligned to a
    chunk), each with its own initial state: each sequence's output and final state are those of
    the reference run on it alone; the empty one's state passes through."""
    cu = np.array([0, 37, 37, 150, 200], np.int32)
    q, k, v, g, beta, _ = _inputs(1, 200, 2, 4, 64, 32, seed=2)
    states = _inputs(1, 1, 1, 4, 64, 32, seqs=4, seed=3)[-1]
    o, final = ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=states, output_final_state=True,
                                          cu_seqlens=jnp.asarray(cu), use_qk_l2norm_in_kernel=True, interpret=True)
    _check_each_sequence(torch_chunk_gated_delta_rule, cu, (q, k, v, g, beta), states, o, final)


@pytest.mark.parametrize("batch", [1, 2])
def test_no_tokens_pass_every_state_through(batch):
    q, k, v, g, beta, state = _inputs(batch, 0, 2, 4, 32, 16)
    o, final = ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                          interpret=True)
    assert o.shape == (batch, 0, 4, 16)
    np.testing.assert_array_equal(final, state)


def test_kernel_passes_the_tpu_interpreter():
    """Races, out-of-bounds copies, reads of uninitialised memory (NaN) and output blocks revisited
    (written back twice: the second time stale) over packed sequences whose chunks run past the
    live ones (5 chunks bound, 3 live); every sequence's output and final state."""
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    cu = np.array([0, 64, 128, 130])
    q, k, v, g, beta, states = _inputs(1, 130, 1, 2, 128, 128, seqs=3, seed=4)
    o, final = ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=states, output_final_state=True,
                                          cu_seqlens=jnp.asarray(cu), use_qk_l2norm_in_kernel=True, interpret=params)
    assert tpu_interpreter.races.races_found is False
    pltpu.reset_tpu_interpret_mode_state()
    _check_each_sequence(torch_chunk_gated_delta_rule, cu, (q, k, v, g, beta), states, o, final)


# Gradients against the reference's own autograd in fp64: the backward recomputes each chunk in
# fp32 from the state entering it and differentiates it exactly (the reference solves the chunk's
# triangular system, ours multiplies squarings). Measured <= 5e-6 of each gradient's largest (g's,
# a sum over every later token, the loosest); 5e-5 allows longer sums, far below what a dropped
# decay term or a state gradient not carried to the chunk before moves (>= 1e-2). From bf16 inputs
# (bf16 operands, their gradients' too) every gradient is within CHUNK_BF16_TOLERANCE of the fp32
# run's.
GRAD_TOLERANCE = 5e-5


def _reference_gradients(q, k, v, g, beta, state, do, dht, l2norm=True):
    """The gradients of sum(o * do) + sum(final * dht) wrt q, k, v, g, beta and the initial state, by
    autograd through transformers' chunked reference in fp64 (q and k repeated as the models do)."""
    t = [torch.tensor(np.array(a, np.float64), requires_grad=True) for a in (q, k, v, g, beta, state)]
    repeat = v.shape[2] // q.shape[2]
    o, final = torch_chunk_gated_delta_rule(t[0].repeat_interleave(repeat, 2), t[1].repeat_interleave(repeat, 2),
                                            t[2], g=t[3], beta=t[4], initial_state=t[5], output_final_state=True,
                                            use_qk_l2norm_in_kernel=l2norm)
    ((o * torch.from_numpy(np.float64(do))).sum() + (final * torch.from_numpy(np.float64(dht))).sum()).backward()
    return [x.grad.numpy() for x in t]


def _gradients(q, k, v, g, beta, state, do, dht, l2norm=True, cu_seqlens=None, interpret=True, heads_per_step=None):
    def loss(q, k, v, g, beta, state):
        o, final = ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                              cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=l2norm,
                                              heads_per_step=heads_per_step, interpret=interpret)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(final * dht)
    return jax.grad(loss, argnums=range(6))(*(jnp.asarray(x) for x in (q, k, v, g, beta, state)))


def _cotangents(inputs, seed):
    """Random gradients of the output and the final states (distinct per head and sequence)."""
    rng = np.random.default_rng(seed)
    v, state = inputs[2], inputs[5]
    return rng.standard_normal(v.shape).astype(np.float32), rng.standard_normal(state.shape).astype(np.float32)


@pytest.mark.parametrize("case", [
    # batch, tokens, q/k heads, v heads, dk, dv, l2norm
    (2, 100, 2, 2, 32, 16, True),  # a partial last chunk, two rows each with its own state
    (1, 150, 1, 2, 64, 32, False),  # three chunks, two value heads on one q/k head, no l2norm
])
def test_gradients_match_the_reference_in_fp32(case):
    """Gradients for q, k, v, g, beta and the initial state (the final state's gradient given
    too) against autograd through the reference."""
    batch, tokens, hk, hv, dk, dv, l2norm = case
    inputs = _inputs(batch, tokens, hk, hv, dk, dv, seed=11)
    do, dht = _cotangents(inputs, seed=12)
    got = _gradients(*inputs, do, dht, l2norm=l2norm)
    want = _reference_gradients(*inputs, do, dht, l2norm=l2norm)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), got, want):
        assert a.dtype == jnp.float32 and _error(a, b) <= GRAD_TOLERANCE, (name, _error(a, b))


@pytest.mark.parametrize("hk,hv,heads_per_step", [(2, 32, 16), (4, 32, 16), (2, 6, None)],
                         ids=["one_shared_per_step", "two_shared_per_step", "group_of_3_by_default"])
def test_value_heads_read_their_shared_q_and_k_head(hk, hv, heads_per_step):
    """Value head h reads q/k head h // (Hv / Hk) without a repeated copy: a step's heads sharing one
    q/k head, or each step reading several; output, states and every gradient (dq and dk summed
    over a q/k head's value heads) against the references, several head blocks per call."""
    inputs = _inputs(1, 70, hk, hv, 32, 16, seed=13)
    o, final = ops.chunk_gated_delta_rule(*inputs[:5], initial_state=inputs[5], output_final_state=True,
                                          heads_per_step=heads_per_step, interpret=True)
    want_o, want_state = _torch(torch_chunk_gated_delta_rule, *inputs, l2norm=False)
    assert _error(o, want_o) <= FP32_TOLERANCE and _error(final, want_state) <= FP32_TOLERANCE
    do, dht = _cotangents(inputs, seed=14)
    got = _gradients(*inputs, do, dht, l2norm=False, heads_per_step=heads_per_step)
    want = _reference_gradients(*inputs, do, dht, l2norm=False)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), got, want):
        assert _error(a, b) <= GRAD_TOLERANCE, (name, _error(a, b))


def test_heads_per_step_that_splits_a_q_k_heads_group_is_named():
    inputs = _inputs(1, 20, 2, 6, 16, 8)
    with pytest.raises(ValueError, match="heads_per_step=2: a divisor of the 6 value heads that their q/k heads' "
                                         "groups of 3 divide or that divides 3"):
        ops.chunk_gated_delta_rule(*inputs[:5], heads_per_step=2, interpret=True)
    inputs = _inputs(1, 20, 2, 32, 16, 8)  # a block of 8 heads would fill half a bf16 sublane tile
    with pytest.raises(ValueError, match="heads_per_step=8: .* a multiple of 16 unless it is all 32"):
        ops.chunk_gated_delta_rule(*inputs[:5], heads_per_step=8, interpret=True)


def test_default_heads_per_step_leaves_a_block_for_each_core():
    """Up to 32 heads a step; a megacore (v5p) gets half the heads a step, a block for each core;
    heads with no tile-filling divisor up to 32 run whole."""
    pick = ops._heads_per_step
    assert [pick(None, 32, 2, g) for g in ("v5e", "v5p", "v6e", "tpu7x")] == [32, 16, 32, 32]
    assert (pick(None, 64, 4, "v6e"), pick(None, 48, 2, "v6e"), pick(None, 4, 2, "v5p"), pick(None, 40, 2, "v6e")) == (
        32, 16, 4, 40)


def test_gradients_of_packed_sequences_and_bf16():
    """Packed sequences (one empty, chunks past the live ones: the bound is 5, 4 live), each
    sequence's gradients those of the reference on it alone; the empty sequence's initial state
    gets its final state's gradient (the state passes through). bf16 q, k, v and beta get their
    gradients in bf16, g's and the state's in fp32, each within CHUNK_BF16_TOLERANCE of the fp32 run
    on the same values."""
    cu = np.array([0, 70, 70, 200], np.int32)
    inputs = _inputs(1, 200, 2, 4, 32, 16, seqs=3, seed=13)
    do, dht = _cotangents(inputs, seed=14)
    got = _gradients(*inputs, do, dht, cu_seqlens=jnp.asarray(cu))
    for n in range(len(cu) - 1):
        a, b = cu[n], cu[n + 1]
        if a == b:
            np.testing.assert_array_equal(got[5][n], dht[n])
            continue
        want = _reference_gradients(*(x[:, a:b] for x in inputs[:5]), inputs[5][n:n + 1], do[:, a:b], dht[n:n + 1])
        for name, x, w in zip(("q", "k", "v", "g", "beta"), got[:5], want[:5]):
            assert _error(x[:, a:b], w) <= GRAD_TOLERANCE, (n, name, _error(x[:, a:b], w))
        assert _error(got[5][n:n + 1], want[5]) <= GRAD_TOLERANCE, (n, "initial_state")
    bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
    q, k, v, g, beta, state = inputs
    low = _gradients(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), g, jnp.asarray(beta, jnp.bfloat16), state,
                     do, dht, cu_seqlens=jnp.asarray(cu))
    # A bf16 output's gradient reaches the kernel in bf16 (as torch's autograd passes it): the
    # fp32 run gets the same rounded values.
    exact = _gradients(bf16(q), bf16(k), bf16(v), g, bf16(beta), state, bf16(do), dht, cu_seqlens=jnp.asarray(cu))
    for name, x, w in zip(("q", "k", "v", "g", "beta", "initial_state"), low, exact):
        assert x.dtype == (jnp.float32 if name in ("g", "initial_state") else jnp.bfloat16), name
        assert _error(x, np.asarray(w)) <= CHUNK_BF16_TOLERANCE, (name, _error(x, np.asarray(w)))


def test_backward_passes_the_tpu_interpreter():
    """The backward walks the chunks in reverse, so the chunks past the live ones come first: no
    races, no reads of uninitialised memory, no output block written back twice; the gradients
    those of the reference (a sequence of one chunk, one of a partial chunk, 5 chunks bound)."""
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    cu = np.array([0, 64, 70, 130])
    inputs = _inputs(1, 130, 1, 2, 128, 128, seqs=3, seed=15)
    do, dht = _cotangents(inputs, seed=16)
    got = _gradients(*inputs, do, dht, cu_seqlens=jnp.asarray(cu), interpret=params)
    assert tpu_interpreter.races.races_found is False
    pltpu.reset_tpu_interpret_mode_state()
    for n in range(len(cu) - 1):
        a, b = cu[n], cu[n + 1]
        want = _reference_gradients(*(x[:, a:b] for x in inputs[:5]), inputs[5][n:n + 1], do[:, a:b], dht[n:n + 1])
        for name, x, w in zip(("q", "k", "v", "g", "beta"), got[:5], want[:5]):
            assert _error(x[:, a:b], w) <= GRAD_TOLERANCE, (n, name)
        assert _error(got[5][n:n + 1], want[5]) <= GRAD_TOLERANCE, (n, "initial_state")


def test_tokens_in_place_pass_the_tpu_interpreter():
    """One sequence read where it lies, its last chunk overhanging the arrays (100 tokens), in two
    blocks of 16 value heads that each read the one block of every q/k head: forward and backward
    with no race, no out-of-bounds copy, no uninitialised read reaching a result; output, final
    state and every gradient those of the reference."""
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    inputs = _inputs(1, 100, 2, 32, 32, 16, seed=17)
    o, final = ops.chunk_gated_delta_rule(*inputs[:5], initial_state=inputs[5], output_final_state=True,
                                          heads_per_step=16, interpret=params)
    do, dht = _cotangents(inputs, seed=18)
    got = _gradients(*inputs, do, dht, l2norm=False, heads_per_step=16, interpret=params)
    assert tpu_interpreter.races.races_found is False
    pltpu.reset_tpu_interpret_mode_state()
    want_o, want_state = _torch(torch_chunk_gated_delta_rule, *inputs, l2norm=False)
    assert _error(o, want_o) <= FP32_TOLERANCE and _error(final, want_state) <= FP32_TOLERANCE
    want = _reference_gradients(*inputs, do, dht, l2norm=False)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), got, want):
        assert _error(a, b) <= GRAD_TOLERANCE, (name, _error(a, b))


# (generation, tokens, q/k heads, v heads): `make test` compiles tpu7x (the smallest VMEM) at 1024
# tokens; `make check-compile` (CHECK_ALL_COMPILES=1) v5e too, and every generation at Qwen3.5's 16
# and 32 heads, 8k and 32k tokens.
TRAINING_COMPILES = [("tpu7x", 1024, 2, 4)] + ([("v5e", 1024, 2, 4)] if sampling.ALL_COMPILES else []) + (
    [(g, t, 16, 32) for g in GENERATIONS for t in (8192, 32768)] if sampling.ALL_COMPILES else [])
DECODE_COMPILES = ["v5e", "tpu7x"] + (["v5p", "v6e"] if sampling.ALL_COMPILES else [])


@pytest.mark.parametrize("case", TRAINING_COMPILES, ids=lambda c: f"{c[0]}-{c[1]}tokens-{c[2]}x{c[3]}heads")
def test_compiles_for_tpu(case):
    """libtpu compiles the forward and the backward at the models' head dims (128, bf16 inputs)
    within VMEM: a training step's loss and gradients, so both kernels are in the program."""
    def step(q, k, v, g, b, h0, do):
        def loss(q, k, v, g, b, h0):
            o, final = ops.chunk_gated_delta_rule(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True, interpret=False)
            return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(final)
        return jax.value_and_grad(loss, argnums=range(6))(q, k, v, g, b, h0)

    generation, tokens, hk, hv = case
    d = 128
    specs = [((1, tokens, hk, d), jnp.bfloat16)] * 2 + [((1, tokens, hv, d), jnp.bfloat16),
                                                       ((1, tokens, hv), jnp.float32), ((1, tokens, hv), jnp.bfloat16),
                                                       ((1, hv, d, d), jnp.float32), ((1, tokens, hv, d), jnp.float32)]
    report = tpu_compile.compile_for(step, specs, generation, "gated_delta_rule")
    names = {name.split(".")[0] for name in report.kernels}
    assert names == {"gated_delta_rule_chunk", "gated_delta_rule_chunk_backward"}, names
    for kernel in report.kernels.values():
        assert 0 < kernel.vmem_bytes <= GENERATIONS[generation].vmem_bytes


@pytest.mark.parametrize("batch,tokens,hk,hv,dtype", [(3, 1, 1, 2, np.float32), (2, 5, 2, 2, np.float32),
                                                      (3, 1, 2, 4, jnp.bfloat16), (1, 1, 4, 8, np.float32)])
def test_recurrent_steps_match_the_reference(batch, tokens, hk, hv, dtype):
    """Decode steps token by token (fused_recurrent_gated_delta_rule): one token per sequence as in
    a decode step (one sequence: split by heads), and a few, against transformers' recurrent
    reference with initial states; bf16 inputs give the fp32 result rounded once (the state stays
    fp32)."""
    q, k, v, g, beta, states = _inputs(batch, tokens, hk, hv, 32, 16, seed=6)
    cast = (lambda x: jnp.asarray(x, dtype))
    o, final = ops.fused_recurrent_gated_delta_rule(*(cast(x) for x in (q, k, v)), g, cast(beta), initial_state=states,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                    interpret=True)
    as_f32 = lambda x: np.asarray(cast(x), np.float32)
    want_o, want_state = _torch(torch_recurrent_gated_delta_rule, as_f32(q), as_f32(k), as_f32(v), g, as_f32(beta),
                                states)
    assert o.dtype == dtype and final.dtype == jnp.float32
    assert _error(o, want_o) <= (BF16_TOLERANCE if dtype == jnp.bfloat16 else FP32_TOLERANCE)
    assert _error(final, want_state) <= FP32_TOLERANCE


@pytest.mark.parametrize("batch,hk,hv,dtype,seqs_per_step", [
    (8, 1, 2, np.float32, 4),  # two steps of four sequences
    (6, 2, 8, jnp.bfloat16, 3),  # two steps of three
    (5, 2, 4, np.float32, 1),  # five steps of one
])
@pytest.mark.parametrize("state_in_place", [True, False])
def test_decode_steps_take_blocks_of_sequences(batch, hk, hv, dtype, seqs_per_step, state_in_place):
    """A decode step with no cu_seqlens (a token per sequence, as transformers' Qwen3.5 decodes): a
    grid step takes a block of sequences, each updated from its own state's block; against the
    reference, in the TPU interpreter (no races, no uninitialised reads: the new states in
    initial_state's buffer, or in a new one that every step's block fills)."""
    assert ops._seqs_per_step(batch) == seqs_per_step
    q, k, v, g, beta, states = _inputs(batch, 1, hk, hv, 32, 16, seed=13)
    cast = lambda x: jnp.asarray(x, dtype)
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    o, final = ops.fused_recurrent_gated_delta_rule(*(cast(x) for x in (q, k, v)), g, cast(beta), initial_state=states,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                    state_in_place=state_in_place, interpret=params)
    assert tpu_interpreter.races.races_found is False
    pltpu.reset_tpu_interpret_mode_state()
    as_f32 = lambda x: np.asarray(cast(x), np.float32)
    want_o, want_state = _torch(torch_recurrent_gated_delta_rule, as_f32(q), as_f32(k), as_f32(v), g, as_f32(beta),
                                states)
    assert _error(o, want_o) <= (BF16_TOLERANCE if dtype == jnp.bfloat16 else FP32_TOLERANCE)
    assert _error(final, want_state) <= FP32_TOLERANCE



@pytest.mark.parametrize("generation,batch,hk,plan", [
    ("v6e", 1, 4, (4, 1, 3)),  # one sequence as four of a quarter of its heads, through the ring
    ("tpu7x", 8, 2, (1, 4, 3)),  # two steps of four sequences, through the ring
    ("tpu7x", 4, 2, (1, 4, 0)),  # one step: nothing to overlap
    ("v5p", 8, 2, (1, 4, 0)),  # a megacore: the steps split over its cores, through Pallas's pipeline
])
def test_decode_plans_by_chip_and_batch(generation, batch, hk, plan):
    """How a decode step's grid runs (`_decode_plan`), and the same step through it against the
    reference in the TPU interpreter: each head block (or block of sequences) updated from its own
    state, in initial_state's buffer, no races, no uninitialised reads."""
    assert ops._decode_plan(batch, hk, generation) == plan
    splits, seqs_per_step, ring = plan
    q, k, v, g, beta, states = _inputs(batch, 1, hk, 2 * hk, 32, 16, seed=14)
    split = lambda x: jnp.asarray(x).reshape(batch * splits, x.shape[1] // splits, *x.shape[2:])
    flat = lambda x: jnp.asarray(x)[:, 0]
    gb = jnp.stack([flat(g), flat(beta)], axis=-1)
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    o, final = kernel.decode_forward(split(flat(q)), split(flat(k)), split(flat(v)), split(gb), split(states),
                                     seqs_per_step=seqs_per_step, scale=32 ** -0.5, l2norm=True, out_dtype=jnp.float32,
                                     in_place=True, ring=ring, interpret=params)
    assert tpu_interpreter.races.races_found is False
    pltpu.reset_tpu_interpret_mode_state()
    want_o, want_state = _torch(torch_recurrent_gated_delta_rule, q, k, v, g, beta, states)
    assert _error(o.reshape(batch, 1, 2 * hk, 16), want_o) <= FP32_TOLERANCE
    assert _error(final.reshape(states.shape), want_state) <= FP32_TOLERANCE

@pytest.mark.parametrize("cu", [[0, 1, 1, 4, 5], [0, 1, 1, 4, 5, 5]])
def test_recurrent_packed_sequences_and_tokens_past_the_live_ones(cu):
    """Packed sequences (one empty, one of three tokens; then the last one empty too, whose state
    block the tokens past the live ones visit) in a batch of one, as an engine's decode batch: each
    sequence against the reference on it alone, the empty ones' states passed through. Under jit
    (cu_seqlens traced, so not checked on the host) the offsets end before the last two tokens:
    they are zeros and change no state. In the TPU interpreter: no races, no uninitialised reads,
    no output block written back twice."""
    cu = np.array(cu)
    q, k, v, g, beta, _ = _inputs(1, 7, 1, 2, 32, 16, seed=7)
    states = _inputs(1, 1, 1, 2, 32, 16, seqs=len(cu) - 1, seed=8)[-1]
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    run = jax.jit(lambda cu, *x: ops.fused_recurrent_gated_delta_rule(
        *x, initial_state=states, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
        interpret=params))
    o, final = run(jnp.asarray(cu), q, k, v, g, beta)
    assert tpu_interpreter.races.races_found is False
    pltpu.reset_tpu_interpret_mode_state()
    _check_each_sequence(torch_recurrent_gated_delta_rule, cu, (q, k, v, g, beta), states, o, final)
    assert not np.asarray(o[:, 5:]).any()


@pytest.mark.parametrize("entry", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
@pytest.mark.parametrize("cu", [[0, 5, 3, 7], [1, 3, 5, 7], [0, 3, 5, 9]])
def test_bad_offsets_on_the_device_make_every_output_nan(entry, cu):
    """Offsets that do not rise from 0 to at most the token count, traced (so not checked on the
    host, which would sync): every output NaN, never a silently wrong result; every state NaN
    (the recurrent kernel, which makes no pass over the states outside itself: every state a
    token reaches NaN, the others as they came)."""
    q, k, v, g, beta, _ = _inputs(1, 7, 1, 2, 32, 16, seed=11)
    states = _inputs(1, 1, 1, 2, 32, 16, seqs=3, seed=12)[-1]
    run = jax.jit(lambda cu, *x: getattr(ops, entry)(*x, initial_state=states, output_final_state=True,
                                                     cu_seqlens=cu, interpret=True))
    o, final = run(jnp.asarray(cu, jnp.int32), q, k, v, g, beta)
    assert bool(jnp.isnan(o).all())
    nan = np.isnan(np.asarray(final)).all(axis=(1, 2, 3))
    if entry == "chunk_gated_delta_rule":
        assert nan.all()
    else:
        assert nan.any() and all(np.array_equal(final[n], states[n]) for n in np.flatnonzero(~nan))
    good, _ = run(jnp.asarray([0, 3, 5, 7], jnp.int32), q, k, v, g, beta)
    assert bool(jnp.isfinite(good).all())


@pytest.mark.parametrize("generation", DECODE_COMPILES)
def test_recurrent_compiles_for_tpu(generation):
    """libtpu compiles the decode step at Qwen3.5-9B's linear attention (16 q/k heads, 32 value heads,
    head dims 128, bf16) for 64 sequences, within VMEM."""
    fn = lambda q, k, v, g, b, h0: ops.fused_recurrent_gated_delta_rule(
        q, k, v, g, b, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, interpret=False)
    batch, hk, hv, d = 64, 16, 32, 128
    specs = [((batch, 1, hk, d), jnp.bfloat16)] * 2 + [((batch, 1, hv, d), jnp.bfloat16),
                                                       ((batch, 1, hv), jnp.float32), ((batch, 1, hv), jnp.bfloat16),
                                                       ((batch, hv, d, d), jnp.float32)]
    report = tpu_compile.compile_for(fn, specs, generation, "gated_delta_rule")
    (kernel,) = report.kernels.values()
    assert 0 < kernel.vmem_bytes <= GENERATIONS[generation].vmem_bytes


@pytest.mark.parametrize("op", ["recurrent_in_place_op", "recurrent_op"])
def test_torch_decode_ops_update_the_states_without_a_copy(op):
    """Neither torch decode op copies the states: the one for a whole fp32 state (as transformers'
    cache holds it) donates its buffer and the kernel writes the new states there; the other (a
    view, bf16, or a torch.compile graph, which keeps its input) writes them to a buffer of their
    own. Compiled for v6e as each runs (donated or not), no XLA op reads or writes the states
    (with the kernel's output aliased to a state that is not donated, XLA copies the states first)."""
    from gated_delta_rule import torch_ops

    entry = getattr(torch_ops, op.replace("_op", "_jax"))
    fn = lambda q, k, v, g, b, h0, cu: entry(q, k, v, g, b, h0, cu, 128 ** -0.5, True, interpret=False,
                                            generation="v6e")
    batch, hk, hv, d = 64, 16, 32, 128
    specs = [((batch, 1, hk, d), jnp.bfloat16)] * 2 + [((batch, 1, hv, d), jnp.bfloat16),
                                                       ((batch, 1, hv), jnp.float32), ((batch, 1, hv), jnp.bfloat16),
                                                       ((batch, hv, d, d), jnp.float32), ((0,), jnp.int32)]
    report = tpu_compile.compile_for(fn, specs, "v6e", "gated_delta_rule",
                                     donate_argnums=(5,) if op == "recurrent_in_place_op" else ())
    states = f"f32[{batch},{hv},{d},{d}]"
    assert not [name for name, schedule in report.other_ops.items() if states in " ".join(schedule.operand_shapes)]


@pytest.mark.parametrize("change,message", [
    (dict(k=(1, 20, 2, 8)), "k has shape (1, 20, 2, 8), expected q's"),
    (dict(v=(1, 19, 2, 8)), "v has shape (1, 19, 2, 8)"),
    (dict(v=(1, 20, 3, 8)), "v's 3 heads are not a multiple of q's and k's 2"),
    (dict(g=(1, 20, 3)), "g has shape (1, 20, 3)"),
    (dict(beta=(1, 20)), "beta has shape (1, 20)"),
    (dict(initial_state=(1, 2, 8, 16)), "initial_state has shape (1, 2, 8, 16), expected [1, 2, 16, 8]"),
    (dict(cu_seqlens=np.array([0, 5, 3, 20])), "cu_seqlens must rise from 0 to the 20 tokens"),
    (dict(cu_seqlens=np.array([0, 5, 19])), "cu_seqlens must rise from 0 to the 20 tokens"),
    (dict(cu_seqlens=np.array([0, 5, 20]), initial_state=(1, 2, 16, 8)), "initial_state has shape (1, 2, 16, 8), "
                                                                         "expected [2, 2, 16, 8]"),
])
def test_bad_input_names_the_argument(change, message):
    shapes = dict(q=(1, 20, 2, 16), k=(1, 20, 2, 16), v=(1, 20, 2, 8), g=(1, 20, 2), beta=(1, 20, 2), initial_state=None)
    args = {name: (np.zeros(shape, np.float32) if shape is not None else None) for name, shape in shapes.items()}
    for name, value in change.items():
        args[name] = np.zeros(value, np.float32) if isinstance(value, tuple) else value
    with pytest.raises(ValueError, match=re.escape(message)):
        ops.chunk_gated_delta_rule(interpret=True, **args)


def test_torch_entry_point_as_transformers_calls_it():
    """The torch layer (what get_kernel loads) with the arguments transformers' Qwen3.5 passes:
    q, k, v positional, int64 cu_seqlens packing three sequences, per-sequence states, its other
    attention kwargs alongside; each sequence against the reference run on it alone. The bf16 call
    gives the same result rounded once."""
    from gated_delta_rule import torch_ops

    cu = np.array([0, 50, 51, 120])
    q, k, v, g, beta, _ = _inputs(1, 120, 1, 2, 32, 16, seed=4)
    states = _inputs(1, 1, 1, 2, 32, 16, seqs=3, seed=5)[-1]
    t = torch.from_numpy
    o, final = torch_ops.chunk_gated_delta_rule(
        t(q), t(k), t(v), g=t(g), beta=t(beta), initial_state=t(states), output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=t(cu), position_ids=None)
    assert o.dtype == torch.float32 and final.dtype == torch.float32
    _check_each_sequence(torch_chunk_gated_delta_rule, cu, (q, k, v, g, beta), states, o.numpy(), final.numpy())
    bf16 = lambda x: t(x).to(torch.bfloat16)
    o16, none = torch_ops.chunk_gated_delta_rule(bf16(q), bf16(k), bf16(v), t(g), bf16(beta),
                                                 cu_seqlens=t(cu), use_qk_l2norm_in_kernel=True)
    assert none is None and o16.dtype == torch.bfloat16
    o32, _ = torch_ops.chunk_gated_delta_rule(*(bf16(x).float() for x in (q, k, v)), t(g), bf16(beta).float(),
                                              cu_seqlens=t(cu), use_qk_l2norm_in_kernel=True)
    assert _error(o16.float().numpy(), o32.numpy()) <= CHUNK_BF16_TOLERANCE


def test_torch_recurrent_entry_point_as_transformers_decode_calls_it():
    """The decode step as Qwen3.5 calls it (q and k already repeated to v's heads, one token per
    sequence, each sequence's cached state): against the reference, states in fp32."""
    from gated_delta_rule import torch_ops

    q, k, v, g, beta, states = _inputs(4, 1, 2, 2, 32, 16, seed=9)
    t = torch.from_numpy
    o, final = torch_ops.fused_recurrent_gated_delta_rule(
        t(q), t(k), t(v), g=t(g), beta=t(beta), initial_state=t(states.copy()), output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=None)  # (a copy: the state is updated in place)
    want_o, want_state = _torch(torch_recurrent_gated_delta_rule, q, k, v, g, beta, states)
    assert _error(o.numpy(), want_o) <= FP32_TOLERANCE and _error(final.numpy(), want_state) <= FP32_TOLERANCE


def test_torch_decode_updates_a_whole_fp32_state_in_place():
    """transformers passes its cache's states and copies the returned ones back onto them: an fp32
    state that owns its buffer becomes the final state (the same tensor returned: the copy back is
    of a tensor onto itself); a view of a larger tensor, a bf16 state, or a state passed to a call
    that torch.compile traces is left as it was."""
    from gated_delta_rule import torch_ops

    q, k, v, g, beta, states = _inputs(4, 1, 2, 2, 32, 16, seed=9)
    t = lambda a: torch.from_numpy(np.array(a))
    _, want_state = _torch(torch_recurrent_gated_delta_rule, q, k, v, g, beta, states)
    call = lambda state: torch_ops.fused_recurrent_gated_delta_rule(
        t(q), t(k), t(v), g=t(g), beta=t(beta), initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True)[1]
    whole = t(states)
    final = call(whole)
    assert final is whole and _error(whole.numpy(), want_state) <= FP32_TOLERANCE
    larger = t(np.concatenate([states, states]))
    view = larger[:4]
    final = call(view)
    np.testing.assert_array_equal(larger.numpy(), np.concatenate([states, states]))
    assert _error(final.numpy(), want_state) <= FP32_TOLERANCE
    low = t(states).bfloat16()
    kept = low.clone()
    final = call(low)
    assert torch.equal(low, kept) and final.dtype == torch.float32
    traced = t(states)
    final = torch.compile(call, fullgraph=True)(traced)  # (traced, a buffer cannot be swapped)
    np.testing.assert_array_equal(traced.numpy(), states)
    assert _error(final.numpy(), want_state) <= FP32_TOLERANCE


@pytest.mark.parametrize("change,error,message", [
    (dict(k=torch.zeros(1, 20, 2, 16, dtype=torch.bfloat16)), TypeError, "k dtype torch.bfloat16 differs from q's"),
    (dict(g=torch.zeros(1, 20)), ValueError, "g must have 3 dims, got shape (1, 20)"),
    (dict(v=np.zeros((1, 20, 2, 8), np.float32)), TypeError, "v must be a torch.Tensor, got ndarray"),
    (dict(cu_seqlens=torch.tensor([0.0, 20.0])), TypeError, "cu_seqlens must be one of ['int32', 'int64']"),
    (dict(cu_seqlens=torch.tensor([0, 21])), ValueError, "cu_seqlens must rise from 0 to the 20 tokens, got [0, 21]"),
    (dict(initial_state=torch.zeros(2, 2, 16, 8)), ValueError, "initial_state has shape (2, 2, 16, 8), expected [1,"),
])
def test_torch_entry_point_names_bad_arguments(change, error, message):
    from gated_delta_rule import torch_ops

    args = dict(q=torch.zeros(1, 20, 2, 16), k=torch.zeros(1, 20, 2, 16), v=torch.zeros(1, 20, 2, 8),
                g=torch.zeros(1, 20, 2), beta=torch.zeros(1, 20, 2)) | change
    with pytest.raises(error, match=re.escape(message)):
        torch_ops.chunk_gated_delta_rule(**args)


def test_torch_entry_point_gradients_as_training_calls_it():
    """torch autograd through the torch op (packed sequences as in packed-sequence training, each
    with its initial state): every input's gradient that of the reference on its sequence alone."""
    from gated_delta_rule import torch_ops

    cu = np.array([0, 80, 150])
    inputs = _inputs(1, 150, 1, 2, 32, 16, seqs=2, seed=17)
    do, dht = _cotangents(inputs, seed=18)
    leaves = [torch.tensor(x, requires_grad=True) for x in inputs]
    q, k, v, g, beta, state = leaves
    o, final = torch_ops.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True, cu_seqlens=torch.from_numpy(cu))
    ((o * torch.from_numpy(do)).sum() + (final * torch.from_numpy(dht)).sum()).backward()
    for n in range(len(cu) - 1):
        a, b = cu[n], cu[n + 1]
        want = _reference_gradients(*(x[:, a:b] for x in inputs[:5]), inputs[5][n:n + 1], do[:, a:b], dht[n:n + 1])
        for name, x, w in zip(("q", "k", "v", "g", "beta"), leaves[:5], want[:5]):
            assert _error(x.grad[:, a:b].numpy(), w) <= GRAD_TOLERANCE, (n, name)
        assert _error(state.grad[n:n + 1].numpy(), want[5]) <= GRAD_TOLERANCE, (n, "initial_state")


def _conv_inputs(batch=2, channels=24, tokens=9, taps=4, state=3, seed=10):
    rng = np.random.default_rng(seed)
    x = lambda *shape: torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
    return x(batch, channels, tokens), x(channels, taps), x(channels), x(batch, channels, state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", None])
def test_causal_conv1d_matches_transformers(dtype, activation):
    """The short convolution's torch entry points against transformers' own: the whole-sequence form,
    and a decode step of 2 tokens continuing a cached state (updated in place as transformers'
    does), bias and SiLU fused. fp32: the same products summed in another order; bf16 inputs with
    fp32 weights compute in fp32 as transformers does, then round once."""
    from gated_delta_rule import torch_ops
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, causal_conv1d_update

    x, w, b, state = _conv_inputs()
    x = x.to(dtype)
    tolerance = 1e-6 if dtype == torch.float32 else BF16_TOLERANCE
    want = causal_conv1d_fn(x, w, b, activation=activation)
    got = torch_ops.causal_conv1d_fn(x, w, b, activation=activation)
    assert got.dtype == dtype and _error(got.float().numpy(), want.float().numpy()) <= tolerance
    theirs, ours = state.clone(), state.clone()
    want = causal_conv1d_update(x[:, :, :2], theirs, w, b, activation)
    got = torch_ops.causal_conv1d_update(x[:, :, :2], ours, w, b, activation)
    assert _error(got.float().numpy(), want.float().numpy()) <= tolerance
    assert torch.equal(ours, theirs) and not torch.equal(ours, state)


def test_causal_conv1d_keeps_packed_sequences_apart():
    """With seq_idx, no tap reads across a sequence's start: each packed sequence equals the
    convolution of it alone (transformers' torch code, which has no seq_idx, mixes them)."""
    from gated_delta_rule import torch_ops
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    x, w, b, _ = _conv_inputs(batch=1, tokens=11)
    starts = [0, 2, 3, 11]  # sequences of 2, 1 and 8 tokens
    seq_idx = torch.repeat_interleave(torch.arange(3), torch.tensor(np.diff(starts)))[None]
    got = torch_ops.causal_conv1d_fn(x, w, b, activation="silu", seq_idx=seq_idx)
    for a, e in zip(starts, starts[1:]):
        want = causal_conv1d_fn(x[:, :, a:e], w, b, activation="silu")
        assert _error(got[:, :, a:e].numpy(), want.numpy()) <= 1e-6


def test_causal_conv1d_gradients_match_transformers():
    """The prefill convolution's gradients (input, weight, bias; SiLU fused) against autograd
    through transformers' own: the same products summed in another order."""
    from gated_delta_rule import torch_ops
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    x, w, b, _ = _conv_inputs()
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(19))
    grads = []
    for fn in (causal_conv1d_fn, torch_ops.causal_conv1d_fn):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        (fn(*leaves, activation="silu") * grad).sum().backward()
        grads.append([t.grad.numpy() for t in leaves])
    for name, want, got in zip(("hidden_states", "weight", "bias"), *grads):
        assert _error(got, want) <= 1e-6, name


@pytest.mark.parametrize("call,message", [
    (lambda f, x, w, b, s: f.causal_conv1d_fn(x, w[:5], b), "weight has shape (5, 4), expected [24, taps]"),
    (lambda f, x, w, b, s: f.causal_conv1d_fn(x, w, b[:5]), "bias has shape (5,), expected [24]"),
    (lambda f, x, w, b, s: f.causal_conv1d_fn(x, w, b, seq_idx=torch.zeros(2, 8, dtype=torch.int32)),
     "seq_idx has shape (2, 8), expected [2, 9]"),
    (lambda f, x, w, b, s: f.causal_conv1d_update(x, s[:, :, :2], w, b), "conv_state has shape (2, 24, 2), expected "
                                                                         "[2, 24, at least 3]"),
    (lambda f, x, w, b, s: f.causal_conv1d_fn(x, w, b, activation="gelu"), "activation 'gelu' is not one of"),
])
def test_causal_conv1d_names_bad_arguments(call, message):
    from gated_delta_rule import torch_ops

    x, w, b, state = _conv_inputs()
    before = state.clone()
    with pytest.raises(ValueError, match=re.escape(message)):
        call(torch_ops, x, w, b, state)
    assert torch.equal(state, before)
