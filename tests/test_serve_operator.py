"""``kvlib serve`` as an operator runs it: no request holds the others up, the event loop never waits on a
tokenizer, the default context fits the pool, ``/health`` means what a readiness probe needs, and a
shutdown ends every open stream with an event. Nothing here judges a timing: where the order of two
things is the point, the test records the order.
"""
from __future__ import annotations

import gc
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.serve.limits import RequestLimits
from kvlib.serve.requests import ServedModel
from kvlib.serve.server import BackgroundServer
from serve_helpers import FailingStep, chat_model_folder, scrape, settled_pools

SMALL = RequestLimits(max_prompts=4, max_prompt_tokens=64, max_body_bytes=4096)


@pytest.fixture(scope="module")
def llm():
    return LLM("default", EngineConfig(num_gpu_blocks=64, max_num_seqs=8), verbose=False)


@pytest.fixture(scope="module")
def small(llm):
    """A server with small request limits, so that each one is easy to reach."""
    with BackgroundServer(llm, "default", limits=SMALL) as server:
        yield server


def completion(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"model": "default", "max_tokens": 2, **body}, timeout=60)


def test_too_many_prompts_in_one_request_get_a_400_naming_the_limit_and_its_flag(small):
    reply = completion(small, prompt=[[5, 6]] * 5)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "prompt" and error["code"] == "too_many_prompts"
    assert "5 prompts" in error["message"] and "at most 4" in error["message"]
    assert "--max-prompts-per-request" in error["message"]
    assert completion(small, prompt=[[5, 6]] * 4).status_code == 200  # the limit itself is allowed


def test_too_many_prompt_tokens_in_one_request_get_a_400_naming_the_limit_and_its_flag(small):
    reply = completion(small, prompt=[[5] * 20] * 4)  # 80 tokens, each prompt well within the context
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "prompt" and error["code"] == "too_many_prompt_tokens"
    assert "80" in error["message"] and "at most 64" in error["message"]
    assert "--max-prompt-tokens-per-request" in error["message"]
    text = completion(small, prompt="x" * 70)  # text counts as its tokens (one per byte in the built-in model)
    assert text.status_code == 400 and text.json()["error"]["code"] == "too_many_prompt_tokens"
    assert completion(small, prompt=[[5] * 16] * 4).status_code == 200


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_gets_a_413_naming_the_limit_and_its_flag(small, declared):
    body = b'{"model": "default", "prompt": "' + b"x" * 5000 + b'"}'
    content = body if declared else iter([body[:2000], body[2000:]])  # an iterator is sent chunked, unannounced
    reply = httpx.post(f"{small.url}/v1/completions", content=content, headers={"content-type": "application/json"})
    assert reply.status_code == 413
    error = reply.json()["error"]
    assert error["code"] == "request_too_large" and "at most 4096 bytes" in error["message"]
    assert "--max-body-bytes" in error["message"]
    assert httpx.get(f"{small.url}/health").status_code == 200


def test_by_default_ten_thousand_prompts_are_refused_before_any_reaches_the_engine(llm):
    with BackgroundServer(llm, "default") as server:
        counted = server.engine_loop.call(lambda llm: llm.metrics.num_prompt_tokens).result(30)
        reply = completion(server, prompt=[[5, 6, 7]] * 10_000)
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "too_many_prompts"
        assert server.engine_loop.call(lambda llm: llm.metrics.num_prompt_tokens).result(30) == counted


@pytest.mark.parametrize("field, value", [("max_prompts", 0), ("max_prompt_tokens", -1), ("max_body_bytes", 1.5)])
def test_a_limit_that_is_not_a_positive_integer_is_refused_by_its_flag(field, value):
    flag = {"max_prompts": "--max-prompts-per-request", "max_prompt_tokens": "--max-prompt-tokens-per-request",
            "max_body_bytes": "--max-body-bytes"}[field]
    with pytest.raises(ValueError, match=flag):
        RequestLimits(**{field: value})


def test_the_limits_are_flags_of_kvlib_serve_with_the_same_defaults():
    from kvlib.cli.commands import build_parser
    from kvlib.serve.command import request_limits
    args = build_parser().parse_args(["serve", "--max-prompts-per-request", "8", "--max-prompt-tokens-per-request",
                                      "1000", "--max-body-bytes", "65536"])
    assert request_limits(args) == RequestLimits(max_prompts=8, max_prompt_tokens=1000, max_body_bytes=65536)
    assert request_limits(build_parser().parse_args(["serve"])) == RequestLimits()


