"""Run in a fresh process by test_multichip.py: tiny seed models (kernels/seed_models.py) with our
experts forward and flash attention, both loaded with get_kernel from the built trees, under
transformers' tensor- and expert-parallel plans for each family, in 2 processes over gloo (CPU),
against the single-process eager logits. One pair of worker processes runs every (seed, plan) in
turn (their imports dominate a tiny model's run). Prints one JSON line per seed and plan.

usage: distributed_run.py WORKDIR SEED...
"""

import json
import os
import socket
import sys
from pathlib import Path

if __name__ in ("__main__", "__mp_main__"):  # run (or a spawned worker), not imported by the test for PLANS
    os.environ.update(JAX_PLATFORMS="cpu", TORCH_DEVICE_BACKEND_AUTOLOAD="0", ALLOW_MULTIPLE_LIBTPU_LOAD="1",
                      PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "kernels"), str(ROOT)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import build_collection  # noqa: E402
import seed_models  # noqa: E402

KERNELS = build_collection.load_manifest()["kernels"]
ATTENTION = KERNELS["flash_attention"]["repo-id"]
EXPERTS = "ragged_dot_tpu_distributed_test"
# What each plan hands the experts forward on a rank (read from transformers 5.22):
PLANS = {
    # every expert, gate_up_proj split by columns (gate and up halves each), down_proj by rows,
    # attention heads split; each rank returns a partial sum that transformers all-reduces
    "tensor parallel": dict(tp_size=2),
    # the family's expert-parallel plan: half the experts per rank. Qwen3-MoE's, Qwen3.5-MoE's and
    # gpt-oss's send tokens to their expert's rank (all-to-all), arriving top-1 with local ids and
    # weight 1 in varying numbers; Gemma 4's masks the router (ids routed to the other rank arrive as
    # the sentinel E / 2) and all-reduces the outputs
    "expert parallel": dict(tp_size=2, ep_size=2, tp_plan={}),
    # router masking on a family whose default is all-to-all
    "expert parallel, router masking": dict(tp_size=2, ep_size=2, tp_plan={}, ep_plan={
        "model.layers.*.mlp.gate": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"}),
}
SEED_PLANS = {"qwen3_moe": list(PLANS)}  # every other MoE seed: the family's own two plans


def plans(seed: str) -> list[str]:
    if seed not in seed_models.MOE:
        return ["tensor parallel"]
    return SEED_PLANS.get(seed, ["tensor parallel", "expert parallel"])


def load_kernels(calls: list):
    """Our two kernels through get_kernel, as users load them; experts calls recorded."""
    from kernels import get_kernel
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssPreTrainedModel

    experts = get_kernel(KERNELS["ragged_dot"]["repo-id"], version=KERNELS["ragged_dot"]["version"])

    def counted(self, hidden_states, top_k_index, top_k_weights):
        calls.append(tuple(self.gate_up_proj.shape))
        return experts.experts_forward(self, hidden_states, top_k_index, top_k_weights)

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS, counted)
    # gpt-oss takes only the flash implementations it lists: the documented opt-in.
    GptOssPreTrainedModel._compatible_flash_implementations = [
        *GptOssPreTrainedModel._compatible_flash_implementations, ATTENTION]


def worker(rank, jobs, port, result_dir):
    """jobs: (seed, plan, checkpoint, ids) to run in turn; rank 0 saves each one's logits and calls."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        calls = []
        load_kernels(calls)
        for index, (seed, plan, checkpoint, ids) in enumerate(jobs):
            calls.clear()
            model = AutoModelForCausalLM.from_pretrained(
                checkpoint, distributed_config=DistributedConfig(**PLANS[plan]), dtype=torch.float32,
                attn_implementation=ATTENTION, experts_implementation=EXPERTS).eval()
            with torch.no_grad():
                logits = model(ids).logits
            if rank == 0:
                torch.save({"logits": logits, "calls": list(calls), "attention": model.config._attn_implementation},
                           os.path.join(result_dir, f"{index}.pt"))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(workdir: str, seeds: list[str]) -> None:
    # The built trees as a Hub cache; the workers inherit the environment and load from it.
    trees = build_collection.build_all(Path(workdir, "build"), ["ragged_dot", "flash_attention"])
    os.environ["KERNELS_CACHE"] = str(Path(workdir, "hub"))
    build_collection.make_hub_cache(trees, Path(os.environ["KERNELS_CACHE"]))
    from transformers import AutoModelForCausalLM

    jobs, expected = [], []
    for seed in seeds:
        torch.manual_seed(0)
        config = seed_models.config(seed)
        eager = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager").eval()
        checkpoint = os.path.join(workdir, seed)
        eager.save_pretrained(checkpoint)
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = eager(ids).logits
        layers = sum(hasattr(m, "has_gate") and hasattr(m, "is_transposed") for m in eager.modules())
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)
        for plan in plans(seed):
            jobs.append((seed, plan, checkpoint, ids))
            expected.append((want, layers, experts))
    result_dir = os.path.join(workdir, "results")
    os.makedirs(result_dir, exist_ok=True)
    mp.spawn(worker, args=(jobs, free_port(), result_dir), nprocs=2, join=True)
    for index, ((seed, plan, _, _), (want, layers, experts)) in enumerate(zip(jobs, expected)):
        got = torch.load(os.path.join(result_dir, f"{index}.pt"))
        print(json.dumps({"seed": seed, "plan": plan, "max_abs_error": (got["logits"] - want).abs().max().item(),
                          "scale": want.abs().max().item(), "attention": got["attention"], "calls": len(got["calls"]),
                          "layers": layers, "experts": experts,
                          "local_experts": sorted({shape[0] for shape in got["calls"]})}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
