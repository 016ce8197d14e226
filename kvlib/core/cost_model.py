"""What a preemption costs, in the seconds it adds to the engine's steps: one model for every machine.

The same model prices this machine (its constants measured by :mod:`kvlib.runner.cost_probe`), a GPU
from its published figures (:mod:`kvlib.course.gpu_profiles`) and a recorded GPU run
(:mod:`kvlib.course.measured_runs`), so their answers can be laid on the same axes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def attention_pairs(num_tokens: int, num_cached: int = 0) -> int:
    """(query, key) pairs causal attention scores for ``num_tokens`` new tokens after ``num_cached`` cached ones."""
    return num_tokens * num_cached + num_tokens * (num_tokens + 1) // 2


@dataclass
class PreemptionCostModel:
    """Seconds each option costs for one victim; ``auto`` picks the cheaper.

    A forward pass reads every weight once, however few tokens it carries (``floor_seconds``,
    which on a CPU or an eager GPU also holds the cost of launching its operations), and does
    arithmetic in proportion to its tokens (``tokens / prefill_tokens_per_s``). The two overlap by
    ``overlap``: 1 on a GPU, where the pass takes the longer of the two, 0 where they add up (one
    CPU core). Attention adds ``attention_seconds_per_pair`` for every (query, key) pair it scores
    and ``attention_call_seconds`` for every prefilling sequence it attends for separately.

    swap:      one batched copy out and one back in, each a fixed call cost plus bytes over the
               host link: ``2 * (copy_call_seconds + num_blocks * block_bytes / host_link_bytes_per_s)``
    recompute: the victim's tokens join a pass that already carries ``batch_tokens`` (the running
               decode batch), so they cost what they add to it, their own attention included.
               While the batch leaves the pass waiting on its weight reads, a GPU recomputes short
               victims almost for free.

    Given only the two speeds, swap is bytes over the link and recompute is tokens over the
    prefill speed.
    """

    host_link_bytes_per_s: float
    prefill_tokens_per_s: float
    floor_seconds: float = 0.0
    overlap: float = 1.0
    attention_seconds_per_pair: float = 0.0
    attention_call_seconds: float = 0.0
    copy_call_seconds: float = 0.0

    def pass_seconds(self, num_tokens: int, num_pairs: int = 0, num_prefills: int = 0) -> float:
        """One forward pass over ``num_tokens`` tokens, ``num_prefills`` of its sequences prefilling.

        ``num_pairs``: the (query, key) pairs its attention scores (see :func:`attention_pairs`).
        """
        arithmetic = num_tokens / self.prefill_tokens_per_s
        hidden = self.overlap * min(self.floor_seconds, arithmetic)
        attention = num_pairs * self.attention_seconds_per_pair + num_prefills * self.attention_call_seconds
        return self.floor_seconds + arithmetic - hidden + attention

    def swap_seconds(self, num_blocks: int, block_bytes: int) -> float:
        if num_blocks == 0:
            return 0.0
        return 2 * (self.copy_call_seconds + num_blocks * block_bytes / self.host_link_bytes_per_s)

    def recompute_seconds(self, num_tokens: int, batch_tokens: int = 1) -> float:
        if num_tokens == 0:
            return 0.0
        with_victim = self.pass_seconds(batch_tokens + num_tokens, attention_pairs(num_tokens), num_prefills=1)
        return with_victim - self.pass_seconds(batch_tokens)

    def choose(self, num_blocks: int, block_bytes: int, num_tokens: int, batch_tokens: int = 1) -> str:
        """"swap" when it is strictly cheaper, else "recompute" (a tie keeps the host pool free)."""
        swap = self.swap_seconds(num_blocks, block_bytes)
        return "swap" if swap < self.recompute_seconds(num_tokens, batch_tokens) else "recompute"

    def recompute_range(self, block_size: int, block_bytes: int, batch_tokens: int = 1,
                        limit_tokens: int = 1 << 17) -> Optional[tuple[int, int]]:
        """The shortest and longest victims, in whole blocks' tokens up to ``limit_tokens``, that recompute.

        Recompute minus swap is convex in the victim's blocks, so the victims that recompute are
        one unbroken range of lengths (None: every victim swaps) and every victim outside it
        swaps. Binary searches on the convex difference find its ends.
        """
        def excess(blocks: int) -> float:  # recompute minus swap: at most 0 recomputes
            return (self.recompute_seconds(blocks * block_size, batch_tokens)
                    - self.swap_seconds(blocks, block_bytes))

        most = limit_tokens // block_size
        if most < 1:
            return None
        cheapest = _first(1, most, lambda b: b == most or excess(b + 1) >= excess(b))
        if excess(cheapest) > 0:
            return None
        first = _first(1, cheapest, lambda b: excess(b) <= 0)
        last = _first(cheapest, most, lambda b: b == most or excess(b + 1) > 0)
        return first * block_size, last * block_size


def _first(low: int, high: int, holds) -> int:
    """The least ``b`` in ``low .. high`` for which ``holds(b)``, given that it holds from there on and at ``high``."""
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if holds(middle) else (middle + 1, high)
    return low
