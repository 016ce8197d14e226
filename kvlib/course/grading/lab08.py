"""Lab 08 checks: timing on a busy machine, cost terms fitted from exact timings, the swap-or-recompute choice."""
from __future__ import annotations

import random
from collections import Counter, namedtuple
from functools import partial
from types import SimpleNamespace

import numpy as np
import torch

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.core.cost_model import PreemptionCostModel as Cost, attention_pairs
from kvlib.core.preemption import LatestArrivalPolicy, PreemptionContext, VictimCandidate
from kvlib.core.sequence import Sequence
from kvlib.course.grading.checks import Task, close, expect, same
from kvlib.course.grading.overrides import COST_CHOICE, overrides_of
from kvlib.course.grading.serving import random_tokens, serve_checked
from kvlib.runner import cost_probe

TIMING = ("kvlib.runner.cost_probe:best_in_turns", "kvlib.course.timing:compare")  # the lessons' rounds: a twin
FITS = ("kvlib.runner.cost_probe:fit_copy", "kvlib.runner.cost_probe:ForwardTimings.fit", f"{__name__}:_reference_fit_forward")
CHOICE = ("kvlib.core.cost_model:PreemptionCostModel.choose", "kvlib.core.cost_model:PreemptionCostModel.recompute_range",
          "kvlib.core.preemption:LatestArrivalPolicy.choose_mode")


def _kvlibs_timing(fns, rounds, clock):
    """kvlib's timing on the learner's interface: ``clock`` for its clock, exactly ``rounds`` rounds."""
    saved, cost_probe.time = cost_probe.time, SimpleNamespace(perf_counter=clock)
    try:
        return cost_probe.best_in_turns(fns, torch.device("cpu"), rounds, 0.0)
    finally:
        cost_probe.time = saved


def _kvlibs_copy_fit(block_counts, round_trip_seconds, block_bytes):  # from 1 and the most blocks, one way
    trips, most = dict(zip(block_counts, round_trip_seconds)), max(block_counts)
    return cost_probe.fit_copy(trips[1] / 2, trips[most] / 2, most, block_bytes)


def _reference_fit_forward(batch_tokens, alone_seconds, victim_tokens, with_victim_seconds):
    rows = np.array([(n, attention_pairs(n), 1.0, t - alone_seconds)
                     for n, t in zip(victim_tokens, with_victim_seconds)])
    per_token, per_pair, call = map(float, np.linalg.pinv(rows[:, :3]) @ rows[:, 3])
    return dict(prefill_tokens_per_s=1 / per_token, attention_seconds_per_pair=per_pair, attention_call_seconds=call,
                floor_seconds=alone_seconds - batch_tokens * per_token)


class _CostPolicy(LatestArrivalPolicy):  # kvlib's choice, asking no swap the host has no room for
    def choose_mode(self, victim: VictimCandidate, ctx: PreemptionContext) -> str:
        return super().choose_mode(victim, ctx) if ctx.host_free_blocks >= ctx.num_host_blocks else "recompute"


measure = Task("measure", ("best_in_turns",), TIMING, lambda: _kvlibs_timing)
fit_swap = Task("fit_swap", ("fit_copy",), FITS, lambda: _kvlibs_copy_fit)
fit_recompute = Task("fit_recompute", ("fit_forward",), FITS, lambda: _reference_fit_forward)
choose_mode = Task("choose_mode", ("MyCostPolicy",), CHOICE, lambda: _CostPolicy, decisions=overrides_of(COST_CHOICE))
engine = Task("engine", ("MyCostPolicy",), CHOICE, lambda: _CostPolicy, decisions=overrides_of(COST_CHOICE))
TASKS = [measure, fit_swap, fit_recompute, choose_mode, engine]
check_measure, check_fit_swap, check_fit_recompute = measure.grade, fit_swap.grade, fit_recompute.grade
check_choose_mode, check_engine = choose_mode.grade, engine.grade
TIMES, TERMS = close(1e-12, 1e-9), close(1e-15, 1e-4)  # exact inputs: every mistake is off by far more


def _floats(got, count: int, what: str) -> list[float]:
    items = None if isinstance(got, (str, bytes, dict)) or not hasattr(got, "__iter__") else list(got)
    expect(items is not None and len(items) == count, f"{what} returned {got!r}; expected {count} numbers")
    return [float(x) for x in items]


