"""The Triton attention backend: the same interface as the torch reference, backed by kernels.

The module imports without Triton; building a backend where Triton is missing raises ImportError.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvlib import kernels
from kvlib.attention.metadata import AttentionMetadata


class TritonAttentionBackend:
    """``store_kv`` then ``forward`` for each layer of a step, plus in-pool block copies."""

    name = "triton"

    def __init__(self) -> None:
        if not kernels.triton_available():
            raise ImportError("the triton attention backend needs Triton, which is not installed; "
                              "use attention_backend='torch' instead")

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        kernels.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.is_decode_only:
            return kernels.paged_decode_attention(query, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                                  scale, max_context_len=meta.max_context_len,
                                                  sliding_window=meta.sliding_window)
        return kernels.paged_prefill_attention(query, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                               meta.query_start, meta.max_query_len, scale,
                                               sliding_window=meta.sliding_window)

    def copy_blocks(self, pool_data: torch.Tensor, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Copy-on-write: blocks ``src_ids`` onto ``dst_ids`` of one pool, all layers, K and V, one launch."""
        kernels.copy_blocks(pool_data, src_ids, dst_ids)
