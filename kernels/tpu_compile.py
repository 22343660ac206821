"""Ahead-of-time compilation for real TPU chips on a machine without one.

libtpu's Mosaic and XLA:TPU compilers run against a topology description
(`v5e:2x2`, ...), so "it compiles and fits VMEM" is a fact we can check
here. libtpu writes a VMEM report and the final VLIW schedule for every
kernel it compiles into a dump folder; `compile_for` reads them back.

`configure_environment()` must run before libtpu loads (before the first
topology is made or torch_tpu is imported): libtpu reads its flags once.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import tpu_schedule

_DUMP_CATEGORIES = "memory-report,codegen"


def configure_environment(dump_dir: str | None = None) -> Path:
    """Sets libtpu's dump flags and quiets its host probing. Idempotent within a process.

    Each process gets its own dump directory: a child inherits its parent's environment (pytest-xdist's
    workers, the controller's), and two processes compiling into one directory would clear and read
    each other's files (a test saw the other worker's `copy` op as its own)."""
    existing = os.environ.get("TPU_KERNELS_DUMP_DIR")
    if existing and os.environ.get("TPU_KERNELS_DUMP_PID") == str(os.getpid()):
        return Path(existing)
    dump = Path(dump_dir or tempfile.mkdtemp(prefix="libtpu-dump-"))
    dump.mkdir(parents=True, exist_ok=True)
    if dump_dir is None:
        atexit.register(shutil.rmtree, dump, ignore_errors=True)
    os.environ["TPU_KERNELS_DUMP_DIR"] = str(dump)
    os.environ["TPU_KERNELS_DUMP_PID"] = str(os.getpid())
    inherited = [flag for flag in os.environ.get("LIBTPU_INIT_ARGS", "").split()
                 if not flag.startswith(("--xla_jf_dump_to=", "--xla_jf_dump_category_filter="))]
    os.environ["LIBTPU_INIT_ARGS"] = " ".join(
        inherited + [f"--xla_jf_dump_to={dump}", f"--xla_jf_dump_category_filter={_DUMP_CATEGORIES}"])
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # Without these libtpu probes for TPU hosts and logs errors (harmless).
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v6e-4")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    return dump


@dataclasses.dataclass
class KernelReport:
    vmem_bytes: int  # all VMEM the compiler allocated for the kernel
    schedule: "tpu_schedule.Schedule | None" = None  # its final bundles, read (kernels/tpu_schedule.py)


@dataclasses.dataclass
class CompileReport:
    generation: str
    device_kind: str
    compile_seconds: float
    vmem_capacity: int | None
    kernels: dict[str, KernelReport]  # keyed by the HLO op name of each Pallas kernel
    # Every other op of the program (XLA's fusions, copies, sorts around the
    # kernel): its schedule, keyed by HLO op name.
    other_ops: dict[str, "tpu_schedule.Schedule"] = dataclasses.field(default_factory=dict)

    @property
    def schedules(self) -> dict[str, "tpu_schedule.Schedule"]:
        """Every compiled op's schedule, keyed by HLO op name."""
        return {op: r.schedule for op, r in self.kernels.items() if r.schedule} | self.other_ops


_devices = {}


def device_for(generation: str):
    """One device of the generation's smallest AOT topology."""
    from runtime.generations import GENERATIONS
    from jax.experimental import topologies

    if generation not in _devices:
        topology = GENERATIONS[generation].topology
        _devices[generation] = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[0]
    return _devices[generation]


