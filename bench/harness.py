"""The one measurement behind every bench, tuning, headline and calibration row: MODELED.

A program is measured in three stages, each one function here:

- `walk`: its Pallas kernels' grids walked (bench/grid_walk.py): the bytes each grid step moves,
  the MXU work it does, which `pl.when` bodies run; plus the padding copies XLA makes outside the
  kernels. Traced with the target chip as jax's default device, as the compile traces it, so
  both see the same program.
- `compile`: libtpu's ahead-of-time compile for the generation (kernels/tpu_compile.py): every
  op's final bundles and each kernel's VMEM.
- `model`: the two combined by the schedule model (bench/pipeline.py), XLA's ops around the
  kernels included: a `Measurement`.

`measure` runs all three; `Results` keeps each bench's rows. The files that use it (bench.py,
flash_bench.py, paged_bench.py, headline.py, calibration.py and the tuners) only say which
programs, shapes and candidates. On a TPU, `bench.py --tpu` times real runs instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [p for p in (str(REPO), str(REPO / "kernels"), str(BENCH)) if p not in sys.path]
# The environment, set once for every bench: jax on the CPU with libtpu's compile dumps on, before
# jax or libtpu load; on a TPU (`bench.py --tpu`) jax keeps its TPU and nothing is compiled here.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
ON_TPU = "--tpu" in sys.argv
import tpu_compile  # noqa: E402

if not ON_TPU:
    os.environ["JAX_PLATFORMS"] = "cpu"
    tpu_compile.configure_environment()

import jax  # noqa: E402

import grid_walk  # noqa: E402
import pipeline  # noqa: E402
from runtime.generations import GENERATIONS  # noqa: E402


@dataclasses.dataclass
class Measurement:
    """One compiled program, modeled. Times in seconds; `figures()` gives a row's fields in us."""

    generation: str
    costs: list  # grid_walk.KernelCost of each walked Pallas kernel, in program order
    report: "tpu_compile.CompileReport"
    parts: dict  # pipeline.program_seconds: modeled, kernels, around, compute, dma, fill_drain, ...
    copies: int = 0  # bytes of the padding copies outside the kernels (walked; in no time above)

    @property
    def modeled_s(self) -> float:
        return self.parts["modeled"]

    @property
    def schedules(self) -> dict:
        return self.report.schedules

    @property
    def kernel_schedules(self) -> list:
        """The compiled schedule of each walked kernel, in the order of `costs`."""
        return [self.report.schedules[op] for op in self.parts["kernel_ops"]]

    @property
    def xla_ops(self) -> dict:
        """{HLO op name: schedule} of every op that is not a walked kernel."""
        return {op: s for op, s in self.report.schedules.items() if op not in self.parts["kernel_ops"]}

    def figures(self) -> dict:
        """The fields every row of a modeled program carries (us, bytes, steps)."""
        us = lambda key: self.parts[key] * 1e6
        return dict(compiles=True, vmem_used=vmem_used(self.report), modeled_us=us("modeled"), kernel_us=us("kernels"),
                    around_us=us("around"), compute_us=us("compute"), dma_us=us("dma"),
                    fill_drain_us=us("fill_drain"), regions_mapped=self.parts["regions_mapped"],
                    grid_steps=sum(int(c.grid_steps) for c in self.costs),
                    hbm_bytes=sum(int(c.hbm_bytes) for c in self.costs),
                    dot_flops=sum(int(c.dot_flops) for c in self.costs))


def vmem_used(report, names=("",)) -> int | None:
    """The most VMEM any compiled kernel whose name holds one of `names` takes."""
    return max((k.vmem_bytes for op, k in report.kernels.items() if any(n in op for n in names)), default=None)


def on_target(fn, generation: str):
    """fn traced with the generation's device as jax's default, as `tpu_compile.compile_for` traces
    it: a kernel that picks its path by the chip (the experts take their weights in the layouts
    that chip holds them in) is walked on the path the compile sees."""
    def traced(*args):
        with jax.default_device(tpu_compile.device_for(generation)):
            return fn(*args)
    return traced


def walk(fn, args, generation: str, with_calls: bool = False):
    """(costs, copies): each Pallas kernel's walked cost and the padding copies' bytes outside them.
    args: the program's arguments, abstract (jax.ShapeDtypeStruct) or concrete (the routing, page
    tables: what the kernels' grids read). with_calls: also each kernel's pallas_call equation."""
    copies = []
    calls = grid_walk.pallas_calls(on_target(fn, generation), *args, copies=copies)
    costs = [grid_walk.analyze_call(eqn, invals, GENERATIONS[generation].mxu_width) for eqn, invals in calls]
    return (costs, sum(copies), [eqn for eqn, _ in calls]) if with_calls else (costs, sum(copies))


def compile(fn, args, generation: str, kernel_name: str = "", compiler_options: dict | None = None,
            layouts: dict | None = None, **options) -> "tpu_compile.CompileReport":
    """libtpu's compile of fn at the arguments' shapes and dtypes (layouts: {argument index:
    major_to_minor} for an argument held in a layout of its own). options: `compile_for`'s
    (donate_argnums, out_layouts). Raises the compiler's error."""
    layouts = layouts or {}
    # (Concrete arguments in jax's dtypes: numpy's int64 is traced as int32.)
    specs = [(tuple(a.shape), jax.dtypes.canonicalize_dtype(a.dtype), *([layouts[i]] if i in layouts else []))
             for i, a in enumerate(args)]
    return tpu_compile.compile_for(fn, specs, generation, kernel_name, compiler_options, **options)


