"""A small serving loop of our own with vLLM's calls, for engine authors to read: per step, every
running request's new tokens (a prefill chunk, or the last generated token) packed in one row,
each layer writing its K and V with `reshape_and_cache_flash` and attending with
`ragged_paged_attention` over pages handed out from a free list. Requests join and finish at
different steps; their pages go back to the free list and are reused. Every step is padded to one
shape, as engines pad for graph capture. Used by tests/test_paged_attention_serving.py and
`make demo`, with paged-attention-tpu loaded by get_kernel.

    register()                               # once: the attention function, with transformers
    model.set_attn_implementation(ATTENTION)
    steps = serve(model, kernel, [Request(prompt_ids, max_new_tokens, joins_at=0), ...])
"""

from __future__ import annotations

import dataclasses

import torch

ATTENTION = "paged_serving_loop"  # our loop's attention function, registered with transformers
PAGE_SIZE, NUM_PAGES, PAGES_PER_SEQ, PREFILL_CHUNK = 16, 12, 3, 8
MAX_SEQS, TOKENS_PER_STEP = 4, 32  # every step is padded to this: one shape to compile, as engines do


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTENTION, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, lambda *args, **kwargs: None)  # ours masks itself


@dataclasses.dataclass
class Step:
    """What every layer of one forward needs: the kernel, the caches and the batch's index arrays."""
    kernel: object
    k_caches: list
    v_caches: list
    slot_mapping: torch.Tensor  # [T] int32
    kv_lens: torch.Tensor  # [S] int32
    page_indices: torch.Tensor  # [S, PAGES_PER_SEQ] int32
    cu_q_lens: torch.Tensor  # [S + 1] int32
    num_seqs: int


STEP: list[Step] = []  # the current step, set by the loop around each forward


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
               softcap=None, s_aux=None, **kwargs):
    """transformers' attention interface: query [1, Hq, T, D], key and value [1, Hkv, T, D] for
    the step's packed tokens; returns [1, T, Hq, D]."""
    step, layer = STEP[0], module.layer_idx
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    step.kernel.reshape_and_cache_flash(k, v, step.k_caches[layer], step.v_caches[layer], step.slot_mapping)
    out = step.kernel.ragged_paged_attention(
        q, step.k_caches[layer], step.v_caches[layer], step.kv_lens, step.page_indices, step.cu_q_lens,
        step.num_seqs, softmax_scale=scaling, sliding_window=sliding_window, softcap=softcap, sinks=s_aux)
    return out[None], None


@dataclasses.dataclass
class Request:
    prompt: list
    max_new_tokens: int
    joins_at: int
    cached: int = 0  # tokens in the cache
    pages: list = dataclasses.field(default_factory=list)
    generated: list = dataclasses.field(default_factory=list)

    @property
    def done(self):
        return len(self.generated) == self.max_new_tokens


def serve(model, kernel, requests: list[Request]) -> int:
    """Runs the requests to completion; returns the number of forward steps."""
    # Each layer's cache sized from its attention module: Gemma 4's layers differ in head_dim and heads.
    layers = sorted((m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")),
                    key=lambda m: m.layer_idx)
    assert [m.layer_idx for m in layers] == list(range(model.config.num_hidden_layers))
    shapes = [(NUM_PAGES, PAGE_SIZE, m.k_proj.out_features // m.head_dim, m.head_dim) for m in layers]
    k_caches, v_caches = [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]
    free = torch.randperm(NUM_PAGES, generator=torch.Generator().manual_seed(0)).tolist()
    steps = 0
    while not all(r.done for r in requests):
        running = [r for r in requests if r.joins_at <= steps and not r.done]
        assert 0 < len(running) <= MAX_SEQS
        ids, positions, slots, kv_lens, cu = [], [], [], [], [0]
        table = torch.zeros(MAX_SEQS, PAGES_PER_SEQ, dtype=torch.int32)  # padded past the running requests
        for s, r in enumerate(running):
            new = (r.prompt[r.cached:r.cached + PREFILL_CHUNK] if r.cached < len(r.prompt) else r.generated[-1:])
            while len(r.pages) * PAGE_SIZE < r.cached + len(new):
                r.pages.append(free.pop())
            table[s, :len(r.pages)] = torch.tensor(r.pages)
            for position in range(r.cached, r.cached + len(new)):
                positions.append(position)
                slots.append(r.pages[position // PAGE_SIZE] * PAGE_SIZE + position % PAGE_SIZE)
            ids += new
            kv_lens.append(r.cached + len(new))
            cu.append(cu[-1] + len(new))
        # Padding, as vLLM pads: sequences past num_seqs (kv_lens 0, page table 0, cu_q_lens 1: what
        # lies past num_seqs is ignored whatever it holds), tokens past the last sequence's (slot -1:
        # not written; their outputs are zeros).
        padding, pad_tokens = MAX_SEQS - len(running), TOKENS_PER_STEP - len(ids)
        ids, positions, slots = ids + [0] * pad_tokens, positions + [0] * pad_tokens, slots + [-1] * pad_tokens
        as_int32 = lambda values: torch.tensor(values, dtype=torch.int32)
        STEP[:] = [Step(kernel, k_caches, v_caches, as_int32(slots), as_int32(kv_lens + [0] * padding), table,
                        as_int32(cu + [1] * padding), len(running))]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]),
                           use_cache=False).logits[0]
        steps += 1
        for s, r in enumerate(running):
            r.cached = kv_lens[s]
            if r.cached >= len(r.prompt):  # its prompt is in: the last position predicts the next token
                r.generated.append(int(logits[cu[s + 1] - 1].argmax()))
            if r.done:
                free += r.pages
                r.pages = []
    return steps
