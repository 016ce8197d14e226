"""A process of its own for a learner's code and the checks that grade it.

The grader (``runner.py``) starts this module as a separate Python process, sends it the
learner's extracted definitions, then asks for one check at a time over its standard input and
reads one JSON line back per check. The process has a memory limit; the grader gives each check
a time limit and, past it, kills the process and starts a fresh one for the next check, so a hang
or a crash costs that check only. Nothing the learner's code does here can reach the grader's
process, the score it assembles, or another submission.
"""
from __future__ import annotations

import importlib
import json
import os
import select
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from kvlib.course.grading.extract import Statement, load
from kvlib.course.grading.results import CRASHED, TIMED_OUT, CheckResult

STARTUP_LIMIT_S = 120.0  # importing torch and kvlib, then defining the learner's names


@dataclass(frozen=True)
class Limits:
    memory_bytes: Optional[int] = 8 * 2**30  # address space of the process running the checks
    check_scale: float = 1.0  # multiplies every check's own time limit (a slow machine, a loaded class run)


class Sandbox:
    """One learner's definitions, loaded in a fresh process; ``run`` grades one check there."""

    def __init__(self, lab: str, statements: list[Statement], limits: Limits = Limits()):
        self.lab, self.statements, self.limits = lab, statements, limits
        self.process: Optional[subprocess.Popen] = None
        self.startup_error: Optional[str] = None

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, task: str, check: str, points: int, limit_s: float) -> CheckResult:
        if self.process is None:
            self._start()
        if self.startup_error is not None:
            return CheckResult(check, points, CRASHED, self.startup_error)
        try:
            self._send({"task": task, "check": check})
            reply = self._receive(limit_s * self.limits.check_scale)
        except TimeoutError:
            self.close()
            return CheckResult(check, points, TIMED_OUT, f"still running after {limit_s * self.limits.check_scale:g} s; "
                                                         f"look for a loop that never ends")
        except EOFError:
            self.close()
            return CheckResult(check, points, CRASHED, "the process running your code died (out of memory, or a "
                                                       "hard crash) during this check")
        return CheckResult(**reply)

    def close(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def _start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(Path(__file__).resolve().parents[3]), os.environ.get("PYTHONPATH")) if p)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvlib.course.grading.sandbox"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, cwd=tempfile.gettempdir(), env=env, text=True)
        self._send({"lab": self.lab, "memory_bytes": self.limits.memory_bytes,
                    "statements": [asdict(s) for s in self.statements]})
        try:
            reply = self._receive(STARTUP_LIMIT_S)
        except (TimeoutError, EOFError):
            reply = {"error": "your definitions did not finish loading (a loop or a crash at definition time)"}
        self.startup_error = reply.get("error")

    def _send(self, message: dict) -> None:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def _receive(self, limit_s: float) -> dict:
        ready, _, _ = select.select([self.process.stdout], [], [], limit_s)
        if not ready:
            raise TimeoutError
        line = self.process.stdout.readline()
        if not line:
            raise EOFError
        return json.loads(line)


class InProcess:
    """The same interface in this process, for trusted code only: the tests of the graders themselves."""

    def __init__(self, lab: str, statements: list[Statement], limits: Limits = Limits()):
        self.tasks = {task.name: task for task in importlib.import_module(f"kvlib.course.grading.{lab}").TASKS}
        self.namespace: dict = {"__name__": "learner"}
        self.startup_error: Optional[str] = None
        try:
            load(statements, self.namespace)  # trusted test code
        except Exception as exc:  # noqa: BLE001 - the same report the sandbox gives
            self.startup_error = f"your definitions raise {type(exc).__name__}: {exc} when they run"

    def __enter__(self) -> "InProcess":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def run(self, task: str, check: str, points: int, limit_s: float) -> CheckResult:
        if self.startup_error is not None:
            return CheckResult(check, points, CRASHED, self.startup_error)
        graded = self.tasks[task]
        return graded.run_check(next(c for c in graded.checks if c.name == check), graded.piece(self.namespace))


def _serve() -> None:
    """The process side: load the learner's code, then answer one check per request."""
    replies = os.fdopen(os.dup(1), "w")
    sys.stdout = sys.stderr  # the learner's prints must not reach the replies
    setup = json.loads(sys.stdin.readline())
    if setup["memory_bytes"]:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (setup["memory_bytes"], setup["memory_bytes"]))
    lab = importlib.import_module(f"kvlib.course.grading.{setup['lab']}")
    namespace: dict = {"__name__": "learner"}
    try:
        load([Statement(**statement) for statement in setup["statements"]], namespace)
    except BaseException as exc:  # noqa: BLE001 - reported as the reason every check of this submission fails
        replies.write(json.dumps({"error": f"your definitions raise {type(exc).__name__}: {exc} when they run"}) + "\n")
        replies.flush()
        return
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    tasks = {task.name: task for task in lab.TASKS}
    for line in sys.stdin:
        request = json.loads(line)
        task = tasks[request["task"]]
        check = next(c for c in task.checks if c.name == request["check"])
        result = task.run_check(check, task.piece(namespace))
        replies.write(json.dumps(asdict(result)) + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve()
