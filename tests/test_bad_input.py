"""Bad input gets a clear error that says what is wrong and what to change; the rest still finish."""
import json

import pytest

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.model.config import UnsupportedModelError


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("llama-gqa"), EngineConfig(block_size=4, num_gpu_blocks=32), verbose=False)


def test_bad_requests_are_rejected_and_others_finish(llm):
    good = [3, 4, 5]
    prompts = [good, [1] * 200, [], [5, 96, 7], good]
    params = [SamplingParams(max_tokens=4)] * 4 + [SamplingParams(max_tokens=1100)]
    outs = llm.generate(prompts, params)
    assert [o.finish_reason for o in outs] == ["length", "rejected", "rejected", "rejected", "rejected"]
    assert len(outs[0].token_ids) == 4 and outs[0].error is None
    assert "needs 50 KV blocks" in outs[1].error and "raise num_gpu_blocks" in outs[1].error
    assert "empty" in outs[2].error
    assert "token id 96 is outside the model's vocabulary" in outs[3].error and "0 to 95" in outs[3].error
    assert "beyond the model's context of 1024" in outs[4].error and "lower max_tokens" in outs[4].error
    assert llm.metrics.num_rejected == 4


def test_prompt_that_fits_but_cannot_finish_is_rejected(llm):
    out = llm.generate([[1] * 100], SamplingParams(max_tokens=40))[0]
    assert out.rejected and "lower max_tokens" in out.error


def test_string_prompt_without_tokenizer(llm):
    assert "no tokenizer.json" in llm.generate(["hello"])[0].error


def test_duplicate_request_id_raises(llm):
    llm.engine.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        llm.engine.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


@pytest.mark.parametrize("field, value, message", [
    ("block_size", 0, "block_size must be a positive integer"),
    ("num_gpu_blocks", -3, "num_gpu_blocks must be a positive integer or None"),
    ("preemption_mode", "fast", "preemption_mode must be one of"),
    ("watermark", 1.5, "watermark is a fraction"),
    ("device", "tpu", "device must be one of"),
    ("attention_backend", "cuda", "attention_backend must be one of"),
    ("max_num_seqs", 0, "max_num_seqs must be a positive integer"),
])
def test_invalid_config_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be a positive integer"),
    (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(n=0), "n must be a positive integer"),
])
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(tmp_path, verbose=False)


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(tmp_path / "nope", verbose=False)


def test_pickle_only_checkpoint_is_refused(tmp_path, checkpoint):
    (tmp_path / "config.json").write_text((checkpoint("llama-gqa") / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="pickle files are not loaded"):
        LLM(tmp_path, verbose=False)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2' is not supported"):
        LLM(tmp_path, verbose=False)
