"""gated-delta-rule-tpu: the gated delta rule (Gated DeltaNet's linear attention, as in Qwen3.5
and Qwen3-Next) as Pallas TPU kernels, callable from torch (CPU runs them in interpret mode).

JAX users: the module's `ops.chunk_gated_delta_rule`, `ops.fused_recurrent_gated_delta_rule`, and
`conv.causal_conv1d_fn`, `conv.causal_conv1d_update` (the short convolution around the rule).
"""

from ._shared.dependencies import require_jax

require_jax("gated-delta-rule-tpu")

from .torch_ops import (  # noqa: E402  (after the jax check)
    causal_conv1d_fn,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
)

# kernels' LayerRepository reads `layers` (transformers' kernelize mapping); not an entry point of its own.
from .torch_ops import layers  # noqa: E402

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update"]
