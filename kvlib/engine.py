"""The engine: requests in, one scheduled model step at a time, finished requests out.

``step()`` reads as the data path does: the scheduler plans (policy), the model runner carries
out the block moves and runs the model, the scheduler records what came out, and the metrics
record the step.

A step that raises loses nothing: the outputs it had in hand come back from the next one. Where
it raises while the block moves it planned are copied, or while their tokens are recorded, the
books and the KV cache no longer agree and cannot be put back; the engine then refuses to go on
(:class:`EngineStoppedError`, naming the cause and the recovery) rather than serve tokens from
K/V never written.
"""
from __future__ import annotations

import logging
import operator
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Union

import torch

from kvlib import interfaces
from kvlib.config import EngineConfig, SamplingParams, is_integer, is_number
from kvlib.core.pieces import Pieces, build_core
from kvlib.core.plan import SchedulerOutput, StepResult
from kvlib.core.sequence import Sequence, sample_stream_seed
from kvlib.metrics import EngineMetrics, StepRecord
from kvlib.model.catalog import gguf_source, resolve_model_folder
from kvlib.model.loader import load_model
from kvlib.model.weight_formats import describe_weights, dtype_name, use_weight_format
from kvlib.outputs import RequestOutput, SampleOutput
from kvlib.runner.device import choose_attention_backend, make_attention_backend, resolve_device, resolve_dtype
from kvlib.runner.model_runner import ModelRunner
from kvlib.tokenizer import Tokenizer, unicode_problem

logger = logging.getLogger("kvlib")


class EngineStoppedError(RuntimeError):
    """A step stopped halfway through its block moves or its bookkeeping: this engine can serve no more."""


