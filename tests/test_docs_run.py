"""Every Python block of the README and of each kernel's card (the README.md of its built tree, as
the Hub shows it) runs as a user would paste it, on this CPU machine: `<org>` is the Hub org of
build.toml, the Hub's model names are tiny random checkpoints of the same family saved here, and
`device_map="tpu"` is "cpu"; the kernels load offline from the built trees (get_kernel, and
transformers' own loading for `attn_implementation`). The tensors a block uses without defining
them (a call's inputs) are given to it. Each block runs paragraph by paragraph in one namespace per
document (a reader runs a card's blocks in order), and after a paragraph its results are checked
against a reference: a model's logits against the same checkpoint on transformers' eager code, a
kernel call against the tests' references."""

import os
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

import build_collection
import seed_models
import test_flash_attention_kvcache as kvcache
import test_fp8_checkpoints
import test_mxfp4_checkpoints
import test_paged_attention_torch as paged_torch

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = build_collection.load_manifest()
KERNELS = MANIFEST["kernels"]
ORG = KERNELS["flash_attention"]["repo-id"].split("/")[0]
# The Hub's model names the docs use -> the tiny random config standing for each.
MODELS = {
    "Qwen/Qwen3-30B-A3B": lambda: seed_models.config("qwen3_moe"),
    "Qwen/Qwen3-8B": lambda: transformers.Qwen3Config(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    "openai/gpt-oss-20b": lambda: seed_models.config("gpt_oss"),
}
# Blocks another test runs as written: (document, block) -> where.
RUN_ELSEWHERE = {
    ("gated_delta_rule", 0): "tests/offline_get_kernel.py (get_kernel test): against transformers' reference",
    ("gated_delta_rule", 1): "tests/test_gated_delta_rule_models.py: the card's block on tiny Qwen3.5 models",
}
# Paragraphs with no check of their own: (document, block, paragraph) -> the check that covers them.
IMPORTS = "imports: the next paragraph's check"
SETUP = {
    ("README", 0, 0): IMPORTS, ("ragged_dot", 0, 0): IMPORTS, ("ragged_dot", 2, 0): IMPORTS,
    ("flash_attention", 0, 0): IMPORTS,
    ("flash_attention", 1, 0): IMPORTS, ("paged_attention", 0, 0): IMPORTS, ("paged_attention", 1, 0): IMPORTS,
    ("paged_attention", 2, 0): "ops taken from the module: the next paragraph's calls and their check",
    ("paged_attention", 3, 0): IMPORTS,
    ("paged_attention", 3, 1): "the caches in the kernels' layout: paragraph 3's check of the layout kept",
    ("paged_attention", 3, 2): "the serving step: paragraph 3's check of its outputs",
}
LOGIT_TOLERANCE = 2e-5  # of the largest logit: fp32, our kernels change only the summation order


def python_blocks(text: str) -> list[str]:
    """Every fenced Python block, those indented in a list item too (dedented)."""
    return [textwrap.dedent(code) for _, code in re.findall(r"^( *)```python\n(.*?)^\1```", text, re.S | re.M)]


def paragraphs(block: str) -> list[str]:
    return [p for p in block.split("\n\n") if p.strip()]


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """{document: its text as a user reads it}: the repo's README and each kernel's built card;
    every kernel laid out in the Hub cache that get_kernel reads offline."""
    out = tmp_path_factory.mktemp("build")
    trees = build_collection.build_all(out)
    build_collection.make_hub_cache(trees, Path(os.environ["KERNELS_CACHE"]))
    return {"README": (ROOT / "README.md").read_text(), **{key: (tree / "README.md").read_text()
                                                             for key, tree in trees.items()}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{Hub model name: a tiny random checkpoint of its family, saved}."""
    root = tmp_path_factory.mktemp("models")
    saved = {}
    for name, config in MODELS.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config(), dtype=torch.float32)
        saved[name] = str(root / name.replace("/", "--"))
        model.save_pretrained(saved[name])
    fp8 = root / "Qwen--Qwen3-30B-A3B-FP8"
    saved["Qwen/Qwen3-30B-A3B-FP8"] = str(test_fp8_checkpoints.fp8_checkpoint("qwen3_moe", torch.float32, fp8)[0])
    mxfp4 = root / "openai--gpt-oss-120b"
    saved["openai/gpt-oss-120b"] = str(test_mxfp4_checkpoints.mxfp4_checkpoint(mxfp4)[0])
    return saved


def as_user_runs(code: str, checkpoints: dict) -> str:
    code = code.replace("<org>", ORG).replace('device_map="tpu"', 'device_map="cpu"')
    for name, path in checkpoints.items():
        code = code.replace(f'"{name}"', repr(path))
    assert '"tpu"' not in code, f"a TPU device left in:\n{code}"
    return code


def check_logits(model, checkpoints, name):
    """The model a paragraph loaded, on our kernels, against the same checkpoint on eager code."""
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    eager = AutoModelForCausalLM.from_pretrained(checkpoints[name], attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    with torch.no_grad():
        got, want = model.eval()(ids).logits, eager(ids).logits
    assert (got - want).abs().max() <= LOGIT_TOLERANCE * want.abs().max(), name


def check_quantized(model, checkpoints, name):
    """The model's experts a byte per weight, its logits those of the same checkpoint on eager code
    with the experts' weights dequantized (fp32: only the summation order differs)."""
    import test_transformers_models

    experts = [m for m in model.modules() if hasattr(m, "down_proj_scale_inv")]
    assert experts and all(m.down_proj.dtype == torch.int8 for m in experts)
    eager = AutoModelForCausalLM.from_pretrained(checkpoints[name], attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    assert test_transformers_models._dequantized_into(eager, model) == len(experts)
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model.eval()(ids).logits, eager(ids).logits
    assert (got - want).abs().max() <= LOGIT_TOLERANCE * want.abs().max(), name


def check_fp8(model, checkpoints, name):
    """The model's experts in fp8 as stored, its logits those of transformers' own load of the
    checkpoint (dequantized; fp32: only the summation order differs)."""
    experts = [m for m in model.modules() if hasattr(m, "down_proj_scale_inv")]
    assert experts and all(m.down_proj.dtype == torch.float8_e4m3fn for m in experts)
    reference = AutoModelForCausalLM.from_pretrained(checkpoints[name]).eval()
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model.eval()(ids).logits, reference(ids).logits
    assert (got - want).abs().max() <= LOGIT_TOLERANCE * want.abs().max(), name


def check_mxfp4(model, checkpoints, name):
    """The model's experts in MXFP4 as stored, its logits those of transformers' own load of the
    checkpoint (its experts dequantized to bf16, exactly, then fp32: only the summation order differs)."""
    experts = [m for m in model.modules() if hasattr(m, "down_proj_scales")]
    assert experts and all(m.down_proj.dtype == torch.uint8 for m in experts)
    reference = AutoModelForCausalLM.from_pretrained(checkpoints[name]).eval().float()
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model.eval()(ids).logits, reference(ids).logits
    assert (got - want).abs().max() <= LOGIT_TOLERANCE * want.abs().max(), name


def paged_inputs(as_jax=False, kv_heads=paged_torch.HKV, dtype=torch.float32, zero_caches=False):
    """vLLM's two calls' inputs (test_paged_attention_torch's batch: decode, chunked prefill and
    prefill sequences past padding), each query token's key and value to write at its slot (-1 for
    the padding tokens), and the caches expected after the write and the output expected."""
    q, k_cache, v_cache, kv_lens, table, cu, num_seqs = paged_torch._batch()
    k_cache, v_cache = (c[:, :, :kv_heads].to(dtype) * (0 if zero_caches else 1) for c in (k_cache, v_cache))
    g = torch.Generator().manual_seed(7)
    key, value = (torch.randn(q.shape[0], *k_cache.shape[2:], generator=g).to(dtype) for _ in range(2))
    q = q.to(dtype)
    slots = torch.full((q.shape[0],), -1, dtype=torch.int32)
    for s in range(num_seqs):
        for t in range(int(cu[s]), int(cu[s + 1])):
            position = int(kv_lens[s]) - int(cu[s + 1]) + t
            page, row = divmod(position, paged_torch.PAGE_SIZE)
            slots[t] = table[s, page] * paged_torch.PAGE_SIZE + row
    k_want, v_want = k_cache.clone(), v_cache.clone()
    live = slots >= 0
    for cache, new in ((k_want, key), (v_want, value)):
        cache.view(-1, *cache.shape[2:])[slots[live].long()] = new[live]
    out = paged_torch._reference(q, k_want, v_want, kv_lens, table, cu, num_seqs)
    names = dict(key=key, value=value, slot_mapping=slots, q=q, kv_lens=kv_lens, page_indices=table, cu_q_lens=cu,
                 num_seqs=num_seqs)
    if as_jax:
        import jax.numpy as jnp
        as_jax = lambda t: jnp.asarray(t.float().numpy()).astype(str(t.dtype).split(".")[1]) if t.is_floating_point() \
            else jnp.asarray(t.numpy())
        names = {k: as_jax(v) if isinstance(v, torch.Tensor) else v for k, v in names.items()}
        return dict(names, k_cache=as_jax(k_cache), v_cache=as_jax(v_cache)), (k_want, v_want, out)
    return dict(names, key_cache=k_cache, value_cache=v_cache), (k_want, v_want, out)


def check_paged(got_k, got_v, out, expected):
    """Caches bit-identical to the expected write; the live tokens' output within the dtype's bound."""
    k_want, v_want, out_want = expected
    as_torch = lambda x: x if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x.astype("float32")))
    assert torch.equal(as_torch(got_k).float(), k_want.float()) and torch.equal(as_torch(got_v).float(), v_want.float())
    live = int(paged_torch._batch()[5][-1])
    bound = (2e-5 if k_want.dtype == torch.float32 else 2 ** -8) * float(v_want.abs().max())
    assert (as_torch(out)[:live].float() - out_want[:live]).abs().max() <= bound


def run_paragraph(doc, block, index, code, ns, checkpoints) -> bool:
    """Runs one paragraph in the document's namespace with the inputs it uses, then its check (if
    it has one: whether it had)."""
    key, check = (doc, block, index), None
    flash_repo = KERNELS["flash_attention"]["repo-id"]
    if key in {("README", 0, 1), ("ragged_dot", 0, 1)}:
        check = lambda: (check_logits(ns["model"], checkpoints, "Qwen/Qwen3-30B-A3B"),
                         assert_implementation(ns["model"], "experts", "tpu_ragged_dot"))
    elif key == ("ragged_dot", 1, 0):
        check = lambda: check_quantized(ns["model"], checkpoints, "Qwen/Qwen3-30B-A3B")
    elif key == ("ragged_dot", 2, 1):
        check = lambda: check_fp8(ns["model"], checkpoints, "Qwen/Qwen3-30B-A3B-FP8")
    elif key == ("ragged_dot", 3, 0):
        check = lambda: check_mxfp4(ns["model"], checkpoints, "openai/gpt-oss-120b")
    elif key in {("README", 0, 2), ("flash_attention", 0, 1)}:
        check = lambda: (check_logits(ns["model"], checkpoints, "Qwen/Qwen3-8B"),
                         assert_implementation(ns["model"], "attn", flash_repo))
    elif key == ("flash_attention", 1, 1):
        check = lambda: (check_logits(ns["model"], checkpoints, "openai/gpt-oss-20b"),
                         assert_implementation(ns["model"], "attn", flash_repo))
    elif key in {("README", 0, 3), ("paged_attention", 0, 1)}:
        inputs, expected = paged_inputs()
        ns.update(inputs)
        check = lambda: check_paged(ns["key_cache"], ns["value_cache"], ns["out"], expected)
    elif key == ("paged_attention", 2, 1):
        inputs, expected = paged_inputs(as_jax=True)
        ns.update(inputs)
        check = lambda: check_paged(ns["k_cache"], ns["v_cache"], ns["out"], expected)
    elif key == ("paged_attention", 3, 0):  # one KV head (MQA), bf16 caches of zeros, held in the kernels' layout
        inputs, ns["expected"] = paged_inputs(as_jax=True, kv_heads=1, dtype=torch.bfloat16, zero_caches=True)
        ns.update({k: v for k, v in inputs.items() if k not in ("k_cache", "v_cache")},
                  kv_heads=1, num_pages=inputs["k_cache"].shape[0], page_size=paged_torch.PAGE_SIZE)
    elif key == ("paged_attention", 3, 3):
        def check():
            check_paged(ns["k_cache"], ns["v_cache"], ns["out"], ns["expected"])
            held = {c.format.layout.major_to_minor for c in (ns["k_cache"], ns["v_cache"])}
            assert held == {ns["cache_format"].layout.major_to_minor} == {(0, 2, 1, 3)}, held  # kept across the step
    elif key == ("flash_attention", 2, 0):
        from kernels import get_kernel
        q, k_cache, v_cache, k, v, options = kvcache._paged_case()
        expected, _, k_want, v_want = kvcache.reference(q, k_cache, v_cache, k, v, causal=True, **options)
        ns.update(kernel=get_kernel(flash_repo, version=KERNELS["flash_attention"]["version"]),
                  q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, **options)

        def check():
            assert kvcache._nan_safe_equal(ns["k_cache"], k_want) and kvcache._nan_safe_equal(ns["v_cache"], v_want)
            bound = kvcache.TOLERANCE[torch.float32] * float(v_want.nan_to_num().abs().max())
            assert (ns["out"].double() - expected).abs().max() <= bound
    elif key == ("paged_attention", 1, 1):
        prompts = [torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 19)]
        ns.update(prompts=prompts, generation_config=GenerationConfig(max_new_tokens=3, do_sample=False,
                                                                      eos_token_id=None, pad_token_id=0))

        def check():
            assert_implementation(ns["model"], "attn", KERNELS["paged_attention"]["repo-id"] + ":flash_attn_forward")
            eager = AutoModelForCausalLM.from_pretrained(checkpoints["Qwen/Qwen3-8B"], attn_implementation="eager")
            generated = {tuple(o.prompt_ids): o.generated_tokens for o in ns["outputs"].values()}
            for prompt in prompts:
                with torch.no_grad():
                    want = eager.generate(torch.tensor([prompt]), generation_config=ns["generation_config"])
                assert generated[tuple(prompt)] == want[0, len(prompt):].tolist()
    exec(compile(as_user_runs(code, checkpoints), f"{doc} block {block}", "exec"), ns)
    if check is not None:
        check()
    return check is not None


def assert_implementation(model, kind, name):
    assert getattr(model.config, f"_{kind}_implementation") == name, (kind, name)


@pytest.mark.parametrize("doc", ["README", "ragged_dot", "flash_attention", "paged_attention", "gated_delta_rule"])
def test_every_python_block_runs_as_written(docs, checkpoints, doc):
    blocks = python_blocks(docs[doc])
    ns, unchecked = {}, []
    for b, block in enumerate(blocks):
        if (doc, b) in RUN_ELSEWHERE:
            continue
        for i, code in enumerate(paragraphs(block)):
            if not run_paragraph(doc, b, i, code, ns, checkpoints) and (doc, b, i) not in SETUP:
                unchecked.append((b, i))
    # A paragraph nothing checks (a new one, or one that moved) fails here until it has a check or
    # names the check that covers it.
    assert blocks and not unchecked, f"{doc}: (block, paragraph) {unchecked} have no check"
