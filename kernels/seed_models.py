"""Tiny random-weight configs of the models our users run first on TPUs:
Gemma 4 (MoE and dense), Qwen3-30B-A3B (Qwen3-MoE), Qwen3.5 and Qwen3.5-MoE,
Qwen3-Next, gpt-oss. Each is small enough for Pallas interpret mode on a CPU but keeps
what its family brings to our kernels: layer types, per-layer head dims,
sliding windows, K read as V, shared experts, sinks, softcaps, scaling.
The tests (tests/test_seed_models.py, the serving loop, the 2-process
plans) and `make demo` build their models from here.
"""

from __future__ import annotations

# initializer_range 0.2 (not 0.02): logits of order 1, so a wrong head, expert or position shows.
BASE = dict(vocab_size=128, hidden_size=64, tie_word_embeddings=False, initializer_range=0.2,
            max_position_embeddings=256)

# Gemma 4 26B-A4B: sliding layers (head_dim 256, window 1024) and every sixth one global (head_dim
# 512, 2 KV heads, K read as V: `attention_k_eq_v`), scaling 1.0 (norms on q and k instead), a dense
# MLP beside the experts, final logit softcap. Window 8 here: the 20-token prompts pass it.
GEMMA4 = dict(BASE, num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
              sliding_window=8, num_attention_heads=4, num_key_value_heads=2, head_dim=256, global_head_dim=512,
              num_global_key_value_heads=2, attention_k_eq_v=True, intermediate_size=48,
              hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
              vocab_size_per_layer_input=128)
# Qwen3.5: three linear-attention (gated delta rule) layers to one full-attention layer (head_dim
# 256, gated output, partial rotary).
QWEN3_5 = dict(BASE, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
               num_attention_heads=4, num_key_value_heads=2, head_dim=256, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)

# name -> (transformers config class, kwargs)
SEEDS = {
    "gemma4_moe": ("Gemma4TextConfig", dict(GEMMA4, enable_moe_block=True, num_experts=8, top_k_experts=2,
                                            moe_intermediate_size=24)),
    # Gemma 4 31B-like: dense, with V projected (attention_k_eq_v off).
    "gemma4_dense": ("Gemma4TextConfig", dict(GEMMA4, attention_k_eq_v=False)),
    # Qwen3-30B-A3B: GQA at head_dim 128, q/k norms, every layer MoE.
    "qwen3_moe": ("Qwen3MoeConfig", dict(BASE, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                                         decoder_sparse_step=1, mlp_only_layers=[])),
    "qwen3_5": ("Qwen3_5TextConfig", dict(QWEN3_5, intermediate_size=64)),
    # Qwen3.5-35B-A3B: the same layers, experts and a gated shared expert.
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(QWEN3_5, num_experts=8, num_experts_per_tok=2,
                                                 moe_intermediate_size=24, shared_expert_intermediate_size=24)),
    # Qwen3-Next-80B-A3B: Qwen3.5's layer pattern (its predecessor: three gated delta rule layers
    # to one gated full-attention layer at head_dim 256), every layer MoE with a gated shared expert.
    "qwen3_next": ("Qwen3NextConfig", dict(QWEN3_5, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                                           shared_expert_intermediate_size=24, intermediate_size=64)),
    # gpt-oss: sinks, alternating sliding window, head_dim 64, experts with biases and a clamp.
    "gpt_oss": ("GptOssConfig", dict(BASE, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                                     sliding_window=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                     intermediate_size=24, num_local_experts=8, num_experts_per_tok=2)),
}
MOE = {"gemma4_moe", "qwen3_moe", "qwen3_5_moe", "qwen3_next", "gpt_oss"}


def config(name: str):
    import transformers

    config_class, kwargs = SEEDS[name]
    return getattr(transformers, config_class)(**kwargs)


def attention_layers(config) -> int:
    """How many layers attend with softmax attention (the others are linear attention)."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return sum(t != "linear_attention" for t in types)
