"""A checked OpenAI request as the engine's work: prompts as token ids, one ``SamplingParams``, stop strings.

Everything the server can check before the engine sees the request is checked here, so a bad
request costs a 400 and nothing else: the model's name, the context length, ``n`` against the
batch, sampling values, the prompt's tokens. What only the engine knows (a prompt that can never fit
the KV pool) comes back from its next step as a rejection, and becomes a 400 too.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from tokenizers import Tokenizer as HFTokenizer

from kvlib.config import MAX_SEED, SamplingParams
from kvlib.llm import LLM
from kvlib.serve.limits import LIMIT_FLAGS, RequestLimits
from kvlib.serve.protocol import (BadRequest, ChatCompletionRequest, CompletionRequest, MAX_STOP_STRINGS,
                                  MAX_STOP_TOKEN_IDS, SamplingFields, check_prompt_count, is_batch)
from kvlib.tokenizer import unicode_problem

MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
logger = logging.getLogger("kvlib.serve")


@dataclass(frozen=True)
class ServedModel:
    """What the server checks requests against: read once from the ``LLM`` it serves."""

    name: str
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    tokenizer: object  # kvlib.tokenizer.Tokenizer, or None for a folder without tokenizer.json
    limits: RequestLimits = field(default_factory=RequestLimits)
    encoder: object = None  # the same tokenizer.json in the tokenizers library, for encode_batch

    @classmethod
    def of(cls, llm: LLM, name: str, limits: Optional[RequestLimits] = None) -> "ServedModel":
        engine, tokenizer = llm.engine, llm.tokenizer
        encoder = None if tokenizer is None else HFTokenizer.from_file(str(tokenizer.path))
        return cls(name, _context_the_pool_holds(llm), engine.config.max_num_seqs, engine.model_config.vocab_size,
                   tokenizer, limits or RequestLimits(), encoder)

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids, as the engine's tokenizer gives them (``Tokenizer.encode``).

        The tokenizers library holds the GIL through ``encode`` but lets it go in ``encode_batch`` (all but
        the hand-back of the ids, tens of ms per million tokens): on a worker thread, a prompt of megabytes
        then leaves the event loop (``/health``, open streams) running.
        """
        return self._ids(text, "the prompt", add_special_tokens=True)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The token ids ``Tokenizer.encode_chat`` gives (the template writes any BOS itself), as :meth:`encode`."""
        return self._ids(self.tokenizer.apply_chat_template(messages), "the conversation", add_special_tokens=False)

    def _ids(self, text: str, what: str, add_special_tokens: bool) -> list[int]:
        problem = unicode_problem(text, what)
        if problem:
            raise ValueError(problem)
        # tokenizers 0.20 added encode_batch_fast: no offsets (the server reads none), half the time; 0.19 has not
        encode = getattr(self.encoder, "encode_batch_fast", self.encoder.encode_batch)
        return encode([text], add_special_tokens=add_special_tokens)[0].ids


def _context_the_pool_holds(llm: LLM) -> int:
    """The longest request (prompt plus output) the server takes, decided as vLLM decides it: the model's context
    when the KV pool holds it; else, with no ``max_model_len`` set, lowered to what the pool holds (logged), so
    that a request sending no ``max_tokens`` is served; a ``max_model_len`` set beyond the pool is refused."""
    engine = llm.engine
    blocks, block_size = engine.block_manager.num_device_blocks, engine.config.block_size
    admitted = blocks - engine.block_manager.watermark_blocks  # the most a prompt may fill (Scheduler.why_never)
    pool = admitted * block_size
    if engine.max_model_len <= pool:
        return engine.max_model_len
    if engine.config.max_model_len is not None:
        needed = _blocks_admitting(-(-engine.max_model_len // block_size), engine.config.watermark)
        raise ValueError(f"max_model_len={engine.max_model_len} is more than the KV pool admits: {blocks} blocks of "
                         f"{block_size} tokens less the watermark's {blocks - admitted}, {pool} tokens, so a prompt "
                         f"that long could never run; raise num_gpu_blocks (--num-gpu-blocks) to at least {needed}, "
                         f"or lower max_model_len (--max-model-len) to at most {pool}")
    logger.warning("the KV pool admits %d tokens (%d blocks of %d, less the watermark's %d), less than the model's "
                   "context of %d: serving a context of %d tokens; raise num_gpu_blocks (--num-gpu-blocks) for more",
                   pool, blocks, block_size, blocks - admitted, engine.max_model_len, pool)
    return pool


def _blocks_admitting(needed: int, watermark: float) -> int:
    """The smallest pool whose blocks less its watermark (``int(watermark * blocks)``, as the engine keeps it) are
    ``needed`` or more."""
    blocks = needed
    while blocks - int(watermark * blocks) < needed:
        blocks += 1
    return blocks


@dataclass(frozen=True)
class EngineWork:
    prompts: list[list[int]]  # one engine request each; choice i * n + j is sample j of prompt i
    params: SamplingParams
    stop_strings: tuple[str, ...]


def completion_work(request: CompletionRequest, model: ServedModel) -> EngineWork:
    _check_model(request, model)
    check_prompt_count(request.prompt, model.limits)  # again: a request may be built in code, not parsed
    prompts: list[list[int]] = []
    for i, prompt in enumerate(_prompt_list(request.prompt)):
        param = f"prompt[{i}]" if is_batch(request.prompt) else "prompt"
        prompts.append(_prompt_ids(prompt, model, param, spent=sum(len(p) for p in prompts)))
    return _work(request, prompts, request.max_tokens, model)


def chat_work(request: ChatCompletionRequest, model: ServedModel) -> EngineWork:
    _check_model(request, model)
    if model.tokenizer is None or not model.tokenizer.chat_template:
        raise BadRequest(f"the model {model.name!r} has no chat template, so it cannot serve chat completions; "
                         f"use /v1/completions with a plain prompt", param="messages", code="no_chat_template")
    messages = [{**m.model_dump(exclude_none=True), "content": _message_text(m.content, i)}
                for i, m in enumerate(request.messages)]
    try:
        prompt = model.encode_chat(messages)
    except Exception as err:  # a template may raise anything (raise_exception, a missing key)
        raise BadRequest(f"the chat template refused these messages: {err}", param="messages") from None
    prompts = [_prompt_ids(prompt, model, "messages")]
    if request.max_completion_tokens is not None:
        return _work(request, prompts, request.max_completion_tokens, model, max_tokens_name="max_completion_tokens")
    return _work(request, prompts, request.max_tokens, model)


def _check_model(request: SamplingFields, model: ServedModel) -> None:
    if request.model != model.name:
        raise BadRequest(f"the model {request.model!r} is not served here; this server serves {model.name!r} "
                         f"(GET /v1/models lists it)", param="model", code="model_not_found")


def _prompt_list(prompt) -> list:
    if is_batch(prompt):
        return list(prompt)
    return [prompt]


def _message_text(content, index: int) -> str:
    """A message's text: a string, or OpenAI's list of text parts, one per line (as vLLM joins them)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for number, part in enumerate(content):
        if part.get("type") != "text":
            raise BadRequest(f"messages[{index}].content holds a {part.get('type')!r} part; kvlib serves text only",
                             param=f"messages.{index}.content", code="unsupported_content")
        if not isinstance(part.get("text"), str):
            raise BadRequest(f"messages[{index}].content[{number}] is a text part without a 'text' string: give it "
                             f'one, as {{"type": "text", "text": "..."}}', param=f"messages.{index}.content.{number}",
                             code="invalid_value")
        texts.append(part["text"])
    return "\n".join(texts)


