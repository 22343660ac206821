"""Benchmarks the gated delta rule (`make bench-gdr`), modeled on this CPU machine.

One shape: the linear-attention layer of Qwen3.5-9B, Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B
alike (16 q/k heads, 32 value heads, head dims 128; q, k, v in bf16, l2-normalised in the
kernel, the states in fp32). Cases: prefill (one sequence of 2k, 8k or 32k tokens: the chunked
rule's forward), a training step (8k tokens: forward and every gradient) and decode (1, 64 or
256 sequences, a token each, each with its state: the recurrent rule). Implementations: ours;
tpu-inference's (vLLM's TPU backend) gated delta rule kernels as vLLM calls them: gdn v1
(`fused_gdn`: decode, and prefill a token at a time) and gdn v2 (`recurrent_scan`: chunked
prefill), both copying their own blocks, so modeled with their loops counted as they run
(harness.measure_profiled); and transformers' own torch code (what Qwen3.5 runs without a
kernel) written op for op in JAX and compiled by XLA (torch_tpu's own lowering not checked). For
each implementation and generation: whether libtpu compiles it, its VMEM, and a time modeled
from the compiled program (bench/harness.py), with two yardsticks:

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
import functools
import sys
import time
import typing
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
TORCH_CODE = "transformers' torch code, XLA"


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


@dataclasses.dataclass
class Program:
    """What a row measures: fn at `args` (abstract arrays, then the concrete index arrays its control
    reads). profiled: its kernels copy their blocks themselves, so their loops and copies are
    counted as they run on the arguments, the arrays zeros (harness.measure_profiled)."""
    fn: typing.Callable
    args: list
    profiled: bool = False
    donate: tuple = ()  # arguments updated in place, as an engine keeps them (decode's states)
    kernels: bool = True  # False: no Pallas kernel to walk, every op XLA's

    def concrete_args(self) -> list:
        return [jnp.zeros(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a for a in self.args]


def ours(case: Case, generation: str) -> Program:
    """Our kernels as a JAX user calls them: the chunked rule (prefill; its gradients for a training
    step) or the recurrent one (decode)."""
    from gated_delta_rule import ops

    if case.phase == "decode":
        rule = ops.fused_recurrent_gated_delta_rule
    else:  # its heads per step chosen for the generation's cores
        rule = functools.partial(ops.chunk_gated_delta_rule, generation=generation)

    def forward(q, k, v, g, beta, h0):
        return rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                    interpret=False)

    if case.phase != "train":
        return Program(forward, specs(case), donate=(5,) * (case.phase == "decode"))

    def step(q, k, v, g, beta, h0, do):  # the loss and every gradient, as a training step needs both
        loss = lambda *args: jnp.sum(forward(*args)[0].astype(jnp.float32) * do)
        return jax.value_and_grad(loss, argnums=range(6))(q, k, v, g, beta, h0)

    return Program(step, specs(case))


def tpu_inference_v1(case: Case, generation: str) -> Program | None:
    """tpu-inference's `fused_gdn` (gdn v1, vLLM's TPU backend) as vLLM calls it: tokens packed
    [T, heads, dim], per-sequence state slots, its decode kernel for one-token sequences and its
    recurrent kernel (a token at a time) for longer ones; beta given raw (it applies the sigmoid).
    No backward: no training row."""
    import tpu_inference_kernels

    if case.phase == "train" or not tpu_inference_kernels.installed():
        return None
    gdn = tpu_inference_kernels.module("kernels.gdn.v1.fused_gdn_kernel_wrapper", generation)
    batch, tokens = case.batch_tokens
    n, seqs = batch * tokens, case.seqs

    def fn(q, k, v, g, b, state, cu_seqlens, state_indices, distribution):
        return gdn.fused_gdn(q, k, v, cu_seqlens, g, state, state_indices, distribution, b,
                             use_qk_l2norm_in_kernel=True)

    s = jax.ShapeDtypeStruct
    data = [s((n, HK, DK), jnp.bfloat16)] * 2 + [s((n, HV, DV), jnp.bfloat16), s((n, HV), jnp.float32),
                                                 s((n, HV), jnp.bfloat16), s((seqs, HV, DK, DV), jnp.float32)]
    decode_end = seqs if case.phase == "decode" else 0
    index = [jnp.arange(seqs + 1, dtype=jnp.int32) * tokens, jnp.arange(seqs, dtype=jnp.int32),
             jnp.array([decode_end, seqs], jnp.int32)]
    return Program(fn, data + index, profiled=True, donate=(2, 5))


def tpu_inference_v2(case: Case, generation: str) -> Program | None:
    """tpu-inference's `recurrent_scan` (gdn v2: chunks of 128 tokens, its prefill kernel) as vLLM
    calls it: q, k, v packed in one [T, 2 Hk dk + Hv dv] array, the gates from the layer's raw `a`
    and `b` (it computes g and beta, and a SiLU on q, k, v, itself). Prefill only."""
    import tpu_inference_kernels

    if case.phase != "prefill" or not tpu_inference_kernels.installed():
        return None
    gdn = tpu_inference_kernels.module("kernels.gdn.v2.recurrent_scan_v2", generation)
    tokens = case.size

    def fn(qkv, b, a, state, a_log, dt_bias, query_start_loc, state_indices, distribution, has_initial_state):
        return gdn.recurrent_scan(qkv, b, a, state, a_log, dt_bias, query_start_loc, state_indices, distribution,
                                  n_kq=HK, n_v=HV, d_k=DK, d_v=DV, has_initial_state=has_initial_state)

    s = jax.ShapeDtypeStruct
    data = [s((tokens, 2 * HK * DK + HV * DV), jnp.bfloat16), s((tokens, HV), jnp.bfloat16),
            s((tokens, HV), jnp.bfloat16), s((1, HV, DK, DV), jnp.float32), s((HV,), jnp.float32),
            s((HV,), jnp.float32)]
    index = [jnp.array([0, tokens], jnp.int32), jnp.array([0], jnp.int32), jnp.array([0, 1, 1], jnp.int32),
             jnp.ones((1,), jnp.int32)]
    return Program(fn, data + index, profiled=True, donate=(3,))


def torch_chunked(q, k, v, g, beta, h0, chunk: int = CHUNK):
    """transformers' `torch_chunk_gated_delta_rule` (Qwen3.5's fallback for prefill and training), op
    for op in JAX: q, k, v [B, T, H, d] (q and k a head per value head, as the model's layer repeats
    them), g, beta [B, T, H], h0 [B, H, dk, dv]; l2-normalised q and k. Everything in fp32 with fp32
    products (torch's default matmul precision, "highest"). Its loop over chunks is a scan: the same
    ops per chunk as the loop torch.compile unrolls, one loop body instead of hundreds (XLA's loop
    trips are counted as they run). Returns (o in q's dtype, the final
    states)."""
    mm = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
    t = lambda x: jnp.swapaxes(x, -1, -2)
    batch, tokens, heads, dk = k.shape
    dtype = q.dtype
    q, k, v, beta, g = (jnp.swapaxes(x, 1, 2).astype(jnp.float32) for x in (q, k, v, beta, g))
    q, k = _l2norm(q), _l2norm(k)
    q = q * dk ** -0.5
    pad = (-tokens) % chunk
    q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
    beta, g = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (beta, g))
    chunks = (tokens + pad) // chunk
    by_chunk = lambda x: x.reshape(batch, heads, chunks, chunk, x.shape[-1])
    q, k, k_beta, v_beta = map(by_chunk, (q, k, k * beta[..., None], v * beta[..., None]))
    cum = jnp.cumsum(g.reshape(batch, heads, chunks, chunk), axis=-1)
    upper = jnp.triu(jnp.ones((chunk, chunk), bool), 1)
    decay = jnp.exp(jnp.where(upper, -jnp.inf, cum[..., :, None] - cum[..., None, :]))
    ut_system = mm(k_beta, t(k)) * decay
    intra = mm(q, t(k)) * decay
    solve = functools.partial(jax.scipy.linalg.solve_triangular, ut_system, lower=True, unit_diagonal=True)
    new_values, k_cumdecay = solve(v_beta), solve(k_beta * jnp.exp(cum)[..., None])
    q = q * jnp.exp(cum)[..., None]
    k = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]

    def chunk_step(state, c):  # c: one chunk of each operand, chunks leading
        q_c, k_c, intra_c, new_values_c, k_cumdecay_c, chunk_decay_c = c
        v_new = new_values_c - mm(k_cumdecay_c, state)
        out = mm(q_c, state) + mm(intra_c, v_new)
        return state * chunk_decay_c + mm(t(k_c), v_new), out

    by_chunk_first = lambda x: jnp.moveaxis(x, 2, 0)
    state, o = jax.lax.scan(chunk_step, h0.astype(jnp.float32), tuple(map(by_chunk_first, (
        q, k, intra, new_values, k_cumdecay, chunk_decay))))
    o = jnp.moveaxis(o, 0, 2).reshape(batch, heads, -1, v.shape[-1])[:, :, :tokens]
    return jnp.swapaxes(o, 1, 2).astype(dtype), state


def torch_recurrent(q, k, v, g, beta, h0):
    """transformers' `torch_recurrent_gated_delta_rule` (Qwen3.5's fallback for decode), op for op in
    JAX, arguments as `torch_chunked`'s: the state decayed, read and updated token by token as
    elementwise products and sums (no matmul), in fp32."""
    dtype, dk = q.dtype, q.shape[-1]
    q, k, v, beta, g = (jnp.swapaxes(x, 1, 2).astype(jnp.float32) for x in (q, k, v, beta, g))
    q, k = _l2norm(q), _l2norm(k)
    q = q / dk ** 0.5
    state = h0.astype(jnp.float32)
    out = []
    for i in range(q.shape[2]):
        state = state * jnp.exp(g[:, :, i])[..., None, None]
        kv_mem = jnp.sum(state * k[:, :, i, :, None], axis=-2)
        delta = (v[:, :, i] - kv_mem) * beta[:, :, i, None]
        state = state + k[:, :, i, :, None] * delta[:, :, None, :]
        out.append(jnp.sum(state * q[:, :, i, :, None], axis=-2))
    return jnp.swapaxes(jnp.stack(out, axis=2), 1, 2).astype(dtype), state


def _l2norm(x):
    """transformers' (and fla's) l2norm: x / sqrt(sum x^2 + 1e-6) over the last axis."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def torch_code_in_xla(case: Case, generation: str) -> Program:
    """transformers' torch reference compiled whole by XLA (the ops it runs, not torch_tpu's own
    lowering of them): the function the model calls without a kernel (`torch_chunked` for prefill and its gradients for a training
    step, `torch_recurrent` for decode), compiled whole, its q and k repeated to a head per value
    head as the layer passes them."""
    args = specs(case)
    args[:2] = [jax.ShapeDtypeStruct(a.shape[:2] + (HV, DK), a.dtype) for a in args[:2]]
    rule = torch_recurrent if case.phase == "decode" else torch_chunked
    if case.phase != "train":
        return Program(rule, args, donate=(5,) * (case.phase == "decode"), kernels=False)

    def step(q, k, v, g, beta, h0, do):
        loss = lambda *a: jnp.sum(rule(*a)[0].astype(jnp.float32) * do)
        return jax.value_and_grad(loss, argnums=range(6))(q, k, v, g, beta, h0)

    return Program(step, args, kernels=False)


