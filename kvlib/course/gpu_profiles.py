"""The cost model a GPU's published figures imply for a given model, for machines a lesson cannot time.

The figures and their sources are in ``kvlib/course/data/gpu_profiles.json``; so are the shares of
each peak an engine is assumed to reach, with why. A profile prices a model from its shape alone:
a pass reads every weight once at the memory bandwidth (the floor) and multiplies 2 FLOPs per
weight per token, plus attention's 4 FLOPs per head dimension per (query, key) pair, at the
assumed share of the tensor peak.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvlib.core.cost_model import PreemptionCostModel
from kvlib.model.config import ModelConfig

PROFILES_PATH = Path(__file__).resolve().parent / "data" / "gpu_profiles.json"


@dataclass(frozen=True)
class ModelShape:
    """The sizes that price a forward pass and a KV block."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: ModelConfig) -> "ModelShape":
        return cls(config.num_layers, config.hidden_size, config.intermediate_size, config.num_heads,
                   config.num_kv_heads, config.head_dim, config.vocab_size)

    @property
    def matmul_weights(self) -> int:
        """Weights every token multiplies: the layers' projections (the output head runs on sampled rows only)."""
        attention = 2 * self.hidden_size * self.num_heads * self.head_dim
        attention += 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        return self.num_layers * (attention + 3 * self.hidden_size * self.intermediate_size)

    @property
    def weights_read_per_pass(self) -> int:
        """The layers' weights and the whole output head; the input embedding is only looked up."""
        return self.matmul_weights + self.vocab_size * self.hidden_size

    @property
    def attention_flops_per_pair(self) -> int:
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element_bytes


@dataclass(frozen=True)
class Assumptions:
    """Shares of the published peaks an engine reaches, and fixed costs; ``why`` says why each."""

    mfu: float
    memory_share: float
    link_share: float
    copy_call_seconds: float
    attention_call_seconds: float
    overlap: float
    why: dict


@dataclass(frozen=True)
class GPUProfile:
    """A GPU's published peaks and its host link, with the documents they come from."""

    name: str
    fp16_dense_tflops: float
    memory_gb_per_s: float
    host_link: str
    host_link_gb_per_s: float  # per direction
    sources: tuple[str, ...]

    def cost_model(self, shape: ModelShape, assumptions: Assumptions, element_bytes: int = 2) -> PreemptionCostModel:
        """The cost model of serving a model of ``shape`` in ``element_bytes``-wide weights on this GPU."""
        flops = self.fp16_dense_tflops * 1e12 * assumptions.mfu
        memory = self.memory_gb_per_s * 1e9 * assumptions.memory_share
        return PreemptionCostModel(
            host_link_bytes_per_s=self.host_link_gb_per_s * 1e9 * assumptions.link_share,
            prefill_tokens_per_s=flops / (2 * shape.matmul_weights),
            floor_seconds=shape.weights_read_per_pass * element_bytes / memory,
            overlap=assumptions.overlap,
            attention_seconds_per_pair=shape.attention_flops_per_pair / flops,
            attention_call_seconds=assumptions.attention_call_seconds,
            copy_call_seconds=assumptions.copy_call_seconds)


def load_profiles(path: Path = PROFILES_PATH) -> tuple[list[GPUProfile], Assumptions]:
    raw = json.loads(Path(path).read_text())
    assumed = raw["assumptions"]
    assumptions = Assumptions(**{key: item["value"] for key, item in assumed.items()},
                              why={key: item["why"] for key, item in assumed.items()})
    profiles = [GPUProfile(**{**p, "sources": tuple(p["sources"])}) for p in raw["profiles"]]
    return profiles, assumptions
