"""A tiny random Qwen3.5, Qwen3.5-MoE and Qwen3-Next (kernels/seed_models.py) whose linear-attention
layers run our gated delta rule, hooked in as the card's transformers block does it: kernels'
`kernelize` under a `use_kernel_mapping` from transformers' layer names to the Hub repo's layers
(`LayerRepository`, which loads them with get_kernel, here offline from the Hub cache that
build_collection.load_from_hub lays out). Against the same model on transformers' torch code, in
fp32: logits over a batch with a left-padded row and 70 tokens (a chunk of 64 and part of one), a
prompt continued on the cache, greedy tokens, and which call ran where; and packed-sequence
training's gradients (kernelize for training) against each sequence alone.

What transformers 5.22 calls in the families' GatedDeltaNet.forward, so what this covers:
`torch_chunk_gated_delta_rule` for every forward of more than one token (prefill, and a prompt
continued on a cache, with the cached state as initial_state), and `torch_recurrent_gated_delta_rule`
for a decode step (one token with a cache): ours, once per linear-attention layer each.
`causal_conv1d_fn` (multi-token) and `causal_conv1d_update` (decode) before the rule: ours too.
"""

import copy
import re
import sys

import pytest
import torch
from kernels import LayerRepository, Mode, kernelize, use_kernel_mapping
from torch._inductor.compile_fx import compile_fx
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
from transformers.models.qwen3_next import modeling_qwen3_next

import build_collection
import seed_models
from sampling import sample  # noqa: E402

KERNEL = build_collection.load_manifest()["kernels"]["gated_delta_rule"]
REPO = KERNEL["repo-id"]
# Seed (kernels/seed_models.py) -> its modeling file. transformers' rules are modules (kernels'
# use_kernel_forward_from_hub), one per modeling file, shared by every model of the family:
# kernelize swaps their forward, so it reaches every such model.
FAMILIES = {"qwen3_5": modeling_qwen3_5, "qwen3_5_moe": modeling_qwen3_5_moe, "qwen3_next": modeling_qwen3_next}


def _rules(seed):
    """The family's hub-mapped functions (modules): the chunked and recurrent rules, then the convolutions."""
    modeling = FAMILIES[seed]
    return (modeling.torch_chunk_gated_delta_rule, modeling.torch_recurrent_gated_delta_rule,
            modeling.causal_conv1d_fn, modeling.causal_conv1d_update)


def _torch_code(rules):
    return all(rule.forward.__func__ is type(rule).forward for rule in rules)
LAYERS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update")
PAD = 5  # left padding of the batch's first row
NEW_TOKENS = 8


class OpCalls(TorchDispatchMode):
    """Records, per call of one of our ops (seen in torch's dispatch, so only if it really ran), the
    linear-attention layer it ran in, by op: {"chunk": [layers], "recurrent": [layers]}."""

    def __init__(self, qualnames, layer):
        super().__init__()
        self.qualnames, self.layer = qualnames, layer
        self.layers = {name: [] for name in qualnames.values()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = self.qualnames.get(func._schema.name)
        if name:
            self.layers[name].append(self.layer[0])
        return func(*args, **(kwargs or {}))


def _card_block(tree):
    """The card's transformers block as a Hub user reads it (the built README)."""
    usage = (tree / "README.md").read_text().split("## Usage")[1].split("\n## ")[0]
    blocks = [b for b in re.findall(r"```python\n(.*?)```", usage, re.S) if "kernelize(" in b]
    assert len(blocks) == 1, "the card's Usage shows one kernelize block"
    return blocks[0]


def _batch():
    """Two prompts of 70 tokens (not a multiple of the kernel's 64-token chunk), the first left-padded."""
    ids = torch.randint(2, 128, (2, 70), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :PAD] = 0
    return ids, mask


def _run(model, ids, mask):
    """Logits of the prompt in one forward, the logits of its last 30 tokens with the first 40 on the
    cache (transformers then passes the cached state to the rule as initial_state), greedy tokens."""
    with torch.no_grad():
        whole = model(ids, attention_mask=mask).logits
        first = model(ids[:, :40], attention_mask=mask[:, :40], use_cache=True)
        continued = model(ids[:, 40:], attention_mask=mask, past_key_values=first.past_key_values,
                          use_cache=True).logits
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                pad_token_id=0)
    return whole, continued, tokens


