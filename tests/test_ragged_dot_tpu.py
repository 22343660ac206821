"""Layers 2 and 3: TPU semantics in the TPU interpreter, and real
compilation for v5e, v5p, v6e and tpu7x with libtpu (no TPU needed)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tpu_compile
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
from jax.experimental.pallas import tpu as pltpu

from ragged_dot import kernel, ops, reference, tuning
from ragged_dot._shared.generations import GENERATIONS
import sampling  # noqa: E402


@pytest.fixture
def interpreter():
    """The TPU interpreter with race detection over two simulated cores (the
    "parallel" n axis is split between them, as on a v5p megacore) and NaN
    in uninitialised memory, so a read of unwritten VMEM shows up in the
    result."""
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2, uninitialized_memory="nan")
    yield params
    pltpu.reset_tpu_interpret_mode_state()


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["KN", "NK"])
@pytest.mark.parametrize("group_sizes", [[1, 60, 0, 50], [0, 0, 0, 0], [131, 0, 0, 0]], ids=["ragged", "empty", "one"])
def test_no_race_no_out_of_bounds(interpreter, group_sizes, transpose_rhs):
    rng = np.random.default_rng(0)
    m, k, n = 131, 1024, 1024  # v5e blocks: 2 n tiles, 2 k steps, 9 m tiles
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((4, n, k) if transpose_rhs else (4, k, n)), jnp.bfloat16)
    gs = jnp.asarray(group_sizes, jnp.int32)
    # Out-of-bounds block indices raise inside the interpreter.
    out = ops.ragged_dot(lhs, rhs, gs, transpose_rhs=transpose_rhs, interpret=interpreter, generation="v5e")
    assert tpu_interpreter.races.races_found is False
    out = np.asarray(out.astype(jnp.float32))
    assert not np.isnan(out).any(), "the kernel read uninitialised memory"
    want = np.asarray(reference.ragged_dot(lhs, rhs, gs, transpose_rhs=transpose_rhs, out_dtype=jnp.float32))
    np.testing.assert_allclose(out, want, rtol=0, atol=2**-8 * np.abs(want).max())


def test_tiles_several_groups_share_no_race(interpreter):
    """256-row tiles visited once per group they hold, each visit storing
    from its group's first row on, with a K that does not divide into
    blocks (the tail masked at the last K step), under the TPU interpreter."""
    rng = np.random.default_rng(4)
    m, k, n, group_sizes = 512, 300, 256, [3, 200, 0, 130, 100]
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((5, n, k)), jnp.bfloat16)
    gs = jnp.asarray(group_sizes, jnp.int32)
    out = kernel.grouped_matmul(lhs, rhs, gs, blocks=kernel.BlockSizes(256, 128, 128), transpose_rhs=True,
                                out_dtype=jnp.bfloat16, vmem_limit=32 << 20, interpret=interpreter)
    assert tpu_interpreter.races.races_found is False
    out = np.asarray(out.astype(jnp.float32))
    want = np.asarray(reference.ragged_dot(lhs, rhs, gs, transpose_rhs=True, out_dtype=jnp.float32))
    np.testing.assert_allclose(out, want, rtol=0, atol=2**-8 * np.abs(want).max())


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["KN", "NK"])
def test_unaligned_weights_no_race_no_out_of_bounds(interpreter, transpose_rhs):
    """Gemma 4's unaligned sizes scaled down (K 200, N 88) under the TPU interpreter: on the default
    blocks (whole K and N, as the rule picks for Gemma 4's sizes), forward and both gradients; and
    on 128-wide K and N blocks, the forward with a masked K edge and a clipped N edge. No race, no
    copy past an array, no unwritten memory (NaN here) reaching a result."""
    rng = np.random.default_rng(5)
    m, k, n, group_sizes = 128, 200, 88, [30, 0, 17, 50]  # 31 rows past the groups
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((4, n, k) if transpose_rhs else (4, k, n)), jnp.bfloat16)
    gs = jnp.asarray(group_sizes, jnp.int32)
    fn = lambda a, b: ops.ragged_dot(a, b, gs, transpose_rhs=transpose_rhs, interpret=interpreter, generation="v6e")
    out, pullback = jax.vjp(fn, lhs, rhs)
    grad_lhs, grad_rhs = pullback(jnp.ones_like(out))
    assert tpu_interpreter.races.races_found is False
    want = np.asarray(reference.ragged_dot(lhs, rhs, gs, transpose_rhs=transpose_rhs, out_dtype=jnp.float32))
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), want, rtol=0, atol=2**-8 * np.abs(want).max())
    for grad in (grad_lhs, grad_rhs):
        assert not np.isnan(np.asarray(grad.astype(jnp.float32))).any(), "a kernel read unwritten memory"
    edges = kernel.grouped_matmul(lhs, rhs, gs, blocks=kernel.BlockSizes(64, 128, 128), transpose_rhs=transpose_rhs,
                                  out_dtype=jnp.bfloat16, vmem_limit=32 << 20, interpret=interpreter)
    assert tpu_interpreter.races.races_found is False
    np.testing.assert_allclose(np.asarray(edges.astype(jnp.float32)), want, rtol=0, atol=2**-8 * np.abs(want).max())


@pytest.mark.parametrize("at_group_start", [True, False], ids=["group-start", "tiles"])
@pytest.mark.parametrize("group_sizes", [[1, 60, 0, 50], [0, 0, 0, 0], [0, 131, 0, 0]], ids=["ragged", "empty", "one"])
def test_weight_grad_no_race_no_out_of_bounds(interpreter, group_sizes, at_group_start):
    """The transposed grouped matmul (weights' gradient), windows at group
    starts (the last one slides back) or at fixed tiles: two parallel axes
    split over the simulated cores; empty groups must still be written.
    Uninitialised memory reads as NaN here, and so does the padding the
    windows hang over past the last row (139 rows, windows need 144) and
    column (P = 200, Q = 300): none of it may reach the output."""
    rng = np.random.default_rng(1)
    m, p, q = 139, 200, 300  # 2 x 2 tiles, Q tiles outside (see transposed_grouped_matmul)
    a = jnp.asarray(rng.standard_normal((m, p)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((m, q)), jnp.bfloat16)
    gs = jnp.asarray(group_sizes, jnp.int32)
    out = kernel.transposed_grouped_matmul(
        a, b, gs, blocks=kernel.BlockSizes(48, 128, 256, windows_at_group_start=at_group_start),
        out_dtype=jnp.bfloat16, vmem_limit=32 << 20, sub_rows=16, interpret=interpreter)
    assert tpu_interpreter.races.races_found is False
    out = np.asarray(out.astype(jnp.float32))
    assert not np.isnan(out).any(), "a gradient block was never written"
    want = np.asarray(reference.weight_grad(a, b, gs, jnp.float32))
    np.testing.assert_allclose(out, want, rtol=0, atol=2**-8 * max(1.0, np.abs(want).max()))


# Qwen3-30B-A3B experts: hidden 2048, expert intermediate 768, 128 experts, top-8.
QWEN3_30B = dict(hidden=2048, intermediate=768, experts=128, top_k=8)


def _experts_specs(tokens, hidden, intermediate, experts, top_k, gpt_oss_layout=False):
    """(shape, dtype) of experts_forward's inputs; gpt-oss's layout is
    transposed weights plus biases."""
    specs = [((tokens, hidden), jnp.bfloat16), ((tokens, top_k), jnp.int32), ((tokens, top_k), jnp.bfloat16)]
    if gpt_oss_layout:
        return specs + [((experts, hidden, 2 * intermediate), jnp.bfloat16),
                        ((experts, intermediate, hidden), jnp.bfloat16),
                        ((experts, 2 * intermediate), jnp.bfloat16), ((experts, hidden), jnp.bfloat16)]
    return specs + [((experts, 2 * intermediate, hidden), jnp.bfloat16),
                    ((experts, hidden, intermediate), jnp.bfloat16)]


def _assert_training_kernels_fit(report, generation):
    names = sorted(report.kernels)
    assert any("weight_grad" in n for n in names) and len(names) >= 4, names
    for name, kernel_report in report.kernels.items():
        assert kernel_report.vmem_bytes <= GENERATIONS[generation].vmem_bytes, (name, kernel_report)


# `make test` compiles a sample: the training step at prefill (all three kernels) on v5p (64 MiB
# of VMEM, the least with tpu7x, and a megacore; v6e's and tpu7x's largest tuned forwards are in
# test_tuned_blocks), a decode forward and gpt-oss's layout on one generation; `make check-compile`
# (CHECK_ALL_COMPILES=1) every case.
def _cases(cases, sample):
    return [pytest.param(*c, id="-".join(map(str, c))) for c in (cases if sampling.ALL_COMPILES else sample)]


EVERY_GENERATION_AND_SIZE = [(g, t) for g in sorted(GENERATIONS) for t in (64, 8192)]


@pytest.mark.parametrize("generation,tokens", _cases(EVERY_GENERATION_AND_SIZE, [("v6e", 64)]))
def test_experts_forward_compiles_and_fits_vmem(generation, tokens):
    h, i, e, k = (QWEN3_30B[key] for key in ("hidden", "intermediate", "experts", "top_k"))
    specs = _experts_specs(tokens, **QWEN3_30B)

    def forward(*args):
        return ops.experts_forward(*args, generation=generation, interpret=False)

    report = tpu_compile.compile_for(forward, specs, generation, "ragged_dot_tpu")
    gen = GENERATIONS[generation]
    assert report.device_kind.startswith(gen.device_kind_prefixes)
    assert len(report.kernels) == 2, report.kernels  # gate_up and down grouped matmuls
    needs = []
    for rows, kk, n in [(tokens * k, h, 2 * i), (tokens * k, i, h)]:
        blocks = tuning.choose_blocks(rows, kk, n, e, generation, transpose_rhs=True)  # the models' [E, N, K] weights
        # Compiling at all proves each kernel fits the limit it asks for; that limit fits the chip.
        assert tuning.vmem_limit(tuning.forward_buffers(blocks, 2), generation) <= gen.vmem_bytes, blocks
        needs.append(kernel.vmem_bytes(blocks, 2, jnp.bfloat16))
    used = sorted(r.vmem_bytes for r in report.kernels.values())
    # The report is the program's VMEM at each kernel (XLA's own scoped VMEM may be
    # live alongside): within the chip, and at least about our double-buffered blocks.
    assert used[-1] <= gen.vmem_bytes, used
    assert all(u >= 0.5 * need for u, need in zip(used, sorted(needs))), (used, needs)
    if tokens * k <= ops.ONE_HOT_ROWS:  # a decode step takes its rows by one-hot matmuls: no row gathered
        assert not [op for op in report.other_ops if op.startswith(("gather", "scatter"))], sorted(report.other_ops)


@pytest.mark.parametrize("generation,tokens",
                         _cases(EVERY_GENERATION_AND_SIZE, [("v5p", 8192)]))
def test_experts_backward_compiles_and_fits_vmem(generation, tokens):
    """The training step's kernels: forward, activations' gradient (the same
    kernel, layout flipped) and weights' gradient, all compiled together."""

    def loss(hidden, index, weights, gate_up, down):
        out = ops.experts_forward(hidden, index, weights, gate_up, down, generation=generation, interpret=False)
        return jnp.sum(out.astype(jnp.float32))

    grads = jax.grad(loss, argnums=(0, 2, 3, 4))
    _assert_training_kernels_fit(
        tpu_compile.compile_for(grads, _experts_specs(tokens, **QWEN3_30B), generation, "ragged_dot_tpu"), generation)


# Shapes outside every table: hidden 2880 (not a multiple of 128),
# intermediate 1408, 60 experts; the rule's blocks must compile and fit.
ODD = dict(hidden=2880, intermediate=1408, experts=60, top_k=4)


@pytest.mark.parametrize("generation,tokens",
                         _cases([(g, t) for g in sorted(GENERATIONS) for t in (37, 3000)], [("v6e", 37)]))
def test_odd_shapes_forward_and_backward_compile(generation, tokens):

    def loss(hidden, index, weights, up, down, up_bias, down_bias):  # gpt-oss's layout
        out = ops.experts_forward(hidden, index, weights, up, down, up_bias, down_bias,
                                  activation="clamped_swiglu", interleaved=True, transposed=True,
                                  alpha=1.702, limit=7.0, generation=generation, interpret=False)
        return jnp.sum(out.astype(jnp.float32))

    specs = _experts_specs(tokens, **ODD, gpt_oss_layout=True)
    grads = jax.grad(loss, argnums=(0, 3, 4, 5, 6))
    _assert_training_kernels_fit(tpu_compile.compile_for(grads, specs, generation, "ragged_dot_tpu"), generation)


# Gemma 4 26B-A4B's experts: hidden 2112 and intermediate 704, neither a multiple of 128.
GEMMA4_26B = dict(hidden=2112, intermediate=704, experts=128, top_k=8)


def _elements(operand: str) -> int:
    """Elements of an operand written as "bf16[2112,704,128]"."""
    return math.prod(int(d) for d in operand.split("[")[1].rstrip("]").split(",") if d)


def _ops_reading(report, shape):
    """The compiled ops other than our kernels that read or write an array of `shape`'s
    elements in any order (a copy into another layout, a transpose, a pad's input)."""
    dims = sorted(shape)
    return sorted(op for op, s in report.other_ops.items()
                  if any(sorted(int(d) for d in o.split("[")[1].rstrip("]").split(",") if d) == dims
                         for o in s.operand_shapes if o.startswith("bf16[")))


GEMMA4_WEIGHTS = {"gate_up_proj": 3, "down_proj": 4}  # argument index in _experts_specs


def test_gemma4_weights_are_not_copied():
    """Gemma 4's experts forward at decode on v6e, each weight in the layout libtpu gives an array
    of its shape: gate_up_proj [128, 1408, 2112] held as [128, 2112, 1408] is read by our kernel
    alone (viewed swapped); down_proj [128, 2112, 704] held as [2112, 704, 128] (experts minor-most,
    which no Pallas operand reads without a copy) by one XLA matmul over every expert
    (`ops.down_held_experts_minor`) and nothing else. No op copies, relayouts or pads either weight:
    such an op would hold a weight-sized array twice, in and out."""
    specs = _experts_specs(64, **GEMMA4_26B)
    forward = lambda *args: ops.experts_forward(*args, activation="gelu_tanh", generation="v6e", interpret=False)
    report = tpu_compile.compile_for(forward, specs, "v6e", "ragged_dot_tpu")
    assert len(report.kernels) == 1, report.kernels  # gate_up's; the down projection is XLA's matmul
    assert not _ops_reading(report, specs[GEMMA4_WEIGHTS["gate_up_proj"]][0])
    down = specs[GEMMA4_WEIGHTS["down_proj"]][0]
    (reader,) = _ops_reading(report, down)
    weight_sized = [o for o in report.other_ops[reader].operand_shapes if _elements(o) == math.prod(down)]
    assert len(weight_sized) == 1, report.other_ops[reader].operand_shapes


def test_the_gate_reads_the_up_projection_once():
    """Between the two projections at a decode batch (Qwen3-30B-A3B's experts, 256 tokens, tpu7x): the
    gate, its product and the rounding to bf16 are one XLA op reading the up projection's [rows, 2I]
    output as the kernel wrote it (bf16); no op writes a float32 copy of it to read back."""
    shape = dict(hidden=2048, intermediate=768, experts=128, top_k=8)
    specs = _experts_specs(256, **shape)
    forward = lambda *args: ops.experts_forward(*args, generation="tpu7x", interpret=False)
    report = tpu_compile.compile_for(forward, specs, "tpu7x", "ragged_dot_tpu")
    up_output = f"[{256 * 8},{2 * shape['intermediate']}]"
    readers = {op: s.operand_shapes for op, s in report.other_ops.items()
               if any(o.endswith(up_output) for o in s.operand_shapes)}
    assert len(readers) == 1, readers
    (operands,) = readers.values()
    assert f"bf16{up_output}" in operands and f"f32{up_output}" not in operands, operands

def test_gemma4_training_step_copies_no_weight():
    """The training step at Gemma 4's shapes on v6e, with down_proj held experts-major (as a JAX
    user can hold it: `Format(Layout((0, 1, 2)))`, and its gradient asked in that layout too;
    gate_up_proj and its gradient in libtpu's own layout): no op but our kernels reads or writes
    either weight or its gradient. 2048 tokens: a training step's, past those for which the down
    projection is one matmul over every expert."""
    specs = _experts_specs(2048, **GEMMA4_26B)
    down_shape, down_dtype = specs[4]
    specs[4] = (down_shape, down_dtype, (0, 1, 2))

    def loss(hidden, index, weights, gate_up, down):
        out = ops.experts_forward(hidden, index, weights, gate_up, down, activation="gelu_tanh", generation="v6e",
                                  interpret=False)
        return jnp.sum(out.astype(jnp.float32))

    grads = jax.grad(loss, argnums=(0, 3, 4))
    report = tpu_compile.compile_for(grads, specs, "v6e", "ragged_dot_tpu", out_layouts=(None, None, (0, 1, 2)))
    _assert_training_kernels_fit(report, "v6e")
    for weight, index in GEMMA4_WEIGHTS.items():
        assert not _ops_reading(report, specs[index][0]), (weight, _ops_reading(report, specs[index][0]))
