"""Block sizes for the grouped matmul, per TPU generation.

`TUNED` holds entries chosen for specific shapes, keyed by
(rows, K, N, groups); everything else gets `rule_blocks`, which keeps
blocks inside the generation's scoped VMEM and always compiles (checked by
tests/test_ragged_dot_compile.py on every generation).
"""

from __future__ import annotations

from ._shared.generations import GENERATIONS
from ._shared.tuning import largest_divisor_block, lookup, round_up
from .kernel import BlockSizes

# Largest blocks the rule uses: (block_m, block_k, block_n). 256-wide MXUs
# (v6e, tpu7x) get wider k and n blocks; all fit the default scoped VMEM.
MAX_BLOCKS = {
    "v5e": (512, 512, 512),
    "v5p": (512, 512, 512),
    "v6e": (512, 1024, 1024),
    "tpu7x": (512, 1024, 1024),
}

# (rows, K, N, groups) -> BlockSizes, per generation. Empty until tuned
# with `make bench` (issue 3).
TUNED: dict[str, dict[tuple, BlockSizes]] = {name: {} for name in GENERATIONS}

MIN_BLOCK_M = 16  # bf16 packs 16 rows per sublane tile


def rule_blocks(rows: int, k: int, n: int, groups: int, generation: str) -> BlockSizes:
    """Blocks for any shape: block_m tracks the expected rows per group, so a
    decode step (a few rows per expert) does not pay for a 512-row tile per
    expert, while prefill gets full tiles."""
    max_m, max_k, max_n = MAX_BLOCKS[generation]
    rows_per_group = max(1, -(-rows // groups))
    block_m = MIN_BLOCK_M
    while block_m < min(rows_per_group, max_m):
        block_m *= 2
    block_m = min(block_m, max_m, round_up(max(rows, 1), MIN_BLOCK_M))
    return BlockSizes(
        block_m=block_m,
        block_k=largest_divisor_block(k, max_k),
        block_n=largest_divisor_block(n, max_n),
    )


def choose_blocks(rows: int, k: int, n: int, groups: int, generation: str) -> BlockSizes:
    return lookup(
        TUNED, generation, (rows, k, n, groups),
        lambda: rule_blocks(rows, k, n, groups, generation),
    )