@pytest.fixture(scope="module")
def chat_llm(tmp_path_factory):
    return LLM(chat_model_folder(tmp_path_factory.mktemp("chat-model")), EngineConfig(num_gpu_blocks=64),
               verbose=False)


def read_stream(reply) -> list[dict]:
    """The events of a server-sent stream up to its ``[DONE]`` (``None`` stands for it)."""
    events = []
    for line in reply.iter_lines():
        if line.startswith("data: "):
            events.append(None if line == "data: [DONE]" else json.loads(line[len("data: "):]))
    return events


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_health_and_open_streams_are_served_while_a_prompt_is_tokenized(chat_llm, monkeypatch, route):
    """The tokenizer here waits until the test lets it go: an open stream must end and /health must answer
    meanwhile, so the test sees them before the tokenizer's return (on the event loop, it would see them after)."""
    started, released, order = threading.Event(), threading.Event(), []

    def slowly(real):
        def encode(self, text):
            started.set()
            released.wait(20)  # only a guard against a hang: the order below is what the test judges
            order.append("tokenized")
            return real(self, text)
        return encode

    monkeypatch.setattr(ServedModel, "encode", slowly(ServedModel.encode))
    monkeypatch.setattr(ServedModel, "encode_chat", slowly(ServedModel.encode_chat))
    body = {"prompt": "Tell me"} if route == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    with BackgroundServer(chat_llm, "tiny-chat") as server, httpx.Client(base_url=server.url, timeout=120) as client:
        replies = {}
        with client.stream("POST", "/v1/completions", json={"model": "tiny-chat", "prompt": [5, 6, 7], "stream": True,
                                                            "max_tokens": 8, "ignore_eos": True}) as stream:
            sender = threading.Thread(target=lambda: replies.update(slow=client.post(
                f"/v1/{route}", json={"model": "tiny-chat", "max_tokens": 2, **body})))
            sender.start()
            assert started.wait(60)
            events = read_stream(stream)
            order.append("stream ended")
        health = client.get("/health")
        order.append("health answered")
        released.set()
        sender.join()
    assert order == ["stream ended", "health answered", "tokenized"]
    assert events[-1] is None and events[-2]["choices"][0]["finish_reason"] == "length"
    assert health.status_code == 200 and replies["slow"].status_code == 200


def test_health_answers_while_a_prompt_of_megabytes_is_tokenized(llm, monkeypatch):
    """The real tokenizer this time: the tokenizers library must let the GIL go while it works, or the event
    loop stops with it. /health is asked once tokenizing has begun; its answer must come while it still runs."""
    tokenizing, tokenized = threading.Event(), threading.Event()
    real = ServedModel.encode

    def observed(self, text):
        tokenizing.set()
        try:
            return real(self, text)
        finally:
            tokenized.set()

    monkeypatch.setattr(ServedModel, "encode", observed)
    with BackgroundServer(llm, "default", limits=RequestLimits(max_body_bytes=16 * 1024 * 1024)) as server:
        replies = {}
        sender = threading.Thread(target=lambda: replies.update(big=completion(server, prompt="a few words " * 500_000)))
        sender.start()
        assert tokenizing.wait(60)
        health = httpx.get(f"{server.url}/health", timeout=120)
        answered_first = not tokenized.is_set()
        sender.join()
    assert health.status_code == 200 and answered_first
    assert replies["big"].status_code == 400 and replies["big"].json()["error"]["code"] == "too_many_prompt_tokens"


def test_the_servers_encoding_is_the_tokenizers_own(chat_llm):
    model = ServedModel.of(chat_llm, "tiny-chat")
    for text in ("The KV cache is", "naïve café, 東京", " leading and trailing ", "<s> not special"):
        assert model.encode(text) == chat_llm.tokenizer.encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is paging?"}]
    assert model.encode_chat(messages) == chat_llm.tokenizer.encode_chat(messages)
    with pytest.raises(ValueError, match="lone surrogate"):
        model.encode("bad \ud800 text")