IMPLS = {"ours": ours, "tpu-inference gdn v1": tpu_inference_v1, "tpu-inference gdn v2": tpu_inference_v2,
         TORCH_CODE: torch_code_in_xla}


def rule_flops(case: Case) -> int:
    """The chunked rule's matmul work (see the module docstring): the yardstick of MXU use."""
    batch, tokens = case.batch_tokens
    per_token = 2 * (3 * DK * DV + CHUNK * (3 * DK + 2 * DV))
    return batch * tokens * HV * per_token * (3 if case.phase == "train" else 1)


def floor_bytes(case: Case) -> int:
    """A decode step's least traffic: each state read and written (fp32), q, k, v and o (bf16)."""
    batch, tokens = case.batch_tokens
    return case.seqs * HV * DK * DV * 4 * 2 + batch * tokens * 2 * (2 * HK * DK + 2 * HV * DV)


def measure(impl: str, case: Case, generation: str) -> dict | None:
    """A row of the table, or None where the implementation has no such case."""
    row = dict(case=case.name, impl=impl, generation=generation)
    try:
        program = IMPLS[impl](case, generation)
        if program is None:
            return None
        options = dict(compile_options=dict(donate_argnums=program.donate))
        if program.profiled:
            m = harness.measure_profiled(program.fn, program.args, program.concrete_args(), generation, **options)[0]
        else:
            m = harness.measure(program.fn, program.args, generation, KERNEL_NAME if program.kernels else "",
                                walked=program.kernels, **options)
    except Exception as err:  # a failed compile is a row, not the end of the run
        return row | harness.error_row(err)
    chip = GENERATIONS[generation]
    row |= m.figures()
    if case.phase == "decode":
        row["floor_us"] = floor_bytes(case) / chip.hbm_bytes_per_s * 1e6
    else:
        row["mxu_fraction"] = rule_flops(case) / (m.modeled_s * chip.bf16_flops)
    return row


