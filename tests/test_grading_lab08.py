"""Lab 08 grading: correct pieces get full marks, a bug costs exactly its checks, kvlib's own answer is hidden.

The pieces are graded in this process, each correct one next to its realistic bugs, on several seeds
(every check draws its inputs from the seed): timing on the fake clock, the two fits and the policy.
Notebooks are graded as ``kvlib grade`` grades them, in this process (the sandbox's isolation is
covered by ``tests/test_grading.py``): the solution, the untouched lab, and copies that hand a task
to kvlib's own code, which is hidden while the learner's code runs.
"""
from __future__ import annotations

import math
import random
from pathlib import Path

import nbformat
import numpy as np
import pytest
from notebook_cells import graded_cells

from kvlib.core.cost_model import PreemptionCostModel, attention_pairs
from kvlib.core.preemption import LatestArrivalPolicy
from kvlib.course.grading import lab08
from kvlib.course.grading.checks import observe
from kvlib.course.grading.hidden import hiding
from kvlib.course.grading.results import FAIL, NOT_IMPLEMENTED, PASS
from kvlib.course.grading.runner import InProcess, grade_cells
from kvlib.runner import cost_probe

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab08_cost_model.ipynb"
LAB = ROOT / "labs" / "lab08_cost_model.ipynb"
SEEDS = (0, 1, 2, 3)


def lost(tasks, piece, seeds=SEEDS) -> set[str]:
    """The checks ``piece`` fails, the same on every seed; a failure always says why and hints."""
    found = set()
    for seed in seeds:
        failed = {f"{task.name}/{r.name}": r for task in tasks for r in task.verdicts(piece, seed) if r.status != PASS}
        assert all(r.status == FAIL and r.message and r.hint for r in failed.values()), failed
        assert not found or set(failed) == found, (seed, set(failed), found)
        found = set(failed)
    return found


# ---- measure -----------------------------------------------------------------------------------
def best_in_turns(fns, rounds, clock):
    for fn in fns:
        fn()
    best = [math.inf] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = clock()
            fn()
            best[i] = min(best[i], clock() - start)
    return best


def no_warm_up(fns, rounds, clock):
    best = [math.inf] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = clock()
            fn()
            best[i] = min(best[i], clock() - start)
    return np.array(best)


def mean_of_rounds(fns, rounds, clock):
    total = [0.0] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = clock()
            fn()
            total[i] += clock() - start
    return [t / rounds for t in total]


def one_after_another(fns, rounds, clock):
    best = []
    for fn in fns:
        fn()
        times = []
        for _ in range(rounds):
            start = clock()
            fn()
            times.append(clock() - start)
        best.append(min(times))
    return best


def too_few_rounds(fns, rounds, clock):
    return best_in_turns(fns, 2, clock)


def wall_clock(fns, rounds, clock):
    import time
    return best_in_turns(fns, rounds, time.perf_counter)


def warm_up_is_a_round(fns, rounds, clock):
    best = [math.inf] * len(fns)
    for r in range(rounds):
        for i, fn in enumerate(fns):
            start = clock()
            fn()
            if r:
                best[i] = min(best[i], clock() - start)
    return best


def kvlibs_timing(fns, rounds, clock):
    return cost_probe.best_in_turns(fns, None, rounds)


MEASURE = {"measure/keeps_the_best", "measure/in_turns", "measure/one_round"}


@pytest.mark.parametrize("piece, failed", [
    (best_in_turns, set()),
    (no_warm_up, {"measure/one_round"}),
    (warm_up_is_a_round, {"measure/one_round"}),
    (mean_of_rounds, MEASURE),  # no warm-up either
    (one_after_another, {"measure/in_turns"}),
    (too_few_rounds, {"measure/keeps_the_best", "measure/in_turns"}),
    (wall_clock, MEASURE),
], ids=lambda p: getattr(p, "__name__", ""))
def test_timing_a_bug_costs_exactly_its_checks(piece, failed):
    assert lost([lab08.measure], piece) == failed


