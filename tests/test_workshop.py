"""WORKSHOP.md's schedule says what the lessons' and labs' own notes say, for every lesson and lab."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]


def _markdown(path: Path) -> str:
    return "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown")


def _schedule() -> dict[str, tuple[str, list[str], list[str]]]:
    """Lesson number -> (teaching time, its labs, their times), from WORKSHOP.md's table."""
    rows = {}
    for line in (ROOT / "WORKSHOP.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"\d\d .*", cells[0]):
            labs = re.findall(r"lab\d\d", cells[2])
            times = [t.strip() for t in cells[3].split(",")] if labs else []
            rows[cells[0][:2]] = (cells[1], labs, times)
    return rows


def test_every_lesson_is_scheduled_with_its_own_teaching_time():
    schedule = _schedule()
    lessons = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert sorted(schedule) == [p.stem[:2] for p in lessons]
    for lesson in lessons:
        found = re.search(r"Teaching time:(?:\*\*)? about (\d+) minutes", _markdown(lesson))
        assert found, f"{lesson.name}: no 'Teaching time: about N minutes' in its instructor notes"
        assert schedule[lesson.stem[:2]][0] == f"{found.group(1)} minutes", lesson.name


def test_every_lab_is_scheduled_with_its_own_time_after_its_lesson():
    scheduled = {lab: time for _, labs, times in _schedule().values() for lab, time in zip(labs, times)}
    solutions = sorted((ROOT / "solutions").glob("lab[0-9][0-9]_*.ipynb"))
    assert sorted(scheduled) == [p.stem[:5] for p in solutions]
    for solution in solutions:
        found = re.search(r"Time:(?:\*\*)? about\s+([^.,]+?)[.,]", _markdown(solution))
        assert found, f"{solution.name}: no 'Time: about ...' in its introduction"
        assert scheduled[solution.stem[:5]] == " ".join(found.group(1).split()), solution.name
