"""Lab 08 checks: timing on a busy machine, the cost model's terms fitted from timings, and the choice.

The learner writes ``best_in_turns(fns, rounds, clock)``; ``fit_copy`` and ``fit_forward``,
which recover the terms of :class:`~kvlib.cost_model.PreemptionCostModel` from round trips of
batched block copies and from forward passes of a decode batch with and without a victim's
tokens; and ``MyCostPolicy.choose_mode``, the swap-or-recompute choice of
:class:`kvlib.interfaces.PreemptionPolicy`.

The timing checks hand ``best_in_turns`` functions whose calls take scripted seconds on a fake
clock, with load that only adds. The fit checks hand it timings that a cost model with known terms
produces, one check per term, and name the mistake a wrong value matches. The choice is asked on
contexts on both sides of two crossovers, at an exact tie, inside and past a GPU's knee, and with
and without room on the host. The engine checks serve one workload under three cost models that
leave one right answer each, token for token against a run with room and without the engine's
swap fallback. While the choice is graded, kvlib's own choice (``PreemptionCostModel.choose``,
``recompute_range``) refuses to answer.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from functools import cache

import numpy as np

from kvlib.config import SamplingParams
from kvlib.cost_model import PreemptionCostModel, attention_pairs
from kvlib.course.grading.checks import Task, expect
from kvlib.course.grading.extract import Rules
from kvlib.course.grading.guards import own_work
from kvlib.course.grading.results import TaskResult
from kvlib.course.grading.serving import serve_checked
from kvlib.preemption import PreemptionContext, VictimCandidate
from kvlib.sequence import Sequence

FIT_IMPORTS = {"kvlib.cost_model": {"attention_pairs"}}
POLICY_IMPORTS = {"kvlib.preemption": {"LatestArrivalPolicy", "PreemptionContext", "PreemptionCostModel",
                                        "VictimCandidate"},
                  "kvlib.cost_model": {"PreemptionCostModel", "attention_pairs"}}
POLICY_RULES = Rules(needs=("MyCostPolicy",), kvlib_imports=POLICY_IMPORTS, own_methods=("choose_mode",))
measure = Task("measure", Rules(needs=("best_in_turns",)))
fit_swap = Task("fit_swap", Rules(needs=("fit_copy",), kvlib_imports=FIT_IMPORTS))
fit_recompute = Task("fit_recompute", Rules(needs=("fit_forward",), kvlib_imports=FIT_IMPORTS))
choose_mode = Task("choose_mode", POLICY_RULES)
engine = Task("engine", POLICY_RULES)
TASKS = [measure, fit_swap, fit_recompute, choose_mode, engine]

REL_TOL = 1e-4  # a fit in float64 recovers exact timings to ~1e-12; every mistake below is off by far more


def check_measure(best_in_turns) -> TaskResult:
    return measure.grade(best_in_turns)


def check_fit_swap(fit_copy) -> TaskResult:
    return fit_swap.grade(fit_copy)


def check_fit_recompute(fit_forward) -> TaskResult:
    return fit_recompute.grade(fit_forward)


def check_choose_mode(policy_cls) -> TaskResult:
    return choose_mode.grade(policy_cls)


def check_engine(policy_cls) -> TaskResult:
    return engine.grade(policy_cls)


# ---- measure -----------------------------------------------------------------------------------
class Bench:
    """Functions whose calls take scripted seconds on a fake clock, the clock, and the order they ran in.

    ``seconds(fn, nth, overall)`` is what the ``nth`` call of function ``fn`` takes when it is the
    ``overall``-th call of any function; only calls move the clock.
    """

    def __init__(self, count: int, seconds):
        self.now, self.order, self.calls, self._seconds = 0.0, [], Counter(), seconds
        self.fns = [self._function(i) for i in range(count)]

    def clock(self) -> float:
        return self.now

    def _function(self, i: int):
        def run() -> None:
            self.now += self._seconds(i, self.calls[i], len(self.order))
            self.calls[i] += 1
            self.order.append(i)
        return run


def _expect_best(got, expected: list[float], what: str) -> None:
    listed = _listed(got)
    expect(listed is not None and len(listed) == len(expected),
           f"best_in_turns returned {got!r} for {len(expected)} functions; expected a list of {len(expected)} seconds")
    for i, (mine, best) in enumerate(zip(listed, expected)):
        expect(_close(mine, best, 1e-9), f"{what}: function {i} took {best * 1e3:g} ms at best, but best_in_turns "
                                         f"returned {_ms(mine)} for it")


def _ms(value) -> str:
    number = _number(value)
    return f"{number * 1e3:g} ms" if number is not None else repr(value)


# Extra load per call, a share of the function's own time: the first call is slow (a warm-up), and
# each function has one clean call, at a different place, among the first rounds.
LOADS = [[9.0, 0.6, 0.3, 0.8, 0.0, 0.5, 0.7], [9.0, 0.4, 0.9, 0.0, 0.6, 0.2, 0.5], [9.0, 0.3, 0.5, 0.7, 0.8, 0.0, 0.4]]
BEST = [1e-3, 4e-3, 0.5e-3]
ROUNDS = 6


@measure.check(1, "time each call alone with clock() just before and after it, run at least `rounds` rounds, and "
                  "keep each function's least time: load from other processes only ever adds time")
def keeps_the_best(best_in_turns) -> None:
    bench = Bench(3, lambda i, nth, overall: BEST[i] * (1 + (LOADS[i][nth] if nth < len(LOADS[i]) else 1.0)))
    got = best_in_turns(bench.fns, ROUNDS, bench.clock)
    few = {i: n for i, n in sorted(bench.calls.items()) if n < ROUNDS}
    expect(not few, f"with rounds={ROUNDS}, best_in_turns called the functions {dict(sorted(bench.calls.items()))} "
                    f"times, a warm-up included; each needs at least {ROUNDS} timed calls")
    _expect_best(got, BEST, "each call took the function's own time plus load from other processes, "
                            "its first call ten times as long")


BUSY_CALLS = 8  # the machine is busy for the first calls, then quiet
TURN_BEST = [2e-3, 1e-3]


@measure.check(1, "run the functions in turns, one call of each per round: a burst of load from another process "
                  "then falls on all of them alike, instead of on whichever was being timed")
def in_turns(best_in_turns) -> None:
    bench = Bench(2, lambda i, nth, overall: TURN_BEST[i] * (3.0 if overall < BUSY_CALLS else 1.0))
    got = best_in_turns(bench.fns, ROUNDS, bench.clock)
    order = "".join(map(str, bench.order))
    _expect_best(got, TURN_BEST, f"the machine was busy (3x slower) for the first {BUSY_CALLS} calls, which ran "
                                 f"in the order {order}")


# ---- fit_swap ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CopyMachine:
    name: str
    copy_call_seconds: float
    host_link_bytes_per_s: float
    block_bytes: int
    block_counts: tuple[int, ...]

    @property
    def round_trips(self) -> list[float]:
        """Seconds of one batched copy out and one back in, as the engine's cost model prices a swap."""
        cost = PreemptionCostModel(self.host_link_bytes_per_s, 1.0, copy_call_seconds=self.copy_call_seconds)
        return [cost.swap_seconds(n, self.block_bytes) for n in self.block_counts]

    def describe(self) -> str:
        return (f"{self.name}: round trips of {list(self.block_counts)} blocks of {self.block_bytes:,} bytes took "
                f"{', '.join(f'{t * 1e6:.4g}' for t in self.round_trips)} us")

    def mistakes(self) -> dict[str, dict[str, float]]:
        """The terms that common mistakes give."""
        n, t = np.array(self.block_counts, float), np.array(self.round_trips)
        slope, intercept = np.polyfit(n, t, 1)
        origin = float(n @ t / (n @ n))
        bb = self.block_bytes
        return {"a line through the origin (the copy calls' fixed cost counted as bytes)": {
                    "copy_call_seconds": 0.0, "host_link_bytes_per_s": 2 * bb / origin},
                "a line through the origin, and a round trip taken for one crossing": {
                    "host_link_bytes_per_s": bb / origin},
                "a round trip taken for one crossing of the link (it crosses twice)": {
                    "host_link_bytes_per_s": bb / slope},
                "a round trip taken for one copy call (it makes two)": {"copy_call_seconds": intercept},
                "a link counted in blocks per second, not bytes": {"host_link_bytes_per_s": 2 / slope},
                "the longest round trip alone": {"host_link_bytes_per_s": 2 * bb * n[-1] / t[-1]}}


