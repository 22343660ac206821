"""Run in a fresh process by test_expert_parallel.py (JAX reads the CPU device count once):
expert_parallel_experts_forward under jax.shard_map over 4 CPU devices, against
experts_forward on one device. Prints JSON."""

import functools
import json
import os
import sys

os.environ.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
                  TORCH_DEVICE_BACKEND_AUTOLOAD="0", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from errors import max_abs, max_error  # noqa: E402  (this script's folder, tests/, is on sys.path)
from ragged_dot import ops  # noqa: E402

rng = np.random.default_rng(0)
tokens, hidden, inter, experts, top_k = 24, 128, 128, 8, 2
hidden_states = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
index = jnp.asarray(rng.integers(0, experts, (tokens, top_k)), jnp.int32).at[0].set(experts)  # token 0: elsewhere
weights = jnp.asarray(rng.random((tokens, top_k)), jnp.float32)
gate_up = jnp.asarray(rng.standard_normal((experts, 2 * inter, hidden)) / 10, jnp.float32)
down = jnp.asarray(rng.standard_normal((experts, hidden, inter)) / 10, jnp.float32)
up_bias = jnp.asarray(rng.standard_normal((experts, 2 * inter)), jnp.float32)
down_bias = jnp.asarray(rng.standard_normal((experts, hidden)), jnp.float32)
args = (hidden_states, index, weights, gate_up, down, up_bias, down_bias)

mesh = jax.make_mesh((4,), ("expert",))
specs = (P(), P(), P(), P("expert"), P("expert"), P("expert"), P("expert"))
ep = jax.jit(jax.shard_map(functools.partial(ops.expert_parallel_experts_forward, axis_name="expert"), mesh=mesh,
                           in_specs=specs, out_specs=P(), check_vma=False))
place = lambda *xs: [jax.device_put(x, jax.NamedSharding(mesh, spec)) for x, spec in zip(xs, specs)]
single = ops.experts_forward(*args)
sharded = ep(*place(*args))
bad = ep(*place(hidden_states, index.at[3, 1].set(experts + 1), *args[2:]))

# int8 experts: each output channel's scale is split over the devices with its expert's weights.
quantize = lambda w: (jnp.round(w / (s := jnp.abs(w).max(axis=2) / 127)[..., None]).astype(jnp.int8), s)
(gate_up_q, up_scale), (down_q, down_scale) = quantize(gate_up), quantize(down)
quantized = dict(hidden_states=hidden_states, top_k_index=index, top_k_weights=weights, up_proj=gate_up_q,
                 down_proj=down_q, up_scale=up_scale, down_scale=down_scale)
ep_quantized = jax.jit(jax.shard_map(
    lambda *xs: ops.expert_parallel_experts_forward(**dict(zip(quantized, xs)), axis_name="expert"),
    mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False))
single_quantized = ops.experts_forward(**quantized)
sharded_quantized = ep_quantized(*place(*quantized.values()))
print(json.dumps({"devices": len(jax.devices()), "max_abs_error": max_error(sharded, single),
                  "scale": max_abs(single), "token_routed_elsewhere": max_abs(sharded[0]),
                  "bad_id_all_nan": bool(jnp.isnan(bad).all()),
                  "quantized_max_abs_error": max_error(sharded_quantized, single_quantized),
                  "quantized_scale": max_abs(single_quantized)}))
