"""Block sizes for the flash attention kernels.

A first rule, to be replaced by a table tuned with the bench model: about
512 query rows (block_q tokens times the G query heads of a KV head) per
block, 512 keys per block, never more than the (padded) sequence needs.
"""

from __future__ import annotations

from ._shared.tuning import round_up
from .kernel import BlockSizes

TARGET_ROWS = 512
BLOCK_K = 512
Q_ALIGN = 16  # bf16 packs 16 rows per sublane tile
K_ALIGN = 128  # keys are the scores' lanes


def choose_blocks(num_q: int, num_k: int, head_dim: int, value_dim: int, groups: int, itemsize: int,
                  generation: str) -> BlockSizes:
    block_q = max(Q_ALIGN, TARGET_ROWS // groups // Q_ALIGN * Q_ALIGN)
    block_q = min(block_q, round_up(max(num_q, 1), Q_ALIGN))
    block_k = min(BLOCK_K, round_up(max(num_k, 1), K_ALIGN))
    return BlockSizes(block_q=block_q, block_k=block_k)
