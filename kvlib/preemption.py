"""Who gives up KV blocks under memory pressure, and how: swap to host memory or recompute later.

A policy is any object with ``select_victim`` and ``choose_mode``; pass one to
``LLM(..., preemption_policy=...)`` to run your own inside the engine. Whatever a policy picks,
outputs stay correct: a bad choice costs time, never tokens, because a block another sequence
still uses is never freed or moved away from it.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvlib.sequence import Sequence


@dataclass
class PreemptionCostModel:
    """Seconds each option costs for one victim; ``auto`` picks the cheaper.

    swap:      the blocks cross the host link twice (out, then back in):
               ``2 * num_blocks * block_bytes / host_link_bytes_per_s``
    recompute: the dropped tokens are prefilled again: ``num_tokens / prefill_tokens_per_s``
    """

    host_link_bytes_per_s: float
    prefill_tokens_per_s: float

    def swap_seconds(self, num_blocks: int, block_bytes: int) -> float:
        return 2 * num_blocks * block_bytes / self.host_link_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s


@dataclass
class VictimCandidate:
    """A sequence that could give up device blocks, with what it could give."""

    seq: Sequence
    running: bool  # False: already preempted, still holding blocks after a partial preemption
    num_blocks: int  # device blocks in its table
    num_unique_tail_blocks: int  # trailing blocks no other sequence uses: what partial preemption takes
    num_shared_blocks: int  # blocks other sequences use too: taking them frees nothing

    @property
    def arrival_time(self) -> float:
        return self.seq.arrival_time


@dataclass
class PreemptionContext:
    """What a policy may look at when it decides how to preempt one victim."""

    num_blocks: int  # device blocks the victim gives up
    num_tokens: int  # computed tokens those blocks hold (what recompute must redo)
    block_bytes: int
    host_free_blocks: int


class LatestArrivalPolicy:
    """The default: preempt the most recently arrived sequence, by the engine's configured mode.

    Taking the newest first means the oldest running request always keeps going, so nobody
    starves: a request preempted again and again is always newer than the one that pushed it out,
    and once it is the oldest it can no longer be chosen while any newer one runs.
    """

    def __init__(self, mode: str = "recompute", cost_model: PreemptionCostModel | None = None):
        self.mode = mode
        self.cost_model = cost_model

    def select_victim(self, candidates: list[VictimCandidate], shortfall: int) -> VictimCandidate:
        """``candidates`` are in arrival order, oldest first; ``shortfall`` blocks are missing."""
        return candidates[-1]

    def choose_mode(self, victim: Sequence, context: PreemptionContext) -> str:
        if self.mode != "auto":
            return self.mode
        swap = self.cost_model.swap_seconds(context.num_blocks, context.block_bytes)
        recompute = self.cost_model.recompute_seconds(context.num_tokens)
        return "swap" if swap < recompute else "recompute"
