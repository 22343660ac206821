"""The benches' charts: the right ratios in the right cells, a colour scale that tells faster from
slower at a glance, and committed charts drawn from the committed results."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import charts  # noqa: E402  (matplotlib and numpy only: no jax, no libtpu)


def test_flash_cells_take_the_fastest_anchor_that_compiled():
    rows = [
        dict(model="M", tokens=8192, pass_="fwd", generation="v6e", impl="ours", modeled_us=90.0, vs_roofline=3.0),
        dict(model="M", tokens=8192, pass_="fwd", generation="v6e", impl="splash", modeled_us=120.0),
        dict(model="M", tokens=8192, pass_="fwd", generation="v6e", impl="tokamax", modeled_us=100.0),
        dict(model="M", tokens=8192, pass_="fwd", generation="v6e", impl="jax", error="does not compile"),
        dict(model="M", tokens=8192, pass_="fwd+bwd", generation="v6e", impl="ours", modeled_us=50.0, vs_roofline=2.0),
        dict(model="M", tokens=8192, pass_="fwd+bwd", generation="v6e", impl="splash", error="unsupported"),
    ]
    fwd, bwd = charts.flash_attention_cells(rows)
    assert (fwd["row"], fwd["column"], fwd["vs_anchor"], fwd["vs_roofline"], fwd["partial"]) == (
        "M", "8192 tokens fwd", pytest.approx(0.9), 3.0, True)
    assert bwd["vs_anchor"] is None and bwd["partial"]  # no anchor compiled: n/a, not 1.0


def test_ragged_cells_mark_an_anchor_that_never_compiled():
    case = dict(model="M", phase="decode", matmul="gate_up", pass_="fwd", generation="v6e")
    ours = dict(case, impl="ours", modeled_us=90.0, ratio_vs_best_anchor=0.9, vs_roofline=1.2)
    compiled = [dict(case, impl="megablox best", modeled_us=100.0), dict(case, impl="tokamax", modeled_us=120.0)]
    assert not charts.ragged_dot_cells([ours, *compiled])[0]["partial"]
    # One of megablox's tilings failing is not a missing anchor; tpu-inference never compiling is.
    failed = [dict(case, impl="megablox ours' tiles", compiles=False, modeled_us=80.0),
              dict(case, impl="tpu-inference", error="no tiling compiles")]
    assert not charts.ragged_dot_cells([ours, *compiled, failed[0]])[0]["partial"]
    assert charts.ragged_dot_cells([ours, *compiled, *failed])[0]["partial"]


def test_paged_cells_compare_bf16_caches_per_layout_with_the_anchors():
    case = dict(model="M", batch="decode 64 x 8k", generation="tpu7x")
    rows = [
        dict(case, impl="ours", cache="bfloat16", modeled_us=130.0, floor_us=100.0),
        dict(case, impl="ours head-major", cache="bfloat16", modeled_us=110.0, floor_us=100.0),
        dict(case, impl="ours", cache="float8_e4m3fn", modeled_us=10.0, floor_us=50.0),  # not against bf16 anchors
        dict(case, impl="tpu-inference", cache="bfloat16", modeled_us=100.0),
        dict(case, impl="jax ragged_paged_attention", cache="bfloat16", modeled_us=200.0),
    ]
    cells = charts.paged_attention_cells(rows)
    assert [(c["column"], c["vs_anchor"], c["vs_roofline"], c["partial"]) for c in cells] == [
        ("decode 64 x 8k, token-major", pytest.approx(1.3), pytest.approx(1.3), False),
        ("decode 64 x 8k, head-major", pytest.approx(1.1), pytest.approx(1.1), False)]


def test_colours_tell_faster_from_slower_and_centre_on_one():
    (norm, cmap), (roof_norm, roof_cmap) = charts.norms()
    colour = lambda ratio: np.array(cmap(norm(ratio))[:3])
    red, blue = 0, 2
    assert colour(0.9)[blue] > colour(0.9)[red] and colour(1.36)[red] > colour(1.36)[blue]
    assert np.abs(colour(1.0) - 1).max() < 0.06  # about white: neither faster nor slower
    # Equal ratios either way are equally far from the centre: 1.25x faster mirrors 1.25x slower.
    assert norm(0.8) == pytest.approx(1 - norm(1.25)) and norm(1.0) == pytest.approx(0.5)
    assert np.linalg.norm(colour(0.9) - colour(1.0)) > 0.1  # a 10% difference shows
    assert np.abs(np.array(roof_cmap(roof_norm(1.0))[:3]) - 1).max() < 0.06  # at the roofline: white


def test_a_chart_per_generation_with_its_cells_digest(tmp_path):
    rows = [dict(model="M", tokens=8192, pass_="fwd", generation=g, impl=impl, modeled_us=t, vs_roofline=2.0)
            for g in ("v6e", "tpu7x") for impl, t in (("ours", 90.0), ("splash", 100.0))]
    written = charts.write("flash_attention", rows, tmp_path)
    assert [p.name for p in written] == ["flash_attention_v6e.png", "flash_attention_tpu7x.png"]
    cells = charts.generations(charts.flash_attention_cells(rows))
    for path, generation in zip(written, ("v6e", "tpu7x")):
        assert Image.open(path).text["Description"] == f"cells {charts.cells_digest(cells[generation])}"


@pytest.mark.parametrize("kernel", list(charts.CELLS))
def test_committed_charts_show_the_committed_results(kernel):
    """Every generation in the kernel's results has its chart, drawn from these very rows (a re-run
    that did not redraw them fails here: `python bench/charts.py` redraws them)."""
    results = charts.RESULTS
    cells = charts.generations(charts.CELLS[kernel](json.loads((results / f"{kernel}.json").read_text())))
    assert sorted(p.name for p in results.glob(f"{kernel}_*.png")) == sorted(f"{kernel}_{g}.png" for g in cells)
    for generation, generation_cells in cells.items():
        shown = Image.open(results / f"{kernel}_{generation}.png").text.get("Description")
        assert shown == f"cells {charts.cells_digest(generation_cells)}", f"{kernel}_{generation}.png is stale"
