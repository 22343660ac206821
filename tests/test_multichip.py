"""The seed models with our flash attention and (MoE ones) experts forward, both loaded with
get_kernel, under transformers' tensor-parallel plan for their family and, for MoE ones, its
expert-parallel plan: 2 CPU processes over gloo, against the single-process eager logits
(tests/distributed_run.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import distributed_run
import seed_models


@pytest.mark.parametrize("seed", sorted(seed_models.SEEDS))
def test_tensor_and_expert_parallel_plans_match_one_process(tmp_path, seed):
    result = subprocess.run([sys.executable, str(Path(__file__).with_name("distributed_run.py")), seed, str(tmp_path)],
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = {r["plan"]: r for r in map(json.loads, (l for l in result.stdout.splitlines() if l.startswith("{")))}
    assert list(rows) == distributed_run.plans(seed), result.stdout[-2000:]
    for plan, r in rows.items():
        # fp32 throughout; the plans change summation order (partial sums all-reduced), our kernels
        # the order within attention and the experts: as the single-process test, 2e-5 of the largest logit.
        assert r["max_abs_error"] < 2e-5 * r["scale"], (plan, r)
        assert r["attention"] == distributed_run.ATTENTION, (plan, r)
        # One call per MoE layer per forward, on the rank's own experts (dense seeds: none).
        assert r["calls"] == r["layers"] and bool(r["layers"]) == (seed in seed_models.MOE), (plan, r)
        if r["layers"]:
            assert r["local_experts"] == [r["experts"] // (1 if plan == "tensor parallel" else 2)], (plan, r)
