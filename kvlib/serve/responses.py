"""The OpenAI response shapes: whole completions, streamed chunks, usage and errors, as plain dicts.

``token_ids`` on a choice (and on a chunk) is vLLM's ``return_token_ids`` extension: the exact
tokens, for a client that compares them with another engine's.
"""
from __future__ import annotations

import json
from typing import Optional

from kvlib.serve.generation import Generation

def error_body(message: str, status: int = 400, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    """OpenAI's error shape; its ``type`` says whose to mend: the client's (4xx) or the server's (5xx)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def sse(data) -> bytes:
    """One server-sent event; ``data`` a dict, or the ``[DONE]`` that ends the stream."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def usage(gen: Generation) -> dict:
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens}


def _head(gen: Generation, model: str, obj: str) -> dict:
    return {"id": gen.id, "object": obj, "created": gen.created, "model": model}


def _choice(index: int, body: dict, finish_reason: Optional[str], token_ids: Optional[list[int]]) -> dict:
    """One choice of any response: ``body`` is its text, message or delta, the only key that differs."""
    item = {"index": index, **body, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        item["token_ids"] = token_ids
    return item


def _whole(gen: Generation, model: str, obj: str, body, with_token_ids: bool) -> dict:
    choices = [_choice(index, body(choice.text), choice.finish_reason, choice.token_ids if with_token_ids else None)
               for index, choice in enumerate(gen.choices)]
    return {**_head(gen, model, obj), "choices": choices, "usage": usage(gen)}


def completion(gen: Generation, model: str, with_token_ids: bool) -> dict:
    return _whole(gen, model, "text_completion", lambda text: {"text": text}, with_token_ids)


def chat_completion(gen: Generation, model: str, with_token_ids: bool) -> dict:
    return _whole(gen, model, "chat.completion",
                  lambda text: {"message": {"role": "assistant", "content": text}}, with_token_ids)


def completion_chunk(gen: Generation, model: str, index: int, text: str, token_ids: Optional[list[int]],
                     finish_reason: Optional[str]) -> dict:
    return {**_head(gen, model, "text_completion"), "choices": [_choice(index, {"text": text}, finish_reason, token_ids)]}


def chat_chunk(gen: Generation, model: str, index: int, delta: dict, token_ids: Optional[list[int]],
               finish_reason: Optional[str]) -> dict:
    return {**_head(gen, model, "chat.completion.chunk"),
            "choices": [_choice(index, {"delta": delta}, finish_reason, token_ids)]}


def usage_chunk(gen: Generation, model: str, obj: str) -> dict:
    """The last chunk when the client asked for ``stream_options.include_usage``: no choices, the usage."""
    return {**_head(gen, model, obj), "choices": [], "usage": usage(gen)}
