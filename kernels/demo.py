"""The main job (`make demo`): build every kernel, load each the way users do
(`get_kernel(..., version=N)`, offline from a Hub cache made from build/),
run it inside tiny random-weight transformers models against transformers'
eager implementation (experts, or attention), and compile it for each TPU
generation with libtpu (the gated delta rule in a tiny Qwen3.5's linear-attention layers, put
there by kernels' kernelize). Then three at once in a tiny Gemma 4 MoE (the
architecture of Gemma 4 26B-A4B: head_dim 256 sliding and 512 global
layers, K read as V, experts at unaligned sizes): experts and attention
against eager, and a serving run on paged attention (kernels/serving_loop.py)
against generate.

Everything runs on this machine's CPU: the kernels run in Pallas interpret
mode, and "compiles for" means libtpu's compilers accepted the kernel for
that chip (no TPU executes anything here).
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

# Read at import by jax, torch, huggingface_hub and kernels: set them first.
os.environ.update(JAX_PLATFORMS="cpu", TORCH_DEVICE_BACKEND_AUTOLOAD="0", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
HUB_CACHE = Path(tempfile.mkdtemp(prefix="demo-hub-cache-"))
os.environ.update(HF_HUB_OFFLINE="1", KERNELS_CACHE=str(HUB_CACHE))

import build_collection  # noqa: E402
import tpu_compile  # noqa: E402

tpu_compile.configure_environment()


def tiny_moe_models(dtype):
    """Tiny random configs of two model families our experts layout serves."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_experts_per_tok=2, tie_word_embeddings=False)
    return {
        "Qwen3-MoE": lambda: Qwen3MoeConfig(**common, num_experts=8, moe_intermediate_size=32,
                                            decoder_sparse_step=1, mlp_only_layers=[]),
        "Mixtral": lambda: MixtralConfig(**common, num_local_experts=8, intermediate_size=32),
    }


def check_in_models(kernel) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register("tpu_ragged_dot", kernel.experts_forward)
    rows = []
    for family, config in tiny_moe_models(torch.float32).items():
        models = {}
        for impl in ("tpu_ragged_dot", "eager"):
            torch.manual_seed(0)
            models[impl] = AutoModelForCausalLM.from_config(
                config(), dtype=torch.float32, experts_implementation=impl).eval()
        ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            logits = {impl: m(ids).logits for impl, m in models.items()}
            tokens = {impl: m.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
                      for impl, m in models.items()}
        rows.append({
            "model": f"tiny {family} (fp32)",
            "max_logit_diff": (logits["tpu_ragged_dot"] - logits["eager"]).abs().max().item(),
            "tokens_identical": torch.equal(tokens["tpu_ragged_dot"], tokens["eager"]),
        })
    return rows


def compiles_for(kernel) -> list[str]:
    """Generations whose libtpu compiler accepts the loaded kernel's experts
    forward at Qwen3-30B-A3B's expert shapes, decode (64 tokens)."""
    import jax.numpy as jnp
    from runtime.generations import GENERATIONS

    ops = sys.modules[kernel.__name__ + ".ops"]
    tokens, hidden, inter, experts, top_k = 64, 2048, 768, 128, 8
    specs = [((tokens, hidden), jnp.bfloat16), ((tokens, top_k), jnp.int32), ((tokens, top_k), jnp.bfloat16),
             ((experts, 2 * inter, hidden), jnp.bfloat16), ((experts, hidden, inter), jnp.bfloat16)]
    ok = []
    for generation in GENERATIONS:
        def forward(*args, generation=generation):
            return ops.experts_forward(*args, generation=generation, interpret=False)
        try:
            tpu_compile.compile_for(forward, specs, generation, "ragged_dot_tpu")
            ok.append(generation)
        except Exception as err:  # report, don't hide: the table shows what failed
            print(f"  {generation}: does not compile: {str(err).splitlines()[0][:200]}")
    return ok


def tiny_attention_models():
    """Tiny random configs: GQA (Llama), and softcap with a sliding window (Gemma 2)."""
    from transformers import Gemma2Config, LlamaConfig

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, intermediate_size=64,
                  tie_word_embeddings=False)
    return {
        "Llama": lambda: LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        "Gemma 2": lambda: Gemma2Config(**common, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        sliding_window=8, attn_logit_softcapping=5.0),
    }


