"""The calibration's points (bench/calibration_cases.json) and their MODELED results
(bench/results/calibration.json): no published measurement is lost, and every Pallas row stays
within the target of its measurement."""

import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
CASES = json.loads((BENCH / "calibration_cases.json").read_text())
ROWS = json.loads((BENCH / "results" / "calibration.json").read_text())
TARGET = 1.3  # bench/calibration.py's: modeled within this factor of measured, either way

# tokamax's "Performance Benchmarks on Ironwood TPU" (November 2025): batch 1, 32 query heads, 8 KV
# heads, causal, bf16, one tpu7x core. (tokens, head_dim_qk, head_dim_v): (forward ms, backward ms).
IRONWOOD_SPLASH = {
    (4096, 128, 128): (0.58, 1.19), (4096, 192, 128): (0.59, 1.23), (4096, 256, 256): (0.67, 1.25),
    (8192, 128, 128): (1.93, 3.98), (8192, 192, 128): (1.98, 4.14), (8192, 256, 256): (2.14, 4.20),
    (32768, 128, 128): (24.75, 55.05), (32768, 192, 128): (25.41, 56.97), (32768, 256, 256): (26.93, 58.11),
    (131072, 128, 128): (357.20, 823.43), (131072, 192, 128): (371.30, 840.74), (131072, 256, 256): (386.39, 853.37),
}


def _row_of(case):
    matches = [r for r in ROWS if all(r.get(k) == v for k, v in case.items())]
    assert len(matches) == 1, f"calibration.json has {len(matches)} rows for {case}"
    return matches[0]


def test_every_ironwood_splash_point_is_a_case():
    splash = {(c["tokens"], c["head_dim_qk"], c["head_dim_v"], c["pass_"]): c["measured_ms"]
              for c in CASES if c["kind"] == "splash"}
    expected = {(*key, pass_): ms for key, both in IRONWOOD_SPLASH.items() for pass_, ms in zip(("fwd", "bwd"), both)}
    assert splash == expected
    for c in CASES:
        if c["kind"] == "splash":
            assert (c["generation"], c["batch"], c["q_heads"], c["kv_heads"]) == ("tpu7x", 1, 32, 8)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['kind']}-{c['generation']}-{c.get('tokens', c.get('m'))}"
                         f"-{c.get('head_dim_qk', c.get('k'))}-{c.get('pass_', '')}")
def test_every_case_has_its_modeled_row(case):
    row = _row_of(case)
    if _not_modeled(case):
        if "error" in row:  # calibration.md lists it and says why
            assert "HbmOom" in row["error"] or "compile" in row["error"] or row["error"].startswith("n/a: gmm_v2")
            return
    assert row["modeled_ms"] > 0 and row["ratio"] == pytest.approx(row["modeled_ms"] / case["measured_ms"])


def _not_modeled(case):
    """The microbenchmark's backward at 128k tokens for head dims 192 and 256: its program needs
    135 GB or more of f32 dq partials at every block calibration.py tries, past a core's HBM; and
    tokamax's gmm_v2 perf test, whose kernel no package here holds."""
    return case["kind"] == "gmm_v2" or (case["kind"] == "splash" and case["tokens"] == 131072
                                        and case["pass_"] == "bwd" and case["head_dim_qk"] > 128)


def _known_off(case):
    """The rows calibration.md names as past the target, with the band they stay in: the splash
    rows from 32k tokens (the model grows slower than the measurement with the sequence, and the
    copy fit slows the backward's copies: 1.42x at most, 32k's backward at head dim 256), the
    1k-token cached row (one masked block per head), and XLA's own
    ragged_dot on v5e (0.5x: its trips' compute and DMAs add up to the measured time there, while
    on tpu7x the longer of the two matches it, as the model takes it) and where it tiles the
    contraction of weights [G, N, K] inside its loop (counted once); and ragged paged attention v3
    with a 128-token window (a page or two per sequence: copies the model overlaps entirely)."""
    if case["kind"] == "xla_ragged_dot" and case["generation"] == "v5e":
        return (0.45, 1 / TARGET)
    if case["kind"] == "xla_ragged_dot" and case.get("transpose_rhs") and case["k"] >= 2048:
        return (0.15, 1 / TARGET)  # the contraction tiled inside the loop: counted once, a lower bound
    if case["kind"] == "splash" and case["tokens"] >= 32768:
        return KNOWN_OFF_BAND
    if case["kind"] == "tokamax_attention" and case["tokens"] == 1024 and case["generation"] == "tpu7x":
        return (0.6, 1 / TARGET)
    if case["kind"] == "rpa_v3" and case["sliding_window"]:
        return (0.2, 1 / TARGET)  # a page or two per sequence: its copies' latency, not charged by the model
    return None