def via_the_lessons_timing(fns, rounds, clock):
    """The lessons' paired rounds (``kvlib.course.timing.compare``) do this task's work: a route around it."""
    from kvlib.course.timing import compare
    got = compare(dict(enumerate(fns)), min_rounds=rounds, max_rounds=rounds, until="spread", clock=clock,
                  budget_s=float("inf"))
    return [min(got.rounds[i]) for i in range(len(fns))]


def test_the_lessons_timing_is_hidden_while_timing_is_graded():
    result = lab08.check_measure(via_the_lessons_timing)
    assert result.points == 0 and {c.status for c in result.checks} == {NOT_IMPLEMENTED}


def test_the_observation_names_what_the_timing_saw():
    [result] = [r for r in lab08.measure.verdicts(one_after_another, 0) if r.status != PASS]
    assert result.name == "in_turns" and "slower for the first" in result.message and "differ from kvlib's" in result.message


def test_kvlibs_own_timing_is_not_there_while_the_timing_is_graded():
    assert {r.status for r in lab08.measure.verdicts(kvlibs_timing, 0)} == {NOT_IMPLEMENTED}
    saved = cost_probe.time
    assert lab08._kvlibs_timing([lambda: None], 1, iter(range(100)).__next__) == [1] and cost_probe.time is saved


# ---- fit_swap ----------------------------------------------------------------------------------
def fit_copy(block_counts, round_trip_seconds, block_bytes):
    slope, intercept = np.polyfit(np.asarray(block_counts, float), np.asarray(round_trip_seconds, float), 1)
    return intercept / 2, 2 * block_bytes / slope


def two_points(block_counts, round_trip_seconds, block_bytes):  # exact timings: the ends of the line are enough
    slope = (round_trip_seconds[-1] - round_trip_seconds[0]) / (block_counts[-1] - block_counts[0])
    return np.array([(round_trip_seconds[0] - slope * block_counts[0]) / 2, 2 * block_bytes / slope])


def through_origin(block_counts, round_trip_seconds, block_bytes):
    n, t = np.asarray(block_counts, float), np.asarray(round_trip_seconds, float)
    return 0.0, 2 * block_bytes / (n @ t / (n @ n))


def one_copy(block_counts, round_trip_seconds, block_bytes):  # the round trip taken for a single copy
    slope, intercept = np.polyfit(block_counts, round_trip_seconds, 1)
    return intercept, block_bytes / slope


def blocks_per_second(block_counts, round_trip_seconds, block_bytes):
    slope, intercept = np.polyfit(block_counts, round_trip_seconds, 1)
    return intercept / 2, 2 / slope


def kvlibs_copy_fit(block_counts, round_trip_seconds, block_bytes):
    return cost_probe.fit_copy(round_trip_seconds[0] / 2, round_trip_seconds[-1] / 2, block_counts[-1], block_bytes)


@pytest.mark.parametrize("piece, failed", [
    (fit_copy, set()),
    (two_points, set()),
    (through_origin, {"fit_swap/host_link", "fit_swap/copy_call"}),
    (one_copy, {"fit_swap/host_link", "fit_swap/copy_call"}),
    (blocks_per_second, {"fit_swap/host_link"}),
], ids=lambda p: getattr(p, "__name__", ""))
def test_copy_fit_a_bug_costs_exactly_its_checks(piece, failed):
    assert lost([lab08.fit_swap], piece) == failed


def test_kvlibs_own_copy_fit_is_not_there_while_the_fit_is_graded_and_recovers_the_terms_outside():
    assert {r.status for r in lab08.fit_swap.verdicts(kvlibs_copy_fit, 0)} == {NOT_IMPLEMENTED}
    cost = PreemptionCostModel(2.52e10, 1.0, copy_call_seconds=1e-5)
    counts = [1, 3, 9, 17]
    call, link = lab08._kvlibs_copy_fit(counts, [cost.swap_seconds(n, 368640) for n in counts], 368640)
    assert math.isclose(call, 1e-5, rel_tol=1e-9) and math.isclose(link, 2.52e10, rel_tol=1e-9)