COPY_MACHINES = [
    CopyMachine("one CPU core copying the tiny model's blocks", 4e-5, 8e9, 32768, (1, 2, 4, 8, 16, 32)),
    CopyMachine("a GPU on PCIe 4.0 copying SmolLM2's blocks", 1e-5, 2.52e10, 368640, (3, 5, 9, 17, 33)),
    CopyMachine("a GPU on NVLink-C2C copying SmolLM2's blocks", 6e-6, 3.6e11, 368640, (2, 8, 32, 128)),
]


def _copy_fit(fit_copy, machine: CopyMachine) -> tuple:
    got = fit_copy(list(machine.block_counts), machine.round_trips, machine.block_bytes)
    fitted = _listed(got)
    expect(fitted is not None and len(fitted) == 2,
           f"fit_copy returned {got!r}; expected (copy_call_seconds, host_link_bytes_per_s)")
    return tuple(fitted)


@fit_swap.check(2, "host_link_bytes_per_s: each extra block adds its bytes crossing the link twice (out, then back "
                   "in) to a round trip; the fixed part of the line is the copy calls, not bytes")
def host_link(fit_copy) -> None:
    for machine in COPY_MACHINES:
        _, link = _copy_fit(fit_copy, machine)
        _expect_term("host_link_bytes_per_s", link, machine.host_link_bytes_per_s, "bytes/s", machine.describe(),
                     {why: terms["host_link_bytes_per_s"] for why, terms in machine.mistakes().items()
                      if "host_link_bytes_per_s" in terms})


