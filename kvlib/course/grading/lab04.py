"""Lab 04 checks: the learner's scheduling step (a Scheduler subclass), model-free and in the engine.

The first two tasks each run one graded method beside kvlib's own other one (only the graded one is hidden) in
the model-free driver: one scenario per rule, sizes, tokens and arrival times drawn from the seed, observing every
step's plan. The engine task runs both in ``LLM(..., scheduler=...)`` and observes every token. Every plan is
checked for invariants (no sequence twice, the token budget)."""
from __future__ import annotations

import random
from typing import Callable

from kvlib.core.model_free import ModelFreeEngine, Request
from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.core.invariants import InvariantError, check_invariants
from kvlib.core.sequence import SequenceStatus
from kvlib.course.grading.checks import FEEDBACK_SEED, CheckFailed, Task, expect
from kvlib.course.grading.hidden import hiding, kvlibs_own
from kvlib.course.grading.overrides import SCHEDULING_STEP, overrides_of
from kvlib.course.grading.serving import random_tokens, serve_checked

HIDDEN = {name: (f"kvlib.core.scheduler:Scheduler.{name}",) for name in SCHEDULING_STEP.methods}
_scheduler = kvlibs_own("kvlib.core.scheduler:Scheduler")
STEP = overrides_of(SCHEDULING_STEP)
running = Task("schedule_running", ("MyScheduler",), HIDDEN["schedule_running"], _scheduler, decisions=STEP)
waiting = Task("schedule_waiting", ("MyScheduler",), HIDDEN["schedule_waiting"], _scheduler, decisions=STEP)
engine = Task("engine", ("MyScheduler",), sum(HIDDEN.values(), ()), _scheduler, decisions=STEP)
TASKS = [running, waiting, engine]
check_schedule_running, check_schedule_waiting, check_engine = running.grade, waiting.grade, engine.grade


def with_reference_waiting(scheduler_cls) -> type:
    """``scheduler_cls`` with kvlib's own schedule_waiting (looked up now: hidden while it is graded)."""
    return type(scheduler_cls.__name__, (scheduler_cls,), {"schedule_waiting": _scheduler().schedule_waiting})


def with_reference_running(scheduler_cls) -> type:
    return type(scheduler_cls.__name__, (scheduler_cls,), {"schedule_running": _scheduler().schedule_running})


def checked(scheduler_cls) -> type:
    """``scheduler_cls`` whose every plan is checked for what must stay true."""
    class Checked(scheduler_cls):
        def schedule(self, out):
            self.by_running = 1 << 30  # the chunks schedule_running planned: all, unless schedule_waiting ran
            super().schedule(out)
            seqs = [seq for seq, _ in out.scheduled]
            twice = {_label(s) for s in seqs if seqs.count(s) > 1}
            expect(not twice, f"the plan schedules {', '.join(sorted(twice))} more than once in one step")
            budget = self.config.max_num_batched_tokens
            expect(out.num_batched_tokens <= budget, f"the plan computes {out.num_batched_tokens} tokens in one "
                                                     f"step, past the budget max_num_batched_tokens={budget}")
            for seq, n in out.scheduled:
                expect(0 < n <= seq.num_uncomputed_tokens, f"the plan gives {_label(seq)} {n} tokens, but it has "
                       f"{seq.num_uncomputed_tokens} left ({seq.num_computed_tokens} of {seq.num_tokens} computed)")
            return out

        def schedule_waiting(self, out, budget):
            self.by_running = len(out.scheduled)
            return super().schedule_waiting(out, budget)

        def make_room(self, seq, end, out):
            expect(seq.status is SequenceStatus.RUNNING,
                   f"make_room was asked to make room for {_label(seq)}, which is {seq.status.value}, not running: "
                   f"a sequence preempted earlier in this step is no longer in the running queue")
            return super().make_room(seq, end, out)

        def start(self, seq, num_new, end, out):
            expect(seq.status is SequenceStatus.RUNNING,
                   f"start was called for {_label(seq)}, which is {seq.status.value}: only a running sequence "
                   f"starts (move an admitted one to RUNNING first; one that make_room preempted, when it "
                   f"returns False, does not start)")
            return super().start(seq, num_new, end, out)
    Checked.__name__ = scheduler_cls.__name__
    return Checked


