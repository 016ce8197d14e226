"""A process and a memory limit on one sandbox's whole process tree, so a fork or memory bomb costs
its own submission only.

A control group of its own per sandbox (cgroup v1's ``pids`` and ``memory`` hierarchies, or v2's
unified one), made beside the grader's own group where the machine lets the grader write there:
``pids.max`` bounds the processes and threads, the memory limit every byte the tree holds. The
sandbox's shell joins the groups before it becomes the sandbox, so nothing it starts is outside
them; closing kills whatever is still in them and removes the groups. Where no group can be made
(no write access, no such controller), :func:`unbounded` says why and the report says so.
"""
from __future__ import annotations

import functools
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Optional

CGROUPS = Path("/sys/fs/cgroup")
JOIN = 'for group in "$KVLIB_CGROUPS"; do echo $$ > "$group/cgroup.procs" || exit 70; done; exec "$@"'


class Bounds:
    """The groups of one sandbox: ``command`` starts a command inside them, ``close`` empties and removes them."""

    def __init__(self, folders: list[Path]):
        self.folders = folders

    def command(self, command: list[str]) -> list[str]:
        script = JOIN.replace('"$KVLIB_CGROUPS"', " ".join(f"'{f}'" for f in self.folders))
        return ["/bin/sh", "-c", script, "sh", *command]

    def close(self) -> None:
        for _ in range(50):
            left = [f for f in self.folders if f.exists()]
            for folder in left:
                for pid in _members(folder):
                    _kill(pid)
                try:
                    folder.rmdir()
                except OSError:
                    pass
            if not any(f.exists() for f in self.folders):
                return
            time.sleep(0.02)


def bounded(processes: int, memory_bytes: Optional[int]) -> Optional[Bounds]:
    """Fresh groups holding at most ``processes`` tasks and ``memory_bytes``, or None where none can be made."""
    if unbounded() is not None:
        return None
    made: list[Path] = []
    try:
        for controller, limits in _plan(processes, memory_bytes).items():
            folder = controller / f"kvlib-sandbox-{uuid.uuid4().hex[:12]}"
            folder.mkdir()
            made.append(folder)
            for name, value in limits.items():
                (folder / name).write_text(str(value))
    except OSError:
        Bounds(made).close()
        return None
    return Bounds(made)


@functools.cache
def unbounded() -> Optional[str]:
    """None when sandboxes get a process and a memory limit here, else why not."""
    if os.environ.get("KVLIB_GRADING_NO_BOUNDS"):
        return "KVLIB_GRADING_NO_BOUNDS is set"
    try:
        plan = _plan(64, 2**30)
    except OSError as exc:
        return f"no control group of the grader's own to write in ({exc})"
    for controller in plan:
        try:
            probe = controller / f"kvlib-probe-{uuid.uuid4().hex[:8]}"
            probe.mkdir()
            probe.rmdir()
        except OSError as exc:
            return f"control groups cannot be made under {controller} ({exc.strerror})"
    return None


def _plan(processes: int, memory_bytes: Optional[int]) -> dict[Path, dict[str, int]]:
    """The grader's own groups to make children under, each with the limits to write there."""
    own = _own_groups()
    if "pids" in own and "memory" in own:  # cgroup v1
        memory = {"memory.limit_in_bytes": memory_bytes} if memory_bytes else {}
        return {CGROUPS / "pids" / own["pids"]: {"pids.max": processes},
                CGROUPS / "memory" / own["memory"]: memory}
    if "" in own and (CGROUPS / "cgroup.controllers").exists():  # cgroup v2
        parent = CGROUPS / own[""]
        enabled = (parent / "cgroup.subtree_control").read_text().split()
        if not {"pids", "memory"} <= set(enabled):
            raise OSError(f"{parent} does not hand the pids and memory controllers to its children")
        return {parent: {"pids.max": processes, **({"memory.max": memory_bytes} if memory_bytes else {})}}
    raise OSError("no pids and memory controllers are mounted")


def _own_groups() -> dict[str, str]:
    """The grader's group in each hierarchy, by controller ("" for v2), as paths relative to its mount."""
    groups: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            groups[controller] = path.lstrip("/")
    return groups


def _members(folder: Path) -> list[int]:
    try:
        return [int(pid) for pid in (folder / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
