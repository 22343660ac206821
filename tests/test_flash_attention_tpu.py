"""flash_attention compiled by libtpu (Mosaic and XLA:TPU, ahead of time) for
each TPU generation: forward and backward, within each chip's VMEM."""

import os

import jax
import jax.numpy as jnp
import pytest
import tpu_compile

from flash_attention import kernel, ops, tuning
from flash_attention._shared.generations import GENERATIONS
import sampling  # noqa: E402

# (generation, tokens, Hq, Hkv, D, Dv, dtype, options). `make test` compiles each generation
# at a small MHA shape (one 512 x 512 block: seconds, where large blocks' unrolled code takes
# libtpu minutes) and head_dim 256; `make check-compile` (CHECK_ALL_COMPILES=1) adds Llama-3-8B's
# attention on every generation, each head dim (512 among them), f32, every option once, long
# packed batches and Gemma-2-9B's 32k training step on tpu7x.
SAMPLE = [(g, 512, 8, 8, 128, 128, jnp.bfloat16, dict(causal=True)) for g in GENERATIONS] + [
    # head_dim 256, G = 2: the forward reshapes a block of heads side by side into rows (ops.IN_LANES_MIN_HEAD_DIM).
    ("v5e", 1024, 8, 4, 256, 256, jnp.bfloat16, dict(causal=True, softcap=50.0, window_size=(255, 0))),
]
MORE = [(g, 2048, 32, 8, 128, 128, jnp.bfloat16, dict(causal=True)) for g in GENERATIONS] + [
    # head_dim 512 (Gemma 4's global layers, 16 query heads over 2 KV heads): its tuned entry.
    ("v6e", 512, 16, 2, 512, 512, jnp.bfloat16, dict(causal=True)),
    ("v5e", 1024, 8, 8, 64, 64, jnp.bfloat16, dict(causal=True, sinks=True, window_size=(127, 0))),
    ("v5p", 1024, 8, 2, 80, 80, jnp.bfloat16, dict(causal=True)),
    # MQA on a megacore: each kernel's steps in two halves, one per core; dq in its own kernel.
    ("v5p", 2048, 8, 1, 128, 128, jnp.bfloat16, dict(causal=True)),
    ("v6e", 1024, 8, 1, 96, 96, jnp.float32, dict(causal=False)),
    ("tpu7x", 1024, 8, 8, 192, 128, jnp.bfloat16, dict(causal=True)),
    # 8k on the smallest VMEM: the dkv kernel keeps a KV head's 8k x 4 rows of dq in VMEM.
    ("tpu7x", 8192, 32, 8, 128, 128, jnp.bfloat16, dict(causal=True)),
    # Qwen3-32B's at 8k: 8k x 8 rows of dq do not fit, the backward runs the heads in two groups of 4.
    ("tpu7x", 8192, 16, 2, 128, 128, jnp.bfloat16, dict(causal=True)),
    # gpt-oss-20b's sliding layer at 8k: 8k x 8 rows of head_dim 64 (128 lanes in VMEM) do not fit
    # (nor do Gemma 4's 8k x 8 rows of head_dim 512, below).
    ("tpu7x", 8192, 16, 2, 64, 64, jnp.bfloat16, dict(causal=True, sinks=True, window_size=(127, 0))),
    # Gemma 4's global layers at 8k and 32k: their tuned entries (the d256 entry's blocks ran out of VMEM).
    *[(g, t, 16, 2, 512, 512, jnp.bfloat16, dict(causal=True)) for g in GENERATIONS for t in (8192, 32768)],
    # Gemma-2-9B's global layer at 32k on tpu7x: dq gets its own kernel, and dkv (head_dim 256,
    # 1024 x 1024 blocks) takes more than Mosaic's default VMEM limit (tuning.backward_vmem_limit).
    ("tpu7x", 32768, 16, 8, 256, 256, jnp.bfloat16, dict(causal=True, softcap=50.0)),
    # 128k tokens: the rule grows the blocks until the step list fits SMEM; dq gets its own kernel.
    ("v5e", 131072, 32, 8, 128, 128, jnp.bfloat16, dict(causal=True)),
]
CASES = SAMPLE + (MORE if sampling.ALL_COMPILES else [])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-T{c[1]}-{c[2]}x{c[3]}-d{c[4]}-{jnp.dtype(c[6]).name}")
def test_forward_and_backward_compile(case):
    generation, tokens, _, hkv = case[:4]
    names = " ".join(compile_forward_backward(*case).kernels)
    assert "fwd" in names and "dkv" in names, names
    # dq has a kernel of its own where a KV head's dq does not fit VMEM (here, at 128k tokens and
    # gpt-oss-20b's 8k) or where a megacore splits each KV head's steps.
    halves = GENERATIONS[generation].cores_per_device > 1 and hkv % 2 == 1
    too_big = (tokens == 131072 or (tokens == 8192 and case[4] == 64) or case[4] == 512 and tokens >= 8192
               or (generation, tokens, case[4]) == ("tpu7x", 32768, 256))
    assert ("_dq" in names) == (too_big or halves), names