# ---- measure -----------------------------------------------------------------------------------
def _timed(timing, rng: random.Random, count: int, rounds: int, seconds, what: str) -> dict:
    """Function i's nth call, the overall-th of all, takes base[i] * seconds(i, nth, overall) on a fake clock."""
    base, now, calls = [round(rng.uniform(2e-4, 5e-3), 6) for _ in range(count)], [0.0], Counter()
    def run(i: int) -> None:
        now[0] += base[i] * seconds(i, calls[i], sum(calls.values()))
        calls[i] += 1
    got = _floats(timing([partial(run, i) for i in range(count)], rounds, lambda: now[0]), count, "best_in_turns")
    expect(all(calls[i] >= rounds for i in range(count)), f"with rounds={rounds}, best_in_turns called the "
           f"functions {[calls[i] for i in range(count)]} times; each needs at least {rounds} timed calls")
    return {f"least seconds of {count} functions of {base} s over {rounds} rounds, {what}": got}


@measure.check(1, "time each call alone with clock() just before and after it, after one untimed warm-up call, "
                  "and keep each function's least time over `rounds` rounds: load only adds", compare=TIMES)
def keeps_the_best(best_in_turns, rng: random.Random) -> dict:
    count, rounds = rng.randint(2, 4), rng.randint(4, 8)
    clean = [rng.randint(1, rounds - 1) for _ in range(count)]  # a call each that every correct timing times
    loads = [[9.0] + [0.0 if n == c else rng.uniform(0.2, 1.0) for n in range(1, 99)] for c in clean]
    return _timed(best_in_turns, rng, count, rounds, lambda i, nth, _: 1 + loads[i][nth],
                  "each call slowed by load but one, the first ten times as slow")


@measure.check(1, "call the functions in turns, one each per round: a burst of load falls on all alike", compare=TIMES)
def in_turns(best_in_turns, rng: random.Random) -> dict:
    count, rounds, slow = rng.randint(2, 3), rng.randint(4, 7), round(rng.uniform(2.0, 4.0), 2)
    busy = rng.randint(count + rounds, count * (rounds - 1))  # outlasts the warm-ups and one function's rounds
    return _timed(best_in_turns, rng, count, rounds, lambda i, nth, overall: slow if overall < busy else 1.0,
                  f"the machine {slow}x slower for the first {busy} calls")


@measure.check(1, "rounds=1: one untimed warm-up call of each function, then one timed; the warm-up is no round",
               compare=TIMES)
def one_round(best_in_turns, rng: random.Random) -> dict:
    load = [round(rng.uniform(0.1, 0.5), 3) for _ in range(rng.randint(1, 4))]
    return _timed(best_in_turns, rng, len(load), 1, lambda i, nth, _: 10.0 if nth == 0 else 1 + load[i],
                  f"the warm-up calls ten times as slow, the next slowed by {load}")


# ---- fit_swap and fit_recompute ----------------------------------------------------------------
def _copy_fits(fit_copy, rng: random.Random, term: str) -> dict:
    seen = {}
    for _ in range(3):
        cost = Cost(10 ** rng.uniform(9.7, 11.6), 1.0, copy_call_seconds=10 ** rng.uniform(-5.3, -4.3))
        size, counts = rng.choice([32768, 65536, 368640]), [1] + sorted(rng.sample(range(2, 65), rng.randint(2, 5)))
        trips = [cost.swap_seconds(n, size) for n in counts]
        got = _floats(fit_copy(list(counts), trips, size), 2, "fit_copy (copy_call_seconds, host_link_bytes_per_s)")
        seen[f"{term} fitted to round trips of {counts} blocks of {size:,} bytes, taking "
             f"{[float(f'{t * 1e6:.4g}') for t in trips]} us"] = [got[term == "host_link_bytes_per_s"]]
    return seen


def _forward_fits(fit_forward, rng: random.Random, term: str) -> dict:
    seen = {}
    for _ in range(3):  # exact passes of one CPU core (overlap 0)
        cost = Cost(1.0, 10 ** rng.uniform(3.4, 5.3), 10 ** rng.uniform(-3.5, -1.5), 0.0,
                    10 ** rng.uniform(-9.5, -6.5), 10 ** rng.uniform(-4.0, -2.7))
        batch, victims = rng.randint(2, 16), sorted(rng.sample(range(16, 513, 16), rng.randint(3, 5)))
        alone, passes = cost.pass_seconds(batch), [cost.pass_seconds(batch + n, attention_pairs(n), 1) for n in victims]
        got = fit_forward(batch, alone, list(victims), passes)
        expect(hasattr(got, "get") and term in got, f"fit_forward returned {got!r}; expected a dict with the keys "
                                                    f"{', '.join(row[-1] for row in FORWARD)}")
        seen[f"{term} fitted to a decode batch of {batch} tokens taking {alone * 1e3:.4g} ms alone, "
             f"{[float(f'{t * 1e3:.4g}') for t in passes]} ms with victims of {victims} tokens"] = [float(got[term])]
    return seen


