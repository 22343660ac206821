"""gated-delta-rule-tpu: the gated delta rule (Gated DeltaNet's linear attention, as in Qwen3.5
and Qwen3-Next) as Pallas TPU kernels.

JAX users: `from <package>.ops import chunk_gated_delta_rule`.
"""
