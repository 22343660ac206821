"""Benchmarks the gated delta rule (`make bench-gdr`), modeled on this CPU machine.

One shape: the linear-attention layer of Qwen3.5-9B, Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B
alike (16 q/k heads, 32 value heads, head dims 128; q, k, v in bf16, l2-normalised in the
kernel, the states in fp32). Cases: prefill (one sequence of 2k, 8k or 32k tokens: the chunked
rule's forward), a training step (8k tokens: forward and every gradient) and decode (1, 64 or
256 sequences, a token each, each with its state: the recurrent rule). For each implementation
and generation: whether libtpu compiles it, its VMEM, and a time modeled from the compiled
program (bench/harness.py), with two yardsticks:

- decode: `floor` is reading and writing each sequence's state once, plus q, k, v and o, at
  full HBM bandwidth;
- prefill and training: `MXU %` is the rule's matmul work (`rule_flops`: per token and value
  head 6 dk dv for the state's products and 2 C (3 dk + 2 dv) within its chunk of C = 64,
  three times that for a training step) over the modeled time at the chip's bf16 peak.

These are MODELED figures, not TPU measurements. With `--tpu` (on a TPU VM) the same programs are
timed for real instead. Writes bench/results/gated_delta_rule.md and .json.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import harness  # sets up sys.path and the CPU / libtpu environment (or the TPU with --tpu)
from harness import BENCH  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from runtime.generations import GENERATIONS  # noqa: E402

HK, HV, DK, DV = 16, 32, 128, 128
CHUNK = 64
KERNEL_NAME = "gated_delta_rule"
BENCH_GENERATIONS = ("v6e", "tpu7x")


@dataclasses.dataclass(frozen=True)
class Case:
    phase: str  # "prefill", "train" or "decode"
    size: int  # tokens of the one sequence (prefill, train), or sequences of a token each (decode)

    @property
    def name(self) -> str:
        return f"{self.phase} {self.size // 1024}k" if self.phase != "decode" else f"decode b{self.size}"

    @property
    def batch_tokens(self) -> tuple[int, int]:
        """(batch, tokens) of q: one long sequence, or a token per sequence."""
        return (1, self.size) if self.phase != "decode" else (self.size, 1)

    @property
    def seqs(self) -> int:
        return self.batch_tokens[0]


CASES = [Case("prefill", 2048), Case("prefill", 8192), Case("prefill", 32768), Case("train", 8192),
         Case("decode", 1), Case("decode", 64), Case("decode", 256)]


def specs(case: Case) -> list:
    """q, k, v, g, beta, the initial states (and for training the output's gradient), abstract."""
    batch, tokens = case.batch_tokens
    s = jax.ShapeDtypeStruct
    args = [s((batch, tokens, HK, DK), jnp.bfloat16)] * 2 + [
        s((batch, tokens, HV, DV), jnp.bfloat16), s((batch, tokens, HV), jnp.float32),
        s((batch, tokens, HV), jnp.bfloat16), s((case.seqs, HV, DK, DV), jnp.float32)]
    return args + [s((batch, tokens, HV, DV), jnp.bfloat16)] * (case.phase == "train")


def ours(case: Case):
    """Our kernels as a JAX user calls them: the chunked rule (prefill; its gradients for a training
    step) or the recurrent one (decode)."""
    from gated_delta_rule import ops

    rule = ops.fused_recurrent_gated_delta_rule if case.phase == "decode" else ops.chunk_gated_delta_rule

    def forward(q, k, v, g, beta, h0):
        return rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                    interpret=False)

    if case.phase != "train":
        return forward

    def step(q, k, v, g, beta, h0, do):  # the loss and every gradient, as a training step needs both
        loss = lambda *args: jnp.sum(forward(*args)[0].astype(jnp.float32) * do)
        return jax.value_and_grad(loss, argnums=range(6))(q, k, v, g, beta, h0)

    return step


IMPLS = {"ours": ours}


def rule_flops(case: Case) -> int:
    """The chunked rule's matmul work (see the module docstring): the yardstick of MXU use."""
    batch, tokens = case.batch_tokens
    per_token = 2 * (3 * DK * DV + CHUNK * (3 * DK + 2 * DV))
    return batch * tokens * HV * per_token * (3 if case.phase == "train" else 1)


def floor_bytes(case: Case) -> int:
    """A decode step's least traffic: each state read and written (fp32), q, k, v and o (bf16)."""
    batch, tokens = case.batch_tokens
    return case.seqs * HV * DK * DV * 4 * 2 + batch * tokens * 2 * (2 * HK * DK + 2 * HV * DV)


