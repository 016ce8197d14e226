"""Every lesson exercise passes its own check with the answer the lesson shows.

The convention a lesson follows, so that a learner and this test read an exercise the same way:

* the exercise starts in a markdown cell whose text names it: ``**Exercise N: ...**`` or
  ``### Exercise N: ...``;
* the exercise cell is the first code cell after it, with a blank to fill (``name = None`` or a
  function returning ``None``);
* the answer follows the check, in a markdown cell that opens with
  ``<details><summary>Show the answer</summary>``: the code of a fenced block, else every inline
  code span that is an assignment (``name = expression``), binding the exercise cell's names;
* the check is the last code cell before the answer (the exercise cell itself, or a later one),
  and prints a line starting with ``Right`` when the answer passes.

Each lesson runs once, up to its last check (lessons 04, 06, 07, 08 and 09 in the second of the two runs
tests/test_lesson_verdicts.py makes of them), with every answer put in place of the statements that
bind the same names, so a check that rejects the lesson's own answer fails here, and so does an
exercise whose answer cannot be found.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

from kvlib.course.grading.execute import execute
from test_lessons import TIMED_TWICE

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
EXERCISE_HEADING = re.compile(r"^(\*\*|#+ )Exercise \d+", re.MULTILINE)
ANSWER_OPENING = "<details><summary>Show the answer</summary>"
FENCED = re.compile(r"```python\n(.*?)```", re.DOTALL)
INLINE = re.compile(r"`([^`\n]+)`")


@dataclass
class Exercise:
    title: str
    cell: int  # the code cell with the blank
    check: int  # the code cell that prints "Right" when the answer passes
    answer: str  # the code that fills the blank


def answer_code(markdown: str) -> str:
    """The answer's code: its fenced blocks, else its inline spans that are assignments."""
    details = markdown[markdown.index(ANSWER_OPENING):].split("</details>")[0]
    fenced = FENCED.findall(details)
    if fenced:
        return "\n".join(fenced)
    return "\n".join(span for span in INLINE.findall(details) if _is_assignment(span))


def _is_assignment(code: str) -> bool:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    return len(tree.body) == 1 and isinstance(tree.body[0], ast.Assign)


def bound_names(statement: ast.stmt) -> set[str]:
    """The names a top-level statement binds: a function's, or an assignment's targets."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {statement.name}
    if isinstance(statement, (ast.Assign, ast.AnnAssign)):
        targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
        return {node.id for target in targets for node in ast.walk(target) if isinstance(node, ast.Name)}
    return set()


def fill_in(source: str, answer: str) -> str:
    """``source`` with the statements that bind the answer's names replaced by the answer."""
    names = set().union(*(bound_names(s) for s in ast.parse(answer).body))
    blanks = [s for s in ast.parse(source).body if bound_names(s) & names]
    if not names or not blanks:
        raise ValueError(f"the answer binds {sorted(names)}, which the exercise cell does not")
    lines = source.splitlines()
    for statement in reversed(blanks):
        lines[statement.lineno - 1:statement.end_lineno] = answer.splitlines() if statement is blanks[0] else []
    return "\n".join(lines)


def exercises(nb: nbformat.NotebookNode, name: str) -> list[Exercise]:
    """Every exercise of a lesson, with its cells and answer; fails on one whose answer is missing."""
    cells, found = nb.cells, []
    starts = [i for i, c in enumerate(cells) if c.cell_type == "markdown" and EXERCISE_HEADING.search(c.source)]
    for n, start in enumerate(starts):
        title = EXERCISE_HEADING.search(cells[start].source).group(0).strip("*# ")
        end = starts[n + 1] if n + 1 < len(starts) else len(cells)
        code = [i for i in range(start + 1, end) if cells[i].cell_type == "code"]
        answer_at = next((i for i in range(start + 1, end)
                          if cells[i].cell_type == "markdown" and cells[i].source.lstrip().startswith(ANSWER_OPENING)), None)
        assert code, f"{name}, {title}: no code cell after its text"
        assert answer_at is not None, f"{name}, {title}: no answer ({ANSWER_OPENING}) after its check"
        answer = answer_code(cells[answer_at].source)
        assert answer, f"{name}, {title}: the answer shows no code (a fenced block, or `name = expression`)"
        check = max(i for i in code if i < answer_at)
        found.append(Exercise(title, code[0], check, answer))
    return found


