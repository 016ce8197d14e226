"""What one graded task leaves behind, and the score file that carries it out of the kernel.

Checks run inside the notebook's kernel; ``kvlib grade`` runs in another process. The grade
runner names a JSON file in :data:`SCORE_FILE_ENV`; every graded task writes its result there,
so the runner can build the score table even when later cells fail.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

SCORE_FILE_ENV = "KVLIB_SCORE_FILE"

PASS = "pass"
FAIL = "fail"
NOT_IMPLEMENTED = "not implemented"
NOT_RUN = "not run"  # the cell that grades the task never finished


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

    @classmethod
    def from_dict(cls, data: dict) -> "TaskResult":
        return cls(data["task"], [CheckResult(**c) for c in data["checks"]])


def record(result: TaskResult) -> None:
    """Store ``result`` in the score file, replacing an earlier result for the same task.

    Without a score file (a learner running the notebook by hand) there is nothing to do.
    """
    path = _score_file()
    if path is None:
        return
    scores = read_scores(path)
    scores[result.task] = result
    path.write_text(json.dumps([asdict(r) for r in scores.values()], indent=1))


def read_scores(path: Path) -> dict[str, TaskResult]:
    if not path.exists() or not path.read_text().strip():
        return {}
    return {d["task"]: TaskResult.from_dict(d) for d in json.loads(path.read_text())}


def _score_file() -> Optional[Path]:
    value = os.environ.get(SCORE_FILE_ENV)
    return Path(value) if value else None
