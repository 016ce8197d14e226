"""Measure, on this machine, the two constants of the swap-or-recompute cost model.

``auto`` preemption compares moving a victim's blocks over the host link with prefilling its
tokens again. Both speeds depend on the hardware and the model, so they are measured once at
start-up, while the pools are still empty, rather than assumed.
"""
from __future__ import annotations

import statistics
import time

import torch

from kvlib.attention.metadata import AttentionMetadata
from kvlib.kv_cache import KVCachePool, copy_blocks_between
from kvlib.preemption import PreemptionCostModel

PROBE_TOKENS = 256


def time_once(fn, device: torch.device) -> float:
    """Wall seconds of one call of ``fn``, the GPU waited for before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _timed(fn, device: torch.device, repeats: int = 3) -> float:
    fn()  # warm-up
    return statistics.median(time_once(fn, device) for _ in range(repeats))


def measure_host_link(gpu_pool: KVCachePool, num_blocks: int) -> float:
    """Bytes per second of a batched copy of ``num_blocks`` device blocks to (pinned) host memory."""
    host = KVCachePool(gpu_pool.spec, num_blocks, "cpu", pin_memory=gpu_pool.device.type == "cuda")
    ids = list(range(num_blocks))
    seconds = _timed(lambda: copy_blocks_between(gpu_pool, host, ids, ids), gpu_pool.device)
    return num_blocks * gpu_pool.spec.block_bytes / seconds


def measure_prefill(model, gpu_pool: KVCachePool, backend, num_tokens: int) -> float:
    """Tokens per second of one prefill of ``num_tokens`` tokens written into the (empty) pool."""
    device, block_size = gpu_pool.device, gpu_pool.spec.block_size
    num_blocks = -(-num_tokens // block_size)
    ids = torch.randint(0, model.config.vocab_size, (num_tokens,), device=device)
    positions = torch.arange(num_tokens, device=device)
    meta = AttentionMetadata(
        slot_mapping=positions.clone(), block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        context_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        query_start=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        max_query_len=num_tokens, max_context_len=num_tokens)
    last = torch.tensor([num_tokens - 1], device=device)
    seconds = _timed(lambda: model(ids, positions, gpu_pool, meta, backend, last), device, repeats=2)
    return num_tokens / seconds


def measure_cost_model(model, gpu_pool: KVCachePool, backend) -> PreemptionCostModel:
    num_tokens = min(PROBE_TOKENS, gpu_pool.num_blocks * gpu_pool.spec.block_size)
    num_blocks = max(1, min(gpu_pool.num_blocks, num_tokens // gpu_pool.spec.block_size))
    return PreemptionCostModel(host_link_bytes_per_s=measure_host_link(gpu_pool, num_blocks),
                               prefill_tokens_per_s=measure_prefill(model, gpu_pool, backend, num_tokens))
