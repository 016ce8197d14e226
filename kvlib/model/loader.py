"""Load a Hugging Face model folder (config.json, safetensors, optional tokenizer.json).

Only safetensors are read: a pickle checkpoint can run arbitrary code when loaded.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from kvlib.model.config import ModelConfig, UnsupportedModelError
from kvlib.model.llama import LlamaForCausalLM, rope_inverse_frequencies


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = (f" It has {', '.join(pickles)}: convert them to safetensors (pickle files are not loaded)."
                if pickles else "")
        raise FileNotFoundError(f"{folder} has no *.safetensors weights.{hint}")
    return files


def load_model(folder: str | Path, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist; pass a Hugging Face model folder or \"default\"")
    config = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = {}
    for path in _safetensors_files(folder):
        state.update(load_file(str(path)))
    expected = set(model.state_dict().keys())
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing = sorted(expected - state.keys())
    if missing:
        raise UnsupportedModelError(f"{folder}: weights missing from the safetensors files: {missing[:5]}"
                                    f"{' ...' if len(missing) > 5 else ''}; is this a Llama-family checkpoint?")
    # One tensor at a time onto the device in the engine's dtype: peak memory stays near one model.
    weights = {k: v.to(device=device, dtype=dtype, copy=True) for k, v in state.items() if k in expected}
    model.load_state_dict(weights, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    model.inv_freq = rope_inverse_frequencies(config).to(device)  # built on meta above
    return model
