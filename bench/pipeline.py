"""The performance model: a kernel's time, MODELED from what the compiler produced.

Inputs, both measured from the kernel itself, never written by hand:

- the issue cycles of each grid step, from libtpu's final bundles for the
  compiled kernel (kernels/tpu_schedule.py): the grid loop's iteration,
  less the `pl.when` bodies that step skips (the grid walk computes each
  condition per step, as the kernel does);
- the bytes each step fetches and writes back, from the grid walk
  (bench/grid_walk.py).

They are combined as Pallas's double-buffered pipeline runs them: while
step i computes, step i+1's inputs arrive and step i-1's output leaves, so

    time = fetch(0) + sum_i max(compute(i), dma(fetch(i+1) + write(i-1))) + write(last)

plus the pipeline's fill and drain iterations and the kernel's entry and
exit code (their cycles are in the schedule too). A DMA costs its bytes at
what HBM delivers (`copy_bytes_per_s`) plus a latency (`copy_latency_s`,
on tpu7x growing with the copy's bytes), both fitted to measured copies. On a v5p megacore the
leading "parallel" grid axis is split in halves over the two cores, which
share the bandwidth.

What it cannot see: stalls the static schedule does not show (bank
conflicts, DMA queueing beyond the bandwidth share), and clock changes
under load. bench/results/calibration.md compares it with every public
TPU measurement we could reproduce.
"""

from __future__ import annotations

import bisect

import numpy as np

# The pipeline sum and what HBM delivers to copies (the fit to calibration's measured DMA rings:
# `HBM_SHARE`, `COPY_LATENCY_S`) live with the generation table: the block rule uses them too.
from runtime.generations import (COPY_LATENCY_S, DMA_LATENCY_S, GENERATIONS, HBM_SHARE,  # noqa: F401
                                 copy_bytes_per_s, copy_latency_s, pipeline_seconds)

# Bumped when the model's figures move: tuning records rated on an earlier one are rated again.
# 3: a profiled kernel's copies started a step ahead queue across steps (`own_copies_step_seconds`);
# 2: copies at `HBM_SHARE` and `COPY_LATENCY_S`; 1: at the published bandwidth and `DMA_LATENCY_S`.
MODEL_REVISION = 3


# The clock at which bundles issue when they do not wait on the MXU. Each generation's `clock_hz`
# is calibrated on MXU-bound steps (a dense matmul's accumulate steps reach the bf16 peak), so it
# is the issue rate only where libtpu's schedule already paces the MXU. On v5e, v5p and v6e it
# does: their derived clocks are near what jax's MXU geometry implies, and on v6e the model rates
# tokamax's splash attention within 6% of its measured times (bench/results/calibration.md). On
# tpu7x it does not: libtpu issues a dense matmul's vmatmuls 1.77x as densely as on v6e for 1.26x
# the peak, so there the MXU stalls the issue, and the calibrated 1.03 GHz would charge those
# stalls to every other bundle too (an attention's softmax): the same splash kernel, with about
# as many bundles per step on both, would be rated 1.5x slower on tpu7x than on v6e where tokamax
# measured it 10% faster. tpu7x's issue clock is therefore calibrated on attention (`python
# bench/calibration.py issue-clock`: tokamax's measured splash forward times on tpu7x); a step
# lasts its bundles at the issue clock or its MXU work, whichever is longer
# (`step_compute_seconds`).
ISSUE_CLOCK_HZ = {"tpu7x": 1.966e9}
# Where the issue clock is not the calibrated one, the MXU sets a step's pace wherever it is the
# busier: each vmatmul the step issues takes as long as one of the dense calibration matmul's
# accumulate steps (MXU-bound by construction) spends per vmatmul, in cycles of `clock_hz`
# (`python bench/calibration.py issue-clock` reads it from that kernel's schedule).
VMATMUL_PACE_CYCLES = {"tpu7x": 2.461}


def issue_clock_hz(generation: str) -> float:
    return ISSUE_CLOCK_HZ.get(generation, GENERATIONS[generation].clock_hz)


