"""Tiny random Hugging Face checkpoints, written by transformers itself, for tests to serve."""
from __future__ import annotations

from pathlib import Path

import torch

ARCHITECTURES = {
    # Llama with grouped-query attention (4 query heads share 2 KV heads), untied embeddings
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                                          tie_word_embeddings=False, rope_theta=5000.0)),
    # Qwen2: q/k/v projections carry a bias, embeddings tied
    "qwen2-bias-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=1,
                                                               tie_word_embeddings=True)),
    # Llama with attention_bias (q/k/v and o_proj) and mlp_bias (gate/up/down)
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                                           attention_bias=True, mlp_bias=True,
                                                           tie_word_embeddings=False)),
    # Mistral: GQA, no sliding window within these lengths
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                                            sliding_window=None, tie_word_embeddings=False)),
    # Mistral with a sliding window far shorter than the prompts: each query sees its last 8 positions
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                                                   sliding_window=8, tie_word_embeddings=False)),
}


def write_checkpoint(folder: Path, arch: str, seed: int = 0, vocab_size: int = 96, max_positions: int = 1024) -> Path:
    """Save a random checkpoint; weights are widened so greedy decoding does not repeat one token.

    Biases are drawn too: transformers initializes them to zero, which would hide a dropped bias.
    """
    import transformers
    config_cls, model_cls, extra = ARCHITECTURES[arch]
    config = getattr(transformers, config_cls)(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        max_position_embeddings=max_positions, initializer_range=0.25, bos_token_id=None,
        eos_token_id=None, pad_token_id=None, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0.0, 0.25)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def hf_greedy(folder: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """What transformers' own ``generate`` produces, greedily, for one prompt."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()