def test_with_no_max_model_len_set_the_server_serves_the_context_its_pool_holds(chat_llm, caplog):
    """48 blocks of 16 tokens hold 768 tokens of a 2,048-token context: chat without max_tokens is served."""
    llm = LLM(chat_llm.engine.tokenizer.path.parent, EngineConfig(num_gpu_blocks=48), verbose=False)
    with caplog.at_level(logging.WARNING, logger="kvlib.serve"):
        server = BackgroundServer(llm, "tiny-chat")
    assert "768 tokens" in caplog.text and "2048" in caplog.text and "num_gpu_blocks" in caplog.text
    with server:
        models = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert models[0]["max_model_len"] == 768
        reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
            "model": "tiny-chat", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0})
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        assert reply.json()["choices"][0]["finish_reason"] in ("stop", "length") and usage["total_tokens"] <= 768
        too_long = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny-chat", "prompt": [5] * 700,
                                                                   "max_tokens": 100})
        assert too_long.status_code == 400 and "context is 768 tokens" in too_long.json()["error"]["message"]


def test_a_max_model_len_set_beyond_the_pool_is_refused_at_start_up(chat_llm):
    llm = LLM(chat_llm.engine.tokenizer.path.parent, EngineConfig(num_gpu_blocks=48, max_model_len=1024),
              verbose=False)
    with pytest.raises(ValueError, match=r"max_model_len=1024 .* 768 tokens.*num_gpu_blocks.* at least 64"):
        BackgroundServer(llm, "tiny-chat")
    fits = LLM(chat_llm.engine.tokenizer.path.parent, EngineConfig(num_gpu_blocks=48, max_model_len=512),
               verbose=False)
    with BackgroundServer(fits, "tiny-chat") as server:
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"] == 512


def test_the_context_served_leaves_the_pools_watermark_free_so_every_prompt_within_it_is_admitted(chat_llm):
    """128 blocks of 16 tokens, 1 kept free by the 0.01 watermark: a prompt may fill 127, so 2,032 tokens is the
    context, not 2,048 (a prompt of 2,040 tokens was taken by the server and refused by the engine)."""
    llm = LLM(chat_llm.engine.tokenizer.path.parent, EngineConfig(num_gpu_blocks=128), verbose=False)
    with BackgroundServer(llm, "tiny-chat") as server:
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"] == 2032
        served = httpx.post(f"{server.url}/v1/completions", timeout=300, json={
            "model": "tiny-chat", "prompt": [5] * 2031, "max_tokens": 1})
        assert served.status_code == 200, served.text
        refused = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny-chat", "prompt": [5] * 2040,
                                                                   "max_tokens": 1})
        assert refused.status_code == 400 and "context is 2032" in refused.json()["error"]["message"]
    set_beyond = LLM(chat_llm.engine.tokenizer.path.parent, EngineConfig(num_gpu_blocks=128, max_model_len=2048),
                     verbose=False)
    with pytest.raises(ValueError, match=r"watermark's 1, 2032 tokens.*at least 129,.*at most 2032"):
        BackgroundServer(set_beyond, "tiny-chat")


def test_kvlib_serve_says_what_is_wrong_with_a_model_it_cannot_build_without_a_traceback(capsys):
    from kvlib.cli.commands import build_parser
    from kvlib.serve.command import run
    assert run(build_parser().parse_args(["serve", "/no/such/model"])) == 2
    assert "kvlib serve: model folder /no/such/model does not exist" in capsys.readouterr().err
    assert run(build_parser().parse_args(["serve", "default", "--max-model-len", "99999"])) == 2
    assert "kvlib serve: " in capsys.readouterr().err


def test_kvlib_serve_refuses_a_max_model_len_beyond_the_pool_before_it_listens(capsys):
    from kvlib.cli.commands import build_parser
    from kvlib.serve.command import run
    args = build_parser().parse_args(["serve", "default", "--num-gpu-blocks", "48", "--max-model-len", "1024"])
    assert run(args) == 2
    out, err = capsys.readouterr()
    assert "at most 768" in err and "--num-gpu-blocks" in err and " on http://" not in out


def test_health_recovers_once_the_engine_steps_again_with_no_client_request_in_between():
    """A readiness probe that reads 503 sends no traffic; /health itself must find out that the engine recovered."""
    llm = LLM("default", EngineConfig(num_gpu_blocks=32), verbose=False)
    llm.engine.step = failing = FailingStep(llm.engine.step)
    with BackgroundServer(llm, "default") as server:
        assert completion(server, prompt=[5, 6, 7], max_tokens=3).status_code == 200
        failing.failing = True
        assert completion(server, prompt="Hi").status_code == 500
        still = httpx.get(f"{server.url}/health")
        assert still.status_code == 503 and "simulated device error" in still.json()["error"]["message"]
        counted = scrape(server.url)
        failing.failing = False
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.get(f"{server.url}/health").status_code == 200
        after = scrape(server.url)
        for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                     "vllm:time_to_first_token_seconds_count"):  # the health check's own step is no client's
            assert after[name] == counted[name], name
        assert settled_pools(server) == {"unfinished": False, "device_blocks_held": 0, "host_blocks_held": 0}


