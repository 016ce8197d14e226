"""Load a Hugging Face model folder (config.json, safetensors, optional tokenizer.json).

Only safetensors are read: a pickle checkpoint can run arbitrary code when loaded. Every tensor
is checked against what config.json implies before any is read, so a mismatch is reported by
name, shape and file instead of surfacing later as wrong tokens. Projections that read the same
input (q/k/v, gate/up) are stacked into one matrix as they load (``fused_projections``).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvlib.model.config import ModelConfig, read_json_object
from kvlib.model.errors import CheckpointError, UnsupportedModelError
from kvlib.model.llama import LlamaForCausalLM, fused_projections, rope_inverse_frequencies

SHARD_INDEX = "model.safetensors.index.json"
NAMED_AT_MOST = 3  # tensors listed in an error before "..."
# Buffers some older checkpoints saved; transformers recomputes them and ignores these too.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / SHARD_INDEX
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no \"weight_map\" object naming the shard of each tensor")
        shards = [folder / shard for shard in sorted(set(weight_map.values()))]
        for shard in shards:
            if not shard.is_file():
                raise FileNotFoundError(f"{shard.name}, named by {index}, is not in {folder}; "
                                        f"copy every shard the index lists")
        return shards
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = (f" It has {', '.join(pickles)}: convert them to safetensors (pickle files are not loaded)."
                if pickles else "")
        raise FileNotFoundError(f"{folder} has no *.safetensors weights.{hint}")
    return files


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as err:
        raise CheckpointError(f"{path} is truncated or corrupt ({err}); re-download or re-convert it") from None


def _tensor_shapes(files: list[Path]) -> dict[str, tuple[Path, list[int]]]:
    """Every tensor's file and shape, read from the headers alone."""
    found = {}
    for path in files:
        with _open(path) as f:
            for name in f.keys():
                found[name] = (path, list(f.get_slice(name).get_shape()))
    return found


def _named(names: list[str]) -> str:
    return ", ".join(names[:NAMED_AT_MOST]) + (", ..." if len(names) > NAMED_AT_MOST else "")


def _check_against_config(found: dict, expected: dict[str, list[int]], folder: Path, config_file: Path) -> None:
    unexpected = sorted(n for n in found if n not in expected and not n.endswith(IGNORED_SUFFIXES))
    if unexpected:
        files = sorted({str(found[n][0]) for n in unexpected})
        raise UnsupportedModelError(
            f"{', '.join(files)} holds {len(unexpected)} tensors kvlib does not use: {_named(unexpected)}; "
            f"they belong to a feature {config_file} does not declare or kvlib does not implement, "
            f"and serving without them would give wrong tokens")
    missing = sorted(n for n in expected if n not in found)
    if missing:
        raise UnsupportedModelError(f"{folder}: weights missing from the safetensors files: {_named(missing)}; "
                                    f"is this a Llama-family checkpoint?")
    wrong = sorted(n for n in expected if found[n][1] != expected[n])
    if wrong:
        name = wrong[0]
        path, shape = found[name]
        more = f" (and {len(wrong) - 1} more tensors disagree)" if len(wrong) > 1 else ""
        raise CheckpointError(f"{path}: {name} has shape {shape} but config.json implies {expected[name]}{more}; "
                              f"the weights and {config_file} disagree: use the config.json that came with them")


def _stacked_parts(config: ModelConfig, model_names) -> dict[str, list[tuple[str, int]]]:
    """Each stacked parameter of the model and the checkpoint tensors it is made of, with their rows."""
    parts = {}
    for name in model_names:
        for fused, pieces in fused_projections(config).items():
            if f".{fused}." in name:
                prefix, suffix = name.split(f".{fused}.")
                parts[name] = [(f"{prefix}.{piece}.{suffix}", rows) for piece, rows in pieces]
    return parts


def _expected_shapes(config: ModelConfig) -> dict[str, list[int]]:
    """Every tensor a checkpoint for ``config`` holds, by its Hugging Face name, with its shape."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = {name: list(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")  # the embedding matrix serves both
    for name, pieces in _stacked_parts(config, list(expected)).items():
        shape = expected.pop(name)
        expected.update({piece: [rows, *shape[1:]] for piece, rows in pieces})
    return expected


def check_folder(folder: str | Path) -> tuple[ModelConfig, list[Path]]:
    """config.json and every safetensors header checked against each other, no tensor read yet."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist; pass a Hugging Face model folder or \"default\"")
    config = ModelConfig.from_folder(folder)
    files = _safetensors_files(folder)
    found = _tensor_shapes(files)
    if config.tie_word_embeddings:
        found.pop("lm_head.weight", None)  # some tied checkpoints store the shared matrix twice
    _check_against_config(found, _expected_shapes(config), folder, folder / "config.json")
    return config, files


def load_model(folder: str | Path, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    config, files = check_folder(folder)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    wanted = _expected_shapes(config)
    # One tensor at a time onto the device in the engine's dtype: peak memory stays near one model.
    weights = {}
    for path in files:
        with _open(path) as f:
            for name in f.keys():
                if name in wanted:
                    weights[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    for name, pieces in _stacked_parts(config, model.state_dict()).items():
        weights[name] = torch.cat([weights.pop(piece) for piece, _ in pieces])
    model.load_state_dict(weights, strict=False, assign=True)  # checked above; a tied lm_head is not in it
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    model.inv_freq = rope_inverse_frequencies(config).to(device)  # built on meta above
    return model
