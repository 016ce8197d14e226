"""The engine with the model taken out: the real scheduler and block manager, nothing else.

Benchmarks of the bookkeeping (``kvlib bench scheduler``, ``kvlib bench sharing``) and the
model-free scheduler tests drive the same ``Scheduler.schedule`` and ``Scheduler.postprocess``
the engine does. Every scheduled token counts as computed and every draw samples a placeholder
token, so requests run exactly as long as they ask (as with ``ignore_eos``). Like ``LLM(...)``, it
takes a ``scheduler``, ``block_manager`` or ``host_prefix_tier`` class to run in place of kvlib's.
"""
from __future__ import annotations

import time
from typing import Optional

from kvlib.block_allocator import BlockAllocator
from kvlib.block_manager import BlockManager
from kvlib.cli.bench.workloads import Request
from kvlib.config import EngineConfig
from kvlib.metrics import EngineMetrics
from kvlib.preemption import LatestArrivalPolicy
from kvlib.prefix_cache import HostPrefixTier
from kvlib.scheduler import Scheduler, SchedulerOutput, StepResult
from kvlib.sequence import Sequence

PLACEHOLDER_TOKEN = 0


class ModelFreeEngine:
    def __init__(self, config: EngineConfig, policy=None, sharing=None, *, scheduler=None, block_manager=None,
                 host_prefix_tier=None):
        if config.num_gpu_blocks is None:
            raise ValueError("a model-free run has no device to size the pool from: set num_gpu_blocks")
        self.config = config
        self.metrics = EngineMetrics(history=config.metrics_history)
        self.block_manager = (block_manager or BlockManager)(
            config.block_size, BlockAllocator(config.num_gpu_blocks), BlockAllocator(config.num_cpu_blocks),
            watermark_blocks=int(config.watermark * config.num_gpu_blocks),
            enable_prefix_caching=config.enable_prefix_caching, host_prefix_cache=config.host_prefix_cache,
            sharing=sharing, host_tier_factory=host_prefix_tier or HostPrefixTier)
        self.scheduler = (scheduler or Scheduler)(config, self.block_manager, policy or LatestArrivalPolicy(),
                                                  self.metrics, block_bytes=1)
        self.requests: dict[str, list[Sequence]] = {}
        self.last_plan: Optional[SchedulerOutput] = None
        self.last_schedule_seconds = 0.0
        self.last_starts: list[int] = []

    def add(self, request_id: str, request: Request) -> Sequence:
        seq = Sequence(request_id, list(request.prompt), request.params(), self.config.block_size,
                       float(request.arrival))
        self.requests[request_id] = [seq]
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> StepResult:
        start = time.perf_counter()
        plan = self.last_plan = self.scheduler.schedule(SchedulerOutput())
        self.last_schedule_seconds = time.perf_counter() - start
        self.last_starts = [seq.num_computed_tokens for seq, _ in plan.scheduled]  # before postprocess moves them
        self.metrics.num_cow_copies += len(plan.moves.copies)
        self.metrics.num_swapped_out_blocks += len(plan.moves.swap_out)
        self.metrics.num_swapped_in_blocks += len(plan.moves.swap_in)
        result = self.scheduler.postprocess(plan, [PLACEHOLDER_TOKEN] * len(plan.draws()), now=0.0)
        for child in result.forked:
            self.requests[child.request_id].append(child)
        return result

    def live_sequences(self) -> list[Sequence]:
        s = self.scheduler
        return s.waiting + s.running + s.swapped
