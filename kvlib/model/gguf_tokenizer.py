"""Rebuild ``tokenizer.json`` and ``tokenizer_config.json`` from the tokenizer a GGUF file carries.

A GGUF stores a byte-level BPE tokenizer as metadata: the vocabulary, the merges, a type per
token (normal, control ...), the special token ids, and the name of the pre-tokenizer the merges
were learned with (``tokenizer.ggml.pre``). That name decides how text is cut before merging,
so it is honoured here the way llama.cpp honours it, not guessed.
"""
from __future__ import annotations

import json
from pathlib import Path

from kvlib.model.errors import UnsupportedModelError
from kvlib.model.gguf_file import metadata

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
# llama.cpp's pre-tokenizers by name: the pieces split off before GPT-2's own split.
# SmolLM's vocabulary was learned with every digit on its own, so "2024" is four tokens.
DIGITS_FIRST = {"gpt2": False, "smollm": True}


def build_tokenizer(reader, source: Path):
    """The ``tokenizers.Tokenizer`` the file describes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    def get(key, *default):
        return metadata(reader, f"tokenizer.ggml.{key}", source, *default)

    kind, pre = get("model"), get("pre", "gpt2")
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"{source}: tokenizer.ggml.model {kind!r} is not converted; kvlib rebuilds byte-level BPE "
            f"('gpt2') tokenizers only: use the original Hugging Face folder of this model instead")
    if pre not in DIGITS_FIRST:
        raise UnsupportedModelError(
            f"{source}: tokenizer.ggml.pre {pre!r} is not converted (kvlib knows {', '.join(DIGITS_FIRST)}); "
            f"use the original Hugging Face folder of this model instead")
    tokens = get("tokens")
    merges = [tuple(merge.split(" ", 1)) for merge in get("merges")]
    types = get("token_type", None) or [1] * len(tokens)
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=bool(get("add_space_prefix", False)),
                                          use_regex=True)
    tokenizer.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                               if DIGITS_FIRST[pre] else byte_level)
    tokenizer.decoder = decoders.ByteLevel()
    # Added in id order, so each keeps the id the vocabulary gives it.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    bos = get("bos_token_id", None)
    if get("add_bos_token", False) and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)])
    return tokenizer


def tokenizer_config(reader, source: Path, context_length: int) -> dict:
    """``tokenizer_config.json``: the special tokens by text and the chat template, as transformers reads them."""
    def get(key, *default):
        return metadata(reader, f"tokenizer.{key}", source, *default)

    tokens = get("ggml.tokens")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "model_max_length": context_length,
              "add_bos_token": bool(get("ggml.add_bos_token", False))}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = get(f"ggml.{key}", None)
        if token_id is not None:
            config[name] = tokens[token_id]
    template = get("chat_template", None)
    if template:
        config["chat_template"] = template
    return config


def write_tokenizer(reader, source: Path, folder: Path, context_length: int) -> None:
    build_tokenizer(reader, source).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(reader, source, context_length), indent=2))
