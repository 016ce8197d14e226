"""Course tooling: generating labs from solutions, grading them, and the notebooks' first cell."""