def step_compute_seconds(cycles, cost, generation: str, matmuls=None) -> np.ndarray:
    """Each grid step's compute time: its issue cycles at the issue clock, but no less than its
    vmatmuls at the MXU's pace (`matmuls`: per step, from the schedule) nor its MXU work (the
    walked dots, padded to the MXU) at the core's bf16 peak. A kernel whose dots the walk cannot
    count (in a while loop), or whose vmatmuls per step are not known, keeps the MXU-calibrated
    clock for all its bundles."""
    gen = GENERATIONS[generation]
    cycles = np.asarray(cycles, np.float64)
    mxu = getattr(cost, "mxu_flops_per_step", None)
    paced = generation in VMATMUL_PACE_CYCLES
    if mxu is None or not getattr(cost, "dots_counted", False) or (paced and matmuls is None):
        return cycles / gen.clock_hz
    floor = np.asarray(mxu, np.float64) / (gen.bf16_flops / gen.cores_per_device)
    if paced:
        floor = np.maximum(floor, np.asarray(matmuls, np.float64) * VMATMUL_PACE_CYCLES[generation] / gen.clock_hz)
    return np.maximum(cycles / issue_clock_hz(generation), floor)


def step_matmuls(schedule, runs) -> np.ndarray:
    """vmatmuls each grid step issues: the grid-loop iteration's, less those of the pl.when
    bodies it skips (a body nested in one that runs counts as running)."""
    runs = np.asarray(runs, bool)
    if not schedule.regions:
        return np.full(len(runs), schedule.matmuls)
    return schedule.matmuls - (~runs) @ np.array([r.matmuls for r in schedule.regions], np.int64)


def copying_pipeline_seconds(compute_s, fetch_bytes, write_bytes, copy_step, copy_bytes, copy_after_wait,
                             copy_waits, bytes_per_s: float, latency_s, largest=None) -> float:
    """Pallas's pipeline over one core's grid steps (as `pipeline_seconds`) with the copies the
    kernel starts itself (copy_step: the step starting each, in order; copy_after_wait: whether the
    step starts it after its waits; copy_waits: per step, how many it waits for, in the order they
    were started; latency_s and largest: as `pipeline_seconds`). Every copy, the pipeline's and the
    kernel's, is issued when its step starts (or its waits end) and goes through one queue: each
    arrives its latency after it is
    issued or its bytes' time after the previous copy arrives, whichever is later (copies in
    flight overlap their latencies, not their bytes). A step computes once the copies it waits for
    have arrived and ends when that is done and its pipeline copies (the next step's blocks, the
    previous step's output) have arrived. With no copies of the kernel's own this is
    `pipeline_seconds`; with a ring of D slots whose steps each copy b bytes and compute c, a step
    lasts max(c, b / bandwidth, (latency + b / bandwidth) / (D - 1))."""
    compute = np.asarray(compute_s, np.float64)
    fetch, write = np.asarray(fetch_bytes, np.float64), np.asarray(write_bytes, np.float64)
    big_fetch, big_write = (fetch, write) if largest is None else (np.asarray(x, np.float64) for x in largest)
    steps = len(compute)
    if steps == 0:
        return 0.0
    issued_at = np.searchsorted(copy_step, np.arange(steps + 1))  # copies started before each step
    queue = 0.0  # when the last copy issued arrives

    latency = latency_s if callable(latency_s) else lambda size: latency_s

    def issue(now, size, big=None):  # big: the largest of the copies issued together
        nonlocal queue
        queue = max(now + float(latency(size if big is None else big)), queue) + size / bytes_per_s
        return queue

    now = issue(0.0, fetch[0], big_fetch[0]) if fetch[0] > 0 else 0.0
    arrived, waited = [], 0
    for i in range(steps):
        pipelined = (fetch[i + 1] if i + 1 < steps else 0.0) + (write[i - 1] if i > 0 else 0.0)
        big = max(big_fetch[i + 1] if i + 1 < steps else 0.0, big_write[i - 1] if i > 0 else 0.0)
        blocks_in = issue(now, pipelined, big) if pipelined > 0 else now
        mine = slice(issued_at[i], issued_at[i + 1])
        arrived += [issue(now, size) if not after else None for size, after in zip(copy_bytes[mine], copy_after_wait[mine])]
        ready = max([now] + arrived[waited:waited + copy_waits[i]])
        waited += copy_waits[i]
        arrived[mine] = [issue(ready, size) if at is None else at for size, at in zip(copy_bytes[mine], arrived[mine])]
        now = max(ready + compute[i], blocks_in)
    return float(issue(now, write[-1], big_write[-1]) if write[-1] > 0 else now)


