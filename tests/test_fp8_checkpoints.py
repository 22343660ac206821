"""FineGrainedFP8 checkpoints on TPU with their experts kept in fp8 (ragged-dot-tpu's
fp8_checkpoint_config, loaded with get_kernel from the built tree). The checkpoints are saved
here as Qwen's FP8 releases are: every projection (attention, linear attention, experts one by
one, shared expert) in float8_e4m3fn with a float32 scale per 128 x 128 block, everything else
as the model holds it. The reference is transformers' own load of the same file, which
dequantizes it off CUDA and XPU."""

import copy
import json
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
from transformers.integrations.moe import use_experts_implementation

from counted_kernel import check_generate_batch
from sampling import sample

IMPL = "hub_ragged_dot_fp8"
BLOCK = 128
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
QUANTIZED = re.compile(r"proj\w*\.weight$")  # attention, linear attention, experts, shared expert
# Dims of 128 or below or multiples of 128: transformers' dequantization (the reference) infers
# the block from the scales' grid, which is the format's 128 only then.
BASE = dict(vocab_size=128, hidden_size=256, num_hidden_layers=2, tie_word_embeddings=False, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(BASE, decoder_sparse_step=1, mlp_only_layers=[])),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(BASE, shared_expert_intermediate_size=128,
                                                 layer_types=["linear_attention", "full_attention"],
                                                 linear_num_key_heads=2, linear_num_value_heads=4,
                                                 linear_key_head_dim=64, linear_value_head_dim=64,
                                                 max_position_embeddings=256)),
}
# Compiled whole in make test: Qwen3-MoE only (Qwen3.5-MoE's linear attention takes a minute to
# compile; tests/test_seed_models.py compiles it with our kernels).
COMPILED = sample(sorted(FAMILIES), {"qwen3_moe"})


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """The kernel as users get it, its experts_forward registered for fp8 experts; calls of its
    quantized op counted."""
    from counted_kernel import counted_kernel

    with counted_kernel("ragged_dot", "quantized_experts_forward_op", tmp_path_factory.mktemp("build")) as found:
        ALL_FP8_EXPERTS_FUNCTIONS.register(IMPL, found[0].experts_forward)
        yield found


