"""The OpenAI request shapes the server accepts, and the errors a bad one gets.

Fields are OpenAI's names with OpenAI's defaults (``temperature`` 1, ``max_tokens`` 16 for
completions, the rest of the context for chat). ``ignore_eos``, ``stop_token_ids`` and
``return_token_ids`` are extensions vLLM accepts too. An unknown field is refused by name rather than silently
ignored, and so is a known one kvlib does not implement (``logprobs``, ``echo``, penalties ...), unless it is
given its neutral value. ``null`` for an optional field means its default (the ``openai`` client sends it for an
argument passed as None). Types are strict: ``"5"`` or ``true`` where a number belongs is refused, not read as 5 or 1.
"""
from __future__ import annotations

import json
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvlib.serve.limits import LIMIT_FLAGS, RequestLimits

MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_STOP_TOKEN_IDS = 256  # each new token is looked up in them at every step: a long list slows every request
UNSUPPORTED = {  # field: the values that mean "off", which are accepted (as vLLM accepts them)
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None,), "logit_bias": (None, {}), "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0),
    "tools": (None,), "tool_choice": (None,), "response_format": (None,), "functions": (None,),
    "function_call": (None,),
}


def is_neutral(value, neutral) -> bool:
    """``value`` means the same as ``neutral``: 0 and 0.0 do, a bool and a number never (``logprobs: 0`` is not
    ``false``), nor values of other types."""
    if neutral is None or value is None:
        return value is neutral
    if isinstance(value, bool) != isinstance(neutral, bool):
        return False
    numbers = (int, float)
    if isinstance(value, numbers) and isinstance(neutral, numbers):
        return value == neutral
    return type(value) is type(neutral) and value == neutral


class BadRequest(Exception):
    """A request the server refuses with a 400: what is wrong, which field, and OpenAI's error code."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    n: int = 1
    temperature: Optional[float] = None  # None: 1.0, as OpenAI
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    return_token_ids: bool = False  # vLLM's extension: each choice also carries its token ids
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = False
    best_of: Any = None
    suffix: Any = None
    logit_bias: Any = None
    presence_penalty: Any = 0.0
    frequency_penalty: Any = 0.0

    @field_validator("n", "stream", "ignore_eos", "return_token_ids", "max_tokens", mode="before", check_fields=False)
    @classmethod
    def _null_means_the_default(cls, value, info):
        return cls.model_fields[info.field_name].default if value is None else value

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int = 16


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool_call_id ...: passed to the chat template as given
    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None  # None: the rest of the context
    max_completion_tokens: Optional[int] = None  # OpenAI's newer name for max_tokens
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None
    functions: Any = None
    function_call: Any = None


def _is_type_tag(part) -> bool:
    """Pydantic names the member of a union it tried (``str``, ``list[int]``) in an error's location."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part or "-" in part)


def is_batch(prompt) -> bool:
    """A list of prompts, not one prompt of token ids."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


def check_prompt_count(prompt, limits: RequestLimits) -> None:
    count = len(prompt) if is_batch(prompt) else 1
    if count > limits.max_prompts:
        raise BadRequest(f"this request holds {count} prompts; this server takes at most {limits.max_prompts} in one "
                         f"request (kvlib serve {LIMIT_FLAGS['max_prompts']}): send them in several requests",
                         param="prompt", code="too_many_prompts")


def parse_request(body: bytes, shape: type[SamplingFields], limits: Optional[RequestLimits] = None) -> SamplingFields:
    """The request body as ``shape``, or :class:`BadRequest` naming the first field that is wrong. The prompt count
    is checked before the fields are validated, which for 10,000 prompts takes longer than parsing them."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as err:  # bad JSON, bad UTF-8, an integer of 4,300+ digits, deep nesting
        raise BadRequest(f"the request body is not valid JSON ({err}); send a JSON object such as "
                         f'{{"model": "...", ...}} with Content-Type: application/json', code="invalid_json") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    if limits is not None:
        check_prompt_count(data.get("prompt"), limits)
    try:
        request = shape.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(part) for part in first["loc"] if not _is_type_tag(part)) or None
        if first["type"] == "extra_forbidden":
            raise BadRequest(f"unknown field {param!r}: kvlib does not recognise it; check its spelling against "
                             f"OpenAI's API", param=param, code="unknown_parameter") from None
        if first["type"] == "missing":
            raise BadRequest(f"the required field {param!r} is missing", param=param, code="missing_required_parameter") from None
        raise BadRequest(f"{param}: {first['msg']} (got {first.get('input')!r})", param=param,
                         code="invalid_type") from None
    for name, neutrals in UNSUPPORTED.items():
        value = getattr(request, name, neutrals[0])
        if not any(is_neutral(value, neutral) for neutral in neutrals):
            raise BadRequest(f"{name} is not supported by kvlib; leave it out", param=name, code="unsupported_parameter")
    if request.stream_options is not None and not request.stream:
        raise BadRequest("stream_options applies to a streamed response only: send stream: true with it, or leave "
                         "it out", param="stream_options", code="invalid_value")
    return request
