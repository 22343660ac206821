"""Block sizes for the grouped matmuls, per TPU generation.

`TUNED` holds entries measured with the bench model for specific shapes,
keyed by (rows, K, N, groups, itemsize); any other shape gets `rule_blocks`, a small
analytic search over blocks that fit the generation's VMEM budget, scored
with the same cost model the bench uses (max of MXU and HBM time, plus a
fixed cost per grid step). Every entry and the rule on odd shapes are
compiled for their generation by tests/test_ragged_dot_tpu.py.
"""

from __future__ import annotations

import functools

from ._shared.generations import GENERATIONS, modeled_time
from ._shared.tuning import lookup, round_up
from .kernel import SUB_M, BlockSizes, vmem_bytes

# (rows, K, N, groups, itemsize) -> BlockSizes, per generation.
TUNED: dict[str, dict[tuple, BlockSizes]] = {name: {} for name in GENERATIONS}
TUNED_WEIGHT_GRAD: dict[str, dict[tuple, BlockSizes]] = {name: {} for name in GENERATIONS}

MIN_BLOCK_M = 16  # bf16 packs 16 rows per sublane tile
MAX_BLOCK_M = 1024


def _dim_blocks(dim: int, quantum: int = 128) -> list[int]:
    """Block sizes worth trying for a dim: Mosaic takes multiples of 128 or
    the whole dim; we try those dividing it, powers of two times 128, and
    the whole dim (a block that does not divide it has a masked edge)."""
    blocks = {b for b in range(quantum, dim + 1, quantum) if dim % b == 0}
    blocks |= {quantum << j for j in range(8) if quantum << j < dim}
    return sorted(blocks | {dim})


def modeled_seconds(rows, k, n, groups, blocks: BlockSizes, generation, itemsize=2) -> float:
    """Expected time of the forward grouped matmul with `blocks`, for rows
    spread evenly over the groups (bench/ counts the real thing)."""
    gen = GENERATIONS[generation]
    bm, bk, bn = blocks.block_m, blocks.block_k, blocks.block_n
    n_tiles, k_steps = -(-n // bn), -(-k // bk)
    active = min(groups, rows)
    visits = -(-rows // bm) + active  # each group boundary adds about one visit
    # Weights stay in VMEM across a group's consecutive visits only when K is
    # one block; otherwise every visit re-reads them.
    weight_reads = 1 if k_steps == 1 else visits / active
    hbm = itemsize * (active * k * n * weight_reads + visits * bm * k * n_tiles + rows * n)
    # The kernel skips sub-blocks without the visit's rows: each group
    # boundary costs at most one extra sub-block of rows.
    computed_rows = min(visits * bm, rows + active * min(bm, SUB_M))
    flops = 2 * computed_rows * round_up(bk, gen.mxu_width) * round_up(bn, gen.mxu_width) * k_steps * n_tiles
    steps = n_tiles * (-(-rows // bm) + groups) * k_steps  # the grid's static length
    return modeled_time(gen, flops, hbm, steps, n_tiles)["total"]


def modeled_weight_grad_seconds(rows, p, q, groups, blocks: BlockSizes, generation, itemsize=2) -> float:
    """The same for the weights' gradient [G, P, Q] (block_k tiles P, block_n Q)."""
    gen = GENERATIONS[generation]
    bm, bp, bq = blocks.block_m, blocks.block_k, blocks.block_n
    p_tiles, q_tiles = -(-p // bp), -(-q // bq)
    visits = -(-rows // bm) + groups
    hbm = itemsize * (visits * bm * (p * q_tiles + q * p_tiles) + groups * p * q)
    flops = 2 * visits * round_up(bm, gen.mxu_width) * round_up(bp, 8) * round_up(bq, gen.mxu_width) * p_tiles * q_tiles
    return modeled_time(gen, flops, hbm, p_tiles * q_tiles * visits, p_tiles * q_tiles)["total"]


def _search(model, buffers, rows, k, n, groups, generation, itemsize) -> BlockSizes:
    """The blocks `model` rates fastest among those whose `buffers` fit the
    generation's default scoped VMEM."""
    gen = GENERATIONS[generation]
    max_m = max(MIN_BLOCK_M, min(MAX_BLOCK_M, round_up(rows, MIN_BLOCK_M)))
    best, best_time = BlockSizes(MIN_BLOCK_M, _dim_blocks(k)[0], _dim_blocks(n)[0]), float("inf")
    for bm in (b for b in (16, 32, 64, 128, 256, 512, 1024) if b <= max_m):
        for bk in _dim_blocks(k):
            for bn in _dim_blocks(n):
                blocks = BlockSizes(bm, bk, bn)
                if buffers(blocks, itemsize) > gen.scoped_vmem_default:
                    continue
                time = model(rows, k, n, groups, blocks, generation, itemsize)
                if time < best_time:
                    best, best_time = blocks, time
    return best


def forward_buffers(blocks: BlockSizes, itemsize: int) -> int:
    return vmem_bytes(blocks, itemsize, "float32" if itemsize == 4 else "bfloat16")


def weight_grad_buffers(blocks: BlockSizes, itemsize: int) -> int:
    """Its buffers are a forward's with (block_m, block_k, block_n) read as
    (P block, rows block, Q block): inputs [rows, P], [rows, Q], output [P, Q]."""
    return forward_buffers(BlockSizes(blocks.block_k, blocks.block_m, blocks.block_n), itemsize)


@functools.lru_cache(maxsize=4096)
def rule_blocks(rows, k, n, groups, generation, itemsize=2) -> BlockSizes:
    return _search(modeled_seconds, forward_buffers, rows, k, n, groups, generation, itemsize)


@functools.lru_cache(maxsize=4096)
def rule_weight_grad_blocks(rows, p, q, groups, generation, itemsize=2) -> BlockSizes:
    return _search(modeled_weight_grad_seconds, weight_grad_buffers, rows, p, q, groups, generation, itemsize)


def choose_blocks(rows, k, n, groups, generation, itemsize=2) -> BlockSizes:
    return lookup(TUNED, generation, (rows, k, n, groups, itemsize),
                  lambda: rule_blocks(rows, k, n, groups, generation, itemsize))


def choose_weight_grad_blocks(rows, p, q, groups, generation, itemsize=2) -> BlockSizes:
    """Blocks of the weights' gradient [G, P, Q], reducing over rows:
    block_m tiles the rows, block_k tiles P and block_n tiles Q."""
    return lookup(TUNED_WEIGHT_GRAD, generation, (rows, p, q, groups, itemsize),
                  lambda: rule_weight_grad_blocks(rows, p, q, groups, generation, itemsize))


def vmem_limit(need: int, generation) -> int:
    """The scoped-VMEM limit to ask Mosaic for, given our buffers' bytes:
    headroom for its internal scratch, never past the chip's VMEM."""
    return min(max(16 << 20, int(need * 1.5) + (4 << 20)), GENERATIONS[generation].vmem_bytes)
