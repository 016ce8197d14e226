"""Greedy generation must be token-for-token what transformers' own ``generate`` produces."""
import random

import pytest
import torch
from checkpoints import ARCHITECTURES, hf_greedy

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.core.invariants import check_invariants
from kvlib.model import packed_linear, weight_formats

PROMPT_LENGTHS = (1, 5, 17, 40)
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def references(checkpoint):
    cache = {}

    def get(arch):
        if arch not in cache:
            rng = random.Random(arch)
            prompts = [[rng.randrange(96) for _ in range(n)] for n in PROMPT_LENGTHS]
            folder = checkpoint(arch)
            cache[arch] = prompts, [hf_greedy(folder, p, MAX_TOKENS) for p in prompts]
        return cache[arch]
    return get


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("block_size", [1, 16, 7])  # 7 divides none of the prompt lengths
def test_batch_matches_transformers(arch, block_size, checkpoint, references):
    prompts, expected = references(arch)
    llm = LLM(checkpoint(arch), EngineConfig(block_size=block_size, num_gpu_blocks=512), verbose=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outs] == expected


@pytest.mark.skipif(not packed_linear.packing_available(torch.device("cpu"), torch.float32),
                    reason="this torch has no oneDNN: nothing is packed")
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_batch_matches_transformers_with_every_matrix_packed(arch, checkpoint, references, monkeypatch):
    """These checkpoints' matrices are all under ``PACK_MIN_BYTES``, so the tests above run them in nn.Linear."""
    monkeypatch.setattr(packed_linear, "PACK_MIN_BYTES", 0)
    prompts, expected = references(arch)
    llm = LLM(checkpoint(arch), EngineConfig(block_size=16, num_gpu_blocks=512), verbose=False)
    layer = llm.engine.runner.model.model.layers[0]
    assert all(isinstance(layer.get_submodule(path), packed_linear.PackedLinear)
               for path in weight_formats.LAYER_PROJECTIONS)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outs] == expected


def test_requests_joining_mid_decode_match(checkpoint, references):
    """Continuous batching: a request added while others decode still gets exactly its tokens."""
    prompts, expected = references("llama-gqa")
    llm = LLM(checkpoint("llama-gqa"), EngineConfig(block_size=4, num_gpu_blocks=512), verbose=False)
    engine, results = llm.engine, {}
    engine.add_request("first", prompts[3], SamplingParams(max_tokens=MAX_TOKENS))
    pending = [(f"p{i}", p) for i, p in enumerate(prompts[:3])]
    steps = 0
    while engine.has_unfinished_requests():
        if pending and steps % 3 == 2:
            engine.add_request(*pending.pop(0), SamplingParams(max_tokens=MAX_TOKENS))
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.token_ids
        check_invariants(engine)
        steps += 1
    assert results == {"first": expected[3], "p0": expected[0], "p1": expected[1], "p2": expected[2]}
    assert max(r.num_running for r in llm.metrics.timeline) >= 2


def test_chunked_prefill_matches(checkpoint, references):
    """A token budget smaller than a prompt splits its prefill into chunks without changing tokens."""
    prompts, expected = references("qwen2-bias-tied")
    llm = LLM(checkpoint("qwen2-bias-tied"),
              EngineConfig(block_size=4, num_gpu_blocks=512, max_num_batched_tokens=8), verbose=False)
    assert [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))] == expected


def test_default_model_matches_transformers():
    """The shipped default model is a real checkpoint: transformers reads it and agrees token for token."""
    from kvlib.model.default import default_model_path
    llm = LLM("default", EngineConfig(block_size=16, num_gpu_blocks=64), verbose=False)
    prompts = ["The with statement", "A dictionary is a mapping"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(default_model_path(), llm.tokenizer.encode(prompt), 24)
        assert out.text == llm.tokenizer.decode(out.token_ids) and out.text.strip()
