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


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def bucket_size(n: int) -> int:
    """The padded size for a dimension that varies call to call (tokens).

    Powers of two: tokens 1..8192 reach a kernel as 14 shapes, so a decode
    or prefill loop compiles a bounded number of variants. Padding rows are
    made free by the caller (routed nowhere, or past sum(group_sizes)).
    """
    return 1 << max(0, (n - 1).bit_length())
