"""flash attention's block choice (tuned table, else the rule) and the flash bench's goal
verdicts, on hand-made inputs, and that each anchor loads and traces: cheap checks that run without
compiling."""

import sys

import jax
import jax.numpy as jnp
import pytest

import flash_bench
from flash_attention import tuning
from flash_attention.kernel import BlockSizes


@pytest.mark.parametrize("call,key", [
    ((8192, 128, 128, 4), (128, 4, 8192)),
    ((3000, 80, 80, 2), (128, 4, 2048)),  # head_dim and G round up
    ((5000, 192, 128, 6), (256, 8, 8192)),  # tokens to the nearest by ratio; value head_dim counts too
    ((100_000, 64, 64, 1), (64, 1, 32768)),
    ((1, 256, 256, 16), (256, 8, 2048)),
    ((8192, 512, 512, 8), (512, 8, 8192)),
])
def test_table_key_buckets_a_call(call, key):
    assert tuning.table_key(*call) == key


def test_tuned_entry_serves_bf16_calls_of_its_bucket_only(monkeypatch):
    monkeypatch.setattr(tuning, "TUNED", {"v6e": {(128, 4, 8192): (1024, 1024, ("fwd",))}})
    tuned = tuning.choose_blocks(8000, 8000, 128, 128, 4, 2, "v6e")
    assert (tuned.block_q * 4, tuned.block_k, tuned.lp_kernels) == (1024, 1024, ("fwd",))
    rule = tuning.GQA_BLOCK
    for call in [dict(itemsize=4), dict(generation="v5e"), dict(window=127), dict(num_q=2048)]:
        args = dict(num_q=8000, num_k=8000, head_dim=128, value_dim=128, groups=4, itemsize=2, generation="v6e")
        args.update(call)
        blocks = tuning.choose_blocks(**args)
        assert (blocks.block_q * 4, blocks.block_k) != (1024, 1024), call
        assert blocks.lp_kernels == (), call  # the scheduler choice comes with the entry only
        if "window" not in call:
            assert (blocks.block_q * 4, blocks.block_k) == rule


