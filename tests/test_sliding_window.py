"""Sliding-window attention (Mistral) end to end: parsed from config.json, served token for token as transformers.

The checkpoint's window is 8 positions and the prompts run to 40 tokens plus 16 generated, so
almost every query sees only part of its context; transformers' query at position ``p`` sees
``p - 7 .. p``, and so must kvlib's, in prefill, decode, chunks and cached prefixes alike.
"""
import random

import pytest

from checkpoints import hf_greedy
from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.kernels import triton_available
from kvlib.model.config import ModelConfig, UnsupportedModelError

ARCH = "mistral-window"
PROMPT_LENGTHS = (3, 9, 23, 40)
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def window_case(checkpoint):
    rng = random.Random(ARCH)
    prompts = [[rng.randrange(96) for _ in range(n)] for n in PROMPT_LENGTHS]
    folder = checkpoint(ARCH)
    return folder, prompts, [hf_greedy(folder, p, MAX_TOKENS) for p in prompts]


def generate(folder, prompts, **config):
    llm = LLM(folder, EngineConfig(num_gpu_blocks=256, **config), verbose=False)
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))]


@pytest.mark.parametrize("config", [
    pytest.param(dict(block_size=16), id="window-inside-one-block"),
    pytest.param(dict(block_size=4), id="window-over-blocks"),
    pytest.param(dict(block_size=3), id="window-not-a-multiple-of-the-block"),
    pytest.param(dict(block_size=4, max_num_batched_tokens=7), id="chunked-prefill-beside-decodes"),
])
def test_window_matches_transformers(window_case, config):
    folder, prompts, expected = window_case
    assert generate(folder, prompts, **config) == expected


def test_window_behind_a_cached_prefix(window_case):
    """A prompt that extends an earlier one starts from its cached blocks; the window reaches into them."""
    folder, prompts, expected = window_case
    longer = prompts[3] + [5, 6, 7, 8, 9]
    llm = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=256, enable_prefix_caching=True, max_num_seqs=1),
              verbose=False)
    outs = llm.generate([prompts[3], longer], SamplingParams(max_tokens=MAX_TOKENS))
    assert llm.metrics.prefix_cache_hit_tokens > 0
    assert [o.token_ids for o in outs] == [expected[3], hf_greedy(folder, longer, MAX_TOKENS)]


def test_window_changes_the_tokens(window_case, checkpoint):
    """The case has teeth: the same weights with full attention generate something else."""
    folder, prompts, expected = window_case
    assert hf_greedy(checkpoint("mistral"), prompts[3], MAX_TOKENS) != expected[3]


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
def test_window_on_the_triton_backend(window_case):
    """The Triton kernels' window (under the interpreter on a CPU): one long prompt, decode and prefill."""
    folder, prompts, expected = window_case
    assert generate(folder, prompts[2:], block_size=4, attention_backend="triton") == expected[2:]


def test_config_reads_mistral_window():
    raw = dict(model_type="mistral", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)
    assert ModelConfig.from_dict({**raw, "sliding_window": 4096}).sliding_window == 4096
    assert ModelConfig.from_dict({**raw, "sliding_window": None}).sliding_window is None
    qwen2 = {**raw, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}
    assert ModelConfig.from_dict(qwen2).sliding_window is None
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        ModelConfig.from_dict({**qwen2, "use_sliding_window": True})
