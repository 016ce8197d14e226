"""Writing into the KV cache: storing a step's new K/V, copying whole blocks for copy-on-write, and moving
blocks between two pools.

Each runs as a single launch whatever the number of tokens or blocks, so its cost does not
grow with per-call launch overhead. ``copy_blocks_across`` may take a pinned host pool as either
side: a GPU reaches pinned host memory at the same address (unified addressing; Triton's launcher
asks the driver for the device address of every pointer argument, and a pinned tensor has one), so
one kernel moves scattered blocks across the link with no staging buffer and no copy per run.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

COPY_CHUNK = 4096  # elements each copy program moves


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kco, stride_kch, stride_kcd,
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, NUM_KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """One program per token: all its kv heads move together."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, NUM_KV_HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    key = tl.load(key_ptr + token * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kco + h * stride_kch + d * stride_kcd,
             key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vco + h * stride_vch + d * stride_vcd,
             value.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_blocks_kernel(src_data_ptr, dst_data_ptr, src_ptr, dst_ptr, src_stride_block, dst_stride_block,
                        block_numel, CHUNK: tl.constexpr):
    """Program (pair, chunk) copies one chunk of block ``src[pair]`` of one pool into block ``dst[pair]`` of
    another, or of the same (blocks are contiguous runs of memory)."""
    pair = tl.program_id(0)
    offsets = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offsets < block_numel
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    chunk = tl.load(src_data_ptr + src * src_stride_block + offsets, mask=mask)
    tl.store(dst_data_ptr + dst * dst_stride_block + offsets, chunk, mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[num_tokens, kv_heads, head_dim]`` into their slots; slot -1 is skipped.

    Slot ``s`` is offset ``s % block_size`` of block ``s // block_size``; the caches are
    ``[num_blocks, block_size, kv_heads, head_dim]`` with any strides.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)}, expected ({num_tokens},)")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, NUM_KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
    )


def copy_blocks(pool_data: torch.Tensor, src_ids: Sequence[int] | torch.Tensor,
                dst_ids: Sequence[int] | torch.Tensor) -> None:
    """Copy block ``src_ids[i]`` onto block ``dst_ids[i]`` of ``pool_data`` for every i, in one launch.

    ``pool_data`` is a pool tensor whose first dimension indexes blocks and whose blocks are each
    contiguous (``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]``). Pairs run in
    parallel, so no destination may also be a source or appear twice. The engine passes int64 device
    tensors (its pinned id uploads); a list becomes one, with a blocking copy from pageable memory.
    """
    if len(src_ids) == 0 == len(dst_ids):
        return  # nothing to upload
    copy_blocks_across(pool_data, pool_data, torch.as_tensor(src_ids, dtype=torch.int64, device=pool_data.device),
                       torch.as_tensor(dst_ids, dtype=torch.int64, device=pool_data.device))


def copy_blocks_across(src_data: torch.Tensor, dst_data: torch.Tensor, src_ids: torch.Tensor,
                       dst_ids: torch.Tensor, chunk: int = COPY_CHUNK) -> None:
    """Copy block ``src_ids[i]`` of ``src_data`` onto block ``dst_ids[i]`` of ``dst_data`` for every i, in one
    launch.

    The pools share a block shape and dtype, and each block is contiguous; either may be pinned host
    memory while the other is on the GPU (the kernel then reads or writes across the link itself).
    ``src_ids``/``dst_ids`` are int64 tensors where the kernel runs (the device). ``chunk``: elements each
    program moves, a power of two.
    """
    if src_data.shape[1:] != dst_data.shape[1:] or src_data.dtype != dst_data.dtype:
        raise ValueError(f"the pools hold different blocks: {tuple(src_data.shape[1:])} {src_data.dtype} and "
                         f"{tuple(dst_data.shape[1:])} {dst_data.dtype}")
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    if len(src_ids) == 0:
        return
    if not (src_data[0].is_contiguous() and dst_data[0].is_contiguous()):
        raise ValueError("copying blocks needs each block of a pool to be one contiguous run of memory")
    block_numel = src_data[0].numel()
    _copy_blocks_kernel[(len(src_ids), triton.cdiv(block_numel, chunk))](
        src_data, dst_data, src_ids, dst_ids, src_data.stride(0), dst_data.stride(0), block_numel, CHUNK=chunk,
    )
