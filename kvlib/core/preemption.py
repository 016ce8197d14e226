"""Who gives up KV blocks under memory pressure, and how: swap to host memory or recompute later.

A policy (see :class:`kvlib.interfaces.PreemptionPolicy`) answers two questions: which candidate
gives up blocks (``select_victim``), and, with ``preemption_mode="auto"``, whether that victim is
swapped or recomputed (``choose_mode``). Pass one as ``LLM(..., preemption_policy=...)`` to run
your own inside the engine. Whatever a policy picks, outputs stay correct: a bad choice costs
time, never tokens, because a block another sequence still uses is never freed or moved away
from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvlib.core.cost_model import PreemptionCostModel
from kvlib.core.sequence import Sequence

__all__ = ["LatestArrivalPolicy", "PreemptionContext", "PreemptionCostModel", "SparingPolicy", "VictimCandidate"]


@dataclass
class VictimCandidate:
    """A sequence that could give up device blocks, with what it could give."""

    seq: Sequence
    is_requester: bool  # the running sequence that needs the blocks: choosing it ends the search
    running: bool  # False: already preempted, still holding device blocks after a partial preemption
    num_blocks: int  # device blocks in its table
    num_unique_tail_blocks: int  # trailing blocks no other sequence uses: what partial preemption takes
    num_shared_blocks: int  # blocks other sequences use too: letting go of them frees nothing

    @property
    def arrival_time(self) -> float:
        return self.seq.arrival_time


@dataclass
class PreemptionContext:
    """What ``choose_mode`` may look at when it decides how one victim gives up its blocks."""

    num_blocks: int  # device blocks the victim gives up
    num_tokens: int  # computed tokens those blocks hold (what recompute must redo)
    num_host_blocks: int  # host blocks a swap would fill (blocks shared with an earlier copy move once)
    block_bytes: int
    host_free_blocks: int  # host blocks a swap can have: free, or held by the host prefix tier only
    cost_model: Optional[PreemptionCostModel] = None  # the engine's measured one, in auto mode
    batch_tokens: int = 1  # tokens the step a recompute joins carries anyway: the running decode batch


class LatestArrivalPolicy:
    """The default: preempt the most recently arrived candidate; in auto mode, the cheaper option.

    Taking the newest first means the oldest running request always keeps going, so nobody
    starves: a request preempted again and again is always newer than the one that pushed it out,
    and once it is the oldest it can no longer be chosen while any newer one runs.
    """

    def __init__(self, cost_model: Optional[PreemptionCostModel] = None):
        if isinstance(cost_model, str):
            raise TypeError(f"{type(self).__name__} takes a cost model, not a mode ({cost_model!r}): the mode is "
                            f"EngineConfig.preemption_mode")
        self.cost_model = cost_model  # None: the engine measures one at start-up in auto mode

    def select_victim(self, candidates: list[VictimCandidate], shortfall: int) -> VictimCandidate:
        """``candidates`` are in arrival order, oldest first; ``shortfall`` blocks are missing."""
        return candidates[-1]

    def choose_mode(self, victim: VictimCandidate, context: PreemptionContext) -> str:
        """The cheaper option by the cost model (see :class:`~kvlib.core.cost_model.PreemptionCostModel`)."""
        cost = self.cost_model or context.cost_model
        return cost.choose(context.num_host_blocks, context.block_bytes, context.num_tokens, context.batch_tokens)


class SparingPolicy(LatestArrivalPolicy):
    """Spare shared blocks: take unique tails that cover the shortfall, newest first; the requester last.

    A candidate whose blocks are all shared frees nothing when it lets go, so it is never chosen
    while anyone else can give a block. Among those who can, one whose unique tail covers the
    whole shortfall is preferred, so one preemption is enough.
    """

    def select_victim(self, candidates: list[VictimCandidate], shortfall: int) -> VictimCandidate:
        requester = next(c for c in candidates if c.is_requester)
        givers = [c for c in candidates if not c.is_requester and c.num_unique_tail_blocks > 0]
        covering = [c for c in givers if c.num_unique_tail_blocks >= shortfall]
        return (covering or givers or [requester])[-1]
