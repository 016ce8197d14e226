"""The model runner: owns the model, the KV pools and the attention backend, and runs one plan.

For each step it carries out the block moves, packs the scheduled tokens into tensors, runs the
forward pass and samples one token per draw. It never decides anything: the plan comes from the
scheduler, and what the tokens mean is the scheduler's to record.
"""
from __future__ import annotations

import time

import torch

from kvlib.attention.metadata import AttentionMetadata
from kvlib.block_manager import BlockMoves
from kvlib.cost_probe import measure_cost_model
from kvlib.kv_cache import KVCachePool, KVCacheSpec, copy_blocks_between
from kvlib.preemption import PreemptionCostModel
from kvlib.sampler import sample
from kvlib.scheduler import SchedulerOutput
from kvlib.sequence import Sequence

CPU_KV_BUDGET_BYTES = 256 * 2**20  # device pool size on a CPU when num_gpu_blocks is None


def build_step_inputs(scheduled: list[tuple[Sequence, int]], block_size: int, device: torch.device,
                      sliding_window: int | None = None):
    """Token ids, positions and attention metadata for packed sequences, plus the rows to sample.

    A sequence is sampled only when this step computes its last token: a chunk in the middle
    of a long prompt produces no token.
    """
    token_ids, positions, slots, context_lens, query_start, logits_rows = [], [], [], [], [0], []
    tables = []
    for seq, num_new in scheduled:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
        blocks = seq.block_table.blocks
        token_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, end))
        tables.append(blocks)
        context_lens.append(end)
        query_start.append(query_start[-1] + num_new)
        if end == seq.num_tokens:
            logits_rows.append(query_start[-1] - 1)
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start=torch.tensor(query_start, dtype=torch.int32, device=device),
        max_query_len=max(n for _, n in scheduled),
        max_context_len=max(context_lens),
        sliding_window=sliding_window,
    )
    return (torch.tensor(token_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device), meta,
            torch.tensor(logits_rows, dtype=torch.long, device=device))


class ModelRunner:
    def __init__(self, model, backend, *, block_size: int, num_gpu_blocks: int | None, num_cpu_blocks: int,
                 device: torch.device, dtype: torch.dtype, gpu_memory_utilization: float = 0.9):
        self.model = model
        self.backend = backend
        self.device = device
        config = model.config
        self.spec = KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, block_size, dtype)
        num_gpu_blocks = num_gpu_blocks or self._blocks_that_fit(gpu_memory_utilization)
        self.gpu_pool = KVCachePool(self.spec, num_gpu_blocks, device)
        self.cpu_pool = KVCachePool(self.spec, num_cpu_blocks, "cpu", pin_memory=device.type == "cuda")

    def _blocks_that_fit(self, utilization: float) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * utilization
        else:
            budget = CPU_KV_BUDGET_BYTES
        return max(1, int(budget // self.spec.block_bytes))

    def measure_cost_model(self) -> PreemptionCostModel:
        return measure_cost_model(self.model, self.gpu_pool, self.backend)

    def execute_moves(self, moves: BlockMoves) -> float:
        """Carry out a step's block moves in their three phases; returns the seconds they took.

        Device to host first, so a device block a swap-out freed can be reused by the later
        phases; then copy-on-write; then host to device, which may read a host block the first
        phase has just written (a prefix block demoted and hit in the same step).
        """
        if not moves:
            return 0.0
        start = time.perf_counter()
        if moves.to_host:
            copy_blocks_between(self.gpu_pool, self.cpu_pool, *map(list, zip(*moves.to_host)))
        if moves.copies:
            src, dst = map(list, zip(*moves.copies))
            if set(src) & set(dst):  # a source freed and reused in the same step: read all before writing any
                copy_blocks_between(self.gpu_pool, self.gpu_pool, src, dst)
            else:
                self.backend.copy_blocks(self.gpu_pool.data, src, dst)
        if moves.to_device:
            copy_blocks_between(self.cpu_pool, self.gpu_pool, *map(list, zip(*moves.to_device)))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def forward(self, plan: SchedulerOutput) -> torch.Tensor:
        """Logits ``[sequences completing this step, vocab]``, in plan order."""
        ids, positions, meta, rows = build_step_inputs(plan.scheduled, self.spec.block_size, self.device,
                                                       self.model.config.sliding_window)
        return self.model(ids, positions, self.gpu_pool, meta, self.backend, rows)

    def sample(self, logits: torch.Tensor, plan: SchedulerOutput) -> list[int]:
        draws = plan.draws()
        if not draws:
            return []
        return sample(logits[[row for _, row in draws]], [seq for seq, _ in draws])
