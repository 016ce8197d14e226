"""Grading with the fence down: every lab's source rule (``reach_rule``) refuses, before any sandbox starts, the
imports and reaching that the tests of the sandbox's own walls submit (os, subprocess, the grading modules). Those
tests grade with it down, so that each wall is tested on its own."""
from __future__ import annotations

import contextlib

import pytest

from kvlib.course.grading import reach_rule


@contextlib.contextmanager
def without_the_fence():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reach_rule, "reaches", lambda statements: [])
        yield
