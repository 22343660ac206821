"""Block sizes for the flash attention kernels.

A first rule, to be replaced by a table tuned with the bench model: about
512 query rows (block_q tokens times the G query heads of a KV head) per
block, 512 keys per block, never more than the (padded) sequence needs, and
blocks grown until the grid's step list fits its SMEM budget.
"""

from __future__ import annotations

from ._shared.tuning import round_up
from .kernel import BlockSizes

TARGET_ROWS = 512
BLOCK_K = 512
MAX_BLOCK_K = 2048
Q_ALIGN = 16  # bf16 packs 16 rows per sublane tile
K_ALIGN = 128  # keys are the scores' lanes
# The kernels get one int32 per (query block, key block) pair through scalar prefetch (ops.Steps);
# SMEM holds 1 MiB: a quarter of it at most.
MAX_STEPS = 65536


def choose_blocks(num_q: int, num_k: int, head_dim: int, value_dim: int, groups: int, itemsize: int,
                  generation: str) -> BlockSizes:
    q_cap, k_cap = round_up(max(num_q, 1), Q_ALIGN), round_up(max(num_k, 1), K_ALIGN)
    block_q = min(max(Q_ALIGN, TARGET_ROWS // groups // Q_ALIGN * Q_ALIGN), q_cap)
    block_k = min(BLOCK_K, k_cap)
    steps = lambda: -(-num_q // block_q) * -(-num_k // block_k)
    while steps() > MAX_STEPS and block_k < min(MAX_BLOCK_K, k_cap):
        block_k *= 2
    while steps() > MAX_STEPS:
        block_q *= 2
    return BlockSizes(block_q=block_q, block_k=block_k)
