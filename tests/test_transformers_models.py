"""Tiny random-weight transformers MoE models: our experts implementation
against eager, logits and greedy tokens."""

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

import ragged_dot

IMPL = "ragged_dot_tpu_test"
ALL_EXPERTS_FUNCTIONS.register(IMPL, ragged_dot.experts_forward)

COMMON = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts_per_tok=2, tie_word_embeddings=False,
)
CONFIGS = {
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, num_experts=8, moe_intermediate_size=32,
                                        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
    "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=8, intermediate_size=32),
}


def _model(name, impl, dtype):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=dtype, experts_implementation=impl).eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_greedy_tokens_match_eager_fp32(name):
    ours, eager = _model(name, IMPL, torch.float32), _model(name, "eager", torch.float32)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(ids).logits - eager(ids).logits).abs().max().item()
        # fp32 end to end; only summation order differs from eager.
        assert diff < 1e-4, diff
        kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(ids[:1], **kwargs), eager.generate(ids[:1], **kwargs))


def test_bf16_model_close_to_fp32_eager():
    """bf16 weights and activations: compare against eager run on the same
    bf16 weights in fp32; the error is bf16 rounding of activations through
    two layers, so a loose 5e-2 relative bound, far below a wrong answer (~1)."""
    ours = _model("mixtral", IMPL, torch.bfloat16)
    eager = _model("mixtral", "eager", torch.bfloat16).float()
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = ours(ids).logits.float(), eager(ids).logits
    assert (got - want).abs().max().item() < 5e-2 * want.abs().max().item()


def test_parameter_gradients_match_eager():
    ours, eager = _model("qwen3_moe", IMPL, torch.float32), _model("qwen3_moe", "eager", torch.float32)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    for model in (ours, eager):
        model(ids, labels=ids).loss.backward()
    for (name, p), (_, q) in zip(ours.named_parameters(), eager.named_parameters()):
        assert p.grad is not None, name
        scale = max(1e-6, q.grad.abs().max().item())
        assert (p.grad - q.grad).abs().max().item() <= 1e-4 * max(1.0, scale), name
