"""ragged-dot-tpu: MoE grouped matmul and the transformers experts forward as
Pallas TPU kernels, callable from torch (CPU runs them in interpret mode).

JAX users: `from <package>.ops import ragged_dot, experts_forward`.
"""

from ._shared.dependencies import require_jax

require_jax("ragged-dot-tpu")

from .fp8_checkpoints import fp8_checkpoint_config  # noqa: E402
from .mxfp4_checkpoints import mxfp4_checkpoint_config  # noqa: E402
from .torch_ops import experts_forward, pad_experts, quantize_experts, ragged_dot  # noqa: E402  (after the jax check)

__all__ = ["ragged_dot", "experts_forward", "pad_experts", "quantize_experts", "fp8_checkpoint_config", "mxfp4_checkpoint_config"]
