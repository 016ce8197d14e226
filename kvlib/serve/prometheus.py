"""``/metrics``: the engine's state and the server's latencies in Prometheus' text format, named as vLLM names them.

Gauges and counters are read from the engine on its own thread, after each step and each abort,
into a snapshot that a scrape reads (a scrape never touches the engine). Latencies are the server's
view, from the moment a request reached the engine loop: ``vllm:time_to_first_token_seconds``,
``vllm:time_per_output_token_seconds`` (every gap between two steps that gave a request tokens, so
a preemption's stutter shows in its upper buckets) and ``vllm:e2e_request_latency_seconds``. Names
vLLM has no counterpart for start with ``kvlib:``. Every metric carries a ``model_name`` label, as
vLLM's do. Each server has a registry of its own, so two servers in one process do not mix.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvlib.llm import LLM
from kvlib.serve.engine_loop import LoopObserver

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)  # vLLM's
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
GAUGES = {  # name: (help, snapshot key)
    "vllm:num_requests_running": ("Requests in the running batch", "running"),
    "vllm:num_requests_waiting": ("Requests waiting to be scheduled", "waiting"),
    "vllm:num_requests_swapped": ("Requests whose KV blocks wait in the host pool", "swapped"),
    "vllm:gpu_cache_usage_perc": ("Device KV-cache usage: a fraction from 0 to 1", "gpu_usage"),
    "vllm:cpu_cache_usage_perc": ("Host (swap) KV-cache usage: a fraction from 0 to 1", "cpu_usage"),
}
COUNTERS = {  # name without _total: (help, llm.metrics field)
    "vllm:num_preemptions": ("Preemptions: a sequence gave up its device blocks", "num_preemptions"),
    "vllm:prompt_tokens": ("Prompt tokens of accepted requests", "num_prompt_tokens"),
    "vllm:generation_tokens": ("Tokens generated", "num_generated_tokens"),
    "kvlib:num_preemptions_swap": ("Preemptions that swapped blocks to the host pool", "num_preemptions_swap"),
    "kvlib:num_preemptions_recompute": ("Preemptions that dropped blocks to recompute them", "num_preemptions_recompute"),
    "kvlib:num_swap_fallbacks": ("Swaps that recomputed instead: the host pool was full", "num_swap_fallbacks"),
    "kvlib:num_swapped_out_blocks": ("Blocks copied to the host pool by preemptions", "num_swapped_out_blocks"),
    "kvlib:num_swapped_in_blocks": ("Blocks copied back to the device on resuming", "num_swapped_in_blocks"),
    "kvlib:num_recomputed_tokens": ("Computed tokens recompute preemptions let go, prefilled again unless the prefix "
                                  "cache still holds them", "num_recomputed_tokens"),
    "kvlib:num_requests_rejected": ("Requests the engine refused (they could never run)", "num_rejected"),
    "kvlib:num_requests_aborted": ("Requests ended early: the client left, a step failed, or a plugged-in piece "
                                   "aborted them", "num_aborted"),
}


def engine_snapshot(llm: LLM) -> dict:
    """The numbers a scrape reports, read on the engine thread: queue lengths, pool usage, the metrics' counters.

    Usage counts a cached block nobody uses as free, as vLLM's does: it is handed out when needed. So does the
    host pool's: a block of the host prefix tier is given up whenever a swap needs the room.
    """
    engine = llm.engine
    scheduler, blocks = engine.scheduler, engine.block_manager
    host_blocks = engine.config.num_cpu_blocks
    host_cached = blocks.host_tier.num_cached if blocks.host_tier is not None else 0
    snapshot = {field: getattr(llm.metrics, field) for _, field in COUNTERS.values()}
    snapshot.update(running=_requests(scheduler.running), waiting=_requests(scheduler.waiting),
                    swapped=_requests(scheduler.swapped),
                    gpu_usage=1.0 - blocks.num_free_blocks / blocks.num_device_blocks,
                    cpu_usage=1.0 - (blocks.num_free_host_blocks + host_cached) / host_blocks if host_blocks else 0.0)
    return snapshot


def _requests(sequences) -> int:
    """Requests, not sequences: the samples of one request (n > 1) count once, as in vLLM."""
    return len({seq.request_id for seq in sequences})


class ServerMetrics(LoopObserver):
    """The engine loop's observer, and the collector ``/metrics`` reads."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._snapshot: dict = {}
        self._uncounted: dict[str, float] = {}  # what the engine counted for health probes, by metrics field
        labels = ["model_name"]
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Seconds from a request's arrival to its first "
                               "token", labels, registry=self.registry, buckets=TTFT_BUCKETS).labels(model_name)
        self._gap = Histogram("vllm:time_per_output_token_seconds", "Seconds between two steps that gave a request "
                              "tokens", labels, registry=self.registry, buckets=TPOT_BUCKETS).labels(model_name)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds", "Seconds from a request's arrival to its end",
                              labels, registry=self.registry, buckets=E2E_BUCKETS).labels(model_name)
        self._success = Counter("vllm:request_success", "Requests finished, by finish reason",
                                labels + ["finished_reason"], registry=self.registry)
        self.registry.register(self)

    # ---- LoopObserver, on the engine thread ----------------------------------------------------------
    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def token_gap(self, seconds: float) -> None:
        self._gap.observe(seconds)

    def finished(self, seconds: float, finished_reason: str) -> None:
        self._e2e.observe(seconds)
        self._success.labels(self.model_name, finished_reason).inc()  # once per request, whatever n

    def engine_changed(self, llm: LLM) -> None:
        snapshot = engine_snapshot(llm)
        self._snapshot = {key: value - self._uncounted.get(key, 0) for key, value in snapshot.items()}

    def uncounted(self, counts: dict[str, float]) -> None:
        for key, value in counts.items():
            self._uncounted[key] = self._uncounted.get(key, 0) + value

    # ---- the collector, on a scrape -----------------------------------------------------------------
    def collect(self):
        snapshot = self._snapshot
        for name, (help_text, key) in GAUGES.items():
            family = GaugeMetricFamily(name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], snapshot.get(key, 0))
            yield family
        for name, (help_text, key) in COUNTERS.items():
            family = CounterMetricFamily(name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], snapshot.get(key, 0))
            yield family

    def describe(self):
        return []  # unchecked collector: its families are created at each scrape

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
