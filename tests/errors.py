"""Errors against a reference that a NaN cannot hide.

XLA's CPU max reduction skips NaN once an array fills its vector registers (`jnp.max` of a
[64, 128] array holding one NaN is the largest number), so `jnp.max(jnp.abs(got - want)) <= bound`
passes a kernel that writes NaN. These reduce in numpy (float64), where a NaN anywhere makes the
figure NaN, and NaN <= bound is False.
"""

import numpy as np


def max_abs(x) -> float:
    """max |x| over every element; NaN if any element is NaN."""
    return float(np.max(np.abs(np.asarray(x).astype(np.float64))))


def max_error(got, want) -> float:
    """max |got - want| over every element; NaN if either holds a NaN."""
    return float(np.max(np.abs(np.asarray(got).astype(np.float64) - np.asarray(want).astype(np.float64))))
