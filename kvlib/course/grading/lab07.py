"""Lab 07 checks: the learner's victim choice, on candidate lists drawn from the seed and inside the engine.

The lab states goal and costs, not a rule: a choice passes when it costs no more than kvlib's SparingPolicy
(hidden while grading) on the same candidates, in victims the engine's loop takes (:func:`replay`) and stalls;
only ties (the newer; the later in the list when arrival times tie) are compared choice by choice. Candidates by
hand, drawn from the seed, and the states the engine's default policy met; then the policy serves by itself. The
sandbox sends back only which candidate each call chose; the grader replays those choices and counts the cost.
"""
from __future__ import annotations

import random
from dataclasses import replace
from functools import cache
from typing import Any, Optional

from kvlib.config import SamplingParams
from kvlib.core.preemption import LatestArrivalPolicy, VictimCandidate
from kvlib.core.sequence import Sequence
from kvlib.course.grading.checks import Task, expect, same
from kvlib.course.grading.decisions import choice_of
from kvlib.course.grading.hidden import kvlibs_own
from kvlib.course.grading.serving import random_tokens
from kvlib.course.grading.workloads import Arrival, serve_timed

HIDDEN = ("kvlib.core.preemption:SparingPolicy",)
_reference = kvlibs_own(HIDDEN[0])

select_victim, engine = (Task(name, ("MyVictimPolicy",), HIDDEN, _reference, decisions=choice_of("select_victim"))
                         for name in ("select_victim", "engine"))
TASKS = [select_victim, engine]
check_select_victim, check_engine = select_victim.grade, engine.grade


def at_most(ratio: float = 1.0, slack: int = 0):
    """Counts (victims, stalls, blocks) up to ``ratio`` x kvlib's + ``slack``, lower ones too; the rest exactly."""
    def compare(yours: Any, reference: Any, path: str = "") -> Optional[str]:
        if isinstance(reference, dict) and isinstance(yours, dict):
            return next((why for key, value in reference.items()
                         if (why := compare(yours.get(key), value, f"{path}, {key}" if path else key))), None)
        if isinstance(reference, list) and isinstance(yours, list) and len(yours) == len(reference):
            return next((why for a, b in zip(yours, reference) if (why := compare(a, b, path))), None)
        if isinstance(reference, (int, float)) and isinstance(yours, (int, float)):
            allowed = int(ratio * reference) + slack
            return None if yours <= allowed else f"{path}: yours is {yours}, kvlib's {reference} (allowed: {allowed})"
        return same(yours, reference, path)
    return compare


no_costlier = at_most()


# ---- by hand -----------------------------------------------------------------------------------
def _candidates(rng: random.Random, spec: str, tails: list, shared: Optional[list] = None) -> list[VictimCandidate]:
    """One candidate per letter of ``spec`` in arrival order: R the requester, r running, p paused, and
    = a sample of the previous request (same request, same arrival time). Names and times are drawn."""
    out, time, names = [], rng.uniform(0, 50), rng.sample(range(100, 999), len(spec))
    for i, kind in enumerate(spec):
        tie = kind == "="
        time += 0 if tie else round(rng.uniform(0.1, 9), 3)
        name, index = (out[-1].seq.request_id, out[-1].seq.sample_index + 1) if tie else (f"req-{names[i]}", 0)
        seq = Sequence(seq_id=names[i], request_id=name, prompt_token_ids=[3], params=SamplingParams(n=1 + tie),
                       block_size=4, arrival_time=time, sample_index=index)
        held = (shared or [0] * len(spec))[i]
        out.append(VictimCandidate(seq, kind == "R", kind != "p", tails[i] + held, tails[i], held))
    return out


def _name(c: VictimCandidate) -> str:
    return f"{c.seq.request_id}{f' sample {c.seq.sample_index}' if c.seq.params.n > 1 else ''}"