@fit_swap.check(1, "copy_call_seconds: what one batched copy costs whatever it carries; a round trip makes two")
def copy_call(fit_copy) -> None:
    for machine in COPY_MACHINES:
        call, _ = _copy_fit(fit_copy, machine)
        _expect_term("copy_call_seconds", call, machine.copy_call_seconds, "s", machine.describe(),
                     {why: terms["copy_call_seconds"] for why, terms in machine.mistakes().items()
                      if "copy_call_seconds" in terms})


# ---- fit_recompute -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ForwardMachine:
    """A CPU core's passes, from known terms: arithmetic and weight reads add up there (overlap 0)."""

    name: str
    floor_seconds: float
    prefill_tokens_per_s: float
    attention_seconds_per_pair: float
    attention_call_seconds: float
    batch_tokens: int
    victim_tokens: tuple[int, ...]

    @property
    def cost(self) -> PreemptionCostModel:
        return PreemptionCostModel(1.0, self.prefill_tokens_per_s, self.floor_seconds, 0.0,
                                   self.attention_seconds_per_pair, self.attention_call_seconds)

    @property
    def alone(self) -> float:
        return self.cost.pass_seconds(self.batch_tokens)

    @property
    def with_victim(self) -> list[float]:
        return [self.cost.pass_seconds(self.batch_tokens + n, attention_pairs(n), 1) for n in self.victim_tokens]

    def describe(self) -> str:
        return (f"{self.name}: a decode batch of {self.batch_tokens} tokens took {self.alone * 1e3:.4g} ms alone and "
                f"{', '.join(f'{t * 1e3:.4g}' for t in self.with_victim)} ms with victims of "
                f"{list(self.victim_tokens)} tokens")

    def mistakes(self) -> dict[str, dict[str, float]]:
        """The terms that common mistakes give."""
        b, lengths = self.batch_tokens, np.array(self.victim_tokens, float)
        added = np.array(self.with_victim) - self.alone
        pairs = np.array([attention_pairs(int(n)) for n in lengths], float)
        ones = np.ones_like(lengths)
        no_attention = np.linalg.lstsq(np.stack([lengths, ones], 1), added, rcond=None)[0]
        no_call = np.linalg.lstsq(np.stack([lengths, pairs], 1), added, rcond=None)[0]
        with_pass = np.linalg.lstsq(np.stack([lengths, pairs, ones], 1), np.array(self.with_victim), rcond=None)[0]
        return {
            "a whole pass divided by its tokens (a per-pass cost, not what each token adds)": {
                "prefill_tokens_per_s": (b + lengths[-1]) / self.with_victim[-1]},
            "the decode batch's pass divided by its tokens": {"prefill_tokens_per_s": b / self.alone},
            "a fit that leaves attention out": {"prefill_tokens_per_s": 1 / no_attention[0],
                                                "attention_seconds_per_pair": 0.0,
                                                "attention_call_seconds": no_attention[1]},
            "a fit that leaves the attention call out": {"prefill_tokens_per_s": 1 / no_call[0],
                                                         "attention_seconds_per_pair": no_call[1],
                                                         "attention_call_seconds": 0.0},
            "a fit to the passes with the victim, the batch alone not subtracted": {
                "attention_call_seconds": with_pass[2]},
            "leaving the floor out": {"floor_seconds": 0.0},
            "the batch's whole pass, its tokens' arithmetic included": {"floor_seconds": self.alone},
        }