def own_copies_step_seconds(compute_s, started_bytes, waited_bytes, bytes_per_s: float, latency_s: float) -> np.ndarray:
    """Each grid step's length for a kernel that copies what it needs itself, known per step only
    as the bytes its DMA starts move and its waits wait for (a profiled kernel:
    bench/kernel_profile.py). Its copies go through one queue, as in `copying_pipeline_seconds`: a
    step's starts issue when the step begins. Bytes a step waits for that an earlier step started
    (the next step's copies started before this one's wait) hold its compute until they arrive;
    bytes it starts and waits for itself are taken to overlap its compute (double-buffered in its
    loops: a lower bound), the step lasting at least until they arrive. So a kernel that copies a
    step ahead pays a copy's latency where its queue runs dry, not every step; one that copies
    within its steps lasts max(compute, latency + bytes / bandwidth) a step. Waits that do not
    add up to the starts (a semaphore counting other units) are read as each step waiting for
    what it started."""
    compute = np.asarray(compute_s, np.float64)
    started = [int(b) for b in started_bytes]
    waited = [int(b) for b in waited_bytes]
    if sum(waited) != sum(started):
        waited = started
    lengths = np.empty(len(compute))
    now = queue = 0.0
    batch_ends, batch_arrivals = [], []  # per batch of starts: bytes started through it, when its last byte arrives
    started_total = waited_total = 0

    def arrival(position: int) -> float:  # when the queue's byte at `position` has arrived
        k = bisect.bisect_left(batch_ends, position)
        return batch_arrivals[k] - (batch_ends[k] - position) / bytes_per_s

    for i in range(len(compute)):
        ahead = started_total - waited_total  # started by earlier steps, not yet waited for
        if started[i]:
            queue = max(now + latency_s, queue) + started[i] / bytes_per_s
            started_total += started[i]
            batch_ends.append(started_total)
            batch_arrivals.append(queue)
        carried = min(waited[i], ahead)
        end = max(now, arrival(waited_total + carried) if carried else now) + compute[i]
        if waited[i] > carried:
            end = max(end, arrival(waited_total + waited[i]))
        waited_total += waited[i]
        lengths[i], now = end - now, end
    return lengths