def test_a_wider_head_than_the_table_holds_takes_the_narrower_entry_cut(monkeypatch):
    """Gemma 4's 512: its own entry where the table holds one at the call's G and length, else the
    widest narrower head_dim's, its rows and keys cut by the ratio of head dims (the VMEM they were
    rated at); the rule (rated up to RULE_HEAD_DIM) likewise."""
    d256, d512 = (2048, 1024, ("fwd",)), (2048, 512)
    monkeypatch.setattr(tuning, "TUNED", {"v6e": {(256, 8, 8192): d256, (512, 8, 8192): d512}})
    blocks = lambda groups, head_dim=512, generation="v6e": tuning.choose_blocks(
        8192, 8192, head_dim, head_dim, groups, 2, generation)
    own = blocks(8)
    assert (own.block_q * 8, own.block_k, own.lp_kernels) == (2048, 512, ())
    monkeypatch.setattr(tuning, "TUNED", {"v6e": {(256, 8, 8192): d256}})
    cut = blocks(8)
    assert (cut.block_q * 8, cut.block_k, cut.lp_kernels) == (1024, 512, ("fwd",))
    assert (blocks(8, head_dim=256).block_q * 8, blocks(8, head_dim=256).block_k) == (2048, 1024)
    rule = blocks(8, generation="v5e")
    assert (rule.block_q * 8, rule.block_k) == (tuning.GQA_BLOCK[0] // 2, tuning.GQA_BLOCK[1] // 2)


def _row(impl, us, model="Qwen3-32B", tokens=8192, **extra):
    return dict(model=model, tokens=tokens, pass_="fwd", generation="v6e", impl=impl, tiling="512x512",
                modeled_us=us, **extra)


def _verdicts(rows):
    return [line.split("|")[5].strip() + ": " + line.split("|")[-2].strip() for line in flash_bench.goal_rows(rows)]


def test_goals_compare_with_the_fastest_anchor_and_the_thresholds():
    ours = _row("ours", 100.0, mxu_vs_dense=0.53, kv_reads_vs_query_blocks=1.02)
    assert _verdicts([ours, _row("splash", 120.0), _row("tokamax", 101.0)]) == [
        "time no worse than the best anchor: met",
        f"causal executes <= {flash_bench.MAX_EXECUTED_VS_DENSE}x dense FLOPs: met",
        f"K/V reads <= {flash_bench.MAX_KV_READS}x (query blocks) x (K and V size): met"]
    slower = _row("ours", 102.0, mxu_vs_dense=0.56, kv_reads_vs_query_blocks=1.2)
    assert [v.split(": ")[1] for v in _verdicts([slower, _row("splash", 120.0), _row("tokamax", 101.0)])] == [
        "NOT met"] * 3
    line = flash_bench.goal_rows([slower, _row("tokamax", 101.0)])[0]
    assert "tokamax 512x512: 101 us" in line


def test_goals_say_na_without_a_compiling_anchor_and_skip_other_lengths():
    ours = _row("ours", 100.0, tokens=2048, mxu_vs_dense=0.9)
    failed = dict(_row("splash", 0.0, tokens=2048), error="does not compile")
    del failed["modeled_us"]
    assert _verdicts([ours, failed]) == ["time no worse than the best anchor: n/a"]
    mha = _row("ours", 100.0, model="Llama-2-7B (MHA)", mxu_vs_dense=0.5, kv_reads_vs_query_blocks=3.0)
    assert len(flash_bench.goal_rows([mha])) == 2  # the K/V read goal is for GQA shapes


def test_other_head_dims_rate_the_reference_entrys_best_candidates():
    import flash_tune

    reference = dict(candidates=[dict(blocks=[512, 512], modeled_us=30.0), dict(blocks=[256, 1024], modeled_us=10.0),
                                 dict(blocks=[1024, 512], error="vmem"), dict(blocks=[512, 1024], modeled_us=20.0)])
    assert flash_tune.followed(reference, groups=4) == [(1024, 1024), (2048, 1024)]  # (rows, keys), fastest first
    assert flash_tune.followed(None, groups=4) is None
    assert flash_tune.followed(dict(candidates=[dict(blocks=[512, 512], error="vmem")]), groups=4) is None


def test_fused_dq_counts_head_dims_padded_to_lanes_and_one_output_buffer():
    """gpt-oss-20b's 8k training step on tpu7x (head_dim 64, G = 8, the window's 128 x 128 blocks):
    its dq held in VMEM takes 8k x 8 rows x 128 lanes x (f32 + bf16) = 48 MiB, the whole budget of
    a 64 MiB core (unpadded it looked like half that, and libtpu ran out of VMEM). Llama-3-8B's
    (head_dim 128, its tuned 512 x 512 blocks) fits, and Gemma-2-9B's (head_dim 256, G = 2, 1024 x
    512 blocks: 24 MiB and dkv's own 18) fits with dq's output block in one buffer, not in two."""
    assert tuning.fused_dq_vmem_limit(8192 * 8, 64, 64, 2, BlockSizes(128, 128), 8, "tpu7x") is None
    assert tuning.fused_dq_vmem_limit(8192 * 4, 128, 128, 2, BlockSizes(512, 512), 4, "tpu7x") is not None
    assert tuning.fused_dq_vmem_limit(8192 * 2, 256, 256, 2, BlockSizes(1024, 512), 2, "tpu7x") is not None


def test_dq_split_takes_the_fewest_groups_whose_dq_fits():
    """Qwen3-32B's 8k training step on tpu7x (G = 8, 512 x 512 blocks): a KV head's dq (48 MiB)
    does not fit, half of its heads' does. Llama-3-8B's fits whole. Groups whose rows would not
    fill whole lanes at these blocks (16 query tokens), or would be small blocks (gpt-oss-20b's
    window: 128 tokens, 512 rows in half its heads), are not taken."""
    qwen = (8192 * 8, 128, 128, 2, BlockSizes(512, 512), 8, "tpu7x")
    assert tuning.fused_dq_vmem_limit(*qwen) is None
    assert tuning.fused_dq_split(*qwen) == (2, tuning.fused_dq_vmem_limit(8192 * 4, 128, 128, 2, BlockSizes(512, 512),
                                                                          4, "tpu7x"))
    assert tuning.fused_dq_split(8192 * 4, 128, 128, 2, BlockSizes(512, 512), 4, "tpu7x")[0] == 1
    assert tuning.fused_dq_split(8192 * 8, 128, 128, 2, BlockSizes(16, 512), 8, "tpu7x") == (1, None)
    assert tuning.fused_dq_split(8192 * 8, 64, 64, 2, BlockSizes(128, 128), 8, "tpu7x") == (1, None)


def test_tuned_table_is_what_the_evidence_chooses():
    """Every record's best is its fastest candidate, and tuned_blocks.py holds exactly those."""
    import json

    import flash_tune

    assert set(tuning.TUNED) >= {"v6e", "tpu7x"}
    for generation in tuning.TUNED:
        records = json.loads(flash_tune.results_file(generation).read_text())
        for record in records:
            fastest = min((c for c in record["candidates"] if "modeled_us" in c), key=lambda c: c["modeled_us"])
            assert record["best"] == [fastest["blocks"][0] * record["key"][1], fastest["blocks"][1]], record["key"]
        assert tuning.TUNED[generation] == {tuple(r["key"]): flash_tune.table_value(r) for r in records}


def test_lp_scheduler_is_chosen_where_modeled_faster_by_the_margin():
    """The LP scheduler is taken per kernel only where it is modeled at least LP_MARGIN faster; a
    kernel whose LP variant did not compile (an error string) keeps the default."""
    import flash_tune

    def rated(fwd):
        return {"fwd": {"default": 1000.0, "fwd": fwd}}

    assert flash_tune.LP_RATINGS == (("fwd", "fwd"),)
    assert flash_tune.lp_choice(rated(980.0)) == ("fwd",)
    assert flash_tune.lp_choice(rated(995.0)) == ()  # 0.5%: within the margin
    assert flash_tune.lp_choice(rated("RESOURCE_EXHAUSTED")) == ()
    record = dict(key=[128, 4, 8192], best=[2048, 512], scheduler=rated(900.0))
    assert flash_tune.table_value(record) == (2048, 512, ("fwd",))
    assert flash_tune.table_value(dict(record, scheduler=rated(1000.0))) == (2048, 512, ())
    del record["scheduler"]["fwd"]["fwd"]
    assert flash_tune.table_value(record) == (2048, 512)  # not rated: the default scheduler


def full_ratings(generation: str) -> dict:
    """flash_tune.FOLLOW_EVIDENCE's records of `generation` by key, each rated over every candidate."""
    import json

    import flash_tune

    records = [r for r in json.loads(flash_tune.FOLLOW_EVIDENCE.read_text()) if r["generation"] == generation]
    assert not [r["key"] for r in records if "rated" in r], "evidence rated over fewer candidates"
    return {tuple(r["key"]): r for r in records}


def test_v6e_head_dims_share_the_reference_entrys_best():
    """What FOLLOW rests on: where every head_dim was rated in full (v6e, 2k and 8k), the
    reference head_dim's best is among its FOLLOW best at every other head_dim."""
    import flash_tune

    records = full_ratings("v6e")
    pairs = 0
    for (d, g, t), record in records.items():
        reference = records.get((flash_tune.REFERENCE_HEAD_DIM, g, t))
        if d == flash_tune.REFERENCE_HEAD_DIM or reference is None:
            continue
        assert tuple(record["best"]) in flash_tune.followed(reference, g), (d, g, t)
        pairs += 1
    assert pairs >= 12


def test_8k_entries_share_their_2k_entrys_best():
    """What FOLLOWED_TOKENS rests on: every entry rated in full at 8k (any head_dim, every
    generation) has its best among the FOLLOW best of its 2k entry, and reference_key sends
    head_dim 128 at 8k there (the others to head_dim 128 at their length; 32k rates in full)."""
    import flash_tune

    pairs = 0
    for generation in tuning.TUNED:
        records = full_ratings(generation)
        for (d, g, t), record in records.items():
            shorter = records.get((d, g, flash_tune.FOLLOWED_TOKENS.get(t)))
            if shorter is None:
                continue
            assert tuple(record["best"]) in flash_tune.followed(shorter, g), (generation, d, g, t)
            pairs += 1
    assert pairs >= 13
    assert flash_tune.reference_key(128, 4, 8192) == (128, 4, 2048)
    assert flash_tune.reference_key(64, 4, 8192) == (128, 4, 8192)
    assert flash_tune.reference_key(128, 4, 32768) is None and flash_tune.reference_key(128, 4, 2048) is None


@pytest.mark.parametrize("impl", list(flash_bench.ANCHORS))
def test_every_anchor_loads_and_traces(impl, monkeypatch):
    """An anchor that no longer loads (a stub of tpu-inference's package missing a name) would
    leave every row of it an error, read as "none compiles": each traces on an MHA shape, which
    all of them serve, through its backward where it has one."""
    monkeypatch.setattr(sys, "argv", sys.argv[:1])  # tokamax parses absl flags from sys.argv
    make, _, has_backward = flash_bench.ANCHORS[impl]
    shape, tokens = flash_bench.SHAPES[0], 1024
    fn = make(shape, 512, 512)
    specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in (
        (1, tokens, shape.q_heads, shape.head_dim), (1, tokens, shape.kv_heads, shape.head_dim),
        (1, tokens, shape.kv_heads, shape.head_dim), (shape.q_heads,))]
    out = jax.eval_shape(flash_bench._program(fn, "fwd+bwd" if has_backward else "fwd"), *specs)
    assert [o.shape for o in jax.tree.leaves(out)] == ([s.shape for s in specs] if has_backward else [specs[0].shape])


