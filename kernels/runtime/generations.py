"""TPU generations: the one table of hardware facts the kernels, tests and bench use.

Figures are per JAX device (what one kernel runs on). On tpu7x a JAX device
is one of the chip's two TensorCores, so it gets half the chip's FLOP/s and
bandwidth; on v5p a JAX device is a megacore (two cores, used by grid
dimensions marked "parallel").
"""

from __future__ import annotations

import dataclasses

MiB = 1 << 20

# Fixed cost of one Pallas grid step (pipeline bookkeeping, DMA issue), the
# figure our performance model uses for every generation.
STEP_OVERHEAD_S = 0.35e-6


@dataclasses.dataclass(frozen=True)
class Generation:
    name: str
    topology: str  # smallest topology libtpu accepts for an AOT compile
    device_kind_prefixes: tuple[str, ...]  # what jax's device_kind starts with
    bf16_flops: float  # per JAX device, FLOP/s
    hbm_bytes_per_s: float  # per JAX device
    vmem_bytes: int  # per core
    scoped_vmem_default: int  # Mosaic's default scoped-VMEM limit
    mxu_width: int  # 128 or 256: matmul dims are padded to this
    cores_per_device: int  # TensorCores a "parallel" grid axis is split over
    # Bundles of a compiled schedule one TensorCore issues per second, an
    # effective clock. No TPU clock figures are public, and libtpu's bundles
    # do not show every MXU stall, so this is calibrated: the rate at which
    # libtpu's own schedule of a dense bf16 matmul's accumulate steps
    # reaches the published bf16 peak per core (`python bench/calibration.py
    # clock` derives it; tests/test_schedule_model.py checks it).
    clock_hz: float


GENERATIONS: dict[str, Generation] = {
    g.name: g
    for g in (
        Generation("v5e", "v5e:2x2", ("TPU v5 lite", "TPU v5e"), 197e12, 819e9, 128 * MiB, 16 * MiB, 128, 1, 1.413e9),
        Generation("v5p", "v5p:2x2x1", ("TPU v5p", "TPU v5"), 459e12, 2765e9, 64 * MiB, 16 * MiB, 128, 2, 1.647e9),
        Generation("v6e", "v6e:2x2", ("TPU v6 lite", "TPU v6e"), 918e12, 1640e9, 128 * MiB, 32 * MiB, 256, 1, 1.712e9),
        Generation("tpu7x", "tpu7x:2x2x1", ("TPU7x", "TPU 7x", "TPU v7"), 2307e12 / 2, 7380e9 / 2, 64 * MiB, 32 * MiB, 256, 1,
                   1.029e9),
    )
}

# Tables are keyed by generation; interpret mode on a CPU uses this one's.
DEFAULT_GENERATION = "v6e"


def modeled_time(gen: Generation, flops: float, hbm_bytes: float, grid_steps: int, parallel_tiles: int) -> dict:
    """The performance model (seconds): max(MXU time, HBM time) plus a fixed
    cost per grid step. A "parallel" grid axis shorter than the device's core
    count leaves cores idle (v5p megacore)."""
    cores = min(gen.cores_per_device, parallel_tiles)
    mxu = flops / (gen.bf16_flops * cores / gen.cores_per_device)
    hbm = hbm_bytes / gen.hbm_bytes_per_s
    steps = grid_steps / cores * STEP_OVERHEAD_S
    return {"mxu": mxu, "hbm": hbm, "steps": steps, "total": max(mxu, hbm) + steps}


def generation_of_device_kind(device_kind: str) -> Generation:
    """Maps jax's `device.device_kind` to a generation; unknown TPUs are an error."""
    for gen in GENERATIONS.values():
        if any(device_kind.startswith(p) for p in gen.device_kind_prefixes):
            return gen
    raise ValueError(
        f"unknown TPU device kind {device_kind!r}; known: "
        + ", ".join(p for g in GENERATIONS.values() for p in g.device_kind_prefixes)
    )


def current_generation() -> Generation:
    """The generation of jax's default device, or the default table off-TPU."""
    import jax

    device = jax.devices()[0]
    if device.platform != "tpu":
        return GENERATIONS[DEFAULT_GENERATION]
    return generation_of_device_kind(device.device_kind)
