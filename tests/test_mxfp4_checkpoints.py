"""MXFP4 checkpoints (gpt-oss's releases) on TPU with their experts kept in MXFP4 (ragged-dot-tpu's
mxfp4_checkpoint_config, loaded with get_kernel from the built tree). The checkpoint is saved here
as gpt-oss's are: each experts projection as `<name>_blocks` (two fp4 e2m1 codes per byte) and
`<name>_scales` (an e8m0 exponent per 32 weights), everything else as the model holds it. The
reference is transformers' own load of the same file, which dequantizes the experts off CUDA."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from counted_kernel import check_generate_batch

IMPL = "hub_ragged_dot_mxfp4"
# gpt-oss's architecture, tiny: K of both projections a multiple of 32 (hidden 128, intermediate 96).
CONFIG = dict(vocab_size=128, hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_local_experts=4,
              num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=8,
              layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """The kernel as users get it, its experts_forward registered; calls of its quantized op counted."""
    from counted_kernel import counted_kernel

    with counted_kernel("ragged_dot", "quantized_experts_forward_op", tmp_path_factory.mktemp("build")) as found:
        ALL_EXPERTS_FUNCTIONS.register(IMPL, found[0].experts_forward)
        yield found


def mxfp4_checkpoint(root, dtype=torch.float32):
    """A random gpt-oss model saved as an MXFP4 checkpoint: random codes, exponents 2^-6 .. 2^-3
    distinct per expert, output channel and 32 weights. Returns its directory and tensors."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(transformers.GptOssConfig(**CONFIG), dtype=dtype)
    model.save_pretrained(root)
    tensors, generator = {}, torch.Generator().manual_seed(1)
    for name, tensor in load_file(root / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, k, n = tensor.shape  # [E, K, N] as the model holds it; stored [E, N, K / 32, 16]
            tensors[name + "_blocks"] = torch.randint(0, 256, (experts, n, k // 32, 16), dtype=torch.uint8,
                                                      generator=generator)
            tensors[name + "_scales"] = torch.randint(121, 125, (experts, n, k // 32), dtype=torch.uint8,
                                                      generator=generator)
        else:
            tensors[name] = tensor
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((root / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (root / "config.json").write_text(json.dumps(config))
    return root, tensors


def test_the_load_lays_out_what_jax_users_lay_out(kernel):
    """The load's layout (torch) and ops.mxfp4_weights (JAX) are one layout."""
    import jax.numpy as jnp
    import numpy as np

    module, _ = kernel
    generator = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (3, 160, 3, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(0, 256, (3, 160, 3), dtype=torch.uint8, generator=generator)
    loaded = module.mxfp4_checkpoints.kernel_layout(blocks, scales)
    for got, want in zip(loaded, module.ops.mxfp4_weights(jnp.asarray(blocks.numpy()), jnp.asarray(scales.numpy()))):
        np.testing.assert_array_equal(got.numpy(), np.asarray(want))


def _load(kernel, path, dtype):
    return AutoModelForCausalLM.from_pretrained(path, config=kernel.mxfp4_checkpoint_config(path), dtype=dtype,
                                                experts_implementation=IMPL).eval()


def test_experts_stay_mxfp4_and_give_the_dequantized_models_logits(kernel, tmp_path):
    """fp32 activations: every decoded weight is exact in fp32, as in transformers' dequantized
    reference, so only summation order differs (atol 1e-4 on logits of order 1)."""
    module, calls = kernel
    path, stored = mxfp4_checkpoint(tmp_path)
    ours = _load(module, path, torch.float32)
    # transformers dequantizes the experts to bf16 whatever the dtype asked for: exact (every MXFP4
    # value is a bf16), so in fp32 they are the same weights at fp32's precision
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().float()
    experts = [m for m in ours.modules() if hasattr(m, "down_proj_scales")]
    assert len(experts) == CONFIG["num_hidden_layers"]
    for layer, module_ in enumerate(experts):  # the stored bytes, half a byte per weight, K-major
        blocks = stored[f"model.layers.{layer}.mlp.experts.down_proj_blocks"]
        assert module_.down_proj.dtype == torch.uint8 and module_.down_proj.shape == (4, 48, 128)
        assert torch.equal(module_.down_proj, blocks.reshape(4, 128, 48).transpose(1, 2))
        assert module_.gate_up_proj.dtype == torch.uint8 and module_.gate_up_proj.shape == (4, 64, 192)
        assert module_.gate_up_proj_scales.shape == (4, 32, 192)  # 4 exponents per column, padded to 32
        assert not module_.gate_up_proj.requires_grad
    assert all(p.dtype == torch.float32 for n, p in ours.named_parameters() if not n.endswith(("_proj", "_scales")))
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = reference(ids).logits
        calls.clear()
        torch.testing.assert_close(ours(ids).logits, want, rtol=0, atol=1e-4)
        assert len(calls) == len(experts), "our kernel must serve every experts layer"
        kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(ids[:1], **kwargs), reference.generate(ids[:1], **kwargs))
        torch._dynamo.reset()
        compiled = torch.compile(ours, fullgraph=True, dynamic=False)
        torch.testing.assert_close(compiled(ids).logits, want, rtol=0, atol=1e-4)


def test_generate_batch_gives_the_dequantized_models_tokens(kernel, tmp_path):
    """Served by continuous batching: the greedy tokens of transformers' dequantized load generating
    one prompt at a time (fp32: in bf16 the two serving paths' attention roundings alone can turn a
    near tie; the bf16 model's generate is checked below)."""
    module, calls = kernel
    path, _ = mxfp4_checkpoint(tmp_path)
    ours = _load(module, path, torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().float()
    check_generate_batch(ours, reference, calls, lengths=(5, 11))


def test_bf16_model_gives_the_dequantized_models_greedy_tokens(kernel, tmp_path):
    """The dtype gpt-oss is served in: the same greedy tokens as transformers' dequantized load."""
    module, _ = kernel
    path, _ = mxfp4_checkpoint(tmp_path, torch.bfloat16)
    ours = _load(module, path, torch.bfloat16)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.randint(2, 128, (1, 10), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **kwargs), reference.generate(ids, **kwargs))


def test_gradients_flow_through_the_frozen_experts(kernel, tmp_path):
    """Fine-tuning around MXFP4 experts (adapters, attention): every other parameter's gradient as
    through transformers' dequantized experts, frozen (fp32: only summation order differs); the
    experts' weights and exponents get none."""
    module, _ = kernel
    path, _ = mxfp4_checkpoint(tmp_path)
    ours = _load(module, path, torch.float32).train()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).float().train()
    for name, parameter in reference.named_parameters():
        parameter.requires_grad_(not name.endswith(("experts.gate_up_proj", "experts.down_proj")))
    ids = torch.randint(2, 128, (2, 10), generator=torch.Generator().manual_seed(6))
    for model in (ours, reference):
        model(ids).logits.pow(2).mean().backward()
    want = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    got = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    assert set(got) == set(want) and all(g is not None for g in got.values())
    for name, grad in want.items():
        assert (got[name] - grad).abs().max() <= 1e-4 * grad.abs().max(), name
    assert all(p.grad is None for n, p in ours.named_parameters() if n.endswith(("_proj", "_scales")) and
               ".experts." in n)


def test_refusals_name_what_to_do(kernel, tmp_path):
    module, _ = kernel
    path, _ = mxfp4_checkpoint(tmp_path / "mxfp4")
    ALL_EXPERTS_FUNCTIONS.register("hub_some_other_experts", lambda *args: None)
    for other in ("grouped_mm", "hub_some_other_experts"):  # transformers' own, or a function not ours
        with pytest.raises(ValueError, match=f"experts_implementation='{other}': MXFP4 experts on TPU need"):
            AutoModelForCausalLM.from_pretrained(path, config=module.mxfp4_checkpoint_config(path),
                                                 experts_implementation=other)
    ours = _load(module, path, torch.float32)
    ids = torch.randint(2, 128, (1, 6), generator=torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="quantize_experts quantizes floating-point experts"):
        module.quantize_experts(ours)
    del ours.model.layers[0].mlp.experts.down_proj_scales
    with pytest.raises(ValueError, match="need gate_up_proj_scales and down_proj_scales \\(mxfp4_checkpoint_config\\)"):
        ours(ids)
    plain = tmp_path / "plain"
    AutoModelForCausalLM.from_config(transformers.GptOssConfig(**CONFIG)).save_pretrained(plain)
    with pytest.raises(ValueError, match="quant_method is None: mxfp4_checkpoint_config reads MXFP4"):
        module.mxfp4_checkpoint_config(plain)