def _describe(candidates: list[VictimCandidate], shortfall: int) -> str:
    return "; ".join(f"{_name(c)} ({'requester' if c.is_requester else 'running' if c.running else 'paused'}, "
                     f"arrived {c.arrival_time:g}, {c.num_unique_tail_blocks} unique tail, {c.num_shared_blocks} "
                     f"shared)" for c in candidates) + f"; shortfall {shortfall}"


def replay(policy, candidates: list[VictimCandidate], shortfall: int) -> list[VictimCandidate]:
    """The victims ``policy`` takes from ``candidates``, replaying the engine's loop with partial preemption."""
    candidates, victims = list(candidates), []
    while True:
        victim = policy.select_victim(list(candidates), shortfall)
        index = next((i for i, c in enumerate(candidates) if c is victim), None)
        expect(index is not None, f"select_victim returned {victim!r}; it must return one of the VictimCandidate "
                                  f"objects it was given")
        victims.append(victim)
        if victim.is_requester or len(victims) > 64:
            return victims
        given = min(shortfall, victim.num_unique_tail_blocks) if victim.num_unique_tail_blocks else victim.num_blocks
        shortfall, left = shortfall - given, victim.num_unique_tail_blocks - given
        candidates[index:index + 1] = [replace(victim, running=False, num_blocks=victim.num_blocks - given,
                                               num_unique_tail_blocks=left)] if left > 0 else []
        if shortfall <= 0:
            return victims


def _cost_check(name: str, points: int, hint: str, shortfalls: tuple, cases) -> None:
    """A check of what the choices cost on ``cases(rng, s)``: (spec, unique tails, shared, shortfall) each."""
    def scenario(cls, rng: random.Random) -> dict:
        drawn = [(_candidates(rng, *case[:3]), case[3]) for case in cases(rng, rng.randint(*shortfalls))]
        return {f"[{_describe(c, s)}]: victims taken, requester stalled": [len(v), v[-1].is_requester]
                for c, s in drawn for v in [replay(cls(), c, s)]}
    select_victim.add(name, points, hint, scenario, compare=no_costlier)


_cost_check("one_victim_when_one_suffices", 1, "a victim gives at most its unique tail; one that leaves blocks missing "
            "means a second preemption right after it; a tail of exactly the shortfall covers it", (2, 6),
            lambda r, s: [("Rrr", [r.randint(1, 4), s + r.randint(0, 3), s - 1], None, s),
                          ("Rpr", [1, s, r.randint(1, s - 1)], None, s), ("Rrrr", [2, s, r.randrange(1, s), 1], 0, s)])
_cost_check("shared_blocks_free_nothing", 1, "a block that another sequence also holds is not freed when one of its "
            "holders lets go: count only what a victim can actually give", (3, 5),
            lambda r, s: [("Rrr", [1, s, 1], [0, 0, r.randint(s, 8)], s), ("Rrr", [3, 2, 0], [0, 0, r.randint(2, 6)], 1),
                          ("Rrrr", [1, 2, 1, 2], [0, 0, r.randint(5, 9), 0], 4)])
_cost_check("nobody_covers_alone", 1, "when nobody covers the shortfall alone, take the largest unique tails first: "
            "the fewest victims (the engine asks again after each one, with what is still missing)", (3, 6),
            lambda r, s: [("Rrrrr", [1, 1, 1, 2, s], None, s + 2), ("Rrrrr", [2, 2, 2, 3, 3], None, 6),
                          ("Rr=r", [1, 2, 2, s], None, s + 3)])
_cost_check("requester_keeps_running", 2, "the requester is the oldest running request and choosing it stalls it: take "
            "it only when the others cannot make room (their tails adding up to exactly the shortfall can); it is the "
            "candidate with is_requester, not the first in the list", (3, 6),
            lambda r, s: [("Rrr", [5, 2, s - 2], None, s), ("Rrr", [4, 1, s - 1], None, s),
                          ("pR", [r.randint(1, 3), 3], None, 1), ("R", [3], None, 1), ("Rrr", [4, 1, s - 2], None, s)])


