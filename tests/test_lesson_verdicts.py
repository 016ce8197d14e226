"""Lessons 07 and 09: every verdict their text prints follows from the measurements it summarises.

Each lesson keeps what it concludes in ``verdicts`` and what it measured in ``evidence``. The test
runs the lesson, reads both back, and recomputes every verdict from the evidence on its own, so a
verdict typed by hand, or computed the wrong way round, fails whatever this machine measured.
"""
from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from kvlib.cost_model import PreemptionCostModel, attention_pairs
from kvlib.course.grading.execute import execute

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
STATE = "LESSON-STATE "
DUMP = f'import json\nprint({STATE!r} + json.dumps({{"verdicts": verdicts, "evidence": evidence}}, default=str))'
BLOCK, LIMIT_07, NEW_TOKENS_09 = 16, 1 << 15, 40


def run_lesson(name: str) -> tuple[dict, dict, str]:
    """``(verdicts, evidence, everything the lesson printed)`` after running it top to bottom."""
    path = NOTEBOOKS / name
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(DUMP))
    execute(nb, path.parent, allow_errors=False)
    printed = "\n".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs)
    state = json.loads(printed.split(STATE, 1)[1].splitlines()[0])
    return state["verdicts"], state["evidence"], printed


def cost_of(entry: dict) -> PreemptionCostModel:
    return PreemptionCostModel(**entry["cost_model"])


def cheaper(swap: float, recompute: float) -> str:
    return "swap" if swap < recompute else "recompute"


def printed_line(printed: str, starts: str) -> str:
    lines = [line for line in printed.splitlines() if line.startswith(starts)]
    assert lines, f"no printed line starts with {starts!r}"
    return lines[0]


# ---- lesson 07 ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lesson07():
    return run_lesson("07_choosing_swap_or_recompute.ipynb")


def test_07_the_measured_winner_is_the_cheaper_measured_option(lesson07):
    verdicts, evidence, _ = lesson07
    victims = evidence["this machine"]["victims"]
    assert verdicts["measured cheaper"] == {str(v["num_tokens"]): cheaper(v["swap_seconds"], v["recompute_seconds"])
                                            for v in victims}


def test_07_the_model_winner_is_the_measured_models_choice(lesson07):
    verdicts, evidence, printed = lesson07
    here, batch = evidence["this machine"], evidence["this machine"]["batch"]
    cost = cost_of(here)
    model = {str(v["num_tokens"]): cost.choose(v["num_blocks"], here["block_bytes"], v["num_tokens"], batch)
             for v in here["victims"]}
    assert verdicts["model cheaper"] == model
    assert verdicts["model agrees with measurement"] == (model == verdicts["measured cheaper"])
    same = sum(model[n] == verdicts["measured cheaper"][n] for n in model)
    assert f"it picks the measured winner at {same} of {len(model)} lengths" in printed


