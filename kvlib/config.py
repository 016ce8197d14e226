"""User-facing configuration: how the engine is sized and how each request samples.

Both are validated when they are built, so a bad value fails at once with a message that
names the field, the value and what to use instead, rather than deep inside a step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

PREEMPTION_MODES = ("recompute", "swap", "auto")
DEVICES = ("auto", "cuda", "cpu")
ATTENTION_BACKENDS = ("auto", "triton", "torch")
DTYPES = ("auto", "float32", "float16", "bfloat16")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


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
    dtype: str = "auto"  # auto: float16 on a GPU, float32 on a CPU
    attention_backend: str = "auto"
    gpu_memory_utilization: float = 0.9  # share of free device memory used when num_gpu_blocks is None
    max_model_len: Optional[int] = None  # None: the model's max_position_embeddings
    seed: int = 0

    def __post_init__(self) -> None:
        _require(isinstance(self.block_size, int) and self.block_size >= 1,
                 f"block_size must be a positive integer, got {self.block_size!r}; 16 is a good default")
        _require(self.num_gpu_blocks is None or (isinstance(self.num_gpu_blocks, int) and self.num_gpu_blocks >= 1),
                 f"num_gpu_blocks must be a positive integer or None (size from free memory), got {self.num_gpu_blocks!r}")
        _require(isinstance(self.num_cpu_blocks, int) and self.num_cpu_blocks >= 0,
                 f"num_cpu_blocks must be an integer >= 0, got {self.num_cpu_blocks!r}")
        _require(self.preemption_mode in PREEMPTION_MODES,
                 f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        _require(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1,
                 f"max_num_seqs must be a positive integer, got {self.max_num_seqs!r}")
        _require(isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens must be a positive integer, got {self.max_num_batched_tokens!r}")
        _require(isinstance(self.watermark, (int, float)) and 0.0 <= self.watermark < 1.0,
                 f"watermark is a fraction of the device pool in [0, 1), got {self.watermark!r}; try 0.01")
        _require(not self.host_prefix_cache or (self.enable_prefix_caching and self.num_cpu_blocks > 0),
                 "host_prefix_cache keeps evicted prefix blocks in the host pool: it needs enable_prefix_caching=True "
                 "and num_cpu_blocks > 0")
        _require(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.attention_backend in ATTENTION_BACKENDS,
                 f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        _require(0.0 < self.gpu_memory_utilization <= 1.0,
                 f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        _require(self.max_model_len is None or (isinstance(self.max_model_len, int) and self.max_model_len >= 1),
                 f"max_model_len must be a positive integer or None, got {self.max_model_len!r}")


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
        _require(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                 f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        _require(isinstance(self.temperature, (int, float)) and self.temperature >= 0.0,
                 f"temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
        _require(isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0,
                 f"top_p must be in (0, 1], got {self.top_p!r}")
        _require(isinstance(self.n, int) and self.n >= 1, f"n must be a positive integer, got {self.n!r}")
        _require(self.seed is None or isinstance(self.seed, int), f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
