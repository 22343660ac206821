"""Tiny random-weight transformers MoE models of every family our experts
forward serves: its logits, greedy tokens and parameter gradients against
the eager experts implementation."""

import copy
import math

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

import ragged_dot
from sampling import sample  # noqa: E402

IMPL = "ragged_dot_tpu_test"
CALLS = []


def _counted_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    CALLS.append(type(self).__name__)
    return ragged_dot.experts_forward(self, hidden_states, top_k_index, top_k_weights)


ALL_EXPERTS_FUNCTIONS.register(IMPL, _counted_experts_forward)

BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, tie_word_embeddings=False)
ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TWO_LAYER_TYPES = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
# Config class name -> kwargs, found to build tiny models whose every MoE
# layer uses transformers' experts interface.
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(BASE, **ATTENTION, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[])),
    "mixtral": ("MixtralConfig", dict(BASE, **ATTENTION, num_local_experts=8, num_experts_per_tok=2,
                                      intermediate_size=32)),
    "olmoe": ("OlmoeConfig", dict(BASE, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
                                  num_experts=8, num_experts_per_tok=2, pad_token_id=0, eos_token_id=1)),
    "gemma4": ("Gemma4TextConfig", dict(BASE, **ATTENTION, **TWO_LAYER_TYPES, intermediate_size=32,
                                        global_head_dim=16, hidden_activation="gelu_pytorch_tanh",
                                        enable_moe_block=True, num_experts=8, top_k_experts=2,
                                        moe_intermediate_size=32, hidden_size_per_layer_input=0,
                                        vocab_size_per_layer_input=128, max_position_embeddings=256)),
    "gpt_oss": ("GptOssConfig", dict(BASE, **ATTENTION, **TWO_LAYER_TYPES, intermediate_size=32,
                                     num_local_experts=8, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", dict(BASE, intermediate_size=32, moe_intermediate_size=32,
                                             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                                             n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                             first_k_dense_replace=0, q_lora_rank=32, kv_lora_rank=16,
                                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                             max_position_embeddings=256)),
    "nemotron_h": ("NemotronHConfig", dict(hidden_size=64, vocab_size=128, tie_word_embeddings=False,
                                           layers_block_type=["full_attention", "moe"], **ATTENTION,
                                           intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                                           n_group=1, topk_group=1, max_position_embeddings=256)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(BASE, **ATTENTION, num_experts=8, num_experts_per_tok=2,
                                                 moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                                 layer_types=["full_attention", "full_attention"],
                                                 max_position_embeddings=256)),
}


