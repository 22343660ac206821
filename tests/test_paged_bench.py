"""The paged bench's whole path (bench/paged_bench.py) on small batches: both kernels compiled by
libtpu, their schedules read, the bytes counted, the report written with its goals."""

import json
import os
import types

import jax.numpy as jnp
import numpy as np
import pytest

import harness
import kernel_profile
import paged_bench
import sampling
import tpu_schedule
from paged_attention import tuning
from paged_attention.kernel import BlockSizes
from runtime.generations import GENERATIONS

# The checks below compile (minutes of libtpu each): `make test` models our kernels on v6e, `make
# check-compile` (CHECK_ALL_COMPILES=1) the anchors beside them, and on tpu7x too.
BENCHED = ["v6e"] + (["tpu7x"] if sampling.ALL_COMPILES else [])
ANCHORS_BENCHED = BENCHED if sampling.ALL_COMPILES else []


def test_paged_bench_models_both_kernels_and_fp8_halves_the_page_copies(tmp_path, monkeypatch):
    """A decode-and-prefill batch with a bf16 cache, then an fp8 one, both with the default blocks
    (the table's entries may differ by dtype, and a prefill's pages are copied once per query
    block): both kernels modeled; then (in `make check-compile`: tests/sampling.py) the anchors,
    transformers' gather and varlen flash, and jax's paged_attention, which has no prefill (its row
    says so)."""
    monkeypatch.setattr(paged_bench, "BATCHES", [paged_bench.Batch("mixed 8 dec + 1 x 64 pre, 1k", 8, 1, 64, 1024)])
    monkeypatch.setattr(tuning, "TUNED", {})
    # A row of the committed results that this run does not redo stays: a subset run loses nothing.
    other = next(r for r in json.loads((harness.BENCH / "results" / "paged_attention.json").read_text())
                 if r["generation"] == "tpu7x" and r["impl"] == "ours")
    (tmp_path / "paged_attention.json").write_text(json.dumps([other]))
    anchors = sampling.ALL_COMPILES
    assert paged_bench.main(["--models", "Llama-3-8B", "--generations", "v6e", "--out", str(tmp_path)]
                            + ([] if anchors else ["--no-anchors"])) == 0
    other_kept, *rows = json.loads((tmp_path / "paged_attention.json").read_text())
    assert other_kept == other
    ours = [("ours", "bfloat16"), ("ours", "float8_e4m3fn"), ("ours head-major", "bfloat16"),
            ("ours head-major", "float8_e4m3fn")]
    anchor_rows = [(impl, "bfloat16") for impl in (paged_bench.TRANSFORMERS, paged_bench.JAX_PAGED,
                                                   paged_bench.JAX_RPA, paged_bench.TPU_INFERENCE)]
    assert [(r["impl"], r["cache"]) for r in rows] == ours + (anchor_rows if anchors else [])
    bf16, fp8, head_major, head_major_fp8 = rows[:4]
    table = (tmp_path / "paged_attention.md").read_text()
    if anchors:
        anchor, decode_only, jax_rpa, tpu_inference = rows[4:]
        assert decode_only["error"].startswith("n/a: decode only")
        # The anchor's flash kernel reads the gathered context: at least the K and V the sequences hold.
        assert anchor["kv_held_bytes"] == bf16["kv_held_bytes"] <= anchor["hbm_bytes"]
        assert f"Ours (bf16) against {paged_bench.TRANSFORMERS}: " in table
        assert f"Ours (bf16) against {paged_bench.TPU_INFERENCE}: " in table
        assert "Ours (bf16) no slower than the best anchor on every shape: " in table
        assert "Ours, head-major cache (bf16) no slower than the best anchor on every shape: " in table
    for r in rows[:4] + [r for r in rows[4:] if "error" not in r]:
        assert r["compiles"] and r["regions_mapped"], r
        assert r["modeled_us"] == pytest.approx(r["kernel_us"] + r["around_us"])
        assert r["kernel_us"] >= max(r["compute_us"], r["dma_us"]) and r["modeled_us"] >= r["floor_us"]
    assert bf16["tiling"].startswith("prefill") and " + decode " in bf16["tiling"], bf16["tiling"]
    # The same pages at half the bytes, and no pass over the cache outside the kernels.
    assert fp8["page_copy_bytes"] * 2 == bf16["page_copy_bytes"] > 0
    assert fp8["around_us"] <= 1.1 * bf16["around_us"] + 1
    assert "NOT measured on a TPU" in table
    assert "page copies against bf16's on the same batch: 0.500 to 0.500x" in table
    # Head-major pages: the same copies, each head's rows read as whole tiles (fewer cycles).
    assert head_major["page_copy_bytes"] == bf16["page_copy_bytes"]
    assert head_major["compute_us"] < bf16["compute_us"]
    # An 8-bit cache goes into the products as stored (Mosaic widens it inside the MXU's operand
    # path); widened first in the vector units it cost about twice bf16's compute.
    assert fp8["compute_us"] <= 1.2 * bf16["compute_us"] and head_major_fp8["compute_us"] <= 1.2 * head_major["compute_us"]
    # The run redraws the chart of every generation its results hold (the kept tpu7x row's too).
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["paged_attention_tpu7x.png", "paged_attention_v6e.png"]


