"""The scheduler: which sequences run this step, for how many tokens, and who is preempted.

Policy only: queues, order, the token budget and the victim loop. Every block question goes
to the :class:`~kvlib.core.block_manager.BlockManager`. Each step it fills the plan
(:class:`~kvlib.core.plan.SchedulerOutput`), once:

1. gives every running sequence, oldest first, its next tokens within the budget, preempting
   the policy's victims while the block manager says it cannot grow;
2. if nobody was preempted, resumes swapped and waiting sequences, oldest first, while the
   pool stays above the watermark, the budget lasts and ``max_num_seqs`` allows;
3. if the plan is still empty while sequences wait, paused ones give up their device blocks one
   at a time, newest first and the first in line last, with 2 again after each, until it plans.

Every sequence computes the tokens between ``num_computed_tokens`` and its end, so a prefill, a
decode, a chunk of a long prompt and a recomputation after preemption are one operation. After
the model step, :meth:`Scheduler.postprocess` records what was computed and sampled: tokens,
forks of parallel samples, finished sequences.
"""
from __future__ import annotations

import bisect
import heapq
from typing import Optional

from kvlib.config import PREEMPTION_MECHANISMS, EngineConfig
from kvlib.core.block_manager import BlockManager
from kvlib.core.block_table import blocks_for
from kvlib.core.plan import Preemption, SchedulerOutput, StepResult
from kvlib.core.preemption import PreemptionContext, PreemptionCostModel, VictimCandidate
from kvlib.core.sequence import Sequence, SequenceStatus

__all__ = ["Scheduler", "SchedulerOutput", "StepResult", "by_arrival"]


