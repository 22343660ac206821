"""Block sizes for the flash attention kernels.

A first rule, to be replaced by a table tuned with the bench model: about
512 query rows (block_q tokens times the G query heads of a KV head) per
block, 512 keys per block, never more than the (padded) sequence needs, and
blocks grown until the grid's step list fits its SMEM budget.
"""

from __future__ import annotations

import math

from ._shared.tuning import round_up
from .kernel import LANES, BlockSizes

TARGET_ROWS = 512
BLOCK_K = 512
MAX_BLOCK_K = 2048
Q_ALIGN = 16  # bf16 packs 16 rows per sublane tile
K_ALIGN = 128  # keys are the scores' lanes
# The kernels get one int32 per (query block, key block) pair through scalar prefetch (ops.Steps);
# SMEM holds 1 MiB: a quarter of it at most.
MAX_STEPS = 65536


def query_align(groups: int) -> int:
    """Query tokens per block are a multiple of this: of 16 (bf16 packs 16 rows per sublane
    tile), and such that the block's rows (tokens times G) fill whole lanes: the kernels keep
    per-row values with the rows on lanes."""
    return math.lcm(Q_ALIGN, LANES // math.gcd(groups, LANES))


def check_blocks(blocks: BlockSizes, groups: int) -> None:
    """Raises ValueError for block sizes Mosaic cannot compile."""
    if blocks.block_q % query_align(groups) or blocks.block_k % K_ALIGN:
        raise ValueError(f"{blocks} does not compile on a TPU with {groups} query heads per KV head: block_q must be "
                         f"a multiple of {query_align(groups)}, block_k of {K_ALIGN}")


def choose_blocks(num_q: int, num_k: int, head_dim: int, value_dim: int, groups: int, itemsize: int,
                  generation: str) -> BlockSizes:
    align = query_align(groups)
    q_cap, k_cap = round_up(max(num_q, 1), align), round_up(max(num_k, 1), K_ALIGN)
    block_q = min(max(align, TARGET_ROWS // groups // align * align), q_cap)
    block_k = min(BLOCK_K, k_cap)
    steps = lambda: -(-num_q // block_q) * -(-num_k // block_k)
    while steps() > MAX_STEPS and block_k < min(MAX_BLOCK_K, k_cap):
        block_k *= 2
    while steps() > MAX_STEPS:
        block_q *= 2
    return BlockSizes(block_q=block_q, block_k=block_k)
