"""Run by root, the sandbox is handed to ``nobody``: its user is unprivileged outside its namespaces too, and a
grader that cannot do that says so in the report. Wherever bubblewrap can make namespaces, grading is isolated,
a Python installed below /tmp included."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from kvlib.course.grading import sandbox
from kvlib.course.grading.hidden import stubbed_tree
from kvlib.course.grading.runner import grade_cells
from kvlib.course.grading.sandbox import NOBODY, Limits, isolation, root_outside, sandbox_command

needs_root = pytest.mark.skipif(isolation() is not None or os.geteuid() != 0,
                                reason="needs root and bubblewrap: only root's sandbox can map to root outside")
# The sandbox's user inside, and through its uid map (the identity where it has no user namespace of its own) outside.
WHO = ("import os\nuid = os.getuid()\nfor line in open('/proc/self/uid_map'):\n    inside, outside, count = map(int, line.split())"
       "\n    if inside <= uid < inside + count:\n        print(uid, outside + uid - inside)")


def sandbox_users(command: list[str], env: dict[str, str]) -> tuple[int, int]:
    """``(inside, outside)``: the user a sandbox's process runs as, in its namespaces and on this machine."""
    python = command.index("-m")  # the sandbox's own module is replaced by a short script
    shown = subprocess.run([*command[:python], "-c", WHO], env=env, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    inside, outside = map(int, shown.stdout.split())
    return inside, outside


@needs_root
def test_the_graders_sandbox_is_nobody_outside_its_namespaces():
    assert root_outside() is None, root_outside()
    assert sandbox_users(*sandbox_command(stubbed_tree(()))) == (NOBODY, NOBODY)


@needs_root
def test_without_the_hand_over_the_sandbox_would_be_root_outside(monkeypatch):
    """What the hand-over prevents, seen: bubblewrap run by root maps the sandbox's nobody to root."""
    monkeypatch.setattr(sandbox, "_hands_over", lambda: False)
    assert sandbox_users(*sandbox_command(stubbed_tree(()))) == (NOBODY, 0)


@needs_root
def test_a_grader_that_cannot_hand_over_says_so_in_the_report(monkeypatch):
    monkeypatch.setattr(sandbox, "_hands_over", lambda: False)
    assert root_outside() == "a sandbox handed to nobody did not start here"
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None if name == "setpriv" else f"/usr/bin/{name}")
    assert root_outside() == "setpriv is not installed"
    graded = grade_cells("lab02", ["class MyBlockAllocator:\n    pass\n"], Limits(check_scale=0.25), seed=5)
    assert any("root outside its namespaces (setpriv is not installed)" in note for note in graded.notes)


@pytest.mark.skipif(shutil.which("bwrap") is None or bool(os.environ.get("KVLIB_GRADING_NO_ISOLATION")),
                    reason="bubblewrap is not installed, or isolation is turned off")
def test_grading_is_isolated_wherever_bubblewrap_can_make_namespaces():
    """A sandbox argument list that bubblewrap refuses loses isolation without failing a grade: it must not."""
    plain = subprocess.run(["bwrap", "--ro-bind", "/", "/", "--unshare-all", "--", "true"], capture_output=True)
    if plain.returncode != 0:
        pytest.skip(f"bubblewrap cannot make namespaces here: {plain.stderr.decode()[:200]}")
    assert isolation() is None


@pytest.mark.skipif(isolation() is not None, reason=f"grading is not isolated here: {isolation()}")
@pytest.mark.parametrize("hand_over", [False, True], ids=["user namespaces", "handed to nobody"])
def test_a_python_below_tmp_is_seen_in_the_sandbox(monkeypatch, tmp_path, hand_over):
    """A virtual environment in /tmp (CI's) is bound below the sandbox's own /tmp, which must not hide it."""
    if hand_over and not sandbox._hands_over():
        pytest.skip("this grader does not hand its sandboxes to nobody (not root, or no setpriv)")
    assert str(tmp_path).startswith("/tmp/")
    installed = tmp_path / "venv"
    installed.mkdir()
    (installed / "marker").write_text("seen")
    for folder in (tmp_path, installed):
        folder.chmod(0o755)
    roots = sandbox._python_roots()
    monkeypatch.setattr(sandbox, "_python_roots", lambda: [*roots, str(installed)])
    shown = subprocess.run([*sandbox._bwrap_arguments(stubbed_tree(()), hand_over), sys.executable, "-c",
                            f"print(open('{installed}/marker').read())"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and shown.stdout.strip() == "seen", shown.stderr


@pytest.mark.skipif(isolation() is not None, reason=f"grading is not isolated here: {isolation()}")
def test_bubblewrap_found_outside_the_system_folders_still_starts_the_sandbox(monkeypatch, tmp_path):
    """A bwrap on the grader's PATH only (a conda environment, ~/.local/bin) zeroed every submission: the sandbox's
    command ran with a PATH of the system's folders, where no bwrap is."""
    own = tmp_path / "bin"
    own.mkdir()
    (own / "bwrap").symlink_to(shutil.which("bwrap"))
    monkeypatch.setenv("PATH", f"{own}{os.pathsep}{os.environ['PATH']}")
    command, env = sandbox_command(stubbed_tree(()))
    assert command[0] == str(own / "bwrap")
    assert sandbox_users(command, env)[0] == NOBODY


@pytest.mark.skipif(isolation() is not None, reason=f"grading is not isolated here: {isolation()}")
def test_the_class_folder_is_not_seen_from_the_sandbox(monkeypatch, tmp_path):
    """``python -m kvlib.cli grade .`` (what ``grade_here()`` runs) puts the class folder on ``sys.path``: bound as one
    of Python's folders, it let a submission read a classmate's notebook."""
    classmate = tmp_path / "alice.ipynb"
    classmate.write_text("{}")
    tmp_path.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert not any(str(tmp_path).startswith(root) for root in sandbox._python_roots() if root not in ("/", "/tmp"))
    seen = subprocess.run([*sandbox._bwrap_arguments(stubbed_tree(()), sandbox._hands_over()), sys.executable, "-c",
                           f"import os; print(os.path.exists({str(classmate)!r}))"],
                          capture_output=True, text=True, timeout=60)
    assert seen.returncode == 0 and seen.stdout.strip() == "False", seen.stderr