# ---- model-free scenarios ----------------------------------------------------------------------
# A scenario draws (config, requests); a request: (step it is added at, name, prompt length or tokens, max_tokens,
# samples[, arrival]); arrival is step + order / 100 unless given, all shifted by an offset drawn from the seed.
def _chunked(rng):
    budget = rng.randint(8, 12)
    return ({"num_gpu_blocks": 48, "max_num_batched_tokens": budget},
            [(1, "a", budget - rng.randint(1, 4), rng.randint(2, 4), 1), (1, "b", rng.randint(2 * budget, 3 * budget),
             2, 1), (2, "c", rng.randint(2, 4), 4, 1), (2, "d", rng.randint(budget, budget + 6), 2, 1)])


def _budget(rng):
    budget = rng.randint(8, 12)
    return ({"num_gpu_blocks": 48, "max_num_batched_tokens": budget},
            [(1, "a", budget - 1, 3, 1), (1, "b", rng.randint(2 * budget, 3 * budget), 2, 1),
             (1, "c", rng.randint(2, 5), 3, 1)])


def _swapped(w_length: int, *w_arrival: float) -> Callable:
    """o and s (3 full blocks each) run, s is swapped out as o grows; w joins at step 3 (arriving then or later)."""
    return lambda rng: ({"num_gpu_blocks": 8, "num_cpu_blocks": 16, "preemption_mode": "swap"},
                        [(1, "o", 12, 10, 1), (1, "s", 12, 6, 1), (3, "w", w_length, 3, 1, *w_arrival)])


def _overtaken(rng):
    """_swapped(4) (w may not pass s, swapped out and waiting for room), then a long prompt l and a short one v
    added together at step 11, served in that order: a skip in either queue lets a newer sequence through."""
    config, requests = _swapped(4)(rng)
    return config, requests + [(11, "l", rng.randint(17, 20), 2, 1), (11, "v", rng.randint(2, 4), 2, 1)]


def _prefix_hits(rng):
    shared = tuple(rng.randrange(3, 128) for _ in range(12))
    fresh = [rng.randrange(128, 253) for _ in range(12)]  # never a cached block's tokens
    return ({"num_gpu_blocks": 32, "enable_prefix_caching": True, "max_num_batched_tokens": 16},
            [(1, "a", shared, 4, 1), (5, "b", shared + tuple(fresh[:4]), 2, 1),
             (5, "c", shared[:8] + tuple(fresh[4:]), 2, 1)])


SCENARIOS = {
    "chunked_prefill": _chunked,  # in victim_in_the_loop, a needs its third block no later than b, takes b's
    "victim_in_the_loop": lambda rng: ({"num_gpu_blocks": 4}, [(1, "a", rng.randint(b := rng.randint(5, 7), 7), 6, 1),
                                                               (1, "b", b, 6, 1)]),
    "own_victim": lambda rng: ({"num_gpu_blocks": 5}, [(1, name, length, 13 - length, 1) for length in
                                                       [rng.randint(5, 7)] for name in "ab"]),
    "budget": _budget, "fcfs_across_queues": _swapped(16), "nobody_overtakes": _overtaken,
    "arrival_ties": _swapped(16, 1.01), "arrived_earlier": _swapped(4, 0.5),
    "max_num_seqs": lambda rng: ({"num_gpu_blocks": 32, "max_num_seqs": 3}, [
        (1, "a", rng.randint(3, 8), 3, 1), (1, "p", rng.randint(4, 8), 3, 3), (2, "q", rng.randint(2, 5), 2, 1)]),
    "watermark": lambda rng: ({"num_gpu_blocks": 10, "watermark": 0.2}, [
        (1, "a", rng.randint(17, 20), 4, 1), (1, "b", rng.randint(13, 16), 4, 1)]),
    "watermark_waived": lambda rng: ({"num_gpu_blocks": 10, "watermark": 0.2},
                                     [(1, "o", 4, 10, 1), (1, "a", 28, 12, 1), (2, "b", 4, 2, 1)]),
    "prefix_hits": _prefix_hits}
