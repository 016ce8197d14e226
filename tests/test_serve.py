"""``kvlib serve`` answers the real ``openai`` client as OpenAI would, with the tokens ``LLM`` itself produces.

One server, started on 127.0.0.1 (a free port) in this process, serves the built-in model with a
chat template beside it; a second ``LLM`` on the same folder is the oracle.
"""
from __future__ import annotations

import httpx
import openai
import pytest

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.serve.server import BackgroundServer
from serve_helpers import FailingStep, chat_model_folder, ended_requests, scrape, settled_pools, successes

NAME = "tiny-chat"
CONFIG = EngineConfig(num_gpu_blocks=64, num_cpu_blocks=32, max_num_seqs=8)
PROMPTS = ["The KV cache is", "Paging means", "A block table maps"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return chat_model_folder(tmp_path_factory.mktemp("chat-model"))


@pytest.fixture(scope="module")
def oracle(folder):
    return LLM(folder, CONFIG, verbose=False)


@pytest.fixture(scope="module")
def server(folder):
    with BackgroundServer(LLM(folder, CONFIG, verbose=False), NAME) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_greedy_completions_are_token_exact_with_generate(client, oracle):
    expected = oracle.generate(PROMPTS, SamplingParams(max_tokens=24))
    out = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=24, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.token_ids for c in out.choices] == [e.token_ids for e in expected]
    assert [c.text for c in out.choices] == [e.text for e in expected]
    assert [c.finish_reason for c in out.choices] == [e.finish_reason for e in expected]
    assert out.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert out.usage.completion_tokens == sum(len(e.token_ids) for e in expected)


def test_a_streamed_completion_arrives_in_pieces_that_add_up_to_generate(client, oracle):
    expected = oracle.generate(PROMPTS[0], SamplingParams(max_tokens=32))[0]
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=32, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}))
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert len(pieces) > 1
    assert "".join(p.text for p in pieces) == expected.text
    assert [t for p in pieces for t in p.token_ids] == expected.token_ids
    assert [p.finish_reason for p in pieces][-1] == expected.finish_reason
    assert all(p.finish_reason is None for p in pieces[:-1])
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat_applies_the_models_template_as_llm_chat_does(client, oracle):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is paging?"}]
    expected = oracle.chat(messages, SamplingParams(max_tokens=20))[0]
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0,
                                         extra_body={"return_token_ids": True})
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert out.choices[0].token_ids == expected.token_ids
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0, stream=True)
    chunks = [c.choices[0] for c in stream]
    assert chunks[0].delta.role == "assistant"
    assert "".join(c.delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].finish_reason == expected.finish_reason


def test_text_parts_of_a_message_are_its_lines_as_vllm_joins_them(client, oracle):
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "paging?"}]
    expected = oracle.chat([{"role": "user", "content": "What is\npaging?"}], SamplingParams(max_tokens=8))[0]
    out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": parts}], max_tokens=8,
                                         temperature=0)
    assert out.choices[0].message.content == expected.text
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_seeded_samples_match_generate_whatever_else_runs(client, oracle):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, n=3, seed=7)
    expected = oracle.generate(PROMPTS[1], params)[0]
    out = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0.9, top_p=0.95, n=3,
                                    seed=7, extra_body={"return_token_ids": True})
    assert [c.token_ids for c in out.choices] == [s.token_ids for s in expected.samples]


def test_a_stop_string_cuts_the_text_and_frees_the_request(server, client, oracle):
    full = oracle.generate(PROMPTS[2], SamplingParams(max_tokens=40))[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = full[:full.index(stop)]
    before, successes_before = scrape(server.url), successes(server.url, "stop")
    out = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=40, temperature=0, stop=[stop])
    assert (out.choices[0].text, out.choices[0].finish_reason) == (cut, "stop")
    streamed = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=40, temperature=0, stop=stop,
                                         stream=True)
    pieces = [c.choices[0] for c in streamed]
    assert "".join(p.text for p in pieces) == cut and pieces[-1].finish_reason == "stop"
    assert settled_pools(server) == {"unfinished": False, "device_blocks_held": 0, "host_blocks_held": 0}
    after = scrape(server.url)  # ended early, and counted as vLLM counts a stop: finished, not aborted
    assert after["kvlib:num_requests_aborted_total"] == before["kvlib:num_requests_aborted_total"]
    assert successes(server.url, "stop") == successes_before + 2
    assert after["vllm:e2e_request_latency_seconds_count"] == before["vllm:e2e_request_latency_seconds_count"] + 2