@pytest.mark.parametrize("experimental_scheduler", [True, False])
def test_tokamax_scheduler_choice_reaches_its_kernel(experimental_scheduler, monkeypatch):
    """The bench rates tokamax with and without libtpu's LP scheduler (its autotuner tries both):
    the choice must be in its forward kernel's compiler flags, or both rows would be one."""
    import re

    import tpu_compile

    monkeypatch.setattr(sys, "argv", sys.argv[:1])  # tokamax parses absl flags from sys.argv
    shape, tokens = flash_bench.SHAPES[0], 1024
    fn = flash_bench.tokamax_attention(shape, 512, 512, experimental_scheduler=experimental_scheduler)
    device = tpu_compile.device_for("v6e")
    specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=jax.sharding.SingleDeviceSharding(device)) for s in (
        (1, tokens, shape.q_heads, shape.head_dim), (1, tokens, shape.kv_heads, shape.head_dim),
        (1, tokens, shape.kv_heads, shape.head_dim), (shape.q_heads,))]
    with jax.default_device(device):
        text = jax.jit(fn).lower(*specs).as_text()
    flags = re.findall(r"XLA_TPU_FORCE_LP_LLO_SCHEDULER\\22, \\22value\\22: \{\\22boolean_value\\22: (\w+)", text)
    assert flags == [str(experimental_scheduler).lower()]


def test_unfused_backward_raises_the_vmem_limit_only_where_dkv_needs_it():
    """Where dq is not fused, the backward's kernels keep Mosaic's default VMEM limit unless dkv's
    estimate nears it: Gemma-2-9B's 32k training step on tpu7x (head_dim 256, 1024 x 1024 blocks,
    dkv compiled at 34 MiB) gets most of the chip's; gpt-oss-20b's (128 x 128 blocks) keeps the
    default, where a raised limit compiled slower code."""
    assert tuning.backward_vmem_limit(256, 256, 2, BlockSizes(1024, 1024), 2, "tpu7x") == int(0.9 * 64 * 2**20)
    assert tuning.backward_vmem_limit(64, 64, 2, BlockSizes(128, 128), 8, "tpu7x") is None
