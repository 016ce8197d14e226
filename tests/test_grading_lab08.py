"""Lab 08 grading: correct pieces get full marks, a bug costs exactly its checks, kvlib's own choice scores zero.

The pieces are graded in this process (fast): timing, the two fits and the policy, each correct one
next to its realistic bugs. Notebooks are graded the way ``kvlib grade`` runs them: the solution,
the untouched lab, and copies that hand a task to kvlib's own implementation.
"""
from __future__ import annotations

import math
from pathlib import Path

import nbformat
import numpy as np
import pytest

from kvlib.cost_model import PreemptionCostModel, attention_pairs
from kvlib.course.grading import grade_notebook, lab08
from kvlib.course.grading.results import FAIL, NOT_ALLOWED, NOT_IMPLEMENTED
from kvlib.course.grading.runner import grade_cells
from kvlib.course.grading.sandbox import InProcess
from kvlib.course.labs import remove_hidden_tests
from kvlib.preemption import LatestArrivalPolicy

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab08_cost_model.ipynb"
LAB = ROOT / "labs" / "lab08_cost_model.ipynb"


def failed(*results) -> set[str]:
    assert all(c.status == FAIL and c.hint and c.message for r in results for c in r.failed)
    return {f"{r.task}/{c.name}" for r in results for c in r.failed}


def messages(*results) -> dict[str, str]:
    return {f"{r.task}/{c.name}": c.message for r in results for c in r.failed}


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


@pytest.mark.parametrize("piece, lost", [
    (best_in_turns, set()),
    (no_warm_up, set()),  # a warm-up is good practice, but with the least time kept it changes no answer here
    (mean_of_rounds, {"measure/keeps_the_best", "measure/in_turns"}),
    (one_after_another, {"measure/in_turns"}),
    (too_few_rounds, {"measure/keeps_the_best", "measure/in_turns"}),  # two rounds cannot outlast a burst
    (wall_clock, {"measure/keeps_the_best", "measure/in_turns"}),
], ids=lambda p: getattr(p, "__name__", ""))
def test_timing_a_bug_costs_exactly_its_checks(piece, lost):
    assert failed(lab08.check_measure(piece)) == lost


def test_timing_one_function_after_another_shows_the_order_the_calls_ran_in():
    message = messages(lab08.check_measure(one_after_another))["measure/in_turns"]
    assert "in the order 00000001111111" in message and "returned 6 ms" in message


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


@pytest.mark.parametrize("piece, lost", [
    (fit_copy, set()),
    (two_points, set()),
    (through_origin, {"fit_swap/host_link", "fit_swap/copy_call"}),
    (one_copy, {"fit_swap/host_link", "fit_swap/copy_call"}),
    (blocks_per_second, {"fit_swap/host_link"}),
], ids=lambda p: getattr(p, "__name__", ""))
def test_copy_fit_a_bug_costs_exactly_its_checks(piece, lost):
    assert failed(lab08.check_fit_swap(piece)) == lost


def test_a_wrong_copy_term_is_named_with_the_mistake_it_matches():
    found = messages(lab08.check_fit_swap(through_origin))
    assert found["fit_swap/host_link"].startswith("host_link_bytes_per_s: got 5.514e+09, expected 8e+09 bytes/s")
    assert "is what a line through the origin" in found["fit_swap/host_link"]
    found = messages(lab08.check_fit_swap(one_copy))
    assert "a round trip taken for one crossing of the link" in found["fit_swap/host_link"]
    assert "a round trip taken for one copy call" in found["fit_swap/copy_call"]
    assert "blocks per second" in messages(lab08.check_fit_swap(blocks_per_second))["fit_swap/host_link"]


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


FORWARD = {"fit_recompute/prefill_speed", "fit_recompute/attention_per_pair", "fit_recompute/attention_call",
           "fit_recompute/floor"}


