"""A step's plan and what came of it, as plain data.

The scheduler fills a :class:`SchedulerOutput` once per step, as it decides: each scheduled
sequence's chunk (where it starts, how many tokens, whether a token is drawn after it), the
draws, the samples to fork, the preemptions and the block moves they imply. The model runner
carries the plan out, the scheduler's ``postprocess`` turns the sampled tokens into a
:class:`StepResult`, and the metrics count both. None of them works the plan out again from a
sequence's counters.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvlib.core.sequence import Sequence


@dataclass
class BlockMoves:
    """The block copies one step owes, grouped by the phase they run in."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host): preempted sequences
    demote: list[tuple[int, int]] = field(default_factory=list)  # (device, host): evicted prefix blocks kept on the host
    copies: list[tuple[int, int]] = field(default_factory=list)  # (device, device): copy-on-write
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device): resumed sequences
    promote: list[tuple[int, int]] = field(default_factory=list)  # (host, device): host-tier prefix hits

    @property
    def to_host(self) -> list[tuple[int, int]]:
        return self.swap_out + self.demote

    @property
    def to_device(self) -> list[tuple[int, int]]:
        return self.swap_in + self.promote

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.demote or self.copies or self.swap_in or self.promote)


@dataclass(slots=True)
class ScheduledChunk:
    """The tokens one sequence computes this step: positions ``start .. start + num_tokens - 1``.

    It unpacks as ``(seq, num_tokens)``, the pair a plan lists: ``for seq, n in plan.scheduled``.
    """

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool  # it reaches the sequence's last token, so a token is drawn after it
    recomputed: int  # of its tokens, those computed before and lost to a preemption

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    def __iter__(self):
        return iter((self.seq, self.num_tokens))


@dataclass(slots=True)
class Preemption:
    """One victim giving up device blocks, as it was carried out."""

    seq: Sequence
    mode: str  # "swap" or "recompute"
    num_blocks: int
    lost_tokens: int  # computed tokens a recompute let go (none for a swap)
    fell_back: bool  # swap was chosen, but the host pool had no room: recomputed instead


@dataclass
class SchedulerOutput:
    """One step's plan: the tokens to compute, the block moves before them, the samples to fork after."""

    scheduled: list[ScheduledChunk] = field(default_factory=list)
    draws: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, logits row) of every token to sample
    forks: dict[Sequence, list[Sequence]] = field(default_factory=dict)  # parent -> new samples, made in postprocess
    preemptions: list[Preemption] = field(default_factory=list)
    moves: BlockMoves = field(default_factory=BlockMoves)
    num_logits_rows: int = 0  # sequences that sample: one row each, shared by their new samples

    def add(self, seq: Sequence, num_new: int, forks: list[Sequence] = ()) -> None:
        """Plan ``num_new`` tokens of ``seq`` from its ``num_computed_tokens`` on, and the samples that fork
        once it has computed its last token (``forks``: only a chunk that reaches its end has any).

        Tokens below the sequence's peak were computed before and lost to a preemption: they are
        redone. A chunk that reaches the sequence's end gets the next logits row, drawn once for
        the sequence and once for each of its new samples, which share the row.
        """
        start, peak = seq.num_computed_tokens, seq.peak_computed_tokens
        end = start + num_new
        samples = end == seq.num_tokens
        self.scheduled.append(ScheduledChunk(seq, start, num_new, samples, min(end, peak) - start if peak > start else 0))
        if samples:
            row = self.num_logits_rows
            self.num_logits_rows = row + 1
            self.draws.append((seq, row))
            if forks:
                self.forks[seq] = forks
                self.draws.extend((child, row) for child in forks)

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.scheduled)

    @property
    def num_recomputed_tokens(self) -> int:
        return sum(chunk.recomputed for chunk in self.scheduled)

    @property
    def num_preemptions(self) -> int:
        return len(self.preemptions)


@dataclass
class StepResult:
    sampled: list[Sequence] = field(default_factory=list)  # sequences that received a token, new samples included
    forked: list[Sequence] = field(default_factory=list)  # new samples of parallel requests
    finished: list[Sequence] = field(default_factory=list)
