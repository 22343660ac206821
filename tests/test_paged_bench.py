"""The paged bench's whole path (bench/paged_bench.py) on small batches: both kernels compiled by
libtpu, their schedules read, the bytes counted, the report written with its goals."""

import json

import pytest

import paged_bench
from paged_attention import tuning


def test_paged_bench_models_both_kernels_and_fp8_halves_the_page_copies(tmp_path, monkeypatch):
    """A decode-and-prefill batch with a bf16 cache, then an fp8 one, both with the default blocks
    (the table's entries may differ by dtype, and a prefill's pages are copied once per query
    block): both kernels modeled; then the anchor, transformers' gather and varlen flash."""
    monkeypatch.setattr(paged_bench, "BATCHES", [paged_bench.Batch("mixed 8 dec + 1 x 64 pre, 1k", 8, 1, 64, 1024)])
    monkeypatch.setattr(tuning, "TUNED", {})
    assert paged_bench.main(["--models", "Llama-3-8B", "--generations", "v6e", "--out", str(tmp_path)]) == 0
    bf16, fp8, anchor = json.loads((tmp_path / "paged_attention.json").read_text())
    assert [(r["impl"], r["cache"]) for r in (bf16, fp8, anchor)] == [
        ("ours", "bfloat16"), ("ours", "float8_e4m3fn"), (paged_bench.TRANSFORMERS, "bfloat16")]
    for r in (bf16, fp8, anchor):
        assert r["compiles"] and r["regions_mapped"], r
        assert r["modeled_us"] == pytest.approx(r["kernel_us"] + r["around_us"])
        assert r["kernel_us"] >= max(r["compute_us"], r["dma_us"]) and r["modeled_us"] >= r["floor_us"]
    assert bf16["tiling"].startswith("prefill") and " + decode " in bf16["tiling"], bf16["tiling"]
    # The anchor's flash kernel reads the gathered context: at least the K and V the sequences hold.
    assert anchor["kv_held_bytes"] == bf16["kv_held_bytes"] <= anchor["hbm_bytes"]
    # The same pages at half the bytes, and no pass over the cache outside the kernels.
    assert fp8["page_copy_bytes"] * 2 == bf16["page_copy_bytes"] > 0
    assert fp8["around_us"] <= 1.1 * bf16["around_us"] + 1
    table = (tmp_path / "paged_attention.md").read_text()
    assert "NOT measured on a TPU" in table
    assert "page copies against bf16's on the same batch: 0.500 to 0.500x" in table
    assert f"Ours (bf16) against {paged_bench.TRANSFORMERS}: " in table