FORWARD_MACHINES = [
    ForwardMachine("one laptop core, the tiny model", 3.2e-3, 2.9e4, 1.4e-7, 9.8e-4, 8, (16, 64, 128, 256)),
    ForwardMachine("one desktop core", 8e-4, 2.1e5, 2e-8, 1.5e-4, 4, (32, 96, 160, 224, 512)),
    ForwardMachine("one laptop core, SmolLM2-135M", 4e-2, 2.5e3, 5e-7, 2e-3, 16, (16, 48, 128)),
]
FORWARD_TERMS = ("prefill_tokens_per_s", "attention_seconds_per_pair", "attention_call_seconds", "floor_seconds")
UNITS = {"prefill_tokens_per_s": "tokens/s", "attention_seconds_per_pair": "s per pair",
         "attention_call_seconds": "s", "floor_seconds": "s"}


def _expect_forward_term(fit_forward, term: str) -> None:
    for machine in FORWARD_MACHINES:
        got = fit_forward(machine.batch_tokens, machine.alone, list(machine.victim_tokens), machine.with_victim)
        expect(hasattr(got, "get") and term in got,
               f"fit_forward returned {got!r}; expected a dict with the keys {', '.join(FORWARD_TERMS)}")
        _expect_term(term, got[term], getattr(machine, term), UNITS[term], machine.describe(),
                     {why: terms[term] for why, terms in machine.mistakes().items() if term in terms})


@fit_recompute.check(2, "prefill_tokens_per_s: what each of a victim's tokens adds to the pass it joins, not a "
                        "whole pass over its tokens; the victim's attention grows faster than its tokens")
def prefill_speed(fit_forward) -> None:
    _expect_forward_term(fit_forward, "prefill_tokens_per_s")


@fit_recompute.check(1, "attention_seconds_per_pair: a victim of n tokens scores attention_pairs(n) = n(n+1)/2 "
                        "(query, key) pairs, so what it adds grows with n squared")
def attention_per_pair(fit_forward) -> None:
    _expect_forward_term(fit_forward, "attention_seconds_per_pair")


@fit_recompute.check(1, "attention_call_seconds: what a victim adds whatever its length, once the batch alone is "
                        "subtracted: the pass attends for the prefilling sequence separately")
def attention_call(fit_forward) -> None:
    _expect_forward_term(fit_forward, "attention_call_seconds")


@fit_recompute.check(1, "floor_seconds: what the batch's pass costs beyond its own tokens' arithmetic (every weight "
                        "read once, every operation launched), however few tokens it carries")
def floor(fit_forward) -> None:
    _expect_forward_term(fit_forward, "floor_seconds")


def _expect_term(term: str, got, true: float, unit: str, where: str, mistakes: dict[str, float]) -> None:
    number = _number(got)
    expect(number is not None, f"{term}: got {got!r}, expected a number ({where})")
    if _close(number, true, REL_TOL):
        return
    why = next((why for why, value in mistakes.items()
                if not _close(value, true, 1e-2) and _close(number, value, 1e-3)), None)
    expect(False, f"{term}: got {number:.4g}, expected {true:.4g} {unit} ({where})"
                  + (f"; {number:.4g} is what {why} gives" if why else ""))