def _quantize(weight):
    """float8_e4m3fn weight and its float32 scale per 128 x 128 block (partial blocks at the edges)."""
    rows, cols = weight.shape
    grid = -(-rows // BLOCK), -(-cols // BLOCK)
    blocks = torch.nn.functional.pad(weight.float(), (0, grid[1] * BLOCK - cols, 0, grid[0] * BLOCK - rows))
    blocks = blocks.reshape(grid[0], BLOCK, grid[1], BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    quantized = (blocks / scale[:, None, :, None]).reshape(grid[0] * BLOCK, grid[1] * BLOCK)[:rows, :cols]
    return quantized.to(torch.float8_e4m3fn), scale


def fp8_checkpoint(family, dtype, root):
    """A random model of the family saved as an fp8 checkpoint; returns its directory and tensors."""
    config_class, kwargs = FAMILIES[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**kwargs), dtype=dtype)
    model.save_pretrained(root)
    tensors = {}
    for name, tensor in load_file(root / "model.safetensors").items():
        if QUANTIZED.search(name):
            tensors[name], tensors[name + "_scale_inv"] = _quantize(tensor)
        else:
            tensors[name] = tensor
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((root / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK],
                                     "activation_scheme": "dynamic"}
    (root / "config.json").write_text(json.dumps(config))
    return root, tensors


def _load(kernel, path, dtype):
    return AutoModelForCausalLM.from_pretrained(path, config=kernel.fp8_checkpoint_config(path), dtype=dtype,
                                                experts_implementation=IMPL).eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_experts_stay_fp8_and_give_the_dequantized_models_logits(family, kernel, tmp_path):
    """fp32 activations: ours reads the fp8 weights times their block scales exactly, as the
    dequantized reference does, so only summation order differs (atol 1e-4 on logits of order 1)."""
    module, calls = kernel
    path, stored = fp8_checkpoint(family, torch.float32, tmp_path)
    ours = _load(module, path, torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    experts = [m for m in ours.modules() if hasattr(m, "down_proj_scale_inv")]
    assert len(experts) == ours.config.num_hidden_layers
    for layer, module_ in enumerate(experts):  # the stored bytes, a byte per weight
        down = torch.stack([stored[f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"] for e in range(4)])
        assert module_.down_proj.dtype == torch.float8_e4m3fn and module_.down_proj.element_size() == 1
        assert torch.equal(module_.down_proj.view(torch.uint8), down.view(torch.uint8))
        assert module_.gate_up_proj.dtype == torch.float8_e4m3fn
        assert module_.gate_up_proj_scale_inv.shape == (4, 2, 2)  # gate's blocks then up's
    assert all(p.dtype == torch.float32 for n, p in ours.named_parameters() if ".experts." not in n)
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(ids).logits
        calls.clear()
        torch.testing.assert_close(ours(ids).logits, want, rtol=0, atol=1e-4)
        assert len(calls) == len(experts), "our kernel must serve every experts layer"
        kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(ids[:1], **kwargs), reference.generate(ids[:1], **kwargs))
        if family not in COMPILED:
            return
        torch._dynamo.reset()
        compiled = torch.compile(ours, fullgraph=True, dynamic=False)
        torch.testing.assert_close(compiled(ids).logits, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("gate", ["default", "swiglu_alpha", "alpha_only", "limit_only"])
def test_fp8_experts_gate_as_transformers_does(gate, kernel):
    """transformers' FP8 experts gate by their config (gpt-oss's clamped SwiGLU with swiglu_alpha;
    a clamp before the activation with swiglu_limit alone, which we refuse by name, as swiglu_alpha
    alone, which their own gate cannot run): ours against their own forward over the weights
    dequantized (fp32; their eager loop takes full-precision weights without a kernel)."""
    module, _ = kernel
    config = transformers.Qwen3MoeConfig(**FAMILIES["qwen3_moe"][1])
    config._experts_implementation = IMPL
    config.swiglu_alpha, config.swiglu_limit = {"default": (None, None), "swiglu_alpha": (1.702, 0.5),
                                                "alpha_only": (1.702, None), "limit_only": (None, 0.5)}[gate]
    experts_class = use_experts_implementation(experts_class=FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    ours = experts_class(config, block_size=[BLOCK, BLOCK])
    reference = experts_class(copy.copy(config), block_size=[BLOCK, BLOCK])
    reference.config._experts_implementation = "eager"  # transformers' own loop
    torch.manual_seed(0)
    for name in ("gate_up_proj", "down_proj"):
        weight = torch.randn(getattr(ours, name).shape)
        quantized, scales = zip(*(_quantize(w) for w in weight))
        setattr(ours, name, torch.nn.Parameter(torch.stack(quantized), requires_grad=False))
        setattr(ours, name + "_scale_inv", torch.nn.Parameter(torch.stack(scales), requires_grad=False))
        dequantized = torch.stack(quantized).float() * torch.stack(scales).repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)
        setattr(reference, name, torch.nn.Parameter(dequantized))
    hidden = torch.randn(6, config.hidden_size)
    index = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    weights = torch.rand(6, 2)
    with torch.no_grad():
        if gate in ("limit_only", "alpha_only"):
            refused = {"limit_only": "swiglu_limit without swiglu_alpha", "alpha_only": "swiglu_alpha without swiglu_limit"}
            with pytest.raises(NotImplementedError, match=refused[gate]):
                ours(hidden, index, weights)
            return
        want = reference(hidden, index, weights)
        # fp32 both, the same weights exactly: summation order only (1e-5 of the largest output)
        torch.testing.assert_close(ours(hidden, index, weights), want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_bf16_checkpoint_serves_generate_batch(kernel, tmp_path):
    """A bf16 model's fp8 checkpoint loaded in bf16, as users load Qwen3-30B-A3B-FP8, served by
    continuous batching: the greedy tokens of transformers' dequantized load, one prompt at a time."""
    module, calls = kernel
    path, _ = fp8_checkpoint("qwen3_moe", torch.bfloat16, tmp_path)
    ours = _load(module, path, torch.bfloat16)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    assert {p.dtype for n, p in ours.named_parameters() if n.endswith("proj")} == {torch.float8_e4m3fn}
    check_generate_batch(ours, reference, calls)


def test_what_it_cannot_load_is_named_before_any_weight(kernel, tmp_path):
    module, _ = kernel
    path, _ = fp8_checkpoint("qwen3_moe", torch.float32, tmp_path / "fp8")
    with pytest.raises(ValueError, match="experts_implementation='grouped_mm': fp8 experts on TPU need"):
        AutoModelForCausalLM.from_pretrained(path, config=module.fp8_checkpoint_config(path),
                                             experts_implementation="grouped_mm")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"weight_block_size is \[64, 64\]"):
        _load(module, path, torch.float32)
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method is None: fp8_checkpoint_config reads FineGrainedFP8"):
        module.fp8_checkpoint_config(path)
