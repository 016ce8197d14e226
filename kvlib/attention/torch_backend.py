"""Paged attention in plain torch: the reference every kernel is tested against, and the torch backend.

The reference gathers each sequence's K/V through its block table into a contiguous tensor and
runs ordinary causal attention, so it is easy to read and check, not fast. The backend runs the
fast versions in ``torch_paged``, which are tested against it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvlib.attention.capabilities import FLOAT_DTYPES, BackendCapabilities
from kvlib.attention.metadata import AttentionMetadata
from kvlib.attention.torch_paged import GatherScratch, paged_attention_mixed, paged_decode


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
    """Causal attention of packed queries ``[num_tokens, heads, head_dim]`` over the paged cache.

    With ``meta.sliding_window`` set, the query at position ``p`` sees positions ``p - window + 1 .. p``.
    """
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
        keys = torch.arange(context_len, device=q.device)[None, :]
        hidden = keys > positions[:, None]
        if meta.sliding_window is not None:
            hidden |= keys <= positions[:, None] - meta.sliding_window
        scores.masked_fill_(hidden[None], float("-inf"))
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(query.dtype)
    return out


def token_rows(cache: torch.Tensor) -> torch.Tensor | None:
    """One layer's CPU cache ``[blocks, block_size, kv_heads, head_dim]`` as ``[rows, kv_heads * head_dim]`` rows
    of the pool's memory, one a token: the token at offset ``o`` of block ``b`` is row ``b * block_rows + o``
    (``block_rows = cache.stride(0) // (kv_heads * head_dim)``). None where the layout or device does not allow it."""
    blocks, block_size, kv_heads, head_dim = cache.shape
    width, stride = kv_heads * head_dim, cache.stride()
    if cache.device.type != "cpu" or stride[0] % width or tuple(stride[1:]) != (width, head_dim, 1):
        return None
    return cache.as_strided(((blocks - 1) * (stride[0] // width) + block_size, width), (width, 1))


class TorchAttentionBackend:
    """The attention backend interface: ``store_kv`` then ``forward`` for each layer of a step."""

    name = "torch"
    capabilities = BackendCapabilities(graph_safe=False, dtypes=FLOAT_DTYPES)  # plans its decode reads on the host

    def __init__(self) -> None:
        self.scratch = GatherScratch()
        self.slot_rows: tuple | None = None  # (slot_mapping, its version, block_size, block_rows, rows): see token_rows

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        """The reference's writes; on a CPU, when no slot is skipped (every step but a padded graph replay's), one
        ``index_copy_`` of whole tokens per cache, at rows worked out once a step: a third of the reference's cost,
        in every layer of every step."""
        k_rows, v_rows = token_rows(k_cache), token_rows(v_cache)
        rows = None if (k_rows is None or v_rows is None or k_cache.stride() != v_cache.stride()
                        or key.dtype != k_cache.dtype) else self.rows_of(slot_mapping, k_cache.shape[1],
                                                                         k_cache.stride(0) // k_rows.shape[1])
        if rows is None:
            return store_kv_reference(key, value, k_cache, v_cache, slot_mapping)
        k_rows.index_copy_(0, rows, key.reshape(rows.shape[0], -1))
        v_rows.index_copy_(0, rows, value.reshape(rows.shape[0], -1))

    def rows_of(self, slot_mapping: torch.Tensor, block_size: int, block_rows: int) -> torch.Tensor | None:
        """The ``token_rows`` row of each slot, or None if a slot is skipped (-1); computed for the first layer of a
        step and kept while the same ``slot_mapping``, unchanged, comes back (every layer passes the step's)."""
        kept = self.slot_rows
        if not (kept and kept[0] is slot_mapping and kept[1:4] == (slot_mapping._version, block_size, block_rows)):
            rows = None if slot_mapping.numel() == 0 or bool(slot_mapping.min() < 0) else (
                slot_mapping.div(block_size, rounding_mode="floor") * block_rows + slot_mapping.remainder(block_size))
            kept = self.slot_rows = (slot_mapping, slot_mapping._version, block_size, block_rows, rows)
        return kept[4]

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.is_decode_only:
            return paged_decode(query, k_cache, v_cache, meta, scale, self.scratch)
        return paged_attention_mixed(query, k_cache, v_cache, meta, scale, self.scratch)

    def copy_blocks(self, pool_data: torch.Tensor, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Copy-on-write: block ``src_ids[i]`` onto ``dst_ids[i]`` of one pool (first dim: blocks), in one copy.

        No destination may also be a source or appear twice, so the order of the copies cannot matter.
        """
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
        if len(src_ids) == 0:
            return
        src = torch.as_tensor(src_ids, dtype=torch.int64, device=pool_data.device)
        dst = torch.as_tensor(dst_ids, dtype=torch.int64, device=pool_data.device)
        pool_data.index_copy_(0, dst, pool_data.index_select(0, src))