LONG = "word " * 1100  # fits the model's context (2,048 tokens), not the 64-block pool (1,024 token slots)
BAD = [  # (what is wrong, request body, the param the error names)
    ("unknown model", {"model": "gpt-4", "prompt": "Hi"}, "model"),
    ("no prompt", {"model": NAME}, "prompt"),
    ("prompt of the wrong type", {"model": NAME, "prompt": {"text": "Hi"}}, "prompt"),
    ("empty prompt", {"model": NAME, "prompt": ""}, "prompt"),
    ("token id outside the vocabulary", {"model": NAME, "prompt": [5, 99999]}, "prompt"),
    ("max_tokens beyond the context", {"model": NAME, "prompt": "Hi", "max_tokens": 5000}, "max_tokens"),
    ("max_tokens zero", {"model": NAME, "prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ("prompt beyond the context", {"model": NAME, "prompt": "word " * 2100}, "prompt"),
    ("prompt beyond the KV pool", {"model": NAME, "prompt": LONG, "max_tokens": 4}, "prompt"),
    ("n over max_num_seqs", {"model": NAME, "prompt": "Hi", "n": 9}, "n"),
    ("n zero", {"model": NAME, "prompt": "Hi", "n": 0}, "n"),
    ("negative temperature", {"model": NAME, "prompt": "Hi", "temperature": -0.5}, "temperature"),
    ("temperature over 2", {"model": NAME, "prompt": "Hi", "temperature": 3}, "temperature"),
    ("top_p zero", {"model": NAME, "prompt": "Hi", "top_p": 0}, "top_p"),
    ("top_p over 1", {"model": NAME, "prompt": "Hi", "top_p": 1.5}, "top_p"),
    ("negative seed", {"model": NAME, "prompt": "Hi", "seed": -1}, "seed"),
    ("five stop strings", {"model": NAME, "prompt": "Hi", "stop": list("abcde")}, "stop"),
    ("empty stop string", {"model": NAME, "prompt": "Hi", "stop": [""]}, "stop"),
    ("unsupported logprobs", {"model": NAME, "prompt": "Hi", "logprobs": 3}, "logprobs"),
    ("misspelt field", {"model": NAME, "prompt": "Hi", "max_token": 3}, "max_token"),
    ("chat without messages", {"model": NAME, "messages": []}, "messages"),
    ("chat message without a role", {"model": NAME, "messages": [{"content": "Hi"}]}, "messages.0.role"),
    ("chat with an image", {"model": NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content"),
    ("chat text part without its text", {"model": NAME, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages.0.content.0"),
    ("max_completion_tokens beyond the context",
     {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 5000},
     "max_completion_tokens"),
    ("max_tokens as a string", {"model": NAME, "prompt": "Hi", "max_tokens": "5"}, "max_tokens"),
    ("max_tokens as a boolean", {"model": NAME, "prompt": "Hi", "max_tokens": True}, "max_tokens"),
    ("stop token id outside the vocabulary", {"model": NAME, "prompt": "Hi", "stop_token_ids": [99999]},
     "stop_token_ids"),
]


CODES = {  # OpenAI's error code, where a client may branch on it
    "unknown model": "model_not_found", "misspelt field": "unknown_parameter", "no prompt": "missing_required_parameter",
    "token id outside the vocabulary": "invalid_token_id", "stop token id outside the vocabulary": "invalid_token_id",
    "unsupported logprobs": "unsupported_parameter", "max_tokens as a string": "invalid_type",
    "max_tokens beyond the context": "context_length_exceeded", "chat with an image": "unsupported_content",
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("what, body, param", BAD, ids=[b[0] for b in BAD])
def test_a_bad_request_gets_openais_error_shape_and_the_server_keeps_serving(server, client, oracle, what, body,
                                                                            param, stream):
    route = "chat/completions" if "messages" in body else "completions"
    reply = httpx.post(f"{server.url}/v1/{route}", json={**body, "stream": stream})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert error["code"] == CODES.get(what, error["code"])
    with pytest.raises(openai.BadRequestError):
        client.post(f"/{route}", cast_to=object, body={**body, "stream": stream})
    assert client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0).choices[0].text == \
        oracle.generate(PROMPTS[0], SamplingParams(max_tokens=4))[0].text


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"\xff\xfe", b"",
                                  b'{"model": "m", "prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}",
                                  b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"],
                         ids=["broken", "a list", "not utf-8", "empty", "an integer of 5,001 digits", "nested 100,000 deep"])
def test_a_body_that_is_not_a_json_object_gets_a_400(server, body):
    reply = httpx.post(f"{server.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize("method, route, status", [("GET", "/v1/engines", 404), ("GET", "/v1/completions", 405),
                                                   ("GET", "/v1/models/gpt-4", 404)])
def test_an_unknown_route_or_method_gets_openais_error_shape_as_the_clients_mistake(server, method, route, status):
    reply = httpx.request(method, f"{server.url}{route}")
    assert reply.status_code == status and set(reply.json()["error"]) == {"message", "type", "param", "code"}
    assert reply.json()["error"]["type"] == "invalid_request_error"  # a 4xx is the client's to mend, as OpenAI types it


def test_the_served_model_is_retrieved_by_name_as_the_client_asks_for_it(client):
    model = client.models.retrieve(NAME)
    assert (model.id, model.object, model.owned_by) == (NAME, "model", "kvlib")
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        client.models.retrieve("gpt-4")


def test_null_for_an_option_means_its_default_as_the_openai_client_sends_it(client, oracle):
    """The client sends ``null`` for any argument passed as None; OpenAI documents these fields as nullable."""
    expected = oracle.generate(PROMPTS[0], SamplingParams(max_tokens=6))[0].text
    out = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0, n=None, stream=None,
                                    echo=None, presence_penalty=None, frequency_penalty=None, logprobs=None,
                                    best_of=None, logit_bias=None, suffix=None, seed=None, stop=None, top_p=None,
                                    user=None, stream_options=None,
                                    extra_body={"ignore_eos": None, "return_token_ids": None, "stop_token_ids": None})
    assert [c.text for c in out.choices] == [expected]
    default = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=None, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # OpenAI's default for completions, not the rest of the context
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=None,
                                          max_completion_tokens=4, temperature=0, n=None, stream=None,
                                          presence_penalty=None, frequency_penalty=None, logprobs=None,
                                          top_logprobs=None, tools=None, tool_choice=None, response_format=None)
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens <= 4


def test_metrics_use_vllms_names(server, client):
    client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_swapped",
                 "vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket"):
        assert f'\n{name}{{' in text, name
    samples = scrape(server.url)
    assert samples["vllm:generation_tokens_total"] >= 8 and samples["vllm:time_to_first_token_seconds_count"] >= 1
    assert samples["vllm:num_requests_running"] == 0 and samples["vllm:gpu_cache_usage_perc"] == 0.0


def test_an_engine_error_reaches_every_client_and_the_server_recovers():
    llm = LLM("default", EngineConfig(num_gpu_blocks=32), verbose=False)
    llm.engine.step = failing = FailingStep(llm.engine.step)
    with BackgroundServer(llm, "default") as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        failing.failing = True
        with pytest.raises(openai.InternalServerError, match="simulated device error"):
            client.completions.create(model="default", prompt="Hi", max_tokens=8)
        with pytest.raises(openai.APIError, match="simulated device error"):
            list(client.completions.create(model="default", prompt="Hi", max_tokens=8, stream=True))
        assert httpx.get(f"{server.url}/health").status_code == 503
        assert settled_pools(server) == {"unfinished": False, "device_blocks_held": 0, "host_blocks_held": 0}
        failing.failing = False
        out = client.completions.create(model="default", prompt="Hi", max_tokens=8, temperature=0)
        assert out.choices[0].text == LLM("default", verbose=False).generate("Hi", SamplingParams(max_tokens=8))[0].text
        assert httpx.get(f"{server.url}/health").status_code == 200


def test_request_success_counts_requests_not_samples(server, client):
    before = scrape(server.url)
    client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, n=3, temperature=1.0, seed=3)
    ended_before = before.get("vllm:request_success_total", 0) + before.get("kvlib:num_requests_aborted_total", 0)
    after = ended_requests(server.url, ended_before + 1)  # counted a moment after the client has its last tokens
    assert after["vllm:request_success_total"] - before.get("vllm:request_success_total", 0) == 1  # n = 3: one request


