"""The OpenAI response shapes: whole completions, streamed chunks, usage and errors, as plain dicts.

``token_ids`` on a choice (and on a chunk) is vLLM's ``return_token_ids`` extension: the exact
tokens, for a client that compares them with another engine's.
"""
from __future__ import annotations

import json
from typing import Optional

from kvlib.serve.generation import Generation

ERROR_TYPES = {400: "invalid_request_error", 500: "server_error", 503: "server_error"}


def error_body(message: str, status: int = 400, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param, "code": code}}


def sse(data) -> bytes:
    """One server-sent event; ``data`` a dict, or the ``[DONE]`` that ends the stream."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def usage(gen: Generation) -> dict:
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens}


def _head(gen: Generation, model: str, obj: str) -> dict:
    return {"id": gen.id, "object": obj, "created": gen.created, "model": model}


def completion(gen: Generation, model: str, with_token_ids: bool) -> dict:
    choices = []
    for index, choice in enumerate(gen.choices):
        item = {"index": index, "text": choice.text, "logprobs": None, "finish_reason": choice.finish_reason}
        if with_token_ids:
            item["token_ids"] = choice.token_ids
        choices.append(item)
    return {**_head(gen, model, "text_completion"), "choices": choices, "usage": usage(gen)}


def completion_chunk(gen: Generation, model: str, index: int, text: str, token_ids: Optional[list[int]],
                     finish_reason: Optional[str]) -> dict:
    item = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        item["token_ids"] = token_ids
    return {**_head(gen, model, "text_completion"), "choices": [item]}


def chat_completion(gen: Generation, model: str, with_token_ids: bool) -> dict:
    choices = []
    for index, choice in enumerate(gen.choices):
        item = {"index": index, "message": {"role": "assistant", "content": choice.text}, "logprobs": None,
                "finish_reason": choice.finish_reason}
        if with_token_ids:
            item["token_ids"] = choice.token_ids
        choices.append(item)
    return {**_head(gen, model, "chat.completion"), "choices": choices, "usage": usage(gen)}


def chat_chunk(gen: Generation, model: str, index: int, delta: dict, token_ids: Optional[list[int]],
               finish_reason: Optional[str]) -> dict:
    item = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        item["token_ids"] = token_ids
    return {**_head(gen, model, "chat.completion.chunk"), "choices": [item]}


def usage_chunk(gen: Generation, model: str, obj: str) -> dict:
    """The last chunk when the client asked for ``stream_options.include_usage``: no choices, the usage."""
    return {**_head(gen, model, obj), "choices": [], "usage": usage(gen)}
