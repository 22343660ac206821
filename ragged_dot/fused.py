"""A decode step's whole experts layer in one kernel: both projections, the gate
and the weighted sum over each token's experts.

At decode the layer's time is its routed experts' weights read once from HBM;
two grouped matmuls each wait for their first copies and end with a step of
compute after their last, and the rows are sorted, gathered and combined
around them. Here one kernel walks the routed experts (`live`), each in
chunks of its intermediate dim: a chunk's gate, up and down weights come
through one ring of copies (several in flight), and each step computes every
token's rows against them. A token's rows for experts it was not routed to
are computed and dropped (`routed`): at decode the MXU's time goes to loading
the weights, not to the rows, and no row is sorted or gathered. The down
projection sums each expert's chunks in float32, rounds the expert's output
to the weights' dtype once (as the grouped path rounds the down projection's
output) and adds it times the token's weight. Experts in bf16 or fp32, or
int8 with a scale per output channel; which steps take it: `ops.fused_decode_applies`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._shared.tuning import round_up
from .tuning import max_buffers, vmem_limit

ROW_TILE = 16  # tokens are padded to a multiple of this (a bf16 vreg's sublanes)


class FusedBlocks(NamedTuple):
    chunk: int  # columns of the intermediate dim per step (a multiple of 128 dividing it)
    depth: int  # ring slots; depth - 1 chunks' copies in flight


# Up to this many tokens a step runs fused (`ops.fused_decode_applies`): there one kernel's single
# wait for its first copies and single last step outweigh multiplying every token's rows by every
# routed expert. Modeled (Qwen3-30B-A3B, Qwen3.5-35B-A3B): faster than the grouped path at one and
# two tokens on every generation; from four tokens no faster on v6e.
FUSED_TOKENS = 2
# Chunks of 128 with two in flight: the smallest chunk keeps the step after the last copy short.
BLOCKS = FusedBlocks(chunk=128, depth=3)


def vmem_need(tokens: int, hidden: int, weight_dtype, blocks: FusedBlocks = BLOCKS, scaled: bool = False) -> int:
    """The kernel's VMEM bytes: the ring's gate, up and down slots, the tokens' rows (taken as fp32:
    at most) and weights, double-buffered, the output and the expert's float32 sum; and int8
    weights' scales, double-buffered."""
    padded = round_up(tokens, ROW_TILE)
    itemsize = jnp.dtype(weight_dtype).itemsize
    ring = blocks.depth * 3 * blocks.chunk * hidden * itemsize
    rows = 2 * padded * hidden * 4 + 4 * padded * 128 * 4
    scales = 2 * 8 * (2 * blocks.chunk + hidden) * 4 if scaled else 0  # a [1, n] float32 block takes 8 sublanes
    return ring + rows + 3 * padded * hidden * 4 + scales


def fits(tokens: int, hidden: int, weight_dtype, generation: str, scaled: bool = False) -> bool:
    return vmem_need(tokens, hidden, weight_dtype, BLOCKS, scaled) <= max_buffers(generation)


