"""Paged attention in plain torch: the reference every kernel is tested against.

It gathers each sequence's K/V through its block table into a contiguous tensor and runs
ordinary causal attention, so it is easy to read and check, not fast.
"""
from __future__ import annotations

import torch

from kvlib.attention.metadata import AttentionMetadata


def store_kv_reference(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[num_tokens, kv_heads, head_dim]`` into their slots; slot -1 is skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def gather_sequence_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence, ``[length, kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:length]


def paged_attention_reference(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of packed queries ``[num_tokens, heads, head_dim]`` over the paged cache."""
    out = torch.empty_like(query)
    group = query.shape[1] // k_cache.shape[2]
    starts = meta.query_start.tolist()
    for i, context_len in enumerate(meta.context_lens.tolist()):
        q = query[starts[i]:starts[i + 1]].float()
        query_len = q.shape[0]
        k = gather_sequence_kv(k_cache, meta.block_tables[i], context_len).float()
        v = gather_sequence_kv(v_cache, meta.block_tables[i], context_len).float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        positions = torch.arange(context_len - query_len, context_len, device=q.device)
        future = torch.arange(context_len, device=q.device)[None, :] > positions[:, None]
        scores.masked_fill_(future[None], float("-inf"))
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(query.dtype)
    return out


def paged_decode_batched(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Decode (one query per sequence) for the whole batch at once: one gather, one masked softmax."""
    num_seqs, heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    max_blocks = -(-meta.max_context_len // block_size)
    tables = meta.block_tables[:, :max_blocks].long()
    k = k_cache[tables].reshape(num_seqs, -1, kv_heads, head_dim).float()
    v = v_cache[tables].reshape(num_seqs, -1, kv_heads, head_dim).float()
    q = query.float().view(num_seqs, kv_heads, heads // kv_heads, head_dim)
    scores = torch.einsum("bhgd,bkhd->bhgk", q, k) * scale
    positions = torch.arange(k.shape[1], device=query.device)
    padding = positions[None, :] >= meta.context_lens[:, None].to(query.device)
    scores.masked_fill_(padding[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgk,bkhd->bhgd", scores.softmax(dim=-1), v)
    return out.reshape(num_seqs, heads, head_dim).to(query.dtype)


class TorchAttentionBackend:
    """The attention backend interface: ``store_kv`` then ``forward`` for each layer of a step."""

    name = "torch"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.is_decode_only:
            return paged_decode_batched(query, k_cache, v_cache, meta, scale)
        return paged_attention_reference(query, k_cache, v_cache, meta, scale)

    def copy_blocks(self, pool_data: torch.Tensor, src_ids, dst_ids) -> None:
        """Copy-on-write: blocks ``src_ids`` onto ``dst_ids`` of one pool, all layers, K and V."""
        src = torch.as_tensor(src_ids, dtype=torch.long, device=pool_data.device)
        dst = torch.as_tensor(dst_ids, dtype=torch.long, device=pool_data.device)
        pool_data.index_copy_(0, dst, pool_data.index_select(0, src))