def printed(cell: nbformat.NotebookNode) -> str:
    return "".join(out.get("text", "") for out in cell.get("outputs", []) if out.output_type == "stream")


def errors(cell: nbformat.NotebookNode) -> list[str]:
    return [f"{out.ename}: {out.evalue}" for out in cell.get("outputs", []) if out.output_type == "error"]


def test_filling_in_replaces_the_blank_and_keeps_the_rest():
    cell = "layers = 4\ncalls = None  # fill in\n\n\ndef f(x):\n    return None\n\nprint(f(1))"
    assert fill_in(cell, "calls = 2 * layers") == "layers = 4\ncalls = 2 * layers\n\n\ndef f(x):\n    return None\n\nprint(f(1))"
    assert fill_in(cell, "def f(x):\n    return x + 1").endswith("def f(x):\n    return x + 1\n\nprint(f(1))")
    assert fill_in("a, b = None, None", "a, b = 5, 0") == "a, b = 5, 0"
    with pytest.raises(ValueError):
        fill_in(cell, "other = 1")


def test_an_answer_is_read_from_its_fenced_block_or_its_assignment():
    assert answer_code(f"{ANSWER_OPENING}\n\n`x = 2 * y`: because.\n\n</details>") == "x = 2 * y"
    assert answer_code(f"{ANSWER_OPENING}\n\n```python\ndef f():\n    return 1\n```\n</details>") == "def f():\n    return 1\n"
    assert answer_code(f"{ANSWER_OPENING}\n\nIt is `4`, not `x + 1`.\n</details>") == ""


def test_a_lesson_without_an_answer_is_refused():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("**Exercise 1: fill in.** x"),
                                         nbformat.v4.new_code_cell("x = None")])
    with pytest.raises(AssertionError, match="no answer"):
        exercises(nb, "synthetic")


def missed(nb: nbformat.NotebookNode, found: list[Exercise]) -> list[str]:
    """The exercises of an executed lesson whose cells failed or whose check did not print ``Right``."""
    failed = []
    for exercise in found:
        crashed = [e for c in nb.cells[exercise.cell:exercise.check + 1] for e in errors(c)]
        right = any(line.startswith("Right") for line in printed(nb.cells[exercise.check]).splitlines())
        if crashed or not right:
            failed.append(f"{exercise.title}: {crashed or printed(nb.cells[exercise.check]).strip()[-300:]!r}")
    return failed


@pytest.mark.parametrize("lesson", [p for p in LESSONS if p.stem[:2] not in TIMED_TWICE], ids=lambda p: p.stem)
def test_every_exercise_passes_its_check_with_the_answer_shown(lesson):
    nb = nbformat.read(lesson, as_version=4)
    found = exercises(nb, lesson.name)
    if not found:
        return
    for exercise in found:
        nb.cells[exercise.cell].source = fill_in(nb.cells[exercise.cell].source, exercise.answer)
    nb.cells = nb.cells[:max(e.check for e in found) + 1]
    execute(nb, lesson.parent, allow_errors=True)
    before = [e for c in nb.cells[:min(e.cell for e in found)] for e in errors(c)]
    assert not before, f"{lesson.name}: a cell before the first exercise failed: {before}"
    failed = missed(nb, found)
    assert not failed, f"{lesson.name}: with the answers shown, these checks did not pass: {failed}"


def test_the_lessons_run_twice_check_their_exercises_in_their_second_run():
    """Lessons 04, 06, 07, 08 and 09 answer their exercises in tests/test_lesson_verdicts.py's second run, not here."""
    import test_lesson_verdicts
    for number in TIMED_TWICE:
        assert issubclass(getattr(test_lesson_verdicts, f"TestLesson{number}"), test_lesson_verdicts.LessonRuns), number