@pytest.mark.parametrize("piece, lost", [
    (fit_forward, set()),
    (first_three, set()),
    (per_pass, {"fit_recompute/prefill_speed"}),
    (without_floor, {"fit_recompute/floor"}),
    (floor_is_the_pass, {"fit_recompute/floor"}),
    (not_subtracted, {"fit_recompute/attention_call"}),
    (without_attention, FORWARD),
    (missing_key, {"fit_recompute/attention_call"}),
], ids=lambda p: getattr(p, "__name__", ""))
def test_forward_fit_a_bug_costs_exactly_its_checks(piece, lost):
    assert failed(lab08.check_fit_recompute(piece)) == lost


def test_a_wrong_forward_term_is_named_with_the_mistake_it_matches():
    assert "a whole pass divided by its tokens" in messages(lab08.check_fit_recompute(per_pass))[
        "fit_recompute/prefill_speed"]
    assert messages(lab08.check_fit_recompute(without_floor))["fit_recompute/floor"].startswith(
        "floor_seconds: got 0, expected 0.0032 s")
    assert "its tokens' arithmetic included" in messages(lab08.check_fit_recompute(floor_is_the_pass))[
        "fit_recompute/floor"]
    assert "the batch alone not subtracted" in messages(lab08.check_fit_recompute(not_subtracted))[
        "fit_recompute/attention_call"]
    found = messages(lab08.check_fit_recompute(without_attention))
    assert all("a fit that leaves attention out" in found[f"fit_recompute/{name}"]
               for name in ("prefill_speed", "attention_per_pair", "attention_call"))
    assert "expected a dict with the keys" in messages(lab08.check_fit_recompute(missing_key))[
        "fit_recompute/attention_call"]


def test_the_fit_machines_give_the_terms_they_were_made_from():
    for machine in lab08.FORWARD_MACHINES:
        terms = fit_forward(machine.batch_tokens, machine.alone, list(machine.victim_tokens), machine.with_victim)
        assert all(math.isclose(terms[t], getattr(machine, t), rel_tol=1e-9) for t in lab08.FORWARD_TERMS)


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


class SwapPricedByEveryBlock(Policy):  # blocks already on the host priced as moving again: no answer changes
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


CHOICE = {"choose_mode/cheaper_wins", "choose_mode/tie_recomputes", "choose_mode/in_the_batch",
          "choose_mode/host_room"}
ENGINE = {"engine/fast_link_swaps", "engine/weight_reads_hide_recompute", "engine/small_host_pool"}


@pytest.mark.parametrize("policy, lost", [
    (Policy, set()),
    (SwapPricedByEveryBlock, set()),
    (skewed(0.98), set()),  # every context but the tie is far from its crossover
    (skewed(1.02), {"choose_mode/tie_recomputes"}),
    (TieSwaps, {"choose_mode/tie_recomputes"}),
    (OwnPass, {"choose_mode/cheaper_wins", "choose_mode/tie_recomputes", "choose_mode/in_the_batch",
               "engine/weight_reads_hide_recompute"}),
    (BatchOfOne, {"choose_mode/in_the_batch"}),
    (RoomForEveryBlock, {"choose_mode/host_room"}),
    (LeavesHostRoomToTheEngine, {"choose_mode/host_room", "engine/small_host_pool"}),
    (Inverted, CHOICE | ENGINE),
], ids=lambda p: getattr(p, "__name__", ""))
def test_choice_a_bug_costs_exactly_its_checks(policy, lost):
    assert failed(lab08.check_choose_mode(policy), lab08.check_engine(policy)) == lost


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
def test_kvlibs_own_choice_refuses_to_answer_while_the_choice_is_graded(policy):
    results = lab08.check_choose_mode(policy), lab08.check_engine(policy)
    assert failed(*results) == CHOICE | ENGINE
    assert all("called PreemptionCostModel.choose" in m for m in messages(*results).values())
    cost = PreemptionCostModel(1e9, 1e3)
    assert cost.choose(1, 1024, 16) == "swap" and cost.recompute_range(16, 1024) is None  # restored after


def test_the_tie_is_exact_and_the_other_contexts_are_not_close():
    toy = lab08.TOY
    assert toy.cost.swap_seconds(2, toy.block_bytes) == toy.cost.recompute_seconds(8, 1) == 2.8125
    for tokens in (16, 64, 256, 2048, 4096):
        c = lab08._context(lab08.EAGER_GPU, tokens)
        swap = lab08.EAGER_GPU.cost.swap_seconds(c.num_host_blocks, c.block_bytes)
        recompute = lab08.EAGER_GPU.cost.recompute_seconds(c.num_tokens, c.batch_tokens)
        assert max(swap, recompute) / min(swap, recompute) > 1.2, tokens


