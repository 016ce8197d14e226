"""The engine: requests in, one scheduled model step at a time, finished requests out."""
from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from typing import Optional, Union

import torch

from kvlib.block_allocator import BlockAllocator
from kvlib.config import EngineConfig, SamplingParams
from kvlib.cost_probe import measure_cost_model
from kvlib.device import choose_attention_backend, make_attention_backend, resolve_device, resolve_dtype
from kvlib.kv_cache import KVCachePool, KVCacheSpec, copy_blocks_between, gather_blocks, scatter_blocks
from kvlib.metrics import EngineMetrics, StepRecord
from kvlib.model.default import default_model_path
from kvlib.model.loader import load_model
from kvlib.model_runner import build_step_inputs
from kvlib.outputs import RequestOutput, SampleOutput
from kvlib.oversubscription import OversubscriptionDetector
from kvlib.preemption import LatestArrivalPolicy
from kvlib.sampler import sample
from kvlib.scheduler import Scheduler, SchedulerOutput
from kvlib.sequence import Sequence
from kvlib.tokenizer import Tokenizer

logger = logging.getLogger("kvlib")

CPU_KV_BUDGET_BYTES = 256 * 2**20  # device pool size on a CPU when num_gpu_blocks is None


class LLMEngine:
    def __init__(self, model: Union[str, Path] = "default", config: Optional[EngineConfig] = None, *,
                 allocator=None, preemption_policy=None, attention_backend=None, block_sharing=None,
                 oversubscription_detector=None, verbose: bool = True):
        self.config = config = config or EngineConfig()
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        folder = default_model_path() if str(model) == "default" else Path(model)
        self.model = load_model(folder, self.device, self.dtype)
        self.model_config = self.model.config
        self.tokenizer = Tokenizer.from_folder(folder)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        if attention_backend is None:
            choice = choose_attention_backend(config.attention_backend, self.device)
            attention_backend = make_attention_backend(choice)
            if verbose:
                print(choice.describe(self.device))
        self.backend = attention_backend
        self.spec = KVCacheSpec(self.model_config.num_layers, self.model_config.num_kv_heads,
                                self.model_config.head_dim, config.block_size, self.dtype)
        num_gpu_blocks = config.num_gpu_blocks or self._blocks_that_fit()
        self.gpu_pool = KVCachePool(self.spec, num_gpu_blocks, self.device)
        self.cpu_pool = KVCachePool(self.spec, config.num_cpu_blocks, "cpu", pin_memory=self.device.type == "cuda")
        make_allocator = allocator or BlockAllocator
        self.metrics = EngineMetrics()
        self.policy = preemption_policy or self._default_policy(verbose)
        self.oversubscription = oversubscription_detector or OversubscriptionDetector()
        self.scheduler = Scheduler(config, make_allocator(num_gpu_blocks), make_allocator(config.num_cpu_blocks),
                                   self.policy, self.metrics, self.spec.block_bytes, block_sharing)
        self._requests: dict[str, list[Sequence]] = {}
        self._rejected: list[RequestOutput] = []
        self._seq_ids = itertools.count()
        self._step = 0

    def _default_policy(self, verbose: bool) -> LatestArrivalPolicy:
        if self.config.preemption_mode != "auto":
            return LatestArrivalPolicy(self.config.preemption_mode)
        cost = measure_cost_model(self.model, self.gpu_pool, self.backend)
        if verbose:
            print(f"kvlib: auto preemption, measured host link {cost.host_link_bytes_per_s / 1e9:.2f} GB/s, "
                  f"prefill {cost.prefill_tokens_per_s:,.0f} tokens/s")
        return LatestArrivalPolicy("auto", cost)

    def _blocks_that_fit(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * self.config.gpu_memory_utilization
        else:
            budget = CPU_KV_BUDGET_BYTES
        return max(1, int(budget // self.spec.block_bytes))

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Union[str, list[int]], params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None) -> None:
        """Queue a request. A request that cannot run is not raised: it comes back from ``step`` rejected.

        ``arrival_time`` (``time.perf_counter()`` seconds, default now) orders the queues: older first,
        and the newest running request is the default preemption victim.
        """
        params = params or SamplingParams()
        if request_id in self._requests or any(r.request_id == request_id for r in self._rejected):
            raise ValueError(f"request_id {request_id!r} is already in use; give each request a unique id")
        now = time.perf_counter() if arrival_time is None else arrival_time
        token_ids, error = self._encode(prompt)
        if error is None:
            error = self._check_length(token_ids, params)
        if error is None:
            seq = self._new_sequence(request_id, token_ids, params, 0, now)
            error = self.scheduler.why_never(seq)
        if error is not None:
            self._reject(request_id, token_ids, params, error)
            return
        self._requests[request_id] = [seq]  # with n > 1, the other samples fork from it after its prefill
        self.metrics.num_prompt_tokens += len(token_ids)
        self.scheduler.add(seq)

    def _encode(self, prompt) -> tuple[list[int], Optional[str]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return [], "this model folder has no tokenizer.json: pass the prompt as a list of token ids"
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
        if not token_ids:
            return [], "the prompt is empty: give at least one token"
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            return token_ids, (f"token id {bad[0]!r} is outside the model's vocabulary (valid ids are 0 to {vocab - 1}); "
                               f"encode the prompt with this model's tokenizer")
        return token_ids, None

    def _check_length(self, token_ids: list[int], params: SamplingParams) -> Optional[str]:
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            return (f"prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) is {total} tokens, beyond "
                    f"the model's context of {self.max_model_len}; lower max_tokens or shorten the prompt")
        return None

    def _new_sequence(self, request_id, token_ids, params, index, now) -> Sequence:
        seq_id = next(self._seq_ids)
        generator = None
        if not params.greedy:  # sample j of a seeded request draws like a request seeded seed + j
            seed = params.seed + index if params.seed is not None else self.config.seed * 1_000_003 + seq_id
            generator = torch.Generator().manual_seed(seed)
        return Sequence(seq_id, request_id, list(token_ids), params, self.config.block_size, now, generator)

    def _reject(self, request_id, token_ids, params, error) -> None:
        logger.warning("request %s rejected: %s", request_id, error)
        self.metrics.num_rejected += 1
        samples = [SampleOutput([], "" if self.tokenizer else None, "rejected") for _ in range(params.n)]
        self._rejected.append(RequestOutput(request_id, token_ids, samples, finished=True, error=error))

    def has_unfinished_requests(self) -> bool:
        return bool(self._rejected) or self.scheduler.has_unfinished()

    # ---- one step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, move swapped blocks, run the model once, sample; return the requests that progressed."""
        outputs, self._rejected = self._rejected, []
        if not self.scheduler.has_unfinished():
            return outputs
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        self._swap(plan)
        if not plan.scheduled:
            raise RuntimeError(self._stall_message())
        ids, positions, meta, rows = build_step_inputs(plan.scheduled, self.config.block_size, self.device,
                                                       self.model_config.sliding_window)
        forward_start = time.perf_counter()
        logits = self.model(ids, positions, self.gpu_pool, meta, self.backend, rows)
        self._account_recompute(plan, time.perf_counter() - forward_start)
        finishing = []
        for seq, num_new in plan.scheduled:
            seq.num_computed_tokens += num_new
            seq.peak_computed_tokens = max(seq.peak_computed_tokens, seq.num_computed_tokens)
            self.scheduler.register_computed(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                finishing.append(seq)
        rows = self._fork_samples(finishing)
        tokens = sample(logits[rows], finishing) if finishing else []
        now = time.perf_counter()
        for seq, token in zip(finishing, tokens):
            seq.record_token(token, now)
            self._maybe_finish(seq, token, now)
        self.metrics.num_generated_tokens += len(tokens)
        progressed = [self._request_output(rid) for rid in dict.fromkeys(s.request_id for s in finishing)]
        for out in progressed:
            if out.finished:
                seqs = self._requests.pop(out.request_id)
                self.metrics.record_finished(out.request_id, seqs)
        warning = self.oversubscription.observe(self.metrics)
        if warning:
            logger.warning(warning)
        self._record_step(plan, start)
        return outputs + progressed

    def _fork_samples(self, finishing: list[Sequence]) -> list[int]:
        """After a prefill with n > 1, fork the other samples; each draws from the same logits row."""
        rows = list(range(len(finishing)))
        for row, seq in enumerate(list(finishing)):
            group = self._requests[seq.request_id]
            if seq.params.n == 1 or len(group) > 1 or seq.output_token_ids:
                continue
            for index in range(1, seq.params.n):
                child = self._new_sequence(seq.request_id, seq.prompt_token_ids, seq.params, index, seq.arrival_time)
                self.scheduler.fork(seq, child)
                group.append(child)
                finishing.append(child)
                rows.append(row)
        return rows

    def _account_recompute(self, plan: SchedulerOutput, forward_seconds: float) -> None:
        """Charge recomputation its share of the forward pass: tokens below a sequence's peak are redone."""
        redone = sum(max(0, min(seq.num_computed_tokens + n, seq.peak_computed_tokens) - seq.num_computed_tokens)
                     for seq, n in plan.scheduled)
        if redone:
            self.metrics.recompute_time += forward_seconds * redone / plan.num_batched_tokens

    def _swap(self, plan: SchedulerOutput) -> None:
        """Move this step's blocks: each copy reads what the block held when the step began.

        A block freed by one move may be reused by another in the same step (a host block a
        resumed sequence just left can receive an evicted prefix block), so every source is
        gathered before anything is written. Copy-on-write sources are never written in a step
        (they are still shared), so those copies can run in place, between the two phases.
        """
        if not (plan.swap_out or plan.swap_in or plan.copies):
            return
        start = time.perf_counter()
        out_staged = gather_blocks(self.gpu_pool, [d for d, _ in plan.swap_out]) if plan.swap_out else None
        in_staged = gather_blocks(self.cpu_pool, [h for h, _ in plan.swap_in]) if plan.swap_in else None
        if plan.copies:
            src, dst = map(list, zip(*plan.copies))
            if hasattr(self.backend, "copy_blocks"):
                self.backend.copy_blocks(self.gpu_pool.data, src, dst)
            else:
                copy_blocks_between(self.gpu_pool, self.gpu_pool, src, dst)
        if out_staged is not None:
            scatter_blocks(self.cpu_pool, [h for _, h in plan.swap_out], out_staged)
        if in_staged is not None:
            scatter_blocks(self.gpu_pool, [d for _, d in plan.swap_in], in_staged)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.metrics.swap_time += time.perf_counter() - start
        self.metrics.swap_bytes += (len(plan.swap_out) + len(plan.swap_in)) * self.spec.block_bytes

    def _maybe_finish(self, seq: Sequence, token: int, now: float) -> None:
        params = seq.params
        if not params.ignore_eos and token in self.model_config.eos_token_ids or token in params.stop_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        else:
            return
        seq.finish_time = now
        self.scheduler.finish(seq)

    def _request_output(self, request_id: str) -> RequestOutput:
        """Tokens so far; the text is decoded once, when the request finishes (decoding every step is quadratic)."""
        seqs = self._requests[request_id]
        finished = len(seqs) == seqs[0].params.n and all(s.is_finished for s in seqs)
        decode = self.tokenizer.decode if self.tokenizer and finished else None
        samples = [SampleOutput(list(s.output_token_ids), decode(s.output_token_ids) if decode else None, s.finish_reason)
                   for s in seqs]
        return RequestOutput(request_id, list(seqs[0].prompt_token_ids), samples, finished=finished)

    def _record_step(self, plan: SchedulerOutput, start: float) -> None:
        self._step += 1
        self.metrics.num_steps += 1
        s = self.scheduler
        if s.cache is not None:
            self.metrics.prefix_cache_queried_tokens = s.cache.num_queried_tokens
            self.metrics.prefix_cache_hit_tokens = s.cache.num_hit_tokens
            self.metrics.prefix_cache_host_hit_tokens = s.cache.num_host_hit_tokens
        tables = [seq.block_table.blocks for seq in s.waiting + s.running + s.swapped]
        self.metrics.timeline.append(StepRecord(
            step=self._step, time=time.perf_counter() - start,
            gpu_blocks_used=s.gpu.num_used, gpu_blocks_total=s.gpu.num_blocks,
            cpu_blocks_used=s.cpu.num_used, cpu_blocks_total=s.cpu.num_blocks,
            num_running=len(s.running), num_waiting=len(s.waiting), num_swapped=len(s.swapped),
            num_batched_tokens=plan.num_batched_tokens, num_preemptions=plan.num_preemptions,
            blocks_saved_by_sharing=sum(map(len, tables)) - len({b for t in tables for b in t})))

    def _stall_message(self) -> str:
        s = self.scheduler
        return (f"the scheduler found nothing to run: {len(s.waiting)} waiting, {len(s.running)} running, "
                f"{len(s.swapped)} swapped, {s.gpu.num_free}/{s.gpu.num_blocks} device blocks free; "
                f"this is a bug in the scheduler or in a plugged-in allocator or policy")
