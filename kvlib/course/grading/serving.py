"""The engine half of a graded check: serve requests step by step, checking bookkeeping after each step."""
from __future__ import annotations

import itertools

from kvlib.course.grading.checks import CheckFailed

_ids = itertools.count()  # request ids unique across calls on one engine
TOKENS = range(3, 253)  # token ids a prompt of the default model is drawn from


def random_tokens(rng, count: int) -> list[int]:
    """A prompt of ``count`` token ids drawn from ``rng``."""
    return [rng.randrange(TOKENS.start, TOKENS.stop) for _ in range(count)]


def serve_checked(llm, prompts: list, params, max_steps: int) -> list:
    """Serve ``prompts`` (one SamplingParams for all, or one each) and return their outputs in order.

    Fails the check, naming the step, as soon as a block invariant breaks, and if requests are
    still unfinished after ``max_steps`` steps (a learner's bug can stall the engine).
    """
    from kvlib.core.invariants import InvariantError, check_invariants

    per_prompt = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
    ids = [f"checked-{next(_ids)}" for _ in prompts]
    for request_id, prompt, p in zip(ids, prompts, per_prompt):
        llm.engine.add_request(request_id, prompt, p)
    finished = {}
    for step in range(max_steps):
        if not llm.engine.has_unfinished_requests():
            break
        finished.update((out.request_id, out) for out in llm.engine.step() if out.finished)
        try:
            check_invariants(llm.engine)
        except InvariantError as exc:
            raise CheckFailed(f"after engine step {step + 1}: {exc}") from exc
    else:
        raise CheckFailed(f"requests were still unfinished after {max_steps} engine steps")
    return [finished[request_id] for request_id in ids]