# ---- whole notebooks, as `kvlib grade` runs them -----------------------------------------------
def test_the_solution_gets_full_marks():
    report = grade_notebook(SOLUTION)
    assert report.full_marks, report.table()
    assert [(t.task, t.points) for t in report.tasks] == [
        ("measure", 2), ("fit_swap", 3), ("fit_recompute", 5), ("choose_mode", 5), ("engine", 5)]


def test_the_untouched_lab_gets_zero_and_says_not_implemented():
    report = grade_notebook(LAB)
    assert (report.points, report.max_points) == (0, 20), report.table()
    for task, stub in [("measure", "best_in_turns"), ("fit_swap", "fit_copy"), ("fit_recompute", "fit_forward"),
                       ("choose_mode", "MyCostPolicy.choose_mode"), ("engine", "MyCostPolicy.choose_mode")]:
        assert report.task(task).failed_summary() == f"not implemented: {stub}", report.table()


def _cells(edits) -> list[str]:
    cells = [remove_hidden_tests(c.source) for c in nbformat.read(SOLUTION, as_version=4).cells
             if c.cell_type == "code"]
    for old, new in edits:
        [i] = [i for i, source in enumerate(cells) if old in source]
        cells[i] = cells[i].replace(old, new)
    return cells


KVLIBS_TIMING = ("def best_in_turns(fns, rounds, clock):\n",
                 "from kvlib.cost_probe import best_in_turns as timed\n\n\ndef best_in_turns(fns, rounds, clock):\n"
                 "    return timed(fns, None, rounds)\n\n\ndef unused(fns, rounds, clock):\n")
KVLIBS_FIT = ("    n, seconds = np.asarray(block_counts, dtype=float), np.asarray(round_trip_seconds, dtype=float)\n",
              "    from kvlib.cost_probe import fit_copy as kvlibs\n"
              "    n, seconds = np.asarray(block_counts, dtype=float), np.asarray(round_trip_seconds, dtype=float)\n")
KVLIBS_CHOICE = ('        return "swap" if swap < recompute else "recompute"\n',
                 "        return cost.choose(context.num_host_blocks, context.block_bytes, context.num_tokens,\n"
                 "                           context.batch_tokens)\n")


@pytest.mark.parametrize("edit, task", [(KVLIBS_TIMING, "measure"), (KVLIBS_FIT, "fit_swap")],
                         ids=["timing", "fit"])
def test_a_task_handed_to_kvlibs_own_code_scores_zero_and_the_others_do_not(edit, task):
    results = {r.task: r for r in grade_cells("lab08", _cells([edit]), runner=InProcess)}
    assert {c.status for c in results[task].checks} == {NOT_ALLOWED}
    assert "kvlib.cost_probe" in results[task].checks[0].message
    assert all(r.full_marks for name, r in results.items() if name != task)


def test_a_choice_handed_to_kvlib_scores_zero_for_the_choice_and_the_engine():
    results = {r.task: r for r in grade_cells("lab08", _cells([KVLIBS_CHOICE]), runner=InProcess)}
    assert results["choose_mode"].points == results["engine"].points == 0
    assert all(r.full_marks for name, r in results.items() if name not in ("choose_mode", "engine"))


def test_a_lab_with_one_part_written_scores_that_part_alone():
    written = next(c.source for c in nbformat.read(SOLUTION, as_version=4).cells if "def fit_copy" in c.source)
    cells = [written if "def fit_copy" in c.source else c.source
             for c in nbformat.read(LAB, as_version=4).cells if c.cell_type == "code"]
    results = {r.task: r for r in grade_cells("lab08", cells, runner=InProcess)}
    assert results["fit_swap"].full_marks and results["fit_recompute"].full_marks
    stubbed = ("measure", "choose_mode", "engine")
    assert {c.status for name in stubbed for c in results[name].checks} == {NOT_IMPLEMENTED}
