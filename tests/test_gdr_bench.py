"""The gated delta rule's bench (bench/gdr_bench.py) on its smallest cases: a decode step and a
2k prefill compiled by libtpu and modeled through the one harness, the rows within what the chip
can do, the report written, a committed row of another case kept."""

import json

import pytest

import gdr_bench
import harness


def test_gdr_bench_models_decode_and_prefill_within_the_chip(tmp_path):
    other = next(r for r in json.loads((harness.BENCH / "results" / "gated_delta_rule.json").read_text())
                 if r["generation"] == "tpu7x")
    (tmp_path / "gated_delta_rule.json").write_text(json.dumps([other]))
    assert gdr_bench.main(["--cases", "decode b64", "prefill 2k", "--generations", "v6e", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gated_delta_rule.json").read_text())
    assert other in rows  # a subset run loses nothing
    prefill, decode = (next(r for r in rows if r["case"] == c and r["generation"] == "v6e")
                       for c in ("prefill 2k", "decode b64"))
    for r in (prefill, decode):
        assert r["compiles"] and r["regions_mapped"] and r["grid_steps"] > 0, r
        assert r["modeled_us"] == pytest.approx(r["kernel_us"] + r["around_us"])
    # Physical: no decode step faster than moving its states once, no prefill past the MXU's peak.
    assert decode["modeled_us"] >= decode["floor_us"] > 0
    assert 0 < prefill["mxu_fraction"] < 1
    # The decode step's states are updated in place: nothing outside the kernel passes over them
    # (a pass over 64 x 32 x 128 x 128 fp32 states would take ~100 us on v6e).
    assert decode["around_us"] < 10, decode
    table = (tmp_path / "gated_delta_rule.md").read_text()
    assert "NOT measured on a TPU" in table and "| decode b64 | v6e | ours |" in table
