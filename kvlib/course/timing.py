"""Paired, repeated timings of what a lesson compares, and what they can honestly decide.

One timing on a shared 2-core machine can flip between runs: another process takes a core, a cache
warms, the clock ticks up. :func:`compare` times the options in interleaved rounds (A B, B A, A B
...), so a drift falls on every option alike, and keeps going until a 98% confidence interval of the
median per-round ratio lies clear of 1 (beyond ``margin``), or its rounds or seconds run out: then the
comparison is *too close to call here*, and the lesson must say so rather than name a winner. The
interval comes from the rounds' order statistics (no assumption about how timings are spread). A cost measured as
the difference of two timings is reported only when it is clear of zero (:meth:`Comparison.extra`),
so a lesson never prints a negative cost.

A handful of whole-engine runs (three rounds, say) is too few for that interval; :func:`settled` is
the rule for them: a winner only where the median paired ratio is at least :data:`SETTLED` away from 1.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

MARGIN = 0.05  # ratios within 5% of 1 are too close to call: two runs could order them either way
CONFIDENCE = 0.98  # the median's interval must lie clear of the margin with this confidence
SETTLED = 1.25  # with too few rounds for an interval, a median paired ratio this far from 1 names a winner
TOO_CLOSE = "too close to call here"


@dataclass(frozen=True)
class Comparison:
    """Every round's seconds per option, and what they decide."""

    rounds: dict[str, list[float]]
    margin: float = MARGIN

    @property
    def seconds(self) -> dict[str, float]:
        """The median seconds of each option."""
        return {name: statistics.median(times) for name, times in self.rounds.items()}

    @property
    def winner(self) -> Optional[str]:
        """The fastest option if it beats every other one clearly, round by round; else None."""
        return decide(self.rounds, self.margin)

    def ratio(self, slower: str, faster: str) -> float:
        """The median of ``slower``'s seconds over ``faster``'s, paired round by round."""
        return statistics.median(s / f for s, f in zip(self.rounds[slower], self.rounds[faster]))

    def extra(self, with_it: str, without_it: str) -> Optional[float]:
        """Seconds ``with_it`` adds to ``without_it`` (paired medians), or None where it is not clear of zero."""
        differences = [a - b for a, b in zip(self.rounds[with_it], self.rounds[without_it])]
        return statistics.median(differences) if median_interval(differences)[0] > 0 else None


def decide(rounds: Mapping[str, list[float]], margin: float = MARGIN) -> Optional[str]:
    """The option whose per-round ratio to every other lies below ``1 - margin`` with :data:`CONFIDENCE`."""
    medians = {name: statistics.median(times) for name, times in rounds.items()}
    fastest = min(medians, key=medians.get)
    for other in rounds:
        if other != fastest:
            ratios = [f / o for f, o in zip(rounds[fastest], rounds[other])]
            if median_interval(ratios)[1] >= 1 - margin:
                return None
    return fastest


def compare(options: Mapping[str, Callable[[], object]], *, min_rounds: int = 7, max_rounds: int = 25,
            budget_s: float = 5.0, margin: float = MARGIN, until: str = "decided",
            clock: Callable[[], float] = time.perf_counter, progress: Optional[str] = None) -> Comparison:
    """Time each option once per round, alternating their order, until ``until`` holds or the budget is spent.

    Raises ValueError for fewer than two options or an unknown ``until``.

    ``until="decided"`` stops as soon as a winner is clear; ``until="spread"`` keeps going to
    ``max_rounds`` or ``budget_s`` (for costs read with :meth:`Comparison.extra`). Each option runs
    once untimed first, so a first call's compilation or allocation is not in any round.
    ``progress``: a label for a bar over the rounds (as many as ``budget_s`` allows at the pace so far, at least
    ``min_rounds``, at most ``max_rounds``; full when the rounds stop).
    """
    if until not in ("decided", "spread"):
        raise ValueError(f"until must be 'decided' or 'spread', got {until!r}")
    if len(options) < 2:
        raise ValueError(f"compare needs two or more options to compare, got {list(options)}")
    bar = None
    if progress is not None:
        from kvlib.course.progress import run_bar
        bar = run_bar(1 + max_rounds, progress, unit="round")
    try:
        for run in options.values():
            run()
        _advance(bar)
        names = list(options)
        rounds: dict[str, list[float]] = {name: [] for name in names}
        start = clock()
        for index in range(max_rounds):
            for name in (names if index % 2 == 0 else names[::-1]):
                began = clock()
                options[name]()
                rounds[name].append(clock() - began)
            _advance(bar, 1 + min(max_rounds, max(min_rounds, _rounds_in(budget_s, clock() - start, index + 1))))
            done = index + 1 >= min_rounds and (
                clock() - start > budget_s or (until == "decided" and decide(rounds, margin) is not None))
            if done:
                break
    finally:
        if bar is not None:
            bar.total = bar.n  # the rounds stopped early: the bar ends full
            bar.close()
    return Comparison(rounds, margin)


def _advance(bar, expected: Optional[int] = None) -> None:
    """One more step on the bar; ``expected``: the steps it now expects in all (the rounds the budget allows)."""
    if bar is not None:
        if expected is not None:
            bar.total = max(expected, bar.n + 1)
        bar.update(1)


def _rounds_in(budget_s: float, spent_s: float, done: int) -> int:
    """The rounds that fit the budget at the pace of those done so far."""
    return math.ceil(budget_s / (spent_s / done)) if spent_s > 0 else done


def median_interval(values: list[float]) -> tuple[float, float]:
    """A distribution-free :data:`CONFIDENCE` interval of the median: the k-th values from each end.

    With too few values for that confidence (fewer than 7) it is unbounded, so nothing is decided.
    """
    ordered, n = sorted(values), len(values)
    outside = 1 - CONFIDENCE
    k = 0  # values left outside each end: the largest k with P(Binomial(n, 1/2) < k) <= outside / 2
    while k < n // 2 and 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n <= outside:
        k += 1
    return (ordered[k - 1], ordered[n - k]) if k else (-math.inf, math.inf)


def settled(ratios: list[float], above: str, below: str) -> str:
    """``above`` where the median paired ratio is at least :data:`SETTLED`, ``below`` where it is at most
    ``1 / SETTLED``, else :data:`TOO_CLOSE`: the verdict of a few rounds, each a whole engine run."""
    middle = statistics.median(ratios)
    return above if middle >= SETTLED else below if middle <= 1 / SETTLED else TOO_CLOSE
