"""The first cell of every notebook, and the one line it prints about where kvlib runs.

The cell must work before kvlib can be imported: in a clone it puts the repository root on
``sys.path`` (so the clone's kvlib wins over any installed copy), and in Colab, where there is
no clone, it installs kvlib from :data:`REPO_URL`. Because that code cannot live in the package
it loads, its text is :data:`FIRST_CELL`, and a test keeps every notebook's first cell equal to it.
"""
from __future__ import annotations

from pathlib import Path

import kvlib
from kvlib.device import choose_attention_backend, resolve_device

REPO_URL = "https://github.com/kvlib-course/kvlib"

FIRST_CELL = f"""\
# Setup, the same in every notebook: kvlib from this clone, or installed from GitHub in Colab.
import pathlib, subprocess, sys
root = next((p for p in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents] if (p / "kvlib" / "course" / "notebook_setup.py").is_file()), None)
if root is None and "google.colab" in sys.modules: subprocess.run([sys.executable, "-m", "pip", "install", "-q", "git+{REPO_URL}"], check=True)
sys.path[:0] = [str(root)] if root else []
from kvlib.course.notebook_setup import setup; setup()"""


def setup() -> None:
    """Print the device and attention backend that ``device="auto"`` will use, and which kvlib loaded.

    In a notebook it also notes when each cell runs, so ``grade_here()`` can warn that cells ran
    after the file was last saved (the grader reads the saved file).
    """
    device = resolve_device("auto")
    backend = choose_attention_backend("auto", device)
    print(f"{backend.describe(device)}; kvlib {kvlib.__version__} from {Path(kvlib.__file__).parent}")
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None:
        from kvlib.course.grading.runner import mark_cell_run
        shell.events.register("post_run_cell", lambda result: mark_cell_run())
