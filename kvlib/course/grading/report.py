"""The score table of one graded notebook: tasks, points, and why points were lost."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvlib.course.grading.record import FAIL, TaskResult


@dataclass
class CellError:
    cell: int  # 1-based, counting every cell as the notebook shows them
    error: str


@dataclass
class GradeReport:
    notebook: Path
    tasks: list[TaskResult]
    errors: list[CellError]

    @property
    def points(self) -> int:
        return sum(t.points for t in self.tasks)

    @property
    def max_points(self) -> int:
        return sum(t.max_points for t in self.tasks)

    @property
    def full_marks(self) -> bool:
        return bool(self.tasks) and all(t.full_marks for t in self.tasks)

    def task(self, name: str) -> TaskResult:
        return next(t for t in self.tasks if t.task == name)

    def failed_checks(self) -> set[str]:
        """``task/check`` of every check that did not pass."""
        return {f"{t.task}/{c.name}" for t in self.tasks for c in t.failed}

    def table(self) -> str:
        """The score table, then the reason and hint for each failed check and any cell errors."""
        if not self.tasks:
            return f"{self.notebook}: no graded checks ran; is this a lab notebook?" + self._errors()
        rows = [("task", "points", "max", "failed checks")]
        rows += [(t.task, str(t.points), str(t.max_points), t.failed_summary()) for t in self.tasks]
        rows.append(("total", str(self.points), str(self.max_points), ""))
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [str(self.notebook)]
        lines += [f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}  {d}".rstrip() for a, b, c, d in rows]
        failures = [(t.task, c) for t in self.tasks for c in t.checks if c.status == FAIL]
        if failures:
            lines.append("\nfailed checks:")
            for task, check in failures:
                lines.append(f"  {task}/{check.name}: {check.message}")
                lines.append(f"    hint: {check.hint}")
        return "\n".join(lines) + self._errors()

    def _errors(self) -> str:
        if not self.errors:
            return ""
        return "\n\ncells that raised an error:\n" + "\n".join(f"  cell {e.cell}: {e.error}" for e in self.errors)