def _models(family, dtype=torch.float32):
    """(ours, eager): one random model, copied, differing only in experts
    implementation. Biases are randomised (transformers inits them to 0)."""
    config_class, kwargs = FAMILIES[family]
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**kwargs), dtype=dtype,
                                            experts_implementation=IMPL).eval()
    experts = [m for m in ours.modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")]
    assert experts, f"{family}: no experts module"
    with torch.no_grad():
        for module in experts:
            for name, param in module.named_parameters():
                if name.endswith("_bias"):
                    param.normal_(0, 0.1)
    eager = copy.deepcopy(ours)
    eager.set_experts_implementation("eager")
    return ours, eager, len(experts)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_greedy_tokens_match_eager_fp32(family):
    ours, eager, num_experts_modules = _models(family)
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    CALLS.clear()
    with torch.no_grad():
        diff = (ours(ids).logits - eager(ids).logits).abs().max().item()
        assert len(CALLS) == num_experts_modules, "our experts forward must serve every MoE layer"
        # fp32 end to end; only summation order differs from eager.
        assert diff < 1e-4, diff
        kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(ids[:1], **kwargs), eager.generate(ids[:1], **kwargs))


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "nemotron_h", "qwen3_moe"])
def test_parameter_gradients_match_eager(family):
    ours, eager, _ = _models(family)
    ours.train(), eager.train()
    ids = torch.randint(2, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    _assert_gradients_match(ours, eager, ids)


def _assert_gradients_match(ours, eager, ids):
    """Both models' parameter gradients of the LM loss on `ids`: fp32, within 1e-4 relative to the
    largest gradient of each tensor; where ours holds a tensor padded (pad_experts), zeros past eager's."""
    for model in (ours, eager):
        model(ids, labels=ids).loss.backward()
    for (name, p), (_, q) in zip(ours.named_parameters(), eager.named_parameters()):
        if q.grad is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None, name
        torch.testing.assert_close(_within(p.grad, q.shape, name), q.grad, rtol=0,
                                   atol=1e-4 * max(1.0, q.grad.abs().max().item()), msg=name)


def test_bf16_model_close_to_fp32_eager():
    """bf16 weights and activations against eager run in fp32 on the same
    weights: the error is bf16 rounding through two layers, bounded loosely
    (5e-2 of the logits' scale), far below a wrong answer (order 1)."""
    ours, eager, _ = _models("mixtral", torch.bfloat16)
    eager = eager.float()
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = ours(ids).logits.float(), eager(ids).logits
    assert (got - want).abs().max().item() < 5e-2 * want.abs().max().item()


@pytest.fixture(scope="module")
def hub_experts(tmp_path_factory):
    """experts_forward as users get it: the built tree laid out as a Hub cache, loaded with
    get_kernel (offline: the trust check is skipped) and registered with transformers under its
    own name. Calls of its op are counted."""
    from counted_kernel import counted_kernel

    with counted_kernel("ragged_dot", "experts_forward_op", tmp_path_factory.mktemp("build")) as (module, calls):
        ALL_EXPERTS_FUNCTIONS.register("hub_ragged_dot", module.experts_forward)
        yield "hub_ragged_dot", calls


# Sampled (tests/sampling.py): Qwen3-MoE's, Mixtral's and Nemotron-H's (ungated) experts;
# tests/test_seed_models.py compiles Gemma 4 MoE, Qwen3.5-MoE and gpt-oss (interleaved, biases) with
# our kernels; the others repeat these.
@pytest.mark.parametrize("family", sample(sorted(FAMILIES), {"qwen3_moe", "mixtral", "nemotron_h"}))
def test_whole_model_compiles_in_one_graph(family, hub_experts):
    """torch.compile(fullgraph=True, dynamic=False), TorchTPU's fast mode, over the whole model
    with the experts forward loaded by get_kernel from the built tree: one graph (any break
    raises), our op in it for every MoE layer, the eager logits (fp32; only summation order
    differs)."""
    name, calls = hub_experts
    ours, eager, num_experts_modules = _models(family)
    ours.set_experts_implementation(name)
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    calls.clear()
    with torch.no_grad():
        compiled = torch.compile(ours, fullgraph=True, dynamic=False)(ids).logits
        assert len(calls) == num_experts_modules, "the compiled graph must call our experts op in every MoE layer"
        torch.testing.assert_close(compiled, eager(ids).logits, rtol=0, atol=1e-4)


def test_gpt_oss_clamp_active():
    """gpt-oss clamps its gate and up projections at `limit` (7 in the real model, never
    reached by a tiny random one): at limit 0.05 most values are clamped, and ours still
    gives the eager logits."""
    ours, eager, _ = _models("gpt_oss")
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        unclamped = eager(ids).logits
        for model in (ours, eager):
            for module in model.modules():
                if hasattr(module, "limit"):
                    module.limit = 0.05
        want = eager(ids).logits
        assert (want - unclamped).abs().max() > 1e-2, "the clamp must change the logits for this test to guard it"
        torch.testing.assert_close(ours(ids).logits, want, rtol=0, atol=1e-4)


def _dequantized_into(eager, ours):
    """eager's experts weights set to ours' quantized ones times their scales (fp32): the model
    ours is, dequantized. int4 (uint8, two codes per byte along K, held K-major): each nibble
    sign-extended, times its group's scale, laid out as eager holds the weight. Past eager's shape
    (down_proj zero-padded) ours must hold zeros."""
    pairs = [(e, o) for e, o in zip(eager.modules(), ours.modules()) if hasattr(o, "down_proj_scale_inv")]
    with torch.no_grad():
        for e, o in pairs:
            out_axis = 2 if o.is_transposed else 1
            for name in ("gate_up_proj" if o.has_gate else "up_proj", "down_proj"):
                weight, scale = getattr(o, name), getattr(o, name + "_scale_inv")
                if weight.dtype == torch.uint8:
                    nibbles = torch.stack([weight & 15, weight >> 4], dim=2).flatten(1, 2).to(torch.int32)
                    codes = torch.where(nibbles >= 8, nibbles - 16, nibbles).float()  # [E, K, N]
                    k_major = codes * scale.repeat_interleave(codes.shape[1] // scale.shape[1], dim=1)
                    dequantized = k_major if e.is_transposed else k_major.transpose(1, 2)
                else:
                    dequantized = weight.float() * scale.unsqueeze(3 - out_axis)
                getattr(e, name).copy_(_within(dequantized, getattr(e, name).shape, name))
    return len(pairs)


def _within(tensor, shape, name):
    """`tensor`'s leading `shape` (ours: down_proj zero-padded past eager's), all past it zeros."""
    held = tuple(slice(0, n) for n in shape)
    past = tensor.clone()
    past[held] = 0
    assert not past.any(), f"{name}: past eager's shape {tuple(shape)}, ours must hold zeros"
    return tensor[held]


@pytest.mark.parametrize("family,dtype", [("gpt_oss", torch.int8), ("qwen3_5_moe", torch.float8_e4m3fn),
                                          ("gemma4", torch.int8),
                                          ("qwen3_moe", torch.int8), ("qwen3_moe", torch.int4),
                                          ("gpt_oss", torch.int4)])
def test_quantized_experts_match_their_dequantized_model(family, dtype, hub_experts):
    """kernel.quantize_experts (loaded with get_kernel from the built tree) turns every experts
    module's weights into a byte each with a float32 scale per expert and output channel (int4:
    half a byte, a scale per 32 weights along the contraction); the model then gives the logits
    and greedy tokens of transformers' eager experts on the same weights dequantized (fp32; only
    summation order differs), compiled whole in one graph too. down_proj is held zero-padded."""
    import sys

    name, _ = hub_experts
    kernel = sys.modules[ALL_EXPERTS_FUNCTIONS[name].__module__.rsplit(".", 1)[0]]
    ours, eager, num_experts_modules = _models(family)
    ours.set_experts_implementation(name)
    # Weights to hold: down_proj's dims zero-padded to multiples of 128 (64 and 32 here).
    padded = lambda shape: math.prod(-(-n // 128) * 128 if axis else n for axis, n in enumerate(shape))
    weights_held = sum(padded(p.shape) if n == "down_proj" else p.numel() for m in ours.modules()
                       if hasattr(m, "has_gate") for n, p in m.named_parameters() if n.endswith("proj"))
    assert kernel.quantize_experts(ours, dtype, group_size=32) == num_experts_modules
    assert _dequantized_into(eager, ours) == num_experts_modules
    quantized = [p for m in ours.modules() if hasattr(m, "has_gate") for n, p in m.named_parameters() if n.endswith("proj")]
    held = torch.uint8 if dtype == torch.int4 else dtype  # int4: two codes per byte
    assert {p.dtype for p in quantized} == {held} and not any(p.requires_grad for p in quantized)
    per_weight = 0.5 if dtype == torch.int4 else 1  # bytes
    assert sum(p.numel() * p.element_size() for p in quantized) == weights_held * per_weight
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = eager(ids).logits
        torch.testing.assert_close(ours(ids).logits, want, rtol=0, atol=1e-4)
        kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(ids[:1], **kwargs), eager.generate(ids[:1], **kwargs))
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(ours, fullgraph=True, dynamic=False)(ids).logits, want,
                                   rtol=0, atol=1e-4)


def test_quantized_experts_without_their_scales_are_named():
    """A quantized weight without its scales, or with scales of the wrong shape: an error naming
    the module's tensor, before any kernel runs."""
    ours, _, _ = _models("qwen3_moe")
    ragged_dot.quantize_experts(ours)
    experts = next(m for m in ours.modules() if hasattr(m, "down_proj_scale_inv"))
    ids = torch.randint(2, 128, (1, 4), generator=torch.Generator().manual_seed(1))
    scale = experts.down_proj_scale_inv
    experts.down_proj_scale_inv = torch.nn.Parameter(scale[:, :-1], requires_grad=False)
    with torch.no_grad(), pytest.raises(ValueError, match="down_proj_scale_inv must be float32"):
        ours(ids)
    del experts.down_proj_scale_inv
    with torch.no_grad(), pytest.raises(ValueError, match="need gate_up_proj_scale_inv and down_proj_scale_inv"):
        ours(ids)


@pytest.mark.parametrize("family", ["gemma4", "gpt_oss"])
def test_padded_experts_match_eager(family, hub_experts):
    """kernel.pad_experts (loaded with get_kernel from the built tree) zero-pads every experts
    module's down_proj to multiples of 128 (here [8, 64, 32], gpt-oss's transposed with a bias,
    to [8, 128, 128]); the model then gives the eager logits of the unpadded one, compiled whole
    too, and its parameter gradients (the padding's zero, so training keeps it zero)."""
    import sys

    name, _ = hub_experts
    kernel = sys.modules[ALL_EXPERTS_FUNCTIONS[name].__module__.rsplit(".", 1)[0]]
    ours, eager, num_experts_modules = _models(family)
    ours.set_experts_implementation(name)
    assert kernel.pad_experts(ours) == num_experts_modules
    assert {tuple(m.down_proj.shape) for m in ours.modules() if hasattr(m, "has_gate")} == {(8, 128, 128)}
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = eager(ids).logits
        torch.testing.assert_close(ours(ids).logits, want, rtol=0, atol=1e-4)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(ours, fullgraph=True, dynamic=False)(ids).logits, want,
                                   rtol=0, atol=1e-4)
    ours.train(), eager.train()
    _assert_gradients_match(ours, eager, ids)
    quantized, _, _ = _models("qwen3_moe")
    kernel.quantize_experts(quantized, torch.int4, group_size=32)
    with pytest.raises(ValueError, match="pad_experts pads floating-point experts"):
        kernel.pad_experts(quantized)


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int8"])
def test_decode_steps_run_the_fused_kernel(quantized, hub_experts):
    """A Qwen3-MoE whose expert dims are multiples of 128, loaded with get_kernel, generating one
    sequence: its decode steps (one token) run the experts as one kernel (ragged_dot/fused.py; the
    built tree's kernel counted as it is traced), its prefill the grouped path, and greedy
    generation gives eager's tokens (fp32 logits within 1e-4 at every step). Quantized: after
    the kernel's `quantize_experts` (int8, a scale per output channel), against eager on the same
    weights dequantized."""
    import sys

    name, calls = hub_experts
    package = ALL_EXPERTS_FUNCTIONS[name].__module__.rsplit(".", 1)[0]
    kernel_module, fused = sys.modules[package], sys.modules[package + ".fused"]
    config_class, kwargs = FAMILIES["qwen3_moe"]
    kwargs = dict(kwargs, hidden_size=128, moe_intermediate_size=128)
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**kwargs), dtype=torch.float32,
                                            experts_implementation=name).eval()
    eager = copy.deepcopy(ours)
    eager.set_experts_implementation("eager")
    if quantized:
        assert kernel_module.quantize_experts(ours) == kwargs["num_hidden_layers"]
        assert _dequantized_into(eager, ours) == kwargs["num_hidden_layers"]
    kernel, traced = fused.fused_experts, []  # each call's live experts: top_k of them for one token
    fused.fused_experts = lambda x, live, *a, **k: traced.append(live.shape[0]) or kernel(x, live, *a, **k)
    try:
        ids = torch.randint(2, 128, (1, 9), generator=torch.Generator().manual_seed(5))
        options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                       return_dict_in_generate=True)
        with torch.no_grad():
            calls.clear()
            got = ours.generate(ids, **options)
            assert calls or quantized, "our experts op must serve the model"  # (the quantized op is not counted)
            want = eager.generate(ids, **options)
    finally:
        fused.fused_experts = kernel
    assert traced and set(traced) == {kwargs["num_experts_per_tok"]}, traced  # decode steps only
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=f"step {step}")