def by_arrival(seq: Sequence) -> tuple[float, int]:
    return seq.arrival_time, seq.seq_id


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, policy, *, block_bytes: int, eos_token_ids: frozenset[int] = frozenset(), max_model_len: Optional[int] = None,
                 cost_model: Optional[PreemptionCostModel] = None):
        self.config = config
        self.block_size = config.block_size
        self.bm = block_manager
        self.policy = policy
        self.block_bytes = block_bytes
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.cost_model = cost_model
        self.waiting: list[Sequence] = []  # every queue in arrival order, oldest first
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.running_slots = 0  # running sequences plus the samples they will fork

    # ---- queues -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.move(seq, SequenceStatus.WAITING)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def _queue(self, status: SequenceStatus) -> Optional[list[Sequence]]:
        return {SequenceStatus.WAITING: self.waiting, SequenceStatus.RUNNING: self.running,
                SequenceStatus.SWAPPED: self.swapped}.get(status)

    def move(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take ``seq`` out of its queue (if it is in it) and put it in ``status``'s, keeping arrival order: found
        by bisection, never a scan, so queueing n requests costs n log n, not n squared."""
        old = self._queue(seq.status)
        at = None if old is None else bisect.bisect_left(old, by_arrival(seq), key=by_arrival)
        if at is not None and at < len(old) and old[at] is seq:
            del old[at]
            if old is self.running:
                self.running_slots -= seq.num_slots
        seq.status = status
        new = self._queue(status)
        if new is not None:
            bisect.insort(new, seq, key=by_arrival)
            if new is self.running:
                self.running_slots += seq.num_slots

    def why_never(self, seq: Sequence) -> Optional[str]:
        """Why ``seq`` could never run in this pool, or None if it can."""
        bs, total, watermark = self.block_size, self.bm.num_device_blocks, self.bm.watermark_blocks
        prompt_blocks = blocks_for(len(seq.prompt_token_ids), bs)
        # the last sampled token is never fed back, so its K/V is never computed or stored
        full_blocks = blocks_for(len(seq.prompt_token_ids) + seq.params.max_tokens - 1, bs)
        if prompt_blocks > total - watermark:
            return (f"its prompt of {len(seq.prompt_token_ids)} tokens needs {prompt_blocks} KV blocks of "
                    f"{bs} tokens, more than the {total - watermark} the pool can ever admit; "
                    f"raise num_gpu_blocks or shorten the prompt")
        if full_blocks > total:
            return (f"prompt ({len(seq.prompt_token_ids)} tokens) plus max_tokens ({seq.params.max_tokens}), less "
                    f"the last token whose K/V is never stored, needs {full_blocks} KV blocks of {bs} tokens but the "
                    f"pool has {total}; raise num_gpu_blocks or lower max_tokens")
        if seq.params.n > self.config.max_num_seqs:
            return (f"its n={seq.params.n} samples run as {seq.params.n} sequences, more than max_num_seqs="
                    f"{self.config.max_num_seqs}; raise max_num_seqs or lower n")
        return None

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self, out: SchedulerOutput) -> SchedulerOutput:
        """Fill ``out`` with this step's plan. Should a plugged-in policy raise midway, ``out.moves``
        still holds every move the actions taken so far imply, for the engine to carry out."""
        self.bm.begin_step()
        try:
            budget = self.schedule_running(out, self.config.max_num_batched_tokens)
            if out.num_preemptions == 0:
                budget = self.schedule_waiting(out, budget)
            if not out.scheduled and (self.waiting or self.swapped):  # all wait for blocks paused ones hold
                self._release_holders(out, budget)
        finally:
            out.moves = self.bm.moves  # before end_step adds the step's demotions, which may call a plugged-in tier
            self.bm.end_step()
        return out

    def schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0:
                continue
            end = seq.num_computed_tokens + num_new
            if self.make_room(seq, end, out):
                self.start(seq, num_new, end, out)
                budget -= num_new
        return budget

    def make_room(self, seq: Sequence, end: int, out: SchedulerOutput) -> bool:
        """Preempt the policy's victims until ``seq`` can grow to ``end``; False if ``seq`` itself was the victim."""
        while (shortfall := self.bm.shortfall(seq, end)) > 0:
            victim = self._select_victim(seq, shortfall, out)
            count = victim.num_blocks
            if self.config.partial_preemption and victim.num_unique_tail_blocks:
                count = min(shortfall, victim.num_unique_tail_blocks)
            self._preempt(victim, count, out)
            if seq.status is not SequenceStatus.RUNNING:
                return False
        return True

    def schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Swapped and waiting sequences, oldest first; nobody newer overtakes one waiting for room."""
        for seq in list(heapq.merge(self.swapped, self.waiting, key=by_arrival)):
            if budget == 0 or self.running_slots + seq.num_slots > self.config.max_num_seqs:
                break
            num_new = min(seq.num_uncomputed_tokens, budget)
            use_watermark = bool(self.running)  # alone in the pool, a sequence may use all of it
            if seq.status is SequenceStatus.SWAPPED:
                end = seq.num_computed_tokens + num_new
                if not self.bm.can_swap_in(seq, end, use_watermark):
                    break
                self.bm.swap_in(seq)
            else:
                hits = self.bm.prefix_hits(seq)
                computed = seq.num_computed_tokens + len(hits) * self.block_size
                num_new = min(seq.num_tokens - computed, budget)
                end = computed + num_new
                if not self.bm.can_admit(seq, hits, end, use_watermark):
                    break
                self.bm.admit(seq, hits)
            self.move(seq, SequenceStatus.RUNNING)
            self.start(seq, num_new, end, out)
            budget -= num_new
        return budget

    def start(self, seq: Sequence, num_new: int, end: int, out: SchedulerOutput) -> None:
        """Give ``seq`` its blocks up to ``end`` and put its chunk in the plan, with the samples that fork after it."""
        self.bm.grow(seq, end)
        forks = [seq.spawn_sample(i) for i in range(1, seq.params.n)] if seq.pending_forks and end == seq.num_tokens else ()
        out.add(seq, num_new, forks)

    # ---- preemption ---------------------------------------------------------------------------
    def _candidates(self, requester: Sequence, out: SchedulerOutput) -> list[VictimCandidate]:
        """Who could give up blocks: the requester (last resort), running sequences not yet scheduled
        this step, and paused sequences still holding blocks of their own."""
        scheduled = {chunk.seq for chunk in out.scheduled}
        candidates = []
        for seq in heapq.merge(self.running, self.waiting, self.swapped, key=by_arrival):
            if seq in scheduled or not seq.block_table.blocks:
                continue
            unique = self.bm.unique_tail(seq)
            if seq is requester or unique:
                candidates.append(VictimCandidate(seq, seq is requester, seq.status is SequenceStatus.RUNNING,
                                                  len(seq.block_table), unique, self.bm.num_shared(seq)))
        return candidates

    def _select_victim(self, requester: Sequence, shortfall: int, out: SchedulerOutput) -> VictimCandidate:
        candidates = self._candidates(requester, out)
        victim = self.policy.select_victim(candidates, shortfall)
        if not any(victim is c for c in candidates):
            raise TypeError(f"the preemption policy's select_victim returned {victim!r}; it must return one of "
                            f"the VictimCandidate objects in the list it was given")
        return victim

    def _preempt(self, victim: VictimCandidate, count: int, out: SchedulerOutput) -> None:
        """Take the last ``count`` device blocks from ``victim`` (partial preemption takes only its unique
        tail, no more than the shortfall); shared ones stay with the sequences that share them."""
        seq = victim.seq
        host_needed = self.bm.host_blocks_needed([seq], count)
        chosen = self._mode(victim, count, host_needed)
        swapped = chosen == "swap" and self.bm.make_host_room(host_needed)  # a swap without host room recomputes
        seq.num_preemptions += 1
        lost = self._preempt_by_swap(seq, count) if swapped else self._preempt_by_recompute(seq, count)
        out.preemptions.append(Preemption(seq, "swap" if swapped else "recompute", count, lost,
                                          fell_back=chosen == "swap" and not swapped))

    def _preempt_by_swap(self, seq: Sequence, count: int) -> int:
        """Its blocks go to the host pool; it resumes from the swapped queue with nothing recomputed."""
        self.bm.swap_out(seq, count)
        self.move(seq, SequenceStatus.SWAPPED)
        return 0

    def _preempt_by_recompute(self, seq: Sequence, count: int) -> int:
        """Its blocks are let go; it waits again and recomputes the positions they held (returned)."""
        lost = self.bm.drop(seq, count)
        self.move(seq, SequenceStatus.WAITING)
        return lost

    def _mode(self, victim: VictimCandidate, count: int, host_needed: int) -> str:
        """The configured mode, or in auto mode the policy's choice."""
        seq, mode = victim.seq, self.config.preemption_mode
        if mode != "auto":
            return mode
        kept = len(seq.block_table) - count
        context = PreemptionContext(
            num_blocks=count, num_tokens=seq.num_computed_tokens - min(seq.num_computed_tokens, kept * self.block_size),
            num_host_blocks=host_needed, block_bytes=self.block_bytes,
            host_free_blocks=self.bm.num_host_blocks_for_swap, cost_model=self.cost_model,
            batch_tokens=max(1, len(self.running)))
        mode = self.policy.choose_mode(victim, context)
        if mode not in PREEMPTION_MECHANISMS:
            raise ValueError(f"the preemption policy's choose_mode returned {mode!r}; it must return "
                             f"'swap' or 'recompute'")
        return mode

    def _release_holders(self, out: SchedulerOutput, budget: int) -> None:
        """Nothing was planned: paused sequences give up their device blocks one at a time, newest first and the
        first in line last (its own would be copied out and back in), the line asked again after each until it
        starts. One gives them up before the line is asked: a sequence that preempted itself would otherwise
        take back just what it gave, and give it again the next step, for ever."""
        holders = [seq for seq in heapq.merge(self.swapped, self.waiting, key=by_arrival) if seq.block_table.blocks]
        if not holders and out.num_preemptions:  # without a preemption, the line was asked already
            self.schedule_waiting(out, budget)
        for seq in reversed(holders):
            candidate = VictimCandidate(seq, False, False, len(seq.block_table), self.bm.unique_tail(seq),
                                        self.bm.num_shared(seq))
            self._preempt(candidate, len(seq.block_table), out)
            self.schedule_waiting(out, budget)
            if out.scheduled:
                return

    # ---- after the model step -----------------------------------------------------------------
    def postprocess(self, plan: SchedulerOutput, tokens: list[int], now: float) -> StepResult:
        """Record a finished model step: computed tokens, forks, one sampled token per draw, finishes."""
        for chunk in plan.scheduled:
            seq = chunk.seq
            seq.num_computed_tokens += chunk.num_tokens
            seq.peak_computed_tokens = max(seq.peak_computed_tokens, seq.num_computed_tokens)
            self.bm.register_computed(seq)
        forked = []
        for parent, children in plan.forks.items():
            parent.pending_forks = 0
            self.running_slots -= len(children)
            for child in children:
                self.bm.fork(parent, child)
                self.move(child, SequenceStatus.RUNNING)
                forked.append(child)
        sampled, finished = [], []
        for (seq, _), token in zip(plan.draws, tokens):
            seq.record_token(token, now)
            sampled.append(seq)
            if self._finish_reason(seq, token):
                seq.finish_time = now
                self.finish(seq)
                finished.append(seq)
        return StepResult(sampled, forked, finished)

    def _finish_reason(self, seq: Sequence, token: int) -> Optional[str]:
        params = seq.params
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.output_token_ids) >= params.max_tokens or (
                self.max_model_len is not None and seq.num_tokens >= self.max_model_len):
            seq.finish_reason = "length"
        return seq.finish_reason

    def finish(self, seq: Sequence) -> None:
        """``seq`` is done (finished or aborted): it leaves its queue and lets go of every block."""
        self.bm.drop(seq)
        self.move(seq, SequenceStatus.FINISHED)
