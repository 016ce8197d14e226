"""Convert a llama-architecture GGUF file into a Hugging Face folder that kvlib and transformers load.

GGUF is llama.cpp's single-file format: quantized tensors under llama.cpp's names, with the
config and the tokenizer as metadata. Dequantizing once to float32 safetensors under Hugging
Face names lets the ordinary loader serve the model, and lets transformers check it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from kvlib.model.errors import UnsupportedModelError
from kvlib.model.gguf_file import metadata, read_gguf
from kvlib.model.gguf_tokenizer import write_tokenizer

GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}
LAYER_TENSORS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                 "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj",
                 "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _shortest(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def hf_config(reader, source: Path) -> dict:
    """The ``config.json`` transformers' ``LlamaConfig`` reads, from llama.cpp's metadata keys."""
    arch = metadata(reader, "general.architecture", source)
    if arch != "llama":
        raise UnsupportedModelError(
            f"{source}: GGUF architecture {arch!r} is not supported; kvlib converts llama-architecture GGUF "
            f"files (such as SmolLM2's): for other models use their Hugging Face folder")
    names = {t.name for t in reader.tensors}

    def get(key, *default):
        return metadata(reader, f"llama.{key}", source, *default)

    if get("expert_count", 0):
        raise UnsupportedModelError(f"{source}: llama.expert_count {get('expert_count')} (mixture of experts) "
                                    f"is not supported; kvlib serves dense models")
    if "rope_freqs.weight" in names:
        raise UnsupportedModelError(f"{source}: a rope_freqs.weight tensor (Llama 3.1 frequency scaling) is not "
                                    f"converted; use the model's Hugging Face folder, whose rope_scaling kvlib reads")
    heads = get("attention.head_count")
    head_dim = get("attention.key_length", get("embedding_length") // heads)
    for key in ("rope.dimension_count", "attention.value_length"):
        if get(key, head_dim) != head_dim:
            raise UnsupportedModelError(f"{source}: llama.{key} {get(key)} differs from the head size {head_dim} "
                                        f"and is not supported; kvlib rotates and stores whole heads")
    scaling = get("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise UnsupportedModelError(f"{source}: llama.rope.scaling.type {scaling!r} is not supported (none, linear)")
    tokens = metadata(reader, "tokenizer.ggml.tokens", source)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": get("vocab_size", len(tokens)),
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": _shortest(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _shortest(get("rope.freq_base", 10000.0)),
        "rope_scaling": {"rope_type": "linear", "factor": get("rope.scaling.factor")} if scaling == "linear" else None,
        "attention_bias": "blk.0.attn_output.bias" in names,
        "mlp_bias": "blk.0.ffn_down.bias" in names,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": metadata(reader, "tokenizer.ggml.bos_token_id", source, None),
        "eos_token_id": metadata(reader, "tokenizer.ggml.eos_token_id", source, None),
        "torch_dtype": "float32",
    }


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name, or None for one kvlib does not know."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{parts[3]}"
    return None


def undo_rotary_permutation(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's two rotary halves (rows 0, d/2, 1, d/2+1 ...)
    for its rotary layout; Hugging Face keeps the halves apart, and so does kvlib's ``apply_rope``."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def float32_bytes(reader) -> int:
    """What the dequantized tensors take: what the progress bar counts towards."""
    return sum(4 * int(np.prod(t.shape)) for t in reader.tensors)


def hf_weights(reader, config: dict, source: Path) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32, renamed, q/k rows back in Hugging Face order.

    A bar on stderr counts the float32 bytes made so far: converting SmolLM2 makes 540 MB, the
    longest wait of a learner's first hour.
    """
    from gguf.quants import dequantize
    from tqdm.auto import tqdm

    unknown = sorted(t.name for t in reader.tensors if hf_name(t.name) is None)
    if unknown:
        raise UnsupportedModelError(f"{source} holds tensors kvlib does not convert: {', '.join(unknown[:3])}"
                                    f"{', ...' if len(unknown) > 3 else ''}; use the model's Hugging Face folder")
    heads = {".attn_q.": config["num_attention_heads"], ".attn_k.": config["num_key_value_heads"]}
    weights = {}
    with tqdm(total=float32_bytes(reader), unit="B", unit_scale=True, desc=f"dequantizing {source.name}") as bar:
        for tensor in reader.tensors:
            array = dequantize(tensor.data, tensor.tensor_type)
            for marker, count in heads.items():
                if marker in tensor.name:
                    array = undo_rotary_permutation(array, count)
            weights[hf_name(tensor.name)] = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))
            bar.update(weights[hf_name(tensor.name)].nbytes)
    return weights


def convert_gguf(source: Path, folder: Path) -> None:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json into ``folder``."""
    from safetensors.torch import save_file

    reader = read_gguf(source)
    config = hf_config(reader, source)
    write_tokenizer(reader, source, folder, config["max_position_embeddings"])
    weights = hf_weights(reader, config, source)
    print(f"kvlib: writing model.safetensors ({sum(w.nbytes for w in weights.values()) / 1e6:.0f} MB)", file=sys.stderr)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