def _listed(value):
    """``value`` as a list (a list, a tuple, an array ...), or None when it is not a sequence."""
    if isinstance(value, (str, bytes, dict)):
        return None
    try:
        return list(value)
    except TypeError:
        return None


def _number(value):
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else number


def _close(got, expected: float, rel_tol: float) -> bool:
    number = _number(got)
    return number is not None and math.isclose(number, expected, rel_tol=rel_tol, abs_tol=1e-15)


# ---- choose_mode -------------------------------------------------------------------------------
SMOL_BLOCK = 16 * 23040  # 16 tokens of SmolLM2-135M in fp16: 30 layers, K and V, 3 heads of 64
TINY_BLOCK = 32768  # 16 tokens of the built-in model in fp32


@dataclass(frozen=True)
class Priced:
    name: str
    cost: PreemptionCostModel
    block_bytes: int
    block_size: int = 16


# An eager GPU serving SmolLM2 (its figures rounded from an A100's published ones, plus a launch
# cost per prefill): short victims swap (the attention call outweighs two small copies), middling
# ones recompute under the weight reads, long ones swap again (attention grows with n squared).
EAGER_GPU = Priced("an eager A100 serving SmolLM2", PreemptionCostModel(
    host_link_bytes_per_s=2.52e10, prefill_tokens_per_s=5.9e5, floor_seconds=1.65e-4, overlap=1.0,
    attention_seconds_per_pair=5.5e-10, attention_call_seconds=1e-4, copy_call_seconds=1e-5), SMOL_BLOCK)
# A GPU whose pass reads weights for 1 ms: below the knee (250 tokens) a victim's arithmetic hides.
KNEE_GPU = Priced("a GPU whose weight reads take 1 ms", PreemptionCostModel(
    host_link_bytes_per_s=2.5e10, prefill_tokens_per_s=2.5e5, floor_seconds=1e-3, overlap=1.0,
    attention_seconds_per_pair=1e-10, attention_call_seconds=0.0, copy_call_seconds=1e-5), SMOL_BLOCK)
# One CPU core: a swap is a memory copy, always the cheaper option.
ONE_CORE = Priced("one CPU core serving the tiny model", PreemptionCostModel(
    host_link_bytes_per_s=8e9, prefill_tokens_per_s=2.9e4, floor_seconds=3.2e-3, overlap=0.0,
    attention_seconds_per_pair=1.4e-7, attention_call_seconds=9.8e-4, copy_call_seconds=4e-5), TINY_BLOCK)
# Every number a power of two: a victim of 8 tokens in 2 blocks costs exactly 2.8125 s either way.
TOY = Priced("a toy machine", PreemptionCostModel(
    host_link_bytes_per_s=1024, prefill_tokens_per_s=4, floor_seconds=1.0, overlap=0.0,
    attention_seconds_per_pair=1 / 64, attention_call_seconds=0.25, copy_call_seconds=0.25), 592, block_size=4)


def _victim() -> VictimCandidate:
    seq = Sequence(request_id="victim", prompt_token_ids=[3], params=SamplingParams(), block_size=4, arrival_time=0.0)
    return VictimCandidate(seq, is_requester=False, running=True, num_blocks=4, num_unique_tail_blocks=4,
                           num_shared_blocks=0)


