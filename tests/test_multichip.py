"""The seed models with our flash attention and (MoE ones) experts forward, both loaded with
get_kernel, under transformers' tensor-parallel plan for their family and, for MoE ones, its
expert-parallel plan: 2 CPU processes over gloo, against the single-process eager logits
(tests/distributed_run.py)."""

import json
import subprocess
import sys
from pathlib import Path

import distributed_run
import seed_models


def test_tensor_and_expert_parallel_plans_match_one_process(tmp_path):
    """Every seed and plan in one run of distributed_run.py (one pair of worker processes: their
    imports, not the tiny models, take its time)."""
    seeds = sorted(seed_models.SEEDS)
    result = subprocess.run([sys.executable, str(Path(__file__).with_name("distributed_run.py")), str(tmp_path), *seeds],
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(l) for l in result.stdout.splitlines() if l.startswith("{")]
    assert [(r["seed"], r["plan"]) for r in rows] == [(s, p) for s in seeds for p in distributed_run.plans(s)], \
        result.stdout[-2000:]
    for r in rows:
        seed, plan = r["seed"], r["plan"]
        # fp32 throughout; the plans change summation order (partial sums all-reduced), our kernels
        # the order within attention and the experts: as the single-process test, 2e-5 of the largest logit.
        assert r["max_abs_error"] < 2e-5 * r["scale"], r
        assert r["attention"] == distributed_run.ATTENTION, r
        # One call per MoE layer per forward, on the rank's own experts (dense seeds: none).
        assert r["calls"] == r["layers"] and bool(r["layers"]) == (seed in seed_models.MOE), r
        if r["layers"]:
            assert r["local_experts"] == [r["experts"] // (1 if plan == "tensor parallel" else 2)], r
