"""Lab 04 checks: the learner's scheduling step, with no model and inside the engine.

The learner writes a :class:`~kvlib.scheduler.Scheduler` subclass's ``schedule_running(out,
budget)`` and ``schedule_waiting(out, budget)`` (see ``kvlib.interfaces.SchedulingStep``). The
first two tasks each run one of them beside kvlib's own version of the other, in the model-free
driver (the real scheduler and block manager, no model), and compare the plan of every step with
the plan kvlib's scheduler makes for the same requests: one scenario per rule, so a bug costs the
rule it breaks. The engine task runs both methods in ``LLM(..., scheduler=...)`` under chunked
prefill and preemption and compares every token with kvlib's scheduler on the same workload.
Throughout, every plan is checked for what must stay true (no sequence twice, nothing past the
token budget) and the block bookkeeping after every step.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Optional

from kvlib.cli.bench.driver import ModelFreeEngine
from kvlib.cli.bench.workloads import Request
from kvlib.config import EngineConfig, SamplingParams
from kvlib.course.grading.checks import CheckFailed, Task, expect
from kvlib.course.grading.extract import Rules
from kvlib.course.grading.guards import own_work
from kvlib.course.grading.results import TaskResult
from kvlib.course.grading.serving import serve_checked
from kvlib.invariants import InvariantError, check_invariants
from kvlib.scheduler import Scheduler
from kvlib.sequence import SequenceStatus

GRADED = ("schedule_running", "schedule_waiting")
IMPORTS = {"kvlib.scheduler": {"Scheduler", "SchedulerOutput"}, "kvlib.sequence": {"Sequence", "SequenceStatus"}}
running = Task("schedule_running", Rules(needs=("MyScheduler",), kvlib_imports=IMPORTS,
                                         own_methods=("schedule_running",)))
waiting = Task("schedule_waiting", Rules(needs=("MyScheduler",), kvlib_imports=IMPORTS,
                                         own_methods=("schedule_waiting",)))
engine = Task("engine", Rules(needs=("MyScheduler",), kvlib_imports=IMPORTS, own_methods=GRADED))
TASKS = [running, waiting, engine]

# kvlib's own halves, for the task that grades the other half (taken before any check runs).
REFERENCE_RUNNING = Scheduler.schedule_running
REFERENCE_WAITING = Scheduler.schedule_waiting


def check_schedule_running(scheduler_cls) -> TaskResult:
    return running.grade(scheduler_cls)


def check_schedule_waiting(scheduler_cls) -> TaskResult:
    return waiting.grade(scheduler_cls)


def check_engine(scheduler_cls) -> TaskResult:
    return engine.grade(scheduler_cls)


def checked(scheduler_cls) -> type:
    """``scheduler_cls`` whose every plan is checked for what must stay true."""
    class Checked(scheduler_cls):
        def schedule(self, out):
            super().schedule(out)
            _expect_valid_plan(self, out)
            return out

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


def _expect_valid_plan(scheduler, out) -> None:
    seqs = [seq for seq, _ in out.scheduled]
    twice = {_label(s) for s in seqs if seqs.count(s) > 1}
    expect(not twice, f"the plan schedules {', '.join(sorted(twice))} more than once in one step")
    budget = scheduler.config.max_num_batched_tokens
    expect(out.num_batched_tokens <= budget, f"the plan computes {out.num_batched_tokens} tokens in one step, past "
                                             f"the budget max_num_batched_tokens={budget}")
    for seq, num_new in out.scheduled:
        expect(num_new > 0 and seq.num_computed_tokens + num_new <= seq.num_tokens,
               f"the plan gives {_label(seq)} {num_new} tokens, but it has {seq.num_uncomputed_tokens} "
               f"left to compute ({seq.num_computed_tokens} of {seq.num_tokens} are in the cache)")


# ---- model-free scenarios ----------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    """Requests arriving at given steps of a model-free run; ``why`` is the rule the plans follow."""

    config: tuple  # EngineConfig fields
    requests: tuple  # (step it arrives at, name, prompt length or token ids, max_tokens, samples)
    why: str


def _prompt(name: str, prompt) -> list[int]:
    if isinstance(prompt, tuple):
        return list(prompt)
    return [(31 * ord(name[0]) + 7 * j) % 250 + 3 for j in range(prompt)]


SHARED = tuple(range(40, 52))  # a 12-token prompt whose 3 blocks a later request finds in the prefix cache
SCENARIOS = {
    "chunked_prefill": Scenario(
        (("num_gpu_blocks", 32), ("max_num_batched_tokens", 10)),
        ((1, "a", 8, 3, 1), (1, "b", 20, 2, 1), (2, "c", 3, 4, 1), (2, "d", 14, 2, 1)),
        "a running sequence computes all its uncomputed tokens, up to what the budget has left: a prompt "
        "split into chunks continues from num_computed_tokens, oldest sequence first"),
    "victim_in_the_loop": Scenario(
        (("num_gpu_blocks", 4), ("max_num_batched_tokens", 64)),
        ((1, "a", 7, 6, 1), (1, "b", 7, 6, 1)),
        "when a needs a block, make_room preempts b, the newest; b is then no longer running and must not be "
        "scheduled in this step"),
    "own_victim": Scenario(
        (("num_gpu_blocks", 5), ("max_num_batched_tokens", 64)),
        ((1, "a", 7, 4, 1), (1, "b", 7, 4, 1)),
        "a takes the last free block; b is then its own victim: make_room returns False, and b is not "
        "started"),
    "budget": Scenario(
        (("num_gpu_blocks", 32), ("max_num_batched_tokens", 10)),
        ((1, "a", 8, 3, 1), (1, "b", 20, 2, 1), (1, "c", 3, 3, 1)),
        "a waiting prompt gets what the budget has left (b's first chunk is 2 tokens); once the budget is "
        "spent, nobody else is admitted"),
    "fcfs_across_queues": Scenario(
        (("num_gpu_blocks", 8), ("num_cpu_blocks", 16), ("preemption_mode", "swap")),
        ((1, "o", 12, 10, 1), (1, "s", 12, 6, 1), (3, "w", 16, 3, 1)),
        "s was swapped out and w waits; s arrived first, so s resumes first, and w, which no longer fits, waits"),
    "nobody_overtakes": Scenario(
        (("num_gpu_blocks", 8), ("num_cpu_blocks", 16), ("preemption_mode", "swap")),
        ((1, "o", 12, 10, 1), (1, "s", 12, 6, 1), (3, "w", 4, 3, 1)),
        "swapped s needs 5 blocks and waits for room; w, newer, would fit in 1, but nobody newer overtakes "
        "a sequence waiting for room"),
    "max_num_seqs": Scenario(
        (("num_gpu_blocks", 32), ("max_num_seqs", 3)),
        ((1, "a", 4, 3, 1), (1, "p", 6, 3, 3), (2, "q", 2, 2, 1)),
        "p asks for 3 samples: it takes num_slots = 3 places among max_num_seqs=3 from admission on, so it "
        "waits for a, and q waits for p's samples"),
    "watermark": Scenario(
        (("num_gpu_blocks", 10), ("watermark", 0.2)),
        ((1, "a", 20, 4, 1), (1, "b", 16, 4, 1)),
        "with a running, admitting b (4 blocks) would leave 1 block free, below the watermark of 2"),
    "watermark_waived": Scenario(
        (("num_gpu_blocks", 10), ("watermark", 0.2)),
        ((1, "o", 4, 10, 1), (1, "a", 28, 12, 1), (2, "b", 4, 2, 1)),
        "a, recomputed, resumes with 33 tokens (9 blocks): only allowed because nothing runs; once a runs, b "
        "must keep the watermark of 2 blocks"),
    "prefix_hits": Scenario(
        (("num_gpu_blocks", 32), ("enable_prefix_caching", True), ("max_num_batched_tokens", 16)),
        ((1, "a", SHARED, 4, 1), (5, "b", SHARED + (7, 8, 9, 10), 2, 1),
         (5, "c", SHARED[:8] + tuple(range(60, 68)), 2, 1)),
        "b finds a's 3 blocks in the prefix cache and computes only its last 4 tokens; c finds 2 blocks and "
        "computes 8; cached tokens cost no budget"),
}


def _label(seq) -> str:
    return seq.request_id if seq.sample_index == 0 else f"{seq.request_id}/{seq.sample_index}"


def _plan(e: ModelFreeEngine) -> dict:
    return {_label(seq): n for seq, n in e.last_plan.scheduled}


def _state(e: ModelFreeEngine) -> str:
    live = [s for seqs in e.requests.values() for s in seqs if not s.is_finished]
    parts = [f"{_label(s)} {s.status.value} with {s.num_computed_tokens} of {s.num_tokens} tokens computed, "
             f"{len(s.block_table)} device and {len(s.host_blocks)} host blocks" for s in live]
    bm = e.block_manager
    return "; ".join(parts + [f"{bm.num_free_blocks} of {bm.num_device_blocks} device blocks free"])


def _drive(scheduler_cls, scenario: Scenario, steps: Optional[int] = None):
    """Run ``scenario``; yield (step, state before it, plan) for each step, the engine after the last."""
    e = ModelFreeEngine(EngineConfig(**{"block_size": 4, "watermark": 0.0, **dict(scenario.config)}),
                        scheduler=scheduler_cls)
    step = 0
    while steps is None or step < steps:
        step += 1
        for order, (at, name, prompt, max_tokens, n) in enumerate(scenario.requests):
            if at == step:
                e.add(name, Request(_prompt(name, prompt), max_tokens, n=n, arrival=step + order / 100))
        if not e.has_unfinished() and all(at < step for at, *_ in scenario.requests):
            return
        before = _state(e)
        e.step()
        try:
            check_invariants(e)
        except InvariantError as exc:
            raise CheckFailed(f"after step {step}: {exc}") from exc
        yield step, before, _plan(e)


@cache
def _reference_plans(name: str) -> tuple:
    return tuple(plan for _, _, plan in _drive(Scheduler, SCENARIOS[name]))


def _expect_same_plans(scheduler_cls, name: str) -> None:
    scenario, expected = SCENARIOS[name], _reference_plans(name)
    with own_work(Scheduler, GRADED, scheduler_cls):
        for step, before, plan in _drive(checked(scheduler_cls), scenario, len(expected)):
            want = expected[step - 1]
            expect(plan == want, f"{name}, step {step}: you planned {_show(plan)}, kvlib's scheduler plans "
                                 f"{_show(want)}. Before the step: {before}. The rule: {scenario.why}")


def _show(plan: dict) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in plan.items()) + "}" if plan else "nothing"


def with_reference_waiting(scheduler_cls) -> type:
    return type(scheduler_cls.__name__, (scheduler_cls,), {"schedule_waiting": REFERENCE_WAITING})


def with_reference_running(scheduler_cls) -> type:
    return type(scheduler_cls.__name__, (scheduler_cls,), {"schedule_running": REFERENCE_RUNNING})


def compare(scheduler_cls, name: str, steps: int = 30) -> None:
    """Print each step's plan of ``scenario`` with your scheduler beside kvlib's, to see where they part."""
    print(f"{name}: {SCENARIOS[name].why}")
    print(f"{'step':>4}  {'yours':<36}{'kvlib':<36}")
    mine = []
    try:
        with own_work(Scheduler, GRADED, scheduler_cls):
            mine = [plan for _, _, plan in _drive(checked(scheduler_cls), SCENARIOS[name], steps)]
    except NotImplementedError as exc:
        print(f"      not implemented yet: {exc}")
    except Exception as exc:  # noqa: BLE001 - shown to the learner, who is debugging
        print(f"      your scheduler raised {type(exc).__name__}: {exc}")
    reference = _reference_plans(name)[:steps]
    for step in range(max(len(mine), len(reference))):
        yours = _show(mine[step]) if step < len(mine) else "-"
        theirs = _show(reference[step]) if step < len(reference) else "-"
        print(f"{step + 1:>4}  {yours:<36}{theirs:<36}{'' if yours == theirs else '<-'}")


# ---- schedule_running ----------------------------------------------------------------------------
@running.check(3, "a running sequence gets min(its uncomputed tokens, the budget left), not one token: a prompt "
                  "split into chunks continues where it stopped; take what you give out of the budget")
def continues_chunked_prefills(cls) -> None:
    _expect_same_plans(with_reference_waiting(cls), "chunked_prefill")


@running.check(2, "make_room may preempt sequences later in the running list: loop over a copy of the list and "
                  "skip a sequence whose status is no longer RUNNING")
def skips_preempted_sequences(cls) -> None:
    _expect_same_plans(with_reference_waiting(cls), "victim_in_the_loop")


@running.check(2, "make_room returns False when the sequence itself was preempted: start it only when it "
                  "returns True")
def respects_make_room(cls) -> None:
    _expect_same_plans(with_reference_waiting(cls), "own_victim")


# ---- schedule_waiting ----------------------------------------------------------------------------
@waiting.check(2, "a waiting prompt gets min(its tokens, the budget left) and the rest later; stop admitting "
                  "when the budget is 0 (a sequence planned for 0 tokens is not admitted)")
def admits_within_the_budget(cls) -> None:
    _expect_same_plans(with_reference_running(cls), "budget")


@waiting.check(2, "swapped and waiting sequences form one line, oldest arrival first (both queues are sorted "
                  "by (arrival_time, seq_id)): merge them, do not serve one queue before the other")
def serves_both_queues_in_arrival_order(cls) -> None:
    _expect_same_plans(with_reference_running(cls), "fcfs_across_queues")


@waiting.check(2, "stop at the first sequence that does not fit (break, not continue): a newer, smaller request "
                  "must not overtake an older one waiting for room, or long requests starve")
def stops_at_the_first_that_does_not_fit(cls) -> None:
    _expect_same_plans(with_reference_running(cls), "nobody_overtakes")


@waiting.check(2, "max_num_seqs counts places, not sequences: self.running_slots (running sequences and the "
                  "samples they will fork) plus the candidate's num_slots must stay within it")
def counts_the_samples_it_will_fork(cls) -> None:
    _expect_same_plans(with_reference_running(cls), "max_num_seqs")


@waiting.check(2, "while sequences run, admission must leave the watermark free: ask the block manager with "
                  "use_watermark=True")
def keeps_the_watermark(cls) -> None:
    _expect_same_plans(with_reference_running(cls), "watermark")


@waiting.check(2, "use_watermark is whether anything runs *now*: decide it for each candidate, so a sequence "
                  "alone in the pool may use all of it, and the next one admitted beside it may not")
def waives_the_watermark_only_when_nothing_runs(cls) -> None:
    _expect_same_plans(with_reference_running(cls), "watermark_waived")


@waiting.check(2, "for a waiting sequence, ask prefix_hits first: the cached blocks are computed tokens, so its "
                  "tokens to compute (and its end) start after them; pass the hits to can_admit and admit")
def starts_after_prefix_hits(cls) -> None:
    _expect_same_plans(with_reference_running(cls), "prefix_hits")


# ---- engine --------------------------------------------------------------------------------------
# Six requests of 5 to 30 prompt tokens in 16 blocks of 4, 16 tokens per step: long prompts are
# chunked and the pool runs out as they decode.
CHUNKED = dict(block_size=4, num_gpu_blocks=16, max_num_batched_tokens=16, preemption_mode="recompute",
               watermark=0.0)
CHUNKED_PROMPTS = [[(11 * i + 5 * j) % 250 + 3 for j in range(5 + 5 * i)] for i in range(6)]
CHUNKED_PARAMS = [SamplingParams(max_tokens=10, ignore_eos=True)] * 6
# Swap with partial preemption: two requests share a 12-token system prompt through prefix
# caching, two ask for 2 samples, 24 tokens per step.
SYSTEM = [(13 * j) % 250 + 3 for j in range(12)]
SWAP = dict(block_size=4, num_gpu_blocks=20, num_cpu_blocks=48, max_num_batched_tokens=24, preemption_mode="swap",
            partial_preemption=True, enable_prefix_caching=True, watermark=0.05)
SWAP_PROMPTS = [SYSTEM + [(7 * i + j) % 250 + 3 for j in range(3 + 4 * i)] if i % 2 == 0 else
                [(5 * i + 3 * j) % 250 + 3 for j in range(6 + 3 * i)] for i in range(6)]
SWAP_PARAMS = [SamplingParams(max_tokens=12, n=2 if i in (1, 4) else 1, ignore_eos=True) for i in range(6)]
MAX_STEPS = 400


@engine.check(3, "pass the model-free checks first; in the engine, a chunked prompt must continue exactly where "
                 "it stopped and a recomputed sequence resume from its first uncomputed token")
def serves_chunked_prefills_and_recomputation(cls) -> None:
    _expect_same_tokens(cls, "CHUNKED")


@engine.check(3, "pass the model-free checks first; swapped sequences resume before newer ones, samples take "
                 "their places from admission on, and prefix hits are computed tokens")
def serves_swaps_samples_and_prefix_hits(cls) -> None:
    _expect_same_tokens(cls, "SWAP")


WORKLOADS = {"CHUNKED": (CHUNKED, CHUNKED_PROMPTS, CHUNKED_PARAMS), "SWAP": (SWAP, SWAP_PROMPTS, SWAP_PARAMS)}


def _expect_same_tokens(cls, workload: str) -> None:
    reference = _reference_tokens(workload)
    with own_work(Scheduler, GRADED, cls):
        mine, preemptions = _serve(checked(cls), workload)
    for i, (got, want) in enumerate(zip(mine, reference)):
        expect(got == want, f"request {i} generated {got} with your scheduler but {want} with kvlib's "
                            f"({preemptions} preemptions in your run)")


@cache
def _reference_tokens(workload: str) -> list:
    return _serve(Scheduler, workload)[0]


def _serve(scheduler_cls, workload: str) -> tuple[list, int]:
    from kvlib import LLM, EngineConfig

    config, prompts, params = WORKLOADS[workload]
    llm = LLM("default", EngineConfig(device="cpu", **config), scheduler=scheduler_cls, verbose=False)
    outputs = serve_checked(llm, prompts, params, MAX_STEPS)
    return [[s.token_ids for s in out.samples] for out in outputs], llm.metrics.num_preemptions
