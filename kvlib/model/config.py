"""The architecture facts kvlib needs, read from a Hugging Face ``config.json``."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint is readable but its architecture is not one kvlib implements."""


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: Optional[int] = None
    model_type: str = "llama"
    sliding_window: Optional[int] = None  # Mistral: each query sees only the last this-many positions

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        model_type = raw.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"{source}: model_type {model_type!r} is not supported; kvlib serves Llama-family "
                f"checkpoints ({', '.join(SUPPORTED_MODEL_TYPES)}), e.g. SmolLM2, TinyLlama, Qwen2.5")
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        if raw.get("use_sliding_window"):
            raise UnsupportedModelError(f"{source}: sliding-window attention is not supported; set use_sliding_window false")
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(f"{source}: rope type {rope_type!r} is not supported ({SUPPORTED_ROPE_TYPES})")
        rope["rope_type"] = rope_type
        eos = raw.get("eos_token_id")
        heads = raw["num_attention_heads"]
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            rope_scaling=rope,
            qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            bos_token_id=raw.get("bos_token_id"),
            model_type=model_type,
            sliding_window=raw.get("sliding_window") if model_type == "mistral" else None,
        )

    @classmethod
    def from_folder(cls, folder: Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{folder} has no config.json: pass a Hugging Face model folder (config.json, *.safetensors, "
                f"optionally tokenizer.json) or \"default\" for the built-in model")
        return cls.from_dict(json.loads(path.read_text()), source=str(path))
