"""transformers' continuous batching (`generate_batch`) served by the paged kernel.

transformers 5.22's own path writes each layer's new K and V into its paged cache with
`index_copy_`, then gathers every cached token of every sequence with `index_select` to call a
varlen attention: each step copies all the context it attends to. This attention function
takes the same call (transformers passes the cache and its index tensors to the attention
function) and attends over the cache's pages where they lie, in the cache's own layout.

The cache of a group of full-attention layers is one buffer whose pages interleave the layers'
K and V pages; each layer's K pages and V pages are two views of it with one numbering, so
one page table serves both. A sequence's positions are read in order from `read_index`
(physical rows, page after page), so its page table is `read_index` at every page_size-th
position of the sequence, divided by page_size: built on the device, no host round trip.
"""

from __future__ import annotations

import torch

from ._shared.tuning import bucket_size
from .torch_ops import ragged_paged_attention

# transformers registers a Hub kernel with neither varlen nor sparse entry points through
# these two names (`attn_implementation="<org>/paged-attention-tpu:flash_attn_forward"`;
# continuous batching takes only implementations whose name contains "flash").
supports_flash_attn = True


def flash_attn_forward(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                       sliding_window=None, softcap=None, s_aux=None, cache=None, **kwargs):
    """transformers' attention interface, under continuous batching: query [1, Hq, T, D], key
    and value [1, Hkv, T, D] (the step's new tokens, packed); returns ([1, T, Hq, D], None)."""
    if cache is None:
        raise NotImplementedError(
            "paged-attention-tpu serves transformers' continuous batching (generate_batch), whose paged cache "
            "it reads in place; for generate or training use flash-attn-tpu")
    if dropout:
        raise NotImplementedError(f"paged-attention-tpu has no attention dropout (dropout={dropout})")
    allocator = cache.layer_to_allocator[module.layer_idx]
    if allocator.layer_type != "full_attention":
        raise NotImplementedError(
            f"paged-attention-tpu serves full-attention layers; layer {module.layer_idx} is "
            f"{allocator.layer_type!r}, whose cache is a ring buffer a page table cannot describe")
    page_size = allocator.tokens_per_page
    k_rows, v_rows = allocator._kv_token_views[module.layer_idx]
    k_pages, v_pages = allocator._kv_page_views[module.layer_idx]
    write_index = kwargs["write_index"][allocator.index]
    read_index = kwargs["read_index"][allocator.index]
    cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
    cu_k = kwargs["cu_seq_lens_k"]
    cu_k = (cu_k[allocator.layer_type] if isinstance(cu_k, dict) else cu_k).to(torch.int32)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    # The write: the new tokens' rows only, in place (as transformers writes them). Our write
    # kernel needs a whole cache tensor to reuse on a TPU; this cache is views of one buffer.
    k_rows.index_copy_(0, write_index, k.to(k_rows.dtype))
    v_rows.index_copy_(0, write_index, v.to(v_rows.dtype))
    # A batch with no cache read (only first prefills) has the sequences' rows in write_index.
    rows, cu = (read_index, cu_k) if read_index.numel() else (write_index, cu_q)
    # Page table width bucketed: a sequence holds at most all the rows read, from a page start.
    pages_per_seq = bucket_size(-(-rows.shape[0] // page_size))
    starts = cu[:-1, None].long() + page_size * torch.arange(pages_per_seq, device=rows.device)[None, :]
    page_indices = (rows[starts.clamp(max=rows.shape[0] - 1)] // page_size).to(torch.int32)
    out = ragged_paged_attention(q, k_pages, v_pages, cu[1:] - cu[:-1], page_indices, cu_q, cu_q.shape[0] - 1,
                                 softmax_scale=scaling, softcap=softcap or None, sinks=s_aux)
    return out[None], None
