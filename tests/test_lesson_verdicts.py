"""Lessons 04, 06, 07, 08 and 09: every verdict they print follows from their measurements, and holds on a second run.

Lessons 07 and 09 keep what they conclude in ``verdicts`` and what they measured in ``evidence``. The
test runs each lesson, reads both back, and recomputes every verdict from the evidence on its own, so
a verdict typed by hand, or computed the wrong way round, fails whatever this machine measured.

Each of these lessons times what it compares, so each runs twice (nbval skips them, see
notebooks/conftest.py): the second run must print the same verdicts, sentence by sentence (which
branch every ``kvlib.course.verdicts.verdict`` took) and winner by winner (the ``verdicts`` tables,
their numbers aside). A verdict that one run decides and the other calls too close is a claim the
lesson cannot keep. The second run has every exercise filled in with the answer the lesson shows
(tests/test_exercises.py's convention), and each must pass its check there: one run of the lesson
serves both, so the suite does not run these slow lessons a third time.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import fields, replace
from pathlib import Path

import nbformat
import pytest
from test_exercises import exercises, fill_in, missed

from kvlib.core.cost_model import PreemptionCostModel, attention_pairs
from kvlib.course import measured_runs as mr
from kvlib.course.gpu_profiles import load_profiles
from kvlib.course.grading.execute import execute
from kvlib.course.model_against_run import profile_for, run_shape
from kvlib.course.timing import TOO_CLOSE, decide, median_interval, settled

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
STATE = "LESSON-STATE "
DUMP = ("import json\nfrom kvlib.course.verdicts import recorded as recorded_verdicts\n"
        f"print({STATE!r} + json.dumps({{'verdicts': globals().get('verdicts', {{}}), "
        "'evidence': globals().get('evidence', {}), "
        "'holds': [[r['rule'], r['holds']] for r in recorded_verdicts()]}, default=str))")
BLOCK, LIMIT_07, NEW_TOKENS_09 = 16, 1 << 15, 40
LESSON_06 = "06_preemption_swap_recompute.ipynb"
LESSON_07 = "07_choosing_swap_or_recompute.ipynb"
LESSON_09 = "09_serving_long_contexts.ipynb"


def run_state(name: str, with_answers: bool = False) -> dict:
    """What the lesson concluded and measured, each verdict's rule and branch, and all it printed, after one run.

    ``with_answers`` fills every exercise with its shown answer first; ``"exercises missed"`` lists
    the exercises whose check did not pass with it.
    """
    path = NOTEBOOKS / name
    nb = nbformat.read(path, as_version=4)
    found = exercises(nb, name) if with_answers else []
    for exercise in found:
        nb.cells[exercise.cell].source = fill_in(nb.cells[exercise.cell].source, exercise.answer)
    nb.cells.append(nbformat.v4.new_code_cell(DUMP))
    execute(nb, path.parent, allow_errors=False)
    printed = "\n".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs)
    state = json.loads(printed.split(STATE, 1)[1].splitlines()[0])
    return {**state, "printed": printed, "exercises": len(found), "exercises missed": missed(nb, found)}


def run_twice(name: str) -> tuple[dict, dict]:
    """A plain run, then one with every exercise answered as the lesson shows."""
    return run_state(name), run_state(name, with_answers=True)


def as_tuple(state: dict) -> tuple[dict, dict, str]:
    """``(verdicts, evidence, everything the lesson printed)``, as the checks of one run read them."""
    return state["verdicts"], state["evidence"], state["printed"]


def winners(value):
    """A verdicts table with its numbers blanked: the labels, booleans and gaps that must not change between runs."""
    if isinstance(value, dict):
        return {key: winners(v) for key, v in value.items()}
    if isinstance(value, list):
        return [winners(v) for v in value]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "a number"
    return value


def assert_same_verdicts(first: dict, second: dict) -> None:
    flipped = [(rule, a, b) for (rule, a), (_, b) in zip(first["holds"], second["holds"]) if a != b]
    assert not flipped, f"verdicts that took the other branch on the second run (rule, first, second): {flipped}"
    assert len(first["holds"]) == len(second["holds"]), "the two runs printed different numbers of verdicts"
    one, two = winners(first["verdicts"]), winners(second["verdicts"])
    assert one.keys() == two.keys()
    changed = {key: (one[key], two[key]) for key in one if one[key] != two[key]}
    assert not changed, f"verdicts tables that changed on the second run (first, second): {changed}"


def test_a_number_may_change_between_runs_and_a_winner_may_not():
    first = {"holds": [["a < b", True]], "verdicts": {"cheaper": {"16": "swap"}, "ratio": 3.1, "range": [16, 208]}}
    assert_same_verdicts(first, {**first, "verdicts": {**first["verdicts"], "ratio": 2.7, "range": [16, 190]}})
    for second in ({**first, "holds": [["a < b", False]]},
                   {**first, "verdicts": {**first["verdicts"], "cheaper": {"16": "too close to call"}}},
                   {**first, "verdicts": {**first["verdicts"], "range": None}}):
        with pytest.raises(AssertionError):
            assert_same_verdicts(first, second)


def cost_of(entry: dict) -> PreemptionCostModel:
    return PreemptionCostModel(**entry["cost_model"])


def cheaper(swap: float, recompute: float) -> str:
    return "swap" if swap < recompute else "recompute"


def printed_line(printed: str, starts: str) -> str:
    lines = [line for line in printed.splitlines() if line.startswith(starts)]
    assert lines, f"no printed line starts with {starts!r}"
    return lines[0]


def between(rounds: dict, swap: str, recompute: str) -> str:
    """The cheaper option where the paired rounds decide it, as the lesson names it."""
    return decide({"swap": rounds[swap], "recompute": rounds[recompute]}) or "too close to call"


def returning_prices(cost: PreemptionCostModel, context: int, block_bytes: int) -> tuple[float, float]:
    total = context + NEW_TOKENS_09
    recompute = cost.pass_seconds(total, attention_pairs(total), 1)
    host = (cost.swap_seconds(context // BLOCK, block_bytes)
            + cost.pass_seconds(NEW_TOKENS_09, attention_pairs(NEW_TOKENS_09, context), 1))
    return recompute, host


def walk_through(evidence: dict) -> dict:
    return {(r["mode"], r["length"]): r for r in evidence["walk-through"]}


class LessonRuns:
    """A timed lesson run twice (the second time with every exercise answered): its verdicts must not change.

    Each lesson is a class, so the suite's workers (``--dist loadscope``) run the lessons side by side."""

    NAME: str
    MIN_EXERCISES: int
    MIN_VERDICTS: int = 1

    @pytest.fixture(scope="class")
    def runs(self) -> tuple[dict, dict]:
        return run_twice(self.NAME)

    def test_verdicts_hold_on_a_second_run(self, runs):
        assert len(runs[0]["holds"]) >= self.MIN_VERDICTS
        assert_same_verdicts(*runs)

    def test_exercises_pass_with_the_answers_shown(self, runs):
        answered = runs[1]
        assert answered["exercises"] >= self.MIN_EXERCISES and not answered["exercises missed"], \
            answered["exercises missed"]


