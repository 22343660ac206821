"""ragged-dot-tpu: MoE grouped matmul and the transformers experts forward as
Pallas TPU kernels, callable from torch (CPU runs them in interpret mode).

JAX users: `from <package>.ops import ragged_dot, experts_forward`.
"""

from .torch_ops import experts_forward, ragged_dot

__all__ = ["ragged_dot", "experts_forward"]