# ---- fit_recompute -----------------------------------------------------------------------------
def fit_forward(batch_tokens, alone_seconds, victim_tokens, with_victim_seconds):
    added = np.asarray(with_victim_seconds) - alone_seconds
    known = np.array([[n, attention_pairs(n), 1.0] for n in victim_tokens])
    per_token, per_pair, call = np.linalg.lstsq(known, added, rcond=None)[0]
    return {"prefill_tokens_per_s": 1 / per_token, "attention_seconds_per_pair": per_pair,
            "attention_call_seconds": call, "floor_seconds": alone_seconds - batch_tokens * per_token}


def first_three(batch_tokens, alone_seconds, victim_tokens, with_victim_seconds):  # exact timings: 3 lengths solve it
    return fit_forward(batch_tokens, alone_seconds, victim_tokens[:3], with_victim_seconds[:3])


def per_pass(batch_tokens, alone_seconds, victim_tokens, with_victim_seconds):
    terms = fit_forward(batch_tokens, alone_seconds, victim_tokens, with_victim_seconds)
    return {**terms, "prefill_tokens_per_s": (batch_tokens + victim_tokens[-1]) / with_victim_seconds[-1]}


def without_floor(batch_tokens, alone_seconds, victim_tokens, with_victim_seconds):
    return {**fit_forward(batch_tokens, alone_seconds, victim_tokens, with_victim_seconds), "floor_seconds": 0.0}


def floor_is_the_pass(batch_tokens, alone_seconds, victim_tokens, with_victim_seconds):
    terms = fit_forward(batch_tokens, alone_seconds, victim_tokens, with_victim_seconds)
    return {**terms, "floor_seconds": alone_seconds}


def not_subtracted(batch_tokens, alone_seconds, victim_tokens, with_victim_seconds):
    known = np.array([[n, attention_pairs(n), 1.0] for n in victim_tokens])
    per_token, per_pair, call = np.linalg.lstsq(known, np.asarray(with_victim_seconds), rcond=None)[0]
    return {"prefill_tokens_per_s": 1 / per_token, "attention_seconds_per_pair": per_pair,
            "attention_call_seconds": call, "floor_seconds": alone_seconds - batch_tokens * per_token}


def without_attention(batch_tokens, alone_seconds, victim_tokens, with_victim_seconds):
    added = np.asarray(with_victim_seconds) - alone_seconds
    per_token, call = np.linalg.lstsq(np.array([[n, 1.0] for n in victim_tokens]), added, rcond=None)[0]
    return {"prefill_tokens_per_s": 1 / per_token, "attention_seconds_per_pair": 0.0,
            "attention_call_seconds": call, "floor_seconds": alone_seconds - batch_tokens * per_token}


def missing_key(batch_tokens, alone_seconds, victim_tokens, with_victim_seconds):
    terms = fit_forward(batch_tokens, alone_seconds, victim_tokens, with_victim_seconds)
    del terms["attention_call_seconds"]
    return terms


def without_call(batch_tokens, alone_seconds, victim_tokens, with_victim_seconds):  # the fit has no intercept
    added = np.asarray(with_victim_seconds) - alone_seconds
    known = np.array([[n, attention_pairs(n)] for n in victim_tokens])
    per_token, per_pair = np.linalg.lstsq(known, added, rcond=None)[0]
    return {"prefill_tokens_per_s": 1 / per_token, "attention_seconds_per_pair": per_pair,
            "attention_call_seconds": 0.0, "floor_seconds": alone_seconds - batch_tokens * per_token}


