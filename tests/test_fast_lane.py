"""The fast lane (``pytest -m "not notebooks"``) leaves out every test file that runs a lesson or a lab.

A new file that executes notebooks or grades labs but is missing from ``tests/lanes.py``'s
``RUNS_NOTEBOOKS`` would slow the engine's lane by minutes without anyone noticing.
"""
import re
from pathlib import Path

from lanes import RUNS_NOTEBOOKS

TESTS = Path(__file__).resolve().parent
RUNS_A_NOTEBOOK = re.compile(r"execute_notebook\(|grading\.execute import|NotebookClient|grade_notebook\(|"
                             r"grade_folder\(|grade_cells\(|grade_here\(")


def test_every_file_that_runs_a_notebook_is_out_of_the_fast_lane():
    marked = {entry.split("::")[0] for entry in RUNS_NOTEBOOKS}
    running = {p.name for p in TESTS.glob("test_*.py") if p.name != Path(__file__).name
               and RUNS_A_NOTEBOOK.search(p.read_text())}
    assert running, "the pattern no longer finds the files that run notebooks"
    assert {name for name in running if name not in marked and not name.startswith("test_grading")} == set()
