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


def sample(cases, kept):
    """`cases` in order: all of them under ALL_CASES, else those in `kept` (each one of them)."""
    cases = list(cases)
    assert set(kept) <= set(cases), f"sampled cases that do not exist: {set(kept) - set(cases)}"
    return cases if ALL_CASES else [c for c in cases if c in kept]
