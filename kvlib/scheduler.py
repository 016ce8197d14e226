"""The scheduler: which sequences run this step, with which blocks, and who is preempted.

Each step it (1) gives every running sequence the blocks for its next tokens, preempting the
policy's victims when the device pool runs dry, then, if nobody was preempted, (2) resumes
swapped and waiting sequences, oldest first, while the pool stays above the watermark and the
step's token budget lasts. Every sequence computes the tokens between ``num_computed_tokens``
and its end, so a prefill, a decode, a chunk of a long prompt and a recomputation after
preemption are all the same operation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvlib.block_allocator import AllocStatus
from kvlib.block_table import blocks_for
from kvlib.config import EngineConfig
from kvlib.metrics import EngineMetrics
from kvlib.preemption import PreemptionContext
from kvlib.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    num_preemptions: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


def by_arrival(seq: Sequence) -> tuple[float, int]:
    return seq.arrival_time, seq.seq_id


class Scheduler:
    def __init__(self, config: EngineConfig, gpu_allocator, cpu_allocator, policy, metrics: EngineMetrics,
                 block_bytes: int):
        self.config = config
        self.gpu = gpu_allocator
        self.cpu = cpu_allocator
        self.policy = policy
        self.metrics = metrics
        self.block_bytes = block_bytes
        self.watermark_blocks = int(config.watermark * gpu_allocator.num_blocks)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []

    # ---- queues -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._enqueue(self.waiting, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @staticmethod
    def _enqueue(queue: list[Sequence], seq: Sequence) -> None:
        queue.append(seq)
        queue.sort(key=by_arrival)

    def why_never(self, seq: Sequence) -> str | None:
        """Why ``seq`` could never run in this pool, or None if it can."""
        bs, total = self.config.block_size, self.gpu.num_blocks
        prompt_blocks = blocks_for(len(seq.prompt_token_ids), bs)
        full_blocks = blocks_for(len(seq.prompt_token_ids) + seq.params.max_tokens, bs)
        if prompt_blocks > total - self.watermark_blocks:
            return (f"its prompt of {len(seq.prompt_token_ids)} tokens needs {prompt_blocks} KV blocks of "
                    f"{bs} tokens, more than the {total - self.watermark_blocks} the pool can ever admit; "
                    f"raise num_gpu_blocks or shorten the prompt")
        if full_blocks > total:
            return (f"prompt ({len(seq.prompt_token_ids)} tokens) plus max_tokens ({seq.params.max_tokens}) needs "
                    f"{full_blocks} KV blocks of {bs} tokens but the pool has {total}; "
                    f"raise num_gpu_blocks or lower max_tokens")
        return None

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self.running.remove(seq)
        for block in seq.block_table.pop_tail(len(seq.block_table)):
            self.gpu.free(block)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if out.num_preemptions == 0:
            self._resume(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        queue = list(self.running)  # oldest first; the newest are the first victims
        kept: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0:
                kept.append(seq)
                continue
            needed = seq.block_table.num_missing_blocks(seq.num_computed_tokens + num_new)
            while self.gpu.num_free < needed:
                candidates = sorted(self._holders() + [seq] + queue, key=by_arrival)
                victim = self.policy.select_victim(candidates)
                self._preempt(victim, needed - self.gpu.num_free, out)
                if victim is seq:
                    break
                if victim in queue:
                    queue.remove(victim)
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self._allocate(seq, needed)
            out.scheduled.append((seq, num_new))
            budget -= num_new
            kept.append(seq)
        self.running = kept
        return budget

    def _resume(self, out: SchedulerOutput, budget: int) -> None:
        for seq in sorted(self.swapped + self.waiting, key=by_arrival):
            if len(self.running) >= self.config.max_num_seqs or budget == 0:
                return
            num_new = min(seq.num_uncomputed_tokens, budget)
            held = len(seq.block_table) + len(seq.host_blocks)
            needed = len(seq.host_blocks) + max(0, blocks_for(seq.num_computed_tokens + num_new,
                                                              self.config.block_size) - held)
            if self.gpu.can_allocate(needed, self.watermark_blocks) is not AllocStatus.OK:
                return  # oldest first: nobody newer overtakes a request that is waiting for room
            if seq.status is SequenceStatus.SWAPPED:
                self._swap_in(seq, out)
                self.swapped.remove(seq)
            else:
                self.waiting.remove(seq)
            self._allocate(seq, seq.block_table.num_missing_blocks(seq.num_computed_tokens + num_new))
            seq.status = SequenceStatus.RUNNING
            self._enqueue(self.running, seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new

    # ---- blocks --------------------------------------------------------------------------------
    def _allocate(self, seq: Sequence, count: int) -> None:
        for _ in range(count):
            seq.block_table.append(self.gpu.allocate())

    def _holders(self) -> list[Sequence]:
        """Preempted sequences that still hold device blocks (after a partial preemption)."""
        return [s for s in self.waiting + self.swapped if len(s.block_table)]

    def _preempt(self, victim: Sequence, shortfall: int, out: SchedulerOutput) -> None:
        """Take blocks from ``victim``: only ``shortfall`` tail blocks when preemption is partial."""
        held = len(victim.block_table)
        running = victim.status is SequenceStatus.RUNNING
        take = min(shortfall, held) if self.config.partial_preemption else held
        kept_tokens = min(victim.num_computed_tokens, (held - take) * self.config.block_size)
        context = PreemptionContext(num_blocks=take, num_tokens=victim.num_computed_tokens - kept_tokens,
                                    block_bytes=self.block_bytes, host_free_blocks=self.cpu.num_free)
        mode = self.policy.choose_mode(victim, context)
        if mode == "swap" and self.cpu.num_free < take:
            mode = "recompute"
            self.metrics.num_swap_fallbacks += 1
        if running:
            self.running.remove(victim)
            victim.num_preemptions += 1
            self.metrics.num_preemptions += 1
            out.num_preemptions += 1
            if mode == "swap":
                self.metrics.num_preemptions_swap += 1
            else:
                self.metrics.num_preemptions_recompute += 1
        if mode == "swap":
            self._swap_out(victim, take, out)
        else:
            self._drop(victim, take)

    def _swap_out(self, victim: Sequence, take: int, out: SchedulerOutput) -> None:
        tail = victim.block_table.pop_tail(take)
        host = [self.cpu.allocate() for _ in tail]
        for device_block, host_block in zip(tail, host):
            out.swap_out.append((device_block, host_block))
            self.gpu.free(device_block)
        victim.host_blocks = host + victim.host_blocks
        self.metrics.num_swapped_out_blocks += len(tail)
        if victim.status is not SequenceStatus.SWAPPED:
            self.waiting = [s for s in self.waiting if s is not victim]
            victim.status = SequenceStatus.SWAPPED
            self._enqueue(self.swapped, victim)

    def _drop(self, victim: Sequence, take: int) -> None:
        if victim.host_blocks:  # a swapped sequence that must now recompute: its host copy is useless
            take = len(victim.block_table)
            for block in victim.host_blocks:
                self.cpu.free(block)
            victim.host_blocks = []
        for block in victim.block_table.pop_tail(take):
            self.gpu.free(block)
        kept_tokens = min(victim.num_computed_tokens, len(victim.block_table) * self.config.block_size)
        self.metrics.num_recomputed_tokens += victim.num_computed_tokens - kept_tokens
        victim.num_computed_tokens = kept_tokens
        if victim.status is not SequenceStatus.WAITING:
            self.swapped = [s for s in self.swapped if s is not victim]
            victim.status = SequenceStatus.WAITING
            self._enqueue(self.waiting, victim)

    def _swap_in(self, seq: Sequence, out: SchedulerOutput) -> None:
        for host_block in seq.host_blocks:
            device_block = self.gpu.allocate()
            seq.block_table.append(device_block)
            out.swap_in.append((host_block, device_block))
            self.cpu.free(host_block)
        self.metrics.num_swapped_in_blocks += len(seq.host_blocks)
        seq.host_blocks = []