def test_health_stays_503_while_steps_keep_failing_and_once_the_loop_stopped():
    llm = LLM("default", EngineConfig(num_gpu_blocks=32), verbose=False)
    llm.engine.step = failing = FailingStep(llm.engine.step)
    with BackgroundServer(llm, "default") as server:
        failing.failing = True
        assert completion(server, prompt="Hi").status_code == 500
        counted = scrape(server.url)
        for _ in range(2):
            reply = httpx.get(f"{server.url}/health")
            assert reply.status_code == 503 and "simulated device error" in reply.json()["error"]["message"]
        after = scrape(server.url)  # the probes that failed were aborted, and counted nowhere
        for name in ("vllm:prompt_tokens_total", "kvlib:num_requests_aborted_total"):
            assert after[name] == counted[name], name
        failing.failing = False
        assert httpx.get(f"{server.url}/health").status_code == 200
        server.engine_loop.stop()
        reply = httpx.get(f"{server.url}/health")
        assert reply.status_code == 503 and "not running" in reply.json()["error"]["message"]


class SlowStep:
    """Wraps ``engine.step``: a device slow enough that a long stream is still open when the server stops."""

    def __init__(self, step):
        self.step = step

    def __call__(self):
        time.sleep(0.02)
        return self.step()


@pytest.fixture
def uvicorn_errors(caplog):
    """What uvicorn logs at ERROR (its loggers do not propagate to pytest's handler)."""
    errors = logging.getLogger("uvicorn.error")
    errors.addHandler(caplog.handler)
    with caplog.at_level(logging.WARNING):
        yield caplog
    errors.removeHandler(caplog.handler)


def test_stopping_the_server_ends_every_open_stream_with_an_error_event_and_done(uvicorn_errors):
    """Stopping is what SIGTERM and SIGINT do (uvicorn's handler sets should_exit, as stop() does here)."""
    llm = LLM("default", EngineConfig(num_gpu_blocks=256, max_num_seqs=8), verbose=False)
    llm.engine.step = SlowStep(llm.engine.step)
    server = BackgroundServer(llm, "default").start()
    streams, first_chunks = [], threading.Barrier(4)

    def stream_one(index: int) -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120, json={
                "model": "default", "prompt": [5, 6, 7 + index], "max_tokens": 2000, "ignore_eos": True,
                "stream": True}) as reply:
            events, lines = [], reply.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line)
                    break
            first_chunks.wait(60)
            events += [line for line in lines if line.startswith("data: ")]
            streams.append(events)

    clients = [threading.Thread(target=stream_one, args=(i,)) for i in range(3)]
    for client in clients:
        client.start()
    first_chunks.wait(60)  # every stream is open and has its first tokens
    server.stop()
    for client in clients:
        client.join()
    assert len(streams) == 3
    for events in streams:
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2][len("data: "):])
        assert "shutting down" in last["error"]["message"]
    assert "Exception in ASGI application" not in uvicorn_errors.text
    assert "Cancel" not in uvicorn_errors.text  # no stream outlived the grace period
    ended = [r for r in uvicorn_errors.records if r.name == "kvlib.serve" and "shutting down" in r.getMessage()]
    assert len(ended) == 1 and "3 open request" in ended[0].getMessage()


@pytest.mark.parametrize("signal_name, exit_code", [("SIGTERM", -signal.SIGTERM), ("SIGINT", 130)])
def test_a_signal_to_kvlib_serve_ends_the_open_stream_and_logs_one_line(signal_name, exit_code):
    with socket.socket() as probe:  # a free port (kvlib serve prints the port it was given, so 0 would not do)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "kvlib.cli", "serve", "default", "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            assert server.poll() is None, server.communicate()
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                "model": "default", "prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True, "stream": True}) as reply:
            lines = (line for line in reply.iter_lines() if line.startswith("data: "))
            events = [next(lines)]
            server.send_signal(getattr(signal, signal_name))
            events += list(lines)
        _, log = server.communicate(timeout=120)
    finally:
        server.kill()
    assert events[-1] == "data: [DONE]" and "shutting down" in json.loads(events[-2][6:])["error"]["message"]
    assert "Traceback" not in log and "Exception in ASGI application" not in log
    assert "leaked" not in log  # the heap frozen at start-up was thawed, so the exit collects it as usual
    assert log.count("shutting down: ending 1 open request(s)") == 1
    assert server.returncode == exit_code


