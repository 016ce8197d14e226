"""KV cache storage in blocks, for a device pool and a host (swap) pool.

Layout: one tensor per pool of shape ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
The block index comes first on purpose: everything one block holds, for every layer, K and V,
is one contiguous run of bytes. Moving a block between pools is therefore one contiguous copy,
not ``2 * num_layers`` small ones, and moving N blocks is one gather plus one copy. Attention
reads one layer through a strided view, ``data[:, layer, 0]``, which costs the kernels nothing:
they address blocks through strides anyway.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one block, shared by both pools."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size


class KVCachePool:
    """The blocks of one pool. ``data[b]`` is block ``b``: all layers, K and V."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str, pin_memory: bool = False):
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (num_blocks, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.data = torch.zeros(shape, dtype=spec.dtype, device=device, pin_memory=pin_memory)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]`` (strided views)."""
        return self.data[:, index, 0], self.data[:, index, 1]


def gather_blocks(pool: KVCachePool, ids: list[int]) -> torch.Tensor:
    """Blocks ``ids`` of a pool, all layers, K and V, as one contiguous staging tensor (one call).

    Gathered from a pinned host pool, the staging tensor is pinned too, so its copy to the device
    can run asynchronously.
    """
    staged = pool.data.index_select(0, torch.tensor(ids, dtype=torch.long, device=pool.device))
    return staged.pin_memory() if pool.data.is_pinned() else staged


def scatter_blocks(pool: KVCachePool, ids: list[int], staged: torch.Tensor) -> None:
    """Write staged blocks into blocks ``ids`` of a pool: one copy across devices, one scatter.

    Towards the device the copy is asynchronous (from pinned memory when the host pool is pinned)
    and the scatter is queued behind it on the same stream. Towards the host the copy must have
    landed before the CPU scatters it, so it is synchronous.
    """
    if staged.device != pool.device:
        to_device = pool.device.type != "cpu"
        staged = staged.to(pool.device, non_blocking=to_device and staged.is_pinned())
    pool.data.index_copy_(0, torch.tensor(ids, dtype=torch.long, device=pool.device), staged)


def copy_blocks_between(src: KVCachePool, dst: KVCachePool, src_ids: list[int], dst_ids: list[int]) -> None:
    """Copy blocks ``src_ids`` of one pool into blocks ``dst_ids`` of another (or the same) pool.

    One gather into a contiguous staging tensor, one copy across devices, one scatter: three calls
    whatever the number of blocks and layers.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    if src_ids:
        scatter_blocks(dst, dst_ids, gather_blocks(src, src_ids))
