"""Layers 2 and 3: TPU semantics in the TPU interpreter, and real
compilation for v5e, v5p, v6e and tpu7x with libtpu (no TPU needed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tpu_compile
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
from jax.experimental.pallas import tpu as pltpu

from ragged_dot import kernel, ops, reference
from ragged_dot._shared.generations import GENERATIONS


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


# Qwen3-30B-A3B experts: hidden 2048, expert intermediate 768, 128 experts, top-8.
QWEN3_30B = dict(hidden=2048, intermediate=768, experts=128, top_k=8)


@pytest.mark.parametrize("tokens", [64, 8192], ids=["decode64", "prefill8192"])
@pytest.mark.parametrize("generation", sorted(GENERATIONS))
def test_experts_forward_compiles_and_fits_vmem(generation, tokens):
    h, i, e, k = (QWEN3_30B[key] for key in ("hidden", "intermediate", "experts", "top_k"))
    specs = [((tokens, h), jnp.bfloat16), ((tokens, k), jnp.int32), ((tokens, k), jnp.bfloat16),
             ((e, 2 * i, h), jnp.bfloat16), ((e, h, i), jnp.bfloat16)]

    def forward(*args):
        return ops.experts_forward(*args, generation=generation, interpret=False)

    report = tpu_compile.compile_for(forward, specs, generation, "ragged_dot_tpu")
    gen = GENERATIONS[generation]
    assert report.device_kind.startswith(gen.device_kind_prefixes)
    assert len(report.kernels) == 2, report.kernels  # gate_up and down grouped matmuls
    for name, (rows, kk, n) in zip(sorted(report.kernels), [(tokens * k, h, 2 * i), (tokens * k, i, h)]):
        blocks = ops.choose_blocks(rows, kk, n, e, generation)
        used = report.kernels[name].vmem_bytes
        # Within the scoped limit the kernel asks Mosaic for, and within the chip.
        assert used <= kernel._vmem_limit(blocks, 2, jnp.bfloat16) <= gen.vmem_bytes, (name, used)
        # The report is this kernel's: it holds at least our double-buffered blocks.
        assert used >= kernel.vmem_bytes(blocks, 2, jnp.bfloat16), (name, used, blocks)
