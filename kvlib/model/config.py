"""The architecture facts kvlib needs, read from a Hugging Face ``config.json`` (and the end-of-sequence
ids of ``generation_config.json``, where the folder has one).

Every key that changes the model's math is either implemented or refused here by name: a
feature silently ignored would serve wrong tokens without a word.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from kvlib.model.errors import CheckpointError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
ROPE_KEYS_NEEDED = {"linear": ("factor",),
                    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
OPTIONAL_SIZE_KEYS = ("num_key_value_heads", "head_dim", "max_position_embeddings")


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
    o_proj_bias: bool = False
    mlp_bias: bool = False
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
        _require_sizes(raw, source)
        _refuse_unimplemented(raw, source)
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        eos = _eos_token_ids(raw.get("eos_token_id"), source)
        heads = raw["num_attention_heads"]
        llama_bias = model_type == "llama" and bool(raw.get("attention_bias", False))  # q, k, v and o, as transformers
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
            qkv_bias=model_type == "qwen2" or llama_bias,
            o_proj_bias=llama_bias,
            mlp_bias=model_type == "llama" and bool(raw.get("mlp_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos,
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
        config = cls.from_dict(read_json_object(path), source=str(path))
        generation = Path(folder) / "generation_config.json"
        if generation.is_file():  # as transformers: its end ids, where it names them, replace config.json's
            raw = read_json_object(generation)
            if raw.get("eos_token_id") is not None:
                config.eos_token_ids = _eos_token_ids(raw["eos_token_id"], str(generation))
        return config


def _eos_token_ids(value, source: str) -> list[int]:
    """``eos_token_id`` as a list: absent, one id, or a list of them (instruct models list their end of turn)."""
    ids = [] if value is None else [value] if not isinstance(value, list) else value
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{source}: eos_token_id must be a token id or a list of them, got {value!r}")
    return list(ids)


def read_json_object(path: Path) -> dict:
    """The JSON object in ``path``, or an error naming the file and the line that is wrong."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{path} is not UTF-8 text ({err}); replace it with the model's own file") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); "
                              f"replace it with the model's own file") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object, it holds a {type(raw).__name__}")
    return raw


def _head_dim(raw: dict) -> int:
    return raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]


def _require_sizes(raw: dict, source: str) -> None:
    for key in REQUIRED_KEYS:
        if key not in raw:
            raise CheckpointError(f"{source} has no {key!r}; a Llama-family config.json names "
                                  f"{', '.join(REQUIRED_KEYS)}: is this the model's own config.json?")
    for key in REQUIRED_KEYS + OPTIONAL_SIZE_KEYS:
        value = raw.get(key, 1) if key in OPTIONAL_SIZE_KEYS else raw[key]
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise CheckpointError(f"{source}: {key} must be a positive integer, got {value!r}")


def _refuse_unimplemented(raw: dict, source: str) -> None:
    """Raise naming the first key whose value asks for math kvlib does not implement."""
    def refuse(what: str, fix: str):
        raise UnsupportedModelError(f"{source}: {what} is not supported; {fix}")

    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        refuse(f"hidden_act {raw['hidden_act']!r}", "kvlib's MLP is SwiGLU (silu)")
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        refuse(f"quantization_config (quant_method {method!r})",
               "kvlib loads unquantized floating-point weights: use the unquantized checkpoint")
    if raw.get("use_sliding_window"):
        refuse(f"use_sliding_window {raw['use_sliding_window']!r}", "kvlib attends to the whole context")
    windowed = sorted(set(raw.get("layer_types") or ()) - {"full_attention"})
    if windowed:
        refuse(f"layer_types with {', '.join(map(repr, windowed))}", "kvlib gives every layer full attention")
    heads, kv_heads = raw["num_attention_heads"], raw.get("num_key_value_heads") or raw["num_attention_heads"]
    if heads % kv_heads:
        refuse(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}",
               "grouped-query attention shares each KV head among a whole number of query heads")
    if _head_dim(raw) % 2:
        refuse(f"head_dim {_head_dim(raw)} is odd", "rotary embeddings rotate pairs of dimensions")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        refuse(f"rope type {rope_type!r}", f"kvlib implements {', '.join(SUPPORTED_ROPE_TYPES)}")
    for key in ROPE_KEYS_NEEDED.get(rope_type, ()):
        if key not in rope:
            raise CheckpointError(f"{source}: rope type {rope_type!r} needs {key!r} in rope_parameters")
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        refuse(f"partial_rotary_factor {partial}", "kvlib rotates the whole head")
