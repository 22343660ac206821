"""paged-attention-tpu: ragged paged attention over a paged KV cache and the cache write, as
Pallas TPU kernels with vLLM's names and arguments, callable from torch (CPU runs them in
interpret mode).

JAX users: `from <package>.ops import ragged_paged_attention, reshape_and_cache_flash`.
"""

from ._shared.dependencies import require_jax

require_jax("paged-attention-tpu")

from .continuous_batching import flash_attn_forward, supports_flash_attn  # noqa: E402, F401
from .torch_ops import ragged_paged_attention, reshape_and_cache_flash  # noqa: E402  (after the jax check)

__all__ = ["ragged_paged_attention", "reshape_and_cache_flash", "flash_attn_forward"]
