"""flash-attn-tpu: flash attention (forward and backward) as Pallas TPU
kernels with flash-attn 2's entry points, callable from torch (CPU runs them
in interpret mode) and loadable by transformers as an attention
implementation.

JAX users: `from <package>.ops import flash_attention, flash_attention_varlen, flash_attention_with_kvcache`.
"""

from ._shared.dependencies import require_jax

require_jax("flash-attn-tpu")

from .torch_ops import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: E402  (after the jax check)

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]
