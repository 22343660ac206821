"""paged-attention-tpu's JAX kernel (ops, kernel, tuning), vendored: flash_attn_with_kvcache runs it.

In the source tree these are links to paged_attention/'s files; the build copies them in
(kernels/build_collection.py), so the published package is self-contained. Only JAX modules
are vendored: no torch op of paged-attention-tpu is registered by this copy."""
