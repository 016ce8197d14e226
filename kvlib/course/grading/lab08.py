"""Lab 07 checks: the learner's swap-or-recompute choice, alone and inside the engine.

The learner writes a policy built on a :class:`~kvlib.preemption.PreemptionCostModel` with
``swap_seconds(context)``, ``recompute_seconds(context)`` and ``choose_mode(victim, context)``.
The unit checks price hand-built :class:`~kvlib.preemption.PreemptionContext` cases on both
sides of the crossover. The engine checks serve one workload under three cost models: a link so
fast that every victim must swap, one so slow that every victim must recompute, and a fast link
with a host pool too small for some victims, where the policy must choose recompute itself
rather than leave the engine to overrule it.
"""
from __future__ import annotations

import math
from functools import cache

from kvlib.config import SamplingParams
from kvlib.course.grading.checks import Task, expect
from kvlib.course.grading.extract import Rules
from kvlib.course.grading.results import TaskResult
from kvlib.course.grading.serving import serve_checked
from kvlib.preemption import PreemptionContext, PreemptionCostModel, VictimCandidate
from kvlib.sequence import Sequence

RULES = Rules(needs=('MyAutoPolicy',), kvlib_imports={'kvlib.preemption': {'LatestArrivalPolicy', 'PreemptionCostModel', 'PreemptionContext', 'VictimCandidate'}}, own_methods=('choose_mode',))
choose_mode = Task("choose_mode", RULES)
engine = Task("engine", RULES)
TASKS = [choose_mode, engine]


def check_choose_mode(policy_cls) -> TaskResult:
    return choose_mode.grade(policy_cls)


def check_engine(policy_cls) -> TaskResult:
    return engine.grade(policy_cls)


# ---- choose_mode -------------------------------------------------------------------------------
# A link of 2048 bytes/s, a prefill of 3.5 tokens/s and 1 KiB blocks: swapping 4 blocks costs
# 2 * 4 * 1024 / 2048 = 4 s, the same as recomputing 14 tokens.
TOY = PreemptionCostModel(host_link_bytes_per_s=2048, prefill_tokens_per_s=3.5)
# A PCIe-like link of 25 GB/s, a fast prefill of 1.2M tokens/s, blocks of 16 tokens x 8 KiB: swapping
# 4 blocks (42 us) costs the same as recomputing 50.3 tokens.
PCIE = PreemptionCostModel(host_link_bytes_per_s=25e9, prefill_tokens_per_s=1.2e6)
PCIE_BLOCK_BYTES = 16 * 8 * 1024
VICTIM = VictimCandidate(Sequence(request_id="victim", prompt_token_ids=[3], params=SamplingParams(), block_size=4,
                                  arrival_time=0.0), is_requester=False, running=True, num_blocks=4,
                         num_unique_tail_blocks=4, num_shared_blocks=0)


def _context(num_blocks: int, num_tokens: int, block_bytes: int = 1024, host_free_blocks: int = 64):
    return PreemptionContext(num_blocks=num_blocks, num_tokens=num_tokens, num_host_blocks=num_blocks,
                             block_bytes=block_bytes, host_free_blocks=host_free_blocks)


def _describe(cost: PreemptionCostModel, c: PreemptionContext) -> str:
    return (f"link {cost.host_link_bytes_per_s:g} bytes/s, prefill {cost.prefill_tokens_per_s:g} tokens/s, "
            f"{c.num_blocks} blocks of {c.block_bytes} bytes holding {c.num_tokens} tokens, "
            f"{c.host_free_blocks} host blocks free")


def _expect_seconds(cls, method: str, cost: PreemptionCostModel, context: PreemptionContext, expected: float) -> None:
    got = getattr(cls(cost), method)(context)
    expect(isinstance(got, (int, float)) and math.isclose(got, expected, rel_tol=1e-9),
           f"{method} with {_describe(cost, context)}: got {got!r}, expected {expected:g} s")


def _expect_mode(cls, cost: PreemptionCostModel, context: PreemptionContext, expected: str, why: str) -> None:
    got = cls(cost).choose_mode(VICTIM, context)
    expect(got == expected, f"choose_mode with {_describe(cost, context)}: got {got!r}, expected {expected!r} ({why})")


@choose_mode.check(1, "swap_seconds = 2 * num_blocks * block_bytes / host_link_bytes_per_s: the blocks cross the "
                      "link once out and once back in")
def swap_seconds(cls) -> None:
    _expect_seconds(cls, "swap_seconds", TOY, _context(4, 14), 4.0)
    _expect_seconds(cls, "swap_seconds", PCIE, _context(4, 50, PCIE_BLOCK_BYTES), 2 * 4 * PCIE_BLOCK_BYTES / 25e9)


@choose_mode.check(1, "recompute_seconds = num_tokens / prefill_tokens_per_s: the dropped tokens are prefilled again")
def recompute_seconds(cls) -> None:
    _expect_seconds(cls, "recompute_seconds", TOY, _context(4, 14), 4.0)
    _expect_seconds(cls, "recompute_seconds", PCIE, _context(4, 50, PCIE_BLOCK_BYTES), 50 / 1.2e6)


