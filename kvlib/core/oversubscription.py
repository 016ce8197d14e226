"""Constant preemption is a capacity signal: say so once, with what to change."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvlib.metrics import EngineMetrics


@dataclass
class OversubscriptionDetector:
    """Warn once when preemptions per finished request exceed ``threshold``.

    The rate is the running total (all preemptions over all finished requests), judged only once
    ``min_finished`` requests have finished, so one unlucky request at start-up does not raise
    the alarm.
    """

    threshold: float = 1.0
    min_finished: int = 8
    warned: bool = False

    def observe(self, metrics: EngineMetrics) -> Optional[str]:
        if self.warned or metrics.num_finished < self.min_finished:
            return None
        rate = metrics.num_preemptions / metrics.num_finished
        if rate <= self.threshold:
            return None
        self.warned = True
        return (f"the engine is oversubscribed: {rate:.1f} preemptions per finished request "
                f"(threshold {self.threshold}); add KV capacity (num_gpu_blocks) or lower concurrency (max_num_seqs)")