FORWARD = {"fit_recompute/prefill_speed", "fit_recompute/attention_per_pair", "fit_recompute/attention_call",
           "fit_recompute/floor"}


@pytest.mark.parametrize("piece, failed", [
    (fit_forward, set()),
    (first_three, set()),
    (per_pass, {"fit_recompute/prefill_speed"}),
    (without_floor, {"fit_recompute/floor"}),
    (floor_is_the_pass, {"fit_recompute/floor"}),
    (not_subtracted, {"fit_recompute/attention_call"}),
    (without_attention, FORWARD),
    (without_call, FORWARD),
    (missing_key, {"fit_recompute/attention_call"}),
], ids=lambda p: getattr(p, "__name__", ""))
def test_forward_fit_a_bug_costs_exactly_its_checks(piece, failed):
    assert lost([lab08.fit_recompute], piece) == failed


def test_the_forward_reference_recovers_the_terms_and_is_hidden_while_the_fit_is_graded():
    cost = PreemptionCostModel(1.0, 2.9e4, 3.2e-3, 0.0, 1.4e-7, 9.8e-4)
    lengths = [16, 64, 128, 256]
    terms = lab08._reference_fit_forward(8, cost.pass_seconds(8), lengths,
                                         [cost.pass_seconds(8 + n, attention_pairs(n), 1) for n in lengths])
    assert all(math.isclose(terms[t], getattr(cost, t), rel_tol=1e-9) for t in terms)
    with hiding(lab08.fit_recompute.hidden), pytest.raises(NotImplementedError):
        lab08._reference_fit_forward(8, 1.0, lengths, [2.0] * 4)


# ---- choose_mode and engine --------------------------------------------------------------------
class Policy(LatestArrivalPolicy):
    def __init__(self, cost_model):
        super().__init__(cost_model)

    def prices(self, context):
        cost = self.cost_model or context.cost_model
        return (cost.swap_seconds(context.num_host_blocks, context.block_bytes),
                cost.recompute_seconds(context.num_tokens, context.batch_tokens))

    def choose_mode(self, victim, context):
        if context.host_free_blocks < context.num_host_blocks:
            return "recompute"
        swap, recompute = self.prices(context)
        return "swap" if swap < recompute else "recompute"


class TieSwaps(Policy):
    def choose_mode(self, victim, context):
        if context.host_free_blocks < context.num_host_blocks:
            return "recompute"
        swap, recompute = self.prices(context)
        return "swap" if swap <= recompute else "recompute"


class OwnPass(Policy):  # recompute priced as a prefill of its own: the floor paid again
    def prices(self, context):
        n = context.num_tokens
        return super().prices(context)[0], self.cost_model.pass_seconds(n, attention_pairs(n), 1)


class BatchOfOne(Policy):
    def prices(self, context):
        return (self.cost_model.swap_seconds(context.num_host_blocks, context.block_bytes),
                self.cost_model.recompute_seconds(context.num_tokens))


class SwapPricedByEveryBlock(Policy):  # blocks already on the host priced as moving again
    def prices(self, context):
        return (self.cost_model.swap_seconds(context.num_blocks, context.block_bytes),
                self.cost_model.recompute_seconds(context.num_tokens, context.batch_tokens))


class RoomForEveryBlock(Policy):
    def choose_mode(self, victim, context):
        if context.host_free_blocks < context.num_blocks:
            return "recompute"
        swap, recompute = self.prices(context)
        return "swap" if swap < recompute else "recompute"


class LeavesHostRoomToTheEngine(Policy):
    def choose_mode(self, victim, context):
        swap, recompute = self.prices(context)
        return "swap" if swap < recompute else "recompute"


class Inverted(Policy):
    def choose_mode(self, victim, context):
        return "recompute" if super().choose_mode(victim, context) == "swap" else "swap"


