"""Every file kvlib reads gets an error naming the file, what in it is wrong and what to change."""
import json
import shutil

import pytest

from kvlib import LLM
from kvlib.model.errors import CheckpointError


@pytest.fixture
def folder(tmp_path, checkpoint):
    """A private copy of a tiny checkpoint, with a tokenizer, to break one file at a time."""
    copy = tmp_path / "model"
    shutil.copytree(checkpoint("llama-gqa"), copy)
    from tokenizers import Tokenizer, models, pre_tokenizers
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(copy / "tokenizer.json"))
    return copy


def test_intact_copy_loads(folder):
    assert LLM(folder, verbose=False).tokenizer.encode("w3 w5") == [3, 5]


def test_config_that_is_not_json(folder):
    (folder / "config.json").write_text('{"model_type": "llama",\n  "hidden_size": 64,,}')
    with pytest.raises(CheckpointError, match=r"config.json is not valid JSON \(line 2") as err:
        LLM(folder, verbose=False)
    assert str(folder / "config.json") in str(err.value)


def test_config_that_is_not_an_object(folder):
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="config.json must hold a JSON object"):
        LLM(folder, verbose=False)


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "vocab_size"])
def test_config_missing_a_required_key(folder, key):
    raw = json.loads((folder / "config.json").read_text())
    del raw[key]
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=f"config.json has no {key!r}"):
        LLM(folder, verbose=False)


def test_config_value_of_the_wrong_type(folder):
    raw = json.loads((folder / "config.json").read_text())
    raw["num_hidden_layers"] = "2"
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="num_hidden_layers must be a positive integer, got '2'"):
        LLM(folder, verbose=False)


def test_truncated_safetensors(folder):
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="model.safetensors is truncated or corrupt") as err:
        LLM(folder, verbose=False)
    assert "re-download or re-convert" in str(err.value)


def test_safetensors_that_is_not_one(folder):
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors is truncated or corrupt"):
        LLM(folder, verbose=False)


def test_broken_tokenizer_json(folder):
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(CheckpointError, match="tokenizer.json cannot be read by the tokenizers library") as err:
        LLM(folder, verbose=False)
    assert str(folder / "tokenizer.json") in str(err.value)


def test_broken_tokenizer_config(folder):
    (folder / "tokenizer_config.json").write_text("{chat_template: nope}")
    with pytest.raises(CheckpointError, match="tokenizer_config.json is not valid JSON"):
        LLM(folder, verbose=False)


def test_broken_shard_index(folder):
    (folder / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match="model.safetensors.index.json is not valid JSON"):
        LLM(folder, verbose=False)


def test_shard_named_by_the_index_is_missing(folder):
    index = {"weight_map": {"model.embed_tokens.weight": "model.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors.*named by .*index.json"):
        LLM(folder, verbose=False)


def test_missing_folder_names_what_would_work(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist") as err:
        LLM(tmp_path / "nope", verbose=False)
    assert "'default'" in str(err.value) and "'smollm2-135m'" in str(err.value)


def test_hub_name_is_not_downloaded():
    with pytest.raises(FileNotFoundError, match="kvlib does not download"):
        LLM("HuggingFaceTB/SmolLM2-135M-Instruct", verbose=False)


def test_weights_file_instead_of_its_folder(folder):
    with pytest.raises(NotADirectoryError, match="is a file: pass the model folder that holds it"):
        LLM(folder / "model.safetensors", verbose=False)
