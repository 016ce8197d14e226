"""Progress bars over what a slow cell or command serves: they move from the first step and end full."""
from __future__ import annotations

import logging

import pytest

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.core.oversubscription import OversubscriptionDetector
from kvlib.course.pool_view import PoolRecorder
from kvlib.course.progress import TokenProgress, counting, tokens_of
from kvlib.course.timing import compare


def _llm(**pieces) -> LLM:
    return LLM("default", EngineConfig(block_size=8, num_gpu_blocks=16, num_cpu_blocks=32, preemption_mode="swap"),
               verbose=False, **pieces)


def _watch(llm, bar: TokenProgress, seen: list) -> None:
    """After every step, note (tokens the bar counted, requests that finished with tokens so far)."""
    step, finished = llm.engine.step, set()

    def watching(*args, **kwargs):
        outputs = step(*args, **kwargs)
        finished.update(out.request_id for out in outputs if out.finished and not out.rejected)
        seen.append((bar.bar.n, len(finished)))
        return outputs
    llm.engine.step = watching


def test_the_bar_counts_tokens_from_the_first_steps_and_ends_full():
    llm = _llm()
    params = [SamplingParams(max_tokens=24, ignore_eos=True)] * 6 + [SamplingParams(max_tokens=4, ignore_eos=True)]
    prompts = [[5 + i] * 12 for i in range(6)] + [[9] * 5000]  # the last one is rejected: longer than the context
    seen = []
    with TokenProgress(tokens_of(params), "tokens") as bar, bar.follow(llm):
        _watch(llm, bar, seen)
        outs = llm.generate(prompts, params)
        assert bar.bar.n == bar.bar.total == 6 * 24 + 4  # the rejected request's budget counted when it came back
    assert outs[-1].rejected
    before_any_finished = [counted for counted, finished in seen if finished == 0]
    assert before_any_finished and max(before_any_finished) > 0  # a bar over finished requests was still at 0 here
    assert [counted for counted, _ in seen] == sorted(counted for counted, _ in seen)


def test_a_request_that_stops_early_has_the_rest_of_its_budget_counted():
    greedy = _llm().generate(["The KV cache"], SamplingParams(max_tokens=40))[0].token_ids
    params = SamplingParams(max_tokens=40, stop_token_ids=[greedy[3]])
    llm = _llm()
    with TokenProgress(tokens_of(params, 4), "tokens") as bar, bar.follow(llm):
        outs = llm.generate(["The KV cache"] * 4, params)
        assert all(len(out.token_ids) <= 4 for out in outs)
        assert bar.bar.n == 4 * 40


def test_following_leaves_the_engine_as_it_was_and_a_recorder_still_records():
    llm = _llm()
    recorder = PoolRecorder(llm)
    recording = llm.engine.__dict__["step"]
    with TokenProgress(8, "tokens") as bar, bar.follow(llm):
        llm.generate(["abc"], SamplingParams(max_tokens=8, ignore_eos=True))
    assert llm.engine.__dict__["step"] is recording and "add_request" not in llm.engine.__dict__
    assert len(recorder.snapshots) > 1
    plain = _llm()
    with TokenProgress(8, "tokens") as bar, bar.follow(plain):
        pass
    assert "step" not in plain.engine.__dict__ and "add_request" not in plain.engine.__dict__


def test_an_engine_warning_is_printed_on_a_line_of_its_own_above_the_bar(capsys, monkeypatch):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # pytest's capture handlers: as in a notebook or a shell
    llm = _llm(oversubscription_detector=OversubscriptionDetector(threshold=0.0, min_finished=1))
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    assert not logging.getLogger("kvlib").hasHandlers(), "a handler here would keep the warning from the console"
    with TokenProgress(tokens_of(params, 8), "tokens") as bar, bar.follow(llm):
        llm.generate([[7 + i] * 20 for i in range(8)], params)
    assert llm.engine.oversubscription.warned
    err = capsys.readouterr().err
    lines = [line for line in err.split("\n") if "oversubscribed" in line]
    assert len(lines) == 1
    assert lines[0].split("\r")[-1].startswith("the engine is oversubscribed"), lines[0][-300:]
    assert not logging.getLogger("kvlib").handlers  # the bar's writer is gone with the bar


def test_counting_takes_a_label_a_shared_bar_or_nothing():
    params = [SamplingParams(max_tokens=6, ignore_eos=True)] * 2
    shared = TokenProgress(2 * tokens_of(params), "two runs")
    for _ in range(2):
        llm = _llm()
        with counting(shared, llm, params):
            llm.generate(["a", "b"], params)
    assert shared.bar.n == 24
    shared.close()
    llm = _llm()
    with counting(None, llm, params):
        assert "step" not in llm.engine.__dict__
    with counting("one run", llm, params):
        assert "step" in llm.engine.__dict__
    assert "step" not in llm.engine.__dict__


def test_a_comparison_shows_its_rounds_and_its_bar_ends_full(capsys):
    ticks = iter(range(10_000))
    comparison = compare({"a": lambda: None, "b": lambda: None}, min_rounds=3, max_rounds=9, budget_s=1.5,
                         until="spread", clock=lambda: next(ticks), progress="paired rounds")
    rounds = len(comparison.rounds["a"])
    assert rounds < 9
    last = capsys.readouterr().err.split("\r")[-1]
    assert last.startswith("paired rounds: 100%") and f"{rounds + 1}/{rounds + 1}" in last


@pytest.mark.parametrize("params, count, expected", [(SamplingParams(max_tokens=5, n=2), 3, 30),
                                                     ([SamplingParams(max_tokens=5), SamplingParams(max_tokens=7)], 1, 12)])
def test_tokens_of_counts_every_sample(params, count, expected):
    assert tokens_of(params, count) == expected


def test_a_notebooks_setup_silences_the_text_bars_fallback_warning():
    """Lesson 00's first bar (SmolLM2's conversion) warned "IProgress not found" where ipywidgets is missing."""
    import warnings

    from kvlib.course.notebook_setup import setup
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        setup()
        warnings.warn("IProgress not found. Please update jupyter and ipywidgets.", UserWarning)
        warnings.warn("another warning", UserWarning)
    assert [str(w.message) for w in caught] == ["another warning"]


def test_the_pool_view_shows_a_bar_over_the_frames_it_draws(capsys):
    """Lesson 06's view of two 500-block pools took 7 s to draw, silently."""
    from kvlib.course.pool_view import show
    llm = _llm()
    recorder = PoolRecorder(llm)
    llm.generate(["The KV cache"], SamplingParams(max_tokens=3, ignore_eos=True))
    frames = len(recorder.snapshots)
    capsys.readouterr()
    html = show(recorder).data
    assert "<script" in html and html.count("data:image/png;base64") == frames  # every step drawn, as before
    last = capsys.readouterr().err.split("\r")[-1]
    assert last.startswith("drawing the steps: 100%") and f"{frames}/{frames}" in last
    show(recorder, progress=False)
    assert capsys.readouterr().err == ""
