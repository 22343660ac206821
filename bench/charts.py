"""The benches' charts: per kernel and generation, ours against the best anchor and against the
roofline, one cell per model and case. MODELED figures, as the tables they are drawn from.

Each bench writes its kernel's charts with its table; `python bench/charts.py` redraws every
kernel's from the committed results (bench/results/<kernel>.json) without re-running anything.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import textwrap
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
# Ours over the best anchor: a log scale centred at 1.0, so 0.9 (ours faster) and 1.1 (slower) take
# opposite hues and equal ratios either way equal depth; the colour saturates past 2x either way,
# the cell's figure still says how far.
VS_ANCHOR_RANGE = (0.5, 2.0)
# Ours over the roofline is at least 1 by definition: one hue, saturating at 4x.
VS_ROOFLINE_RANGE = (1.0, 4.0)
# Results a later change to the schedule model left stale until re-run: their charts say so.
STALE = {}


def _ordered(values) -> list:
    return list(dict.fromkeys(values))


def _against_anchors(ours: dict, anchors: list[dict]) -> dict:
    """Ours over the fastest anchor that compiled; `partial` where another anchor did not."""
    done = [r for r in anchors if "modeled_us" in r]
    best = min(done, key=lambda r: r["modeled_us"], default=None)
    return dict(vs_anchor=best and ours["modeled_us"] / best["modeled_us"], partial=len(done) < len(anchors))


def ragged_dot_cells(results: list[dict]) -> list[dict]:
    """One cell per model and (phase, matmul, pass): the bench's own ratios of our row; `partial`
    where an anchor (megablox, tokamax, tpu-inference: each at any of its tilings) has no row that
    compiled."""
    case = lambda r: (r["generation"], r["model"], r["phase"], r["matmul"], r["pass_"])
    family = lambda impl: impl.split()[0]  # "megablox best" and "megablox ours' tiles": one anchor
    families, compiled = {}, {}
    for r in results:
        if family(r["impl"]) != "ours":
            families.setdefault(case(r), set()).add(family(r["impl"]))
            if "modeled_us" in r and r.get("compiles") is not False:
                compiled.setdefault(case(r), set()).add(family(r["impl"]))
    return [dict(generation=r["generation"], row=r["model"], column=f"{r['phase']} {r['matmul']} {r['pass_']}",
                 vs_anchor=r.get("ratio_vs_best_anchor"), vs_roofline=r.get("vs_roofline"),
                 partial=families.get(case(r), set()) != compiled.get(case(r), set()))
            for r in results if r["impl"] == "ours" and "modeled_us" in r]


def flash_attention_cells(results: list[dict]) -> list[dict]:
    """One cell per model and (tokens, pass): ours over the fastest anchor that compiled."""
    cases = {}
    for r in results:
        cases.setdefault((r["generation"], r["model"], r["tokens"], r["pass_"]), []).append(r)
    cells = []
    for (generation, model, tokens, pass_name), rows in cases.items():
        ours = next((r for r in rows if r["impl"] == "ours" and "modeled_us" in r), None)
        if ours is None:
            continue
        cells.append(dict(generation=generation, row=model, column=f"{tokens} tokens {pass_name}",
                          vs_roofline=ours.get("vs_roofline"),
                          **_against_anchors(ours, [r for r in rows if r["impl"] != "ours"])))
    return cells


# paged_bench's impl names: ours in each cache layout; every other impl is an anchor.
PAGED_OURS = {"ours": "token-major", "ours head-major": "head-major"}


def paged_attention_cells(results: list[dict]) -> list[dict]:
    """One cell per model and (batch, our cache layout), bf16 caches (the anchors' dtype): ours over
    the fastest anchor that compiled; the roofline is the bytes the sequences hold at full bandwidth."""
    cases = {}
    for r in results:
        if r["cache"] == "bfloat16":
            cases.setdefault((r["generation"], r["model"], r["batch"]), []).append(r)
    cells = []
    for (generation, model, batch), rows in cases.items():
        anchors = [r for r in rows if r["impl"] not in PAGED_OURS]
        for impl, layout in PAGED_OURS.items():
            ours = next((r for r in rows if r["impl"] == impl and "modeled_us" in r), None)
            if ours is None:
                continue
            cells.append(dict(generation=generation, row=model, column=f"{batch}, {layout}",
                              vs_roofline=ours["modeled_us"] / ours["floor_us"], **_against_anchors(ours, anchors)))
    return cells


CELLS = {"ragged_dot": ragged_dot_cells, "flash_attention": flash_attention_cells,
         "paged_attention": paged_attention_cells}


def grids(cells: list[dict]) -> tuple[list[str], list[str], np.ndarray, np.ndarray, np.ndarray]:
    """Row and column labels (in the results' order), the two ratio grids (NaN where none) and
    where an anchor did not compile."""
    rows, columns = _ordered(c["row"] for c in cells), _ordered(c["column"] for c in cells)
    vs_anchor, vs_roofline = (np.full((len(rows), len(columns)), np.nan) for _ in range(2))
    partial = np.zeros((len(rows), len(columns)), bool)
    assert len({(c["row"], c["column"]) for c in cells}) == len(cells), "two cases share a cell"
    for c in cells:
        at = rows.index(c["row"]), columns.index(c["column"])
        vs_anchor[at] = np.nan if c["vs_anchor"] is None else c["vs_anchor"]
        vs_roofline[at] = np.nan if c["vs_roofline"] is None else c["vs_roofline"]
        partial[at] = c["partial"]
    return rows, columns, vs_anchor, vs_roofline, partial


def cells_digest(cells: list[dict]) -> str:
    """What a chart shows, as a short digest its PNG carries (so a test can tell a stale chart)."""
    return hashlib.sha256(json.dumps(cells, sort_keys=True).encode()).hexdigest()[:16]


def generations(cells: list[dict]) -> dict[str, list[dict]]:
    """The cells of each generation, in the results' order."""
    return {g: [c for c in cells if c["generation"] == g] for g in _ordered(c["generation"] for c in cells)}


def norms():
    """The two colour scales: (ours / best anchor, ours / roofline), each a (norm, colour map)."""
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm

    return ((LogNorm(*VS_ANCHOR_RANGE), colormaps["RdBu_r"]),
            (LogNorm(*VS_ROOFLINE_RANGE), colormaps["Reds"]))


def write(kernel: str, results: list[dict], out: Path) -> list[Path]:
    """`out/<kernel>_<generation>.png` for each generation the results have; the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    written = []
    for generation, cells in generations(CELLS[kernel](results)).items():
        rows, columns, vs_anchor, vs_roofline, partial = grids(cells)
        fig, axes = plt.subplots(2, 1, figsize=(max(7.0, 0.75 * len(columns) + 3), 2 * (0.42 * len(rows) + 1.6)))
        titles = ("ours / fastest anchor (* where one did not compile or support the case): blue faster, red slower",
                  "ours / roofline (1 = the chip's limit)")
        marks = (np.where(partial, "*", ""), np.full(partial.shape, ""))
        for ax, grid, mark, (norm, cmap), title in zip(axes, (vs_anchor, vs_roofline), marks, norms(), titles):
            ax.imshow(np.ma.masked_invalid(grid), norm=norm, cmap=cmap, aspect="auto")
            ax.set_facecolor("0.85")  # n/a: no anchor compiled or none supports the case
            for (i, j), value in np.ndenumerate(grid):
                red, green, blue, _ = cmap(norm(value))
                dark = not math.isnan(value) and 0.3 * red + 0.6 * green + 0.1 * blue < 0.5
                ax.text(j, i, "n/a" if math.isnan(value) else f"{value:.2f}{mark[i, j]}", ha="center", va="center",
                        fontsize=7, color="white" if dark else "black")
            ax.set_yticks(range(len(rows)), rows, fontsize=8)
            labels = ["\n".join(textwrap.wrap(column, 10)) for column in columns]
            ax.set_xticks(range(len(columns)), labels, fontsize=7)
            ax.set_title(title, fontsize=9)
            bar = fig.colorbar(ax.images[0], ax=ax, fraction=0.04, extend="both" if norm.vmin < 1 else "max")
            bar.ax.yaxis.set_minor_formatter(NullFormatter())
            ticks = [t for t in (0.5, 0.67, 0.8, 1, 1.25, 1.5, 2, 3, 4) if norm.vmin <= t <= norm.vmax]
            bar.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])
        fig.suptitle(f"{kernel} on {generation}: MODELED from libtpu's compiled schedules, not measured on a TPU"
                     + (f"\n{STALE[kernel, generation]}" if (kernel, generation) in STALE else ""), fontsize=10)
        fig.tight_layout()
        path = out / f"{kernel}_{generation}.png"
        fig.savefig(path, dpi=90, metadata={"Description": f"cells {cells_digest(cells)}"})
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> int:
    for kernel in (argv if argv is not None else sys.argv[1:]) or CELLS:
        for path in write(kernel, json.loads((RESULTS / f"{kernel}.json").read_text()), RESULTS):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