@pytest.mark.parametrize("field, value", [("logprobs", False), ("best_of", 1), ("logit_bias", {}), ("top_logprobs", 0),
                                          ("presence_penalty", 0), ("echo", False)])
def test_a_neutral_value_of_an_unsupported_option_is_accepted_as_vllm_accepts_it(server, field, value):
    route, body = ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}) if field in (
        "logprobs", "top_logprobs") else ("completions", {"prompt": "Hi"})
    reply = httpx.post(f"{server.url}/v1/{route}", json={"model": NAME, "max_tokens": 2, field: value, **body})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("field, value", [("logprobs", 0), ("best_of", 2), ("logit_bias", {"5": 1.0}),
                                          ("echo", 0)])
def test_a_value_that_asks_for_an_unsupported_option_is_refused(server, field, value):
    reply = httpx.post(f"{server.url}/v1/completions", json={"model": NAME, "prompt": "Hi", field: value})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == field


def test_stream_options_without_streaming_is_refused(server):
    reply = httpx.post(f"{server.url}/v1/completions",
                       json={"model": NAME, "prompt": "Hi", "stream_options": {"include_usage": True}})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "stream_options"
    assert "send stream: true" in reply.json()["error"]["message"] and reply.json()["error"]["code"] == "invalid_value"


class AbortsRequests:
    """A plugged-in piece that aborts every request once it has ``after_tokens`` tokens: its client is still there."""

    def __init__(self, after_tokens: int):
        self.engine, self.after_tokens = None, after_tokens

    def observe(self, metrics):
        for request_id, seqs in list(self.engine._requests.items()):
            if len(seqs[0].output_token_ids) >= self.after_tokens:
                self.engine.abort_request(request_id)
        return None


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_a_plugged_in_piece_aborts_ends_every_choice_with_abort_as_vllm_says(stream):
    """Each of its n choices ends, finish reason "abort" (a non-streamed reply got a 499, a stream never ended
    its second choice), and /metrics counts the request once, as aborted."""
    detector = AbortsRequests(after_tokens=2)
    llm = LLM("default", EngineConfig(num_gpu_blocks=32), oversubscription_detector=detector, verbose=False)
    detector.engine = llm.engine
    with BackgroundServer(llm, "default") as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        request = dict(model="default", prompt="Hi", max_tokens=16, n=2, temperature=1.0, seed=5, stream=stream)
        if stream:
            reasons = {c.index: c.finish_reason for chunk in client.completions.create(**request)
                       for c in chunk.choices if c.finish_reason is not None}
        else:
            reasons = {c.index: c.finish_reason for c in client.completions.create(**request).choices}
        assert reasons == {0: "abort", 1: "abort"}
        after = ended_requests(server.url, 1)
        assert after.get("kvlib:num_requests_aborted_total", 0) == 1 and after.get("vllm:request_success_total", 0) == 0
        assert settled_pools(server) == {"unfinished": False, "device_blocks_held": 0, "host_blocks_held": 0}


def test_a_request_aborted_before_its_first_token_gives_no_time_to_first_token():
    """Its prompt is a chunk short of done when a plugged-in piece aborts it: no token, so no TTFT (one was
    recorded)."""
    detector = AbortsRequests(after_tokens=0)
    llm = LLM("default", EngineConfig(num_gpu_blocks=32, max_num_batched_tokens=4), oversubscription_detector=detector,
              verbose=False)
    detector.engine = llm.engine
    with BackgroundServer(llm, "default") as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        out = client.completions.create(model="default", prompt="The KV cache is paged", max_tokens=8)
        assert (out.choices[0].text, out.choices[0].finish_reason) == ("", "abort")
        after = ended_requests(server.url, 1)
        assert after.get("vllm:time_to_first_token_seconds_count", 0) == 0