def compile_for(fn, arg_specs, generation: str, kernel_name: str, compiler_options: dict | None = None,
                donate_argnums: tuple[int, ...] = (), out_layouts: tuple | None = None) -> CompileReport:
    """Compiles `fn(*args)` for one device of `generation`.

    arg_specs: (shape, dtype) per argument, or (shape, dtype, major_to_minor) for an argument held in
    that layout rather than the one libtpu picks for its shape (which, for a minor dimension under
    128 lanes, may put another dimension minor-most). Reports every Pallas kernel whose
    name contains `kernel_name`. Raises the compiler's error when it fails
    (a VMEM overflow is `RESOURCE_EXHAUSTED ... vmem`). compiler_options:
    XLA/libtpu flags for this compile only (a kernel that sets no VMEM limit
    gets `xla_tpu_scoped_vmem_limit_kib`, as its users set it). donate_argnums: as jax.jit's
    (an op that updates an argument in place). out_layouts: a major_to_minor (or None: libtpu's
    choice) per output of a tuple-returning fn; a donated argument is updated in place only if
    its output keeps its layout.
    """
    import jax

    dump = configure_environment()
    device = device_for(generation)
    sharding = jax.sharding.SingleDeviceSharding(device)
    from jax.experimental.layout import Format, Layout

    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=Format(Layout(layout[0]), sharding) if layout else sharding)
            for shape, dtype, *layout in arg_specs]
    _clear(dump)
    start = time.perf_counter()
    try:
        with jax.default_device(device):  # lets pltpu.get_tpu_info() see the target while tracing
            out_shardings = None if out_layouts is None else tuple(
                Format(Layout(layout), sharding) if layout else sharding for layout in out_layouts)
            # A new function object each call: jax caches compiles by function, and a cached compile
            # writes no dump to read.
            (jax.jit(lambda *a: fn(*a), donate_argnums=donate_argnums, out_shardings=out_shardings).lower(*args)
             .compile(compiler_options=compiler_options))
        seconds = time.perf_counter() - start
        capacity, kernels, other_ops = _read_dump(dump, sorted(os.listdir(dump)), kernel_name)
    finally:
        _clear(dump)  # a compile's dump can be tens of MB: keep none of it
    if not kernels and not any(kernel_name in op for op in other_ops):  # a kernel of DMAs only has no VMEM report
        raise RuntimeError(f"libtpu's dump in {dump} has no kernel named {kernel_name!r}")
    return CompileReport(generation, device.device_kind, seconds, capacity, kernels, other_ops)


def compile_on_topology(build, arg_specs, generation: str, topology: str, kernel_name: str) -> CompileReport:
    """Compiles an SPMD program for every device of `topology` (e.g. "v6e:2x4", eight chips).

    build(devices) -> (fn, shardings): the program over those devices and each argument's
    sharding. Reports as compile_for does (the per-device program's kernels and ops)."""
    import jax
    from jax.experimental import topologies

    dump = configure_environment()
    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    fn, shardings = build(devices)
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
            for (shape, dtype), sharding in zip(arg_specs, shardings)]
    _clear(dump)
    start = time.perf_counter()
    try:
        jax.jit(fn).lower(*args).compile()
        seconds = time.perf_counter() - start
        capacity, kernels, other_ops = _read_dump(dump, sorted(os.listdir(dump)), kernel_name)
    finally:
        _clear(dump)
    if not kernels:
        raise RuntimeError(f"libtpu's dump in {dump} has no kernel named {kernel_name!r}")
    return CompileReport(generation, devices[0].device_kind, seconds, capacity, kernels, other_ops)


def _clear(dump: Path) -> None:
    for entry in Path(dump).iterdir():
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


# libtpu names each op's schedule "<id>-<HLO op name>-<pass no>-final_bundles.txt";
# programs also get pseudo-ops ("TLP", "<late-initialization>") that are not ops.
_FINAL_BUNDLES = re.compile(r"^\d+-(.+)-\d+-final_bundles\.txt$")


def _read_dump(dump: Path, files: list[str], kernel_name: str):
    capacity, vmem, schedules = None, {}, {}
    for name in files:
        path = Path(dump) / name
        if name.endswith("vmem_report.html"):
            text = path.read_text()
            data, _ = json.JSONDecoder().raw_decode(text[text.index("const DATA =") + len("const DATA ="):].lstrip())
            capacity = data.get("global_info", {}).get("vmem_capacity", capacity)
            for op, info in data["hlo_breakdowns"].items():
                # A Pallas kernel's HLO op carries its name. Other ops whose metadata
                # names it (copies around it) and "<top-inlining-caller>" are not it.
                if kernel_name in op and not op.startswith("<"):
                    vmem[op] = info["total_size"]
        elif (match := _FINAL_BUNDLES.match(name)) and not match.group(1).startswith(("TLP", "<")):
            schedules[match.group(1)] = tpu_schedule.read_schedule(path.read_text())
    kernels = {op: KernelReport(size, schedules.get(op)) for op, size in vmem.items()}
    return capacity, kernels, {op: s for op, s in schedules.items() if op not in kernels}
