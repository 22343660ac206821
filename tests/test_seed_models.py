"""The models our users run first (kernels/seed_models.py: Gemma 4 MoE and dense, Qwen3-MoE,
Qwen3.5 and Qwen3.5-MoE, gpt-oss), as tiny random configs with their real architecture, with
every kernel loaded as users load it: experts forward from ragged-dot-tpu and attention from
flash-attn-tpu, both through get_kernel from the built trees (offline Hub cache). Each against
transformers' eager attention and eager experts: logits, greedy tokens, parameter gradients,
the whole model compiled in one graph, continuous batching where transformers' takes the family.
Serving Gemma 4 on paged attention: test_paged_attention_serving.py; the 2-process TP/EP
plans: test_multichip.py."""

import copy
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

import build_collection
import seed_models
from sampling import sample  # noqa: E402

KERNELS = build_collection.load_manifest()["kernels"]
ATTENTION = KERNELS["flash_attention"]["repo-id"]
EXPERTS = "seed_models_hub_experts"  # the hub experts forward, registered with transformers
SEEDS = sorted(seed_models.SEEDS)
CALLS = {"attention": 0, "experts": 0}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Both kernels built, laid out as a Hub cache and loaded with get_kernel; each call counted."""
    loaded = build_collection.load_from_hub(["ragged_dot", "flash_attention"], tmp_path_factory.mktemp("build"))
    experts, attention = loaded["ragged_dot"], loaded["flash_attention"]

    def experts_forward(*args):
        CALLS["experts"] += 1
        return experts.experts_forward(*args)

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS, experts_forward)
    torch_ops = sys.modules[attention.__name__ + ".torch_ops"]
    op = torch_ops.attention_op

    def counted(*args):
        CALLS["attention"] += 1
        return op(*args)

    torch_ops.attention_op = counted
    # gpt-oss takes only the flash implementations it lists: the documented opt-in.
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssPreTrainedModel

    listed = GptOssPreTrainedModel._compatible_flash_implementations
    GptOssPreTrainedModel._compatible_flash_implementations = [*listed, ATTENTION]
    yield torch_ops
    GptOssPreTrainedModel._compatible_flash_implementations = listed
    torch_ops.attention_op = op


def _models(seed):
    """(ours, eager): one random fp32 model, copied, differing only in the attention and experts
    implementations. Expert biases (gpt-oss) are randomised: transformers inits them to 0."""
    torch.manual_seed(0)
    implementations = dict(attn_implementation=ATTENTION)
    if seed in seed_models.MOE:
        implementations["experts_implementation"] = EXPERTS
    ours = AutoModelForCausalLM.from_config(seed_models.config(seed), dtype=torch.float32, **implementations).eval()
    assert ours.config._attn_implementation == ATTENTION, "transformers replaced our attention"
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if "experts" in name and name.endswith("_bias"):
                param.normal_(0, 0.1)
    eager = copy.deepcopy(ours)
    eager.set_attn_implementation("eager")
    if seed in seed_models.MOE:
        eager.set_experts_implementation("eager")
    return ours, eager


def _expected_calls(model):
    moe_layers = sum(hasattr(m, "has_gate") and hasattr(m, "is_transposed") for m in model.modules())
    return {"attention": seed_models.attention_layers(model.config), "experts": moe_layers}


def _batch():
    """Two prompts of 20 tokens, the first left-padded by 5: past the sliding windows of 8."""
    ids = torch.randint(2, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    return ids, mask


@pytest.mark.parametrize("seed", SEEDS)
def test_logits_and_greedy_tokens_match_eager(hub, seed):
    ours, eager = _models(seed)
    ids, mask = _batch()
    with torch.no_grad():
        CALLS.update(attention=0, experts=0)
        got = ours(ids, attention_mask=mask).logits
        assert CALLS == _expected_calls(ours), "our kernels must serve every attention and MoE layer"
        want = eager(ids, attention_mask=mask).logits
        # fp32 in both; the kernels sum in another order (blocked softmax, grouped matmuls). Measured
        # at most 8e-6 of the largest logit (Gemma 4: 3 layers, softcap); a wrong head, key or expert
        # is of the logits' own size. Padding positions are arbitrary (ours are zeros): not compared.
        torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=0, atol=2e-5 * want.abs().max().item())
        generate = lambda model: model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                                                pad_token_id=0)
        assert torch.equal(generate(ours), generate(eager))


@pytest.mark.parametrize("seed", SEEDS)
def test_parameter_gradients_match_eager(hub, seed):
    ours, eager = _models(seed)
    ids, mask = _batch()
    # No loss on padding positions, nor on the token each predicts (the first real one).
    predicted_from_padding = torch.nn.functional.pad(mask, (1, 0), value=1)[:, :-1] == 0
    labels = ids.masked_fill((mask == 0) | predicted_from_padding, -100)
    for model in (ours, eager):
        model.train()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
    compared = 0
    for (name, a), (_, b) in zip(ours.named_parameters(), eager.named_parameters()):
        if b.grad is None:
            continue
        # Each tensor within 1e-3 of its largest gradient: transformers' own sdpa and eager differ by
        # up to 1e-4 of it in Gemma 4 (its router and softcap amplify fp32 rounding), ours by 2e-4; a
        # wrong dq, dk, dv or expert gradient is off by the gradient's own size.
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-3 * b.grad.abs().max().item() + 1e-7, msg=name)
        compared += 1
    assert compared > 10


# Sampled (tests/sampling.py): Gemma 4 MoE (all three kernels, head_dim 512, k_eq_v), Qwen3.5-MoE
# (linear attention beside ours, shared experts) and gpt-oss (sinks, biases); the others repeat them.
@pytest.mark.parametrize("seed", sample(SEEDS, {"gemma4_moe", "qwen3_5_moe", "gpt_oss"}))
def test_whole_model_compiles_in_one_graph(hub, seed):
    """torch.compile(fullgraph=True, dynamic=False), TorchTPU's fast mode, over the whole bf16 model
    (fp32 breaks the graph in transformers' flash path: it warns that it casts fp32 inputs), our
    kernels in it. bf16 rounds differently once fused, and these random models amplify rounding
    (bf16 eager's logits are up to 0.36 off fp32's on average): the compiled model must be no
    further from the fp32 logits than eager bf16 is, within 2x (measured: 0.4x to 1.25x)."""
    ours, _ = _models(seed)
    ids, _ = _batch()
    with torch.no_grad():
        exact = ours(ids).logits
        ours = ours.to(torch.bfloat16)
        eager_error = (ours(ids).logits.float() - exact).abs().mean()
        CALLS.update(attention=0, experts=0)
        compiled = torch.compile(ours, fullgraph=True, dynamic=False)(ids).logits.float()
    assert CALLS == _expected_calls(ours), "the compiled graph must call our kernels in every layer"
    assert (compiled - exact).abs().mean() <= 2 * eager_error


@pytest.mark.parametrize("seed", sample(["qwen3_moe", "gpt_oss"], {"gpt_oss"}))  # gpt-oss: sinks, windows, biases
def test_generate_batch_gives_the_tokens_of_generate(hub, seed):
    """transformers' continuous batching (the varlen entry point, requests packed) against generate
    one prompt at a time, both with our kernels."""
    ours, _ = _models(seed)
    prompts = [torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 12, 20)]
    config = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    CALLS.update(attention=0, experts=0)
    with torch.no_grad():
        batched = ours.generate_batch(prompts, generation_config=config)
        assert CALLS["attention"] and CALLS["experts"]
        assert len(batched) == len(prompts)
        for prompt, result in zip(prompts, sorted(batched.values(), key=lambda r: int(r.request_id.split("_")[-1]))):
            alone = ours.generate(torch.tensor([prompt]), generation_config=config)
            assert result.generated_tokens == alone[0, len(prompt):].tolist()


@pytest.mark.parametrize("seed,refusal", [
    ("gemma4_moe", "'head_dim' is a per-layer attribute"),  # served by our paged loop instead
    ("qwen3_5_moe", "Invalid layer type: linear_attention"),
    ("qwen3_next", "Invalid layer type: linear_attention"),
])
def test_continuous_batching_cannot_take(hub, seed, refusal):
    """Where transformers 5.22's continuous batching cannot size the family's cache it says so;
    when this fails, it can: move the family to the test above."""
    ours, _ = _models(seed)
    config = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad(), pytest.raises(Exception, match=refusal):
        ours.generate_batch([[5, 6, 7]], generation_config=config)


def test_a_head_dim_past_the_kernels_names_the_layer(hub):
    """Gemma 4 with 640-wide global heads: refused when the model is first called, naming the layer
    (not a silent fallback to another attention)."""
    kwargs = dict(seed_models.SEEDS["gemma4_dense"][1], global_head_dim=640)
    config = seed_models.config("gemma4_dense").__class__(**kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=ATTENTION).eval()
    with torch.no_grad(), pytest.raises(ValueError, match=r"Gemma4TextAttention \(layer 2\): head dims of any size "
                                                          r"up to 512 are supported, got q and k's 640"):
        model(torch.tensor([[5, 6, 7]]))


def test_gemma4_k_eq_v_gives_attention_two_tensors(hub, monkeypatch):
    """Gemma 4's attention_k_eq_v projects V with K's weights, but K then takes a scaled norm and
    RoPE and V an unscaled norm and no RoPE: at the attention call they differ (so a kernel has no
    shared tensor to read once). Read at the op, for the global layer (head_dim 512)."""
    ours, _ = _models("gemma4_moe")
    assert ours.config.attention_k_eq_v
    seen, op = [], hub.attention_op

    def recording(q, k, v, *args):
        seen.append((k.shape[-1], torch.equal(k, v)))
        return op(q, k, v, *args)

    monkeypatch.setattr(hub, "attention_op", recording)
    with torch.no_grad():
        ours(torch.randint(2, 128, (1, 12), generator=torch.Generator().manual_seed(1)))
    assert sorted(seen) == [(256, False), (256, False), (512, False)]
