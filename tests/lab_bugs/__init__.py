"""Realistic learner bugs, one list per lab, as edits of the solution notebook.

Each bug names the edits that turn the solution into the buggy submission (``old`` text, present
once in the solution's code, and what replaces it) and the checks it must fail. Test data, not
special cases in the graders: the graders know nothing of these.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bug:
    name: str
    edits: tuple[tuple[str, str], ...]
    fails: frozenset[str]  # "task/check" names that must fail (others may fail too)
    # Reads out of bounds, so it may crash the process running it: graded in the sandbox, as `kvlib grade` does.
    sandboxed: bool = False


def bug(name: str, edits: list[tuple[str, str]], *fails: str, sandboxed: bool = False) -> Bug:
    return Bug(name, tuple(edits), frozenset(fails), sandboxed)
