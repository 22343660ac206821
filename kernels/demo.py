"""The main job (`make demo`): build every kernel, load each the way users do
(`get_kernel(..., version=N)`, offline from a Hub cache made from build/),
run it inside tiny random-weight transformers models against transformers'
eager implementation (experts, or attention), and compile it for each TPU
generation with libtpu.

Everything runs on this machine's CPU: the kernels run in Pallas interpret
mode, and "compiles for" means libtpu's compilers accepted the kernel for
that chip (no TPU executes anything here).
"""

from __future__ import annotations

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


# Per kernel in build.toml: what the demo runs once the kernel is loaded.
DEMOS = {
    "ragged_dot": (lambda kernel, repo_id: check_in_models(kernel), compiles_for),
    "flash_attention": (check_attention_in_models, attention_compiles_for),
}


def main() -> int:
    start = time.perf_counter()
    manifest = build_collection.load_manifest()
    print("Building the Hub repo trees ...", flush=True)
    trees = build_collection.build_all()
    build_collection.make_hub_cache(trees, HUB_CACHE)

    from kernels import get_kernel

    table, failed = [], False
    for key, entry in manifest["kernels"].items():
        print(f"Loading {entry['repo-id']} v{entry['version']} with get_kernel (offline) ...", flush=True)
        kernel = get_kernel(entry["repo-id"], version=entry["version"])
        variant = Path(kernel.__file__).parent.parent.name
        if key not in DEMOS:
            print(f"  loaded {variant}; no demo in make demo: its tests are tests/test_{key}_*.py")
            continue
        check, compiles = DEMOS[key]
        print(f"  loaded {variant}; running tiny models (CPU, interpret mode) ...", flush=True)
        rows = check(kernel, entry["repo-id"])
        print("  compiling for TPU generations with libtpu ...", flush=True)
        generations = ", ".join(compiles(kernel)) or "none"
        for row in rows:
            failed |= not row["tokens_identical"] or row["max_logit_diff"] > 1e-4
            table.append((entry["repo"], variant, row["model"], f"{row['max_logit_diff']:.2e}",
                          "yes" if row["tokens_identical"] else "NO", generations))

    header = ("kernel", "variant loaded", "model", "max logit diff", "16 tokens identical", "compiles for")
    widths = [max(len(str(r[i])) for r in [header, *table]) for i in range(len(header))]
    print()
    for row in [header, tuple("-" * w for w in widths), *table]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    print(f"\nAll on CPU ({time.perf_counter() - start:.0f} s): kernels ran in Pallas interpret mode; "
          "'compiles for' is libtpu's AOT compiler, not a run on a TPU.")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