def test_too_many_stop_token_ids_get_a_400(small):
    """The engine looks each new token up in the list on every step: a long one would slow every request."""
    reply = completion(small, prompt=[5, 6], stop_token_ids=list(range(257)))
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "stop_token_ids"
    assert "at most 256" in reply.json()["error"]["message"]
    assert completion(small, prompt=[5, 6], stop_token_ids=list(range(256))).status_code == 200


def test_the_prompt_count_is_refused_before_the_fields_are_validated(monkeypatch):
    """Validating 10,000 prompts holds the GIL longer than parsing them; a request over the limit skips it."""
    from kvlib.serve.protocol import BadRequest, CompletionRequest, parse_request

    def validated(*args, **kwargs):
        raise AssertionError("the fields were validated")

    monkeypatch.setattr(CompletionRequest, "model_validate", validated)
    body = json.dumps({"model": "default", "prompt": [[5, 6, 7]] * 10_000}).encode()
    with pytest.raises(BadRequest, match="10000 prompts") as refused:
        parse_request(body, CompletionRequest, RequestLimits())
    assert refused.value.code == "too_many_prompts"


def test_the_prompt_token_limit_is_checked_before_the_ids_are_scanned(small):
    """A prompt of megabytes costs its tokenizing and no more: the limit refuses it before its ids are read."""
    reply = completion(small, prompt=[[5] * 40, [5] * 40 + [99_999]])  # the bad id lies past the limit
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "too_many_prompt_tokens"
    assert "81 tokens or more" in reply.json()["error"]["message"]


def test_a_whole_response_is_rendered_off_the_event_loop(llm, monkeypatch):
    """256 prompts x n choices make a body of megabytes: /health answers while it is built (held here by the test)."""
    from kvlib.serve import app as app_module
    building, released, order = threading.Event(), threading.Event(), []
    real = app_module.responses.completion

    def slowly(*args):
        building.set()
        released.wait(20)  # only a guard against a hang: the order below is what the test judges
        order.append("rendered")
        return real(*args)

    monkeypatch.setattr(app_module.responses, "completion", slowly)
    with BackgroundServer(llm, "default") as server:
        replies = {}
        sender = threading.Thread(target=lambda: replies.update(whole=completion(server, prompt=[5, 6, 7])))
        sender.start()
        assert building.wait(60)
        health = httpx.get(f"{server.url}/health", timeout=120)
        order.append("health answered")
        released.set()
        sender.join()
    assert order == ["health answered", "rendered"]
    assert health.status_code == 200 and replies["whole"].status_code == 200
    assert replies["whole"].json()["usage"]["prompt_tokens"] == 3


def test_a_stream_that_fails_in_the_server_itself_still_ends_with_an_error_event_and_done(llm, monkeypatch):
    from kvlib.serve import app as app_module

    def broken(*args):
        raise KeyError("a defect in a chunk builder")

    monkeypatch.setattr(app_module.responses, "completion_chunk", broken)
    with BackgroundServer(llm, "default") as server:
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
                "model": "default", "prompt": [5, 6, 7], "max_tokens": 4, "stream": True}) as reply:
            events = read_stream(reply)
        assert events[-1] is None and "a defect in a chunk builder" in events[-2]["error"]["message"]
        assert settled_pools(server) == {"unfinished": False, "device_blocks_held": 0, "host_blocks_held": 0}


def test_the_server_freezes_the_heap_it_starts_with_and_thaws_it_when_it_stops(llm):
    """The model's and the libraries' objects live as long as the server: Python's full collections, which stall
    every thread while they walk the heap, skip what was frozen at start-up (vLLM freezes it too)."""
    assert gc.get_freeze_count() == 0
    with BackgroundServer(llm, "default") as server:
        assert gc.get_freeze_count() > 0
        assert completion(server, prompt=[5, 6, 7]).status_code == 200
    assert gc.get_freeze_count() == 0


