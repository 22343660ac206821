"""paged-attention-tpu: ragged paged attention over a paged KV cache and the cache write, as
Pallas TPU kernels (in development: JAX entry points so far).

JAX users: `from <package>.ops import ragged_paged_attention, reshape_and_cache_flash`.
"""