def measure(impl: str, case: Case, generation: str) -> dict:
    row = dict(case=case.name, impl=impl, generation=generation)
    try:
        # A decode step's states are updated in place, as an engine keeps them (donated).
        donate = dict(donate_argnums=(5,)) if case.phase == "decode" else {}
        m = harness.measure(IMPLS[impl](case), specs(case), generation, KERNEL_NAME, compile_options=donate)
    except Exception as err:  # a failed compile is a row, not the end of the run
        return row | harness.error_row(err)
    chip = GENERATIONS[generation]
    row |= m.figures()
    if case.phase == "decode":
        row["floor_us"] = floor_bytes(case) / chip.hbm_bytes_per_s * 1e6
    else:
        row["mxu_fraction"] = rule_flops(case) / (m.modeled_s * chip.bf16_flops)
    return row


def time_on_tpu(impl: str, case: Case, repeats: int = 20) -> dict:
    """Wall-clock time of the same program on the TPU jax runs on (random inputs as the models make
    them)."""
    rng = np.random.default_rng(0)
    args = [jnp.asarray(rng.standard_normal(s.shape), s.dtype) for s in specs(case)]
    args[3] = -jnp.abs(args[3])  # g: a log decay, at most 0
    args[4] = jax.nn.sigmoid(args[4])  # beta in (0, 1)
    fn = jax.jit(IMPLS[impl](case))
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return dict(case=case.name, impl=impl, generation=jax.devices()[0].device_kind,
                measured_us=(time.perf_counter() - start) / repeats * 1e6)


def row_order(row: dict):
    names = [c.name for c in CASES]
    return (list(GENERATIONS).index(row["generation"]) if row["generation"] in GENERATIONS else 99,
            names.index(row["case"]) if row["case"] in names else 99, list(IMPLS).index(row["impl"]))


def write_markdown(rows: list[dict], path: Path) -> None:
    lines = [
        "# gated_delta_rule: modeled performance (NOT measured on a TPU)",
        "",
        "Modeled from each compiled program (bench/harness.py: libtpu's bundles, the grid walk, the",
        "schedule model), per layer: Qwen3.5-9B's, Qwen3.5-35B-A3B's and Qwen3-Next's linear attention",
        "(16 q/k heads, 32 value heads, head dims 128; bf16 q, k, v; fp32 states). `MXU %`: the rule's",
        "matmul work over the modeled time at the chip's bf16 peak (bench/gdr_bench.py says how it is",
        "counted). `floor`: a decode step's states read and written once plus q, k, v, o, at full HBM",
        "bandwidth.",
        "",
        "## Every row",
        "",
        "| case | gen | impl | VMEM MiB | grid steps | compute us | DMA us | around us | modeled us "
        "| MXU % | floor us | modeled / floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['case']} | {r['generation']} | {r['impl']} "
        if "error" in r:
            lines.append(head + f"| {r['error']} |" + " |" * 8)
            continue
        mxu = f"{100 * r['mxu_fraction']:.1f}" if "mxu_fraction" in r else ""
        floor = (f"{r['floor_us']:.1f} | {r['modeled_us'] / r['floor_us']:.2f}" if "floor_us" in r else " | ")
        lines.append(head + f"| {(r['vmem_used'] or 0) / 2**20:.1f} | {r['grid_steps']} | {r['compute_us']:.0f} "
                     f"| {r['dma_us']:.0f} | {r['around_us']:.0f} | {r['modeled_us']:.1f} | {mxu} | {floor} |")
    harness.write_atomically(path, "\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=[c.name for c in CASES], choices=[c.name for c in CASES])
    parser.add_argument("--generations", nargs="*", default=list(BENCH_GENERATIONS), choices=list(GENERATIONS))
    parser.add_argument("--impls", nargs="*", default=list(IMPLS), choices=list(IMPLS))
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    parser.add_argument("--tpu", action="store_true", help="time real runs on a TPU (needs one)")
    args = parser.parse_args(argv)
    cases = [c for c in CASES if c.name in args.cases]
    if args.tpu:
        measured = harness.Results(args.out / "gated_delta_rule_tpu_measured.json", key=lambda r: (
            r["case"], r["impl"], r["generation"]))
        for case in cases:
            for impl in args.impls:
                measured.put(time_on_tpu(impl, case))
                print(measured.rows[-1], flush=True)
        return 0
    results = harness.Results(args.out / "gated_delta_rule.json", key=lambda r: (r["case"], r["impl"], r["generation"]),
                              order=row_order)
    runs = [(c, i, g) for g in args.generations for c in cases for i in args.impls]
    start = time.perf_counter()
    for n, (case, impl, generation) in enumerate(runs, 1):
        print(f"[{n}/{len(runs)}] {case.name} {impl} {generation} ({time.perf_counter() - start:.0f} s)", flush=True)
        results.put(measure(impl, case, generation))
        write_markdown(results.rows, args.out / "gated_delta_rule.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