def test_a_burst_of_requests_joins_the_engine_at_most_256_between_two_steps():
    """Adding a request is work the running streams wait for: a burst of 600 is spread over several steps."""
    from kvlib.serve.engine_loop import EngineLoop
    llm = LLM("default", EngineConfig(num_gpu_blocks=512, max_num_seqs=8), verbose=False)
    queued, step = [], llm.engine.step

    def counting_step():
        scheduler = llm.engine.scheduler
        queued.append(len(scheduler.waiting) + len(scheduler.running) + len(scheduler.swapped))
        return step()

    llm.engine.step = counting_step
    loop, finished, all_done = EngineLoop(llm), [], threading.Event()

    def sink(event):
        if event.kind == "output" and event.output.finished:
            finished.append(event.output.request_id)
            if len(finished) == 600:
                all_done.set()

    loop.start()
    entered, hold = threading.Event(), threading.Event()
    held = loop.call(lambda llm: (entered.set(), hold.wait(60)))  # the engine thread waits inside its inbox
    assert entered.wait(60)
    for i in range(600):
        loop.submit(f"burst-{i}", [5, 6], SamplingParams(max_tokens=1), sink)
    hold.set()
    held.result(60)
    assert all_done.wait(120)
    loop.stop()
    growth = [b - a for a, b in zip([0] + queued, queued)]
    assert queued[0] == 256 and max(growth) <= 256 and sorted(finished) == sorted(f"burst-{i}" for i in range(600))


def test_host_prefix_blocks_count_as_free_in_the_host_usage_gauge_as_cached_device_blocks_do():
    """The tier gives a block up whenever a swap needs the room: an idle server read 0.9 with a full tier."""
    config = EngineConfig(num_gpu_blocks=16, num_cpu_blocks=16, enable_prefix_caching=True, host_prefix_cache=True)
    with BackgroundServer(LLM("default", config, verbose=False), "default") as server:
        for first in range(8):  # eight different 64-token prompts through a 16-block pool: evictions fill the tier
            assert completion(server, prompt=[first + 5] + [7] * 63, max_tokens=1).status_code == 200
        tier = server.engine_loop.call(lambda llm: llm.engine.block_manager.host_tier.num_cached).result(30)
        assert tier >= 8
        metrics = scrape(server.url)
        assert (metrics["vllm:cpu_cache_usage_perc"], metrics["vllm:gpu_cache_usage_perc"]) == (0.0, 0.0)


def test_a_client_that_leaves_while_sending_its_body_gets_no_answer_and_no_server_error(llm):
    """The body was announced as 1,000 bytes and 10 came: the app answers 499 (nobody reads it), never a 500."""
    import asyncio
    from kvlib.serve.app import build_app
    messages = [{"type": "http.request", "body": b"0123456789", "more_body": True}, {"type": "http.disconnect"}]
    sent = []

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "scheme": "http", "http_version": "1.1", "server": ("test", 80),
             "client": ("client", 1), "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")]}
    asyncio.run(build_app(llm, "default")(scope, receive, send))
    assert sent[0]["status"] == 499


def test_stop_strings_on_a_model_without_a_tokenizer_are_refused_naming_stop_token_ids():
    """Stop strings are matched in text: without a tokenizer there is none, and they were silently ignored."""
    from kvlib.serve.protocol import BadRequest, CompletionRequest
    from kvlib.serve.requests import ServedModel, completion_work
    model = ServedModel("ids-only", max_model_len=64, max_num_seqs=4, vocab_size=100, tokenizer=None)
    request = CompletionRequest.model_validate({"model": "ids-only", "prompt": [1, 2, 3], "stop": ["a"]})
    with pytest.raises(BadRequest, match="stop_token_ids") as refused:
        completion_work(request, model)
    assert refused.value.param == "stop"
    ids_only = CompletionRequest.model_validate({"model": "ids-only", "prompt": [1, 2, 3], "stop_token_ids": [7]})
    assert completion_work(ids_only, model).params.stop_token_ids == [7]


def test_a_request_built_in_code_meets_the_prompt_limit_too():
    """``parse_request`` counts prompts before validating; ``completion_work`` counts again for a request that never
    went through it (built in code, as lesson 10 and the tests build them)."""
    from kvlib.serve.protocol import BadRequest, CompletionRequest
    from kvlib.serve.requests import ServedModel, completion_work
    model = ServedModel("ids-only", max_model_len=64, max_num_seqs=4, vocab_size=100, tokenizer=None,
                        limits=RequestLimits(max_prompts=2))
    request = CompletionRequest.model_validate({"model": "ids-only", "prompt": [[1], [2], [3]]})
    with pytest.raises(BadRequest, match="3 prompts") as refused:
        completion_work(request, model)
    assert refused.value.code == "too_many_prompts"