def _register(task: Task, run, rows: list, compare=same) -> None:
    """A check per row ``(name, points, hint, *arguments)``, observing ``run(piece, rng, *arguments)``."""
    for name, points, hint, *arguments in rows:
        def scenario(piece, rng: random.Random, arguments: tuple = tuple(arguments)):
            return run(piece, rng, *arguments)
        task.add(name, points, hint, scenario, compare)


_register(fit_swap, _copy_fits, [
    ("host_link", 2, "host_link_bytes_per_s: each extra block adds its bytes crossing the link twice (out, then back "
     "in) to a round trip; the fixed part of the line is the copy calls, not bytes", "host_link_bytes_per_s"),
    ("copy_call", 1, "copy_call_seconds: one batched copy's cost whatever it carries (the intercept); a round trip "
     "makes two", "copy_call_seconds")], TERMS)
FORWARD = [
    ("prefill_speed", 2, "prefill_tokens_per_s: what each of a victim's tokens adds to the pass it joins, not a whole "
     "pass over its tokens; the victim's attention grows faster than its tokens", "prefill_tokens_per_s"),
    ("attention_per_pair", 1, "attention_seconds_per_pair: a victim of n tokens scores attention_pairs(n) pairs",
     "attention_seconds_per_pair"),
    ("attention_call", 1, "attention_call_seconds: what a victim adds whatever its length (the fit's intercept), "
     "once the batch alone is subtracted: attention runs per prefilling sequence", "attention_call_seconds"),
    ("floor", 1, "floor_seconds: what the batch's pass costs beyond its own tokens' arithmetic (every weight read "
     "once, every operation launched)", "floor_seconds")]
_register(fit_recompute, _forward_fits, FORWARD, TERMS)


# ---- choose_mode -------------------------------------------------------------------------------
Priced = namedtuple("Priced", "name cost block_bytes block_size", defaults=(16,))
SMOL = 16 * 23040  # bytes of 16 tokens of SmolLM2-135M in fp16
EAGER_GPU = Priced("an eager A100", Cost(2.52e10, 5.9e5, 1.65e-4, 1.0, 5.5e-10, 1e-4, 1e-5), SMOL)
KNEE_GPU = Priced("a GPU, 1 ms of weights", Cost(2.5e10, 2.5e5, 1e-3, 1.0, 1e-10, 0.0, 1e-5), SMOL)
ONE_CORE = Priced("one CPU core, the tiny model", Cost(8e9, 2.9e4, 3.2e-3, 0.0, 1.4e-7, 9.8e-4, 4e-5), 32768)
TIE_COST = Cost(1024, 4, 1.0, 0.0, 1 / 64, 0.25, 0.25)  # powers of two: a swap can cost exactly a recompute
# Eager GPU: short victims swap, middling ones recompute, long ones swap; one core: a swap is always cheaper.
CHEAPER = [(EAGER_GPU, 8, 16), (EAGER_GPU, 64, 200), (EAGER_GPU, 3000, 5000), (ONE_CORE, 16, 512)]


