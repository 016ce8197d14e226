"""The engine with the model taken out: the real scheduler and block manager, nothing else.

The core's tests, lab 04's grader and the bookkeeping benchmarks (``kvlib bench scheduler``,
``kvlib bench sharing``) drive the same ``Scheduler.schedule`` and ``Scheduler.postprocess``
the engine does. Every scheduled token counts as computed and every draw samples a placeholder
token, so requests run exactly as long as they ask (as with ``ignore_eos``). Like ``LLM(...)``, it
takes pieces as keyword arguments (``scheduler=``, ``block_manager=``, ``preemption_policy=`` ...)
to run in place of kvlib's, builds its core with the same :func:`~kvlib.core.pieces.build_core` and
records its metrics with the same calls.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from kvlib.config import EngineConfig, SamplingParams
from kvlib.core.pieces import Pieces, build_core
from kvlib.core.plan import SchedulerOutput, StepResult
from kvlib.core.sequence import Sequence
from kvlib.metrics import EngineMetrics

PLACEHOLDER_TOKEN = 0
BLOCK_BYTES = 1  # no pool holds bytes: a block moved counts as one


@dataclass
class Request:
    """One request of a synthetic workload: what it asks for and when it arrives."""

    prompt: list[int]
    max_tokens: int
    n: int = 1
    arrival: float = 0.0  # seconds after the start for timed runs, the engine step for model-free ones

    def params(self, **extra) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, n=self.n, ignore_eos=True, **extra)


class ModelFreeEngine:
    def __init__(self, config: EngineConfig, **pieces):
        if config.num_gpu_blocks is None:
            raise ValueError("a model-free run has no device to size the pool from: set num_gpu_blocks")
        self.config = config
        self.metrics = EngineMetrics(history=config.metrics_history)
        pieces = Pieces.from_keywords(**pieces).with_defaults(config)
        self.block_manager, self.scheduler = build_core(config, pieces, num_device_blocks=config.num_gpu_blocks,
                                                        block_bytes=BLOCK_BYTES)
        self.requests: dict[str, list[Sequence]] = {}
        self.last_plan: Optional[SchedulerOutput] = None
        self.last_schedule_seconds = 0.0

    def add(self, request_id: str, request: Request) -> Sequence:
        seq = Sequence(request_id, list(request.prompt), request.params(), self.config.block_size,
                       float(request.arrival))
        self.requests[request_id] = [seq]
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def last_starts(self) -> list[int]:
        """Where each chunk of the last plan started."""
        return [chunk.start for chunk in self.last_plan.scheduled]

    def step(self) -> StepResult:
        start = time.perf_counter()
        plan = self.last_plan = self.scheduler.schedule(SchedulerOutput())
        self.last_schedule_seconds = time.perf_counter() - start
        self.metrics.record_plan(plan, BLOCK_BYTES)
        result = self.scheduler.postprocess(plan, [PLACEHOLDER_TOKEN] * len(plan.draws), now=0.0)
        self.metrics.record_result(plan, result)
        for child in result.forked:
            self.requests[child.request_id].append(child)
        return result

    def live_sequences(self) -> list[Sequence]:
        s = self.scheduler
        return s.waiting + s.running + s.swapped
