"""Block sizes for the flash attention kernels.

A rule read from the bench model (bench/flash_bench.py, v6e, 2k and 8k
tokens, forward and backward; MODELED, not measured), until a tuned table
per generation replaces it: score blocks of about a million elements,
2048 query rows (block_q tokens times the G query heads of a KV head) by
512 keys when G > 1, 1024 by 1024 for MHA; under a sliding window, 1024
rows by a key block about the window's width (blocks past the window are
wasted work). Never more than the padded sequence needs, and grown until
the grid's step list fits its SMEM budget.

Modeled on v6e, fwd+bwd at 8k tokens, with the separate dq kernel:
Llama-3-8B (G=4) 2048x512 7.75 ms against 512x512 10.1 ms; Llama-2-7B (MHA)
1024x1024 8.5 ms against 512x512 10.6 ms; gpt-oss-20b's window of 128, 1024
rows x 128 keys 2.8 ms against 1024x512 3.8 ms.
"""

from __future__ import annotations

import math

from ._shared.generations import GENERATIONS
from ._shared.tuning import round_up
from .kernel import LANES, BlockSizes
from .tuned_blocks import TUNED  # generation -> {table_key: (query rows, keys)}

# The tuned table's axes (bench/flash_tune.py fills flash_attention/tuned_blocks.py).
TUNED_HEAD_DIMS = (64, 128, 256)
TUNED_GROUPS = (1, 4, 8)
TUNED_TOKENS = (2048, 8192, 32768)
# (query rows, keys) per block: GQA, MHA, and under a window (keys: at most this).
GQA_BLOCK = (2048, 512)
MHA_BLOCK = (1024, 1024)
WINDOW_BLOCK = (1024, 512)
MAX_BLOCK_K = 2048
Q_ALIGN = 16  # bf16 packs 16 rows per sublane tile
K_ALIGN = 128  # keys are the scores' lanes
# The kernels get one int32 per (query block, key block) pair through scalar prefetch (ops.Steps);
# SMEM holds 1 MiB: a quarter of it at most.
MAX_STEPS = 65536
# The share of a core's VMEM the backward may fill to keep a KV head's dq resident (fused_dq_vmem_limit).
FUSED_DQ_FRACTION = 0.75


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


def fused_dq_vmem_limit(rows: int, head_dim: int, value_dim: int, itemsize: int, blocks: BlockSizes, groups: int,
                        generation: str) -> int | None:
    """The VMEM limit under which the dkv kernel also accumulates dq (kernel.backward), or None
    where a KV head's dq does not fit in FUSED_DQ_FRACTION of the chip's VMEM: its f32
    accumulator and its output block (double-buffered), next to a generous estimate of dkv's
    own use (a few f32 score blocks, its double-buffered input blocks, its accumulators)."""
    rows_per_block, keys = blocks.block_q * groups, blocks.block_k
    dq = rows * head_dim * (4 + 2 * itemsize)
    own = (3 * rows_per_block * keys * 4 + 2 * (rows_per_block + keys) * (head_dim + value_dim) * itemsize
           + keys * (head_dim + value_dim) * 4)
    vmem = GENERATIONS[generation].vmem_bytes
    return int(0.9 * vmem) if dq + own <= FUSED_DQ_FRACTION * vmem else None


def window_span(causal: bool, left: int, right: int) -> int:
    """How many keys besides its own a query can see, when a window bounds them; -1 otherwise."""
    bounded = left >= 0 and (causal or right >= 0)
    return left + max(right, 0) if bounded else -1


def table_key(num_q: int, head_dim: int, value_dim: int, groups: int) -> tuple[int, int, int]:
    """The TUNED entry a call takes: its head_dim, G and query tokens, each rounded to the
    nearest tuned value (head_dim and G up, tokens by ratio)."""
    d = next((x for x in TUNED_HEAD_DIMS if x >= max(head_dim, value_dim)), TUNED_HEAD_DIMS[-1])
    g = next((x for x in TUNED_GROUPS if x >= groups), TUNED_GROUPS[-1])
    t = min(TUNED_TOKENS, key=lambda x: abs(math.log2(max(num_q, 1) / x)))
    return d, g, t


def choose_blocks(num_q: int, num_k: int, head_dim: int, value_dim: int, groups: int, itemsize: int,
                  generation: str, window: int = -1, parts: int = 1) -> BlockSizes:
    """window: `window_span` of the call; parts: see ops._Static. bf16 calls take the tuned entry of their bucket where
    the table has one; fp32 calls (twice the VMEM per block), windows and the rest, the rule."""
    if window >= 0:
        rows, keys = WINDOW_BLOCK
        keys = min(keys, round_up(window + 1, K_ALIGN))
    else:
        rule = GQA_BLOCK if groups > 1 else MHA_BLOCK
        tuned = TUNED.get(generation, {}) if itemsize == 2 else {}
        rows, keys = tuned.get(table_key(num_q, head_dim, value_dim, groups), rule)
    align = query_align(groups)
    q_cap, k_cap = round_up(max(num_q, 1), align), round_up(max(num_k, 1), K_ALIGN)
    block_q = min(max(align, rows // groups // align * align), q_cap)
    block_k = min(keys, k_cap)
    steps = lambda: parts * -(-num_q // block_q) * -(-num_k // block_k)  # the step arrays' length
    while steps() > MAX_STEPS and block_k < min(MAX_BLOCK_K, k_cap):
        block_k *= 2
    while steps() > MAX_STEPS:
        block_q *= 2
    return BlockSizes(block_q=block_q, block_k=block_k)
