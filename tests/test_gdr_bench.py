"""The gated delta rule's bench (bench/gdr_bench.py) on its smallest cases: a decode step and a
2k prefill compiled by libtpu and modeled through the one harness, the rows within what the chip
can do, the report written, a committed row of another case kept; its JAX copy of transformers'
torch code against that code."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                          torch_recurrent_gated_delta_rule)

import gdr_bench
import harness


def test_gdr_bench_models_decode_and_prefill_within_the_chip(tmp_path):
    other = next(r for r in json.loads((harness.BENCH / "results" / "gated_delta_rule.json").read_text())
                 if r["generation"] == "tpu7x")
    (tmp_path / "gated_delta_rule.json").write_text(json.dumps([other]))
    assert gdr_bench.main(["--cases", "decode b64", "prefill 2k", "--generations", "v6e", "--impls", "ours",
                           "tpu-inference gdn v1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gated_delta_rule.json").read_text())
    assert other in rows  # a subset run loses nothing
    prefill, decode = (next(r for r in rows if r["case"] == c and r["generation"] == "v6e")
                       for c in ("prefill 2k", "decode b64"))
    for r in (prefill, decode):
        assert r["compiles"] and r["regions_mapped"] and r["grid_steps"] > 0, r
        assert r["modeled_us"] == pytest.approx(r["kernel_us"] + r["around_us"])
    # Physical: no decode step faster than moving its states once, no prefill past the MXU's peak.
    assert decode["modeled_us"] >= decode["floor_us"] > 0
    assert 0 < prefill["mxu_fraction"] < 1
    # The decode step's states are updated in place: nothing outside the kernel passes over them
    # (a pass over 64 x 32 x 128 x 128 fp32 states would take ~100 us on v6e).
    assert decode["around_us"] < 10, decode
    # tpu-inference's fused_gdn, profiled (it copies its own blocks, its loops run as its data says):
    # decode by its decode kernel (its recurrent kernel on no sequence: a grid of no steps), prefill
    # by its recurrent kernel a token at a time (its loop's guard branch matched to no node).
    anchor = {r["case"]: r for r in rows if r["impl"] == "tpu-inference gdn v1"}
    assert set(anchor) == {"decode b64", "prefill 2k"} and all(r["compiles"] for r in anchor.values()), anchor
    assert anchor["decode b64"]["modeled_us"] >= decode["floor_us"]
    assert anchor["prefill 2k"]["modeled_us"] > prefill["modeled_us"]  # 2048 dependent token steps
    table = (tmp_path / "gated_delta_rule.md").read_text()
    assert "NOT measured on a TPU" in table and "| decode b64 | v6e | ours |" in table


def test_tpu_inference_chunked_kernel_profiles():
    """tpu-inference's gdn v2 (`recurrent_scan`) reads its block count from an input block in VMEM
    and loops over chunks of 128 tokens: its profile (run in the TPU interpreter, XLA's while-loop
    simplifier left out: with it XLA's verifier rejects the sliced loop) counts a trip per chunk."""
    import kernel_profile

    program = gdr_bench.tpu_inference_v2(gdr_bench.Case("prefill", 512), "v6e")
    with harness.target_info("v6e"):
        (p,) = kernel_profile.profile(program.fn, *program.concrete_args())
    outer = next(i for i, n in enumerate(p.nodes) if n.kind == "loop")
    assert p.counts[:, outer].sum() == 512 // 128


@pytest.mark.parametrize("ours, theirs", [(gdr_bench.torch_chunked, torch_chunk_gated_delta_rule),
                                          (gdr_bench.torch_recurrent, torch_recurrent_gated_delta_rule)],
                         ids=["chunked", "recurrent"])
def test_the_benched_torch_code_is_transformers(ours, theirs):
    """The bench's XLA row runs transformers' torch reference written in JAX: the same outputs and
    final states in fp32 (150 tokens: a last chunk cut short; two sequences, each its own initial
    state; distinct head dims). Both compute in fp32 with fp32 products, the same ops in the same
    order: within 1e-5 of the largest entry (measured: about 3e-7)."""
    rng = np.random.default_rng(0)
    b, t, h, dk, dv = 2, 150, 4, 32, 16
    q, k = (rng.standard_normal((b, t, h, dk), np.float32) for _ in range(2))
    v = rng.standard_normal((b, t, h, dv), np.float32)
    g = -0.1 * np.abs(rng.standard_normal((b, t, h), np.float32))
    beta = rng.uniform(0, 1, (b, t, h)).astype(np.float32)
    h0 = rng.standard_normal((b, h, dk, dv), np.float32)
    o, final = ours(*map(jnp.asarray, (q, k, v, g, beta, h0)))
    want_o, want_final = theirs(*map(torch.from_numpy, (q, k, v)), g=torch.from_numpy(g),
                                beta=torch.from_numpy(beta), initial_state=torch.from_numpy(h0),
                                output_final_state=True, use_qk_l2norm_in_kernel=True)
    for got, want in ((o, want_o), (final, want_final)):
        want = want.numpy()
        assert np.abs(np.asarray(got) - want).max() <= 1e-5 * np.abs(want).max()


def test_the_torch_code_decode_step_reads_the_states_twice():
    """transformers' decode step compiled by XLA (its states donated, as ours): compiles for v6e
    and is modeled no faster than moving its states once; its fusions read the states twice and
    write them once, as the card says (at least 1.4 times the floor, where ours is within 1.1)."""
    row = gdr_bench.measure(gdr_bench.TORCH_CODE, gdr_bench.Case("decode", 64), "v6e")
    assert row["compiles"] and row["modeled_us"] >= 1.4 * row["floor_us"] > 0, row