def _context(priced: Priced, num_tokens: int, batch_tokens: int = 4, host_free_blocks: int = 4096,
             num_host_blocks=None) -> PreemptionContext:
    num_blocks = -(-num_tokens // priced.block_size)
    return PreemptionContext(num_blocks=num_blocks, num_tokens=num_tokens,
                             num_host_blocks=num_blocks if num_host_blocks is None else num_host_blocks,
                             block_bytes=priced.block_bytes, host_free_blocks=host_free_blocks,
                             cost_model=priced.cost, batch_tokens=batch_tokens)


def _describe(priced: Priced, c: PreemptionContext) -> str:
    shared = "" if c.num_host_blocks == c.num_blocks else f" ({c.num_host_blocks} of them still to copy to the host)"
    return (f"{priced.name}: a victim of {c.num_tokens} tokens in {c.num_blocks} blocks of {c.block_bytes:,} bytes"
            f"{shared}, a decode batch of {_count(c.batch_tokens, 'token')}, {c.host_free_blocks} host blocks free")


def _count(n: int, what: str) -> str:
    return f"{n:,} {what}" + ("" if n == 1 else "s")


def _prices(priced: Priced, c: PreemptionContext) -> str:
    swap = priced.cost.swap_seconds(c.num_host_blocks, c.block_bytes)
    recompute = priced.cost.recompute_seconds(c.num_tokens, c.batch_tokens)
    scale, unit = (1, "s") if max(swap, recompute) > 0.1 else (1e6, "us")
    return f"swap {swap * scale:.5g} {unit}, recompute {recompute * scale:.5g} {unit}"


def _expect_mode(cls, priced: Priced, context: PreemptionContext, expected: str, why: str = "") -> None:
    why = why or _prices(priced, context)
    with kvlibs_choice_refused():
        got = cls(priced.cost).choose_mode(_victim(), context)
    expect(got == expected, f"choose_mode for {_describe(priced, context)}: got {got!r}, expected {expected!r} ({why})")


def kvlibs_choice_refused():
    """While the learner's choice runs, kvlib's own choice raises: choose_mode must compare the prices itself."""
    return own_work(PreemptionCostModel, ("choose", "recompute_range"),
                    refusal="your policy called {cls}.{name}, kvlib's own choice; compare swap_seconds with "
                            "recompute_seconds yourself")


@choose_mode.check(2, "return \"swap\" when cost_model.swap_seconds(num_host_blocks, block_bytes) is below "
                      "cost_model.recompute_seconds(num_tokens, batch_tokens), else \"recompute\"")
def cheaper_wins(cls) -> None:
    for tokens, expected in [(16, "swap"), (64, "recompute"), (256, "recompute"), (2048, "swap"), (4096, "swap")]:
        _expect_mode(cls, EAGER_GPU, _context(EAGER_GPU, tokens), expected)
    _expect_mode(cls, ONE_CORE, _context(ONE_CORE, 64), "swap")


@choose_mode.check(1, "a tie recomputes: swap only when it is strictly cheaper, which keeps the host link and the "
                      "host pool free for victims that gain from them")
def tie_recomputes(cls) -> None:
    context = _context(TOY, 8, batch_tokens=1)
    _expect_mode(cls, TOY, context, "recompute", f"a tie: {_prices(TOY, context)}")


@choose_mode.check(1, "price recompute as what the victim's tokens add to the step they join: "
                      "recompute_seconds(num_tokens, batch_tokens), not a pass of their own nor a batch of 1")
def in_the_batch(cls) -> None:
    _expect_mode(cls, KNEE_GPU, _context(KNEE_GPU, 64, batch_tokens=4), "recompute",
                 f"{_prices(KNEE_GPU, _context(KNEE_GPU, 64, batch_tokens=4))}: the 68 tokens of the pass take "
                 f"less than its 1 ms of weight reads, which the batch pays anyway")
    _expect_mode(cls, KNEE_GPU, _context(KNEE_GPU, 64, batch_tokens=1000), "swap",
                 f"{_prices(KNEE_GPU, _context(KNEE_GPU, 64, batch_tokens=1000))}: the batch is past the knee, so "
                 f"every victim token adds its arithmetic")


@choose_mode.check(1, "a swap needs a free host block for each block still to copy: with host_free_blocks < "
                      "num_host_blocks return \"recompute\" yourself; blocks already on the host need no room")
def host_room(cls) -> None:
    _expect_mode(cls, ONE_CORE, _context(ONE_CORE, 64, host_free_blocks=3), "recompute",
                 "4 blocks to copy, 3 free on the host")
    _expect_mode(cls, ONE_CORE, _context(ONE_CORE, 64, host_free_blocks=4), "swap",
                 "swap is cheaper and the 4 blocks fit the 4 free on the host")
    _expect_mode(cls, ONE_CORE, _context(ONE_CORE, 64, host_free_blocks=2, num_host_blocks=2), "swap",
                 "swap is cheaper, and only 2 of the 4 blocks need host room: the other 2 are already there")


# ---- engine ------------------------------------------------------------------------------------
# 6 requests that grow to 38 blocks in all, in a pool of 12: every run preempts.
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(5 + i)] for i in range(6)]
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)
ENGINE_CONFIG = dict(block_size=4, num_gpu_blocks=12, preemption_mode="auto", watermark=0.0)
# A link a million times faster than the arithmetic: every victim swaps.
FAST_LINK = PreemptionCostModel(host_link_bytes_per_s=1e15, prefill_tokens_per_s=1.0, floor_seconds=1e-3,
                                overlap=0.0, copy_call_seconds=1e-9)
