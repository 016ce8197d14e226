"""The built-in default model: a small Llama that needs no download.

It is written once into ``$KVLIB_HOME/default-model`` (``~/.cache/kvlib`` by default) as an
ordinary Hugging Face folder, so it goes through exactly the loader a real checkpoint does.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvlib.model.config import ModelConfig
from kvlib.model.llama import LlamaForCausalLM

DEFAULT_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 259,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>"]
WEIGHT_STD = 0.1  # wide enough that greedy decoding does not collapse onto one token


def kvlib_home() -> Path:
    return Path(os.environ.get("KVLIB_HOME", Path.home() / ".cache" / "kvlib"))


def default_model_path() -> Path:
    folder = kvlib_home() / "default-model"
    if not (folder / "model.safetensors").is_file():
        write_default_model(folder)
    return folder


def write_byte_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer: every UTF-8 byte is a token, so any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({char: len(SPECIAL_TOKENS) + i for i, char in enumerate(alphabet)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.save(str(folder / "tokenizer.json"))


def write_default_model(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_dict(DEFAULT_CONFIG))
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to the embedding
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            state[name] = torch.ones_like(tensor)
        else:
            state[name] = torch.randn(tensor.shape, generator=generator) * WEIGHT_STD
    tmp = folder / "model.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
    (folder / "config.json").write_text(json.dumps(DEFAULT_CONFIG, indent=2))
    write_byte_tokenizer(folder)
    tmp.rename(folder / "model.safetensors")