def _context(priced: Priced, num_tokens: int, batch_tokens: int = 4, host_free: int = 4096, to_copy=None):
    num_blocks = -(-num_tokens // priced.block_size)
    return PreemptionContext(num_blocks, num_tokens, num_blocks if to_copy is None else to_copy, priced.block_bytes,
                             host_free, priced.cost, batch_tokens)


def _modes(cls, rng: random.Random, cases) -> dict:
    """What ``cls(cost).choose_mode`` returns for each drawn ``(priced, context)``, keyed by victim and prices."""
    seq = Sequence(request_id="victim", prompt_token_ids=[3], params=SamplingParams(), block_size=4, arrival_time=0.0)
    victim, seen = VictimCandidate(seq, False, True, 4, 4, 0), {}
    for priced, c in cases(rng):
        prices = [priced.cost.swap_seconds(c.num_host_blocks, c.block_bytes),
                  priced.cost.recompute_seconds(c.num_tokens, c.batch_tokens)]
        mode = cls(priced.cost).choose_mode(victim, c)
        seen[f"{priced.name}: a victim of {c.num_tokens} tokens in {c.num_blocks} blocks of {c.block_bytes:,} bytes, "
             f"{c.num_host_blocks} to copy, {c.host_free_blocks} host blocks free, a decode batch of {c.batch_tokens} "
             f"(swap, recompute: {[float(f'{t:.5g}') for t in prices]} s)"] = mode if isinstance(mode, str) \
            else repr(mode)
    return seen


def _tie(rng: random.Random) -> tuple:
    """1, 2, 4 or 8 blocks of 4 tokens: the block size that makes the two prices equal is whole."""
    tokens, batch = rng.choice([*range(1, 9), *range(13, 17), *range(29, 33)]), rng.randint(1, 8)
    size = int(512 * (TIE_COST.recompute_seconds(tokens, batch) - 0.5)) // -(-tokens // 4)
    priced = Priced("a toy machine", TIE_COST, size, 4)
    return priced, _context(priced, tokens, batch)


def _room(rng: random.Random) -> list:
    tokens = rng.randint(33, 160)
    blocks = -(-tokens // 16)
    shared = rng.randint(1, blocks - 1)
    return [(ONE_CORE, _context(ONE_CORE, tokens, 4, free, copy))
            for free, copy in ((blocks - 1, blocks), (blocks, blocks), (shared, shared), (0, 0))]


_register(choose_mode, _modes, [
    ("cheaper_wins", 2, "return \"swap\" when cost_model.swap_seconds(num_host_blocks, block_bytes) is below "
     "cost_model.recompute_seconds(num_tokens, batch_tokens), else \"recompute\"",
     lambda rng: [(p, _context(p, rng.randint(low, high))) for p, low, high in CHEAPER]),
    ("tie_recomputes", 1, "a tie recomputes: swap only when it is strictly cheaper, keeping the host pool free",
     lambda rng: [_tie(rng), _tie(rng)]),
    ("in_the_batch", 1, "price recompute as what the victim's tokens add to the step they join: "
     "recompute_seconds(num_tokens, batch_tokens), not a pass of their own nor a batch of 1",
     lambda rng: [(KNEE_GPU, _context(KNEE_GPU, n, batch)) for n in [rng.randint(32, 128)]
                  for batch in (rng.randint(1, 8), rng.randint(800, 3000))]),
    ("host_room", 1, "a swap needs a free host block for each block still to copy: with host_free_blocks < "
     "num_host_blocks return \"recompute\" yourself; exactly enough room is room", _room),
    ("priced_by_what_moves", 1, "a swap copies only the blocks not on the host yet: price it by num_host_blocks, "
     "not num_blocks", lambda rng: [(EAGER_GPU, _context(EAGER_GPU, n, 4, 4096, copy))
                                    for n in [rng.randint(100, 160)] for copy in (rng.randint(1, 2), None)])])


# ---- engine ------------------------------------------------------------------------------------
def _serve(policy_cls, rng: random.Random, cost: Cost, num_cpu_blocks: int) -> dict:
    """Six drawn prompts that grow to 36 blocks or more in a pool of 12, served with ``policy_cls(cost)``."""
    prompts = [random_tokens(rng, rng.randint(5, 10)) for _ in range(6)]
    config = EngineConfig(block_size=4, num_gpu_blocks=12, num_cpu_blocks=num_cpu_blocks, preemption_mode="auto",
                          watermark=0.0, device="cpu")
    llm = LLM("default", config, preemption_policy=policy_cls(cost), verbose=False)
    outputs, m = serve_checked(llm, prompts, SamplingParams(max_tokens=16, ignore_eos=True), 500), llm.metrics
    expect(m.num_preemptions > 0, "the workload was meant to preempt but did not")
    return {"tokens of each request": [out.token_ids for out in outputs],
            f"preemptions, of them swapped ({num_cpu_blocks} host blocks)": [m.num_preemptions, m.num_preemptions_swap],
            "swaps the engine overruled for want of host room (num_swap_fallbacks)": m.num_swap_fallbacks}


FAST_LINK = Cost(1e15, 1.0, 1e-3, 0.0, copy_call_seconds=1e-9)  # a link a million times faster than the arithmetic
HIDDEN_RECOMPUTE = Cost(1e10, 1e9, 1.0, 1.0, 1e-15, copy_call_seconds=1e-3)  # weight reads of 1 s hide any victim
_register(engine, _serve, [
    ("fast_link_swaps", 2, "with a link this fast swap is always cheaper: every preemption swaps", FAST_LINK, 64),
    ("weight_reads_hide_recompute", 2, "where the pass's weight reads hide a victim's tokens, recompute costs next "
     "to nothing: every preemption recomputes (a pass of its own would pay the 1 s floor again)", HIDDEN_RECOMPUTE, 64),
    ("small_host_pool", 1, "the engine falls back to recompute when you choose swap without host room, and counts it "
     "in num_swap_fallbacks; compare host_free_blocks with num_host_blocks yourself", FAST_LINK, 3)])
