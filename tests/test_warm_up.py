"""After the warm-up, serving launches no kernel variant Triton would have to compile mid-step.

On a GPU, Triton compiles a kernel for each new set of compile-time values: constexprs, which
integer arguments equal 1 or are multiples of 16 (unless the kernel declares them
``do_not_specialize``), which tensors start on a 16-byte boundary, and launch options. Here the
kernels run under the interpreter, which compiles nothing, so each launch's variant is worked out
by those same rules. The split rule is given a small GPU's multiprocessor count and shorter
splits, so that the tiny model's contexts split as long ones would on a GPU.
"""
import contextlib
import importlib
import inspect

import pytest
import torch

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.kernels import triton_available
from kvlib.runner.decode_graphs import EagerCapture
from kvlib.runner.warm_up import warm_up

pytestmark = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")

KERNELS = [("paged_decode", "_paged_decode_kernel"), ("paged_decode", "_merge_splits_kernel"),
           ("paged_prefill", "_paged_prefill_kernel"), ("cache_ops", "_store_kv_kernel"),
           ("cache_ops", "_copy_blocks_kernel")]
FAKE_SMS = 16


def variant(kernel, args: tuple, kwargs: dict) -> tuple:
    """What a compiled launch with these arguments is specialized on."""
    names = kernel.arg_names
    constexprs = {name for name, kind in inspect.get_annotations(kernel.fn).items()
                  if getattr(kind, "__name__", str(kind)).endswith("constexpr")}  # "tl.constexpr" as a string too
    unspecialized = set(kernel.kwargs.get("do_not_specialize") or ())
    bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    key = []
    for name in names:
        value = bound[name]
        if name in constexprs:
            key.append((name, value))
        elif isinstance(value, torch.Tensor):
            key.append((name, str(value.dtype), value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and not isinstance(value, bool):
            key.append((name, None if name in unspecialized else (value == 1, value % 16 == 0)))
        else:
            key.append((name, type(value).__name__))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in names))
    return kernel.fn.__name__, tuple(key), options


class Recording:
    def __init__(self, kernel, seen: set):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.add(variant(self.kernel, args, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.fixture
def gpu_like_splits(monkeypatch):
    """Splits as on a 16-multiprocessor GPU, and 16-token splits, so short contexts split."""
    from kvlib.kernels import paged_decode
    monkeypatch.setattr(paged_decode, "MIN_SPLIT_TOKENS", 16)
    monkeypatch.setattr(paged_decode, "MAX_SPLITS", 8)

    def choose(num_seqs, num_kv_heads, max_context_len, device, per_sm=None):
        wanted = paged_decode.DEFAULT_PROGRAMS_PER_SM * FAKE_SMS // (num_seqs * num_kv_heads)
        return max(1, min(wanted, max_context_len // 16, 8))
    monkeypatch.setattr(paged_decode, "choose_num_splits", choose)


@contextlib.contextmanager
def recording(seen: set):
    """Within it, every kernel launch is noted in ``seen`` (and still runs)."""
    with pytest.MonkeyPatch.context() as patch:
        for module, name in KERNELS:
            module = importlib.import_module(f"kvlib.kernels.{module}")
            patch.setattr(module, name, Recording(getattr(module, name), seen))
        yield


def test_serving_compiles_nothing_the_warm_up_did_not(checkpoint, gpu_like_splits):
    config = EngineConfig(block_size=8, num_gpu_blocks=30, num_cpu_blocks=64, preemption_mode="swap", watermark=0.0,
                          max_num_seqs=6, enable_prefix_caching=True, attention_backend="triton")
    llm = LLM(checkpoint("llama-gqa"), config, verbose=False)
    warmed, served = set(), set()
    with recording(warmed):
        warm_up(llm.engine.runner)
        llm.engine.runner.set_decode_graphs(EagerCapture())  # recording the graphs launches each bucket once
    torch.manual_seed(0)
    prompts = [torch.randint(0, 96, (n,)).tolist() for n in (150, 3, 70, 1, 33, 120, 9)]
    # short answers in a tight pool (it preempts, as 36 blocks and answers up to 50 tokens did, at a third of the
    # interpreter's time); the last one decodes alone through contexts that split in two
    params = [SamplingParams(max_tokens=m, n=n, temperature=1.0 if n > 1 else 0.0, seed=1)
              for m, n in ((6, 1), (10, 2), (6, 1), (8, 1), (4, 3), (8, 1), (30, 1))]
    with recording(served):
        llm.generate(prompts[0], params[0])
        llm.generate(prompts[0][:100] + [5], params[0])  # a prefix hit
        llm.generate(prompts, params)
    assert llm.metrics.num_preemptions > 0 and llm.metrics.num_cow_copies > 0
    assert llm.metrics.prefix_cache_hit_tokens > 0
    assert {name for name, _, _ in served} == {name for _, name in KERNELS}  # every kernel ran while serving
    split = {entry[1] for name, key, _ in served if name == "_paged_decode_kernel" for entry in key
             if entry[0] == "SPLIT"}
    assert True in split  # decode split its contexts, as on a GPU
    merged = {entry[1] for name, key, _ in served if name == "_merge_splits_kernel" for entry in key
              if entry[0] == "NUM_SPLITS_PAD"}
    assert 2 in merged and len(merged) > 1  # into two splits and into more
    missed = served - warmed
    assert not missed, "\n".join(map(str, missed))
