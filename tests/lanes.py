"""Which tests leave the fast lane (``pytest -m "not notebooks and not slow"``).

Tests that run a lesson or a lab (a notebook's cells, in a kernel, a sandbox or this process): with
nbval's items of notebooks/ and solutions/ and every ``test_grading*`` file, tests/conftest.py gives
them the ``notebooks`` marker, so that ``pytest -m "not notebooks"`` runs the engine's tests alone.
The engine's own tests that take longest get the ``slow`` marker (``SLOW``), so that the fast lane
stays within 3 minutes on 2 cores; the whole suite runs both.
"""
RUNS_NOTEBOOKS = {"test_exercises.py", "test_first_cell.py", "test_fresh_install.py", "test_jupyterlab.py",
                  "test_labs_graded.py", "test_lesson_verdicts.py", "test_notebook_hygiene.py::test_runs_top_to_bottom"}

# Measured in the fast lane on 2 busy cores (BENCHMARKS.md, "Lessons and the fast lane on a shared 2-core machine"):
# 175 s for the warm-up test, about 120 s for SmolLM2 against transformers (59 s of it preparing the reference),
# 42 s for the two graph-replay cases and 31 s for compiling every kernel variant, of 414 s in all; the every-feature
# workloads on the interpreted Triton kernels take about 10 s each.
SLOW = {"test_warm_up.py::test_serving_compiles_nothing_the_warm_up_did_not", "test_smollm2.py",
        "test_kernel_compile.py", "test_decode_graphs.py::test_graph_replays_give_the_eager_tokens",
        "test_every_feature.py::test_every_feature_together_on_the_triton_kernels"}

# The longest scopes (files; tests/test_lesson_verdicts.py's classes come with their file), longest first, as
# measured on 2 cores (BENCHMARKS.md, "The whole test suite"). pytest-xdist hands whole scopes to its workers in
# collection order (pyproject's --no-loadscope-reorder), so tests/conftest.py collects these first: otherwise
# xdist starts with the scopes of most tests, many of them quick, and one worker ends alone on a long file.
LONGEST_FIRST = ("tests/test_grading.py", "tests/test_labs_graded.py", "tests/test_fresh_install.py",
                 "tests/test_exercises.py", "tests/test_notebook_hygiene.py", "tests/test_lesson_verdicts.py",
                 "tests/test_warm_up.py", "tests/test_jupyterlab.py", "tests/test_smollm2.py",
                 "tests/test_grading_labs_07_09.py")


def longest_first(nodeid: str) -> int:
    """Where a test's scope comes in ``LONGEST_FIRST`` (after them all if it is not there)."""
    return next((rank for rank, prefix in enumerate(LONGEST_FIRST) if nodeid.startswith(prefix + "::")),
                len(LONGEST_FIRST))