def check_attention_in_models(kernel, repo_id: str) -> list[dict]:
    """attn_implementation=<our repo> (transformers loads it with get_kernel)
    against transformers' eager attention, on a left-padded batch."""
    import torch
    from transformers import AutoModelForCausalLM

    rows = []
    for family, config in tiny_attention_models().items():
        models = {}
        for impl in (repo_id, "eager"):
            torch.manual_seed(0)
            models[impl] = AutoModelForCausalLM.from_config(config(), dtype=torch.float32,
                                                            attn_implementation=impl).eval()
        ids = torch.randint(2, 128, (2, 20), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        mask[0, :5] = 0
        with torch.no_grad():
            logits = {impl: m(ids, attention_mask=mask).logits for impl, m in models.items()}
            tokens = {impl: m.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
                      for impl, m in models.items()}
        rows.append({
            "model": f"tiny {family} (fp32)",
            "max_logit_diff": (logits[repo_id] - logits["eager"])[mask.bool()].abs().max().item(),
            "tokens_identical": torch.equal(tokens[repo_id], tokens["eager"]),
        })
    return rows


def attention_compiles_for(kernel) -> list[str]:
    """Generations whose libtpu compiler accepts the loaded kernel's forward
    and backward at Llama-3-8B's attention shapes (32 query heads, 8 KV
    heads, head_dim 128), 2048 causal tokens."""
    import jax
    import jax.numpy as jnp
    from runtime.generations import GENERATIONS

    ops = sys.modules[kernel.__name__ + ".ops"]
    tokens = 2048
    specs = [((tokens, 32, 128), jnp.bfloat16), ((tokens, 8, 128), jnp.bfloat16), ((tokens, 8, 128), jnp.bfloat16),
             ((2,), jnp.int32)]
    ok = []
    for generation in GENERATIONS:
        def forward_backward(q, k, v, cu, generation=generation):
            attend = lambda q, k, v: ops.flash_attention_varlen(q, k, v, cu, cu, causal=True, generation=generation,
                                                                interpret=False)
            return jax.vjp(attend, q, k, v)[1](q)
        try:
            tpu_compile.compile_for(forward_backward, specs, generation, "flash_attention")
            ok.append(generation)
        except Exception as err:  # report, don't hide: the table shows what failed
            print(f"  {generation}: does not compile: {str(err).splitlines()[0][:200]}")
    return ok


def check_seed_model(kernels: dict, repos: dict) -> list[dict]:
    """A tiny Gemma 4 MoE with our experts and flash attention against eager experts and attention
    (left-padded batch), then served by our loop on paged attention (4 requests joining at
    different steps, chunked prefill) against generate, one prompt at a time."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    import seed_models
    import serving_loop

    ALL_EXPERTS_FUNCTIONS.register("tpu_ragged_dot", kernels["ragged_dot"].experts_forward)
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(seed_models.config("gemma4_moe"), dtype=torch.float32,
                                            attn_implementation=repos["flash_attention"],
                                            experts_implementation="tpu_ragged_dot").eval()
    eager = copy.deepcopy(ours)
    eager.set_attn_implementation("eager")
    eager.set_experts_implementation("eager")
    ids = torch.randint(2, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    generate = lambda model, ids, mask, n: model.generate(ids, attention_mask=mask, max_new_tokens=n,
                                                         do_sample=False, pad_token_id=0)
    with torch.no_grad():
        diff = (ours(ids, attention_mask=mask).logits - eager(ids, attention_mask=mask).logits)[mask.bool()]
        same = torch.equal(generate(ours, ids, mask, 16), generate(eager, ids, mask, 16))
    rows = [{"model": "tiny Gemma 4 MoE: experts + attention (fp32)", "max_logit_diff": diff.abs().max().item(),
             "tokens_identical": same}]

    serving_loop.register()
    make = lambda n, seed: torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    requests = [serving_loop.Request(make(5, 1), 3, joins_at=0), serving_loop.Request(make(19, 2), 8, joins_at=0),
                serving_loop.Request(make(12, 3), 7, joins_at=1), serving_loop.Request(make(3, 4), 4, joins_at=4)]
    with torch.no_grad():
        expected = [generate(eager, torch.tensor([r.prompt]), None, r.max_new_tokens)[0, len(r.prompt):].tolist()
                    for r in requests]
    ours.set_attn_implementation(serving_loop.ATTENTION)
    steps = serving_loop.serve(ours, kernels["paged_attention"], requests)
    rows.append({"model": f"tiny Gemma 4 MoE: experts + paged, {len(requests)} requests served in {steps} steps",
                 "max_logit_diff": None, "tokens_identical": [r.generated for r in requests] == expected})
    return rows


def seed_compiles_for(kernels: dict) -> list[str]:
    """Generations whose libtpu compiler accepts Gemma 4 26B-A4B's global-layer attention on paged
    attention (16 query heads, 2 KV heads, head_dim 512, bf16 cache) for 64 decoding sequences of up
    to 1024 tokens, and its experts forward (hidden 2112, expert intermediate 704: not multiples of
    128) at batch 64."""
    import jax.numpy as jnp
    from runtime.generations import GENERATIONS

    paged = sys.modules[kernels["paged_attention"].__name__ + ".ops"]
    experts = sys.modules[kernels["ragged_dot"].__name__ + ".ops"]
    seqs, page_size, pages_per_seq, num_pages = 64, 16, 64, 1024
    cache = (paged.cache_shape(num_pages, page_size, 2, 512), jnp.bfloat16, paged.cache_major_to_minor(2))
    attention_specs = [((seqs, 16, 512), jnp.bfloat16), cache, cache, ((seqs,), jnp.int32),
                       ((seqs, pages_per_seq), jnp.int32), ((seqs + 1,), jnp.int32), ((), jnp.int32)]
    tokens, hidden, inter, num_experts, top_k = 64, 2112, 704, 128, 8
    experts_specs = [((tokens, hidden), jnp.bfloat16), ((tokens, top_k), jnp.int32),
                     ((tokens, top_k), jnp.bfloat16), ((num_experts, 2 * inter, hidden), jnp.bfloat16),
                     ((num_experts, hidden, inter), jnp.bfloat16)]
    ok = []
    for generation in GENERATIONS:
        def attend(*args, generation=generation):
            return paged.ragged_paged_attention(*args, generation=generation, interpret=False)

        def forward(*args, generation=generation):
            return experts.experts_forward(*args, activation="gelu_tanh", generation=generation, interpret=False)
        try:
            tpu_compile.compile_for(attend, attention_specs, generation, "ragged_paged_attention")
            tpu_compile.compile_for(forward, experts_specs, generation, "ragged_dot_tpu")
            ok.append(generation)
        except Exception as err:  # report, don't hide: the table shows what failed
            print(f"  {generation}: does not compile: {str(err).splitlines()[0][:200]}")
    return ok


GATED_DELTA_RULE_LAYERS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn",
                           "causal_conv1d_update")


def check_gated_delta_rule_in_model(kernel, repo_id: str) -> list[dict]:
    """A tiny Qwen3.5 whose linear-attention layers run the gated delta rule kernels, put in place by
    kernels' kernelize as the card shows (device "cpu" here, "tpu" on a TPU), against the same
    model on transformers' torch code; then the torch code back."""
    import torch
    from kernels import LayerRepository, Mode, kernelize, use_kernel_mapping
    from transformers import AutoModelForCausalLM

    import seed_models

    version = build_collection.load_manifest()["kernels"]["gated_delta_rule"]["version"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(seed_models.config("qwen3_5"), dtype=torch.float32).eval()
    ids = torch.randint(2, 128, (1, 70), generator=torch.Generator().manual_seed(1))

    def run():
        with torch.no_grad():
            return model(ids).logits, model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)

    torch_logits, torch_tokens = run()
    with torch.no_grad():  # the tolerance: twice transformers' own fp32 distance from fp64 (its gated norms amplify)
        exact = copy.deepcopy(model).double()(ids).logits
    tolerance = 2 * (torch_logits - exact).abs().max().item()
    # kernelize names every hub-decorated layer it leaves alone (the norms, the activations): quiet here.
    logging.getLogger("kernels").setLevel(logging.ERROR)
    mapping = {name: {"cpu": LayerRepository(repo_id=repo_id, layer_name=name, version=version,
                                             trust_remote_code=[repo_id])} for name in GATED_DELTA_RULE_LAYERS}
    with use_kernel_mapping(mapping):
        kernelize(model, mode=Mode.INFERENCE, device="cpu")
    logits, tokens = run()
    kernelize(model, mode=Mode.INFERENCE, device="cpu")  # no mapping: transformers' torch code again
    return [{"model": "tiny Qwen3.5 (fp32, vs its torch rule)",
             "max_logit_diff": (logits - torch_logits).abs().max().item(),
             "tokens_identical": torch.equal(tokens, torch_tokens), "tolerance": tolerance}]


def gated_delta_rule_compiles_for(kernel) -> list[str]:
    """Generations whose libtpu compiler accepts both kernels at Qwen3.5-9B's linear attention (16
    q/k heads, 32 value heads, head dims 128, bf16): a 1024-token prefill and a 64-sequence decode
    step."""
    import jax.numpy as jnp
    from runtime.generations import GENERATIONS

    ops = sys.modules[kernel.__name__ + ".ops"]
    hk, hv, d = 16, 32, 128

    def specs(batch, tokens):
        return [((batch, tokens, hk, d), jnp.bfloat16)] * 2 + [
            ((batch, tokens, hv, d), jnp.bfloat16), ((batch, tokens, hv), jnp.float32),
            ((batch, tokens, hv), jnp.bfloat16), ((batch, hv, d, d), jnp.float32)]

    ok = []
    for generation in GENERATIONS:
        try:
            for fn, args in ((ops.chunk_gated_delta_rule, specs(1, 1024)),
                             (ops.fused_recurrent_gated_delta_rule, specs(64, 1))):
                tpu_compile.compile_for(
                    lambda q, k, v, g, b, h0, fn=fn: fn(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                                        use_qk_l2norm_in_kernel=True, interpret=False),
                    args, generation, "gated_delta_rule")
            ok.append(generation)
        except Exception as err:  # report, don't hide: the table shows what failed
            print(f"  {generation}: does not compile: {str(err).splitlines()[0][:200]}")
    return ok


# Per kernel in build.toml: what the demo runs once the kernel is loaded.
DEMOS = {
    "ragged_dot": (lambda kernel, repo_id: check_in_models(kernel), compiles_for),
    "flash_attention": (check_attention_in_models, attention_compiles_for),
    "gated_delta_rule": (check_gated_delta_rule_in_model, gated_delta_rule_compiles_for),
}


def main() -> int:
    start = time.perf_counter()
    manifest = build_collection.load_manifest()
    print("Building the Hub repo trees ...", flush=True)
    trees = build_collection.build_all()
    build_collection.make_hub_cache(trees, HUB_CACHE)

    from kernels import get_kernel

    table, failed, kernels, repos = [], False, {}, {}

    def report(kernel_name, variant, rows, generations):
        nonlocal failed
        for row in rows:
            diff = row["max_logit_diff"]
            failed |= not row["tokens_identical"] or (diff is not None and diff > row.get("tolerance", 1e-4))
            table.append((kernel_name, variant, row["model"], "-" if diff is None else f"{diff:.2e}",
                          "yes" if row["tokens_identical"] else "NO", ", ".join(generations) or "none"))

    for key, entry in manifest["kernels"].items():
        print(f"Loading {entry['repo-id']} v{entry['version']} with get_kernel (offline) ...", flush=True)
        kernels[key] = kernel = get_kernel(entry["repo-id"], version=entry["version"])
        repos[key] = entry["repo-id"]
        variant = Path(kernel.__file__).parent.parent.name
        if key not in DEMOS:
            print(f"  loaded {variant}; its demo is the seed model below")
            continue
        check, compiles = DEMOS[key]
        print(f"  loaded {variant}; running tiny models (CPU, interpret mode) ...", flush=True)
        rows = check(kernel, entry["repo-id"])
        print("  compiling for TPU generations with libtpu ...", flush=True)
        report(entry["repo"], variant, rows, compiles(kernel))

    print("Experts, attention and paged attention together in a tiny Gemma 4 MoE (CPU, interpret mode) ...", flush=True)
    rows = check_seed_model(kernels, repos)
    print("  compiling Gemma 4 26B-A4B's paged attention and experts for TPU generations with libtpu ...", flush=True)
    report("three together", "-", rows, seed_compiles_for(kernels))

    header = ("kernel", "variant loaded", "model", "max logit diff", "tokens identical", "compiles for")
    widths = [max(len(str(r[i])) for r in [header, *table]) for i in range(len(header))]
    print()
    for row in [header, tuple("-" * w for w in widths), *table]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    print(f"\nAll on CPU ({time.perf_counter() - start:.0f} s): kernels ran in Pallas interpret mode; "
          "'compiles for' is libtpu's AOT compiler, not a run on a TPU.")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
