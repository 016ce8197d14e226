"""The scheduler: which sequences run this step, with which blocks, and who is preempted.

Each step it (1) gives every running sequence the blocks for its next tokens, preempting the
policy's victims when the device pool runs dry, then, if nobody was preempted, (2) resumes
swapped and waiting sequences, oldest first, while the pool stays above the watermark and the
step's token budget lasts. Every sequence computes the tokens between ``num_computed_tokens``
and its end, so a prefill, a decode, a chunk of a long prompt and a recomputation after
preemption are all the same operation.

Sharing: a block may sit in several block tables (the samples of one request share their
prompt; prefix caching shares full blocks across requests), and its reference count says how
many. A sequence about to write into a shared block first gets its own copy (copy-on-write).
Preemption never frees or moves a block away from another sequence that still uses it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kvlib.block_allocator import AllocStatus
from kvlib.block_table import blocks_for
from kvlib.config import EngineConfig
from kvlib.metrics import EngineMetrics
from kvlib.prefix_cache import PrefixCache, PrefixHit
from kvlib.preemption import PreemptionContext, VictimCandidate
from kvlib.sequence import Sequence, SequenceStatus
from kvlib.sharing import BlockSharing


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (device block, device block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    num_preemptions: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


def by_arrival(seq: Sequence) -> tuple[float, int]:
    return seq.arrival_time, seq.seq_id


class Scheduler:
    def __init__(self, config: EngineConfig, gpu_allocator, cpu_allocator, policy, metrics: EngineMetrics,
                 block_bytes: int, sharing=None):
        self.config = config
        self.block_size = config.block_size
        self.gpu = gpu_allocator
        self.cpu = cpu_allocator
        self.policy = policy
        self.sharing = sharing or BlockSharing()
        self.metrics = metrics
        self.block_bytes = block_bytes
        host_tier = cpu_allocator if config.host_prefix_cache else None
        self.cache = PrefixCache(gpu_allocator, host_tier) if config.enable_prefix_caching else None
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

    def _move(self, seq: Sequence, status: SequenceStatus) -> None:
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)
        seq.status = status
        queue = {SequenceStatus.WAITING: self.waiting, SequenceStatus.RUNNING: self.running,
                 SequenceStatus.SWAPPED: self.swapped}.get(status)
        if queue is not None:
            self._enqueue(queue, seq)

    def why_never(self, seq: Sequence) -> Optional[str]:
        """Why ``seq`` could never run in this pool, or None if it can."""
        bs, total = self.block_size, self.gpu.num_blocks
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
        self._release_device(seq, len(seq.block_table))
        self._move(seq, SequenceStatus.FINISHED)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` continues from ``parent``'s computed tokens, sharing every block by reference."""
        child.block_table.blocks = self.sharing.fork(self.gpu, list(parent.block_table.blocks))
        child.num_computed_tokens = child.peak_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        self._move(child, SequenceStatus.RUNNING)

    def register_computed(self, seq: Sequence) -> None:
        """Name the blocks ``seq`` has just filled, so later requests can reuse them."""
        if self.cache is None:
            return
        tokens = seq.token_ids
        for index in range(len(seq.block_hashes), seq.num_computed_tokens // self.block_size):
            previous = seq.block_hashes[-1] if seq.block_hashes else None
            chunk = tuple(tokens[index * self.block_size:(index + 1) * self.block_size])
            seq.block_hashes.append(self.cache.insert(previous, chunk, seq.block_table.blocks[index]))

    # ---- capacity -----------------------------------------------------------------------------
    def num_available(self) -> int:
        """Blocks that can be handed out now: free ones plus cached ones nobody uses."""
        return self.gpu.num_free + (self.cache.num_evictable if self.cache else 0)

    def _has_room(self, needed: int) -> bool:
        return self.gpu.num_free >= needed or self.num_available() >= needed

    def _take_block(self) -> int:
        if self.gpu.num_free == 0 and self.cache is not None:
            self.cache.evict_one()
        return self.gpu.allocate()

    def _sharers(self, block: int) -> int:
        """Sequences using ``block`` (the prefix cache's own reference is not a user)."""
        return self.gpu.ref_count(block) - (1 if self.cache is not None and block in self.cache else 0)

    def _unique_tail(self, seq: Sequence) -> int:
        count = 0
        for block in reversed(seq.block_table.blocks):
            if self._sharers(block) != 1:
                break
            count += 1
        return count

    def _admission(self, needed: int, revived: int = 0) -> AllocStatus:
        """Ask the allocator, counting evictable cached blocks as free (minus those a hit revives)."""
        spare = self.cache.num_evictable - revived if self.cache is not None else 0
        return self.gpu.can_allocate(needed - spare, self.watermark_blocks)

    def _writes_into_shared(self, seq: Sequence, end: int) -> list[int]:
        """Table indices of shared blocks that positions ``num_computed_tokens .. end-1`` would write."""
        first, last = seq.num_computed_tokens // self.block_size, min(len(seq.block_table), blocks_for(end, self.block_size))
        return [i for i in range(first, last) if self.gpu.ref_count(seq.block_table.blocks[i]) > 1]

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.cache is not None:
            self.cache.start_step()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if out.num_preemptions == 0:
            self._resume(out, budget)
        if not out.scheduled and self.has_unfinished():
            self._release_holders()  # everyone waits on blocks held by preempted sequences
            self._resume(out, budget)
        if self.cache is not None:  # evicted prefix blocks on their way to the host tier
            out.swap_out.extend(self.cache.demotions)
            self.cache.demotions.clear()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        queue = list(self.running)  # oldest first; the newest are the first victims
        for position, seq in enumerate(queue):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop, with its request
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0:
                continue
            end = seq.num_computed_tokens + num_new
            shared = self._writes_into_shared(seq, end)
            needed = seq.block_table.num_missing_blocks(end) + len(shared)
            if not self._has_room(needed):
                while not self._has_room(needed) and seq.status is SequenceStatus.RUNNING:
                    shortfall = needed - self.num_available()
                    victim = self.policy.select_victim(self._candidates(seq, queue[position + 1:]), shortfall)
                    self._preempt(victim.seq, shortfall, out)
                if seq.status is not SequenceStatus.RUNNING:
                    continue
                shared = self._writes_into_shared(seq, end)  # a preempted sibling may have let go of some
            self._copy_on_write(seq, shared, out)
            self._allocate(seq, seq.block_table.num_missing_blocks(end))
            out.scheduled.append((seq, num_new))
            budget -= num_new
        return budget

    def _candidates(self, seq: Sequence, later: list[Sequence]) -> list[VictimCandidate]:
        """Who could give up blocks: ``seq`` itself (last resort), newer running ones, and holders."""
        running = [s for s in later if s.status is SequenceStatus.RUNNING]
        holders = [s for s in self.waiting + self.swapped if self._unique_tail(s)]
        candidates = []
        for s in sorted(set(running + holders + [seq]), key=by_arrival):
            unique = self._unique_tail(s)
            if s is seq or unique:
                candidates.append(VictimCandidate(s, s.status is SequenceStatus.RUNNING, len(s.block_table), unique,
                                                  sum(1 for b in s.block_table.blocks if self._sharers(b) > 1)))
        return candidates

    def _resume(self, out: SchedulerOutput, budget: int) -> None:
        for seq in sorted(self.swapped + self.waiting, key=by_arrival):
            if seq.status is SequenceStatus.RUNNING:
                continue  # resumed with its request's other samples
            if budget == 0:
                return
            group = self._swapped_group(seq) if seq.status is SequenceStatus.SWAPPED else [seq]
            if len(self.running) + len(group) + self._pending_forks(seq) > self.config.max_num_seqs:
                return
            admitted = self._swap_in_group(group, budget, out) if seq.status is SequenceStatus.SWAPPED \
                else self._admit_waiting(seq, budget, out)
            if not admitted:
                return  # oldest first: nobody newer overtakes a request that is waiting for room
            budget -= sum(n for s, n in out.scheduled if s in group)

    @staticmethod
    def _pending_forks(seq: Sequence) -> int:
        return seq.params.n - 1 if seq.num_computed_tokens == 0 and not seq.output_token_ids else 0

    def _admit_waiting(self, seq: Sequence, budget: int, out: SchedulerOutput) -> bool:
        hits = self._prefix_hits(seq)
        computed = seq.num_computed_tokens + len(hits) * self.block_size
        num_new = min(seq.num_tokens - computed, budget)
        from_host = sum(1 for h in hits if h.on_host)
        needed = from_host + max(0, blocks_for(computed + num_new, self.block_size) - len(seq.block_table) - len(hits))
        revived = sum(1 for h in hits if not h.on_host and self.gpu.ref_count(h.block_id) == 1)
        if self._admission(needed, revived) is not AllocStatus.OK:
            return False
        if self.cache is not None and not seq.block_table.blocks:
            self.cache.record_query(seq.num_tokens, hits, self.block_size)
            self.cache.pin([h.block_id for h in hits if h.on_host])  # taking device blocks may evict to the host
        for hit in hits:
            if hit.on_host:  # tiered cache: copy the block back instead of recomputing it
                block = self._take_block()
                out.swap_in.append((hit.block_id, block))
                self.cache.promote(hit, block)
            else:
                block = self.gpu.fork(hit.block_id)
                self.cache.touch(block)
            seq.block_table.append(block)
            seq.block_hashes.append(hit.name)
        seq.num_computed_tokens = computed
        self._allocate(seq, needed - from_host)
        self._move(seq, SequenceStatus.RUNNING)
        out.scheduled.append((seq, num_new))
        return True

    def _prefix_hits(self, seq: Sequence) -> list[PrefixHit]:
        """Cached blocks for a sequence that holds none yet; the last token is always computed."""
        if self.cache is None or seq.block_table.blocks:
            return []
        return self.cache.match(seq.token_ids[:-1], self.block_size)

    def _swapped_group(self, seq: Sequence) -> list[Sequence]:
        """Swapped samples of one request share host blocks, so they come back together."""
        return [s for s in self.swapped if s.request_id == seq.request_id]

    def _swap_in_group(self, group: list[Sequence], budget: int, out: SchedulerOutput) -> bool:
        host_blocks = {b for s in group for b in s.host_blocks}
        plans = [(s, min(s.num_uncomputed_tokens, max(1, budget // len(group)))) for s in group]
        extra = sum(max(0, blocks_for(s.num_computed_tokens + n, self.block_size)
                        - len(s.block_table) - len(s.host_blocks)) for s, n in plans)
        if self._admission(len(host_blocks) + extra) is not AllocStatus.OK:
            return False
        moved: dict[int, int] = {}
        for seq, num_new in plans:
            for host_block in seq.host_blocks:
                if host_block in moved:
                    device_block = self.gpu.fork(moved[host_block])
                else:
                    device_block = moved[host_block] = self._take_block()
                    out.swap_in.append((host_block, device_block))
                seq.block_table.append(device_block)
                self.cpu.free(host_block)
            seq.host_blocks = []
            self._allocate(seq, seq.block_table.num_missing_blocks(seq.num_computed_tokens + num_new))
            self._move(seq, SequenceStatus.RUNNING)
            out.scheduled.append((seq, num_new))
        self.metrics.num_swapped_in_blocks += len(moved)
        return True

    # ---- blocks -------------------------------------------------------------------------------
    def _allocate(self, seq: Sequence, count: int) -> None:
        for _ in range(count):
            seq.block_table.append(self._take_block())

    def _copy_on_write(self, seq: Sequence, indices: list[int], out: SchedulerOutput) -> None:
        for index in indices:
            copy = self.sharing.make_writable(self.gpu, seq.block_table.blocks, index, self._take_block)
            if copy is not None:
                out.copies.append(copy)
                self.metrics.num_cow_copies += 1

    def _release_device(self, seq: Sequence, count: int) -> None:
        """Drop ``seq``'s reference to its last ``count`` blocks (shared ones live on for the others)."""
        released = seq.block_table.pop_tail(count)
        for block in released:
            self.gpu.free(block)
        if self.cache is not None:
            self.cache.release_order(released)
        kept = len(seq.block_table) * self.block_size
        seq.num_computed_tokens = min(seq.num_computed_tokens, kept + len(seq.host_blocks) * self.block_size)
        del seq.block_hashes[len(seq.block_table):]

    # ---- preemption ---------------------------------------------------------------------------
    def _preempt(self, victim: Sequence, shortfall: int, out: SchedulerOutput) -> None:
        """Partial: the victim's unique tail, only ``shortfall`` blocks of it. Full: the victim's request.

        Samples of the request already scheduled this step keep running; blocks they share with
        the victims stay theirs (a swap copies them, a drop only lets go of a reference).
        """
        scheduled = {s for s, _ in out.scheduled}
        running = [s for s in self.running if s.request_id == victim.request_id and s not in scheduled]
        partial = self.config.partial_preemption and len(running) <= 1
        group = [victim] if partial or victim not in running else running
        if partial:
            take = min(shortfall, self._unique_tail(victim))
            distinct = take
        else:
            take = None
            distinct = len({b for s in group for b in s.block_table.blocks})
        tokens = sum(s.num_computed_tokens for s in group) if take is None else min(
            victim.num_computed_tokens, take * self.block_size)
        context = PreemptionContext(num_blocks=distinct, num_tokens=tokens, block_bytes=self.block_bytes,
                                    host_free_blocks=self.cpu.num_free)
        mode = self.policy.choose_mode(victim, context)
        while mode == "swap" and self.cpu.num_free < distinct and self.cache is not None and self.cache.evict_host_one():
            pass  # a preempted sequence's blocks outrank cached prefixes on the host
        if mode == "swap" and self.cpu.num_free < distinct:
            mode = "recompute"
            self.metrics.num_swap_fallbacks += 1
        for seq in group:
            if seq.status is SequenceStatus.RUNNING:
                seq.num_preemptions += 1
                out.num_preemptions += 1
                self.metrics.num_preemptions += 1
                if mode == "swap":
                    self.metrics.num_preemptions_swap += 1
                else:
                    self.metrics.num_preemptions_recompute += 1
        if mode == "swap":
            self._swap_out(group, take, out)
        else:
            for seq in group:
                self._drop(seq, len(seq.block_table) if take is None else take)

    def _swap_out(self, group: list[Sequence], take: Optional[int], out: SchedulerOutput) -> None:
        """Copy the group's blocks to the host; a block its members share moves once for all of them."""
        moved: dict[int, int] = {}
        for seq in group:
            count = len(seq.block_table) if take is None else take
            tail = seq.block_table.blocks[len(seq.block_table) - count:]
            host = []
            for device_block in tail:
                if device_block in moved:
                    host.append(self.cpu.fork(moved[device_block]))
                else:
                    host.append(self.cpu.allocate())
                    moved[device_block] = host[-1]
            seq.host_blocks = host + seq.host_blocks
            self._release_device(seq, count)
            self._move(seq, SequenceStatus.SWAPPED)
        out.swap_out.extend(moved.items())
        self.metrics.num_swapped_out_blocks += len(moved)

    def _drop(self, seq: Sequence, count: int) -> None:
        """Recompute later: let go of the tail (and of any host copy, now useless)."""
        before = seq.num_computed_tokens
        if seq.host_blocks:
            for block in seq.host_blocks:
                self.cpu.free(block)
            seq.host_blocks = []
            count = len(seq.block_table)
        self._release_device(seq, count)
        self.metrics.num_recomputed_tokens += before - seq.num_computed_tokens
        self._move(seq, SequenceStatus.WAITING)

    def _release_holders(self) -> None:
        """Nothing can run: preempted sequences holding blocks give them all up, to be recomputed."""
        for seq in list(self.waiting + self.swapped):
            if seq.block_table.blocks or seq.host_blocks:
                self._drop(seq, len(seq.block_table))