def skewed(factor):
    class Skewed(Policy):  # recompute priced a little off, as a learner's own formula might round it
        def prices(self, context):
            swap, recompute = super().prices(context)
            return swap, recompute * factor
    Skewed.__name__ = f"Skewed{factor}"
    return Skewed


class NoSpareBlock(Policy):
    def choose_mode(self, victim, context):
        if context.host_free_blocks <= context.num_host_blocks:
            return "recompute"
        swap, recompute = self.prices(context)
        return "swap" if swap < recompute else "recompute"


CHOICE = {"choose_mode/cheaper_wins", "choose_mode/tie_recomputes", "choose_mode/in_the_batch",
          "choose_mode/host_room", "choose_mode/priced_by_what_moves"}
ENGINE = {"engine/fast_link_swaps", "engine/weight_reads_hide_recompute", "engine/small_host_pool"}


@pytest.mark.parametrize("policy, failed", [
    (Policy, set()),
    (skewed(0.98), set()),  # every victim but the ties is far from its crossover
    (skewed(1.02), {"choose_mode/tie_recomputes"}),
    (TieSwaps, {"choose_mode/tie_recomputes"}),
    (SwapPricedByEveryBlock, {"choose_mode/priced_by_what_moves"}),
    (OwnPass, {"choose_mode/cheaper_wins", "choose_mode/tie_recomputes", "choose_mode/in_the_batch",
               "choose_mode/priced_by_what_moves"}),
    (BatchOfOne, {"choose_mode/in_the_batch"}),
    (RoomForEveryBlock, {"choose_mode/host_room"}),
    (NoSpareBlock, {"choose_mode/host_room"}),
    (LeavesHostRoomToTheEngine, {"choose_mode/host_room"}),
    (Inverted, CHOICE),
], ids=lambda p: getattr(p, "__name__", ""))
def test_choice_a_bug_costs_exactly_its_checks(policy, failed):
    assert lost([lab08.choose_mode], policy) == failed


@pytest.mark.parametrize("policy, failed", [
    (Policy, set()),
    (OwnPass, {"engine/weight_reads_hide_recompute"}),
    (LeavesHostRoomToTheEngine, {"engine/small_host_pool"}),
    (Inverted, ENGINE),
], ids=lambda p: getattr(p, "__name__", ""))
def test_engine_a_bug_costs_exactly_its_checks(policy, failed):
    assert lost([lab08.engine], policy, seeds=(0,)) == failed


class AsksKvlib(Policy):
    def choose_mode(self, victim, context):
        if context.host_free_blocks < context.num_host_blocks:
            return "recompute"
        return self.cost_model.choose(context.num_host_blocks, context.block_bytes, context.num_tokens,
                                      context.batch_tokens)


class CallsTheDefault(Policy):
    def choose_mode(self, victim, context):
        if context.host_free_blocks < context.num_host_blocks:
            return "recompute"
        return LatestArrivalPolicy.choose_mode(self, victim, context)


@pytest.mark.parametrize("policy", [AsksKvlib, CallsTheDefault, LatestArrivalPolicy], ids=lambda p: p.__name__)
def test_kvlibs_own_choice_is_not_there_while_the_choice_is_graded(policy):
    assert {r.status for r in lab08.choose_mode.verdicts(policy, 0)} == {NOT_IMPLEMENTED}
    cost = PreemptionCostModel(1e9, 1e3)
    assert cost.choose(1, 1024, 16) == "swap" and cost.recompute_range(16, 1024) is None  # restored after


def test_the_ties_are_exact_and_the_other_victims_are_not_close():
    for seed in range(50):
        priced, c = lab08._tie(random.Random(seed))
        assert priced.cost.swap_seconds(c.num_host_blocks, c.block_bytes) == priced.cost.recompute_seconds(
            c.num_tokens, c.batch_tokens)
    modes = set()
    for priced, low, high in lab08.CHEAPER:
        for tokens in range(low, high + 1):
            c = lab08._context(priced, tokens)
            swap = priced.cost.swap_seconds(c.num_host_blocks, c.block_bytes)
            recompute = priced.cost.recompute_seconds(c.num_tokens, c.batch_tokens)
            assert max(swap, recompute) / min(swap, recompute) > 1.2, (priced.name, tokens)
            modes.add(swap < recompute)
    assert modes == {True, False}


