"""The score table of one graded notebook, and the gradebook of a class."""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

from kvlib.course.grading.results import FAIL, TaskResult


@dataclass
class GradeReport:
    notebook: Path
    lab: str
    tasks: list[TaskResult]
    notes: list[str] = field(default_factory=list)  # what the learner should know about how it was graded
    flags: list[str] = field(default_factory=list)  # for the instructor: code that repeats kvlib's own answer

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
        """The score table, then the reason and hint for each failed check, then the notes."""
        rows = [("task", "points", "max", "failed checks")]
        rows += [(t.task, str(t.points), str(t.max_points), t.failed_summary()) for t in self.tasks]
        rows.append(("total", str(self.points), str(self.max_points), ""))
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [f"{self.notebook} ({self.lab})"]
        lines += [f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}  {d}".rstrip() for a, b, c, d in rows]
        failures = [(t.task, c) for t in self.tasks for c in t.checks if c.status != "pass"]
        if failures:
            lines.append("\nfailed checks:")
            for task, check in failures:
                lines.append(f"  {task}/{check.name}: {check.reason}")
                if check.hint and check.status == FAIL:
                    lines.append(f"    hint: {check.hint}")
        for title, items in (("flagged for the instructor", self.flags), ("notes", self.notes)):
            if items:
                lines.append(f"\n{title}:")
                lines += [f"  {item}" for item in items]
        return "\n".join(lines)

    def gradescope(self) -> dict:
        """Gradescope's ``results.json``: a test per check, with its score, maximum and what it said."""
        tests = [{"name": f"{t.task}/{c.name}", "score": c.points, "max_score": c.max_points,
                  "status": "passed" if c.status == "pass" else "failed",
                  "output": "" if c.status == "pass" else c.reason + (f"\nhint: {c.hint}" if c.hint and c.status == FAIL
                                                                     else "")}
                 for t in self.tasks for c in t.checks]
        output = "\n".join([*(f"flagged: {f}" for f in self.flags), *self.notes])
        return {"score": self.points, "output": output, "tests": tests}


def write_gradebook(reports: list[GradeReport], path: str | Path) -> Path:
    """One row per submission: points per task, the total, and the checks that failed (as nbgrader and
    otter-grader gradebooks have it)."""
    tasks = list(dict.fromkeys(t.task for r in reports for t in r.tasks))
    with open(path, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["submission", "lab", *tasks, "total", "max", "failed checks", "flags", "notes"])
        for r in reports:
            points = {t.task: t.points for t in r.tasks}
            writer.writerow([r.notebook.name, r.lab, *(points.get(t, "") for t in tasks), r.points, r.max_points,
                             "; ".join(sorted(r.failed_checks())), " | ".join(r.flags), " | ".join(r.notes)])
    return Path(path)


def write_gradescope(report: GradeReport, path: str | Path) -> Path:
    Path(path).write_text(json.dumps(report.gradescope(), indent=1) + "\n")
    return Path(path)
