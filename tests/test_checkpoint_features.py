"""A checkpoint feature kvlib does not implement is refused by name, never silently ignored.

The features it does implement are served token for token like transformers in
``test_matches_transformers.py`` (``llama-bias`` covers ``attention_bias`` and ``mlp_bias``).
"""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvlib import LLM
from kvlib.model.config import ModelConfig, UnsupportedModelError
from kvlib.model.errors import CheckpointError


def config_of(checkpoint, arch: str) -> dict:
    return json.loads((checkpoint(arch) / "config.json").read_text())


@pytest.mark.parametrize("arch, change, refused", [
    ("llama-gqa", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope type 'yarn'"),
    ("llama-gqa", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     "rope type 'dynamic'"),
    ("llama-gqa", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor 0.5"),
    ("llama-gqa", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("llama-gqa", {"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
    ("llama-gqa", {"head_dim": 15}, "head_dim 15 is odd"),
    ("llama-gqa", {"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ("qwen2-bias-tied", {"use_sliding_window": True}, "use_sliding_window True"),
    ("qwen2-bias-tied", {"layer_types": ["full_attention", "sliding_attention"]},
     "layer_types .*'sliding_attention'"),
])
def test_unimplemented_feature_is_refused_by_name(arch, change, refused, checkpoint, tmp_path):
    raw = {**config_of(checkpoint, arch), **change}
    with pytest.raises(UnsupportedModelError, match=refused) as err:
        ModelConfig.from_dict(raw, source="config.json")
    assert str(err.value).startswith("config.json: ")
    shutil.copytree(checkpoint(arch), tmp_path / arch)
    (tmp_path / arch / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match=refused):
        LLM(tmp_path / arch, verbose=False)


@pytest.mark.parametrize("rope, missing", [
    ({"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}, "rope type 'llama3' needs 'low_freq_factor'"),
    ({"rope_type": "linear", "rope_theta": 1e4}, "rope type 'linear' needs 'factor'"),
])
def test_rope_parameters_missing_a_key(rope, missing, checkpoint):
    with pytest.raises(CheckpointError, match=missing):
        ModelConfig.from_dict({**config_of(checkpoint, "llama-gqa"), "rope_parameters": rope})


@pytest.mark.parametrize("arch, feature", [("llama-bias", "o_proj_bias"), ("llama-bias", "mlp_bias"),
                                           ("qwen2-bias-tied", "qkv_bias")])
def test_bias_features_are_read(arch, feature, checkpoint):
    assert getattr(ModelConfig.from_dict(config_of(checkpoint, arch)), feature)


def test_unexpected_tensors_are_named(checkpoint, tmp_path):
    folder = tmp_path / "extra"
    shutil.copytree(checkpoint("llama-gqa"), folder)
    weights = load_file(folder / "model.safetensors")
    extras = {f"model.layers.{i}.self_attn.o_proj.bias": torch.zeros(64) for i in range(2)}
    extras.update({f"model.layers.{i}.mlp.gate_proj.bias": torch.zeros(128) for i in range(2)})
    save_file({**weights, **extras}, folder / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match="tensors kvlib does not use") as err:
        LLM(folder, verbose=False)
    message = str(err.value)
    assert str(folder / "model.safetensors") in message
    assert "model.layers.0.mlp.gate_proj.bias" in message and "..." in message  # three named, then ...
    assert sum(name in message for name in extras) == 3


def test_rotary_buffers_of_older_checkpoints_are_not_weights(checkpoint, tmp_path):
    """Older Llama checkpoints saved ``rotary_emb.inv_freq``; transformers skips it and so does kvlib."""
    folder = tmp_path / "old"
    shutil.copytree(checkpoint("llama-gqa"), folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(weights, folder / "model.safetensors")
    reference = LLM(checkpoint("llama-gqa"), verbose=False).generate([[1, 2, 3]])[0].token_ids
    assert LLM(folder, verbose=False).generate([[1, 2, 3]])[0].token_ids == reference


def test_shape_that_disagrees_with_config(checkpoint, tmp_path):
    folder = tmp_path / "wide"
    shutil.copytree(checkpoint("llama-gqa"), folder)
    raw = config_of(checkpoint, "llama-gqa")
    (folder / "config.json").write_text(json.dumps({**raw, "intermediate_size": 96}))
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.down_proj.weight has shape \[64, 128\] "
                                              r"but config.json implies \[64, 96\]") as err:
        LLM(folder, verbose=False)
    assert str(folder / "model.safetensors") in str(err.value)