MAX_MODEL_FREE_STEPS = 200


def _label(seq) -> str:
    return seq.request_id if seq.sample_index == 0 else f"{seq.request_id}/{seq.sample_index}"


def _show(plan, k: int) -> str:  # "a: 1, b: 1 + c: 4": the first k chunks (schedule_running's) + schedule_waiting's
    parts = [", ".join(f"{_label(seq)}: {n}" for seq, n in part) for part in (plan.scheduled[:k], plan.scheduled[k:])]
    return (parts[0] + " + " * bool(parts[1]) + parts[1]).strip()


def _plans(scheduler_cls, name: str, rng: random.Random, steps: int = MAX_MODEL_FREE_STEPS) -> list[str]:
    """Each step's plan ("a: 1, b: 1 + c: 4") of scenario ``name`` drawn from ``rng``, until every request finished."""
    config, requests = SCENARIOS[name](rng)
    offset = rng.uniform(0, 1000)
    e = ModelFreeEngine(EngineConfig(**{"block_size": 4, "watermark": 0.0, **config}), scheduler=checked(scheduler_cls))
    plans = []
    for step in range(1, steps + 1):
        for order, (at, label, prompt, max_tokens, n, *arrival) in enumerate(requests):
            if at == step:
                tokens = list(prompt) if isinstance(prompt, tuple) else random_tokens(rng, prompt)
                e.add(label, Request(tokens, max_tokens, n=n, arrival=offset + (arrival or [step + order / 100])[0]))
        if not e.has_unfinished() and all(at < step for at, *_ in requests):
            return plans
        try:
            e.step()
            check_invariants(e)
        except InvariantError as exc:
            raise CheckFailed(f"after step {step}: {exc}") from exc
        plans.append(_show(e.last_plan, e.scheduler.by_running) or "nothing")
    expect(steps < MAX_MODEL_FREE_STEPS, f"requests were still unfinished after {steps} steps: your scheduler stalls")
    return plans


def compare(scheduler_cls, name: str, steps: int = 30) -> None:
    """Print each step's plan of scenario ``name`` with your scheduler beside kvlib's, to see where they part."""
    print(f"{'step':>4}  {'yours':<36}{'kvlib':<36}")
    mine = []  # what ran before a crash
    try:
        with hiding(engine.hidden):
            mine = _plans(scheduler_cls, name, random.Random(FEEDBACK_SEED), steps)
    except NotImplementedError as exc:
        print(f"      not implemented yet: {exc}")
    except Exception as exc:  # noqa: BLE001 - shown to the learner, who is debugging
        print(f"      your scheduler raised {type(exc).__name__}: {exc}")
    reference = _plans(_scheduler(), name, random.Random(FEEDBACK_SEED), steps)
    for step in range(max(len(mine), len(reference))):
        yours, theirs = (p[step] if step < len(p) else "-" for p in (mine, reference))
        print(f"{step + 1:>4}  {yours:<36}{theirs:<36}{'' if yours == theirs else '<-'}")


def _model_free(task: Task, points: int, hint: str, scenario: str) -> None:
    other = with_reference_waiting if task is running else with_reference_running  # kvlib's own other method

    def observe(cls, rng: random.Random) -> dict:
        plans = _plans(other(cls), scenario, rng)
        return {**{f"{scenario}, step {i + 1}: tokens each sequence computes": p for i, p in enumerate(plans)},
                f"{scenario}: steps until every request finished": len(plans)}
    task.add(scenario, points, hint, observe)


