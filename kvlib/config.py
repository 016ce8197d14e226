"""User-facing configuration: how the engine is sized and how each request samples.

Both are validated when they are built, so a bad value fails at once with a message that
names the field, the value and what to use instead, rather than deep inside a step. The engine
keeps a checked ``copy()`` of each (the config when it is built, a request's parameters when the
request is added): a value changed on the caller's object afterwards is checked again the next
time that object is given, and never reaches what the engine already holds.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import Optional

PREEMPTION_MECHANISMS = ("recompute", "swap")  # what a preemption does
PREEMPTION_MODES = (*PREEMPTION_MECHANISMS, "auto")  # auto: the policy chooses one, victim by victim
DEVICES = ("auto", "cuda", "cpu")
ATTENTION_BACKENDS = ("auto", "triton", "torch")
DTYPES = ("auto", "float32", "float16", "bfloat16")
WEIGHT_FORMATS = ("float32", "bfloat16", "q4_1")  # a CPU decode's projections: kvlib.model.weight_formats
MAX_SEED = 2**64  # torch generators take 64-bit seeds
MIN_TEMPERATURE = 2.0**-126  # the smallest normal float32 (about 1.2e-38): the sampler divides in float32


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def is_integer(value) -> bool:
    """An integer of any kind (Python, numpy, a one-element torch tensor) but not a bool, which Python counts as one."""
    if type(value).__name__ in ("bool", "bool_"):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def is_number(value) -> bool:
    """A finite real number (not a bool)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _flag(name: str, value) -> None:
    _require(isinstance(value, bool), f"{name} must be True or False, got {value!r}")


@dataclass
class EngineConfig:
    """How much KV memory the engine has and how the scheduler may use it."""

    block_size: int = 16
    num_gpu_blocks: Optional[int] = None  # None: sized from free device memory
    num_cpu_blocks: int = 0  # host swap pool; 0 means swap always falls back to recompute
    preemption_mode: str = "recompute"
    partial_preemption: bool = False
    enable_prefix_caching: bool = False
    host_prefix_cache: bool = False  # tiered caching: prefix blocks evicted from the device wait in the host pool
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    watermark: float = 0.01  # fraction of the device pool kept free when admitting new requests
    device: str = "auto"
    dtype: str = "auto"  # auto: bfloat16 on a GPU of compute capability 8.0 or newer, float16 below, float32 on a CPU
    attention_backend: str = "auto"
    gpu_memory_utilization: float = 0.9  # share of free device memory used when num_gpu_blocks is None
    max_model_len: Optional[int] = None  # None: the model's max_position_embeddings
    seed: int = 0  # seeds the samples of requests that give no seed of their own
    metrics_history: Optional[int] = 10_000  # finished requests and steps the metrics keep; None: all
    weight_format: str = "float32"  # on a CPU: "bfloat16" or "q4_1" (a GGUF model's own 4-bit weights) projections

    def __post_init__(self) -> None:
        _require(is_integer(self.block_size) and self.block_size >= 1,
                 f"block_size must be a positive integer, got {self.block_size!r}; 16 is a good default")
        _require(self.num_gpu_blocks is None or (is_integer(self.num_gpu_blocks) and self.num_gpu_blocks >= 1),
                 f"num_gpu_blocks must be a positive integer or None (size from free memory), got {self.num_gpu_blocks!r}")
        _require(is_integer(self.num_cpu_blocks) and self.num_cpu_blocks >= 0,
                 f"num_cpu_blocks must be an integer >= 0, got {self.num_cpu_blocks!r}")
        _require(self.preemption_mode in PREEMPTION_MODES,
                 f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        for name in ("partial_preemption", "enable_prefix_caching", "host_prefix_cache"):
            _flag(name, getattr(self, name))
        _require(is_integer(self.max_num_seqs) and self.max_num_seqs >= 1,
                 f"max_num_seqs must be a positive integer, got {self.max_num_seqs!r}")
        _require(is_integer(self.max_num_batched_tokens) and self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens must be a positive integer, got {self.max_num_batched_tokens!r}")
        _require(is_number(self.watermark) and 0.0 <= self.watermark < 1.0,
                 f"watermark is a fraction of the device pool in [0, 1), got {self.watermark!r}; try 0.01")
        _require(not self.host_prefix_cache or (self.enable_prefix_caching and self.num_cpu_blocks > 0),
                 "host_prefix_cache keeps evicted prefix blocks in the host pool: it needs enable_prefix_caching=True "
                 "and num_cpu_blocks > 0")
        _require(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.weight_format in WEIGHT_FORMATS,
                 f"weight_format must be one of {WEIGHT_FORMATS}, got {self.weight_format!r}")
        _require(self.attention_backend in ATTENTION_BACKENDS,
                 f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        _require(is_number(self.gpu_memory_utilization) and 0.0 < self.gpu_memory_utilization <= 1.0,
                 f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        _require(self.max_model_len is None or (is_integer(self.max_model_len) and self.max_model_len >= 1),
                 f"max_model_len must be a positive integer or None, got {self.max_model_len!r}")
        _require(is_integer(self.seed) and 0 <= self.seed < MAX_SEED,
                 f"seed must be an integer from 0 to 2**64 - 1, got {self.seed!r}")
        _require(self.metrics_history is None or (is_integer(self.metrics_history) and self.metrics_history >= 1),
                 f"metrics_history must be a positive integer or None (keep everything), got {self.metrics_history!r}")
        for name in ("block_size", "num_gpu_blocks", "num_cpu_blocks", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len", "seed", "metrics_history"):
            if getattr(self, name) is not None:
                setattr(self, name, int(getattr(self, name)))

    def copy(self) -> "EngineConfig":
        """A copy checked again as if built now: what the engine keeps (``LLM`` and ``LLMEngine`` make one)."""
        return dataclasses.replace(self)


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    n: int = 1
    seed: Optional[int] = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _require(is_integer(self.max_tokens) and self.max_tokens >= 1,
                 f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        _require(is_number(self.temperature) and (self.temperature == 0.0 or self.temperature >= MIN_TEMPERATURE),
                 f"temperature must be a finite number >= 0: 0 (greedy) or at least {MIN_TEMPERATURE:.4g} (the "
                 f"smallest normal float32, in which tokens are drawn), got {self.temperature!r}")
        _require(is_number(self.top_p) and 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}")
        _require(is_integer(self.n) and self.n >= 1, f"n must be a positive integer, got {self.n!r}")
        _require(self.seed is None or (is_integer(self.seed) and 0 <= self.seed < MAX_SEED),
                 f"seed must be None or an integer from 0 to 2**64 - 1, got {self.seed!r}")
        _require(isinstance(self.stop_token_ids, (list, tuple)) and all(is_integer(t) for t in self.stop_token_ids),
                 f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}; "
                 f"for one id write stop_token_ids=[id]")
        _flag("ignore_eos", self.ignore_eos)
        self.max_tokens, self.n = int(self.max_tokens), int(self.n)
        self.seed = None if self.seed is None else int(self.seed)
        self.stop_token_ids = [operator.index(t) for t in self.stop_token_ids]

    def copy(self) -> "SamplingParams":
        """A copy checked again as if built now, with its own stop list: what the engine keeps of a request."""
        return dataclasses.replace(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
