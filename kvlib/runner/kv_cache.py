"""KV cache storage in blocks, for a device pool and a host (swap) pool.

Layout: one tensor per pool of shape ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
The block index comes first on purpose: everything one block holds, for every layer, K and V,
is one contiguous run of bytes. Moving a block between pools is therefore one contiguous copy,
not ``2 * num_layers`` small ones. Attention reads one layer through a strided view,
``data[:, layer, 0]``, which costs the kernels nothing: they address blocks through strides anyway.

Blocks move between pools through one function, :func:`copy_blocks_between`, which the engine's
swaps and the cost probe's timing both call, so the probe measures the path the engine takes:

- host memory to host memory (the device pool on a CPU): each pair is one ``memmove`` of the
  block's bytes, read once and written once, with nothing staged in between;
- a GPU pool and a pinned host pool: the pool's :class:`~kvlib.runner.block_transfer.StagedTransfer`,
  a persistent staging buffer and a copy stream ordered by events.

A pinned host pool is ordinary memory of exactly the pool's size, registered with CUDA
(:func:`pinned_zeros`): torch's pinned allocator rounds every allocation up to a power of two, so
a 40 GiB pool would pin 64 GiB of the machine's memory. ``KVCachePool.pinned_bytes`` says what
was pinned.
"""
from __future__ import annotations

import ctypes
import math
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from kvlib.runner.block_transfer import StagedTransfer
from kvlib.runner.streams import streams_for

STAGING_BYTES = 256 * 2**20  # a GPU pool's staging buffer for block transfers (at most the pool itself)
PAGE_BYTES = 4096  # a registered range starts on a page boundary


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
    """The blocks of one pool. ``data[b]`` is block ``b``: all layers, K and V.

    A GPU pool also owns the staging buffer and copy stream its transfers to and from the host go
    through (``transfer``), allocated with it so that serving never allocates for a swap.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str, pin_memory: bool = False):
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (num_blocks, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.pinned_bytes = 0  # host memory pinned for this pool (page-locked, out of the machine's reach)
        if pin_memory:
            self.data, self.pinned_bytes = pinned_zeros(shape, spec.dtype, torch.cuda.cudart())
        else:
            self.data = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.layer_views = [(self.data[:, i, 0], self.data[:, i, 1]) for i in range(spec.num_layers)]
        self.transfer = None
        if self.data.device.type == "cuda":
            self.transfer = StagedTransfer(self.data, streams_for(self.data.device), staging_blocks(spec, num_blocks))

    @property
    def device(self) -> torch.device:
        return self.data.device

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]`` (strided views, made
        once: a step asks for every layer's, and four view ops a layer cost a CPU decode step 0.2 ms)."""
        return self.layer_views[index]


def torch_pinned_bytes(nbytes: int) -> int:
    """What torch's pinned allocator pins for a request of ``nbytes``: the next power of two."""
    return 1 << max(0, nbytes - 1).bit_length() if nbytes else 0


def pinned_zeros(shape: tuple[int, ...], dtype: torch.dtype, cudart) -> tuple[torch.Tensor, int]:
    """A zeroed host tensor the GPU copies to and from asynchronously, and the bytes pinned for it.

    Ordinary memory of exactly the tensor's size (page-aligned, zeroed by the kernel as first touched)
    is registered with ``cudart.cudaHostRegister`` and unregistered when the last view of it is gone.
    Where registering fails, or torch does not see the memory as pinned (it would then refuse the
    asynchronous copies), torch's pinned allocator serves it instead, pinning ``torch_pinned_bytes``.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype), 0
    memory = np.zeros(nbytes + PAGE_BYTES, dtype=np.uint8)
    offset = -memory.ctypes.data % PAGE_BYTES
    region = memory[offset:offset + nbytes]
    if int(cudart.cudaHostRegister(region.ctypes.data, nbytes, 0)) == 0:
        tensor = torch.from_numpy(region).view(dtype).view(shape)
        if tensor.is_pinned():
            weakref.finalize(memory, cudart.cudaHostUnregister, region.ctypes.data)  # once no tensor holds it
            return tensor, nbytes
        cudart.cudaHostUnregister(region.ctypes.data)
    return torch.zeros(shape, dtype=dtype, pin_memory=True), torch_pinned_bytes(nbytes)


def staging_blocks(spec: KVCacheSpec, num_blocks: int) -> int:
    """Blocks a GPU pool's staging buffer holds: ``STAGING_BYTES`` worth, at most the pool, at least 2."""
    return max(2, min(num_blocks, STAGING_BYTES // spec.block_bytes))


def _check_ids(pool: KVCachePool, ids: list[int], role: str) -> None:
    if min(ids) < 0 or max(ids) >= pool.num_blocks:
        bad = next(i for i in ids if not 0 <= i < pool.num_blocks)
        raise IndexError(f"{role} block {bad} is outside its pool of {pool.num_blocks} blocks")


def copy_host_blocks(src: KVCachePool, dst: KVCachePool, src_ids: list[int], dst_ids: list[int]) -> None:
    """Host memory to host memory, one pass: each pair is one ``memmove`` of a block's contiguous bytes.

    The ids are checked first, since ``memmove`` checks nothing. ``src`` and ``dst`` are different
    pools, so no copy can overwrite another's source.
    """
    _check_ids(src, src_ids, "source")
    _check_ids(dst, dst_ids, "destination")
    if not (src.data.is_contiguous() and dst.data.is_contiguous()):
        raise ValueError("copy_host_blocks addresses blocks by offset: both pools' data must be contiguous")
    nbytes = src.spec.block_bytes
    src_base, dst_base = src.data.data_ptr(), dst.data.data_ptr()
    for s, d in zip(src_ids, dst_ids):
        ctypes.memmove(dst_base + d * nbytes, src_base + s * nbytes, nbytes)


def copy_blocks_reading_first(pool: KVCachePool, src_ids, dst_ids) -> None:
    """Within one pool, where a destination may also be a source: every source is read before anything is written.
    The ids are lists or int64 tensors on the pool's device."""
    src = torch.as_tensor(src_ids, dtype=torch.long, device=pool.device)
    dst = torch.as_tensor(dst_ids, dtype=torch.long, device=pool.device)
    pool.data.index_copy_(0, dst, pool.data.index_select(0, src))


def copy_blocks_between(src: KVCachePool, dst: KVCachePool, src_ids: list[int], dst_ids: list[int]) -> None:
    """Copy blocks ``src_ids`` of one pool into blocks ``dst_ids`` of another (or the same) pool.

    On a GPU the copy is asynchronous: work queued after it on the compute stream sees the blocks
    that moved to the device; the host pool's blocks are final once the device is synchronized.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    if src.spec != dst.spec:
        raise ValueError(f"the pools hold different blocks: {src.spec} and {dst.spec}")
    if not src_ids:
        return
    if src is dst:
        copy_blocks_reading_first(src, src_ids, dst_ids)
    elif src.device.type == dst.device.type == "cpu":
        copy_host_blocks(src, dst, src_ids, dst_ids)
    else:
        device, host = (src, dst) if src.transfer is not None else (dst, src)
        if host.device.type != "cpu" or device.transfer is None:
            raise ValueError(f"blocks move between a GPU pool and a host pool, not {src.device} and {dst.device}")
        if not host.data.is_pinned():
            raise ValueError("the host pool is in pageable memory, which the GPU cannot copy to asynchronously: "
                             "create it with KVCachePool(..., 'cpu', pin_memory=True)")
        if device is src:
            device.transfer.to_host(host.data, src_ids, dst_ids)
        else:
            device.transfer.to_device(host.data, src_ids, dst_ids)
