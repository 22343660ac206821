"""flash-attn-tpu (in progress)."""
