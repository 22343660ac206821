"""Serving with paged attention: our own serving loop with vLLM's calls (kernels/serving_loop.py:
requests join and finish at different steps, chunked prefill, pages reused), and transformers'
continuous batching through our hook. The greedy tokens must be `generate`'s for each prompt
alone (sdpa, or eager where the family has no sdpa). The kernel is the built Hub tree, loaded with
get_kernel as users load it; so are the MoE families' experts (ragged-dot-tpu). Gemma 4 is served
by our loop: transformers' continuous batching cannot size its cache (head_dim differs per layer)."""

import copy
import sys

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

import build_collection
import seed_models
from sampling import sample
from serving_loop import ATTENTION, Request, register, serve

KERNELS = build_collection.load_manifest()["kernels"]
REPO = KERNELS["paged_attention"]["repo-id"]
EXPERTS = "paged_serving_hub_experts"  # ragged-dot-tpu's experts forward, loaded with get_kernel
BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, intermediate_size=64, tie_word_embeddings=False)
FAMILIES = {
    "llama": ("LlamaConfig", dict(BASE, num_attention_heads=4, num_key_value_heads=2, head_dim=64)),  # GQA
    # softcap, alternating sliding window, head_dim 256, MQA
    "gemma2": ("Gemma2Config", dict(BASE, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                                    sliding_window=8, attn_logit_softcapping=5.0, query_pre_attn_scalar=64)),
    # sinks, alternating sliding window
    "gpt_oss": ("GptOssConfig", dict(BASE, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                     layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                                     num_local_experts=4, num_experts_per_tok=2)),
    # sliding layers at head_dim 256 and a global one at 512 with K read as V, 2 KV heads each:
    # every layer's cache has its own shape
    "gemma4_moe": seed_models.SEEDS["gemma4_moe"],
}
MOE = {"gpt_oss", "gemma4_moe"}
CALLS = []


@pytest.fixture(scope="module")
def paged(tmp_path_factory):
    loaded = build_collection.load_from_hub(["paged_attention", "ragged_dot"], tmp_path_factory.mktemp("build"))
    module, experts = loaded["paged_attention"], loaded["ragged_dot"]
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS, experts.experts_forward)
    torch_ops = sys.modules[module.__name__ + ".torch_ops"]
    op = torch_ops.attention_op

    def counted(*args):
        CALLS.append(tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args))
        return op(*args)

    torch_ops.attention_op = counted
    register()
    yield module
    torch_ops.attention_op = op


def layer_type(config, i):
    return (getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)[i]


# Sampled (tests/sampling.py): Gemma 4 MoE (head dims 256 and 512, windows, k_eq_v) and gpt-oss (sinks,
# windows); Llama's GQA and Gemma 2's softcap and MQA are in the kernel's direct tests.
@pytest.mark.parametrize("family", sample(FAMILIES, {"gemma4_moe", "gpt_oss"}))
def test_serving_loop_gives_the_tokens_of_generate(paged, family):
    config_class, kwargs = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.set_attn_implementation("sdpa" if model._supports_sdpa else "eager")
    if family in MOE:
        model.set_experts_implementation("eager")
    make = lambda n, seed: torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    # Prompts longer than a prefill chunk (chunked prefill) and than the window of 8; one joins
    # late, after the first finished and gave its pages back; contexts cross page boundaries.
    requests = [Request(make(5, 1), 3, joins_at=0), Request(make(19, 2), 8, joins_at=0),
                Request(make(12, 3), 7, joins_at=1), Request(make(3, 4), 4, joins_at=4)]
    expected = []
    with torch.no_grad():
        for r in requests:
            out = model.generate(torch.tensor([r.prompt]), max_new_tokens=r.max_new_tokens, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
            expected.append(out[0, len(r.prompt):].tolist())
    model.set_attn_implementation(ATTENTION)
    if family in MOE:
        model.set_experts_implementation(EXPERTS)
    CALLS.clear()
    steps = serve(model, paged, requests)
    assert len(CALLS) == steps * config.num_hidden_layers, "our kernel must serve every layer at every step"
    assert len(set(CALLS)) == len({layer_type(config, i) for i in range(config.num_hidden_layers)}), \
        "one signature per attention type: every step has the same shapes"
    for r, tokens in zip(requests, expected):
        assert r.generated == tokens


# 16-token pages (contexts span several), a 16-token budget per step (the 19-token prompt is
# prefilled in chunks, requests wait for room and join later).
BATCHING = ContinuousBatchingConfig(page_size=16, num_blocks=32, max_batch_tokens=16)


def test_generate_batch_gives_the_tokens_of_generate(paged):
    """transformers' continuous batching with attn_implementation="<repo>:flash_attn_forward"
    (transformers loads the built tree with get_kernel): requests of different lengths, some
    queued behind a small token budget so they join later; every layer's attention is ours.
    (The hook reads only the attention call and the cache, the same for every family with
    full-attention layers; Llama's stands for them.)"""
    config_class, kwargs = FAMILIES["llama"]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**kwargs)
    implementation = f"{REPO}:flash_attn_forward"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation, dtype=torch.float32).eval()
    assert model.config._attn_implementation == implementation
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa",
                                                 dtype=torch.float32).eval()
    reference.load_state_dict(model.state_dict())
    # Each layer's call, and (the fixture's counter: transformers loaded the same module) each kernel call.
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    served, layers = ALL_ATTENTION_FUNCTIONS[implementation], []

    def attention(module, *args, **kwargs):
        layers.append(module.layer_idx)
        return served(module, *args, **kwargs)

    prompts = [torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 19, 3)]
    generation = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    CALLS.clear()
    # transformers' own path gathers the context in PagedAttentionCache.update: ours must never call it.
    from transformers.generation.continuous_batching import PagedAttentionCache

    gathers, update = [], PagedAttentionCache.update
    ALL_ATTENTION_FUNCTIONS.register(implementation, attention)
    PagedAttentionCache.update = lambda self, *args, **kwargs: gathers.append(1) or update(self, *args, **kwargs)
    try:
        with torch.no_grad():
            batched = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=BATCHING)
    finally:
        ALL_ATTENTION_FUNCTIONS.register(implementation, served)
        PagedAttentionCache.update = update
    assert not gathers, "the context must be read from the pages, not gathered by cache.update"
    assert set(layers) == set(range(config.num_hidden_layers)), "our function must serve every layer"
    assert len(CALLS) == len(layers), "and each call must run our kernel"
    assert len(batched) == len(prompts)
    with torch.no_grad():
        for prompt, result in zip(prompts, sorted(batched.values(), key=lambda r: int(r.request_id.split("_")[-1]))):
            alone = reference.generate(torch.tensor([prompt]), generation_config=generation)
            assert result.generated_tokens == alone[0, len(prompt):].tolist()


def test_what_is_not_served_says_so(paged):
    """Sliding-window layers (a ring-buffer cache) and generate (no paged cache) are not served:
    each says so rather than computing something else."""
    config = transformers.MistralConfig(**FAMILIES["llama"][1], sliding_window=8)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=f"{REPO}:flash_attn_forward",
                                             dtype=torch.float32).eval()
    generation = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        results = model.generate_batch([[5, 6, 7]], generation_config=generation, continuous_batching_config=BATCHING)
        # transformers' loop logs the error and returns the request failed, with the message.
        (result,) = results.values()
        assert result.status.name == "FAILED" and not result.generated_tokens
        assert "layer 0 is 'sliding_attention'" in result.error
        with pytest.raises(NotImplementedError, match="serves transformers' continuous batching"):
            model.generate(torch.tensor([[5, 6, 7]]), generation_config=generation)