KNOWN_OFF_BAND = (1 / TARGET, 1.45)


@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: f"{c['kind']}-{c['generation']}-{c.get('tokens', c.get('m'))}"
                         f"-{c.get('head_dim_qk', c.get('k'))}-{c.get('pass_', '')}")
def test_every_row_within_the_target(case):
    """Matmuls, attention and XLA's own ragged_dot (its loop's trips counted over the measured
    group sizes) alike, but for the rows calibration.md names, which stay in their band."""
    row = _row_of(case)
    if _not_modeled(case) and "error" in row:
        pytest.skip("not modeled: calibration.md says why")
    ratio = row["ratio"]
    low, high = _known_off(case) or (1 / TARGET, TARGET)
    assert low <= ratio <= high, f"MODELED / measured = {ratio:.2f}"


def test_before_the_two_rate_fix_tpu7x_attention_was_off():
    """The splash forward on tpu7x was 1.7x or more slow with every bundle at the MXU-calibrated
    clock (calibration.md's `before fix`), and v6e's rows did not move: the fix is tpu7x's."""
    rows = [r for r in (_row_of(c) for c in CASES if c["kind"] in ("splash", "tokamax_attention")) if "error" not in r]
    assert min(r["before_ratio"] for r in rows if r["kind"] == "splash" and r["pass_"] == "fwd") >= 1.7
    assert all(r["before_ms"] == pytest.approx(r["modeled_ms"], rel=0.02) for r in rows if r["generation"] == "v6e")


def test_the_model_copies_at_the_fit_of_the_measured_rings():
    """helion's tpu7x decode points (DMA rings of 2 MiB copies, four and two in flight; XLA's dense MLP)
    are rows. The model's share of the HBM bandwidth and tpu7x's copy latency are the fit to the two
    rings (`calibration.stream_fit`), so both are modeled within a twentieth of their measured times,
    and XLA's MLP, streaming at less than the rings, short of its own; headline.md's verdict quotes
    the current ratios."""
    import calibration
    import pipeline

    ratio = {(r["kind"], r.get("slots")): r["ratio"] for r in ROWS if r["kind"] in ("weight_stream", "xla_mlp")}
    assert set(ratio) == {("weight_stream", 3), ("weight_stream", 5), ("xla_mlp", None)}
    fit = calibration.stream_fit([r for r in ROWS if r["kind"] == "weight_stream"])
    assert pipeline.HBM_SHARE == pytest.approx(fit["share"], abs=0.005)
    latency, at_bytes = pipeline.COPY_LATENCY_S["tpu7x"]
    ring = next(r for r in ROWS if r["kind"] == "weight_stream")
    assert latency == pytest.approx(fit["latency"], rel=0.01) and at_bytes == ring["tiling"][0] * ring["tiling"][1] * 2
    assert abs(ratio["weight_stream", 5] - 1) < 0.05 and abs(ratio["weight_stream", 3] - 1) < 0.05
    assert 1 / 1.3 < ratio["xla_mlp", None] < 1
    verdict = " ".join((BENCH / "results" / "headline.md").read_text().split("## Quantized")[0].split())
    assert f"is modeled {ratio['xla_mlp', None]:.2f}x its measured time" in verdict
    assert (f"{ratio['weight_stream', 5]:.2f}x with four copies in flight and {ratio['weight_stream', 3]:.2f}x with two"
            in verdict)


