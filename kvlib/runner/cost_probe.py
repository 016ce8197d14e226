"""Measure, on this machine, the constants of the preemption cost model, and time real victims.

``auto`` preemption prices a swap as copies over the host link and a recompute as what the
victim's tokens add to a forward pass (:class:`~kvlib.core.cost_model.PreemptionCostModel`). Every
constant depends on the hardware and the model, so the engine measures them once at start-up,
while the pools are still empty, rather than assume them. Timings run at the current torch thread
count, which is what the engine will run at; each is the best of a few runs taken in turns with
the others, because load from other processes only ever adds time and falls on all alike.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from kvlib.attention.metadata import AttentionMetadata
from kvlib.core.cost_model import PreemptionCostModel, attention_pairs
from kvlib.runner.kv_cache import KVCachePool, copy_blocks_between

PROBE_TOKENS = 64  # the first prefill chunk the forward probe times
MAX_PROBE_TOKENS = 4096
MAX_PROBE_CONTEXT = 2048  # cached tokens behind the chunk that measures attention
COPY_PROBE_BLOCKS = 32  # blocks of the probe's larger copy, at least
COPY_PROBE_BYTES = 64 * 2**20  # and at least this many bytes where the pool holds them: the link's rate, not its latency
PROBE_BATCH = 8  # decode sequences in the probe's batch
REPEATS = 3  # rounds at least; more while a round is quick, up to MIN_SECONDS of timing or MAX_ROUNDS
MIN_SECONDS = 0.5
MAX_ROUNDS = 50
NOISE_COPIES = 3  # the decode batch's pass timed this many times in turns: the spread of their bests is the noise
MAX_PROBE_ATTEMPTS = 3  # probes timed while their passes contradict each other, before the engine says so
COMPUTE_BOUND_GROWTH = 1.6  # a pass this much slower with twice the tokens is mostly arithmetic
MEASURABLE_SHARE = 0.25  # ... provided the tokens add at least this share of the batch's own pass


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of one call of ``fn``, the GPU waited for before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def best_in_turns(fns: Sequence[Callable[[], object]], device: torch.device, repeats: int = REPEATS,
                  min_seconds: float = MIN_SECONDS) -> list[float]:
    """The least wall seconds of each of ``fns`` over rounds that run them in turns, after a warm-up.

    At least ``repeats`` rounds, and more while they have taken under ``min_seconds`` (at most
    ``MAX_ROUNDS``): quick calls are the noisiest, and cost little to repeat.
    """
    for fn in fns:
        fn()
    best, rounds, start = [float("inf")] * len(fns), 0, time.perf_counter()
    while rounds < repeats or (time.perf_counter() - start < min_seconds and rounds < MAX_ROUNDS):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], time_once(fn, device))
        rounds += 1
    return best


def forward_pass(model, pool: KVCachePool, backend, sequences: list[tuple[int, int]]) -> Callable[[], torch.Tensor]:
    """A forward pass over packed ``(new tokens, cached tokens)`` sequences, their blocks one after another in ``pool``.

    The cached K/V are whatever the pool holds, and a pass longer than the pool wraps around it:
    attention costs the same whatever the numbers it reads.
    """
    device, block_size = pool.device, pool.spec.block_size
    ids, positions, slots, context_lens, query_start, tables = [], [], [], [], [0], []
    next_block = 0
    for num_new, num_cached in sequences:
        length = num_new + num_cached
        blocks = [(next_block + i) % pool.num_blocks for i in range(-(-length // block_size))]
        next_block += len(blocks)
        ids.extend((7 * p + 3) % model.config.vocab_size for p in range(num_cached, length))
        positions.extend(range(num_cached, length))
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(num_cached, length))
        context_lens.append(length)
        query_start.append(query_start[-1] + num_new)
        tables.append(blocks)
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start=torch.tensor(query_start, dtype=torch.int32, device=device),
        max_query_len=max(n for n, _ in sequences), max_context_len=max(context_lens),
        num_decodes=leading_decodes(sequences))
    ids_t = torch.tensor(ids, dtype=torch.long, device=device)
    positions_t = torch.tensor(positions, dtype=torch.long, device=device)
    last = torch.tensor(query_start[1:], dtype=torch.long, device=device) - 1

    def run() -> torch.Tensor:
        with torch.inference_mode():
            return model(ids_t, positions_t, pool, meta, backend, last)
    return run


def leading_decodes(sequences: list[tuple[int, int]]) -> int:
    """How many sequences at the front carry one new token: the engine packs decodes first and sends them to the
    decode kernel, so a probe pass does too."""
    return next((i for i, (num_new, _) in enumerate(sequences) if num_new != 1), len(sequences))


def copy_probe_blocks(device_pool: KVCachePool) -> int:
    """Blocks of the copy probe's larger copy: ``COPY_PROBE_BLOCKS``, or more where blocks are small, so that it
    moves ``COPY_PROBE_BYTES`` (within the pool). Small blocks timed in a small copy measure each copy's latency:
    16 KiB blocks, 32 of them, put a GPU's host link at 1.95 GB/s."""
    wanted = max(COPY_PROBE_BLOCKS, -(-COPY_PROBE_BYTES // device_pool.spec.block_bytes))
    return max(1, min(wanted, device_pool.num_blocks))


def copy_probes(device_pool: KVCachePool, num_blocks: int | None = None,
                seed: int = 0) -> tuple[Callable, Callable]:
    """Batched copies to the host of one block and of ``num_blocks`` (``copy_probe_blocks`` when None), scattered
    over the pool as a victim's are."""
    num_blocks = copy_probe_blocks(device_pool) if num_blocks is None else max(1, min(num_blocks, device_pool.num_blocks))
    host = KVCachePool(device_pool.spec, num_blocks, "cpu", pin_memory=device_pool.device.type == "cuda")
    ids, host_ids = random.Random(seed).sample(range(device_pool.num_blocks), num_blocks), list(range(num_blocks))
    return (lambda: copy_blocks_between(device_pool, host, ids[:1], host_ids[:1]),
            lambda: copy_blocks_between(device_pool, host, ids, host_ids))


def fit_copy(one: float, many: float, num_blocks: int, block_bytes: int) -> tuple[float, float]:
    """``(seconds per batched copy call, host-link bytes per second)`` from copies of 1 and ``num_blocks`` blocks."""
    if num_blocks == 1 or many <= one:
        return 0.0, num_blocks * block_bytes / many
    per_block = (many - one) / (num_blocks - 1)
    return max(0.0, one - per_block), block_bytes / per_block


class ContradictoryTimings(ValueError):
    """The probe's passes contradict each other: other work slowed one of them, so no model fits them."""


@dataclass
class ForwardTimings:
    """Best wall seconds of the probe's passes, and the fit of the cost model's forward terms to them."""

    batch: int  # decode tokens in the probe's batch
    small: int  # tokens of its smallest prefill: one block
    q: int  # tokens of its prefill chunk
    context: int  # cached tokens behind the chunk that measures attention
    one: float  # one decode token alone
    alone: float  # the decode batch alone
    with_small: float  # the batch with a prefill of `small` tokens
    with_q: float  # ... with a q-token prefill
    with_2q: float  # ... with a 2q-token prefill
    with_q_behind: float  # ... with a q-token prefill behind `context` cached tokens

    def fit(self) -> dict:
        """``PreemptionCostModel`` keyword arguments for the forward pass.

        Each prefill's cost is what it adds to the batch alone. Attention per pair is what the
        context adds to the same chunk; the arithmetic per token is the slope from q to 2q once
        attention is taken out; the floor is the one-token pass; the overlap is how much less than
        its arithmetic the q-token chunk added beyond the one-block prefill (or, where both are past
        the knee, the decode batch beyond one token); what the one-block prefill adds beyond its
        share of the pass is its attention call.

        Raises :class:`ContradictoryTimings` where no positive price per token fits the passes.
        """
        b, small, q = self.batch, self.small, self.q
        per_pair = max(0.0, (self.with_q_behind - self.with_q) / (q * self.context)) if self.context else 0.0
        added = {n: t - self.alone - per_pair * attention_pairs(n)
                 for n, t in ((small, self.with_small), (q, self.with_q), (2 * q, self.with_2q))}
        per_token = (added[2 * q] - added[q]) / q if added[2 * q] > added[q] else added[2 * q] / (2 * q)
        if per_token <= 0:
            raise ContradictoryTimings(f"with its attention taken out, a prefill of {2 * q} tokens measured cheaper "
                                       f"than the decode batch alone ({1e3 * added[2 * q]:+.3f} ms)")
        floor = self.one
        overlap = _overlap(floor, per_token, (b + small, added[small]), (b + q, added[q]))
        if overlap is None:  # both prefills are past the knee: read the overlap off the decode batch instead
            overlap = _overlap(floor, per_token, (1, self.one), (b, self.alone))
        if overlap is None:  # nothing hides below the knee either, so the overlap changes no price
            overlap = 1.0
        tokens_only = PreemptionCostModel(1.0, 1 / per_token, floor, overlap)
        call = max(0.0, added[small] - (tokens_only.pass_seconds(b + small) - tokens_only.pass_seconds(b)))
        return dict(prefill_tokens_per_s=1 / per_token, floor_seconds=floor, overlap=overlap,
                    attention_seconds_per_pair=per_pair, attention_call_seconds=call)


def _overlap(floor: float, per_token: float, fewer: tuple[int, float], more: tuple[int, float]) -> Optional[float]:
    """The overlap that makes ``more[0]`` tokens cost ``more[1] - fewer[1]`` seconds more than ``fewer[0]`` tokens.

    None when under a tenth of the floor could hide between the two, too little to tell.
    """
    hideable = min(floor, more[0] * per_token) - min(floor, fewer[0] * per_token)
    if hideable <= 0.1 * floor:
        return None
    arithmetic = (more[0] - fewer[0]) * per_token
    return min(1.0, max(0.0, (arithmetic - (more[1] - fewer[1])) / hideable))


def past_the_knee(timings: ForwardTimings) -> bool:
    """Whether the probe's q-token prefill is past the knee: doubling it nearly doubles what it adds to the batch,
    and what it adds is a measurable share of the batch's own pass.

    Below the knee both additions are timing noise, and a ratio of noise says nothing: with the ratio
    alone, an H200 at Llama-3.2-1B's shape was priced at 17 M prefill tokens/s where its victims
    took 150 k/s, and ``auto`` recomputed every victim.
    """
    added, added_twice = timings.with_q - timings.alone, timings.with_2q - timings.alone
    return added_twice >= COMPUTE_BOUND_GROWTH * added and added >= MEASURABLE_SHARE * timings.alone


def measure_cost_model(model, device_pool: KVCachePool, backend, num_batch: int = PROBE_BATCH) -> PreemptionCostModel:
    """Every constant of the cost model, measured in this engine's pool, on its model and backend.

    The passes and the copies are timed in turns, so a copy finds the caches as a forward pass
    leaves them, as in the engine. The prefill chunk q is doubled while doubling it does not
    yet nearly double what it adds to the batch: until then it rides on the weight reads.
    Passes that contradict each other (other work slowed one) are timed again, up to
    ``MAX_PROBE_ATTEMPTS`` times; then the engine cannot be priced here, and says what to do.
    """
    batch = [(1, 0)] * num_batch
    small = max(2, device_pool.spec.block_size)
    q = max(2 * small, PROBE_TOKENS)
    copy_blocks = copy_probe_blocks(device_pool)
    copies = copy_probes(device_pool, copy_blocks)
    contradictions = 0
    while True:
        context = max(1, min(MAX_PROBE_CONTEXT, model.config.max_position_embeddings - q))
        prefills = [[], [(small, 0)], [(q, 0)], [(2 * q, 0)], [(q, context)]]
        fns = [forward_pass(model, device_pool, backend, [(1, 0)]),
               *(forward_pass(model, device_pool, backend, batch + p) for p in prefills), *copies]
        *passes, copy_one, copy_many = best_in_turns(fns, device_pool.device)
        timings = ForwardTimings(num_batch, small, q, context, *passes)
        if not past_the_knee(timings) and 4 * q <= MAX_PROBE_TOKENS:
            q *= 2
            continue
        try:
            forward = timings.fit()
            break
        except ContradictoryTimings as err:
            contradictions += 1
            if contradictions == MAX_PROBE_ATTEMPTS:
                raise RuntimeError(
                    f"auto preemption could not price swap and recompute here: the cost probe's passes contradicted "
                    f"each other {contradictions} times ({err}), as when other work keeps the machine busy. Start the "
                    f"engine again when it is quieter, or choose preemption_mode='swap' or 'recompute', which need "
                    f"no probe") from None
    call, link = fit_copy(copy_one, copy_many, copy_blocks, device_pool.spec.block_bytes)
    return PreemptionCostModel(host_link_bytes_per_s=link, copy_call_seconds=call, **forward)


@dataclass
class VictimTiming:
    """What preempting one victim of ``num_tokens`` tokens cost, measured both ways."""

    num_tokens: int
    num_blocks: int
    swap_seconds: float  # its scattered blocks copied out to the host pool and back in, one batched copy each way
    recompute_seconds: float  # what its prefill added to a pass carrying the decode batch
    noise_seconds: float = 0.0  # how far identical decode passes timed beside it differed: what adds no more is noise


def victim_calls(runner, num_tokens: int, batch: int = 4, batch_context: int = 64,
                 rng: Optional[random.Random] = None, swap_beside: bool = False) -> dict[str, Callable[[], object]]:
    """The calls that price one victim in ``runner``'s own pools, for timing side by side.

    ``"batch"``: the decode pass the step runs anyway (``batch`` sequences of ``batch_context``
    cached tokens; with ``batch`` 0, nothing); ``"swap"``: the victim's blocks, scattered over the
    device pool, copied to the host pool and back, one batched copy each way, and with
    ``swap_beside`` the decode pass issued between the two, so the copies cross the link while
    it computes (the swap's cost is then what it adds to ``"batch"``); ``"batch with the victim"``:
    the victim's prefill packed into the batch's pass, whose cost is what it adds to ``"batch"``.
    """
    rng = rng or random.Random(0)
    device, host = runner.device_pool, runner.host_pool
    decode = [(1, batch_context)] * batch
    num_blocks = -(-num_tokens // device.spec.block_size)
    device_ids = rng.sample(range(device.num_blocks), num_blocks)
    host_ids = rng.sample(range(host.num_blocks), num_blocks)
    batch_pass = forward_pass(runner.model, device, runner.backend, decode) if decode else (lambda: None)

    def swap():
        copy_blocks_between(device, host, device_ids, host_ids)
        if swap_beside:
            batch_pass()
        copy_blocks_between(host, device, host_ids, device_ids)
    return {"batch": batch_pass, "swap": swap,
            "batch with the victim": forward_pass(runner.model, device, runner.backend, decode + [(num_tokens, 0)])}


def time_victims(runner, lengths: list[int], batch: int = 4, batch_context: int = 64, repeats: int = REPEATS,
                 min_seconds: float = MIN_SECONDS, seed: int = 0, swap_beside: bool = False) -> list[VictimTiming]:
    """Preempt victims of each length both ways in ``runner``'s own pools, in turns with the decode batch alone.

    The decode batch is ``batch`` sequences of ``batch_context`` cached tokens (0: none, each way
    timed alone); a victim's recompute is its prefill packed into that batch's pass, minus the
    pass without it, and with ``swap_beside`` its swap likewise (:func:`victim_calls`; a swap hidden
    entirely behind the pass costs 0, not the timing noise's sign). The batch's pass alone is timed
    ``NOISE_COPIES`` times: bests of the same pass differ by noise alone, so what a victim adds is
    clear of 0 only beyond their spread (``noise_seconds``).
    """
    rng = random.Random(seed)
    calls = [victim_calls(runner, n, batch, batch_context, rng, swap_beside) for n in lengths]
    copies = NOISE_COPIES if batch else 1
    fns = [calls[0]["batch"]] * copies + [c[name] for c in calls for name in ("swap", "batch with the victim")]
    times = best_in_turns(fns, runner.device, repeats, min_seconds)
    passes, times = times[:copies], times[copies:]
    alone, noise = (min(passes), max(passes) - min(passes)) if batch else (0.0, 0.0)
    blocks = [-(-n // runner.device_pool.spec.block_size) for n in lengths]
    return [VictimTiming(n, b, max(0.0, swap_s - alone) if swap_beside else swap_s, with_victim - alone, noise)
            for n, b, swap_s, with_victim in zip(lengths, blocks, times[0::2], times[1::2])]


@dataclass
class ReturningTiming:
    """A conversation of ``context`` tokens returning with new ones: its prefix prefilled again, or copied back."""

    context: int
    recompute_seconds: float  # one pass over the context and the new tokens
    copy_back_seconds: float  # its blocks copied back (and as many evicted blocks out), then a pass over the new tokens


def time_returning_turns(runner, contexts: list[int], new_tokens: int, repeats: int = REPEATS,
                         min_seconds: float = MIN_SECONDS, seed: int = 0) -> list[ReturningTiming]:
    """Serve each returning turn both ways in ``runner``'s own pools, every pass and copy in turns with the others."""
    rng = random.Random(seed)
    device, host = runner.device_pool, runner.host_pool
    fns = []
    for context in contexts:
        num_blocks = context // device.spec.block_size
        device_ids = rng.sample(range(device.num_blocks), num_blocks)
        host_ids = rng.sample(range(host.num_blocks), num_blocks)

        def copies(device_ids=device_ids, host_ids=host_ids):
            copy_blocks_between(device, host, device_ids, host_ids)  # an evicted prefix out
            copy_blocks_between(host, device, host_ids, device_ids)  # the returning one in
        fns += [forward_pass(runner.model, device, runner.backend, [(context + new_tokens, 0)]), copies,
                forward_pass(runner.model, device, runner.backend, [(new_tokens, context)])]
    times = best_in_turns(fns, runner.device, repeats, min_seconds)
    return [ReturningTiming(c, recompute, copy + new) for c, recompute, copy, new in
            zip(contexts, times[0::3], times[1::3], times[2::3])]
