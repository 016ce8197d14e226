"""Every lesson runs top to bottom, and every verdict it prints is what its measurements say.

This is how the lessons run in the suite (nbval runs the solutions): after the last cell, the
kernel hands back every ``kvlib.course.verdicts.verdict`` the lesson printed, and each recorded
rule is evaluated again on the recorded values.
"""
from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from kvlib.course.grading.execute import execute
from kvlib.course.verdicts import holds_again

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
REPORT = "import json\nfrom kvlib.course.verdicts import recorded\nprint('VERDICTS' + json.dumps(recorded()))"


def run_lesson(path: Path) -> list[dict]:
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(REPORT))
    execute(nb, path.parent, allow_errors=False)
    printed = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    return json.loads(printed.split("VERDICTS", 1)[1])


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_the_lesson_runs_and_says_what_it_measured(lesson):
    verdicts = run_lesson(lesson)
    wrong = [v for v in verdicts if not holds_again(v)]
    assert not wrong, f"{lesson.name}: printed verdicts their own measurements contradict: {wrong}"