@select_victim.check(1, "when two choices cost the same, take the newer: the oldest request must always make "
                        "progress; the list is in arrival order, and samples of one request share an arrival time")
def newest_among_equals(cls, rng: random.Random) -> dict:
    s, seen = rng.randint(2, 5), {}
    for candidates in (_candidates(rng, "Rrr", [1, s + rng.randint(0, 2), s + rng.randint(0, 2)]),
                       _candidates(rng, "Rr=", [1, s, s]), _candidates(rng, "Rr==", [1, s + 1, s, s]),
                       _candidates(rng, "Rrr", [1, s + rng.randint(1, 3), s])):
        chosen = cls().select_victim(list(candidates), s)
        seen[f"[{_describe(candidates, s)}]: your choice"] = next(
            (_name(c) for c in candidates if c is chosen), f"not one of the candidates: {chosen!r}")
    return seen


# ---- in the engine -----------------------------------------------------------------------------
COMMON = dict(block_size=4, max_num_batched_tokens=32, num_cpu_blocks=256, partial_preemption=True, watermark=0.0,
              device="cpu")
WORKLOADS = {"swap": (dict(COMMON, num_gpu_blocks=56, preemption_mode="swap"), 20, 0, 96),
             "prefix cache": (dict(COMMON, num_gpu_blocks=64, preemption_mode="recompute",
                                   enable_prefix_caching=True), 8, 16, 80)}
MAX_STEPS = 600


def _arrivals(workload: str, seed: int) -> list[Arrival]:
    """Three single requests and three of 3 samples decoding 32 tokens; then three long requests that arrived
    before them (queued upstream) join at steps 6, 14, 22 and are prefilled first, in a full pool."""
    _, single, system_length, long = WORKLOADS[workload]
    rng = random.Random(seed)
    tokens = lambda n: tuple(random_tokens(rng, n))  # noqa: E731
    system, decoding = tokens(system_length), SamplingParams(max_tokens=32, ignore_eos=True)
    return [Arrival(0, system + tokens(single), decoding, 100.0 + i, f"single-{i}") for i in range(3)] + [
        Arrival(0, tokens(28), SamplingParams(max_tokens=32, n=3, ignore_eos=True), 100.0 + i, f"samples-{i}")
        for i in range(3, 6)] + [Arrival(step, system + tokens(long), SamplingParams(max_tokens=2, ignore_eos=True),
                          float(k), f"long-{k}") for k, step in enumerate((6, 14, 22))]


class _Recorder(LatestArrivalPolicy):
    def select_victim(self, candidates: list[VictimCandidate], shortfall: int) -> VictimCandidate:  # every call kept
        self.calls.append((self.step, shortfall, [replace(c) for c in candidates]))
        return self.inner.select_victim(candidates, shortfall)


def _run(policy_cls, workload: str, seed: int) -> tuple[dict, list]:
    """Serve a workload with ``policy_cls()`` choosing every victim: what it cost, and the first call of each
    episode (the calls that made room for one sequence in one engine step)."""
    from kvlib import LLM, EngineConfig
    recorder = _Recorder()
    recorder.inner, recorder.step, recorder.calls = policy_cls(), 0, []
    llm = LLM("default", EngineConfig(**WORKLOADS[workload][0]), preemption_policy=recorder, verbose=False)
    served = serve_timed(llm, _arrivals(workload, seed), MAX_STEPS,
                         before_step=lambda step: setattr(recorder, "step", step))
    episodes, m = {}, llm.metrics
    for step, short, cands in recorder.calls:
        episodes.setdefault((step, next(c.seq.seq_id for c in cands if c.is_requester)), (step, short, cands))
    return ({"tokens of each request's samples": [[s.token_ids for s in out.samples] for out in served.outputs],
             "blocks swapped out": m.num_swapped_out_blocks, "tokens recomputed": m.num_recomputed_tokens,
             "preemptions": m.num_preemptions}, list(episodes.values()))


