"""Verdicts a lesson prints from what it measured, never typed into its text.

``verdict(rule, when_true, when_false, **measured)`` evaluates ``rule`` (an expression over the
measured values), prints the sentence the measurements support, and records what it said. Every
lesson ends with ``check_verdicts()``, which evaluates each recorded rule again on the recorded
values (the suite runs every lesson under nbval), so a sentence can only ever say what the
numbers on this machine show.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional

_RECORDED: list[dict[str, Any]] = []
_SAFE = {"abs": abs, "min": min, "max": max, "round": round, "len": len, "all": all, "any": any, "math": math}


def verdict(rule: str, when_true: str, when_false: str, **measured) -> bool:
    """Print ``when_true`` or ``when_false`` (``str.format`` with ``measured``) as ``rule`` holds on ``measured``."""
    holds = bool(eval(rule, {"__builtins__": {}, **_SAFE}, dict(measured)))  # noqa: S307 - a lesson's own rule
    said = (when_true if holds else when_false).format(**measured)
    _RECORDED.append({"rule": rule, "holds": holds, "said": said,
                      "measured": {k: _plain(v) for k, v in measured.items()}})
    print(said)
    return holds


def recorded() -> list[dict[str, Any]]:
    """Every verdict printed in this process, in order."""
    return list(_RECORDED)


def check_verdicts(table: Optional[Mapping[str, Any]] = None) -> None:
    """The last cell of every lesson: each verdict printed above agrees with the numbers it came from.

    A lesson that also keeps conclusions in a table (lessons 07 and 09: ``verdicts``, each computed from
    what they keep in ``evidence``) passes it, so the count says how many there are: those conclusions
    are tables of winners and crossovers rather than single sentences, and the lesson's tests recompute
    them from the evidence.
    """
    wrong = [r for r in _RECORDED if not holds_again(r)]
    if wrong:
        raise AssertionError(f"verdicts their own measurements contradict: {wrong}")
    if table is None:
        print(f"{_count(len(_RECORDED), 'verdict')} in this lesson, each printed from this run's measurements "
              "and checked again here")
        return
    print(f"{_count(len(_RECORDED) + len(table), 'verdict')} in this lesson, each from this run's measurements: "
          f"{_count(len(_RECORDED), 'printed sentence')} checked again here, and {len(table)} kept in the "
          f"verdicts table with the measurements behind them")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def holds_again(record: dict[str, Any]) -> bool:
    """The recorded rule evaluated again on the recorded values: it must agree with what was said."""
    return bool(eval(record["rule"], {"__builtins__": {}, **_SAFE}, dict(record["measured"]))) == record["holds"]


def _plain(value):
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return float(value)
