"""Run in a fresh process by test_multichip.py: a tiny Qwen3-MoE with our experts forward under
transformers' tensor- and expert-parallel plans, in 2 processes over gloo (CPU), against the
single-process eager logits. Prints one JSON line per plan.

usage: distributed_run.py CHECKPOINT_DIR
"""

import json
import os
import socket
import sys

os.environ.update(JAX_PLATFORMS="cpu", TORCH_DEVICE_BACKEND_AUTOLOAD="0", ALLOW_MULTIPLE_LIBTPU_LOAD="1",
                  PYTHONWARNINGS="ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

IMPL = "ragged_dot_tpu_distributed_test"
ROUTER_PLAN = {"model.layers.*.mlp.gate": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"}
# What each plan hands the experts forward on a rank (read from transformers 5.22):
PLANS = {
    # every expert, gate_up_proj split by columns (gate and up halves each), down_proj by rows;
    # each rank returns a partial sum that transformers all-reduces
    "tensor parallel": dict(tp_size=2),
    # half the experts per rank; ids routed to the other rank arrive as the sentinel E / 2;
    # transformers all-reduces the outputs
    "expert parallel, router masking": dict(tp_size=2, ep_size=2, tp_plan={}, ep_plan=ROUTER_PLAN),
    # Qwen3-MoE's default: tokens travel to their expert's rank (all-to-all) and arrive top-1,
    # with local ids and weight 1, in varying numbers
    "expert parallel, all-to-all dispatch": dict(tp_size=2, ep_size=2, tp_plan={}),
}


def config():
    from transformers import Qwen3MoeConfig

    # initializer_range 0.2 (not 0.02): logits of order 1, so a wrong expert shows in a diff.
    return Qwen3MoeConfig(vocab_size=128, hidden_size=128, intermediate_size=128, moe_intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                          tie_word_embeddings=False, initializer_range=0.2, max_position_embeddings=64)


def register(calls: list):
    import ragged_dot
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    def counted(self, hidden_states, top_k_index, top_k_weights):
        calls.append(tuple(self.gate_up_proj.shape))
        return ragged_dot.experts_forward(self, hidden_states, top_k_index, top_k_weights)

    ALL_EXPERTS_FUNCTIONS.register(IMPL, counted)


def worker(rank, plan, checkpoint, port, ids, result_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from transformers import Qwen3MoeForCausalLM
        from transformers.distributed import DistributedConfig

        calls = []
        register(calls)
        model = Qwen3MoeForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(**PLANS[plan]),
                                                    dtype=torch.float32, experts_implementation=IMPL).eval()
        with torch.no_grad():
            logits = model(ids).logits
        if rank == 0:
            torch.save({"logits": logits, "calls": calls}, result_path)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(checkpoint: str) -> None:
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    eager = Qwen3MoeForCausalLM._from_config(config(), dtype=torch.float32, experts_implementation="eager").eval()
    eager.save_pretrained(checkpoint)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = eager(ids).logits
    layers = config().num_hidden_layers
    for plan in PLANS:
        result_path = os.path.join(checkpoint, "result.pt")
        mp.spawn(worker, args=(plan, checkpoint, free_port(), ids, result_path), nprocs=2, join=True)
        got = torch.load(result_path)
        print(json.dumps({"plan": plan, "max_abs_error": (got["logits"] - want).abs().max().item(),
                          "scale": want.abs().max().item(), "calls": len(got["calls"]), "layers": layers,
                          "local_experts": sorted({shape[0] for shape in got["calls"]})}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