# Weight reads of 1 s that any victim here hides under: every victim recomputes, though its own pass would take 1 s.
HIDDEN_RECOMPUTE = PreemptionCostModel(host_link_bytes_per_s=1e10, prefill_tokens_per_s=1e9, floor_seconds=1.0,
                                       overlap=1.0, attention_seconds_per_pair=1e-15, copy_call_seconds=1e-3)
ROOMY_HOST, SMALL_HOST = 64, 3
MAX_STEPS = 500


@engine.check(2, "with a link this fast swap is always cheaper: every preemption must swap")
def fast_link_swaps(cls) -> None:
    m = _serve(cls, FAST_LINK, ROOMY_HOST)
    expect(m.num_preemptions_swap == m.num_preemptions,
           f"{m.num_preemptions_recompute} of {m.num_preemptions} preemptions recomputed; with a 1e15 bytes/s link "
           f"and 1 prefill token/s every one should swap")


@engine.check(2, "where the pass's weight reads hide a victim's tokens, recompute costs the steps next to nothing: "
                 "every preemption must recompute (a pass of its own would cost the 1 s floor again)")
def weight_reads_hide_recompute(cls) -> None:
    m = _serve(cls, HIDDEN_RECOMPUTE, ROOMY_HOST)
    expect(m.num_preemptions_recompute == m.num_preemptions,
           f"{m.num_preemptions_swap} of {m.num_preemptions} preemptions swapped; with 1 s of weight reads per pass "
           f"and 1e9 tokens/s of arithmetic, a victim's tokens ride along free, while a swap pays two 1 ms copy calls")


@engine.check(1, "the engine falls back to recompute when you choose swap without host room, and counts it in "
                 "num_swap_fallbacks; compare host_free_blocks with num_host_blocks yourself")
def small_host_pool(cls) -> None:
    m = _serve(cls, FAST_LINK, SMALL_HOST)
    expect(m.num_preemptions_swap > 0, f"none of {m.num_preemptions} preemptions swapped, though the fast link makes "
                                       f"swap cheaper whenever the host pool has room")


@cache
def _unpressured_tokens() -> tuple:
    from kvlib import LLM, EngineConfig
    llm = LLM("default", EngineConfig(block_size=4, num_gpu_blocks=256, device="cpu"), verbose=False)
    return tuple(out.token_ids for out in llm.generate(PROMPTS, PARAMS))


def _serve(policy_cls, cost: PreemptionCostModel, num_cpu_blocks: int):
    """Serve the prompts step by step with ``policy_cls(cost)``; check bookkeeping, tokens and fallbacks."""
    from kvlib import LLM, EngineConfig

    config = EngineConfig(device="cpu", num_cpu_blocks=num_cpu_blocks, **ENGINE_CONFIG)
    with kvlibs_choice_refused():
        llm = LLM("default", config, preemption_policy=policy_cls(cost), verbose=False)
        outputs = serve_checked(llm, PROMPTS, PARAMS, MAX_STEPS)
    for i, (out, expected) in enumerate(zip(outputs, _unpressured_tokens())):
        expect(out.token_ids == expected, f"request {i} generated {out.token_ids} but {expected} in a pool with room")
    m = llm.metrics
    expect(m.num_preemptions > 0, "the workload was meant to preempt but did not")
    print(f"host pool of {num_cpu_blocks} blocks: {m.num_preemptions_swap} swapped, {m.num_preemptions_recompute} "
          f"recomputed ({m.num_swap_fallbacks} of them swaps the engine overruled)")
    expect(m.num_swap_fallbacks == 0,
           f"the engine overruled {m.num_swap_fallbacks} of your swap choices: the host pool of {num_cpu_blocks} "
           f"blocks had no room for them")
    return m
