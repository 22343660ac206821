"""Expert parallelism for JAX users: ops.expert_parallel_experts_forward under jax.shard_map."""

import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from ragged_dot import ops


def test_local_expert_ids():
    """Shard 1 of 4, two experts each, of 8 (8: the global sentinel): its experts 2 and 3
    become 0 and 1; every other id, the global sentinel included, becomes the local sentinel 2."""
    ids = jnp.asarray([[0, 1, 2, 3], [4, 7, 8, 3]], jnp.int32)
    np.testing.assert_array_equal(ops.local_expert_ids(ids, 2, 1), [[2, 2, 0, 1], [2, 2, 2, 1]])


def test_sharded_experts_match_one_device():
    """Four CPU devices holding two of eight experts each (biases too), tokens replicated, one
    psum: the single-device output within fp32 summation order; a token routed only to the
    global sentinel stays exactly zero; an id past the sentinel makes the output NaN."""
    result = subprocess.run([sys.executable, str(Path(__file__).with_name("expert_parallel_run.py"))],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4
    assert out["max_abs_error"] < 1e-5 * max(1.0, out["scale"]), out
    assert out["token_routed_elsewhere"] == 0.0
    assert out["bad_id_all_nan"]
