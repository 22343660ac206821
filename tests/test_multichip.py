"""Our experts forward under transformers' tensor- and expert-parallel plans: 2 CPU processes
over gloo, against the single-process eager logits (tests/distributed_run.py)."""

import json
import subprocess
import sys
from pathlib import Path


def test_tensor_and_expert_parallel_plans_match_one_process(tmp_path):
    result = subprocess.run([sys.executable, str(Path(__file__).with_name("distributed_run.py")), str(tmp_path)],
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = {r["plan"]: r for r in map(json.loads, (l for l in result.stdout.splitlines() if l.startswith("{")))}
    assert len(rows) == 3, result.stdout[-2000:]
    for plan, r in rows.items():
        # fp32 throughout; the plans only change summation order (partial sums all-reduced).
        assert r["max_abs_error"] < 1e-4 * max(1.0, r["scale"]), (plan, r)
        # One call per MoE layer per forward, on the rank's own experts.
        assert r["calls"] == r["layers"], (plan, r)
        assert r["local_experts"] == ([8] if plan == "tensor parallel" else [4]), (plan, r)
