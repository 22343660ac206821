"""The bench's counting (bench/grid_walk.py) against hand counts, and the
properties of our kernel it shows: inactive experts' weights are never read."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench  # noqa: E402
import grid_walk  # noqa: E402

from ragged_dot import kernel  # noqa: E402


def _tiled_matmul(m, k, n, bm, bk, bn):
    def body(a_ref, b_ref, o_ref, acc_ref):
        @pl.when(pl.program_id(2) == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        acc_ref[...] += jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    return pl.pallas_call(
        body,
        grid=(m // bm, n // bn, k // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)), pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
    )


@pytest.mark.parametrize("bk", [256, 512], ids=["k-split", "k-whole"])
def test_grid_walk_counts_a_tiled_matmul(bk):
    m, k, n, bm, bn = 256, 512, 384, 128, 128
    a, b = jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((k, n), jnp.bfloat16)
    (cost,) = grid_walk.kernel_costs(_tiled_matmul(m, k, n, bm, bk, bn), (a, b), mxu_width=256)
    k_steps, n_tiles, m_tiles = k // bk, n // bn, m // bm
    assert cost.grid == (m_tiles, n_tiles, k_steps) and cost.grid_steps == m_tiles * n_tiles * k_steps
    # A's block changes every step when K is split; with K whole it stays
    # put across j, so each row tile is read once.
    a_reads = m * k * (n_tiles if k_steps > 1 else 1)
    b_reads = k * n * m_tiles  # B's block changes every step
    out_writes = m * n
    assert cost.bytes_by_operand == {
        "in0:bfloat16[256,512]": 2 * a_reads, "in1:bfloat16[512,384]": 2 * b_reads, "out2:bfloat16[256,384]": 2 * out_writes}
    # 128-wide n blocks are padded to the 256-wide MXU.
    assert cost.mxu_flops == cost.grid_steps * 2 * bm * bk * 256
    assert cost.dot_flops == 2 * m * k * n


def test_inactive_experts_weights_are_never_read():
    """Decode-like routing: 5 of 64 experts active, each group exactly one
    16-row tile. The weights read are exactly the active experts' weights,
    and the dots run only on the active experts' visits."""
    k, n, groups, rows = 512, 256, 64, 80
    sizes = np.zeros(groups, np.int32)
    sizes[[3, 10, 11, 40, 63]] = 16

    def fn(lhs, rhs, gs):
        return kernel.grouped_matmul(lhs, rhs, gs, blocks=kernel.BlockSizes(16, k, n), transpose_rhs=True,
                                     out_dtype=jnp.bfloat16, vmem_limit=32 << 20, interpret=False)

    args = (jnp.zeros((rows, k), jnp.bfloat16), jnp.zeros((groups, n, k), jnp.bfloat16), jnp.asarray(sizes))
    (cost,) = grid_walk.kernel_costs(fn, args, mxu_width=256)
    weights = [v for key, v in cost.bytes_by_operand.items() if key.startswith("in1:")]
    assert weights == [5 * k * n * 2]
    assert cost.work_steps == 5 and cost.dot_flops == 5 * 2 * 16 * k * n


def test_bench_writes_modeled_table_and_chart(tmp_path):
    assert bench.main(["--models", "Qwen3-30B-A3B", "--phases", "decode", "--generations", "v6e",
                       "--no-compile", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "ragged_dot.md").read_text()
    assert "NOT measured on a TPU" in table
    ours = [line for line in table.splitlines() if "| ours |" in line]
    assert len(ours) == 6  # gate_up and down; forward, activations' and weights' gradients
    assert all(line.rstrip(" |").split("|")[-1].strip() != "nan" for line in ours), "ratio vs the anchor"
    assert (tmp_path / "ragged_dot.png").stat().st_size > 10_000
