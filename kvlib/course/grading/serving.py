"""The engine half of a graded check: serve requests step by step, checking bookkeeping after each step."""
from __future__ import annotations

from kvlib.core import invariants
from kvlib.course.grading.checks import CheckFailed

TOKENS = range(3, 253)  # token ids a prompt of the default model is drawn from


def random_tokens(rng, count: int) -> list[int]:
    """A prompt of ``count`` token ids drawn from ``rng``."""
    return [rng.randrange(TOKENS.start, TOKENS.stop) for _ in range(count)]


def serve_checked(llm, prompts: list, params, max_steps: int) -> list:
    """:func:`kvlib.core.invariants.serve_checked`, a broken rule or a stall failing the check that served."""
    try:
        return invariants.serve_checked(llm, prompts, params, max_steps)
    except invariants.InvariantError as exc:
        raise CheckFailed(str(exc)) from exc
