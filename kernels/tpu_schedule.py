"""Reads a compiled kernel's own schedule: libtpu's final VLIW bundles.

libtpu writes, for every op it compiles, the final bundles in a text file
(`*-final_bundles.txt` in the `--xla_jf_dump_to` folder). One bundle issues
per cycle and the scheduler has placed the latencies it knows as empty
slots, so counting the bundles a run executes gives its issue cycles. Not
in them: DMA waits (the pipeline model adds those) and stalls the schedule
does not show (on v5e a dense matmul issues about 4% fewer bundles than its
MXU busy cycles; the calibrated clock in the generation table absorbs that).

The format, as libtpu 0.0.52 prints it:

    0x41 LB: > { %a = sadd.s32 1, %b ;; ... } /* Start region 114 */
    0xc6   : > { %7 = sbr.rel (%p10) target = $region28 }
    0x9a8 PF: > { ... } /* Start/End empty region 28 */

- `>` repeated: the loop depth; `LB` marks a loop body's first bundle.
- `sbr.rel ... target = $regionN` branches to the bundle where region N
  starts, after BRANCH_DELAY_SLOTS more bundles (which always run). A
  backward branch closes a loop; a forward one skips a predicated region
  (a `pl.when` body, or the pipeline's compute stage).
- A static loop's trip count is the immediate of its `loop exit test`
  compare. A loop whose back branch tests a register is counted where the
  registers it compares follow from constants and the op's addresses: an
  induction stepped by a constant against a bound at a constant offset from
  its start (XLA's copy and scatter loops walk a buffer's address so),
  `_RegisterLoops`. A bound read at run time (a dynamic grid, a loop over
  data) leaves it uncounted.
- XLA's own ragged dot (`jax.lax.ragged_dot`) is one loop over a flattened
  (row tile, group, column tile...) space whose index jumps past the pairs
  of a row tile and a group that share no row: its back branch compares the
  index with the space's size plus the pipeline's stages, untagged. It runs
  one trip per pair that shares rows (times the other dims), so its count
  depends on the group sizes (`RaggedLoop.trips`).

For a Pallas kernel the outermost loop is the grid loop: Mosaic flattens
the grid into it and software-pipelines it, so it runs grid steps + 2
iterations; the first only starts the first fetch and the last only waits
for the last write-back, both skipping the compute stage (the largest
forward region in the loop). The kernel body's `pl.when` regions are the
forward regions directly inside the compute stage, in program order.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

BRANCH_DELAY_SLOTS = 4  # bundles after a branch that run before it jumps (read from the dumps)

_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(?:(LB|LH|LE|PB|PF|CT):|\s*:)\s*(>*)\s*\{")
_BRANCH = re.compile(r"sbr\.rel\s*(?:\([^)]*\))?\s*target = \$region(\d+)")
_REGION_START = re.compile(r"(?:Start region|Start/End empty region) (\d+)\b")
_EXIT_TEST = re.compile(r"scmp\.\w+\.s32\.totalorder %\w+, (\d+) /\* loop exit test")
_RAGGED_BOUND = re.compile(r"scmp\.ge\.s32\.totalorder %\w+, (\d+) \} /\* End region")
_CLAMP = re.compile(r"smov\.u32 \([!%\w]+, %\w+\), (\d+)\b")
_OPCODE = re.compile(r"(?:=|\{|;;)\s+([a-z][\w.]*)")
# A DMA to or from HBM: its size in 32-byte granules (an immediate), or its
# window in the comment that follows it when the size is a register.
_DMA = re.compile(r"dma\.(\w+)_to_(\w+)\b[^;{}]*?size_in_granules=\*/([^,]+),(?:[^;{}]*?window_bounds: \(([\d, ]+)\)"
                  r"[^;{}]*?element_size_in_bytes: (\d+))?", re.S)
_GENERAL_DMA = re.compile(r"\bdma\.general\b")
# libtpu's run-time check of a DMA's addresses (a halt when out of bounds), unless Mosaic's
# `disable_bounds_checks` is set.
_BOUNDS_CHECK = re.compile(r"shalt\.err\b[^;{}]*?/\* BoundsCheck")
DMA_GRANULE_BYTES = 32
_OPERAND = re.compile(r"inlined_call_operand\.([^\s\[]+(?: memory space>)?) \[shape: (\w+)\[([\d,]*)\]")


@dataclasses.dataclass
class Bundle:
    address: int
    marker: str | None
    depth: int
    text: str

    def count(self, opcode_prefix: str) -> int:
        return sum(op.startswith(opcode_prefix) for op in _OPCODE.findall(self.text))

    def hbm_dma_bytes(self) -> tuple[int, int]:
        """(bytes its DMAs move to or from HBM, both ways for HBM to HBM;
        how many of its HBM DMAs have a size known only at run time)."""
        total = 0
        unknown = len(_GENERAL_DMA.findall(self.text))  # memory spaces and size in registers
        for src, dst, granules, window, element in _DMA.findall(self.text):
            if "hbm" not in (src, dst):
                continue
            if granules.strip().isdigit():
                size = int(granules) * DMA_GRANULE_BYTES
            elif window:
                size = int(np.prod([int(d) for d in window.split(",")])) * int(element)
            else:
                unknown += 1
                continue
            total += size * ((src == "hbm") + (dst == "hbm"))
        return total, unknown


_CUSTOM_CALL = re.compile(r"entry bundle: %[\w.-]+ = custom-call\(")
_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_DEFINITION = re.compile(r"^%(\w+) = ([a-z][\w.]*)\s*(.*)$", re.S)
_GUARD = re.compile(r"^\((!?%\w+)\),\s*")  # a predicated instruction's predicate
_SELECT = re.compile(r"^\((!?%\w+), (%\w+)\),\s*(\S+)$")  # `smov (p, %old), new`: p ? new : old
_BRANCH_PREDICATE = re.compile(r"sbr\.rel\s*\((!?)%(\w+)\)")
_SMEM_SLOT = re.compile(r"^\[smem:\[(#allocation\d+(?: \+ \$0x[0-9a-f]+)?)\]\]\s*(\S*)$")
_TRIP_LIMIT = 1 << 24
_COMPARE = {"lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b,
            "ge": lambda a, b: a >= b, "eq": lambda a, b: a == b, "ne": lambda a, b: a != b}
_ARITHMETIC = {"sshll.u32": lambda a, b: a << b, "sshra.s32": lambda a, b: a >> b,
               "sshrl.u32": lambda a, b: (a & 0xFFFFFFFF) >> b, "sand.u32": lambda a, b: a & b,
               "smul.u32": lambda a, b: a * b, "smul.s32": lambda a, b: a * b}


def _immediate(text: str) -> int | None:
    """A decimal immediate as a signed 32-bit value, or None."""
    if not re.fullmatch(r"-?\d+", text):
        return None
    value = int(text) & 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


class _RegisterLoops:
    """Trip counts of loops whose back branch tests a register, where that test compares an
    induction stepped by a constant (`sphi` of a start and the induction plus a constant) with a
    bound at a known offset from the same base.

    A scalar's value is (base, offset): base None for a constant, else an operand's or an
    allocation's address or a loop's induction. Constants propagate through moves, selects whose
    predicate is known, adds, shifts and compares; a predicated instruction is read as if it runs
    (it does on the path into the loop that uses it); an SMEM slot reads the first value stored to
    it (XLA keeps a loop's counter there, and the loops read so run inside a first trip). A value
    loaded from data, or anything else, is unknown (None), and so is the count of a loop it bounds.
    """

    def __init__(self, bundles: list[Bundle]):
        self.definitions = {}  # register -> (address, opcode, operands)
        self.stored = {}  # SMEM slot -> the register first stored to it
        for b in bundles:
            text = _COMMENT.sub("", b.text)
            for instruction in text[text.find("{") + 1:text.rfind("}")].split(";;"):
                match = _DEFINITION.match(instruction.strip())
                if not match:
                    continue
                register, opcode, args = match.group(1), match.group(2), match.group(3).strip()
                self.definitions[register] = (b.address, opcode, args)
                slot = _SMEM_SLOT.match(_GUARD.sub("", args))
                if opcode == "sst" and slot:
                    self.stored.setdefault(slot.group(1), slot.group(2))
        self.exits = {}  # an induction of a counted loop -> its value in the loop's last trip
        self.counted = []  # (start, end) of each loop counted
        self.skipped = []  # (start, end) of code a forward branch known to be taken skips
        self.heads = {b.address for b in bundles if b.marker == "LB"}

    def value(self, operand: str, inductions: dict, depth: int = 0):
        if (constant := _immediate(operand)) is not None:
            return None, constant
        if (allocation := re.fullmatch(r"\[(#allocation\d+)\]", operand)) is not None:
            return allocation.group(1), 0
        negated = operand.startswith("!")
        register = operand.lstrip("!")[1:]
        if not operand.lstrip("!").startswith("%") or depth > 64:
            return None
        if register in inductions:
            return inductions[register]
        if register in self.exits:
            return self.exits[register]
        if register not in self.definitions:
            return None
        _, opcode, args = self.definitions[register]
        evaluate = lambda x: self.value(x, inductions, depth + 1)
        if negated:  # a predicate's complement
            known = evaluate(operand[1:])
            return None if known is None or known[0] is not None else (None, int(not known[1]))
        if opcode.startswith("inlined_call_operand"):
            return register, 0
        if opcode == "sphi" and self.definitions[register][0] not in self.heads:
            # Where paths join after a loop that was counted (so it ran): the value from inside it.
            inside = [x for x in (a.strip() for a in args.split(",")) if x[1:] in self.definitions and any(
                start <= self.definitions[x[1:]][0] < end for start, end in self.counted)]
            return evaluate(inside[0]) if len(inside) == 1 else None
        if opcode == "smov.u32" and (select := _SELECT.match(args)):
            predicate = evaluate(select.group(1))
            if predicate is None or predicate[0] is not None:
                return None
            return evaluate(select.group(3) if predicate[1] else select.group(2))
        parts = [a.strip() for a in _GUARD.sub("", args).split(",")]
        if opcode in ("smov.u32", "pmov") and len(parts) == 1:
            return evaluate(parts[0])
        if opcode == "sld" and (slot := _SMEM_SLOT.match(parts[0])) and slot.group(1) in self.stored:
            return evaluate(self.stored[slot.group(1)])
        if len(parts) != 2:
            return None
        a, b = (evaluate(x) for x in parts)
        if a is None or b is None:
            return None
        if opcode.startswith(("scalar_lea", "sadd.s32")):
            if a[0] is not None and b[0] is not None:
                return None
            return a[0] if a[0] is not None else b[0], a[1] + b[1]
        if opcode == "ssub.s32":
            if b[0] is None:
                return a[0], a[1] - b[1]
            return (None, a[1] - b[1]) if a[0] == b[0] else None
        if (compare := re.fullmatch(r"scmp\.(\w+)\.[su]32(?:\.totalorder)?", opcode)) and a[0] == b[0] \
                and compare.group(1) in _COMPARE:
            return None, int(_COMPARE[compare.group(1)](a[1], b[1]))
        if opcode in _ARITHMETIC and a[0] is None and b[0] is None:
            return None, _immediate(str(_ARITHMETIC[opcode](a[1], b[1]) & 0xFFFFFFFF))
        return None

    def taken(self, branch: str) -> bool | None:
        """Whether the branch (its text) is taken, where its predicate is known."""
        match = _BRANCH_PREDICATE.search(_COMMENT.sub("", branch))
        known = None if match is None else self.value(f"%{match.group(2)}", {})
        if known is None or known[0] is not None:
            return None
        return bool(known[1]) != (match.group(1) == "!")

    def branch_forward(self, branch: str, address: int, target: int) -> None:
        if self.taken(branch):
            self.skipped.append((address, target))

    def trips(self, branch: str, start: int, end: int) -> int | None:
        """The trips of the loop [start, end) closed by `branch` (its back branch's text), or None;
        a counted loop's inductions' last values are kept for the loops after it."""
        match = _BRANCH_PREDICATE.search(_COMMENT.sub("", branch))
        if match is None or match.group(2) not in self.definitions:
            return None
        negated = match.group(1) == "!"
        _, opcode, args = self.definitions[match.group(2)]
        # A loop that a taken branch skips never runs: its bundles are counted once, a few cycles over.
        # A back branch never taken closes a loop of one trip.
        if any(a < start and end <= b for a, b in self.skipped) or self.taken(branch) is False:
            self.counted.append((start, end))
            return 1
        compare = re.fullmatch(r"scmp\.(\w+)\.[su]32(?:\.totalorder)?", opcode)
        if compare is None or compare.group(1) not in _COMPARE:
            return None
        phis = {r: [a.strip() for a in args.split(",")] for r, (address, op, args) in self.definitions.items()
                if op == "sphi" and start <= address < end}
        inductions = {r: (("induction", r), 0) for r in phis}
        steps, starts = {}, {}
        for r, (first, following) in phis.items():
            after = self.value(following, inductions)
            initial = self.value(first, {})
            if after is not None and after[0] == ("induction", r) and after[1] != 0 and initial is not None:
                steps[r], starts[r] = after[1], initial
        lhs, rhs = (self.value(x.strip(), inductions) for x in _GUARD.sub("", args).split(","))
        if lhs is None or rhs is None:
            return None
        varying = [v for v in (lhs, rhs) if isinstance(v[0], tuple)]
        if len(varying) != 1 or varying[0][0][1] not in steps:
            return None
        induction = varying[0][0][1]
        base, offset = starts[induction]
        bound = rhs if varying[0] is lhs else lhs
        if bound[0] != base:  # the bound must sit at a known distance from the start
            return None
        step = steps[induction]

        def continues(k: int) -> bool:  # whether trip k (from 0) branches back
            at = offset + k * step + varying[0][1]
            a, b = (at, bound[1]) if varying[0] is lhs else (bound[1], at)
            return _COMPARE[compare.group(1)](a, b) != negated

        if not continues(0):
            count = 1
        elif compare.group(1) in ("eq", "ne"):  # the induction meets the bound at most once
            distance = bound[1] - offset - varying[0][1]
            if continues(1):  # it branches back until it meets the bound
                if distance % step or distance // step < 0:
                    return None
                count = distance // step + 1
            else:  # it branched back on meeting it, once
                count = 2
        elif continues(_TRIP_LIMIT):
            return None
        else:  # the first trip that does not branch back (an order compare: monotone in k)
            low, high = 0, _TRIP_LIMIT
            while low < high:
                mid = (low + high) // 2
                low, high = (mid + 1, high) if continues(mid) else (low, mid)
            count = low + 1
        for r in steps:
            self.exits[r] = (starts[r][0], starts[r][1] + (count - 1) * steps[r])
        self.counted.append((start, end))
        return count


@dataclasses.dataclass
class Loop:
    start: int  # address of its first bundle
    end: int  # one past its last (the back branch's delay slots included)
    trip_count: int | None  # None: known only at run time


@dataclasses.dataclass
class RaggedLoop:
    """XLA's ragged-dot loop: a trip per (row tile, group) pair sharing rows, times the other dims
    of its space, plus the pipeline's stages."""

    bound: int  # the back branch's immediate: the space's size plus the stages
    rows: int  # the lhs's
    columns: int  # the output's
    tile_rows: int  # rows of the lhs tile a trip multiplies
    iteration_cycles: int  # one trip with every region run
    iteration_hbm_bytes: int  # what one trip's DMAs move to or from HBM (each DMA in the body once)

    def trips(self, group_sizes) -> int | None:
        """Trips with the lhs's rows in groups of `group_sizes`, or None where the space's size is
        not row tiles x groups x a whole number."""
        sizes = [int(x) for x in group_sizes]
        row_tiles = -(-self.rows // self.tile_rows)
        pairs = row_tiles * len(sizes)
        space = (self.bound - 1) // pairs * pairs
        if space == 0 or self.bound - space > 8:  # not this loop's space: the sizes or the tile are not its
            return None
        # Past one trip per column tile, the space also tiles the contraction (XLA does so for weights
        # held [G, N, K] with a long K): measured, such loops run far fewer trips than the space holds
        # (bench/results/calibration.md), in a way not read here.
        if space // pairs > -(-self.columns // 128):
            return None
        ends = np.cumsum(sizes)
        starts = ends - np.asarray(sizes)
        tile_start = np.arange(row_tiles)[:, None] * self.tile_rows
        shared = (np.asarray(sizes) > 0) & (starts < tile_start + self.tile_rows) & (ends > tile_start)
        return int(shared.sum()) * (space // pairs) + self.bound - space


@dataclasses.dataclass
class Region:
    """Bundles a forward branch skips when taken: [start, end)."""

    start: int
    end: int
    cycles: int  # issue cycles when it runs (inner loops times their trip counts)
    matmuls: int  # vmatmul instructions it issues when it runs
    children: tuple[int, ...] = ()  # the cycles of the regions directly inside it (pl.when in pl.when), in order

    def contains(self, other: "Region") -> bool:
        return self.start <= other.start and other.end <= self.end and self != other


@dataclasses.dataclass
class Control:
    """A loop or a forward region in the kernel's compute stage, for a profile of how often each
    runs (bench/kernel_profile.py): its bundles outside the controls nested in it."""

    kind: str  # "loop" or "branch"
    start: int
    end: int
    own_cycles: int  # issue cycles of one run (a loop: of one trip), its nested controls left out

    def holds(self, other: "Control") -> bool:
        """other is nested in this one: it starts inside and ends by this one's end, give or take
        the delay slots (on tpu7x a region's last loop may end a few bundles past the region's
        forward jump)."""
        return self.start <= other.start < self.end and other.end <= self.end + BRANCH_DELAY_SLOTS


@dataclasses.dataclass
class Schedule:
    """A compiled op's schedule, reduced to what the pipeline model needs."""

    bundles: int  # static count
    total_cycles: int  # the whole program: bundles times the trip counts of their loops (dynamic: once)
    grid_loop: Loop | None
    outside_loop_cycles: int  # entry and exit, outside the grid loop
    iteration_cycles: int  # one grid-loop iteration with every region run
    stage: Region | None  # the compute stage (skipped by the fill and drain iterations)
    regions: list[Region]  # the kernel's pl.when bodies, in program order
    matmuls: int  # vmatmul per iteration with every region run
    weight_pushes: int  # vmatpush likewise
    dynamic_inner_loops: int  # inner loops with no static trip count (counted once)
    # What the whole program moves to or from HBM: its DMAs' bytes (loops
    # times their trip counts) when every size and trip count is static,
    # else (None) its HBM operands once each (`hbm_operand_bytes`).
    hbm_dma_bytes: int | None = 0
    hbm_operand_bytes: int = 0
    operand_shapes: tuple[str, ...] = ()  # every operand and result, as "bf16[512,2048]"
    bounds_checks: int = 0  # DMA bounds-check halts in the program (static count)
    # The compute stage's loops and forward regions in program order (outer before inner), and
    # the grid-loop iteration's cycles outside them: with a profile of each one's runs per step,
    # a step's cycles (`profiled_step_cycles`).
    controls: list[Control] = dataclasses.field(default_factory=list)
    uncontrolled_cycles: int = 0
    # The same with the whole program as one step (a grid of one step has no grid loop: the
    # outermost loop found is the kernel's own).
    program_controls: list[Control] = dataclasses.field(default_factory=list)
    program_uncontrolled_cycles: int = 0
    ragged_loop: RaggedLoop | None = None  # XLA's ragged dot: its loop (counted once in total_cycles)

    def profiled_step_cycles(self, runs: np.ndarray, whole_program: bool = False) -> np.ndarray:
        """Issue cycles of each grid step. runs: int [steps, len(controls)], how many times
        each control runs at that step (a loop: its trips, over all runs of what holds it).
        whole_program: of the one step of a grid of one, with `program_controls`."""
        controls = self.program_controls if whole_program else self.controls
        base = self.program_uncontrolled_cycles if whole_program else self.uncontrolled_cycles
        own = np.array([c.own_cycles for c in controls], np.int64)
        return base + np.asarray(runs, np.int64) @ own

    def step_cycles(self, runs: np.ndarray, child_runs: dict | None = None) -> np.ndarray:
        """Issue cycles of each grid step. runs: bool [steps, len(regions)],
        whether each pl.when body runs at that step. child_runs: {region
        index: bool [steps, its children]}, whether each region nested in it
        runs when it does (by default, all of them; the grid walk evaluates
        top-level conditions only)."""
        if not self.regions:
            return np.full(len(runs), self.iteration_cycles)
        runs = np.asarray(runs, bool)
        skipped = (~runs) @ np.array([r.cycles for r in self.regions], np.int64)
        for j, child in (child_runs or {}).items():
            skipped = skipped + runs[:, j] * ((~np.asarray(child, bool)) @ np.array(self.regions[j].children, np.int64))
        return self.iteration_cycles - skipped.reshape(-1)

    @property
    def fill_drain_cycles(self) -> int:
        """The two grid-loop iterations that only fetch or only write back, plus entry and exit."""
        stage = self.stage.cycles if self.stage else 0
        return self.outside_loop_cycles + 2 * (self.iteration_cycles - stage)


def _controls(loops: list[Loop], regions: list[Region], stage: Region | None, over: slice, span, bundles: int):
    """(the loops and forward regions inside `stage`, in program order, outer before inner, each with
    its own cycles; the cycles of the bundles in `over` outside them)."""
    # (A branch around a loop, skipping it when it has no trips, adds nothing of its own: dropped.)
    loop_spans = {(l.start, l.end) for l in loops}
    spans = [("loop", l.start, l.end) for l in loops] + [("branch", r.start, r.end) for r in regions
                                                          if (r.start, r.end) not in loop_spans]
    spans = sorted({x for x in spans if stage is not None and stage.start <= x[1] and x[2] <= stage.end
                    and (x[1], x[2]) != (stage.start, stage.end)}, key=lambda x: (x[1], -x[2]))
    # A branch that spans a loop to within a few bundles at both ends (inside it, around it, or
    # across one of its ends) tests the loop's trips: the loop's own test, or its guard. Its bundles
    # count with the loop or with what holds it.
    near = lambda a, b: abs(a - b) <= 2 * BRANCH_DELAY_SLOTS
    spans = [x for x in spans if x[0] == "loop" or not any(
        y[0] == "loop" and near(x[1], y[1]) and near(x[2], y[2]) for y in spans)]

    def own_cycles(spans):
        controlled = np.zeros(bundles, np.int64)  # the innermost control each bundle is in, + 1
        for i, (_, start, end) in enumerate(spans):  # outer first: an inner span overwrites its bundles
            controlled[span(start, end)] = i + 1
        return np.bincount(controlled[over], minlength=len(spans) + 1)

    # Likewise a branch of a few bundles around a single loop (the guard of a loop whose trip
    # count may be zero): its bundles count with what holds it.
    own = own_cycles(spans)
    inside = lambda outer, x: x is not outer and outer[1] <= x[1] and x[2] <= outer[2]
    spans = [x for i, x in enumerate(spans) if not (
        x[0] == "branch" and own[i + 1] <= BRANCH_DELAY_SLOTS
        and [y[0] for y in spans if inside(x, y) and not any(inside(z, y) and inside(x, z) for z in spans)] == ["loop"])]
    own = own_cycles(spans)
    controls = [Control(kind, start, end, int(own[i + 1])) for i, (kind, start, end) in enumerate(spans)]
    return controls, int(own[0])


def parse_bundles(text: str) -> list[Bundle]:
    bundles = []
    for line in text.splitlines():
        match = _BUNDLE.match(line)
        if match:
            bundles.append(Bundle(int(match.group(1), 0), match.group(2), len(match.group(3)), line))
        elif bundles:  # a comment spilling over lines
            bundles[-1].text += "\n" + line
    return bundles


def operands(entry: Bundle) -> list[tuple[str, str, tuple[int, ...]]]:
    """(memory space, dtype, shape) of the op's operands and results, from its entry bundle."""
    return [(space, dtype, tuple(int(d) for d in filter(None, dims.split(","))))
            for space, dtype, dims in _OPERAND.findall(entry.text)]


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
             "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def read_schedule(text: str) -> Schedule:
    bundles = parse_bundles(text)
    if not bundles:
        raise ValueError("no bundles in the schedule text")
    shapes = tuple(f"{dtype}[{','.join(map(str, shape))}]" for _, dtype, shape in operands(bundles[0]))
    index = {b.address: i for i, b in enumerate(bundles)}
    region_start = {}
    for b in bundles:
        for region in _REGION_START.findall(b.text):
            region_start.setdefault(int(region), b.address)

    loops, forward = [], []
    # XLA's ops' loops bounded by registers are counted where their bounds follow from constants;
    # a Pallas kernel (a custom call) keeps its such loops uncounted: they are profiled per grid step.
    registers = None if _CUSTOM_CALL.search(bundles[0].text) else _RegisterLoops(bundles)
    for i, b in enumerate(bundles):
        match = _BRANCH.search(b.text)
        if not match:
            continue
        target = region_start.get(int(match.group(1)))
        if target is None:  # XLA's own ops sometimes branch to a region with no start marker: not countable
            if registers:  # (but a known-taken one skips to the next fall-through at its depth)
                landing = next((x.address for x in bundles[i + 1:] if x.marker == "PF" and x.depth == b.depth), None)
                if landing is not None:
                    registers.branch_forward(b.text, b.address, landing)
            continue
        after = bundles[min(i + BRANCH_DELAY_SLOTS, len(bundles) - 1)].address + 1
        if target <= b.address:
            # Its own exit test, not an inner loop's: the one at the loop's own depth.
            depth = bundles[index[target]].depth
            exit_test = next((m for j in range(i, index[target] - 1, -1) if bundles[j].depth == depth
                              for m in _EXIT_TEST.findall(bundles[j].text)), None)
            trips = (int(exit_test) if exit_test is not None
                     else registers.trips(b.text, target, after) if registers else None)
            loops.append(Loop(target, after, trips))
        else:
            forward.append((after, target))
            if registers:
                registers.branch_forward(b.text, b.address, target)

    # The grid loop is the outermost: the one no other loop contains.
    outermost = [l for l in loops if not any(o is not l and o.start <= l.start and l.end <= o.end for o in loops)]
    grid_loop = max(outermost, key=lambda l: l.end - l.start) if outermost else None
    inner = [l for l in loops if l is not grid_loop]
    weight = np.ones(len(bundles), np.int64)  # times a bundle runs per grid-loop iteration
    for loop in inner:
        weight[index[loop.start]:index_of(index, bundles, loop.end)] *= loop.trip_count or 1
    every_loop = weight.copy()  # times a bundle runs in the whole program (dynamic loops once)
    if grid_loop is not None:
        every_loop[index[grid_loop.start]:index_of(index, bundles, grid_loop.end)] *= grid_loop.trip_count or 1
    is_matmul = np.array([b.count("vmatmul") for b in bundles], np.int64)
    is_push = np.array([b.count("vmatpush") for b in bundles], np.int64)

    def span(start, end):
        return slice(index_of(index, bundles, start), index_of(index, bundles, end))

    def region(start, end):
        s = span(start, end)
        return Region(start, end, int(weight[s].sum()), int((weight[s] * is_matmul[s]).sum()))

    total = int(every_loop.sum())
    dma = np.array([b.hbm_dma_bytes() for b in bundles], np.int64).reshape(-1, 2)
    static = not dma[:, 1].any() and all(l.trip_count is not None for l in loops)
    hbm_bytes = int((every_loop * dma[:, 0]).sum()) if static else None
    bounds_checks = sum(len(_BOUNDS_CHECK.findall(b.text)) for b in bundles)
    ragged = next((r for r in (_ragged_loop(bundles, span(l.start, l.end), operands(bundles[0]), weight, dma[:, 0])
                               for l in loops if l.trip_count is None) if r), None)
    operand_bytes = sum(int(np.prod(shape)) * _ITEMSIZE.get(dtype, 4)
                        for space, dtype, shape in operands(bundles[0]) if space == "hbm")
    # The controls read with the whole program as one step: for a grid of one step, which has no
    # grid loop (the outermost loop is then the kernel's own).
    program_controls = _controls(loops, [region(a, t) for a, t in forward if a < t],
                                 Region(bundles[0].address, bundles[-1].address + 1, 0, 0),
                                 slice(0, len(bundles)), span, len(bundles))
    if grid_loop is None:
        return Schedule(len(bundles), total, None, total, 0, None, [], int((weight * is_matmul).sum()),
                        int((weight * is_push).sum()), sum(l.trip_count is None for l in inner), hbm_bytes,
                        operand_bytes, shapes, bounds_checks, program_controls=program_controls[0],
                        program_uncontrolled_cycles=program_controls[1], ragged_loop=ragged)
    loop_span = span(grid_loop.start, grid_loop.end)
    in_loop = [region(a, t) for a, t in forward if grid_loop.start <= a and t <= grid_loop.end and a < t]
    stage = max(in_loop, key=lambda r: r.cycles, default=None)
    direct = [r for r in in_loop if stage is not None and stage.contains(r)
              and not any(o.contains(r) for o in in_loop if o is not stage)]
    for r in direct:
        inside = [o for o in in_loop if r.contains(o)]
        r.children = tuple(o.cycles for o in sorted(inside, key=lambda o: o.start)
                           if not any(m.contains(o) for m in inside))
    iteration = int(weight[loop_span].sum())
    controls, uncontrolled = _controls(inner, in_loop, stage, loop_span, span, len(bundles))
    return Schedule(
        bundles=len(bundles),
        total_cycles=total,
        grid_loop=grid_loop,
        outside_loop_cycles=int(weight.sum()) - iteration,
        iteration_cycles=iteration,
        stage=stage,
        regions=sorted(direct, key=lambda r: r.start),
        matmuls=int((weight[loop_span] * is_matmul[loop_span]).sum()),
        weight_pushes=int((weight[loop_span] * is_push[loop_span]).sum()),
        dynamic_inner_loops=sum(l.trip_count is None for l in inner),
        hbm_dma_bytes=hbm_bytes,
        hbm_operand_bytes=operand_bytes,
        operand_shapes=shapes,
        bounds_checks=bounds_checks,
        controls=controls,
        uncontrolled_cycles=uncontrolled,
        program_controls=program_controls[0],
        program_uncontrolled_cycles=program_controls[1],
        ragged_loop=ragged,
    )


def _ragged_loop(bundles: list[Bundle], body: slice, operand_list, weight: np.ndarray,
                 hbm_bytes: np.ndarray) -> RaggedLoop | None:
    """The loop as XLA's ragged dot, if it is one: its back branch's untagged bound, and its row
    tiles: the dim whose index is clamped to its last tile (`smov ..., T - 1` beside compares
    with T - 1 and T), one tile if none is; rows from the lhs [M, K] (the first 2-D operand that
    is not the op's [G, M] mask of each group's rows, which marks the op), columns from the
    output [M, N] (the last)."""
    bounds = [int(x) for b in bundles[body] for x in _RAGGED_BOUND.findall(b.text)]
    matrices = [shape for _, dtype, shape in operand_list if len(shape) == 2 and dtype != "pred"]
    rows = matrices[0][0] if matrices else None
    masked = any(dtype == "pred" and len(shape) == 2 and shape[1] == rows for _, dtype, shape in operand_list)
    if not bounds or not masked:
        return None
    text = "\n".join(b.text for b in bundles)
    compared = lambda op: {int(x) for x in re.findall(rf"scmp\.{op}\.s32\.totalorder %\w+, (\d+)\b", text)}
    clamps = {int(x) for x in _CLAMP.findall(text)}
    last_tiles = [t for t in clamps & compared("lt") if t > 0 and t + 1 in compared("ge") and t + 1 < bounds[-1]]
    if len(last_tiles) > 1:
        return None
    row_tiles = last_tiles[0] + 1 if last_tiles else 1
    per_tile = -(-rows // row_tiles)
    tile_rows = -(-per_tile // 8) * 8  # sublane-aligned
    if -(-rows // tile_rows) != row_tiles:
        return None
    return RaggedLoop(bounds[-1], rows, matrices[-1][1], tile_rows, int(weight[body].sum()),
                      int((weight[body] * hbm_bytes[body]).sum()))


def index_of(index: dict, bundles: list[Bundle], address: int) -> int:
    """The position of the first bundle at or after `address`."""
    if address in index:
        return index[address]
    return next((i for i, b in enumerate(bundles) if b.address >= address), len(bundles))


def to_dict(schedule: Schedule) -> dict:
    """A JSON-ready copy (bench/tune.py caches schedules per tiling)."""
    return dataclasses.asdict(schedule)


def from_dict(data: dict) -> Schedule:
    data = dict(data)
    data["grid_loop"] = Loop(**data["grid_loop"]) if data["grid_loop"] else None
    data["stage"] = Region(**data["stage"]) if data["stage"] else None
    data["regions"] = [Region(**r) for r in data["regions"]]
    data["operand_shapes"] = tuple(data["operand_shapes"])
    data["controls"] = [Control(**c) for c in data.get("controls", [])]
    data["program_controls"] = [Control(**c) for c in data.get("program_controls", [])]
    data["ragged_loop"] = RaggedLoop(**data["ragged_loop"]) if data.get("ragged_loop") else None
    return Schedule(**data)

