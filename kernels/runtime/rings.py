"""A ring of VMEM slots that a Pallas kernel fills itself from HBM: several copies in flight, so
that each copy's latency overlaps the copies before it (Pallas's own pipeline keeps one in flight
and waits out each one's latency)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def consecutive_blocks(hbm, slots, sems):
    """The slot holding grid step i's block of `hbm`: block i of its first dim, in blocks of as many
    rows as a slot holds, copied through the ring `slots` [depth, rows, ...] (`sems`: a DMA
    semaphore per slot). The first step starts the first depth - 1 copies; each step waits for its
    own and starts the one depth - 1 ahead, into the slot the previous step (done) read. The grid's
    first axis must run its steps in order on one core ("arbitrary")."""
    depth, rows = slots.shape[:2]
    step, steps = pl.program_id(0), pl.num_programs(0)

    def copy(c):
        return pltpu.make_async_copy(hbm.at[pl.ds(c * rows, rows)], slots.at[c % depth], sems.at[c % depth])

    for first in range(depth - 1):
        @pl.when(jnp.logical_and(step == 0, first < steps))
        def _():
            copy(first).start()

    copy(step).wait()

    @pl.when(step + depth - 1 < steps)
    def _():
        copy(step + depth - 1).start()

    return slots.at[step % depth]