def test_jax_paged_attention_anchor_copies_its_pages_and_prefetches_once_per_step():
    """The decode anchor on a small batch: compiled at each of its tilings, its fastest kept; every
    step that attends copies its block's pages whole (at least the K and V the sequences hold).
    Batches or models it cannot serve get a row that says so."""
    batch = paged_bench.Batch("decode 8 x 1k", 8, 0, 0, 1024)
    row = paged_bench.measure_jax_paged_attention(paged_bench.SHAPES[0], batch, "v6e")
    assert row["compiles"] and row["regions_mapped"], row
    assert row["modeled_us"] >= row["floor_us"] and row["tiling"].endswith("pages per block")
    block_keys = int(row["tiling"].split()[0]) * batch.page_size
    blocks = -(-batch.routing()["kv_lens"] // block_keys)
    shape = paged_bench.SHAPES[0]
    pages = int(blocks.sum()) * block_keys * shape.kv_heads * shape.head_dim * 2 * 2  # K and V, bf16
    assert row["kv_held_bytes"] <= pages <= row["hbm_bytes"] < 1.01 * pages  # and q, out, its statistics
    windowed = paged_bench.measure_jax_paged_attention(paged_bench.SHAPES[2], batch, "v6e")
    assert windowed["error"].startswith("n/a")


def test_jax_paged_attention_runs_one_prefetch_per_step():
    """Its nested bodies: the first block's prefetch at the first step that attends, the next
    block's at every step that attends but the last, the small ones never."""
    cost = types.SimpleNamespace(when_runs=np.array([[0], [1], [1], [0], [1]], bool), grid_steps=5)
    region = tpu_schedule.Region(0, 10, 700, 2, children=(5, 300, 7, 300))
    schedule = tpu_schedule.Schedule(20, 0, None, 0, 1000, None, [region], 2, 0, 0)
    runs = paged_bench._jax_paged_prefetches(cost, schedule)[0]
    assert runs.tolist() == [[False] * 4, [False, True, False, True], [False, False, False, True], [False] * 4,
                             [False] * 4]
    # A step pays its region less the children that do not run; a step that skips it, none of it.
    cycles = schedule.step_cycles(cost.when_runs, {0: runs})
    assert cycles.tolist() == [300, 1000 - 12, 1000 - 312, 300, 1000 - 612]


@pytest.mark.parametrize("generation", ANCHORS_BENCHED)
def test_profiled_anchors_move_what_their_copies_say(generation):
    """The anchors whose loops run as their data says, profiled on a small decode batch and mapped
    onto their compiled loops and branches (libtpu lays them out differently per generation: on
    tpu7x a loop's trip test spans its body). jax's ragged_paged_attention copies whole blocks of
    pages (K and V interleaved) for each sequence; tpu-inference's kernel copies exactly the K and
    V each sequence holds, and its head_dim 64 variant (gpt-oss, with sinks) runs a grid whose size
    is a value. Both add q and out."""
    batch = paged_bench.Batch("decode 8 x 1k", 8, 0, 0, 1024)
    shape = paged_bench.SHAPES[0]
    q_out = 2 * batch.tokens * shape.q_heads * shape.head_dim * 2
    kv_lens = batch.routing()["kv_lens"]
    jax_rpa = paged_bench.measure_jax_ragged_paged_attention(shape, batch, generation)
    assert jax_rpa["compiles"] and jax_rpa["regions_mapped"], jax_rpa
    block = int(jax_rpa["tiling"].split(" x ")[1].split()[0]) * batch.page_size  # keys per block
    copied = int((-(-kv_lens // block)).sum()) * block * 2 * shape.kv_heads * shape.head_dim * 2
    assert jax_rpa["hbm_bytes"] == copied + q_out
    assert jax_rpa["modeled_us"] >= jax_rpa["floor_us"]
    tpu_inference = paged_bench.measure_tpu_inference(shape, batch, generation)
    assert tpu_inference["compiles"] and tpu_inference["regions_mapped"], tpu_inference
    assert tpu_inference["hbm_bytes"] == tpu_inference["kv_held_bytes"] + q_out
    assert tpu_inference["around_us"] < 1  # its cache held and returned in place: no copy of it
    if generation == "v6e":
        gpt_oss = paged_bench.measure_tpu_inference(paged_bench.SHAPES[2], batch, generation)
        assert gpt_oss["compiles"] and gpt_oss["regions_mapped"] and gpt_oss["grid_steps"] == batch.seqs, gpt_oss
        no_sinks = paged_bench.measure_jax_ragged_paged_attention(paged_bench.SHAPES[2], batch, generation)
        assert no_sinks["error"] == "n/a: no sinks"


@pytest.mark.parametrize("generation", BENCHED)
def test_our_page_loops_count_each_trip(generation):
    """Our kernel copies and waits for a chunk's pages in loops of as many trips as the chunk has
    pages to copy (its profile counts them): on the same grid (one chunk per sequence, the default
    blocks: the prefill kernel runs a grid loop of one idle step), twice the context issues at
    least a few cycles more per extra page (a schedule read without the profile counts a loop
    whose trip count is a value once). On tpu7x a region's last loop ends a few bundles past it."""
    shape, clock = paged_bench.SHAPES[0], GENERATIONS[generation].clock_hz
    batches = [paged_bench.Batch(f"decode 8 x {n}", 8, 0, 0, n) for n in (512, 1024)]
    short, long = (paged_bench.measure(shape, b, generation) for b in batches)
    assert short["grid_steps"] == long["grid_steps"]
    pages = [int((-(-b.routing()["kv_lens"] // b.page_size)).sum()) for b in batches]
    assert long["page_copy_bytes"] * pages[0] == short["page_copy_bytes"] * pages[1]
    extra_cycles = (long["compute_us"] - short["compute_us"]) * 1e-6 * clock
    assert extra_cycles >= 16 * (pages[1] - pages[0])


def test_our_decode_waits_for_the_pages_its_previous_step_started():
    """The profile of our decode kernel (no compile): each step starts the next step's pages
    before it waits for its own, so every step after the first waits for exactly the bytes the
    step before it started, and the waits add up to the starts: the model queues them across steps
    (`pipeline.own_copies_step_seconds`), a copy's latency paid where the queue runs dry."""
    shape, batch = paged_bench.SHAPES[0], paged_bench.Batch("decode 8 x 1k", 8, 0, 0, 1024)
    routing, data, index = paged_bench.our_inputs(shape, batch, jnp.bfloat16)
    fn = paged_bench.ours(shape, routing, "v6e", jnp.bfloat16, BlockSizes(2, 16))  # 256-key chunks
    (profile,) = kernel_profile.profile(fn, *paged_bench.profile_args(data, index, (1, 2), routing))
    started, waited = profile.dma_bytes(), profile.waited_bytes()
    steps = np.flatnonzero(waited)
    assert len(steps) > 8 and waited.sum() == started.sum() > 0
    assert started[steps[0]] == waited[steps[0]] + waited[steps[1]]  # the first step starts its own pages too
    np.testing.assert_array_equal(waited[steps[2:]], started[steps[1:-1]])


def test_goals_name_each_decode_row_an_8bit_cache_misses():
    """The 8-bit caches' goal (decode at most 0.6x bf16's time in the same layout and batch) names
    each row past it, the worst first; prefill batches and rows without a bf16 twin are not rated."""
    def row(batch, cache, us, impl="ours"):
        return dict(model="M", batch=batch, generation="v6e", cache=cache, impl=impl, modeled_us=us,
                    page_copy_bytes=1, hbm_vs_held=1.0)

    rows = [row("decode a", "bfloat16", 100.0), row("decode a", "int8", 55.0), row("decode b", "bfloat16", 100.0),
            row("decode b", "int8", 70.0), row("decode c", "bfloat16", 100.0), row("decode c", "int8", 90.0),
            row("mixed", "bfloat16", 100.0), row("mixed", "int8", 200.0), row("decode a", "int8", 10.0, "ours head-major")]
    lines = paged_bench.goal_lines(rows)
    assert ("- int8 cache's decode at most 0.6x bf16's modeled time (same layout): 0.55 to 0.90x, NOT met on 2 of 3: "
            "ours, M, decode c, v6e (0.90x); ours, M, decode b, v6e (0.70x).") in lines, lines
    assert not any(line.startswith("- float8_e4m3fn cache's decode") for line in lines)


def test_a_re_rating_resumes_where_it_stopped():
    """`paged_tune.py` rates again the entries an earlier schedule model rated (those from before
    revisions were kept count as revision 1), and skips those the current one did: a re-rating
    stopped midway resumes where it stopped. `--redo` rates every entry again."""
    import paged_tune
    import pipeline

    now = {"rated": "2026-12-01", "model_revision": pipeline.MODEL_REVISION}
    assert paged_tune.needs_rating(None)
    assert not paged_tune.needs_rating(now)
    assert paged_tune.needs_rating(now, redo=True)
    assert paged_tune.needs_rating({**now, "model_revision": pipeline.MODEL_REVISION - 1})
    assert paged_tune.needs_rating({"rated": "2026-12-07"})  # kept before revisions were
