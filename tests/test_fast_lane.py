"""The fast lane (``pytest -m "not notebooks and not slow"``) leaves out every test file that runs a lesson or a lab,
and the engine tests tests/lanes.py names as slow.

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


def test_every_slow_entry_names_a_test_that_exists():
    """An entry of lanes.SLOW that no longer names a test would leave that test's time in the fast lane unnoticed."""
    from lanes import SLOW
    for entry in SLOW:
        file, _, test = entry.partition("::")
        source = (TESTS / file).read_text()
        assert not test or re.search(rf"^def {re.escape(test)}\(", source, re.M), entry


def test_the_fast_lane_leaves_the_slow_tests_out(pytestconfig):
    import subprocess
    import sys
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "-o", "addopts=", "-m", "not notebooks and not slow",
                             str(TESTS / "test_decode_graphs.py"), str(TESTS / "test_smollm2.py")],
                            capture_output=True, text=True, cwd=TESTS.parent).stdout
    assert "test_graph_replays_give_the_eager_tokens" not in listed and "test_smollm2.py::" not in listed
    assert "test_decode_graphs.py::" in listed  # the rest of the file stays
