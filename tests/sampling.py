"""What `make test` runs of the slowest parametrized tests.

`make test` must stay under CI's 30 minutes on 2 cores. Of a test's slow cases it runs a sample that
still takes every kernel feature and user path once (the cases left out repeat one of them on another
model, generation or shape; the benches' anchors are modeled in `make check-compile` only);
`make test-all` (ALL_CASES=1) runs every case, and `make check-compile` (CHECK_ALL_COMPILES=1) every
compile case.
"""

import os

ALL_CASES = os.environ.get("ALL_CASES") == "1"
ALL_COMPILES = ALL_CASES or os.environ.get("CHECK_ALL_COMPILES") == "1"


def sample(cases, kept, key=lambda case: case):
    """`cases` in order: all of them under ALL_CASES, else those whose `key` is in `kept` (each one
    of them)."""
    cases = list(cases)
    keys = [key(c) for c in cases]
    assert set(kept) <= set(keys), f"sampled cases that do not exist: {set(kept) - set(keys)}"
    return cases if ALL_CASES else [c for c, k in zip(cases, keys) if k in kept]


def named(case):
    """The name a case tuple starts with (the tests' convention)."""
    return case[0]