class LLMEngine:
    """Takes the pieces of :class:`~kvlib.core.pieces.Pieces` as keyword arguments (``allocator=``,
    ``preemption_policy=``, ``scheduler=`` ...), each replacing kvlib's own."""

    def __init__(self, model: Union[str, Path] = "default", config: Optional[EngineConfig] = None, *,
                 verbose: bool = True, **pieces):
        if config is not None and not isinstance(config, EngineConfig):
            hint = "; for a dict of its fields, pass EngineConfig(**that_dict)" if isinstance(config, dict) else ""
            raise TypeError(f"config must be an EngineConfig, got a {type(config).__name__}{hint}")
        self.config = config = (config or EngineConfig()).copy()  # the caller's object may change; this may not
        pieces = Pieces.from_keywords(**pieces).with_defaults(config)
        self.policy = pieces.preemption_policy
        self.oversubscription = pieces.oversubscription_detector
        model = self._load(model)
        backend = self._attention_backend(pieces.attention_backend, verbose)
        if verbose:
            print(describe_weights(model))
        self.runner = self._runner(model, backend)  # on a GPU: profiles a forward pass and sizes the pool by it
        self.runner.warm_up_kernels()
        self.runner.capture_decode_graphs()
        self.cost_model = self._probe_cost_model(verbose) if config.preemption_mode == "auto" else None
        self.block_manager, self.scheduler = build_core(
            config, pieces, num_device_blocks=self.runner.device_pool.num_blocks,
            block_bytes=self.runner.spec.block_bytes,
            eos_token_ids=frozenset(self.model_config.eos_token_ids), max_model_len=self.max_model_len,
            cost_model=self.cost_model)
        self.metrics = EngineMetrics(history=config.metrics_history)
        self._requests: dict[str, list[Sequence]] = {}  # live requests: their sequences, sample 0 first
        self._ready: dict[str, RequestOutput] = {}  # outputs the next step() hands out first (rejections ...)
        self._deferred_aborts: Optional[list[str]] = None  # in a step, an abort or an add: aborts asked, done after
        self._stopped: Optional[str] = None  # why the engine refuses to go on, once a step stopped halfway
        self._num_requests = 0
        self._step = 0
        if config.preemption_mode == "swap" and config.num_cpu_blocks == 0:
            logger.warning("preemption_mode='swap' with num_cpu_blocks=0: there is no host pool to swap into, so "
                           "every preemption will recompute; give num_cpu_blocks a size to swap")

    def _load(self, model: Union[str, Path]):
        """The model on the configured device and dtype, with its tokenizer and context length."""
        self.device = resolve_device(self.config.device)
        self.dtype = resolve_dtype(self.config.dtype, self.device)
        folder = resolve_model_folder(model)
        loaded = self._in_weight_format(load_model(folder, self.device, self.dtype), model)
        self.model_config = loaded.config
        self.tokenizer = Tokenizer.from_folder(folder)
        self.max_model_len = self._max_model_len()
        return loaded

    def _in_weight_format(self, model, source):
        """The projections in ``config.weight_format``: a CPU's float32 model only; q4_1 from the GGUF file itself."""
        fmt = self.config.weight_format
        on_cpu_in_float32 = self.device.type == "cpu" and self.dtype == torch.float32
        if fmt == "float32":
            return use_weight_format(model, fmt) if on_cpu_in_float32 else model
        if not on_cpu_in_float32:
            raise ValueError(f"weight_format={fmt!r} is for a float32 model on a CPU, but this engine runs "
                             f"{dtype_name(self.dtype)} on {self.device.type}; on a GPU use "
                             f"dtype='bfloat16' instead, or weight_format='float32'")
        if fmt == "bfloat16":
            return use_weight_format(model, fmt)
        gguf = gguf_source(source)
        if gguf is None:
            raise ValueError(f"weight_format='q4_1' takes the projections from the model's own GGUF file, but "
                             f"{source!r} is not a GGUF model; pass a .gguf file or a catalog name such as "
                             f"'smollm2-135m', or weight_format='bfloat16'")
        return use_weight_format(model, fmt, gguf)

    def _attention_backend(self, backend, verbose: bool):
        if backend is None:
            choice = choose_attention_backend(self.config.attention_backend, self.device)
            backend = make_attention_backend(choice)
            if verbose:
                print(choice.describe(self.device))
        interfaces.check_attention_backend(backend, self.dtype)
        return backend

    def _runner(self, model, backend) -> ModelRunner:
        c = self.config
        return ModelRunner(model, backend, block_size=c.block_size, num_gpu_blocks=c.num_gpu_blocks,
                           num_cpu_blocks=c.num_cpu_blocks, device=self.device, dtype=self.dtype,
                           gpu_memory_utilization=c.gpu_memory_utilization, max_num_seqs=c.max_num_seqs,
                           max_num_batched_tokens=c.max_num_batched_tokens, max_model_len=self.max_model_len)

    def _max_model_len(self) -> int:
        positions = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len or positions
        if wanted > positions:
            raise ValueError(f"max_model_len={wanted} is beyond the model's {positions} positions "
                             f"(max_position_embeddings); use at most {positions}, or None")
        return wanted

    def _probe_cost_model(self, verbose: bool):
        """Auto mode prices swap and recompute with the policy's cost model, else one measured here now."""
        cost = self.policy.cost_model or self.runner.measure_cost_model()
        if verbose:
            print(f"kvlib: auto preemption, host link {cost.host_link_bytes_per_s / 1e9:.2f} GB/s, "
                  f"prefill {cost.prefill_tokens_per_s:,.0f} tokens/s")
        return cost

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Union[str, list[int]], params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None) -> None:
        """Queue a request. A request that cannot run is not raised: it comes back from ``step`` rejected.

        ``arrival_time`` (``time.perf_counter()`` seconds, default now) orders the queues: older first,
        and the newest running request is the default preemption victim.
        """
        self._require_running()
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__} {request_id!r}")
        if self.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use; give each request a unique id")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__} {params!r}")
        params = params.copy()  # checked again: it may have changed since it was built, and may change later
        if arrival_time is not None and not is_number(arrival_time):
            raise TypeError(f"arrival_time must be a finite number of seconds on time.perf_counter()'s clock, or "
                            f"None for now; got {type(arrival_time).__name__} {arrival_time!r}")
        now = time.perf_counter() if arrival_time is None else float(arrival_time)
        token_ids, error = self._encode(prompt)
        if error is None:
            error = self._check_length(token_ids, params)
        seq = Sequence(request_id, token_ids, params, self.config.block_size, now, self._seed(params))
        with self._aborts_deferred(self._ready):  # the scheduler's pieces may abort, this request too, once in
            if error is None:
                error = self.scheduler.why_never(seq)
            if error is not None:
                self._reject(request_id, token_ids, params, error)
            else:
                self.scheduler.add(seq)  # first: should it raise, nothing of the request is left behind
                self._requests[request_id] = [seq]  # with n > 1, the other samples fork from it after its prefill
                self.metrics.num_prompt_tokens += len(token_ids)
            self._num_requests += 1

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` names a live request, a rejection not yet handed out, or a retained record."""
        return request_id in self._requests or request_id in self.metrics.requests or request_id in self._ready

    def _seed(self, params: SamplingParams) -> int:
        """A request's seed: its own, or one derived from the engine's seed and the number the request will have."""
        return params.seed if params.seed is not None else sample_stream_seed(self.config.seed, self._num_requests + 1)

    def _encode(self, prompt) -> tuple[list[int], Optional[str]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return [], "this model folder has no tokenizer.json: pass the prompt as a list of token ids"
            problem = unicode_problem(prompt, "the prompt")
            if problem:
                return [], problem
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
        else:
            return [], (f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}; "
                        f"for a numpy array or tensor pass .tolist()")
        if not token_ids:
            return [], "the prompt is empty: give at least one token"
        not_integers = [t for t in token_ids if not is_integer(t)]
        if not_integers:
            bad = not_integers[0]
            return [], (f"token ids must be integers, got {type(bad).__name__} {bad!r}; "
                        f"encode text with this model's tokenizer (or pass the prompt as a string)")
        token_ids = [operator.index(t) for t in token_ids]
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
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

    def _reject(self, request_id, token_ids, params, error) -> None:
        logger.warning("request %s rejected: %s", request_id, error)
        self.metrics.num_rejected += 1
        samples = [SampleOutput([], "" if self.tokenizer else None, "rejected") for _ in range(params.n)]
        self._ready[request_id] = RequestOutput(request_id, token_ids, samples, finished=True, error=error)

    def abort_request(self, request_id: str) -> None:
        """Stop a request in any state (waiting, mid-prefill, running, swapped, forked): every block it
        holds, on the device and the host, goes back. Its owner asked, so no step returns anything more
        for it.

        Asked by a plugged-in piece during a step (an abort, an add), it is done when that ends, so no plan
        names a sequence that has gone; the owner did not ask, so the request's last output comes back
        (from that step, or the next), finished, its samples ``"aborted"``. A request the step finished
        keeps its own ending: the abort came too late."""
        if self._deferred_aborts is not None:
            self._deferred_aborts.append(request_id)
            return
        self._ready.pop(request_id, None)
        self._deferred_aborts = [request_id]  # the first of the aborts done now; pieces may ask for more
        self._do_deferred_aborts(self._ready, owner_asked=request_id)

    def _abort(self, request_id: str) -> Optional[RequestOutput]:
        """Finish a live request's sequences as aborted; its last output, or None if it was not live."""
        seqs = self._requests.pop(request_id, None)  # first: aborted again while this runs, it is not live
        if seqs is None:
            return None
        for seq in seqs:
            self._or_stop("letting go of its blocks (some of its samples may have, others not)",
                          self.scheduler.finish, seq, who=f"aborting request {request_id!r}")
            seq.finish_reason = seq.finish_reason or "aborted"  # a sample that had ended keeps its reason
        self.metrics.num_aborted += 1
        decode = self.tokenizer.decode if self.tokenizer else (lambda token_ids: None)
        samples = [SampleOutput(list(s.output_token_ids), decode(s.output_token_ids), s.finish_reason) for s in seqs]
        unforked = seqs[0].params.n - len(seqs)  # aborted before its prompt was computed: n - 1 never forked
        samples += [SampleOutput([], decode([]), "aborted") for _ in range(unforked)]
        return RequestOutput(request_id, list(seqs[0].prompt_token_ids), samples, finished=True)

    def hand_back(self, outputs: list[RequestOutput]) -> None:
        """Outputs a caller stepped past but does not own (``LLM.generate``): the next ``step()`` returns them
        first; where one waiting there is of the same request, that newer one is kept."""
        ready = {out.request_id: out for out in outputs}
        ready.update(self._ready)
        self._ready = ready

    def has_unfinished_requests(self) -> bool:
        return bool(self._ready) or self.scheduler.has_unfinished()

    # ---- one step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan, move blocks, run the model, record; return the requests that progressed (and rejections).

        Should it raise, the outputs it held (rejections, outputs handed back, those of requests it
        had already recorded) come back from the next step."""
        self._require_running()
        outputs, self._ready = self._ready, {}
        try:
            with self._aborts_deferred(outputs):
                self._run_step(outputs)
        except BaseException:
            self.hand_back(list(outputs.values()))
            raise
        return list(outputs.values())

    @contextmanager
    def _aborts_deferred(self, outputs: dict[str, RequestOutput]):
        """Aborts the plugged-in pieces ask for within are done as it ends (or by the step or abort that already
        defers them), so no plan names a sequence that has gone; each one's last output joins ``outputs``."""
        if self._deferred_aborts is not None:
            yield
            return
        self._deferred_aborts = []
        try:
            yield
        finally:
            self._do_deferred_aborts(outputs)

    def _do_deferred_aborts(self, outputs: dict[str, RequestOutput], owner_asked: Optional[str] = None) -> None:
        """The aborts asked for, and those asked while these are done: each one's last output joins ``outputs``,
        but the request's whose owner asked (nothing more comes back for it)."""
        asked = self._deferred_aborts
        try:
            while asked:
                last = self._abort(asked.pop(0))
                if last is not None and last.request_id != owner_asked:
                    outputs[last.request_id] = last
        finally:
            self._deferred_aborts = None

    def _run_step(self, outputs: dict[str, RequestOutput]) -> None:
        if not self.scheduler.has_unfinished():
            return
        start, plan = time.perf_counter(), SchedulerOutput()
        try:
            self.scheduler.schedule(plan)
        finally:  # what was planned is carried out and counted, even when a plugged-in piece raised midway
            self._carry_out_moves(plan)
        if not plan.scheduled:
            raise RuntimeError(self._stall_message())
        forward_start = time.perf_counter()
        logits = self.runner.forward(plan)
        forward_seconds = time.perf_counter() - forward_start
        tokens = self.runner.sample(logits, plan)
        result = self._or_stop("recording the tokens it sampled (some may be recorded, others not)",
                               self.scheduler.postprocess, plan, tokens, time.perf_counter())
        for child in result.forked:  # the request's own at once: interrupted from here on, it still has all n
            self._requests[child.request_id].append(child)
        self.metrics.record_result(plan, result, forward_seconds)
        outputs.update((out.request_id, out) for out in self._request_outputs(result))
        self._record_step(plan, start)
        warning = self.oversubscription.observe(self.metrics)
        if warning:
            logger.warning(warning)

    def _carry_out_moves(self, plan: SchedulerOutput) -> None:
        """The plan's block moves, which the block manager has already booked, and their count in the metrics."""
        seconds = 0.0
        try:
            seconds = self._or_stop("copying the KV blocks its plan moved (the block manager had booked the moves)",
                                    self.runner.execute_moves, plan.moves)
        finally:
            self.metrics.record_plan(plan, self.runner.spec.block_bytes, seconds)

    def _or_stop(self, doing: str, call, *args, who: Optional[str] = None):
        """``call(*args)``, bookkeeping that cannot be undone once begun: should it raise, the engine stops."""
        try:
            return call(*args)
        except BaseException as err:
            cause = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            who = who or f"step {self._step + 1}"
            self._stopped = self._stopped or (  # the first cause is the one to report
                f"the engine stopped: {who} raised {cause} while {doing}. The engine's KV cache "
                f"and its books no longer agree, and serving on would give wrong tokens: build a new "
                f"LLM (or LLMEngine) to go on; the requests still in this one cannot finish")
            raise

    def _require_running(self) -> None:
        if self._stopped is not None:
            raise EngineStoppedError(self._stopped)

    def _request_outputs(self, result: StepResult) -> list[RequestOutput]:
        progressed = [self._request_output(rid) for rid in dict.fromkeys(s.request_id for s in result.sampled)]
        for out in progressed:
            if out.finished:
                self.metrics.record_finished(out.request_id, self._requests.pop(out.request_id))
        return progressed

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
        s, bm, now = self.scheduler, self.block_manager, time.perf_counter()
        stats = bm.prefix_stats
        self.metrics.prefix_cache_queried_tokens = stats.queried_tokens
        self.metrics.prefix_cache_hit_tokens = stats.hit_tokens
        self.metrics.prefix_cache_host_hit_tokens = stats.host_hit_tokens
        tables = [seq.block_table.blocks for seq in s.waiting + s.running + s.swapped]
        self.metrics.record_step(StepRecord(
            step=self._step, time=now - start, end_time=now,
            gpu_blocks_used=bm.device_pool.num_used, gpu_blocks_total=bm.device_pool.num_blocks,
            cpu_blocks_used=bm.host_pool.num_used, cpu_blocks_total=bm.host_pool.num_blocks,
            num_running=len(s.running), num_waiting=len(s.waiting), num_swapped=len(s.swapped),
            num_batched_tokens=plan.num_batched_tokens, num_preemptions=plan.num_preemptions,
            blocks_saved_by_sharing=sum(map(len, tables)) - len({b for t in tables for b in t})))

    def _stall_message(self) -> str:
        s, bm = self.scheduler, self.block_manager
        return (f"the scheduler found nothing to run: {len(s.waiting)} waiting, {len(s.running)} running, "
                f"{len(s.swapped)} swapped, {bm.num_free_blocks}/{bm.device_pool.num_blocks} device blocks free or "
                f"cached for no one; this is a bug in the scheduler or in a plugged-in allocator or policy")