def core_of_step(grid: tuple[int, ...], semantics: tuple[str, ...], cores: int) -> np.ndarray:
    """Which core runs each grid step: a megacore splits the first
    "parallel" axis longer than one into contiguous halves."""
    steps = int(np.prod(grid))
    axis = next((a for a, (n, s) in enumerate(zip(grid, semantics)) if s == "parallel" and n > 1), None)
    if cores == 1 or axis is None:
        return np.zeros(steps, np.int32)
    index = np.indices(grid).reshape(len(grid), -1)[axis]
    return (index * cores // grid[axis]).astype(np.int32)


def region_runs(cost, schedule) -> np.ndarray | None:
    """Whether each of the schedule's pl.when regions runs at each step: the
    kernel's top-level conds in program order, matched one to one (a region
    holds matmuls exactly when its cond's body does). Mosaic folds a cond
    on grid indices alone that is constant over the grid (`k == 0` with one
    k step), and predicates a body that only starts or waits for copies (or,
    at times, any small body without matmuls): those are dropped when the
    counts differ. Where a block
    overhangs a dim that is not a multiple of 128 (gpt-oss's 2880), Mosaic
    adds regions of its own after the kernel's, without matmuls: those count
    as running at every step. None when they cannot be matched."""
    if not all(cost.when_known):
        return None
    runs, has_dot = cost.when_runs, np.asarray(cost.when_has_dot, bool)
    folded = np.asarray(cost.when_on_grid_only, bool) & (runs.min(axis=0) == runs.max(axis=0))
    varying = ~folded
    branched = ~np.asarray(getattr(cost, "when_copies_only", None) or [False] * runs.shape[1], bool)
    region_dots = np.array([r.matmuls > 0 for r in schedule.regions], bool)
    # Last: only the bodies with matmuls (Mosaic predicated every other: its cycles run every step).
    for keep in (np.ones(runs.shape[1], bool), varying, branched, varying & branched, has_dot):
        ours, extra = region_dots[:keep.sum()], region_dots[keep.sum():]
        if np.array_equal(has_dot[keep], ours) and not extra.any():
            return np.concatenate([runs[:, keep], np.ones((len(runs), len(extra)), bool)], axis=1)
    return None


def kernel_seconds(cost, schedule, generation: str, child_runs: dict | None = None, profile=None) -> dict:
    """Modeled time of one kernel (a grid_walk.KernelCost with its compiled
    tpu_schedule.Schedule), with the parts a reader needs to see why.
    child_runs: as `Schedule.step_cycles`. profile: the kernel's
    bench/kernel_profile.KernelProfile, for a kernel whose loops and branches
    depend on its data and which copies what it needs itself: a step's cycles
    are those of its loops and branches as they ran, its copies as
    `own_copies_step_seconds` queues them."""
    gen = GENERATIONS[generation]
    if not cost.grid_steps:  # a grid of no steps (a kernel called on an empty part of the batch): it only enters and leaves
        fill_drain = schedule.fill_drain_cycles / gen.clock_hz
        return {"modeled": fill_drain, "compute": 0.0, "dma": 0.0, "fill_drain": fill_drain, "cores": 1,
                "regions_mapped": True}
    core = core_of_step(cost.grid, cost.dimension_semantics, gen.cores_per_device)
    active = int(core.max()) + 1
    bandwidth, latency = copy_bytes_per_s(generation), copy_latency_s(generation)
    own_bytes = np.zeros(cost.grid_steps, np.int64)
    whole_program = False
    if profile is not None:
        read = profile.step_cycles(schedule)
        if read is None:
            raise RuntimeError(f"{cost.name}: its profile does not match its compiled loops and branches")
        cycles, whole_program = read
        own_bytes = profile.dma_bytes() + profile.dma_bytes(reads_hbm=False)
        waited = profile.waited_bytes()
        issue = step_compute_seconds(cycles, cost, generation)
        compute = np.empty_like(issue)
        for c in range(active):
            # (A step's copies are many, of a page or a block each: the latency of the smallest, once.)
            compute[core == c] = own_copies_step_seconds(issue[core == c], own_bytes[core == c], waited[core == c],
                                                         bandwidth / active, DMA_LATENCY_S)
        mapped = True
    else:
        runs = region_runs(cost, schedule)
        mapped = runs is not None
        if not mapped:  # the regions do not line up with the kernel's pl.when: count them all as running
            runs = np.ones((cost.grid_steps, len(schedule.regions)), bool)
        compute = issue = step_compute_seconds(schedule.step_cycles(runs, child_runs), cost, generation,
                                               step_matmuls(schedule, runs))
    copies = getattr(cost, "copy_step", None) is not None and profile is None
    if copies:  # the kernel copies blocks itself (a ring): its copies and the pipeline's share one queue
        per_core = []
        for c in range(active):
            steps = np.flatnonzero(core == c)
            mine = core[cost.copy_step] == c
            position = np.searchsorted(steps, cost.copy_step[mine])
            per_core.append(copying_pipeline_seconds(
                compute[steps], cost.fetch_bytes[steps], cost.write_bytes[steps], position,
                cost.copy_bytes[mine], cost.copy_after_wait[mine], cost.copy_waits[steps], bandwidth / active, latency,
                (cost.fetch_largest[steps], cost.write_largest[steps])))
    else:
        per_core = [pipeline_seconds(compute[core == c], cost.fetch_bytes[core == c], cost.write_bytes[core == c],
                                     bandwidth / active, latency,
                                     largest=(cost.fetch_largest[core == c], cost.write_largest[core == c]))
                    for c in range(active)]
    # (A profile read as the whole program: its cycles are the program's already.)
    # (The fill and drain iterations run no dots: their bundles issue at the issue clock.)
    fill_clock = issue_clock_hz(generation) if getattr(cost, "dots_counted", False) and profile is None else gen.clock_hz
    fill_drain = 0.0 if profile is not None and whole_program else schedule.fill_drain_cycles / fill_clock
    total = max(per_core) + fill_drain
    moved = cost.fetch_bytes.sum() + cost.write_bytes.sum() + own_bytes.sum() + (cost.copy_bytes.sum() if copies else 0)
    return {
        "modeled": total,
        "compute": float(issue.sum()) / active,  # issue (or MXU) time, split over the active cores
        "dma": float(moved / bandwidth),
        "fill_drain": fill_drain,
        "cores": active,
        "regions_mapped": mapped,
    }


def data_shapes(shapes) -> list[str]:
    """The array operands (rank >= 2) of an op, sorted: what identifies a
    kernel's compiled op whatever its name and scalar operands."""
    return sorted(s for s in shapes if s.count(",") >= 1)


def match_kernels(costs: list, schedules: dict) -> dict:
    """{index of a walked kernel: HLO op name of its schedule}, matched by
    the kernels' array operands (a pallas_call's HLO name is not its
    program order). Of several ops with the same operands, the one with a
    grid loop is the kernel."""
    matched = {}
    for i, cost in enumerate(costs):
        want = data_shapes(cost.operand_shapes)
        candidates = [op for op, s in schedules.items() if op not in matched.values()
                      and data_shapes(s.operand_shapes) == want]
        candidates.sort(key=lambda op: schedules[op].grid_loop is None)
        if not candidates:
            raise RuntimeError(f"no compiled op has the operands of kernel {cost.name} {want}")
        matched[i] = candidates[0]
    return matched


def program_seconds(costs: list, schedules: dict, generation: str, child_runs=None, profiles=None,
                    group_sizes=None) -> dict:
    """A whole compiled program: each walked Pallas kernel through the
    pipeline model, every other op as `around_seconds` counts it (XLA's
    ragged dots over `group_sizes`).
    child_runs(cost, schedule) -> a kernel's `Schedule.step_cycles` child_runs;
    profiles: each kernel's KernelProfile, in the order of `costs`."""
    matched = match_kernels(costs, schedules)
    parts = [kernel_seconds(cost, schedules[matched[i]], generation,
                            child_runs(cost, schedules[matched[i]]) if child_runs else None,
                            profiles[i] if profiles else None)
             for i, cost in enumerate(costs)]
    around = around_seconds({op: s for op, s in schedules.items() if op not in matched.values()}, generation,
                            group_sizes)
    kernels = sum(p["modeled"] for p in parts)
    return {
        "modeled": kernels + around,
        "kernels": kernels,
        "around": around,
        "compute": sum(p["compute"] for p in parts),
        "dma": sum(p["dma"] for p in parts),
        "fill_drain": sum(p["fill_drain"] for p in parts),
        "regions_mapped": all(p["regions_mapped"] for p in parts),
        "kernel_ops": [matched[i] for i in range(len(costs))],
    }


def ragged_trips(schedule, group_sizes) -> int | None:
    """Trips of an XLA ragged dot's loop over the given groups (`tpu_schedule.RaggedLoop`), or None
    for another op, or where no sizes are given or they are not this loop's."""
    if schedule.ragged_loop is None or group_sizes is None:
        return None
    return schedule.ragged_loop.trips(group_sizes)


def around_seconds(other_ops: dict, generation: str, group_sizes=None) -> float:
    """XLA's ops around the kernel (routing metadata, sorts, gathers,
    padding), each run once: its scheduled cycles, or its HBM traffic at
    what HBM delivers (`copy_bytes_per_s`) when that takes longer (the cycles do not show DMA
    waits). The traffic is what its DMAs move where the schedule fixes
    their sizes and counts, else its HBM operands once each. XLA's own
    ragged dots over `group_sizes` run their loop's trips (`ragged_trips`),
    each trip's cycles and DMAs; other loops with a trip count known only
    at run time are counted once (a lower bound)."""
    gen = GENERATIONS[generation]
    # An op that issues matmuls keeps the MXU-calibrated clock (no FLOPs are walked for XLA's ops).
    clock = lambda s: gen.clock_hz if s.matmuls else issue_clock_hz(generation)

    def seconds(s):
        trips = ragged_trips(s, group_sizes)
        if trips is not None:  # total_cycles holds one trip
            cycles = s.total_cycles + (trips - 1) * s.ragged_loop.iteration_cycles
            traffic = trips * s.ragged_loop.iteration_hbm_bytes
        else:
            cycles = s.total_cycles
            traffic = s.hbm_operand_bytes if s.hbm_dma_bytes is None else s.hbm_dma_bytes
        return max(cycles / clock(s), traffic / copy_bytes_per_s(generation))

    return sum(seconds(s) for s in other_ops.values())
