"""Paired timings decide only what their rounds show: a clear winner, a cost clear of zero, else nothing."""
from __future__ import annotations

import itertools
import random

import pytest

from kvlib.course.timing import TOO_CLOSE, compare, decide, settled


class FakeClock:
    """A clock each option advances by its own cost, times a noise factor drawn per call."""

    def __init__(self, noise: float = 0.0, seed: int = 0):
        self.now, self.noise, self.rng = 0.0, noise, random.Random(seed)

    def __call__(self) -> float:
        return self.now

    def costs(self, seconds: float):
        def run():
            self.now += seconds * (1 + self.rng.uniform(-self.noise, self.noise))
        return run


def test_a_clear_difference_names_its_winner_and_stops_early():
    clock = FakeClock(noise=0.02)
    result = compare({"swap": clock.costs(1.0), "recompute": clock.costs(2.0)}, clock=clock)
    assert result.winner == "swap" and len(result.rounds["swap"]) == 7  # the fewest rounds that can decide
    assert result.ratio("recompute", "swap") == pytest.approx(2.0, rel=0.05)


def test_a_difference_inside_the_noise_is_too_close_to_call():
    clock = FakeClock(noise=0.3)
    result = compare({"tier": clock.costs(1.04), "no tier": clock.costs(1.05)}, clock=clock, max_rounds=25,
                     budget_s=1e9)
    assert result.winner is None and len(result.rounds["tier"]) == 25


def test_a_drift_that_falls_on_every_option_alike_does_not_decide():
    """The clock slows down round after round; alternating the order keeps equal options equal."""
    clock, slowdown = FakeClock(), itertools.count(1)
    def equal():
        clock.now += 1.0 + 0.1 * next(slowdown)
    assert compare({"a": equal, "b": equal}, clock=clock, budget_s=1e9).winner is None


def test_a_cost_is_reported_only_when_it_is_clear_of_zero():
    clock = FakeClock(noise=0.01)
    clear = compare({"batch+victim": clock.costs(1.2), "batch": clock.costs(1.0)}, clock=clock, until="spread",
                    max_rounds=9, budget_s=1e9)
    assert clear.extra("batch+victim", "batch") == pytest.approx(0.2, rel=0.2)
    noisy = FakeClock(noise=0.2)
    hidden = compare({"batch+victim": noisy.costs(1.0), "batch": noisy.costs(1.0)}, clock=noisy, until="spread",
                     max_rounds=9, budget_s=1e9)
    assert hidden.extra("batch+victim", "batch") is None  # never a negative cost


def test_three_options_need_the_fastest_to_beat_each_other_clearly():
    assert decide({"a": [1.0] * 7, "b": [2.0] * 7, "c": [3.0] * 7}) == "a"
    assert decide({"a": [1.0] * 7, "b": [1.01] * 7, "c": [3.0] * 7}) is None


def test_bad_arguments_say_what_to_change():
    with pytest.raises(ValueError, match="two or more options"):
        compare({"only": lambda: None})
    with pytest.raises(ValueError, match="until must be"):
        compare({"a": lambda: None, "b": lambda: None}, until="forever")


@pytest.mark.parametrize("seed", range(40))
def test_equal_options_are_almost_never_given_a_winner(seed):
    """Stopping at the first round that decides must not turn noise into a verdict (a 98% interval per look)."""
    clock = FakeClock(noise=0.3, seed=seed)
    result = compare({"a": clock.costs(1.0), "b": clock.costs(1.0)}, clock=clock, budget_s=1e9)
    assert result.winner is None


def test_a_few_whole_runs_name_a_winner_only_a_quarter_clear_of_a_tie():
    assert settled([1.3, 1.2, 1.26], "above", "below") == "above"  # median 1.26
    assert settled([0.7, 0.9, 0.79], "above", "below") == "below"  # median 0.79 <= 1 / 1.25
    assert settled([1.24, 2.0, 0.5], "above", "below") == TOO_CLOSE
    assert settled([0.81, 0.8, 0.9], "above", "below") == TOO_CLOSE  # 0.81 > 0.8
