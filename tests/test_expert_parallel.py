"""Expert parallelism for JAX users: ops.expert_parallel_experts_forward under jax.shard_map."""

import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from ragged_dot import ops


def test_local_expert_ids():
    """Shard 1 of 4, two experts each, of 8 (8: the global sentinel): its experts 2 and 3
    become 0 and 1; every other id, the global sentinel included, becomes the local sentinel 2."""
    ids = jnp.asarray([[0, 1, 2, 3], [4, 7, 8, 3]], jnp.int32)
    np.testing.assert_array_equal(ops.local_expert_ids(ids, 2, 1), [[2, 2, 0, 1], [2, 2, 2, 1]])


def test_sharded_experts_match_one_device():
    """Four CPU devices holding two of eight experts each (biases too), tokens replicated, one
    psum: the single-device output within fp32 summation order; a token routed only to the
    global sentinel stays exactly zero; an id past the sentinel makes the output NaN. int8 experts
    with their scales split over the devices likewise."""
    result = subprocess.run([sys.executable, str(Path(__file__).with_name("expert_parallel_run.py"))],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4
    assert out["max_abs_error"] < 1e-5 * max(1.0, out["scale"]), out
    assert out["token_routed_elsewhere"] == 0.0
    assert out["bad_id_all_nan"]
    assert out["quantized_max_abs_error"] < 1e-5 * max(1.0, out["quantized_scale"]), out


@pytest.mark.parametrize("generation,topology", [("v6e", "v6e:2x4"), ("tpu7x", "tpu7x:2x2x1")])
def test_recipe_compiles_on_eight_devices(generation, topology):
    """The docstring's recipe at Qwen3-30B-A3B's decode shapes (batch 64, 128 experts, top-8),
    compiled by libtpu for eight v6e chips and for four tpu7x chips (eight devices)."""
    import functools

    import jax
    import tpu_compile
    from jax.sharding import PartitionSpec as P

    tokens, hidden, inter, experts, top_k = 64, 2048, 768, 128, 8
    specs = (P(), P(), P(), P("expert"), P("expert"))

    def build(devices):
        assert len(devices) == 8
        mesh = jax.sharding.Mesh(np.array(devices), ("expert",))
        body = functools.partial(ops.expert_parallel_experts_forward, axis_name="expert", generation=generation,
                                 interpret=False)
        fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)
        return fn, [jax.NamedSharding(mesh, spec) for spec in specs]

    shapes = [((tokens, hidden), jnp.bfloat16), ((tokens, top_k), jnp.int32), ((tokens, top_k), jnp.bfloat16),
              ((experts, 2 * inter, hidden), jnp.bfloat16), ((experts, hidden, inter), jnp.bfloat16)]
    report = tpu_compile.compile_on_topology(build, shapes, generation, topology, "ragged_dot_tpu")
    assert len(report.kernels) == 2  # the two projections, on each device's 16 experts
    assert all(0 < k.vmem_bytes <= report.vmem_capacity for k in report.kernels.values())
