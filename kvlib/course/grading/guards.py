"""Checks that run a learner's subclass of a kvlib class with the graded methods of the base refused.

Some labs hand the learner a seam: a subclass of ``Scheduler`` or ``BlockManager`` whose graded
methods the learner writes (``Rules.own_methods``). The extractor refuses ``super().method``;
:func:`own_work` also refuses the other way to reach the base's own version, naming the class
(``Scheduler.schedule_running(self, ...)``), while the learner's code runs in a check.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from kvlib.course.grading.checks import CheckFailed


@contextmanager
def own_work(base: type, names: tuple[str, ...]) -> Iterator[None]:
    """While the block runs, calling ``base.<name>`` for any of ``names`` fails the check."""
    saved = {name: base.__dict__[name] for name in names}

    def refused(name: str):
        def call(*args, **kwargs):
            raise CheckFailed(f"your code calls kvlib's own {base.__name__}.{name}: a graded method must do its "
                              f"work itself, with the actions the lab lists")
        return call

    for name in names:
        setattr(base, name, refused(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(base, name, method)