for _task, _points, _scenario, _hint in [
    (running, 3, "chunked_prefill", "a running sequence gets min(its uncomputed tokens, the budget left), not one "
     "token: a prompt split into chunks continues where it stopped; take what you give out of the budget"),
    (running, 2, "victim_in_the_loop", "make_room may preempt sequences later in the running list: loop over a copy "
     "of the list and skip a sequence whose status is no longer RUNNING"),
    (running, 2, "own_victim", "make_room returns False when the sequence itself was preempted: start it only "
     "when it returns True"),
    (waiting, 2, "budget", "a waiting prompt gets min(its tokens, the budget left) and the rest later; stop "
     "admitting when the budget is 0 (a sequence planned for 0 tokens is not admitted)"),
    (waiting, 2, "fcfs_across_queues", "swapped and waiting sequences form one line, oldest arrival first (both "
     "queues are sorted by (arrival_time, seq_id)): merge them, do not serve one queue before the other"),
    (waiting, 2, "arrival_ties", "two sequences with the same arrival_time go in seq_id order, whichever queue "
     "they are in: sort the line by (arrival_time, seq_id)"),
    (waiting, 2, "arrived_earlier", "a request added later may have arrived earlier (its arrival_time says when): "
     "order the line by arrival_time, not by when a sequence joined its queue nor by queue"),
    (waiting, 2, "nobody_overtakes", "stop at the first sequence that does not fit (break, not continue): a newer, "
     "smaller request must not overtake an older one waiting for room, or long requests starve"),
    (waiting, 2, "max_num_seqs", "max_num_seqs counts places, not sequences: self.running_slots (running sequences "
     "and the samples they will fork) plus the candidate's num_slots must stay within it"),
    (waiting, 2, "watermark", "while sequences run, admission must leave the watermark free: ask the block manager "
     "with use_watermark=True"),
    (waiting, 2, "watermark_waived", "use_watermark is whether anything runs *now*: decide it for each candidate, "
     "so a sequence alone in the pool may use all of it, and the next one admitted beside it may not"),
    (waiting, 2, "prefix_hits", "for a waiting sequence, ask prefix_hits first: the cached blocks are computed "
     "tokens, so its tokens to compute (and its end) start after them; pass the hits to can_admit and admit"),
]:
    _model_free(_task, _points, _hint, _scenario)

# ---- engine --------------------------------------------------------------------------------------
# Six prompts of 5 to 30 tokens in 16 blocks of 4, 16 tokens a step: chunked, and the pool runs out.
CHUNKED = dict(block_size=4, num_gpu_blocks=16, max_num_batched_tokens=16, preemption_mode="recompute", watermark=0.)
# Partial swaps: three requests share a 12-token system prompt (prefix caching), two ask for 2 samples.
SWAP = dict(block_size=4, num_gpu_blocks=20, num_cpu_blocks=48, max_num_batched_tokens=24, preemption_mode="swap",
            partial_preemption=True, enable_prefix_caching=True, watermark=0.05)
MAX_STEPS = 400


@engine.check(3, "pass the model-free checks first; in the engine, a chunked prompt must continue exactly where "
                 "it stopped and a recomputed sequence resume from its first uncomputed token")
def serves_chunked_prefills_and_recomputation(cls, rng: random.Random) -> dict:
    prompts = [random_tokens(rng, 5 + 5 * i) for i in range(6)]
    return _serve(cls, CHUNKED, prompts, [SamplingParams(max_tokens=10, ignore_eos=True)] * 6)


@engine.check(3, "pass the model-free checks first; swapped sequences resume before newer ones, samples take "
                 "their places from admission on, and prefix hits are computed tokens")
def serves_swaps_samples_and_prefix_hits(cls, rng: random.Random) -> dict:
    system = random_tokens(rng, 12)
    prompts = [system + random_tokens(rng, 3 + 4 * i) if i % 2 == 0 else random_tokens(rng, 6 + 3 * i)
               for i in range(6)]
    params = [SamplingParams(max_tokens=12, n=2 if i in (1, 4) else 1, ignore_eos=True) for i in range(6)]
    return _serve(cls, SWAP, prompts, params)


def _serve(scheduler_cls, config: dict, prompts: list, params: list) -> dict:
    llm = LLM("default", EngineConfig(device="cpu", **config), scheduler=checked(scheduler_cls), verbose=False)
    outputs = serve_checked(llm, prompts, params, MAX_STEPS)
    return {f"request {i}: tokens of each sample": [s.token_ids for s in out.samples] for i, out in enumerate(outputs)}
