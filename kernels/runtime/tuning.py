"""Tuning-table lookup shared by the kernels.

A kernel's table maps generation -> {shape key: block config}. A shape that
is not in the table gets the kernel's rule, which must always compile.
"""

from __future__ import annotations

from typing import Callable, Mapping, TypeVar

Config = TypeVar("Config")
Key = tuple


def lookup(
    table: Mapping[str, Mapping[Key, Config]],
    generation: str,
    key: Key,
    rule: Callable[[], Config],
) -> Config:
    """The tuned entry for (generation, key), else what `rule()` gives."""
    entry = table.get(generation, {}).get(key)
    return entry if entry is not None else rule()


def widest_held(head_dims, head_dim: int, held: Callable[[int], bool]) -> int | None:
    """The widest of a table's `head_dims` up to `head_dim` for which it holds an entry (`held`), or
    None. A wider head than that entry was rated at takes its blocks cut by the ratio of head dims
    (`cut_for`), so that a block's tiles and accumulators take the VMEM they were rated at."""
    return max((d for d in head_dims if d <= head_dim and held(d)), default=None)


def cut_for(head_dim: int, rated_head_dim: int) -> int:
    """By how much blocks rated at `rated_head_dim` are divided for a `head_dim`-wide head."""
    return -(-head_dim // rated_head_dim)


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def bucket_size(n: int) -> int:
    """The padded size for a dimension that varies call to call (tokens).

    Powers of two: tokens 1..8192 reach a kernel as 14 shapes, so a decode
    or prefill loop compiles a bounded number of variants. Padding rows are
    made free by the caller (routed nowhere, or past sum(group_sizes)).
    """
    return 1 << max(0, (n - 1).bit_length())