_recorded = cache(lambda workload, seed: _run(LatestArrivalPolicy, workload, seed)[1])  # the default's episodes


@engine.check(1, "pass the select_victim checks first; whatever you choose, every request must finish with the "
                 "tokens it gets in a pool with room, and you must return one of the candidates")
def serves_every_request(cls, rng: random.Random) -> dict:
    seed = rng.randrange(10**6)
    return {w: _run(cls, w, seed)[0]["tokens of each request's samples"] for w in WORKLOADS}


@engine.check(3, "a victim gives only its unique tail (shared blocks free nothing), at most the shortfall: when a "
                 "sequence is short of several blocks, a victim whose tail covers them all is one preemption "
                 "instead of several", compare=no_costlier)
def covers_multi_block_shortfalls(cls, rng: random.Random) -> dict:
    seed, seen = rng.randrange(10**6), {}
    for workload in WORKLOADS:
        for step, shortfall, candidates in (e for e in _recorded(workload, seed) if e[1] > 1):
            victims = replay(cls(), candidates, shortfall)
            seen[f"{workload} workload, step {step}, short of {shortfall} with {len(candidates)} candidates: "
                 f"victims taken, requester stalled"] = [len(victims), victims[-1].is_requester]
    return seen


@engine.check(2, "choosing the requester stalls the oldest running request; do it only when the other candidates "
                 "cannot make room (find it by is_requester)", compare=no_costlier)
def spares_the_requester(cls, rng: random.Random) -> dict:
    seed, seen = rng.randrange(10**6), {}
    for workload in WORKLOADS:
        episodes = _run(cls, workload, seed)[1]
        seen[f"{workload} workload: shortfalls where you stalled the requester while the "
             f"others' unique tails covered it"] = sum(
            replay(cls(), c, s)[-1].is_requester and sum(x.num_unique_tail_blocks for x in c if not x.is_requester) >= s
            for _, s, c in episodes)
    return seen


@engine.check(2, "every preemption moves blocks to the host and back or has them computed again; a choice that "
                 "preempts more often, or the requester, does more of that work", compare=at_most(1.25, 8))
def no_more_work(cls, rng: random.Random) -> dict:
    seed = rng.randrange(10**6)
    costs = {w: _run(cls, w, seed)[0] for w in WORKLOADS}
    return {"swap workload, blocks swapped out": costs["swap"]["blocks swapped out"],
            "prefix cache workload, tokens recomputed": costs["prefix cache"]["tokens recomputed"]}


def compare(policy_cls, seed: int = 0) -> None:
    """Print what each engine workload cost with your policy, kvlib's and the engine's default."""
    from kvlib.core.preemption import SparingPolicy
    for workload, cls in ((w, c) for w in WORKLOADS for c in (policy_cls, SparingPolicy, LatestArrivalPolicy)):
        try:
            print(f"{workload:<14}{cls.__name__:<21}", {k: v for k, v in _run(cls, workload, seed)[0].items()
                                                         if k != "tokens of each request's samples"})
        except NotImplementedError as exc:
            print(f"{cls.__name__}: not implemented yet ({exc})")


def show_episodes(policy_cls=LatestArrivalPolicy, workload: str = "swap", count: int = 3, min_shortfall: int = 2,
                  seed: int = 0) -> None:
    """The first ``count`` shortfalls (of ``min_shortfall`` or more) the default policy met; who policy_cls takes."""
    for step, shortfall, candidates in [e for e in _recorded(workload, seed) if e[1] >= min_shortfall][:count]:
        try:
            taken = ", ".join(map(_name, replay(policy_cls(), candidates, shortfall)))
        except NotImplementedError as exc:
            taken = f"not implemented yet ({exc})"
        print(f"step {step}: {_describe(candidates, shortfall)}\n  {policy_cls.__name__} takes {taken}")