def test_07_each_machines_recompute_range_and_its_sentence(lesson07):
    verdicts, evidence, printed = lesson07
    for machine, entry in evidence["machines"].items():
        cost, batch = cost_of(entry), evidence["this machine"]["batch"]
        recomputed = [b * BLOCK for b in range(1, LIMIT_07 // BLOCK + 1)
                      if cost.choose(b, entry["block_bytes"], b * BLOCK, batch) == "recompute"]
        expected = [recomputed[0], recomputed[-1]] if recomputed else None
        assert verdicts["recompute range"][machine] == expected, machine
        line = printed_line(printed, f"{machine}: ")
        if expected is None:
            assert "swap is cheaper for every victim" in line and "fails" in line
        elif expected[1] < LIMIT_07:
            assert f"recompute from {expected[0]:,} to {expected[1]:,} tokens, swap beyond" in line
            assert f"holds up to {expected[1]:,} tokens" in line


def test_07_auto_did_what_its_prices_predicted(lesson07):
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


def test_07_mistakes_conclude_from_their_tables(lesson07):
    verdicts, evidence, _ = lesson07
    rows = evidence["block by block"]
    assert verdicts["block by block loses to recompute at"] == [
        r["block size"] for r in rows if r["block by block ms"] > r["recompute ms"]]
    assert verdicts["batched loses to recompute at"] == [
        r["block size"] for r in rows if r["batched ms"] > r["recompute ms"]]
    assert verdicts["own pass overcharges here"] == all(
        r["on its own ms"] > r["in the batch ms"] for r in evidence["own pass"])
    per_token = [r["measured us/token"] for r in evidence["per token"]]
    assert verdicts["per-token recompute grows"] == (per_token[-1] > min(per_token))


# ---- lesson 09 ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lesson09():
    return run_lesson("09_serving_long_contexts.ipynb")


def returning_prices(cost: PreemptionCostModel, context: int, block_bytes: int) -> tuple[float, float]:
    total = context + NEW_TOKENS_09
    recompute = cost.pass_seconds(total, attention_pairs(total), 1)
    host = (cost.swap_seconds(context // BLOCK, block_bytes)
            + cost.pass_seconds(NEW_TOKENS_09, attention_pairs(NEW_TOKENS_09, context), 1))
    return recompute, host


def walk_through(evidence: dict) -> dict:
    return {(r["mode"], r["length"]): r for r in evidence["walk-through"]}


def test_09_the_cheaper_returning_turn_timed_in_the_engine_and_by_the_model(lesson09):
    verdicts, evidence, printed = lesson09
    assert verdicts["timed cheaper"] == {
        str(t["context"]): "copy back" if t["copy_back_seconds"] < t["recompute_seconds"] else "recompute"
        for t in evidence["returning"]}
    runs = walk_through(evidence)
    lengths = sorted({n for _, n in runs})
    assert verdicts["engine cheaper"] == {
        str(n): "copy back" if runs["host tier", n]["ttft"] < runs["no prefix caching", n]["ttft"] else "recompute"
        for n in lengths}
    here = evidence["this machine"]
    model = {str(n): "copy back" if returning_prices(cost_of(here), n, here["block_bytes"])[1]
             < returning_prices(cost_of(here), n, here["block_bytes"])[0] else "recompute" for n in lengths}
    assert verdicts["model cheaper"] == model
    for label in ("model", "timed", "engine"):
        assert printed_line(printed, f"{label:6s} cheaper: ") == f"{label:6s} cheaper: " + ", ".join(
            f"{n}: {v}" for n, v in verdicts[f"{label} cheaper"].items())


def test_09_each_machines_crossover_and_its_sentence(lesson09):
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


def test_09_walk_through_verdicts_follow_from_its_table(lesson09):
    verdicts, evidence, _ = lesson09
    runs = walk_through(evidence)
    lengths = sorted({n for _, n in runs})
    device_only = [runs["device-only prefix cache", n] for n in lengths]
    assert verdicts["device-only found nothing"] == all(r["recomputed"] == r["context"] for r in device_only)
    assert verdicts["host tier copied every full block"] == all(
        runs["host tier", n]["copied back"] == runs["host tier", n]["context"] // BLOCK * BLOCK for n in lengths)
    for name in ("no prefix caching", "host tier"):
        for a, b in zip(lengths, lengths[1:]):
            grew = runs[name, b]["context"] / runs[name, a]["context"]
            factor = runs[name, b]["ttft"] / runs[name, a]["ttft"]
            pace = "faster than" if factor > 1.1 * grew else "slower than" if factor < grew / 1.1 else "in step with"
            assert verdicts["growth"][f"{name}, {b}"] == pace


def test_09_mistakes_conclude_from_their_tables(lesson09):
    verdicts, evidence, printed = lesson09
    for row in evidence["tier sizes"]:
        keys = ("block 0 on host", "copied back", "recomputed")
        assert verdicts["tier sizes"][str(row["host blocks"])] == {key: row[key] for key in keys}
        line = printed_line(printed, f"a tier of {row['host blocks']} blocks: ")
        assert ("found nothing" in line) == (row["copied back"] == 0)
    tier = next(r for r in evidence["one-off traffic"] if r["mode"] == "host tier")
    assert verdicts["tier only cost"] == (tier["host hit tokens"] == 0 and tier["blocks copied"] > 0)
