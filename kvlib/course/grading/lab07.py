"""Lab 06 checks: the learner's victim selection, alone and inside the engine.

The learner writes ``select_victim(candidates, shortfall)`` (see :mod:`kvlib.preemption`): take
blocks from a sequence whose unique tail covers the shortfall, never from one whose blocks are
all shared, the newest first among equals, and the requesting sequence only when nobody else
can give a block. The unit checks hand it candidate lists built here, one rule per check. The
engine checks plug the policy into a small pool with prefix caching, parallel samples and
partial preemption, and compare its tokens with a run that never preempts and its work (blocks
swapped, tokens recomputed) with :class:`ReferencePolicy`.
"""
from __future__ import annotations

from functools import cache

from kvlib.config import SamplingParams
from kvlib.course.grading.checks import Task, expect
from kvlib.course.grading.extract import Rules
from kvlib.course.grading.results import TaskResult
from kvlib.course.grading.serving import serve_checked
from kvlib.preemption import LatestArrivalPolicy, SparingPolicy, VictimCandidate
from kvlib.sequence import Sequence

RULES = Rules(needs=('MyVictimPolicy',), kvlib_imports={'kvlib.preemption': {'LatestArrivalPolicy', 'VictimCandidate'}}, own_methods=('select_victim',))
select_victim = Task("select_victim", RULES)
engine = Task("engine", RULES)
TASKS = [select_victim, engine]


def check_select_victim(policy_cls) -> TaskResult:
    return select_victim.grade(policy_cls)


def check_engine(policy_cls) -> TaskResult:
    return engine.grade(policy_cls)


ReferencePolicy = SparingPolicy  # the rule the lab asks for; the engine checks hold the learner's policy to its cost


# ---- select_victim -----------------------------------------------------------------------------
def _candidate(name: str, arrival: float, running: bool, unique: int, shared: int = 0) -> VictimCandidate:
    seq = Sequence(seq_id=ord(name), request_id=name, prompt_token_ids=[3], params=SamplingParams(), block_size=4,
                   arrival_time=arrival)
    return VictimCandidate(seq, name == "R", running, unique + shared, unique, shared)


def _describe(c: VictimCandidate) -> str:
    state = "running" if c.running else "paused"
    return f"{c.seq.request_id} ({state}, arrived {c.arrival_time:g}, {c.num_unique_tail_blocks} unique tail, " \
           f"{c.num_shared_blocks} shared)"


def _expect_choice(cls, candidates: list[VictimCandidate], shortfall: int, expected: str, why: str) -> None:
    chosen = cls().select_victim(list(candidates), shortfall)
    got = chosen.seq.request_id if isinstance(chosen, VictimCandidate) else repr(chosen)
    expect(got == expected, f"candidates [{'; '.join(map(_describe, candidates))}], shortfall {shortfall}: "
                            f"you chose {got}, expected {expected} ({why})")


@select_victim.check(2, "a candidate covers the shortfall when num_unique_tail_blocks >= shortfall; prefer those, "
                        "even when a newer one could give only part of it")
def prefers_covering_tail(cls) -> None:
    _expect_choice(cls, [_candidate("R", 0, True, 2), _candidate("A", 1, True, 4), _candidate("B", 2, True, 1)], 3,
                   "A", "only A's unique tail covers 3 blocks; B would give 1 and another victim would follow")
    _expect_choice(cls, [_candidate("R", 0, True, 1), _candidate("H", 1, False, 3), _candidate("B", 2, True, 2)], 3,
                   "H", "paused H still holds a 3-block unique tail, which covers the shortfall")


@select_victim.check(1, "among candidates that cover the shortfall, take the newest (the last in the list); if none "
                        "covers, take the newest one that can give any unique block")
def newest_among_equals(cls) -> None:
    _expect_choice(cls, [_candidate("R", 0, True, 1), _candidate("A", 1, True, 2), _candidate("B", 2, True, 3)], 2,
                   "B", "A and B both cover 2 blocks; B arrived last")
    _expect_choice(cls, [_candidate("R", 0, True, 1), _candidate("A", 1, True, 2), _candidate("B", 2, True, 1)], 3,
                   "B", "nobody covers 3 blocks; B is the newest that can give some")
    _expect_choice(cls, [_candidate("R", 0, True, 1), _candidate("A", 1, True, 2), _candidate("B", 1, True, 2)], 2,
                   "B", "A and B are samples of one request with the same arrival time; B comes later in the list")


@select_victim.check(2, "a candidate with num_unique_tail_blocks == 0 frees nothing: its blocks are all shared, so "
                        "preempting it stalls a sequence and every block stays in use")
