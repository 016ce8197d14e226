"""What the engine measures: preemption counters, per-request latency and a per-step KV timeline.

Preemption is not free: it shows up as a later first token, a longer request, or a stutter
(a long gap between two tokens). These are the numbers that make that visible.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from kvlib.sequence import Sequence


@dataclass
class RequestMetrics:
    request_id: str
    arrival_time: float
    ttft: Optional[float] = None  # seconds from arrival to the first token
    e2e_latency: Optional[float] = None  # seconds from arrival to the end
    num_preemptions: int = 0
    max_inter_token_latency: float = 0.0  # the worst stutter
    num_output_tokens: int = 0


@dataclass
class StepRecord:
    step: int
    time: float
    gpu_blocks_used: int
    gpu_blocks_total: int
    cpu_blocks_used: int
    cpu_blocks_total: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_batched_tokens: int
    num_preemptions: int
    blocks_saved_by_sharing: int = 0  # block-table entries beyond the distinct blocks they point to


@dataclass
class EngineMetrics:
    num_preemptions: int = 0
    num_preemptions_swap: int = 0
    num_preemptions_recompute: int = 0
    num_swap_fallbacks: int = 0  # swap chosen but the host pool was full: recomputed instead
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    num_recomputed_tokens: int = 0
    swap_bytes: int = 0
    swap_time: float = 0.0
    recompute_time: float = 0.0  # share of step time spent re-prefilling preempted tokens
    num_cow_copies: int = 0  # shared blocks copied on a sequence's first write into them
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_host_hit_tokens: int = 0  # hits copied back from the host tier instead of recomputed
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_finished: int = 0
    num_rejected: int = 0
    requests: dict[str, RequestMetrics] = field(default_factory=dict)
    timeline: list[StepRecord] = field(default_factory=list)

    def reset(self) -> None:
        fresh = EngineMetrics()
        self.__dict__.update(fresh.__dict__)

    def record_finished(self, request_id: str, seqs: list[Sequence]) -> None:
        arrival_time = seqs[0].arrival_time
        finish = max(s.finish_time for s in seqs)
        firsts = [s.first_token_time for s in seqs if s.first_token_time is not None]
        self.requests[request_id] = RequestMetrics(
            request_id=request_id,
            arrival_time=arrival_time,
            ttft=min(firsts) - arrival_time if firsts else None,
            e2e_latency=finish - arrival_time,
            num_preemptions=sum(s.num_preemptions for s in seqs),
            max_inter_token_latency=max(s.max_inter_token_latency for s in seqs),
            num_output_tokens=sum(len(s.output_token_ids) for s in seqs),
        )
        self.num_finished += 1

    @property
    def ttft(self) -> dict[str, Optional[float]]:
        return {rid: r.ttft for rid, r in self.requests.items()}

    @property
    def e2e_latency(self) -> dict[str, Optional[float]]:
        return {rid: r.e2e_latency for rid, r in self.requests.items()}

    @property
    def max_inter_token_latency(self) -> dict[str, float]:
        return {rid: r.max_inter_token_latency for rid, r in self.requests.items()}

    @property
    def preemptions_per_request(self) -> dict[str, int]:
        return {rid: r.num_preemptions for rid, r in self.requests.items()}

    def summary(self) -> dict:
        """Counters and latency percentiles as a plain dict (no per-step timeline)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("requests", "timeline")}
        ttfts = sorted(r.ttft for r in self.requests.values() if r.ttft is not None)
        e2es = sorted(r.e2e_latency for r in self.requests.values() if r.e2e_latency is not None)
        stutters = [r.max_inter_token_latency for r in self.requests.values()]
        out.update(
            ttft_p50=percentile(ttfts, 50), ttft_p99=percentile(ttfts, 99),
            e2e_p50=percentile(e2es, 50), e2e_p99=percentile(e2es, 99),
            max_inter_token_latency=max(stutters, default=0.0),
            preemptions_per_finished_request=self.num_preemptions / max(self.num_finished, 1),
            peak_gpu_blocks_used=max((s.gpu_blocks_used for s in self.timeline), default=0),
            peak_cpu_blocks_used=max((s.cpu_blocks_used for s in self.timeline), default=0),
            peak_blocks_saved_by_sharing=max((s.blocks_saved_by_sharing for s in self.timeline), default=0),
        )
        return out

    def plot(self, path: Optional[str] = None, ax=None):
        """Draw GPU and CPU KV usage per step, with preemptions marked; save to ``path`` if given."""
        import matplotlib
        if ax is None and path is not None:
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        if ax is None:
            _, ax = plt.subplots(figsize=(8, 3.5))
        steps = [s.step for s in self.timeline]
        ax.plot(steps, [s.gpu_blocks_used for s in self.timeline], label="GPU KV blocks used")
        ax.plot(steps, [s.cpu_blocks_used for s in self.timeline], label="CPU (swap) blocks used")
        if self.timeline:
            ax.axhline(self.timeline[0].gpu_blocks_total, color="grey", ls="--", lw=0.8, label="GPU pool size")
        marks = [s.step for s in self.timeline if s.num_preemptions]
        if marks:
            ax.scatter(marks, [0] * len(marks), marker="v", color="red", label="preemption", zorder=3)
        ax.set_xlabel("engine step")
        ax.set_ylabel("KV blocks")
        ax.legend(loc="upper right", fontsize=8)
        if path is not None:
            ax.figure.tight_layout()
            ax.figure.savefig(path, dpi=120)
        return ax


def percentile(sorted_values: list[float], q: float) -> Optional[float]:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_values:
        return None
    rank = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[rank]
