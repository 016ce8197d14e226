"""The Triton attention backend: the same interface as the torch reference, backed by kernels.

A step with prefills sends its decodes (packed first, ``meta.num_decodes``) to the decode kernel,
which is built for one query row per sequence and splits long contexts, and only the rest to the
prefill kernel. The kernels come from ``kvlib.kernels.for_device``, so CPU tensors get interpreted
kernels even where Triton compiles for a GPU.

The module imports without Triton; building a backend where Triton is missing raises ImportError.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvlib import kernels
from kvlib.attention.capabilities import FLOAT_DTYPES, BackendCapabilities
from kvlib.attention.metadata import AttentionMetadata


class TritonAttentionBackend:
    """``store_kv`` then ``forward`` for each layer of a step, plus in-pool block copies."""

    name = "triton"

    def __init__(self) -> None:
        if not kernels.triton_available():
            raise ImportError("the triton attention backend needs Triton, which is not installed; "
                              "use attention_backend='torch' instead")

    @property
    def capabilities(self) -> BackendCapabilities:
        """Graph-safe: its decode reads everything from device tensors. Read when asked, from the decode
        kernel's split rule, so the warm-up bounds are those the rule uses now."""
        return BackendCapabilities(graph_safe=True, dtypes=FLOAT_DTYPES,
                                   warm_up_decode_bounds=kernels.split_warm_up_bounds())

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        kernels.for_device(key.device).store_kv(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if query.device.type == "cpu" and query.dtype == torch.bfloat16:
            raise TypeError("Triton's interpreter, which runs the kernels on CPU tensors, computes bfloat16 attention "
                            "wrongly; on a CPU use dtype='float32' or 'float16', or attention_backend='torch'")
        run = kernels.for_device(query.device)
        if meta.is_decode_only:
            return self._decode(run, query, k_cache, v_cache, meta, scale)
        out = torch.empty_like(query)  # each kernel writes its own rows of it in place
        decodes = meta.num_decodes
        if decodes:
            self._decode(run, query[:decodes], k_cache, v_cache, meta.decode_part, scale, out[:decodes])
        rest = meta.prefill_part
        run.paged_prefill_attention(query[decodes:], k_cache, v_cache, rest.block_tables, rest.context_lens,
                                    rest.query_start, rest.max_query_len, scale, sliding_window=rest.sliding_window,
                                    out=out[decodes:])
        return out

    @staticmethod
    def _decode(run, query, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
        return run.paged_decode_attention(query, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                          max_context_len=meta.max_context_len, sliding_window=meta.sliding_window,
                                          out=out)

    def copy_blocks(self, pool_data: torch.Tensor, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Copy-on-write: blocks ``src_ids`` onto ``dst_ids`` of one pool, all layers, K and V, one launch."""
        kernels.for_device(pool_data.device).copy_blocks(pool_data, src_ids, dst_ids)
