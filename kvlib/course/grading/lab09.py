"""Lab 08 checks: the learner's oversubscription detector, alone and inside the engine.

The learner writes ``observe(metrics) -> Optional[str]`` (see :mod:`kvlib.oversubscription`):
once at least ``min_finished`` requests have finished, warn the first time preemptions per
finished request are above ``threshold``, naming both remedies, and never again. The unit checks
feed it :class:`~kvlib.metrics.EngineMetrics` built by hand; the engine checks plug it in with
``LLM(..., oversubscription_detector=...)`` and count its warnings over a whole run, in a pool
too small for the workload and in one with room.
"""
from __future__ import annotations

from kvlib.config import SamplingParams
from kvlib.course.grading.checks import Task, expect
from kvlib.course.grading.extract import Rules
from kvlib.course.grading.results import TaskResult
from kvlib.metrics import EngineMetrics

RULES = Rules(needs=('MyOversubscriptionDetector',), kvlib_imports={'kvlib.metrics': {'EngineMetrics'}}, own_methods=('observe',))
detector = Task("detector", RULES)
engine = Task("engine", RULES)
TASKS = [detector, engine]

REMEDIES = ("num_gpu_blocks", "max_num_seqs")


def check_detector(detector_cls) -> TaskResult:
    return detector.grade(detector_cls)


def check_engine(detector_cls) -> TaskResult:
    return engine.grade(detector_cls)


# ---- detector ----------------------------------------------------------------------------------
def _observe(instance, preemptions: int, finished: int):
    return instance.observe(EngineMetrics(num_preemptions=preemptions, num_finished=finished))


def _expect_answers(cls, cases: list[tuple[int, int, bool]], threshold: float = 1.0, min_finished: int = 8) -> None:
    """Each case is (preemptions, finished, warns) for a fresh detector."""
    for preemptions, finished, warns in cases:
        answer = _observe(cls(threshold=threshold, min_finished=min_finished), preemptions, finished)
        expect(bool(answer) == warns,
               f"a new detector (threshold {threshold}, min_finished {min_finished}) given {preemptions} preemptions "
               f"over {finished} finished requests returned {answer!r}; expected "
               f"{'a warning' if warns else 'None'}")


@detector.check(1, "judge nothing before min_finished requests have finished: return None, and never divide by "
                   "num_finished while it can still be 0")
def quiet_until_min_finished(cls) -> None:
    _expect_answers(cls, [(5, 0, False), (50, 7, False), (50, 8, True)])
    _expect_answers(cls, [(10, 2, False), (10, 3, True)], min_finished=3)


@detector.check(2, "the rate is num_preemptions / num_finished, and it warns only when strictly above threshold")
def rate_above_threshold(cls) -> None:
    _expect_answers(cls, [(20, 10, True), (9, 8, True), (8, 8, False), (20, 40, False)])
    _expect_answers(cls, [(20, 40, True), (10, 40, False)], threshold=0.25)


@detector.check(1, "after the first warning, keep returning None: the engine calls observe after every step, and one "
                   "alarm per run is a signal where one per step is noise")
def warns_once(cls) -> None:
    instance = cls(threshold=1.0, min_finished=8)
    answers = [_observe(instance, p, f) for p, f in [(1, 8), (15, 10), (30, 12), (60, 20)]]
    expect([bool(a) for a in answers] == [False, True, False, False],
           f"one detector given (preemptions, finished) = (1, 8), (15, 10), (30, 12), (60, 20) in turn returned "
           f"{answers}; expected None, a warning, None, None")


@detector.check(1, "the warning must say what to change: more KV capacity (num_gpu_blocks) or less concurrency "
                   "(max_num_seqs)")
def names_both_remedies(cls) -> None:
    message = _observe(cls(threshold=1.0, min_finished=8), 30, 10)
    expect(isinstance(message, str), f"the detector returned {message!r} where it should warn; expected a str")
    missing = [name for name in REMEDIES if name not in message]
    expect(not missing, f"the warning {message!r} does not mention {' or '.join(missing)}")


# ---- engine ------------------------------------------------------------------------------------
# 10 requests that each grow to 7 blocks of 2 tokens, all admitted at once: 10 blocks cannot
# hold them, and the engine preempts about twice per finished request. 256 blocks hold them all.
PROMPTS = [[3 + i, 4, 5, 6] for i in range(10)]
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)
CONFIG = dict(block_size=2, max_num_seqs=10, preemption_mode="recompute", watermark=0.0)
SMALL_POOL, ROOMY_POOL = 10, 256


class _Recording:
    """The learner's detector as the engine sees it, keeping every warning it returns."""

    def __init__(self, inner):
        self.inner = inner
        self.warnings: list[str] = []

    def observe(self, metrics: EngineMetrics):
        answer = self.inner.observe(metrics)
        if answer:
            self.warnings.append(answer)
        return answer


@engine.check(2, "an oversubscribed run must warn exactly once; pass the detector checks first")
def warns_once_when_oversubscribed(cls) -> None:
    warnings, metrics = _serve(cls, SMALL_POOL)
    rate = metrics.num_preemptions / metrics.num_finished
    expect(len(warnings) == 1, f"{metrics.num_preemptions} preemptions over {metrics.num_finished} requests "
                               f"({rate:.1f} per request) in a pool of {SMALL_POOL} blocks: your detector warned "
                               f"{len(warnings)} times, expected once")


@engine.check(1, "a run that never preempts must never warn")
def quiet_with_room(cls) -> None:
    warnings, metrics = _serve(cls, ROOMY_POOL)
    expect(not warnings, f"{metrics.num_preemptions} preemptions over {metrics.num_finished} requests in a pool of "
                         f"{ROOMY_POOL} blocks, yet your detector warned {len(warnings)} times: {warnings[:1]}")


def _serve(detector_cls, num_gpu_blocks: int) -> tuple[list[str], EngineMetrics]:
    from kvlib import LLM, EngineConfig

    recording = _Recording(detector_cls(threshold=1.0, min_finished=8))
    llm = LLM("default", EngineConfig(device="cpu", num_gpu_blocks=num_gpu_blocks, **CONFIG),
              oversubscription_detector=recording, verbose=False)
    llm.generate(PROMPTS, PARAMS)
    return recording.warnings, llm.metrics