@choose_mode.check(2, "return \"swap\" only when swap_seconds is strictly below recompute_seconds; a tie recomputes "
                      "(it keeps the host link and the host pool free)")
def cheaper_wins(cls) -> None:
    _expect_mode(cls, TOY, _context(4, 13), "recompute", "recompute 3.71 s < swap 4 s")
    _expect_mode(cls, TOY, _context(4, 15), "swap", "swap 4 s < recompute 4.29 s")
    _expect_mode(cls, TOY, _context(4, 14), "recompute", "a tie: both 4 s")
    _expect_mode(cls, PCIE, _context(4, 50, PCIE_BLOCK_BYTES), "recompute", "recompute 41.7 us < swap 41.9 us")
    _expect_mode(cls, PCIE, _context(4, 51, PCIE_BLOCK_BYTES), "swap", "swap 41.9 us < recompute 42.5 us")


@choose_mode.check(1, "swap needs a free host block for every block the victim gives up: with "
                      "host_free_blocks < num_blocks, return \"recompute\" whatever the prices")
def host_room(cls) -> None:
    _expect_mode(cls, TOY, _context(4, 16, host_free_blocks=3), "recompute", "4 blocks but only 3 free on the host")
    _expect_mode(cls, TOY, _context(4, 16, host_free_blocks=4), "swap", "swap 4 s < recompute 4.57 s, and the 4 "
                                                                        "blocks fit the 4 free on the host")


# ---- engine ------------------------------------------------------------------------------------
# 6 requests that grow to 38 blocks in all, in a pool of 12: every run preempts.
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(5 + i)] for i in range(6)]
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)
ENGINE_CONFIG = dict(block_size=4, num_gpu_blocks=12, preemption_mode="auto", watermark=0.0)
FAST_LINK = PreemptionCostModel(host_link_bytes_per_s=1e15, prefill_tokens_per_s=1.0)
SLOW_LINK = PreemptionCostModel(host_link_bytes_per_s=1e3, prefill_tokens_per_s=1e9)
ROOMY_HOST, SMALL_HOST = 64, 3
MAX_STEPS = 500


@engine.check(2, "with a link this fast swap is always cheaper: every preemption must swap")
def fast_link_swaps(cls) -> None:
    m = _serve(cls, FAST_LINK, ROOMY_HOST)
    expect(m.num_preemptions_swap == m.num_preemptions,
           f"{m.num_preemptions_recompute} of {m.num_preemptions} preemptions recomputed; with a 1e15 bytes/s link "
           f"and 1 prefill token/s every one should swap")


@engine.check(2, "with a link this slow recompute is always cheaper: every preemption must recompute")
def slow_link_recomputes(cls) -> None:
    m = _serve(cls, SLOW_LINK, ROOMY_HOST)
    expect(m.num_preemptions_recompute == m.num_preemptions,
           f"{m.num_preemptions_swap} of {m.num_preemptions} preemptions swapped; with a 1e3 bytes/s link and 1e9 "
           f"prefill tokens/s every one should recompute")


@engine.check(1, "the engine falls back to recompute when you choose swap without host room, and counts it in "
                 "num_swap_fallbacks; compare host_free_blocks with num_blocks yourself")
def small_host_pool(cls) -> None:
    m = _serve(cls, FAST_LINK, SMALL_HOST)
    expect(m.num_swap_fallbacks == 0,
           f"the engine overruled {m.num_swap_fallbacks} of your swap choices: the host pool of {SMALL_HOST} blocks "
           f"did not have room for them")
    expect(m.num_preemptions_swap > 0, f"none of {m.num_preemptions} preemptions swapped, though the fast link makes "
                                       f"swap cheaper whenever the host pool has room")


@cache
def _unpressured_tokens() -> tuple:
    from kvlib import LLM, EngineConfig
    llm = LLM("default", EngineConfig(block_size=4, num_gpu_blocks=256, device="cpu"), verbose=False)
    return tuple(out.token_ids for out in llm.generate(PROMPTS, PARAMS))


def _serve(policy_cls, cost: PreemptionCostModel, num_cpu_blocks: int):
    """Serve the prompts step by step with ``policy_cls(cost)``; check bookkeeping and tokens; return the metrics."""
    from kvlib import LLM, EngineConfig

    config = EngineConfig(device="cpu", num_cpu_blocks=num_cpu_blocks, **ENGINE_CONFIG)
    llm = LLM("default", config, preemption_policy=policy_cls(cost), verbose=False)
    outputs = serve_checked(llm, PROMPTS, PARAMS, MAX_STEPS)
    for i, (out, expected) in enumerate(zip(outputs, _unpressured_tokens())):
        expect(out.token_ids == expected, f"request {i} generated {out.token_ids} but {expected} in a pool with room")
    m = llm.metrics
    expect(m.num_preemptions > 0, "the workload was meant to preempt but did not")
    print(f"link {cost.host_link_bytes_per_s:g} bytes/s, prefill {cost.prefill_tokens_per_s:g} tokens/s, host pool "
          f"{num_cpu_blocks} blocks: {m.num_preemptions_swap} swapped, {m.num_preemptions_recompute} recomputed "
          f"({m.num_swap_fallbacks} of them overruled by the engine)")
    return m