def _kernel(live_ref, num_live_ref, x_ref, weight_ref, routed_ref, *refs, chunks: int, inter: int, depth: int,
            activation, precision, scaled: bool):
    gate_scale, up_scale, down_scale = refs[:3] if scaled else (None, None, None)
    gate_up_hbm, down_hbm, out_ref, gate_slots, up_slots, down_slots, sems, expert_out = refs[3 if scaled else 0:]
    step = pl.program_id(0)
    c = step % chunks
    live_steps = num_live_ref[0] * chunks
    tile = gate_slots.shape[1]

    def copies(s):
        e, chunk = live_ref[s // chunks], s % chunks
        slot = s % depth
        return (
            pltpu.make_async_copy(gate_up_hbm.at[e, pl.ds(chunk * tile, tile), :], gate_slots.at[slot],
                                  sems.at[0, slot]),
            pltpu.make_async_copy(gate_up_hbm.at[e, pl.ds(inter + chunk * tile, tile), :], up_slots.at[slot],
                                  sems.at[1, slot]),
            pltpu.make_async_copy(down_hbm.at[e, :, pl.ds(chunk * tile, tile)], down_slots.at[slot],
                                  sems.at[2, slot]),
        )

    @pl.when(step == 0)
    def _():
        out_ref[...] = jnp.zeros_like(out_ref)

    for first in range(depth - 1):
        @pl.when(jnp.logical_and(step == 0, first < live_steps))
        def _():
            for copy in copies(first):
                copy.start()

    @pl.when(step < live_steps)
    def _():
        for copy in copies(step):
            copy.wait()

    @pl.when(step + depth - 1 < live_steps)
    def _():
        for copy in copies(step + depth - 1):
            copy.start()

    @pl.when(step < live_steps)
    def _():
        slot = step % depth
        x = x_ref[...]
        dims = (((1,), (1,)), ((), ()))  # x [T, H] . w [tile, H]^T
        # int8 weights go into a bf16 product as they are (Mosaic widens them on the way into the
        # MXU), into an fp32 one widened in VMEM (exactly); their scale per output channel multiplies
        # the fp32 product, as the grouped kernel's.
        widen = lambda w: w.astype(x.dtype) if x.dtype == jnp.float32 else w
        gate = jax.lax.dot_general(x, widen(gate_slots[slot]), dims, precision=precision,
                                   preferred_element_type=jnp.float32)
        up = jax.lax.dot_general(x, widen(up_slots[slot]), dims, precision=precision,
                                 preferred_element_type=jnp.float32)
        if scaled:
            gate, up = gate * gate_scale[...], up * up_scale[...]
        act = (activation(gate) * up).astype(x.dtype)
        part = jax.lax.dot_general(act, widen(down_slots[slot]), dims, precision=precision,
                                   preferred_element_type=jnp.float32)

        @pl.when(c == 0)
        def _():
            expert_out[...] = part

        @pl.when(c > 0)
        def _():
            expert_out[...] += part

        @pl.when(c == chunks - 1)
        def _():
            y = expert_out[...] * down_scale[...] if scaled else expert_out[...]
            y = y.astype(x.dtype).astype(jnp.float32)
            out_ref[...] += jnp.where(routed_ref[0] > 0, y * weight_ref[0], 0.0)


def fused_experts(hidden_states, live, num_live, weight, routed, gate_up_proj, down_proj, up_scale=None,
                  down_scale=None, *, activation, generation: str, blocks: FusedBlocks = BLOCKS, interpret=False):
    """out [T, H] float32 = sum over live experts j of weight[j] * (act(x gate_j^T) * (x up_j^T)) down_j^T.

    hidden_states [T, H] (T a multiple of ROW_TILE); live int32 [L]: the experts to walk, the first
    num_live ([1]) of them; weight, routed float32 [L, T, 1]: each token's weight for live[j] and 1
    where the token was routed to it (its row is added, even at weight 0, so a non-finite output
    stays its own token's); gate_up_proj [E, 2I, H] (gate rows then up rows); down_proj [E, H, I];
    int8 weights with their float32 scales per output channel, up_scale [E, 2I] and down_scale [E, H]."""
    tokens, hidden = hidden_states.shape
    _, two_inter, _ = gate_up_proj.shape
    inter = two_inter // 2
    chunk, depth = blocks
    chunks = inter // chunk
    # A dynamic grid: no step for the live slots left unused; one (zeroing the output) when no token
    # is routed here (expert parallel: every slot on other shards).
    num_steps = jnp.maximum(num_live[0] * chunks, 1)
    dtype = gate_up_proj.dtype
    precision = jax.lax.Precision.HIGHEST if hidden_states.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    per_expert = lambda s, live, n: (s // chunks, 0, 0)
    scaled = up_scale is not None
    scale_specs, scales = [], []
    if scaled:  # each step's chunk of the gate's and up's scales, the expert's down scales
        scale_specs = [pl.BlockSpec((None, 1, chunk), lambda s, live, n: (live[s // chunks], 0, s % chunks)),
                       pl.BlockSpec((None, 1, chunk), lambda s, live, n: (live[s // chunks], 0, chunks + s % chunks)),
                       pl.BlockSpec((None, 1, hidden), lambda s, live, n: (live[s // chunks], 0, 0))]
        scales = [up_scale[:, None, :], up_scale[:, None, :], down_scale[:, None, :]]
    return pl.pallas_call(
        functools.partial(_kernel, chunks=chunks, inter=inter, depth=depth, activation=activation,
                          precision=precision, scaled=scaled),
        out_shape=jax.ShapeDtypeStruct((tokens, hidden), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(num_steps,),
            in_specs=[
                pl.BlockSpec((tokens, hidden), lambda s, live, n: (0, 0)),
                pl.BlockSpec((1, tokens, 1), per_expert),
                pl.BlockSpec((1, tokens, 1), per_expert),
                *scale_specs,
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec((tokens, hidden), lambda s, live, n: (0, 0)),
            scratch_shapes=[
                pltpu.VMEM((depth, chunk, hidden), dtype),
                pltpu.VMEM((depth, chunk, hidden), dtype),
                pltpu.VMEM((depth, hidden, chunk), dtype),
                pltpu.SemaphoreType.DMA((3, depth)),
                pltpu.VMEM((tokens, hidden), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),  # the ring and the output's sum run in step order
            vmem_limit_bytes=vmem_limit(vmem_need(tokens, hidden, dtype, blocks, scaled), generation),
        ),
        interpret=interpret,
        name="fused_experts_tpu",
    )(live, num_live, hidden_states, weight, routed, *scales, gate_up_proj, down_proj)


def routed_experts(top_k_index, top_k_weights, num_experts: int, padded_tokens: int):
    """(live, num_live, weight, routed) for `fused_experts`: the experts some token is routed to,
    in id order, then zeros up to L = min(E, T * k) entries; each token's weight and routing per
    live expert, [L, padded_tokens, 1] (zero past the tokens). Ids outside [0, E) route nowhere."""
    tokens, top_k = top_k_index.shape
    ids = top_k_index.reshape(-1)
    present = (jnp.bincount(jnp.clip(ids, 0, num_experts), length=num_experts + 1)[:num_experts] > 0).astype(jnp.int32)
    slots = min(num_experts, tokens * top_k)
    (live,) = jnp.nonzero(present, size=slots, fill_value=0)
    live = live.astype(jnp.int32)
    num_live = jnp.sum(present, dtype=jnp.int32)[None]
    hit = (top_k_index[None, :, :] == live[:, None, None]) & (jnp.arange(slots)[:, None, None] < num_live[0])
    weight = jnp.sum(jnp.where(hit, top_k_weights.astype(jnp.float32)[None], 0.0), axis=2)
    routed = jnp.any(hit, axis=2).astype(jnp.float32)
    pad = ((0, 0), (0, padded_tokens - tokens))
    return live, num_live, jnp.pad(weight, pad)[..., None], jnp.pad(routed, pad)[..., None]


def experts_forward_fused(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, up_scale=None,
                          down_scale=None, *, activation, generation: str, blocks: FusedBlocks = BLOCKS,
                          interpret=False):
    """experts_forward's output, float32 [T, H], from `fused_experts`: the tokens padded to ROW_TILE
    rows, their routing per live expert (`routed_experts`)."""
    tokens = hidden_states.shape[0]
    padded = round_up(tokens, ROW_TILE)
    live, num_live, weight, routed = routed_experts(top_k_index, top_k_weights, gate_up_proj.shape[0], padded)
    x = jnp.pad(hidden_states, ((0, padded - tokens), (0, 0)))
    out = fused_experts(x, live, num_live, weight, routed, gate_up_proj, down_proj, up_scale, down_scale,
                        activation=activation, generation=generation, blocks=blocks, interpret=interpret)
    return out[:tokens]