def time_on_tpu(impl: str, case: Case, repeats: int = 20) -> dict | None:
    """Wall-clock time of the same program on the TPU jax runs on. Its data random, at most 0 (a
    log decay g must be; the other operands' signs do not change the time)."""
    from runtime.generations import current_generation

    program = IMPLS[impl](case, current_generation().name)
    if program is None:
        return None
    rng = np.random.default_rng(0)
    args = [jnp.asarray(-0.1 * np.abs(rng.standard_normal(a.shape)), a.dtype) if isinstance(a, jax.ShapeDtypeStruct)
            else a for a in program.args]
    fn = jax.jit(program.fn)  # (not donating: each run reads the same arguments)
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
        "bandwidth. tpu-inference's kernels (gdn v1, v2) copy their own blocks: modeled with their loops",
        "counted as they run and the copies a step waits for itself overlapping its compute entirely (a",
        "lower bound); a row whose compiled loops the model cannot match to the kernel's says so.",
        "transformers' torch code (`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`:",
        "fp32, fp32 products, a triangular solve per chunk) is written op for op in JAX and compiled by",
        "XLA whole, every op XLA's (no grid: `VMEM` is its largest fusion's).",
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
                row = time_on_tpu(impl, case)
                if row is not None:
                    measured.put(row)
                    print(row, flush=True)
        return 0
    results = harness.Results(args.out / "gated_delta_rule.json", key=lambda r: (r["case"], r["impl"], r["generation"]),
                              order=row_order)
    runs = [(c, i, g) for g in args.generations for c in cases for i in args.impls]
    start = time.perf_counter()
    for n, (case, impl, generation) in enumerate(runs, 1):
        print(f"[{n}/{len(runs)}] {case.name} {impl} {generation} ({time.perf_counter() - start:.0f} s)", flush=True)
        row = measure(impl, case, generation)
        if row is not None:
            results.put(row)
        write_markdown(results.rows, args.out / "gated_delta_rule.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
