"""One ``LLM`` called from two threads: the second ``generate`` is refused at once, saying why and what to do,
and the first finishes as if alone (its engine is not thread-safe, and was never meant to be)."""
from __future__ import annotations

import threading

import pytest

from kvlib import LLM, SamplingParams


class HeldStep:
    """Wraps ``engine.step``: its first call waits until the test lets it go, so a generate is surely running."""

    def __init__(self, step):
        self.step, self.entered, self.release = step, threading.Event(), threading.Event()

    def __call__(self):
        self.entered.set()
        assert self.release.wait(60)  # only a guard against a hang
        return self.step()


def test_a_second_thread_calling_generate_is_refused_while_the_first_runs():
    llm = LLM("default", verbose=False)
    expected = LLM("default", verbose=False).generate("The KV cache is", SamplingParams(max_tokens=8))[0].token_ids
    llm.engine.step = held = HeldStep(llm.engine.step)
    first = {}
    runner = threading.Thread(target=lambda: first.update(
        out=llm.generate("The KV cache is", SamplingParams(max_tokens=8))))
    runner.start()
    assert held.entered.wait(60)
    with pytest.raises(RuntimeError, match=r"already running in another thread.*one LLM per thread.*kvlib serve"):
        llm.generate("Paging means", SamplingParams(max_tokens=4))
    held.release.set()
    runner.join()
    assert first["out"][0].token_ids == expected
    assert not llm.engine.has_unfinished_requests()


def test_generate_is_free_again_after_it_returns_or_raises():
    llm = LLM("default", verbose=False)
    results = []
    for _ in range(2):  # one thread after another: each call has the LLM to itself
        worker = threading.Thread(target=lambda: results.append(llm.generate([[5, 6]], SamplingParams(max_tokens=2))))
        worker.start()
        worker.join()
    assert len(results) == 2 and results[0][0].token_ids == results[1][0].token_ids
    with pytest.raises(TypeError):
        llm.generate(3.5)
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2))[0].token_ids == results[0][0].token_ids
