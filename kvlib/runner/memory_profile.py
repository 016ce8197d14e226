"""Sizing the device pool from what is left after the model's own peak, measured rather than guessed.

The KV pool takes what the GPU has free, but a forward pass needs room for its activations: the
largest step (``max_num_batched_tokens`` tokens, each of up to ``max_num_seqs`` sequences sampled)
and the decode graphs' memory. As vLLM and nano-vllm do, one forward of each is run before the pool
exists, on a small throwaway pool, and the allocator's peak says how much to hold back.
"""
from __future__ import annotations

import torch

from kvlib.runner.kv_cache import STAGING_BYTES, KVCachePool, KVCacheSpec
from kvlib.runner.step_inputs import Chunk, InputBuffers


def dummy_chunks(num_tokens: int, num_seqs: int, block_size: int, max_len: int) -> list[Chunk]:
    """Up to ``num_tokens`` tokens of token id 0 in ``num_seqs`` sampled sequences of at most ``max_len`` tokens,
    each in its own consecutive blocks: the largest step the scheduler can make of them."""
    num_tokens = min(num_tokens, num_seqs * max_len)
    num_seqs = max(1, min(num_seqs, num_tokens))
    chunks, block = [], 0
    for i in range(num_seqs):
        length = num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0)
        blocks = -(-length // block_size)
        chunks.append(Chunk([0] * length, 0, list(range(block, block + blocks)), sampled=True))
        block += blocks
    return chunks


def blocks_needed(chunks: list[Chunk]) -> int:
    return max(max(c.block_table, default=-1) for c in chunks) + 1


def forward_peak_bytes(model, backend, spec: KVCacheSpec, buffers: InputBuffers, chunks: list[Chunk]) -> int:
    """Device bytes a forward of ``chunks`` allocates at its peak, beyond what was allocated before it."""
    device = buffers.device
    pool = KVCachePool(spec, blocks_needed(chunks), device)
    inputs = buffers.pack(chunks)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    model(inputs.token_ids, inputs.positions, pool, inputs.meta, backend, inputs.logits_rows)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del pool
    torch.cuda.empty_cache()
    return peak


def kv_budget_bytes(free_bytes: int, utilization: float, activation_bytes: int, reserved_bytes: int) -> int:
    """What the pool may take: the share ``utilization`` of free memory, less the measured activations and what
    else serving holds (staging buffer, decode graphs)."""
    return int(free_bytes * utilization) - activation_bytes - reserved_bytes


def device_blocks_that_fit(model, backend, spec: KVCacheSpec, buffers: InputBuffers, utilization: float,
                           max_num_seqs: int, max_model_len: int, graph_batch: int) -> int:
    """Blocks of ``spec`` the GPU can hold once a forward of the largest step and of the largest decode graph fit."""
    largest = dummy_chunks(buffers.max_num_tokens, max_num_seqs, spec.block_size, max_model_len)
    prefill = forward_peak_bytes(model, backend, spec, buffers, largest)
    decode = forward_peak_bytes(model, backend, spec, buffers,
                                dummy_chunks(graph_batch, graph_batch, spec.block_size, max_model_len))
    free, _ = torch.cuda.mem_get_info(buffers.device)
    budget = kv_budget_bytes(free, utilization, prefill, decode + STAGING_BYTES)
    if budget < spec.block_bytes:
        raise RuntimeError(f"no room for the KV pool: {free / 2**30:.2f} GiB free, a forward of the largest step "
                           f"takes {prefill / 2**30:.2f} GiB; lower max_num_batched_tokens or max_num_seqs, or raise "
                           f"gpu_memory_utilization")
    return budget // spec.block_bytes