def model(costs, report, generation: str, copies: int = 0, **program_options) -> Measurement:
    """The schedule model of a compiled program whose kernels were walked. program_options:
    `pipeline.program_seconds`'s (child_runs, profiles, group_sizes)."""
    return Measurement(generation, costs, report,
                       pipeline.program_seconds(costs, report.schedules, generation, **program_options), copies)


def measure(fn, args, generation: str, kernel_name: str = "", *, compiler_options: dict | None = None,
            layouts: dict | None = None, compile_options: dict | None = None, costs=None, copies: int = 0,
            walked: bool = True, require_kernels: bool = False, **program_options) -> Measurement:
    """Walk, compile and model one program. costs (with copies): already walked (a caller that
    adds what the walk cannot see); walked=False: no kernel walked, every op counted as XLA's;
    require_kernels: an error when the walk finds no Pallas kernel."""
    if costs is None and walked:
        costs, copies = walk(fn, args, generation)
    costs = costs or []
    if require_kernels and not costs:
        raise RuntimeError("the grid walk found no Pallas kernel in the program")
    report = compile(fn, args, generation, kernel_name, compiler_options, layouts, **(compile_options or {}))
    return model(costs, report, generation, copies, **program_options)


def measure_profiled(fn, args, profile_args, generation: str, kernel_name: str = "", **options):
    """`measure` for kernels whose loops run as their data says and that copy what they need
    themselves (bench/kernel_profile.py): each kernel's control run on `profile_args` (all of fn's
    arguments, concrete) in Pallas's TPU interpreter, its loops and branches counted as they ran and
    the bytes its own copies moved added to its walked bytes. Returns (Measurement, [bytes each
    kernel copied itself], [each kernel's pallas_call equation]). options: `measure`'s."""
    import kernel_profile

    costs, copies, calls = walk(fn, args, generation, with_calls=True)
    # A jitted kernel wrapper that sizes its blocks by the chip is cached by its arguments alone:
    # traced on this CPU for another generation before, it would come back with that one's blocks.
    jax.clear_caches()
    with target_info(generation):
        profiles = kernel_profile.profile(fn, *profile_args)
    if [c.name for c in costs] != [p.name for p in profiles]:
        raise RuntimeError(f"profiled {[p.name for p in profiles]}, walked {[c.name for c in costs]}")
    own = [int(prof.dma_bytes().sum() + prof.dma_bytes(reads_hbm=False).sum()) for prof in profiles]
    for cost, copied in zip(costs, own):  # the profile's count of its own copies replaces the walk's
        cost.hbm_bytes += copied - (0 if cost.copy_bytes is None else int(cost.copy_bytes.sum()))
    return measure(fn, args, generation, kernel_name, costs=costs, copies=copies, profiles=profiles, **options), own, calls


@contextlib.contextmanager
def target_info(generation: str):
    """Within it, Pallas's `get_tpu_info` answers for the generation, while the program runs on this
    CPU (a profile): kernels that size their blocks by the chip they run on (tpu-inference's) ask
    it, as does jax's pipeline for those blocks' tiling."""
    from jax._src.pallas.mosaic import tpu_info
    from jax.experimental.pallas import tpu as pltpu

    with jax.default_device(tpu_compile.device_for(generation)):
        info = pltpu.get_tpu_info()
    saved = [(module, module.get_tpu_info) for module in (pltpu, tpu_info)]
    for module, _ in saved:
        module.get_tpu_info = lambda *args, **kwargs: info
    try:
        yield
    finally:
        for module, original in saved:
            module.get_tpu_info = original


def error_row(err: Exception) -> dict:
    """A row's record of what failed: the error's first line."""
    return dict(error=str(err).splitlines()[0][:200])


def chip_vmem_option(generation: str) -> dict:
    """A compile option giving a kernel that sets no VMEM limit the chip's whole VMEM, as
    measurements whose tiles exceed Mosaic's default limit ran."""
    return {"xla_tpu_scoped_vmem_limit_kib": str(GENERATIONS[generation].vmem_bytes // 1024)}


def write_atomically(path: Path, text: str) -> None:
    """Replaces the file whole: a run stopped mid-write leaves the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(text)
    partial.replace(path)


class Results:
    """A results file: a JSON list of rows, each named by `key(row)`. Loaded whole at the start;
    `put` replaces its rows' namesakes (or adds them) and rewrites the file at once, whole, in
    `order` (default: as first put). A run stopped, or one that redoes a subset, never loses the
    rows it did not redo."""

    def __init__(self, path: Path, key, order=None):
        self.path, self.key, self.order = Path(path), key, order
        self._rows = {key(r): r for r in json.loads(self.path.read_text())} if self.path.exists() else {}

    def __contains__(self, key) -> bool:
        return key in self._rows

    def get(self, key, default=None):
        return self._rows.get(key, default)

    @property
    def rows(self) -> list[dict]:
        rows = list(self._rows.values())
        return sorted(rows, key=self.order) if self.order else rows

    def put(self, *rows: dict, save: bool = True) -> None:
        self._rows.update({self.key(r): r for r in rows})
        if save:
            self.save()

    def merge(self, path: Path) -> None:
        """Another run's results file, its rows winning."""
        self.put(*json.loads(Path(path).read_text()), save=False)

    def save(self) -> None:
        write_atomically(self.path, json.dumps(self.rows, indent=1))
