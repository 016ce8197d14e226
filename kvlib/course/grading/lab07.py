"""Lab 07 checks: the learner's victim choice, on candidate lists built by hand and inside the engine.

The learner writes ``select_victim(candidates, shortfall)`` (``kvlib.interfaces.PreemptionPolicy``).
The lab states the goal and the costs, not a rule, so the checks grade consequences:

- by hand: small candidate lists where one choice is plainly cheaper under the stated costs (one
  victim instead of two, a victim whose blocks are all shared frees nothing, the requester stalls
  the oldest request); a failure says what the choice would cost;
- in the engine: two workloads with partial preemption, parallel samples and long requests that
  are prefilled in chunks while the pool is full, so a sequence is often short of several blocks
  at once (one swaps, one recomputes with prefix caching and a shared system prompt). Every call
  to ``select_victim`` is recorded with the candidates it was given. The calls that served one
  sequence in one step form an *episode*; its outcome is how many victims it took and whether the
  requester was stalled. The reference, :class:`kvlib.preemption.SparingPolicy`, is replayed on the
  same first candidate list (the engine's loop is replayed exactly: each victim gives its unique
  tail, at most the shortfall, and stays a candidate while it still holds a unique tail), so both
  are judged on the same states. The whole run's blocks swapped and tokens recomputed are compared
  with the reference's own run.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from kvlib.config import SamplingParams
from kvlib.course.grading.checks import Task, expect
from kvlib.course.grading.extract import Rules
from kvlib.course.grading.results import TaskResult
from kvlib.course.grading.workloads import Arrival, serve_timed
from kvlib.preemption import LatestArrivalPolicy, SparingPolicy, VictimCandidate
from kvlib.sequence import Sequence

RULES = Rules(needs=("MyVictimPolicy",),
              kvlib_imports={"kvlib.preemption": {"LatestArrivalPolicy", "VictimCandidate"}},
              own_methods=("select_victim",))
select_victim = Task("select_victim", RULES)
engine = Task("engine", RULES)
TASKS = [select_victim, engine]

ReferencePolicy = SparingPolicy  # replayed on the learner's own episodes; never shown to the learner's code


def check_select_victim(policy_cls) -> TaskResult:
    return select_victim.grade(policy_cls)


def check_engine(policy_cls) -> TaskResult:
    return engine.grade(policy_cls)


# ---- by hand -----------------------------------------------------------------------------------
def _candidate(name: str, arrival: float, unique: int, shared: int = 0, running: bool = True) -> VictimCandidate:
    seq = Sequence(seq_id=1000 + ord(name[0]) + len(name), request_id=name, prompt_token_ids=[3],
                   params=SamplingParams(), block_size=4, arrival_time=arrival)
    return VictimCandidate(seq, name == "R", running, unique + shared, unique, shared)


def _describe(c: VictimCandidate) -> str:
    state = "the requester" if c.is_requester else ("running" if c.running else "paused")
    return (f"{c.seq.request_id} ({state}, arrived {c.arrival_time:g}, {c.num_blocks} blocks: "
            f"{c.num_unique_tail_blocks} unique tail, {c.num_shared_blocks} shared)")


def _expect_choice(cls, candidates: list[VictimCandidate], shortfall: int, good: set[str], why: str) -> None:
    chosen = cls().select_victim(list(candidates), shortfall)
    expect(any(chosen is c for c in candidates),
           f"select_victim returned {chosen!r}; it must return one of the VictimCandidate objects it was given")
    expect(chosen.seq.request_id in good,
           f"candidates [{'; '.join(map(_describe, candidates))}], shortfall {shortfall} block(s): you chose "
           f"{chosen.seq.request_id}; {why}")


@select_victim.check(2, "a victim gives at most its unique tail; one that leaves blocks missing means a second "
                        "preemption right after it")
def one_victim_when_one_suffices(cls) -> None:
    _expect_choice(cls, [_candidate("R", 0, 2), _candidate("A", 1, 4), _candidate("B", 2, 1)], 3, {"A"},
                   "B would give 1 of the 3 missing blocks and the engine would preempt a second victim; A alone "
                   "gives all 3")
    _expect_choice(cls, [_candidate("R", 0, 1), _candidate("H", 1, 3, running=False), _candidate("B", 2, 2)], 3,
                   {"H"}, "paused H still holds a 3-block unique tail and covers the shortfall alone; B leaves one "
                          "block missing")


@select_victim.check(1, "a block that another sequence also holds is not freed when one of its holders lets go: "
                        "count only what a victim can actually give")
def shared_blocks_free_nothing(cls) -> None:
    _expect_choice(cls, [_candidate("R", 0, 1), _candidate("A", 1, 3), _candidate("B", 2, 1, shared=6)], 3, {"A"},
                   "B holds 7 blocks but 6 are shared with other samples: it would free 1, and a second victim "
                   "would follow; A frees 3")
    _expect_choice(cls, [_candidate("R", 0, 3), _candidate("A", 1, 2), _candidate("B", 2, 0, shared=4)], 1, {"A"},
                   "all of B's blocks are shared, so preempting B stalls it and frees nothing")
    _expect_choice(cls, [_candidate("R", 0, 1), _candidate("A", 1, 2), _candidate("B", 2, 1, shared=6),
                         _candidate("C", 3, 2)], 4, {"A", "C"},
                   "nobody covers the 4 blocks alone; A and C give 2 each, so two victims suffice, while B, the "
                   "largest table, frees only 1 of its 7 blocks and would make it three")


@select_victim.check(2, "the requester is the oldest running request and choosing it stalls it: take it only when "
                        "the others cannot make room; it is the candidate with is_requester, not the first in the "
                        "list")
def requester_keeps_running(cls) -> None:
    _expect_choice(cls, [_candidate("R", 0, 5), _candidate("A", 1, 2), _candidate("B", 2, 2)], 3, {"A", "B"},
                   "A and B together give the 3 blocks, so the requester R, the oldest request, can keep running")
    _expect_choice(cls, [_candidate("H", 0, 2, running=False), _candidate("R", 1, 3)], 1, {"H"},
                   "R is the requester (is_requester); paused H is older but can give the block")
    _expect_choice(cls, [_candidate("R", 0, 3)], 1, {"R"}, "R is the only candidate")


@select_victim.check(1, "when two choices cost the same, take the newer: the oldest request must always make "
                        "progress; the list is in arrival order, and samples of one request share an arrival time")
def newest_among_equals(cls) -> None:
    _expect_choice(cls, [_candidate("R", 0, 1), _candidate("A", 1, 2), _candidate("B", 2, 3)], 2, {"B"},
                   "A and B each cover the 2 blocks alone, and B arrived later")
    _expect_choice(cls, [_candidate("R", 0, 1), _candidate("A", 1, 2), _candidate("B", 1, 2)], 2, {"B"},
                   "A and B are samples of one request (same arrival time) and cost the same; B comes later in "
                   "the list, which is arrival order")


# ---- in the engine -----------------------------------------------------------------------------
def _tokens(seed: int, length: int) -> tuple[int, ...]:
    return tuple((7 * seed + 3 * j + 1) % 250 + 3 for j in range(length))


SYSTEM = tuple(range(100, 116))  # a 16-token system prompt the second workload's requests share


def _arrivals(single_prompt: int, shared_prefix: tuple, long_prompt: int) -> list[Arrival]:
    """Three single requests, then three of 3 samples (they share their prompt's blocks), decoding 32 tokens
    each; then three long requests that arrived before all of them (queued upstream) join at steps 6, 14 and
    22. Being the oldest, each is prefilled first, 32 tokens (8 blocks) a step, while the pool is full."""
    decoding = SamplingParams(max_tokens=32, ignore_eos=True)
    out = [Arrival(0, shared_prefix + _tokens(i, single_prompt), decoding, 100.0 + i, f"single-{i}") for i in range(3)]
    out += [Arrival(0, _tokens(i, 28), SamplingParams(max_tokens=32, n=3, ignore_eos=True), 100.0 + i, f"samples-{i}")
            for i in range(3, 6)]
    out += [Arrival(step, shared_prefix + _tokens(50 + k, long_prompt), SamplingParams(max_tokens=2, ignore_eos=True),
                    float(k), f"long-{k}") for k, step in enumerate((6, 14, 22))]
    return out


@dataclass(eq=False)  # one object per workload: the caches key on it
class Workload:
    name: str
    config: tuple  # EngineConfig fields
    arrivals: tuple[Arrival, ...]
    work: str  # "swapped" or "recomputed": what this workload's preemptions cost


COMMON = dict(block_size=4, max_num_batched_tokens=32, num_cpu_blocks=256, partial_preemption=True, watermark=0.0,
              device="cpu")
WORKLOADS = (
    Workload("swap", tuple(dict(COMMON, num_gpu_blocks=56, preemption_mode="swap").items()),
             tuple(_arrivals(20, (), 96)), "swapped"),
    Workload("prefix cache", tuple(dict(COMMON, num_gpu_blocks=64, preemption_mode="recompute",
                                        enable_prefix_caching=True).items()),
             tuple(_arrivals(8, SYSTEM, 80)), "recomputed"),
)
MAX_STEPS = 600


class _Recorder(LatestArrivalPolicy):
    """The engine's policy during a check: the learner's ``select_victim``, every call recorded."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.step = 0
        self.calls: list[tuple[int, int, list[VictimCandidate], VictimCandidate]] = []

    def select_victim(self, candidates: list[VictimCandidate], shortfall: int) -> VictimCandidate:
        given = [VictimCandidate(c.seq, c.is_requester, c.running, c.num_blocks, c.num_unique_tail_blocks,
                                 c.num_shared_blocks) for c in candidates]
        chosen = self.inner.select_victim(candidates, shortfall)
        position = next((i for i, c in enumerate(candidates) if c is chosen), None)
        if position is not None:
            self.calls.append((self.step, shortfall, given, given[position]))
        return chosen


@dataclass
class Episode:
    """The calls that made room for one sequence in one engine step."""

    step: int
    shortfall: int
    candidates: list[VictimCandidate]  # as the first call saw them
    victims: list[VictimCandidate]  # the learner's, as each call saw them

    @property
    def requester_stalled(self) -> bool:
        return self.victims[-1].is_requester


@dataclass
class Run:
    tokens: list
    episodes: list[Episode]
    swapped: int
    recomputed: int
    preemptions: int
    steps: int

    def work(self, kind: str) -> int:
        return self.swapped if kind == "swapped" else self.recomputed


def replay(policy, candidates: list[VictimCandidate], shortfall: int) -> list[VictimCandidate]:
    """The victims ``policy`` would take from ``candidates``, replaying the engine's loop with partial preemption."""
    candidates, victims = list(candidates), []
    while True:
        victim = policy.select_victim(list(candidates), shortfall)
        victims.append(victim)
        if victim.is_requester or len(victims) > 64:
            return victims
        given = min(shortfall, victim.num_unique_tail_blocks) if victim.num_unique_tail_blocks else victim.num_blocks
        shortfall -= given
        index = next(i for i, c in enumerate(candidates) if c is victim)
        left = victim.num_unique_tail_blocks - given
        if left > 0:
            candidates[index] = VictimCandidate(victim.seq, False, False, victim.num_blocks - given, left,
                                                victim.num_shared_blocks)
        else:
            del candidates[index]
        if shortfall <= 0:
            return victims


def _episodes(calls) -> list[Episode]:
    episodes: dict[tuple[int, int], Episode] = {}
    for step, shortfall, candidates, victim in calls:
        requester = next(c for c in candidates if c.is_requester).seq
        key = (step, id(requester))
        if key not in episodes:
            episodes[key] = Episode(step, shortfall, candidates, [])
        episodes[key].victims.append(victim)
    return list(episodes.values())


@cache
def _run(policy_cls, workload: Workload) -> Run:
    """Serve ``workload`` with ``policy_cls()`` choosing every victim, checking the bookkeeping after every step."""
    from kvlib import LLM, EngineConfig

    recorder = _Recorder(policy_cls())
    llm = LLM("default", EngineConfig(**dict(workload.config)), preemption_policy=recorder, verbose=False)
    served = serve_timed(llm, list(workload.arrivals), MAX_STEPS,
                         before_step=lambda step: setattr(recorder, "step", step))
    m = llm.metrics
    return Run([[s.token_ids for s in out.samples] for out in served.outputs], _episodes(recorder.calls),
               m.num_swapped_out_blocks, m.num_recomputed_tokens, m.num_preemptions, served.num_steps)


@cache
def _unpressured_tokens(workload: Workload) -> list:
    from kvlib import LLM, EngineConfig
    llm = LLM("default", EngineConfig(block_size=4, num_gpu_blocks=512, device="cpu"), verbose=False)
    outs = llm.generate([list(a.prompt) for a in workload.arrivals], [a.params for a in workload.arrivals])
    return [[s.token_ids for s in out.samples] for out in outs]


def _name(c: VictimCandidate) -> str:
    sample = f" sample {c.seq.sample_index}" if c.seq.params.n > 1 else ""
    state = "" if c.running else ", paused"
    return f"{c.seq.request_id}{sample} ({c.num_unique_tail_blocks} unique tail, {c.num_shared_blocks} shared{state})"


def _victims(victims: list[VictimCandidate]) -> str:
    if len(victims) == 1:
        return f"1 victim, {_name(victims[0])}"
    listed = ", ".join(map(_name, victims[:3])) + (", ..." if len(victims) > 3 else "")
    return f"{len(victims)} victims ({listed})"


@engine.check(1, "pass the select_victim checks first; whatever you choose, every request must finish with the "
                 "tokens it gets in a pool with room, and you must return one of the candidates")
def serves_every_request(cls) -> None:
    for workload in WORKLOADS:
        run = _run(cls, workload)
        expect(run.preemptions > 0, f"the {workload.name} workload was meant to preempt but did not")
        for i, (mine, expected) in enumerate(zip(run.tokens, _unpressured_tokens(workload))):
            expect(mine == expected, f"{workload.name} workload, request {i}: {mine} with your policy, {expected} "
                                     f"in a pool with room")


@engine.check(3, "a victim gives only its unique tail (shared blocks free nothing), at most the shortfall: when a "
                 "sequence is short of several blocks, a victim whose tail covers them all is one preemption "
                 "instead of several")
def covers_multi_block_shortfalls(cls) -> None:
    for workload in WORKLOADS:
        episodes = [e for e in _run(cls, workload).episodes if e.shortfall > 1]
        expect(episodes, f"the {workload.name} workload had no shortfall of several blocks with your policy")
        reference = [replay(ReferencePolicy(), e.candidates, e.shortfall) for e in episodes]
        mine, theirs = sum(len(e.victims) for e in episodes), sum(map(len, reference))
        if mine > theirs:
            episode, better = max(zip(episodes, reference), key=lambda pair: len(pair[0].victims) - len(pair[1]))
            example = (f"e.g. at step {episode.step} a sequence was short of {episode.shortfall} blocks: you took "
                       f"{_victims(episode.victims)}, where {_victims(better)} would do")
            shared = [v for v in episode.victims if v.num_blocks >= episode.shortfall > v.num_unique_tail_blocks]
            if shared:
                example += (f"; {_name(shared[0])} holds {shared[0].num_blocks} blocks, but the shared ones free "
                            f"nothing when it lets go")
            expect(False, f"{workload.name} workload: {len(episodes)} shortfalls of several blocks cost {mine} "
                          f"preemptions with your policy where {theirs} suffice on the same candidates; {example}")


@engine.check(2, "choosing the requester stalls the oldest running request; do it only when the other candidates "
                 "cannot make room (find it by is_requester)")
def spares_the_requester(cls) -> None:
    for workload in WORKLOADS:
        episodes = _run(cls, workload).episodes
        needless = [e for e in episodes if e.requester_stalled
                    and not replay(ReferencePolicy(), e.candidates, e.shortfall)[-1].is_requester]
        if needless:
            e = needless[0]
            others = sorted((c for c in e.candidates if not c.is_requester), key=lambda c: -c.num_unique_tail_blocks)
            listed = ", ".join(map(_name, others[:3])) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
            expect(False, f"{workload.name} workload: {len(needless)} of {len(episodes)} times you stalled the "
                          f"requester when the other candidates could make room; e.g. at step {e.step} "
                          f"{_name(e.candidates[[c.is_requester for c in e.candidates].index(True)])} was short of "
                          f"{e.shortfall} block(s) and the others included {listed}")


@engine.check(2, "every preemption moves blocks to the host and back or has them computed again; a choice that "
                 "preempts more often, or the requester, does more of that work")
def no_more_work(cls) -> None:
    for workload in WORKLOADS:
        mine, reference = _run(cls, workload), _run(ReferencePolicy, workload)
        allowed = int(1.25 * reference.work(workload.work)) + 8
        what = "blocks swapped out" if workload.work == "swapped" else "tokens recomputed"
        expect(mine.work(workload.work) <= allowed,
               f"{workload.name} workload: {mine.work(workload.work)} {what} and {mine.preemptions} preemptions with "
               f"your policy; the reference policy needed {reference.work(workload.work)} and "
               f"{reference.preemptions} (allowed: {allowed})")


def compare(policy_cls) -> None:
    """Print what each engine workload cost with your policy, the reference and the engine's default."""
    rows = []
    for workload in WORKLOADS:
        for name, cls in (("your policy", policy_cls), ("reference", ReferencePolicy),
                          ("LatestArrivalPolicy", LatestArrivalPolicy)):
            try:
                run = _run(cls, workload)
            except NotImplementedError as exc:
                print(f"{name}: not implemented yet ({exc})")
                continue
            several = sum(len(e.victims) for e in run.episodes if e.shortfall > 1)
            stalled = sum(e.requester_stalled for e in run.episodes)
            rows.append((workload.name, name, run.preemptions, several, stalled, run.swapped, run.recomputed,
                         run.steps))
    print(f"{'workload':<14}{'policy':<21}{'preemptions':>12}{'in shortfalls > 1':>18}{'requester':>10}"
          f"{'swapped':>9}{'recomputed':>11}{'steps':>7}")
    for row in rows:
        print(f"{row[0]:<14}{row[1]:<21}" + "".join(f"{v:>{w}}" for v, w in zip(row[2:], (12, 18, 10, 9, 11, 7))))


def show_episodes(policy_cls=LatestArrivalPolicy, workload: str = "swap", count: int = 3,
                  min_shortfall: int = 2) -> None:
    """Print the first ``count`` episodes of a workload whose shortfall is at least ``min_shortfall``: the
    candidates the engine passed (first call) and the victims ``policy_cls`` took, one call each."""
    chosen = next(w for w in WORKLOADS if w.name == workload)
    try:
        run = _run(policy_cls, chosen)
    except NotImplementedError as exc:
        print(f"not implemented yet ({exc})")
        return
    shown = [e for e in run.episodes if e.shortfall >= min_shortfall][:count]
    for e in shown:
        print(f"step {e.step}: short of {e.shortfall} block(s); candidates, oldest first:")
        for c in e.candidates:
            mark = "requester" if c.is_requester else ("running" if c.running else "paused")
            print(f"    {c.seq.request_id:<10} sample {c.seq.sample_index}  {mark:<9} {c.num_blocks:>3} blocks "
                  f"{c.num_unique_tail_blocks:>3} unique tail {c.num_shared_blocks:>3} shared")
        print(f"  {policy_cls.__name__} took {_victims(e.victims)}")