def _prompt_ids(prompt, model: ServedModel, param: str, spent: int = 0) -> list[int]:
    """The prompt's token ids, checked; ``spent``: the tokens of the request's prompts before this one."""
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise BadRequest(f"the model {model.name!r} has no tokenizer: send the prompt as a list of token ids",
                             param=param, code="no_tokenizer")
        try:
            prompt = model.encode(prompt)
        except Exception as err:  # the tokenizers library refuses a lone surrogate with a bare exception
            raise BadRequest(f"{param} cannot be tokenized ({err})", param=param) from None
    if not prompt:
        raise BadRequest(f"{param} is empty: give at least one token", param=param, code="empty_prompt")
    total, cap = spent + len(prompt), model.limits.max_prompt_tokens
    if total > cap:  # before the ids are scanned: a prompt of megabytes costs its tokenizing and no more
        raise BadRequest(f"this request's prompts hold {total} tokens or more; this server takes at most {cap} prompt "
                         f"tokens in one request (kvlib serve {LIMIT_FLAGS['max_prompt_tokens']}): send fewer or "
                         f"shorter prompts, or split them over several requests", param=param.split("[")[0],
                         code="too_many_prompt_tokens")
    _check_vocabulary(prompt, model, param)
    return list(prompt)


def _check_vocabulary(token_ids, model: ServedModel, param: str, why: str = "") -> None:
    """:class:`BadRequest` naming the first of ``token_ids`` outside the model's vocabulary, if one is."""
    bad = next((t for t in token_ids if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        raise BadRequest(f"{param} holds token id {bad}, outside the model's vocabulary of {model.vocab_size} "
                         f"(ids 0 to {model.vocab_size - 1}){why}", param=param, code="invalid_token_id")


def _work(request: SamplingFields, prompts: list[list[int]], max_tokens: Optional[int], model: ServedModel,
          max_tokens_name: str = "max_tokens") -> EngineWork:
    """The engine's work, every value checked; errors name the field as the client sent it (``max_tokens_name``)."""
    longest = max(len(p) for p in prompts)
    room = model.max_model_len - longest
    if room < 1:
        raise BadRequest(f"the prompt is {longest} tokens, and this model's context is {model.max_model_len}: "
                         f"there is no room to generate; shorten the prompt", param="prompt",
                         code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = room
    if max_tokens < 1:
        raise BadRequest(f"{max_tokens_name} must be at least 1, got {max_tokens}", param=max_tokens_name)
    if longest + max_tokens > model.max_model_len:
        raise BadRequest(f"this model's context is {model.max_model_len} tokens, but the prompt ({longest} tokens) "
                         f"plus {max_tokens_name} ({max_tokens}) is {longest + max_tokens}; lower {max_tokens_name} "
                         f"to at most {room} or shorten the prompt", param=max_tokens_name,
                         code="context_length_exceeded")
    if not 1 <= request.n <= model.max_num_seqs:
        raise BadRequest(f"n must be from 1 to {model.max_num_seqs} (the server's max_num_seqs: every sample runs in "
                         f"the batch at once), got {request.n}", param="n")
    temperature = 1.0 if request.temperature is None else request.temperature
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise BadRequest(f"temperature must be from 0 (greedy) to {MAX_TEMPERATURE}, got {temperature}",
                         param="temperature")
    top_p = 1.0 if request.top_p is None else request.top_p
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    if request.seed is not None and not 0 <= request.seed < MAX_SEED:
        raise BadRequest(f"seed must be from 0 to 2**64 - 1, got {request.seed}", param="seed")
    stops = request.stop_strings
    if len(stops) > MAX_STOP_STRINGS or not all(stops):
        raise BadRequest(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings, got {request.stop!r}", param="stop")
    if stops and model.tokenizer is None:
        raise BadRequest(f"stop strings are matched in the text, and the model {model.name!r} has no tokenizer to "
                         f"write text: stop on token ids with stop_token_ids instead", param="stop")
    if len(request.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
        raise BadRequest(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(request.stop_token_ids)}",
                         param="stop_token_ids")
    _check_vocabulary(request.stop_token_ids or (), model, "stop_token_ids", ": the model can never produce it")
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, n=request.n,
                                seed=request.seed, stop_token_ids=list(request.stop_token_ids or []),
                                ignore_eos=request.ignore_eos)
    except (TypeError, ValueError) as err:  # what SamplingParams checks beyond the ranges above
        raise BadRequest(str(err)) from None
    return EngineWork(prompts, params, tuple(stops))
