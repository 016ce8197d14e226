"""Every lesson says only what it measured: its verdicts come from code, and its last cell checks them.

nbval runs every lesson (pyproject.toml) but those that time what they compare, which
tests/test_lesson_verdicts.py runs twice; this test makes sure each one prints its verdicts with
``kvlib.course.verdicts.verdict`` and ends with ``check_verdicts()``, which evaluates every
recorded rule again on the recorded values, so that run fails if a printed sentence and the
numbers behind it disagree.
"""
from __future__ import annotations

import re
import runpy
from pathlib import Path

import nbformat
import pytest

from kvlib.course.verdicts import check_verdicts, holds_again, recorded, verdict

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
# Lessons 07 and 09 keep richer verdicts (tables of winners and crossovers) that tests/test_lesson_verdicts.py
# recomputes from their evidence; every other lesson follows the convention below.
RECOMPUTED_ELSEWHERE = {"07", "09"}
CHECKED = {p for p in LESSONS if p.stem[:2] not in RECOMPUTED_ELSEWHERE}
# Lessons whose verdicts rest on timings: run twice in tests/test_lesson_verdicts.py, which requires the same
# verdicts from both runs, and skipped by nbval (notebooks/conftest.py).
TIMED_TWICE = {"04", "06", "07", "08", "09"}
LAST_CELL = "from kvlib.course.verdicts import check_verdicts\ncheck_verdicts()"
# Lessons 07 and 09 hand check_verdicts their table, so the count it prints includes the conclusions kept there
LAST_CELL_WITH_TABLE = "from kvlib.course.verdicts import check_verdicts\ncheck_verdicts(verdicts)"


def test_every_lesson_has_its_verdicts_checked():
    import test_lesson_verdicts
    assert RECOMPUTED_ELSEWHERE <= {p.stem[:2] for p in LESSONS}, "a lesson named here no longer exists"
    for number in RECOMPUTED_ELSEWHERE:
        checks = getattr(test_lesson_verdicts, f"TestLesson{number}", None)
        own = {name for name in dir(checks)} - {name for name in dir(test_lesson_verdicts.LessonRuns)}
        assert any(name.startswith("test_") for name in own), \
            f"lesson {number} is neither checked here nor in tests/test_lesson_verdicts.py"


def test_every_timed_lesson_runs_twice_and_nbval_skips_it():
    import test_lesson_verdicts
    ignored = runpy.run_path(str(ROOT / "notebooks" / "conftest.py"))["collect_ignore"]
    assert {name[:2] for name in ignored} == TIMED_TWICE
    assert all((ROOT / "notebooks" / name).is_file() for name in ignored), "nbval skips a lesson that no longer exists"
    for number in TIMED_TWICE:
        checks = getattr(test_lesson_verdicts, f"TestLesson{number}", None)
        assert checks is not None and issubclass(checks, test_lesson_verdicts.LessonRuns), number
        assert checks.NAME[:2] == number, (number, checks.NAME)


def test_a_verdict_prints_what_the_numbers_say_and_is_checked_again(capsys):
    assert verdict("swap_s < recompute_s", "swap won ({swap_s} s)", "recompute won ({recompute_s} s)",
                   swap_s=2.0, recompute_s=1.5) is False
    assert capsys.readouterr().out == "recompute won (1.5 s)\n"
    record = recorded()[-1]
    assert holds_again(record)
    forged = dict(record, holds=True)  # a notebook that printed the other sentence
    assert not holds_again(forged)
    check_verdicts()


@pytest.mark.parametrize("lesson", sorted(CHECKED), ids=lambda p: p.stem)
def test_the_lesson_prints_its_verdicts_from_code_and_checks_them_last(lesson):
    code = [c.source for c in nbformat.read(lesson, as_version=4).cells if c.cell_type == "code"]
    assert code[-1] == LAST_CELL, f"{lesson.name}: the last code cell must be {LAST_CELL!r}"
    assert any("verdict(" in source for source in code), f"{lesson.name}: no verdict printed from measurements"


@pytest.mark.parametrize("lesson", sorted(set(LESSONS) - CHECKED), ids=lambda p: p.stem)
def test_a_lesson_with_a_verdicts_table_checks_and_counts_it_last(lesson):
    """Lesson 07 ended by counting "1 verdict(s)" under some fifteen conclusions; lesson 09 had no check at all."""
    code = [c.source for c in nbformat.read(lesson, as_version=4).cells if c.cell_type == "code"]
    assert code[-1] == LAST_CELL_WITH_TABLE, f"{lesson.name}: the last code cell must be {LAST_CELL_WITH_TABLE!r}"


def test_the_count_includes_a_lessons_verdicts_table(capsys):
    from kvlib.course import verdicts as module
    saved = recorded()
    module._RECORDED.clear()
    try:
        verdict("a < b", "a won", "b won", a=1, b=2)
        capsys.readouterr()
        check_verdicts({"measured cheaper": {"32": "swap"}, "growth": "faster", "rule text": ["..."]})
        assert capsys.readouterr().out == ("4 verdicts in this lesson, each from this run's measurements: 1 printed "
                                           "sentence checked again here, and 3 kept in the verdicts table with the "
                                           "measurements behind them\n")
        check_verdicts()
        assert capsys.readouterr().out.startswith("1 verdict in this lesson")
    finally:
        module._RECORDED[:] = saved


PIN = "torch.set_num_threads(1)"
SERVES = re.compile(r"\b(LLM|serve|run_demo|run_preemption_bench|compare)\(")  # calls that serve or time


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_torch_runs_on_one_thread_before_the_lesson_serves_anything(lesson):
    """Lessons 06 and 08 served their slowest cells with torch's default threads: on a 2-core machine kept busy
    by other work, two threads each slowed down several times over (lesson 06 took 288 s, lesson 08 timed out)."""
    code = [c.source for c in nbformat.read(lesson, as_version=4).cells if c.cell_type == "code"][1:]  # after setup
    serving = next(((i, m.start()) for i, source in enumerate(code) for m in [SERVES.search(source)] if m), None)
    pinned = next(((i, source.index(PIN)) for i, source in enumerate(code) if PIN in source), None)
    if serving is not None:
        assert pinned is not None and pinned < serving, \
            f"{lesson.name}: code cell {serving[0] + 2} serves before torch is pinned to one thread"


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_no_cell_ends_in_a_verdict_or_comparison_that_prints_its_bool(lesson):
    """A cell whose last line is ``verdict(...)`` shows a stray ``True`` under the sentence it printed."""
    import ast
    stray = []
    for number, cell in enumerate(nbformat.read(lesson, as_version=4).cells):
        if cell.cell_type != "code" or cell.source.startswith(("%", "!")):
            continue
        body = ast.parse(cell.source).body
        last = body[-1] if body else None
        prints_bool = isinstance(last, ast.Expr) and (
            isinstance(last.value, (ast.Compare, ast.BoolOp))
            or isinstance(last.value, ast.Call) and getattr(last.value.func, "id", "") == "verdict")
        if prints_bool and not cell.source.rstrip().endswith(";"):
            stray.append(number)
    assert not stray, f"{lesson.name}: cells {stray} end in an expression whose True/False the notebook shows"