def _real(logits):
    """The logits at real (not padding) positions."""
    return torch.cat([logits[0, PAD:], logits[1]])


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(the kernel loaded from the built tree's Hub cache, the tree)."""
    out = tmp_path_factory.mktemp("build")
    return build_collection.load_from_hub(["gated_delta_rule"], out)["gated_delta_rule"], out / KERNEL["repo"]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hooked(request, hub):
    """(model, fallback results, fp64 logits, our ops' qualnames, linear-attention layer indices, the
    family's rules). The model's torch results are taken first: kernelize changes transformers'
    shared functions, not a copy."""
    module, tree = hub
    rules = _rules(request.param)
    namespace = sys.modules[module.__name__ + "._build"].OP_NAMESPACE
    qualnames = {f"{namespace}::chunk_gated_delta_rule": "chunk",
                 f"{namespace}::fused_recurrent_gated_delta_rule": "recurrent",
                 f"{namespace}::fused_recurrent_gated_delta_rule_in_place": "recurrent",  # a cache's own state
                 f"{namespace}::causal_conv1d_fn": "conv", f"{namespace}::causal_conv1d_update": "conv_update"}
    torch.manual_seed(0)
    # The experts' eager loop: transformers' grouped_mm has no fp64 for the exact reference.
    experts = {"experts_implementation": "eager"} if request.param in seed_models.MOE else {}
    model = AutoModelForCausalLM.from_config(seed_models.config(request.param), dtype=torch.float32,
                                             **experts).eval()
    ids, mask = _batch()
    fallback = _run(model, ids, mask)
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(ids, attention_mask=mask).logits
    # The card's calls, with the test's model for its from_pretrained line and the device "cpu" for
    # "tpu": kernelize picks the mapping's entry for the device it is given, and the model runs on
    # the CPU here (the kernel in Pallas interpret mode).
    block = _card_block(tree)
    load = re.search(r"^model = AutoModelForCausalLM\.from_pretrained\(.*\)\n", block, re.M)
    assert load, block
    block = block.replace(load.group(0), "")
    assert block.count('"tpu"') == 2, block  # the mapping's device and kernelize's
    names = {"model": model}
    exec(block.replace('"tpu"', '"cpu"'), names)
    assert names["model"] is model
    for rule, name in zip(rules, LAYERS):
        assert rule.forward.__func__ is getattr(module.layers, name).forward, ("the Hub kernel's layer", name)
    linear = [i for i, t in enumerate(model.config.layer_types) if t == "linear_attention"]
    yield model, fallback, exact, qualnames, linear, rules
    # Back to transformers' torch code for later tests in this process: no mapping, so kernelize
    # restores the functions' own forwards.
    kernelize(model, mode=Mode.INFERENCE, device="cpu")
    assert _torch_code(rules)


@pytest.fixture
def calls(hooked):
    """Our op's calls by layer, and transformers' calls of its chunked and recurrent rules."""
    model, _, _, qualnames, _, rules = hooked
    layer, counts = [None], {"chunk": 0, "recurrent": 0}
    hooks = [model.model.layers[i].linear_attn.register_forward_pre_hook(lambda m, a, i=i: layer.__setitem__(0, i))
             for i, t in enumerate(model.config.layer_types) if t == "linear_attention"]
    hooks += [f.register_forward_hook(lambda *a, name=name: counts.__setitem__(name, counts[name] + 1))
              for f, name in zip(rules[:2], ("chunk", "recurrent"))]
    with OpCalls(qualnames, layer) as ops:
        yield ops.layers, counts
    for hook in hooks:
        hook.remove()


def test_logits_match_the_torch_fallback(hooked, calls):
    model, (whole, continued, _), exact, _, linear, _ = hooked
    ops, counts = calls
    ids, mask = _batch()
    with torch.no_grad():
        ours = model(ids, attention_mask=mask).logits
        assert ops == {"chunk": linear, "recurrent": [], "conv": linear, "conv_update": []}, \
            "ours in every linear layer"
        assert counts == {"chunk": len(linear), "recurrent": 0}
        first = model(ids[:, :40], attention_mask=mask[:, :40], use_cache=True)
        ours_continued = model(ids[:, 40:], attention_mask=mask, past_key_values=first.past_key_values,
                               use_cache=True).logits
    assert ops == {"chunk": linear * 3, "recurrent": [], "conv": linear * 3, "conv_update": []}
    assert counts == {"chunk": 3 * len(linear), "recurrent": 0}
    # Tolerance: the fallback's own distance from the fp64 result, twice. The rule's outputs (ours
    # within a few 1e-6 of the largest from transformers' torch code, which is itself that far
    # from exact) go through a per-head gated RMSNorm, which scales a small head output's rounding
    # up with it, then three more layers: fp32 logits of this model are 1e-4 of the largest apart
    # from exact (measured: fallback 6.7e-4, ours 9.5e-4, ours from fallback 4.3e-4, largest 6.6).
    # A wrong state or scale moves them by O(1).
    tolerance = 2 * (_real(whole) - _real(exact)).abs().max().item()
    assert 0 < tolerance < 1e-3 * exact.abs().max().item()  # rounding, not a broken reference
    torch.testing.assert_close(_real(ours), _real(whole), rtol=0, atol=tolerance)
    # The continued prompt runs our kernel from the state our first 40 tokens left in the cache.
    torch.testing.assert_close(ours_continued, continued, rtol=0, atol=tolerance)


def test_greedy_tokens_match_the_torch_fallback(hooked, calls):
    """Prefill on our chunked kernel, each decode step on our recurrent one (one call per
    linear-attention layer each), from the states the previous step left."""
    model, (_, _, tokens), _, _, linear, _ = hooked
    ops, counts = calls
    ids, mask = _batch()
    with torch.no_grad():
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    steps = NEW_TOKENS - 1
    assert ops == {"chunk": linear, "recurrent": linear * steps, "conv": linear, "conv_update": linear * steps}
    assert counts == {"chunk": len(linear), "recurrent": steps * len(linear)}
    assert torch.equal(ours, tokens)


def _mapping():
    return {name: {"cpu": LayerRepository(repo_id=REPO, layer_name=name, version=KERNEL["version"],
                                          trust_remote_code=[REPO])}
            for name in LAYERS}


def _loss_gradients(model, weights, ids, **kwargs):
    """Each parameter's gradient of sum(logits * weights)."""
    model.zero_grad()
    (model(ids, **kwargs).logits * weights).sum().backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def test_packed_sequence_training_matches_each_sequence_alone(hooked):
    """Training on packed sequences, as transformers' DataCollatorWithFlattening feeds them (one
    row, position_ids restarting, cu_seq_lens_q and seq_idx): kernelize for training puts our
    chunked rule (forward and backward kernels) and our convolution in every linear-attention
    layer (the decode steps stay transformers'), and each parameter's gradient is the sum of
    those of the two sequences run alone on transformers' torch code (which refuses packed input)."""
    model, _, _, qualnames, linear, rules = hooked
    lengths = (100, 30)  # neither a multiple of the 64-token chunk; the first spans one and part of one
    ids = torch.randint(2, 128, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    weights = torch.randn(1, sum(lengths), model.config.vocab_size, generator=torch.Generator().manual_seed(4))
    bounds = [0, lengths[0], sum(lengths)]
    try:
        kernelize(model, mode=Mode.INFERENCE, device="cpu")  # no mapping: transformers' torch code
        assert _torch_code(rules)
        model.train()
        exact, fallback, double = {}, {}, copy.deepcopy(model).double()
        for a, b in zip(bounds, bounds[1:]):
            for sums, run, w in ((exact, double, weights.double()), (fallback, model, weights)):
                for name, grad in _loss_gradients(run, w[:, a:b], ids[:, a:b]).items():
                    sums[name] = sums.get(name, 0) + grad
        with use_kernel_mapping(_mapping()):
            kernelize(model, mode=Mode.TRAINING, device="cpu")
        assert [rule.forward.__func__ is type(rule).forward for rule in rules] == [False, True, False, True], \
            "the chunked rule and the convolution are ours, the decode steps transformers'"
        namespace = next(iter(qualnames)).split("::")[0]
        counted = {**qualnames, f"{namespace}::chunk_gated_delta_rule_vjp": "chunk_backward"}
        position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
        cu = torch.tensor(bounds, dtype=torch.int32)
        seq_idx = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))[None]
        with OpCalls(counted, [None]) as calls:
            # use_cache=False as in training: with a cache transformers does not read packing from position_ids.
            ours = _loss_gradients(model, weights, ids, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                   max_length_q=max(lengths), max_length_k=max(lengths), seq_idx=seq_idx,
                                   use_cache=False)
        assert {name: len(layers) for name, layers in calls.layers.items()} == {
            "chunk": len(linear), "chunk_backward": len(linear), "recurrent": 0, "conv": len(linear),
            "conv_update": 0}
    finally:
        model.eval()
        with use_kernel_mapping(_mapping()):
            kernelize(model, mode=Mode.INFERENCE, device="cpu")
    assert ours.keys() == exact.keys()
    # Tolerance, of each tensor's largest: 1e-3 (as the seed models' gradients, tests/test_seed_models.py),
    # or twice transformers' own fp32 code's worst distance from fp64 where that is larger. Measured:
    # ours <= 2.2e-4 (Qwen3.5) and 1.4e-3 (Qwen3-Next, whose fp32 torch code is 6.5e-3 off); a state
    # gradient not carried between chunks moves the worst to 3-15% (sequences mixed: O(1)).
    relative = lambda grads, name: ((grads[name] - exact[name]).abs().max() / exact[name].abs().max()).item()
    tolerance = max(1e-3, 2 * max(relative(fallback, name) for name in exact))
    for name in exact:
        assert relative(ours, name) <= tolerance, (name, relative(ours, name), tolerance)