def never_all_shared(cls) -> None:
    _expect_choice(cls, [_candidate("R", 0, True, 1), _candidate("A", 1, True, 2, 1), _candidate("B", 2, True, 0, 4)],
                   1, "A", "B is newer but all 4 of its blocks are shared")
    _expect_choice(cls, [_candidate("R", 0, True, 3), _candidate("H", 1, False, 1, 2), _candidate("B", 2, True, 0, 3)],
                   2, "H", "B gives nothing; paused H can give 1 block")


@select_victim.check(1, "the requesting sequence is the first running candidate in the list (older ones are paused "
                        "holders); return it only when no other candidate has a unique tail block")
def requester_last_resort(cls) -> None:
    _expect_choice(cls, [_candidate("R", 0, True, 3)], 1, "R", "R is the only candidate")
    _expect_choice(cls, [_candidate("R", 0, True, 2, 1), _candidate("B", 1, True, 0, 4)], 1,
                   "R", "B's blocks are all shared, so only R can free a block")
    _expect_choice(cls, [_candidate("R", 0, True, 4), _candidate("A", 1, True, 1)], 3,
                   "A", "A can give a block; R is the sequence asking for blocks, so it keeps running if it can")
    _expect_choice(cls, [_candidate("H", 0, False, 2), _candidate("R", 1, True, 3)], 1,
                   "H", "R, the first running candidate, is the requester; paused H is older and can give 2 blocks")


# ---- engine ------------------------------------------------------------------------------------
# 7 requests in 20 blocks of 4 tokens: two share a 16-token system prompt through prefix caching,
# three ask for 2 samples that share their prompt, and a 32-token step budget splits the long
# prefills. Each shape is (shares the system prompt, own prompt tokens, max_tokens, samples).
SYSTEM = list(range(40, 56))
SHAPES = [(False, 24, 10, 1), (True, 24, 16, 1), (False, 1, 5, 2), (False, 5, 9, 2), (False, 1, 9, 1),
          (False, 13, 13, 2), (True, 6, 7, 1)]
PROMPTS = [(SYSTEM if shared else []) + [(7 * i + 3 * j + 1) % 250 + 3 for j in range(length)]
           for i, (shared, length, _, _) in enumerate(SHAPES)]
PARAMS = [SamplingParams(max_tokens=tokens, n=n, ignore_eos=True) for _, _, tokens, n in SHAPES]
ENGINE_CONFIG = dict(block_size=4, num_gpu_blocks=20, num_cpu_blocks=64, preemption_mode="swap",
                     partial_preemption=True, enable_prefix_caching=True, max_num_batched_tokens=32, watermark=0.0)
MAX_STEPS = 500


@engine.check(2, "pass the select_victim checks first; whatever victim you pick, the engine must finish every "
                 "request with the tokens it produces without memory pressure")
def serves_requests(cls) -> None:
    tokens, metrics = _serve(cls)
    expect(metrics["preemptions"] > 0, "the workload was meant to preempt but did not")
    for i, (mine, expected) in enumerate(zip(tokens, _unpressured_tokens())):
        expect(mine == expected, f"request {i} generated {mine} with your policy but {expected} in a pool with room")


@engine.check(2, "a victim whose unique tail covers the shortfall stalls one sequence; a short tail means another "
                 "victim, and a fully shared one frees nothing: both mean more blocks swapped later")
def no_more_work_than_reference(cls) -> None:
    _, mine = _serve(cls)
    reference = _serve(ReferencePolicy)[1]
    default = _serve(LatestArrivalPolicy)[1]
    print(f"{'':<20}{'preemptions':>12}{'blocks swapped out':>20}{'tokens recomputed':>19}")
    for name, m in (("your policy", mine), ("reference", reference), ("LatestArrivalPolicy", default)):
        print(f"{name:<20}{m['preemptions']:>12}{m['swapped']:>20}{m['recomputed']:>19}")
    for key, what in (("swapped", "blocks swapped out"), ("recomputed", "tokens recomputed")):
        expect(mine[key] <= reference[key], f"your policy caused {mine[key]} {what}, the reference {reference[key]}")


@cache
def _unpressured_tokens() -> tuple:
    from kvlib import LLM, EngineConfig
    llm = LLM("default", EngineConfig(block_size=4, num_gpu_blocks=256, device="cpu"), verbose=False)
    return tuple([s.token_ids for s in out.samples] for out in llm.generate(PROMPTS, PARAMS))


@cache
def _serve(policy_cls) -> tuple[list, dict]:
    """Serve the workload step by step with ``policy_cls()``, checking block bookkeeping after every step."""
    from kvlib import LLM, EngineConfig

    llm = LLM("default", EngineConfig(device="cpu", **ENGINE_CONFIG), preemption_policy=policy_cls(),
              verbose=False)
    outputs = serve_checked(llm, PROMPTS, PARAMS, MAX_STEPS)
    m = llm.metrics
    return ([[s.token_ids for s in out.samples] for out in outputs],
            dict(preemptions=m.num_preemptions, swapped=m.num_swapped_out_blocks, recomputed=m.num_recomputed_tokens))
