"""Tiny random-weight transformers models with attn_implementation set to our
built flash-attn-tpu, loaded as users load it (transformers calls get_kernel,
offline from a Hub cache of the built tree), against sdpa (eager where a family has no sdpa): logits with and
without padding, greedy tokens, parameter gradients, continuous batching,
torch.compile."""

import copy
import sys

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

import build_collection
from sampling import sample

REPO = build_collection.load_manifest()["kernels"]["flash_attention"]["repo-id"]
BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, intermediate_size=64, tie_word_embeddings=False)
GQA = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
# Config class -> kwargs: what each family brings to the kernel.
FAMILIES = {
    "llama": ("LlamaConfig", dict(BASE, **GQA)),  # GQA
    "qwen3": ("Qwen3Config", dict(BASE, **GQA)),  # GQA, q/k norms
    "mistral": ("MistralConfig", dict(BASE, **GQA, sliding_window=8)),  # sliding window on every layer
    # softcap on the scores, alternating sliding window, head_dim 256
    "gemma2": ("Gemma2Config", dict(BASE, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                                    sliding_window=8, attn_logit_softcapping=5.0, query_pre_attn_scalar=64)),
    # sinks, alternating sliding window, head_dim 64
    "gpt_oss": ("GptOssConfig", dict(BASE, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                     layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                                     num_local_experts=4, num_experts_per_tok=2)),
}
CALLS = []


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """Our flash attention, built and laid out as a Hub cache; transformers
    loads it from there (offline mode skips the Hub's trust check, which
    online needs `allow_all_kernels=True`). Calls to its op are counted."""
    module = build_collection.load_from_hub(["flash_attention"], tmp_path_factory.mktemp("build"))["flash_attention"]
    torch_ops = sys.modules[module.__name__ + ".torch_ops"]
    op = torch_ops.attention_op

    def counted(*args):  # records each call's shapes and static options: what a TPU compiles per signature
        CALLS.append(tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args))
        return op(*args)

    torch_ops.attention_op = counted
    # gpt-oss takes only the flash implementations it lists: the documented opt-in.
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssPreTrainedModel

    listed = GptOssPreTrainedModel._compatible_flash_implementations
    GptOssPreTrainedModel._compatible_flash_implementations = [*listed, REPO]
    yield module
    GptOssPreTrainedModel._compatible_flash_implementations = listed
    torch_ops.attention_op = op


def _models(family):
    """(ours, reference): one random model, copied, differing only in
    attention: sdpa, or eager where the family has no sdpa (softcap, sinks)."""
    config_class, kwargs = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**kwargs)
    ours = AutoModelForCausalLM.from_config(config, attn_implementation=REPO, dtype=torch.float32).eval()
    assert ours.config._attn_implementation == REPO, "transformers replaced our implementation"
    reference = copy.deepcopy(ours)
    reference.set_attn_implementation("sdpa" if ours._supports_sdpa else "eager")
    return ours, reference


def _batch():
    """Two prompts of 20 tokens, the first left-padded by 5: longer than the sliding window of 8."""
    ids = torch.randint(2, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    return ids, mask


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_tokens_match_the_reference(kernel, family):
    ours, sdpa = _models(family)
    ids, mask = _batch()
    layers = ours.config.num_hidden_layers
    with torch.no_grad():
        CALLS.clear()
        dense = ours(ids).logits
        assert len(CALLS) == layers, "our kernel must serve every attention layer"
        torch.testing.assert_close(dense, sdpa(ids).logits, rtol=0, atol=1e-4)
        # Padded: transformers unpads the batch and calls the varlen entry point.
        padded, expected = ours(ids, attention_mask=mask).logits, sdpa(ids, attention_mask=mask).logits
        torch.testing.assert_close(padded[0, 5:], expected[0, 5:], rtol=0, atol=1e-4)
        torch.testing.assert_close(padded[1], expected[1], rtol=0, atol=1e-4)
        CALLS.clear()
        tokens = ours.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert len(CALLS) == 16 * layers
        assert torch.equal(tokens, sdpa.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                                                 pad_token_id=0))


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
def test_parameter_gradients_match_the_reference(kernel, family):
    ours, sdpa = _models(family)
    ids, mask = _batch()
    # Outputs at padding positions are arbitrary (ours are zeros): no loss on them, nor on the token
    # each predicts (the first real one).
    predicted_from_padding = torch.nn.functional.pad(mask, (1, 0), value=1)[:, :-1] == 0
    labels = ids.masked_fill((mask == 0) | predicted_from_padding, -100)
    for model in (ours, sdpa):
        model.train()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
    for (name, a), (_, b) in zip(ours.named_parameters(), sdpa.named_parameters()):
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
    sinks = [p for n, p in ours.named_parameters() if n.endswith("sinks")]
    assert family != "gpt_oss" or (sinks and all(s.grad.abs().sum() > 0 for s in sinks)), "sinks get gradients"


# Sampled (tests/sampling.py): gpt-oss (sinks, sliding and full layers); Mistral's window repeats it.
@pytest.mark.parametrize("family", sample(["mistral", "gpt_oss"], {"gpt_oss"}))
def test_continuous_batching_gives_the_tokens_of_generate(kernel, family):
    """generate_batch (transformers' continuous batching: on TPU it calls the
    varlen entry point with requests packed, fewer queries than keys) over
    prompts of different lengths, against generate one prompt at a time;
    the op sees at most 16 signatures (shapes and options) in the run."""
    ours, _ = _models(family)
    prompts = [torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 12, 20)]
    config = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    CALLS.clear()
    with torch.no_grad():
        batched = ours.generate_batch(prompts, generation_config=config)
    assert CALLS and len(set(CALLS)) <= 16
    assert len(batched) == len(prompts)
    with torch.no_grad():
        for prompt, result in zip(prompts, sorted(batched.values(), key=lambda r: r.request_id)):
            alone = ours.generate(torch.tensor([prompt]), generation_config=config)
            assert result.generated_tokens == alone[0, len(prompt):].tolist()


def test_whole_model_compiles_in_one_graph(kernel):
    """torch.compile(fullgraph=True, dynamic=False), TorchTPU's fast mode, over
    a whole bf16 model (an fp32 one breaks the graph in transformers' own
    code: a warning that it casts fp32 inputs): one graph, no break in our
    code, the eager logits within bf16's rounding of other fusions."""
    ours, _ = _models("qwen3")
    ours = ours.to(torch.bfloat16)
    ids, _ = _batch()
    with torch.no_grad():
        eager = ours(ids).logits.float()
        CALLS.clear()
        compiled = torch.compile(ours, fullgraph=True, dynamic=False)(ids).logits.float()
    assert CALLS, "the compiled model must call our kernel"
    torch.testing.assert_close(compiled, eager, rtol=0, atol=2**-6 * eager.abs().max().item())