class TestLesson04(LessonRuns):
    """The knobs' table: a verdict on a time names a winner only where three paired runs settle it."""
    NAME, MIN_EXERCISES, MIN_VERDICTS = "04_engine_loop.ipynb", 2, 10


class TestLesson06(LessonRuns):
    NAME, MIN_EXERCISES, MIN_VERDICTS = LESSON_06, 1, 8


class TestLesson08(LessonRuns):
    """Four remedies for one workload, each served three times in turns: its verdicts on times are paired."""
    NAME, MIN_EXERCISES, MIN_VERDICTS = "08_preemption_metrics.ipynb", 1, 6


class TestLesson07(LessonRuns):
    NAME, MIN_EXERCISES = LESSON_07, 3

    @pytest.fixture(scope="class")
    def lesson07(self, runs):
        return as_tuple(runs[0])

    def test_the_measured_winner_is_decided_by_the_paired_rounds(self, lesson07):
        verdicts, evidence, _ = lesson07
        victims = evidence["this machine"]["victims"]
        assert verdicts["measured cheaper"] == {
            str(v["num_tokens"]): between(v["rounds"], f"{v['num_tokens']}: step, then swap",
                                          f"{v['num_tokens']}: step with the recompute") for v in victims}
        for v in victims:
            assert v["recompute_seconds"] is None or v["recompute_seconds"] > 0, "a measured cost is never negative"

    def test_the_model_winner_is_the_measured_models_choice(self, lesson07):
        verdicts, evidence, printed = lesson07
        here, batch = evidence["this machine"], evidence["this machine"]["batch"]
        cost = cost_of(here)
        model = {str(v["num_tokens"]): cost.choose(v["num_blocks"], here["block_bytes"], v["num_tokens"], batch)
                 for v in here["victims"]}
        assert verdicts["model cheaper"] == model
        assert verdicts["model agrees with measurement"] == (model == verdicts["measured cheaper"])
        same = sum(model[n] == verdicts["measured cheaper"][n] for n in model)
        assert f"it picks the measured winner at {same} of {len(model)} lengths" in printed

    def test_the_assumption_a_recorded_gpu_run_contradicts_is_named_from_its_victims(self, lesson07):
        """Every recorded run on a profiled GPU: how many of its measured winners the modelled line picks, and the
        terms that, measured alone, make it pick them all, worked out here term by term."""
        verdicts, _, printed = lesson07
        profiles, assumptions = load_profiles()
        expected_picks, expected_terms = {}, {}
        for run in mr.load_runs():
            profile, shape = profile_for(run, profiles), run_shape(run)
            if profile is None or shape is None:
                continue
            decided = [v for v in run.victims if mr.way(v) in ("swap", "recompute")]

            def agreed(cost: PreemptionCostModel) -> int:
                return sum(cost.choose(v.num_blocks, run.block_bytes, v.num_tokens, run.batch)
                           == mr.way(v) for v in decided)
            modelled, label = profile.cost_model(shape, assumptions), mr.run_label(run)
            expected_picks[label] = [agreed(modelled), len(decided)]
            expected_terms[label] = [
                f.name for f in fields(PreemptionCostModel)
                if agreed(replace(modelled, **{f.name: getattr(run.cost_model, f.name)})) == len(decided)
                > agreed(modelled)]
        assert expected_picks, "the recorded runs include runs on a profiled GPU"
        assert verdicts["modelled picks"] == expected_picks
        assert verdicts["deciding terms"] == expected_terms
        for label, (agreed_here, total) in expected_picks.items():
            assert f"against {label}: the modelled line picks {agreed_here} of {total} measured winners" in printed

    def test_each_machines_recompute_range_and_its_sentence(self, lesson07):
        verdicts, evidence, printed = lesson07
        for machine, entry in evidence["machines"].items():
            cost, batch = cost_of(entry), evidence["this machine"]["batch"]
            recomputed = [b * BLOCK for b in range(1, LIMIT_07 // BLOCK + 1)
                          if cost.choose(b, entry["block_bytes"], b * BLOCK, batch) == "recompute"]
            expected = [recomputed[0], recomputed[-1]] if recomputed else None
            assert verdicts["recompute range"][machine] == expected, machine
            line = printed_line(printed, f"{machine}: ")
            if expected is None:
                assert "swap is cheaper for every victim" in line
            elif expected[1] < LIMIT_07:
                assert f"recompute from {expected[0]:,} to {expected[1]:,} tokens, swap beyond" in line

    def test_auto_did_what_its_prices_predicted(self, lesson07):
        verdicts, _, printed = lesson07
        for label, run in verdicts["auto"].items():
            assert run["swapped"] + run["recomputed"] == run["preemptions"] > 0
            if run["predicted"] == "swap":
                assert run["recomputed"] == run["fallbacks"], label
            elif run["predicted"] == "recompute":
                assert run["swapped"] == 0, label
            chose_recompute = run["recomputed"] - run["fallbacks"]
            chose_swap = run["swapped"] + run["fallbacks"]
            assert f"{label}: auto chose swap {chose_swap} times and recompute {chose_recompute} times" in printed

    def test_mistakes_conclude_from_their_paired_rounds(self, lesson07):
        verdicts, evidence, _ = lesson07
        copies = evidence["block by block"]
        for way in ("block by block", "batched"):
            assert verdicts[f"{way} against recompute"] == {
                str(b): between(copies["rounds"], f"{b}: {way}", "step with the recompute") for b in copies["block sizes"]}
        own = evidence["own pass"]
        expected = {str(n): decide({way: own["rounds"][f"{n}: {way}"] for way in ("in the batch", "a pass of its own")})
                    or "too close to call" for n in own["lengths"]}
        assert verdicts["own pass cheaper step"] == expected
        assert verdicts["own pass overcharges here"] == all(v == "in the batch" for v in expected.values())
        rounds, lengths = evidence["per token"]["rounds"], evidence["per token"]["lengths"]
        per_token = {n: [(w - a) / n for w, a in zip(rounds[str(n)], rounds["step alone"])] for n in lengths}
        cheapest = min(lengths, key=lambda n: statistics.median(per_token[n]))
        longest = lengths[-1]
        assert verdicts["per-token recompute grows"] == (
            longest != cheapest and decide({"cheapest": per_token[cheapest], "other": per_token[longest]}) == "cheapest")
        shortest = lengths[0]
        assert verdicts["per-token recompute falls first"] == (
            shortest != cheapest and decide({"cheapest": per_token[cheapest], "other": per_token[shortest]}) == "cheapest")
        low = 1e6 * median_interval(per_token[longest])[0]
        assert verdicts["without attention undercharges the longest"] == (
            evidence["per token"]["without attention us/token"] < low)


class TestLesson09(LessonRuns):
    NAME, MIN_EXERCISES, MIN_VERDICTS = LESSON_09, 2, 0  # its verdicts are tables, checked one by one below

    @pytest.fixture(scope="class")
    def lesson09(self, runs):
        return as_tuple(runs[0])

    def test_the_cheaper_returning_turn_timed_in_the_engine_and_by_the_model(self, lesson09):
        verdicts, evidence, printed = lesson09
        assert verdicts["timed cheaper"] == {str(t["context"]): decide(t["rounds"]) or TOO_CLOSE
                                             for t in evidence["returning"]}
        assert all(len(t["rounds"]["recompute"]) >= 7 for t in evidence["returning"])  # paired rounds, not one timing
        runs = walk_through(evidence)
        lengths = sorted({n for _, n in runs})
        assert verdicts["engine cheaper"] == {
            str(n): settled([r / h for r, h in zip(runs["no prefix caching", n]["ttfts"], runs["host tier", n]["ttfts"])],
                               "copy back", "recompute") for n in lengths}
        here = evidence["this machine"]
        model = {str(n): "copy back" if returning_prices(cost_of(here), n, here["block_bytes"])[1]
                 < returning_prices(cost_of(here), n, here["block_bytes"])[0] else "recompute" for n in lengths}
        assert verdicts["model cheaper"] == model
        for label in ("model", "timed", "engine"):
            assert printed_line(printed, f"{label:6s} cheaper: ") == f"{label:6s} cheaper: " + ", ".join(
                f"{n}: {v}" for n, v in verdicts[f"{label} cheaper"].items())

    def test_each_machines_crossover_and_its_sentence(self, lesson09):
        verdicts, evidence, printed = lesson09
        for machine, entry in evidence["machines"].items():
            cost = cost_of(entry)
            prices = {c: returning_prices(cost, c, entry["block_bytes"]) for c in range(BLOCK, entry["limit"] + 1, BLOCK)}
            found = [c for c, (recompute, host) in prices.items() if host < recompute]
            if found:
                assert found == list(range(found[0], entry["limit"] + 1, BLOCK)), f"{machine}: the curves cross twice"
            expected = found[0] if found else None
            assert verdicts["crossover"][machine] == expected, machine
            line = printed_line(printed, f"{machine}: ")
            if expected is None:
                assert "recomputing is cheaper at every context" in line
            elif expected > BLOCK:
                assert f"recomputing is cheaper below {expected:,} tokens of context" in line

    def test_walk_through_verdicts_follow_from_its_table(self, lesson09):
        verdicts, evidence, _ = lesson09
        runs = walk_through(evidence)
        lengths = sorted({n for _, n in runs})
        device_only = [runs["device-only prefix cache", n] for n in lengths]
        assert verdicts["device-only found nothing"] == all(r["recomputed"] == r["context"] for r in device_only)
        assert verdicts["host tier copied every full block"] == all(
            runs["host tier", n]["copied back"] == runs["host tier", n]["context"] // BLOCK * BLOCK for n in lengths)
        growth = {name: [b / a for a, b in zip(runs[name, lengths[0]]["ttfts"], runs[name, lengths[-1]]["ttfts"])]
                  for name in ("no prefix caching", "host tier")}
        assert verdicts["growth"] == settled(
            [r / t for r, t in zip(growth["no prefix caching"], growth["host tier"])], "faster", "slower")

    def test_mistakes_conclude_from_their_tables(self, lesson09):
        verdicts, evidence, printed = lesson09
        for row in evidence["tier sizes"]:
            keys = ("block 0 on host", "copied back", "recomputed")
            assert verdicts["tier sizes"][str(row["host blocks"])] == {key: row[key] for key in keys}
            line = printed_line(printed, f"a tier of {row['host blocks']} blocks: ")
            assert ("found nothing" in line) == (row["copied back"] == 0)
        tier = next(r for r in evidence["one-off traffic"] if r["mode"] == "host tier")
        assert verdicts["tier only cost"] == (tier["host hit tokens"] == 0 and tier["blocks copied"] > 0)
        winner = decide(evidence["one-off rounds"])
        assert verdicts["tier made one-off traffic slower"] == {
            "device-only prefix cache": "yes", "host tier": "no"}.get(winner, TOO_CLOSE)
        assert len(evidence["one-off rounds"]["host tier"]) >= 7
        assert printed_line(printed, "traffic that never returns, slower with the tier here: ").endswith(
            verdicts["tier made one-off traffic slower"])

    def test_the_view_follows_the_conversation_to_the_host_and_back(self, lesson09):
        verdicts, evidence, printed = lesson09
        journey = evidence["view journey"]
        assert all(journey.values()), f"the view did not show every stage its text names: {journey}"
        held, cached, host = journey["held"], journey["cached on the device"], journey["on the host only"]
        assert held[0] < cached[0] < host[0] < held[-1]  # held, kept by the cache, on the host, held again
        assert verdicts["view journey"] == {stage: bool(steps) for stage, steps in journey.items()}
