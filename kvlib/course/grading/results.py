"""What grading one check, and one task, leaves behind."""
from __future__ import annotations

from dataclasses import dataclass, field

PASS = "pass"
FAIL = "fail"
NOT_IMPLEMENTED = "not implemented"
TIMED_OUT = "timed out"
CRASHED = "crashed"  # the process running the check died, hung at start-up or sent no valid reply
NOT_GRADED = "not graded"  # the submission could not be read, or lacks a graded name, so no check ran


@dataclass
class CheckResult:
    name: str
    max_points: int
    status: str
    message: str = ""
    hint: str = ""

    @property
    def points(self) -> int:
        return self.max_points if self.status == PASS else 0

    @property
    def reason(self) -> str:
        """Why it did not pass: a failed check's message, or the status and its message."""
        return self.message if self.status == FAIL else f"{self.status}: {self.message}"


@dataclass
class TaskResult:
    task: str
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def points(self) -> int:
        return sum(c.points for c in self.checks)

    @property
    def max_points(self) -> int:
        return sum(c.max_points for c in self.checks)

    @property
    def full_marks(self) -> bool:
        return all(c.status == PASS for c in self.checks)

    @property
    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status != PASS]

    def failed_summary(self) -> str:
        """One phrase for the score table: the failed check names, or why nothing ran."""
        failed = self.failed
        statuses = {c.status for c in failed}
        if len(failed) == len(self.checks) and len(statuses) == 1 and statuses != {FAIL}:
            return f"{failed[0].status}: " + ", ".join(dict.fromkeys(c.message for c in failed))
        return ", ".join(c.name if c.status == FAIL else f"{c.name} ({c.status})" for c in failed)

    def __repr__(self) -> str:
        return f"<{self.task}: {self.points}/{self.max_points} points>"
