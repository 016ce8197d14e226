"""A sandbox's whole process tree is bounded in processes and memory, and nothing in it survives ``close``."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from fence import without_the_fence

from kvlib.course.grading.bounds import bounded, unbounded
from kvlib.course.grading.runner import grade_cells
from kvlib.course.grading.sandbox import Limits

pytestmark = pytest.mark.skipif(unbounded() is not None, reason=f"no control groups here: {unbounded()}")


def test_a_fork_bomb_stops_at_the_process_limit_and_close_ends_it():
    bounds = bounded(processes=24, memory_bytes=2**30)
    bomb = "n=0; while [ $n -lt 200 ]; do sleep 60 & n=$((n+1)); done; wait"
    shell = subprocess.Popen(bounds.command(["/bin/sh", "-c", bomb]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        most = max(len(members(bounds)) for _ in range(50) if time.sleep(0.1) is None)
        assert 20 <= most <= 24  # the limit, not the 200 asked for
    finally:
        bounds.close()
        shell.wait(timeout=30)
    assert "fork" in shell.stderr.read().lower()
    assert not any(folder.exists() for folder in bounds.folders)


def test_a_tree_past_its_memory_is_killed():
    bounds = bounded(processes=64, memory_bytes=200 * 2**20)
    try:
        grab = subprocess.run(bounds.command([sys.executable, "-c", "x = bytearray(400 * 2**20); print('held')"]),
                              capture_output=True, text=True, timeout=60)
    finally:
        bounds.close()
    assert grab.returncode != 0 and "held" not in grab.stdout


def test_close_ends_a_daemon_that_left_the_session():
    bounds = bounded(processes=64, memory_bytes=2**30)
    daemon = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    print(os.getpid(), flush=True)\n    time.sleep(300)\n"
    parent = subprocess.Popen(bounds.command([sys.executable, "-c", daemon]), stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    parent.wait(timeout=60)  # the parent is gone; its child lives on in a session of its own
    assert alive(pid)
    bounds.close()
    parent.stdout.close()
    time.sleep(0.2)
    assert not alive(pid)


def test_a_fork_bomb_at_load_time_costs_its_own_checks_only():
    """Every process forks until the limit refuses, then all of them go on loading: the replies are garbled."""
    bomb = ("import os\n\n\ndef _fork_until_refused():\n    for _ in range(64):\n        try:\n            os.fork()\n"
            "        except OSError:\n            return\n\n\nclass MyBlockAllocator:\n    _ = _fork_until_refused()\n")
    started = time.monotonic()
    with without_the_fence():
        graded = grade_cells("lab02", [bomb], Limits(processes=48, check_scale=0.25, submission_s=60), seed=5)
    assert sum(t.points for t in graded.tasks) == 0 and time.monotonic() - started < 120


def members(bounds) -> set[int]:
    """Every process in the sandbox's groups (each group holds the same tree)."""
    return {int(p) for f in bounds.folders if (f / "cgroup.procs").exists()
            for p in (f / "cgroup.procs").read_text().split()}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
