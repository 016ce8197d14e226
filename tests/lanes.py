"""Which tests leave the fast lane (``pytest -m "not notebooks"``).

Tests that run a lesson or a lab (a notebook's cells, in a kernel, a sandbox or this process): with
nbval's items of notebooks/ and solutions/ and every ``test_grading*`` file, tests/conftest.py gives
them the ``notebooks`` marker, so that ``pytest -m "not notebooks"`` runs the engine's tests alone.
"""
RUNS_NOTEBOOKS = {"test_exercises.py", "test_first_cell.py", "test_fresh_install.py", "test_jupyterlab.py",
                  "test_labs_graded.py", "test_lesson_verdicts.py", "test_notebook_hygiene.py::test_runs_top_to_bottom"}
