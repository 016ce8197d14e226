"""What the engine measures: preemption counters, per-request latency and a per-step KV timeline.

Preemption is not free: it shows up as a later first token, a longer request, or a stutter
(a long gap between two tokens). These are the numbers that make that visible.

A server runs for days, so memory stays bounded: counters and peaks are running totals, while
the per-request records and the per-step timeline keep only the most recent ``history`` entries
(``None`` keeps everything, for a short experiment you want to plot in full). ``summary()`` reads
the counters and the retained records only, so it costs the same at any run length.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from kvlib.core.plan import SchedulerOutput, StepResult
    from kvlib.core.sequence import Sequence

DEFAULT_HISTORY = 10_000


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
    time: float  # seconds the step took
    end_time: float  # time.perf_counter() when it ended
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
    num_preemptions: int = 0  # every time a sequence gave up device blocks
    num_preemptions_swap: int = 0
    num_preemptions_recompute: int = 0
    num_swap_fallbacks: int = 0  # swap chosen but the host pool was full: recomputed instead
    num_swapped_out_blocks: int = 0  # block copies to the host made by preemption
    num_swapped_in_blocks: int = 0  # block copies back to the device made by resuming
    num_recomputed_tokens: int = 0  # computed tokens recompute preemptions let go (a prefix hit may serve some back)
    swap_bytes: int = 0  # every byte moved over the host link (preemption and the host prefix tier)
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
    num_aborted: int = 0
    peak_gpu_blocks_used: int = 0
    peak_cpu_blocks_used: int = 0
    peak_blocks_saved_by_sharing: int = 0
    history: Optional[int] = DEFAULT_HISTORY  # requests and steps kept; None: all of them
    requests: OrderedDict[str, RequestMetrics] = field(default_factory=OrderedDict)
    steps: deque[StepRecord] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.steps = deque(self.steps, maxlen=self.history)

    @property
    def timeline(self) -> list[StepRecord]:
        """The retained steps, oldest first."""
        return list(self.steps)

    def reset(self) -> None:
        self.__dict__.update(EngineMetrics(history=self.history).__dict__)

    def record_plan(self, plan: SchedulerOutput, block_bytes: int, move_seconds: float = 0.0) -> None:
        """Count what a step's plan did to the pools: its preemptions and its block moves."""
        for preemption in plan.preemptions:
            self.num_preemptions += 1
            self.num_preemptions_swap += preemption.mode == "swap"
            self.num_preemptions_recompute += preemption.mode == "recompute"
            self.num_swap_fallbacks += preemption.fell_back
            self.num_recomputed_tokens += preemption.lost_tokens
        moves = plan.moves
        self.num_swapped_out_blocks += len(moves.swap_out)
        self.num_swapped_in_blocks += len(moves.swap_in)
        self.num_cow_copies += len(moves.copies)
        self.swap_bytes += (len(moves.to_host) + len(moves.to_device)) * block_bytes
        self.swap_time += move_seconds

    def record_result(self, plan: SchedulerOutput, result: StepResult, forward_seconds: float = 0.0) -> None:
        """Count what the step computed: its tokens, and the share of the forward pass that redid lost ones."""
        self.num_generated_tokens += len(result.sampled)
        if plan.num_recomputed_tokens:
            self.recompute_time += forward_seconds * plan.num_recomputed_tokens / plan.num_batched_tokens

    def record_finished(self, request_id: str, seqs: list[Sequence]) -> None:
        arrival_time = seqs[0].arrival_time
        firsts = [s.first_token_time for s in seqs if s.first_token_time is not None]
        self.requests[request_id] = RequestMetrics(
            request_id=request_id,
            arrival_time=arrival_time,
            ttft=min(firsts) - arrival_time if firsts else None,
            e2e_latency=max(s.finish_time for s in seqs) - arrival_time,
            num_preemptions=sum(s.num_preemptions for s in seqs),
            max_inter_token_latency=max(s.max_inter_token_latency for s in seqs),
            num_output_tokens=sum(len(s.output_token_ids) for s in seqs),
        )
        if self.history is not None and len(self.requests) > self.history:
            self.requests.popitem(last=False)
        self.num_finished += 1

    def record_step(self, record: StepRecord) -> None:
        self.num_steps += 1
        self.steps.append(record)
        self.peak_gpu_blocks_used = max(self.peak_gpu_blocks_used, record.gpu_blocks_used)
        self.peak_cpu_blocks_used = max(self.peak_cpu_blocks_used, record.cpu_blocks_used)
        self.peak_blocks_saved_by_sharing = max(self.peak_blocks_saved_by_sharing, record.blocks_saved_by_sharing)

    def summary(self) -> dict:
        """Counters, peaks and latency percentiles (over the retained requests) as a plain dict."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("history", "requests", "steps")}
        records = list(self.requests.values())
        ttfts = sorted(r.ttft for r in records if r.ttft is not None)
        e2es = sorted(r.e2e_latency for r in records if r.e2e_latency is not None)
        out.update(
            ttft_p50=percentile(ttfts, 50), ttft_p99=percentile(ttfts, 99),
            e2e_p50=percentile(e2es, 50), e2e_p99=percentile(e2es, 99),
            max_inter_token_latency=max((r.max_inter_token_latency for r in records), default=0.0),
            preemptions_per_finished_request=self.num_preemptions / max(self.num_finished, 1),
        )
        return out

    def plot(self, path: Optional[str] = None, ax=None, x: str = "step"):
        """Draw GPU and CPU KV usage per step (``x="seconds"``: against time), preemptions marked.

        With a ``path`` and no ``ax`` the plot is drawn on a ``Figure`` of its own and saved, outside
        pyplot: a notebook's backend and its open figures stay as they were.
        """
        if ax is None and path is not None:
            from matplotlib.figure import Figure
            ax = Figure(figsize=(8, 3.5)).subplots()
        elif ax is None:
            import matplotlib.pyplot as plt
            _, ax = plt.subplots(figsize=(8, 3.5))
        timeline = self.timeline
        start = timeline[0].end_time - timeline[0].time if timeline else 0.0
        xs = [s.step if x == "step" else s.end_time - start for s in timeline]
        ax.plot(xs, [s.gpu_blocks_used for s in timeline], label="GPU KV blocks used")
        ax.plot(xs, [s.cpu_blocks_used for s in timeline], label="CPU (swap) blocks used")
        if timeline:
            ax.axhline(timeline[0].gpu_blocks_total, color="grey", ls="--", lw=0.8, label="GPU pool size")
        marks = [xv for xv, s in zip(xs, timeline) if s.num_preemptions]
        if marks:
            ax.scatter(marks, [0] * len(marks), marker="v", color="red", label="preemption", zorder=3)
        ax.set_xlabel("engine step" if x == "step" else "seconds")
        ax.set_ylabel("KV blocks")
        _counts_on_axes(ax, integer_x=x == "step")
        highest = max([s.gpu_blocks_total for s in timeline[:1]] + [s.cpu_blocks_used for s in timeline] + [1])
        ax.set_ylim(bottom=-0.04 * highest, top=1.45 * highest)  # a band above the curves for the legend
        ax.legend(loc="upper center", ncol=2, fontsize=8)
        if path is not None:
            ax.figure.tight_layout()
            ax.figure.savefig(path, dpi=120)
        return ax


def _counts_on_axes(ax, integer_x: bool) -> None:
    """Whole-number ticks where the axis counts (blocks; steps), never 2.5 blocks."""
    from matplotlib.ticker import MaxNLocator
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if integer_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def percentile(sorted_values: list[float], q: float) -> Optional[float]:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_values:
        return None
    rank = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[rank]