def test_every_check_observes_inputs_drawn_from_the_seed():
    for task in lab08.TASKS[:4]:
        for check in task.checks:
            first, second = (observe(check, task.reference(), seed).observation for seed in (0, 1))
            assert first != second, f"{task.name}/{check.name}"


# ---- whole notebooks, as `kvlib grade` grades them ---------------------------------------------
def _graded(cells) -> dict:
    return {t.task: t for t in grade_cells("lab08", cells, runner=InProcess, seed=11).tasks}


def test_the_solution_gets_full_marks_and_no_flag():
    graded = grade_cells("lab08", graded_cells(SOLUTION), runner=InProcess, seed=11)
    assert all(t.full_marks for t in graded.tasks), graded.tasks
    assert [(t.task, t.points) for t in graded.tasks] == [
        ("measure", 3), ("fit_swap", 3), ("fit_recompute", 5), ("choose_mode", 6), ("engine", 5)]
    assert graded.flags == []


def test_the_untouched_lab_gets_zero_and_says_not_implemented():
    graded = _graded(graded_cells(LAB))
    assert sum(t.points for t in graded.values()) == 0
    assert {c.status for t in graded.values() for c in t.checks} == {NOT_IMPLEMENTED}


KVLIBS_TIMING = ("def best_in_turns(fns, rounds, clock):\n",  # (in this process a module's name is looked up
                 "from kvlib.runner import cost_probe\n\n\ndef best_in_turns(fns, rounds, clock):\n"  # when called)
                 "    return cost_probe.best_in_turns(fns, None, rounds)\n\n\ndef unused(fns, rounds, clock):\n")
KVLIBS_FIT = ("    n, seconds = np.asarray(block_counts, dtype=float), np.asarray(round_trip_seconds, dtype=float)\n",
              "    from kvlib.runner.cost_probe import fit_copy as kvlibs\n"
              "    return kvlibs(round_trip_seconds[0] / 2, round_trip_seconds[-1] / 2, block_counts[-1], block_bytes)\n")
KVLIBS_CHOICE = ('        return "swap" if swap < recompute else "recompute"\n',
                 "        return cost.choose(context.num_host_blocks, context.block_bytes, context.num_tokens,\n"
                 "                           context.batch_tokens)\n")


@pytest.mark.parametrize("edit, tasks", [(KVLIBS_TIMING, {"measure"}), (KVLIBS_FIT, {"fit_swap"}),
                                         (KVLIBS_CHOICE, {"choose_mode", "engine"})], ids=["timing", "fit", "choice"])
def test_a_task_handed_to_kvlibs_own_code_is_not_implemented_and_the_others_score(edit, tasks):
    graded = _graded(graded_cells(SOLUTION, [edit]))
    assert {c.status for name in tasks for c in graded[name].checks} == {NOT_IMPLEMENTED}
    assert all(t.full_marks for name, t in graded.items() if name not in tasks)


def test_a_lab_with_one_part_written_scores_that_part_alone():
    written = next(c.source for c in nbformat.read(SOLUTION, as_version=4).cells if "def fit_copy" in c.source)
    cells = [written if "def fit_copy" in c.source else c.source
             for c in nbformat.read(LAB, as_version=4).cells if c.cell_type == "code"]
    graded = _graded(cells)
    assert graded["fit_swap"].full_marks and graded["fit_recompute"].full_marks
    assert {c.status for name in ("measure", "choose_mode", "engine") for c in graded[name].checks} == {NOT_IMPLEMENTED}