def test_backward_in_head_groups_compiles(monkeypatch):
    """A KV head's query heads in two groups (tuning.fused_dq_split; made to split at a small
    shape) compile for tpu7x with dq fused in the dkv kernel (no dq kernel of its own)."""
    fits = tuning.fused_dq_vmem_limit
    monkeypatch.setattr(tuning, "fused_dq_vmem_limit", lambda *args: None if args[5] > 2 else fits(*args))
    report = compile_forward_backward("tpu7x", 1024, 8, 2, 128, 128, jnp.bfloat16, dict(causal=True))
    assert not any("_dq" in name for name in report.kernels), list(report.kernels)


def tuned_entries():
    return [(gen, key, value) for gen, table in tuning.TUNED.items() for key, value in table.items()]


@pytest.mark.parametrize("generation,key,value", tuned_entries())
def test_tuned_entry_is_chosen(generation, key, value):
    """A call at an entry's own head_dim, G and length gets the entry's blocks and scheduler."""
    d, groups, tokens = key
    blocks = tuning.choose_blocks(tokens, tokens, d, d, groups, 2, generation)
    assert (blocks.block_q * groups, blocks.block_k, blocks.lp_kernels) == (value + ((),))[:3]


@pytest.mark.parametrize("lp_kernels,fused_dq", [(("fwd",), True), (("dkv",), True), (("dq",), False)])
def test_lp_scheduler_reaches_its_kernels_only(lp_kernels, fused_dq, monkeypatch):
    """BlockSizes' scheduler choice is in the compiler flags of the kernels it names, not the others."""
    import re

    if not fused_dq:  # dq gets a kernel of its own
        monkeypatch.setattr(tuning, "FUSED_DQ_FRACTION", 0.0)
    cu = jnp.asarray([0, 512], jnp.int32)
    blocks = kernel.BlockSizes(256, 256, lp_kernels=lp_kernels)

    def forward_backward(q, k, v):
        attend = lambda q, k, v: ops.flash_attention_varlen(q, k, v, cu, cu, causal=True, blocks=blocks,
                                                            generation="v6e", interpret=False)
        out, pullback = jax.vjp(attend, q, k, v)
        return pullback(out)

    device = tpu_compile.device_for("v6e")
    spec = jax.ShapeDtypeStruct((512, 8, 128), jnp.bfloat16, sharding=jax.sharding.SingleDeviceSharding(device))
    with jax.default_device(device):
        text = jax.jit(forward_backward).lower(spec, spec, spec).as_text()
    flagged = {re.search(r'kernel_name = "(\w+)"', line).group(1): "XLA_TPU_FORCE_LP_LLO_SCHEDULER" in line
               for line in text.splitlines() if "tpu_custom_call" in line}
    names = ("fwd", "dkv") if fused_dq else ("fwd", "dq", "dkv")
    assert flagged == {f"flash_attention_{name}": name in lp_kernels for name in names}


@pytest.mark.parametrize("generation,key,value",
                         tuned_entries() if os.environ.get("FLASH_CHECK_ALL_TUNED") == "1" else [])
def test_tuned_entry_compiles(generation, key, value):
    """`make check-tuned`: every entry compiles at its own shape (2 KV heads: VMEM does not depend
    on the head count). `make tune-flash` compiled each when it rated it; a tuned entry's large
    blocks take libtpu minutes, so `make test` compiles the small per-generation sample above."""
    d, groups, tokens = key
    compile_forward_backward(generation, tokens, 2 * groups, 2, d, d, jnp.bfloat16, dict(causal=True))


def compile_forward_backward(generation, tokens, hq, hkv, d, dv, dtype, options):
    """Compiles a causal-or-not training step's attention; checks every kernel's VMEM."""
    options = dict(options)
    has_sinks = options.pop("sinks", False)

    def forward_backward(q, k, v, cu, sinks):
        def attend(q, k, v, sinks):
            return ops.flash_attention_varlen(q, k, v, cu, cu, sinks=sinks if has_sinks else None,
                                              generation=generation, interpret=False, **options)
        out, pullback = jax.vjp(attend, q, k, v, sinks)
        return out, pullback(out)

    specs = [((tokens, hq, d), dtype), ((tokens, hkv, d), dtype), ((tokens, hkv, dv), dtype), ((3,), jnp.int32),
             ((hq,), dtype)]
    report = tpu_compile.compile_for(forward_backward, specs, generation, "flash_attention")
    for kernel in report.kernels.values():
        assert 0 < kernel.vmem_bytes <= GENERATIONS[generation].vmem_bytes
    return report
