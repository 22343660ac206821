"""TPU generations: the one table of hardware facts the kernels, tests and bench use.

Figures are per JAX device (what one kernel runs on). On tpu7x a JAX device
is one of the chip's two TensorCores, so it gets half the chip's FLOP/s and
bandwidth; on v5p a JAX device is a megacore (two cores, used by grid
dimensions marked "parallel").
"""

from __future__ import annotations

import dataclasses

import numpy as np

MiB = 1 << 20


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

# SMEM per core, where scalar-prefetch arrays live: 1 MiB on v5e, v5p, v6e and tpu7x alike, as
# libtpu's out-of-SMEM compile error reports it ("Used 1.13M of 1.00M smem").
SMEM_BYTES = 1 * MiB

# Tables are keyed by generation; interpret mode on a CPU uses this one's.
DEFAULT_GENERATION = "v6e"


# A DMA's cost beyond its bytes at full bandwidth (issue to completion).
# Pallas's TPU guide puts the fixed cost of a grid step near 0.35 us; the
# step's own bookkeeping cycles are in its compiled schedule, this is the rest.
DMA_LATENCY_S = 0.3e-6

# What HBM delivers to copies, as a share of each generation's published bandwidth, and a copy's
# latency (issue to arrival, beyond its bytes): the fit to two measured DMA rings of 2 MiB copies on
# one tpu7x core (the repo's bench/calibration.py `stream_fit`, bench/results/calibration.md). The
# share is taken for every generation (no generation's copies reach the published figure; a
# streamed copy measured on tpu7x elsewhere reached a similar share). The latency is measured for
# 2 MiB copies on tpu7x only, and is no flat cost: tokamax's splash backward on tpu7x, whose steps
# each wait on copies of a few hundred KiB, was measured at about a microsecond per step, less
# than that latency alone; and on v5e the JAX guide's dense matmul runs steps of 32 KiB copies in
# about 0.35 us all told. So on tpu7x a copy's latency grows with its bytes up to the measured
# copy's (linearly, an interpolation), never below `DMA_LATENCY_S`, which the other generations
# keep for every copy; larger copies take the measured latency.
HBM_SHARE = 0.89
COPY_LATENCY_S = {"tpu7x": (1.13e-6, 2 << 20)}  # (latency, at copies of this many bytes)


def copy_bytes_per_s(generation: str) -> float:
    return GENERATIONS[generation].hbm_bytes_per_s * HBM_SHARE


def copy_latency_s(generation: str):
    """A copy's latency on the generation as a function of its bytes (scalar or array)."""
    if generation not in COPY_LATENCY_S:
        return lambda size: np.full(np.shape(size), DMA_LATENCY_S)[()]
    measured, at = COPY_LATENCY_S[generation]
    return lambda size: np.clip(measured * np.asarray(size, np.float64) / at, DMA_LATENCY_S, measured)[()]


def pipeline_seconds(compute_s, fetch_bytes, write_bytes, bytes_per_s: float, latency_s=DMA_LATENCY_S,
                     repeats: int = 1, largest=None) -> float:
    """Pallas's double-buffered pipeline over one core's grid steps, in order:
    while step i computes, step i+1's inputs arrive and step i-1's output
    leaves, so time = fetch(0) + sum_i max(compute(i), dma(fetch(i+1) +
    write(i-1))) + write(last), a DMA of b bytes taking b / bytes_per_s plus
    its latency (`latency_s`: seconds, or a function of the bytes of the
    largest copy among them, which run together: `largest`, per step, the
    largest fetched and written block; the whole DMA's bytes without it).
    `repeats`: the steps run that many times back to back (a grid's outer
    tiles), each boundary overlapping like any other."""
    compute_s = np.asarray(compute_s, np.float64)
    if compute_s.size == 0:
        return 0.0
    fetch, write = np.asarray(fetch_bytes, np.float64), np.asarray(write_bytes, np.float64)
    big_fetch, big_write = (fetch, write) if largest is None else (np.asarray(x, np.float64) for x in largest)
    if compute_s.size == 1 and repeats > 1:  # every step is both the first and the last of its repeat
        compute_s, fetch, write, big_fetch, big_write = (np.tile(x, repeats)
                                                         for x in (compute_s, fetch, write, big_fetch, big_write))
        repeats = 1
    latency = latency_s if callable(latency_s) else lambda b: latency_s
    dma = lambda b, big: np.where(b > 0, b / bytes_per_s + latency(big), 0.0)
    overlapped, big = np.zeros_like(compute_s), np.zeros_like(compute_s)
    overlapped[:-1] += fetch[1:]
    overlapped[1:] += write[:-1]
    big[:-1] = big_fetch[1:]
    big[1:] = np.maximum(big[1:], big_write[:-1])
    steps = np.maximum(compute_s, dma(overlapped, big))
    total = repeats * steps.sum()
    if repeats > 1:  # later repeats' first steps overlap the previous write; earlier ones' last steps the next fetch
        first = np.maximum(compute_s[0], dma(overlapped[0] + write[-1], max(big[0], big_write[-1])))
        last = np.maximum(compute_s[-1], dma(overlapped[-1] + fetch[0], max(big[-1], big_fetch[0])))
        total += (repeats - 1) * (first - steps[0] + last - steps[-1])
    return float(dma(fetch[:1], big_fetch[:1])[0] + total + dma(write[-1:], big_write[-1:])[0])


def generation_of_device_kind(device_kind: str) -> Generation:
    """Maps jax's `device.device_kind` to a generation; unknown TPUs are an error."""
    for gen in GENERATIONS.values():
        if any(device_kind.startswith(p) for p in gen.device_kind_prefixes):
            return gen
    raise ValueError(
        f"unknown TPU device kind {device_kind!r}; known: "
        + ", ".join(p for g in GENERATIONS.values() for p in g.device_kind_prefixes)
    )


def default_interpret() -> bool:
    """Pallas runs compiled on a TPU and in interpret mode anywhere else."""
    import jax

    return jax.devices()[0].platform != "tpu"


def current_generation() -> Generation:
    """The generation of jax's default device, or the default table off-TPU."""
    import jax

    device = jax.devices()[0]
    if device.platform != "tpu":
        return GENERATIONS[DEFAULT_GENERATION]
    return generation_of_device_kind(device.device_kind)
