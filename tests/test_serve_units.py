"""The server's pieces on their own: incremental text and stop strings, the command's flags, the layering."""
from __future__ import annotations

import ast
import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

import kvlib
from kvlib import EngineConfig, SamplingParams
from kvlib.cli.commands import build_parser
from kvlib.serve.command import engine_config
from kvlib.outputs import RequestOutput, SampleOutput
from kvlib.serve.generation import ChoiceText, Generation
from kvlib.serve.requests import EngineWork
from kvlib.tokenizer import Tokenizer
from kvlib.model.default import default_model_path

PACKAGE = Path(kvlib.__file__).parent


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_folder(default_model_path())


def streamed(choice: ChoiceText, token_ids: list[int], final_text=None, reason="length") -> str:
    """Feed one token at a time, as steps do, and join what ``take()`` hands out."""
    out = []
    for token in token_ids:
        choice.add([token])
        out.append(choice.take()[0])
    choice.finish(final_text, reason)
    out.append(choice.take()[0])
    return "".join(out)


def test_characters_split_over_byte_tokens_are_handed_out_whole(tokenizer):
    text = "naïve café, 東京 and ünïcode"
    ids = tokenizer.encode(text)
    choice = ChoiceText(tokenizer, ())
    pieces = []
    for token in ids:
        choice.add([token])
        pieces.append(choice.take()[0])
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert len(ids) > len([p for p in pieces if p])  # some tokens were held back until their character was whole


def test_a_stop_string_split_over_tokens_cuts_the_text_before_it_and_nothing_after_is_sent(tokenizer):
    ids = tokenizer.encode("one two STOP three four")
    choice = ChoiceText(tokenizer, ("STOP",))
    assert streamed(choice, ids) == "one two "
    assert choice.finish_reason == "stop" and choice.text == "one two "


def test_text_that_only_begins_a_stop_string_is_sent_at_the_end(tokenizer):
    ids = tokenizer.encode("one two ST")
    choice = ChoiceText(tokenizer, ("STOP",))
    assert streamed(choice, ids, tokenizer.decode(ids), "length") == "one two ST"
    assert choice.finish_reason == "length"


def test_the_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta")
    choice = ChoiceText(tokenizer, ("delta", "beta"))
    assert streamed(choice, ids) == "alpha "


class RecordingLoop:
    """The engine loop's side of a ``Generation``: what it was asked to submit and to end."""

    def __init__(self):
        self.submitted, self.ended = [], []

    def submit(self, request_id, prompt, params, sink):
        self.submitted.append(request_id)

    def end_stopped(self, request_id):
        self.ended.append(request_id)


def test_a_sample_that_ends_on_eos_while_the_others_meet_stop_strings_ends_the_request(tokenizer):
    """n = 2: one sample ends in the engine (EOS), the other meets a stop string: every choice is done, so the
    request ends now; before, the EOS choice waited for the request, and the engine ran the other to max_tokens."""
    eos_ids, stop_ids = tokenizer.encode("short answer"), tokenizer.encode("one two STOP three")
    work = EngineWork([[5, 6]], SamplingParams(max_tokens=500, n=2), ("STOP",))

    async def step_once():
        loop = RecordingLoop()
        gen = Generation(loop, work, tokenizer, "cmpl")
        out = RequestOutput(loop.submitted[0], [5, 6], [SampleOutput(eos_ids, None, "stop"),
                                                         SampleOutput(stop_ids, None, None)], finished=False)
        return gen, loop, gen._apply(0, out)

    gen, loop, changed = asyncio.run(step_once())
    assert changed == [0, 1] and loop.ended == loop.submitted  # ended as a stop, freeing its blocks now
    assert [(c.text, c.finish_reason) for c in gen.choices] == [("short answer", "stop"), ("one two ", "stop")]


def test_every_engine_knob_is_a_serve_flag_and_reaches_the_config():
    args = build_parser().parse_args(["serve", "some/folder", "--host", "0.0.0.0", "--port", "9000",
                                      "--num-gpu-blocks", "32", "--preemption-mode", "swap", "--num-cpu-blocks", "64",
                                      "--enable-prefix-caching", "--max-model-len", "512", "--watermark", "0.05"])
    assert (args.model, args.host, args.port) == ("some/folder", "0.0.0.0", 9000)
    assert engine_config(args) == EngineConfig(num_gpu_blocks=32, preemption_mode="swap", num_cpu_blocks=64,
                                               enable_prefix_caching=True, max_model_len=512, watermark=0.05)
    assert engine_config(build_parser().parse_args(["serve"])) == EngineConfig()


def test_nothing_of_the_engine_imports_the_server():
    """The server sits beside the engine: kvlib's other modules never import it, so the engine needs none of its packages."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] in ("serve", "cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(PACKAGE)}: {n}" for n in names if n.startswith("kvlib.serve")]
    assert offenders == []
    loaded = subprocess.run([sys.executable, "-c", "import sys, kvlib, kvlib.cli.commands; "
                             "kvlib.cli.commands.build_parser(); print(sorted(m for m in ('fastapi', 'uvicorn', "
                             "'prometheus_client', 'kvlib.serve.app') if m in sys.modules))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"
