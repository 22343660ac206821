"""flash_attention compiled by libtpu (Mosaic and XLA:TPU, ahead of time) for
each TPU generation: forward and backward, within each chip's VMEM."""

import jax
import jax.numpy as jnp
import pytest
import tpu_compile

from flash_attention import ops
from flash_attention._shared.generations import GENERATIONS

# (generation, tokens, Hq, Hkv, D, Dv, dtype, options): every generation at Llama-3-8B's
# attention, then each head dim, f32, every option once and a long packed batch, spread over
# the generations.
CASES = [(g, 2048, 32, 8, 128, 128, jnp.bfloat16, dict(causal=True)) for g in GENERATIONS] + [
    ("v5e", 1024, 8, 8, 64, 64, jnp.bfloat16, dict(causal=True, sinks=True, window_size=(127, 0))),
    ("v5p", 1024, 8, 2, 80, 80, jnp.bfloat16, dict(causal=True)),
    ("v6e", 1024, 8, 1, 96, 96, jnp.float32, dict(causal=False)),
    ("tpu7x", 1024, 8, 8, 192, 128, jnp.bfloat16, dict(causal=True)),
    ("v5e", 1024, 8, 4, 256, 256, jnp.bfloat16, dict(causal=True, softcap=50.0, window_size=(255, 0))),
    # 8k on the smallest VMEM: the dkv kernel keeps a KV head's 8k x 4 rows of dq in VMEM.
    ("tpu7x", 8192, 32, 8, 128, 128, jnp.bfloat16, dict(causal=True)),
    # 128k tokens: the rule grows the blocks until the step list fits SMEM; dq gets its own kernel.
    ("v5e", 131072, 32, 8, 128, 128, jnp.bfloat16, dict(causal=True)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-T{c[1]}-{c[2]}x{c[3]}-d{c[4]}-{jnp.dtype(c[6]).name}")
def test_forward_and_backward_compile(case):
    generation, tokens, hq, hkv, d, dv, dtype, options = case
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
    names = " ".join(report.kernels)
    assert "fwd" in names and "dkv" in names, names
    # dq has a kernel of its own only where a KV head's dq does not fit VMEM: here, at 128k tokens.
    assert ("_dq" in names) == (tokens == 131072), names
    for kernel in report.kernels.values():
        assert 0 < kernel.vmem_bytes <= GENERATIONS[generation].vmem_bytes
