"""Run in a fresh process by test_build_and_load.py: loads a built kernel the
way users do, `get_kernel(repo_id, version=N)`, offline from a Hub cache, and
prints JSON about what was loaded and how it computed.

With `--hub URL` it loads online instead, from the Hub at URL (tests/local_hub.py),
into the empty cache CACHE: kernels' publisher trust check runs, and `--trust` passes
the README's opt-in, `trust_remote_code=[repo_id]`. A refused load prints {"refused": why}.

usage: offline_get_kernel.py CACHE REPO_ID VERSION [--torch-backends-tpu] [--hub URL [--trust]]
"""

import json
import os
import numpy as np
import sys
import types

cache, repo_id, version = sys.argv[1], sys.argv[2], int(sys.argv[3])
hub = sys.argv[sys.argv.index("--hub") + 1] if "--hub" in sys.argv else None
# Read once, when huggingface_hub and kernels are imported: set them first.
os.environ.update(KERNELS_CACHE=cache, JAX_PLATFORMS="cpu", TORCH_DEVICE_BACKEND_AUTOLOAD="0",
                  ALLOW_MULTIPLE_LIBTPU_LOAD="1")
if hub:
    os.environ.update(HF_ENDPOINT=hub, HF_HUB_OFFLINE="0", HF_HUB_DISABLE_XET="1")
else:
    os.environ.update(HF_HUB_OFFLINE="1")

import torch  # noqa: E402

if "--torch-backends-tpu" in sys.argv:
    # What kernels 0.17.2 looks for to pick the torch-tpu variant.
    torch.backends.tpu = types.SimpleNamespace()

from kernels import get_kernel  # noqa: E402
from errors import max_error

try:
    kernel = get_kernel(repo_id, version=version, trust_remote_code=[repo_id] if "--trust" in sys.argv else False)
except ValueError as refused:
    if hub is None:
        raise
    print(json.dumps({"refused": str(refused)}))
    sys.exit(0)
gen = lambda seed: torch.Generator().manual_seed(seed)
jax_error = 0.0  # the JAX API's error, where the card shows one
if hasattr(kernel, "ragged_dot"):
    lhs = torch.randn(37, 128, generator=gen(0))
    rhs = torch.randn(3, 128, 256, generator=gen(1))
    out = kernel.ragged_dot(lhs, rhs, torch.tensor([10, 0, 20]))
    want = torch.cat([lhs[:10] @ rhs[0], lhs[10:30] @ rhs[2], torch.zeros(7, 256)])
elif hasattr(kernel, "ragged_paged_attention"):  # write a sequence's 40 tokens to the cache, decode its last
    k, v = (torch.randn(40, 2, 64, generator=gen(seed)) for seed in (1, 2))
    q = torch.randn(1, 4, 64, generator=gen(0))
    k_cache, v_cache = torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    slots = (table[0, torch.arange(40) // 16] * 16 + torch.arange(40) % 16).to(torch.int32)
    kernel.reshape_and_cache_flash(k, v, k_cache, v_cache, slots)
    out = kernel.ragged_paged_attention(q, k_cache, v_cache, torch.tensor([40], dtype=torch.int32), table,
                                        torch.tensor([0, 1], dtype=torch.int32), 1)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), enable_gqa=True).transpose(0, 1)
    # The card's JAX section, through the module get_kernel returned (its package name is hashed).
    import jax.numpy as jnp
    ops = kernel.ops
    as_jax = lambda t: jnp.asarray(t.numpy())
    k_cache, v_cache = (jnp.zeros((4, 16, 2, 64), jnp.float32) for _ in range(2))
    k_cache, v_cache = ops.reshape_and_cache_flash(as_jax(k), as_jax(v), k_cache, v_cache, as_jax(slots))
    jax_out = ops.ragged_paged_attention(as_jax(q), k_cache, v_cache, jnp.asarray([40], jnp.int32), as_jax(table),
                                         jnp.asarray([0, 1], jnp.int32), 1)
    jax_error = max_error(jax_out, as_jax(want))
elif hasattr(kernel, "chunk_gated_delta_rule"):  # the card's usage block as written, against transformers' reference
    import pathlib
    import re

    card = (pathlib.Path(kernel.__file__).parents[3] / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    torch.manual_seed(0)
    names = {}
    exec(block, names)
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    parts = [torch_recurrent_gated_delta_rule(  # each sequence alone; q and k repeated to v's heads
        *(names[x][:, a:b].repeat_interleave(2, dim=2) for x in ("q", "k")), names["v"][:, a:b],
        g=names["g"][:, a:b], beta=names["beta"][:, a:b], initial_state=torch.zeros(1, 4, 64, 32),
        output_final_state=True) for a, b in ((0, 30), (30, 100))]
    out = torch.cat([names["o"].flatten(), names["state"].flatten()])
    want = torch.cat([o.flatten() for o, _ in parts] + [state.flatten() for _, state in parts])
    # The card's JAX line: the same call on JAX arrays through the loaded module's ops.
    import jax.numpy as jnp
    as_jax = lambda t: jnp.asarray(t.numpy())
    jax_o, jax_state = names["gdr"].ops.chunk_gated_delta_rule(
        *(as_jax(names[x]) for x in ("q", "k", "v", "g", "beta")), initial_state=jnp.zeros((2, 4, 64, 32)),
        output_final_state=True, cu_seqlens=as_jax(names["cu_seqlens"]))
    jax_error = max_error(jnp.concatenate([jax_o.reshape(-1), jax_state.reshape(-1)]), as_jax(want))
else:  # flash attention: one causal GQA batch against torch's own attention
    q, k, v = (torch.randn(2, 40, heads, 64, generator=gen(seed)) for seed, heads in ((0, 4), (1, 2), (2, 2)))
    out = kernel.flash_attn_func(q, k, v, causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True).transpose(1, 2)
print(json.dumps({
    "file": kernel.__file__,
    "variant": os.path.basename(os.path.dirname(os.path.dirname(kernel.__file__))),
    "all": sorted(kernel.__all__),
    "op_namespaces": sorted({op.split("::")[0] for op in torch._C._dispatch_get_all_op_names()
                             if op.split("::")[0].startswith("_" + repo_id.split("/")[1].replace("-", "_"))}),
    "max_abs_error": float(np.max([(out - want).abs().max().item(), jax_error])),  # NaN in either stays NaN
}), flush=True)
# Every check is printed: leave without the interpreter's teardown, where a native thread still
# running at exit can abort the process ("terminate called without an active exception", seen once
# in a full make test) after a passing run.
os._exit(0)
