"""The bench's counting (bench/grid_walk.py) against hand counts, and the
properties of our kernel it shows: inactive experts' weights are never read."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import bench
import harness
import grid_walk
from ragged_dot import kernel


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

    # Data operands abstract (the walk needs only their shapes), routing concrete.
    args = (jax.ShapeDtypeStruct((rows, k), jnp.bfloat16), jax.ShapeDtypeStruct((groups, n, k), jnp.bfloat16),
            jnp.asarray(sizes))
    (cost,) = grid_walk.kernel_costs(fn, args, mxu_width=256)
    weights = [v for key, v in cost.bytes_by_operand.items() if key.startswith("in1:")]
    assert weights == [5 * k * n * 2]
    assert cost.work_steps == 5 and cost.dot_flops == 5 * 2 * 16 * k * n


def test_weight_grad_windows_are_counted_in_place():
    """The weights' gradient with windows at group starts: element-indexed
    windows are counted at their offsets (a group's first window re-reads
    the previous group's last rows) and clipped to the inputs (the windows
    hang over the last row and column instead of the inputs being padded:
    no copy), and MXU passes past a group's rows are skipped."""
    rows, p, q = 250, 128, 200  # Q = 200 in 128-wide blocks: the second Q tile reads 72 columns
    sizes = np.array([100, 0, 150], np.int32)

    def fn(a, b, gs):
        return kernel.transposed_grouped_matmul(
            a, b, gs, blocks=kernel.BlockSizes(128, 128, 128, windows_at_group_start=True),
            out_dtype=jnp.bfloat16, vmem_limit=32 << 20, sub_rows=64, interpret=False)

    args = (jax.ShapeDtypeStruct((rows, p), jnp.bfloat16), jax.ShapeDtypeStruct((rows, q), jnp.bfloat16),
            jnp.asarray(sizes))
    (cost,), copies = grid_walk.kernel_costs_and_copies(fn, args, mxu_width=256)
    assert copies == 0
    # Windows need 256 rows: group 0 at row 0; group 2 starts at 100 -> 96, then
    # 224 slides back to 128 (rows 128-249 exist). Empty group 1 (one visit,
    # window 96 after group 0's 0) and group 2's first window share offset 96,
    # so the a/b copies happen at 0, 96, 128 per (P tile, Q tile).
    rows_read = 128 + 128 + 122
    # P is one tile and outside the Q tiles: a is re-read per Q tile, b read once.
    in_bytes = {k: v for k, v in cost.bytes_by_operand.items() if k.startswith("in")}
    assert sorted(in_bytes.values()) == sorted([2 * rows_read * p * 2, 2 * rows_read * q])
    # Passes of 64 rows: group 0's window 0 owns rows 0-99 (passes 0, 64); group 2's
    # window 96 owns 100-223 (passes 96, 160), its window 128 owns 224-249 (pass 192
    # only). 5 passes per Q tile, each contraction padded to 256.
    assert cost.mxu_flops == 5 * 2 * 2 * 128 * 256 * 256


def test_bench_writes_modeled_table_and_chart(tmp_path):
    """The bench's whole path on one small case: compiles, reads the
    schedules, models ours and an anchor (one tiling: the sweep's choice of its fastest is
    test_each_anchor_keeps_its_fastest_compiling_tiling), and writes the report."""
    # A row of the committed results that this run does not redo stays: a subset run loses nothing.
    other = next(r for r in json.loads((harness.BENCH / "results" / "ragged_dot.json").read_text())
                 if r["model"] == "Mixtral-8x7B")
    (tmp_path / "ragged_dot.json").write_text(json.dumps([other]))
    assert bench.main(["--models", "Qwen3-30B-A3B", "--phases", "decode", "--generations", "v6e",
                       "--passes", "fwd", "--impls", "ours", "megablox 128^3", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "ragged_dot.md").read_text()
    assert "NOT measured on a TPU" in table and "## Summary" in table.split("## Every row")[0]
    ours = [line for line in table.splitlines() if "| ours |" in line and "Qwen3-30B-A3B" in line]
    assert len(ours) == 2  # gate_up and down
    assert all(line.rstrip(" |").split("|")[-2].strip() not in ("-", "nan") for line in ours), "ratio vs the anchor"
    rows = json.loads((tmp_path / "ragged_dot.json").read_text())
    same = lambda r: (*bench.case_of(r), r["impl"], r["modeled_us"]) == (*bench.case_of(other), other["impl"],
                                                                        other["modeled_us"])
    assert sum(map(same, rows)) == 1
    rows = [r for r in rows if not same(r)]
    (best,) = {r["impl"] for r in rows} - {"ours"}
    assert best == "megablox 128^3"
    for r in rows:
        # The schedule model's parts add up: the kernel's pipeline covers its compute and its DMA.
        assert r["regions_mapped"] and r["modeled_us"] == pytest.approx(r["kernel_us"] + r["around_us"])
        assert r["kernel_us"] >= max(r["compute_us"], r["dma_us"])
    assert (tmp_path / "ragged_dot_v6e.png").stat().st_size > 10_000


def test_each_anchor_keeps_its_fastest_compiling_tiling():
    """megablox's best is its fastest tiling that libtpu compiles; tokamax and
    tpu-inference keep the faster of their own pick and megablox's best."""
    row = lambda impl, tiling, us, compiles=True: dict(impl=impl, tiling=tiling, modeled_us=us, compiles=compiles)
    rows = [row("ours", "256x512x512", 40),
            row("megablox 128^3", "128x128x128", 100),
            row("megablox ours' tiles", "256x512x512", 30, compiles=False),
            row("megablox sweep 0", "512x512x512", 80),
            row("tokamax", "128x128x128", 120), row("tokamax sweep 0", "512x512x512", 85),
            row("tpu-inference", "128x512x512", 70), row("tpu-inference sweep 0", "512x512x512", 75)]
    kept = {r["impl"]: r for r in bench.best_of_sweep(rows, bench.IMPLS)}
    assert set(kept) == set(bench.IMPLS)
    assert (kept["megablox best"]["tiling"], kept["megablox best"]["modeled_us"]) == ("512x512x512", 80)
    assert kept["megablox best"]["candidates"]["256x512x512"] is None  # refused by libtpu
    assert (kept["tokamax"]["tiling"], kept["tokamax"]["own_tiling"]) == ("512x512x512", "128x128x128")
    assert (kept["tpu-inference"]["tiling"], kept["tpu-inference"]["modeled_us"]) == ("128x512x512", 70)
    assert kept["megablox 128^3"]["modeled_us"] == 100  # the fixed tilings stay as they are


def test_v1_rows_are_compared_with_not_raced():
    """Our rows from before the v2 forward give ours / v1 on the summary, and
    are never taken for the best anchor (they are ours)."""
    case = dict(model="Qwen3-30B-A3B", phase="decode", tokens=64, matmul="gate_up", pass_="fwd",
                generation="v6e", rows=512, min_flops=1.0, min_bytes=1.0, active_groups=125)
    rows = [dict(case, impl="ours", modeled_us=300.0), dict(case, impl=bench.V1, modeled_us=200.0),
            dict(case, impl="megablox best", modeled_us=250.0)]
    bench.ratio_rows(rows)
    ours = rows[0]
    assert ours["ratio_vs_v1"] == pytest.approx(1.5)
    assert ours["best_anchor"]["impl"] == "megablox best" and ours["ratio_vs_best_anchor"] == pytest.approx(1.2)
    (line,) = [s for s in bench.summary_lines(rows) if s.startswith("| v6e | fwd")]
    assert line.endswith("| 1.50 (1.50) |")
