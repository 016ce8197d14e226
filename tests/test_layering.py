"""The engine reads in one direction and imports nothing from the course tooling or the commands."""
import ast
import re
from pathlib import Path

import kvlib

PACKAGE = Path(kvlib.__file__).parent
OUTSIDE_THE_ENGINE = ("kvlib.course", "kvlib.cli")


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def engine_modules() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] not in ("course", "cli")]


def test_the_engine_imports_nothing_from_the_course_or_the_commands():
    offenders = {str(p.relative_to(PACKAGE)): sorted(n for n in imports_of(p) if n.startswith(OUTSIDE_THE_ENGINE))
                 for p in engine_modules()}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_scheduler_never_touches_an_allocator():
    """Policy asks, mechanism answers: reference counts are the block manager's business."""
    source = (PACKAGE / "core" / "scheduler.py").read_text()
    for mechanism in (".device_pool.", ".host_pool.", "ref_count", "allocate(", ".fork(", "make_writable"):
        assert mechanism not in source.replace("self.bm.fork(", ""), mechanism


def test_every_engine_file_is_small_enough_to_hold_in_your_head():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in engine_modules()}
    assert {name: n for name, n in sizes.items() if n > 400} == {}


def test_the_readme_engine_map_gives_each_files_real_line_count():
    """The README's engine map shows a reader how big each file is; a count that drifted would mislead."""
    readme = (PACKAGE.parent / "README.md").read_text()
    rows = re.findall(r"^\| ((?:`kvlib/[\w/]+\.py`(?:, )?)+) \| (\d+) \|", readme, flags=re.MULTILINE)
    assert len(rows) > 20, "the engine map table was not found in README.md"
    stated = {files: int(count) for files, count in rows}
    real = {files: sum(len((PACKAGE.parent / f).read_text().splitlines()) for f in re.findall(r"`([^`]+)`", files))
            for files in stated}
    assert stated == real


def test_every_lab_grader_is_one_readable_table():
    """A lab's grader is its checks in a table an instructor reads through: under 250 lines each."""
    sizes = {p.name: len(p.read_text().splitlines()) for p in (PACKAGE / "course" / "grading").glob("lab*.py")}
    assert len(sizes) == 9 and {name: n for name, n in sizes.items() if n >= 250} == {}