# Sampled (tests/sampling.py): Qwen3.5-MoE, whose layers hold the other two families' (the experts too).
@pytest.mark.parametrize("hooked", sample(sorted(FAMILIES), {"qwen3_5_moe"}), indirect=True)
def test_bf16_model_compiles_in_one_graph(hooked):
    """kernelize for torch.compile, then torch.compile(fullgraph=True, dynamic=False) (TorchTPU's
    fast mode) over the bf16 model: our chunked rule and convolution in every linear-attention layer
    of the graph. bf16 rounds differently once fused, and these random models amplify rounding: the
    compiled model's logits must be no further from fp64's than transformers' torch code in bf16
    eager is, within 2x."""
    model, _, exact, qualnames, linear, rules = hooked
    ids, mask = _batch()
    error = lambda logits: (_real(logits).double() - _real(exact)).abs().mean().item()
    # The model itself, in bf16 for this test: kernelize reaches transformers' shared rules through
    # a model's own layers (a copy's are copies).
    weights = copy.deepcopy(model.state_dict())
    moe = any(name.endswith(".experts") for name, _ in model.named_modules())
    try:
        model.to(torch.bfloat16)
        if moe:  # the eager loop over the experts hit is data-dependent: not one graph
            model.set_experts_implementation("grouped_mm")
        kernelize(model, mode=Mode.INFERENCE, device="cpu")  # no mapping: transformers' torch code
        assert _torch_code(rules)
        with torch.no_grad():
            eager_error = error(model(ids, attention_mask=mask).logits)
        with use_kernel_mapping(_mapping()):
            kernelize(model, mode=Mode.INFERENCE | Mode.TORCH_COMPILE, device="cpu")
        assert not any(rule.forward.__func__ is type(rule).forward for rule in rules)
        graphs = []

        def inductor(graph, example_inputs):  # the graph dynamo traced, then compiled as by default
            graphs.append([str(node.target) for node in graph.graph.nodes if node.op == "call_function"])
            return compile_fx(graph, example_inputs)

        with torch.no_grad():
            compiled = torch.compile(model, backend=inductor, fullgraph=True, dynamic=False)(
                ids, attention_mask=mask).logits
    finally:
        model.float().load_state_dict(weights)
        if moe:
            model.set_experts_implementation("eager")
        with use_kernel_mapping(_mapping()):
            kernelize(model, mode=Mode.INFERENCE, device="cpu")
    (graph,) = graphs
    calls = {name: sum(target == f"{qualname.replace('::', '.')}.default" for target in graph)
             for qualname, name in qualnames.items()}
    assert calls == {"chunk": len(linear), "recurrent": 0, "conv": len(linear), "conv_update": 0}, calls
    assert error(compiled) <= 2 * eager_error, (error(compiled), eager_error)
