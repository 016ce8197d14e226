"""The ASGI app: OpenAI's routes over one engine loop.

Nothing slow runs on the event loop (it serves ``/health`` and every open stream): a request is
parsed, checked and tokenized on a worker thread, and a whole response rendered on one; anything
wrong is a 400 in OpenAI's error shape (a 413 for a body over the limit). A request is then
submitted, and answered once the engine has taken it: so a prompt the engine refuses is a 400 too,
even when streaming, since no byte of the stream has gone out yet. From then on, a client that
disconnects aborts its request wherever it is (waiting, running, swapped): a task watches the
connection for the whole life of the request, and the stream's own end aborts whatever still runs.
Every stream ends with ``[DONE]``, after an ``error`` event if the engine failed, the server is
shutting down, or the server's own code failed.
"""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from kvlib.llm import LLM
from kvlib.serve import responses
from kvlib.serve.engine_loop import SHUTTING_DOWN, EngineLoop
from kvlib.serve.generation import EngineFailure, Generation
from kvlib.serve.prometheus import ServerMetrics
from kvlib.serve.limits import LIMIT_FLAGS, RequestLimits
from kvlib.serve.protocol import BadRequest, ChatCompletionRequest, CompletionRequest, SamplingFields, parse_request
from kvlib.serve.requests import ServedModel, chat_work, completion_work

logger = logging.getLogger("kvlib.serve")
CLIENT_GONE = 499  # the status nginx logs for a client that closed the connection first; nobody reads it


def build_app(llm: LLM, model_name: str, limits: Optional[RequestLimits] = None) -> FastAPI:
    """The server's app. Its lifespan starts the engine loop and stops it; ``app.state`` holds the loop and metrics."""
    model = ServedModel.of(llm, model_name, limits)
    metrics = ServerMetrics(model_name)
    loop = EngineLoop(llm, metrics)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        _freeze_heap()
        try:
            yield
        finally:
            await asyncio.to_thread(loop.stop)
            gc.unfreeze()

    app = FastAPI(title="kvlib", description="An OpenAI-compatible server on kvlib's paged-KV engine",
                  lifespan=lifespan)
    app.state.engine_loop, app.state.metrics, app.state.model = loop, metrics, model

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return _error(str(exc.detail), exc.status_code, code="not_found" if exc.status_code == 404 else None)

    @app.get("/health")
    async def health():
        if not loop.alive:
            return _error("the engine loop is not running", 503)
        if loop.last_error and not await _probe(loop):
            return _error(f"the last engine step failed: {loop.last_error}", 503)
        return JSONResponse({"status": "ok"})

    card = {"id": model.name, "object": "model", "created": created, "owned_by": "kvlib", "root": model.name,
            "max_model_len": model.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")  # :path, as a model's name may hold a slash (org/model)
    async def one_model(name: str):
        if name != model.name:
            return _error(f"the model {name!r} is not served here; this server serves {model.name!r}", 404,
                          param="model", code="model_not_found")
        return card

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, loop, model, CompletionRequest, completion_work, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, loop, model, ChatCompletionRequest, chat_work, chat=True)

    return app


def _freeze_heap() -> None:
    """The model's and the libraries' objects live as long as the server, and a full collection walks them all
    holding the GIL, every thread stalled (0.39 s here with the built-in model, triggered by a request's 10,000
    prompts): frozen, collections skip them, as vLLM's server does."""
    gc.collect()
    gc.freeze()


async def _probe(loop: EngineLoop) -> bool:
    """Whether the engine steps again, after a step failed: asked of the loop, so that /health recovers on its own."""
    try:
        return await asyncio.wrap_future(loop.probe())
    except RuntimeError:  # the loop stopped meanwhile
        return False


def _error(message: str, status: int, param=None, code=None) -> JSONResponse:
    return JSONResponse(responses.error_body(message, status, param, code), status_code=status)


async def _serve(request: Request, loop: EngineLoop, model: ServedModel, shape: type[SamplingFields],
                 to_work: Callable, chat: bool) -> Response:
    try:
        raw = await _read_body(request, model.limits.max_body_bytes)
        body, work = await asyncio.to_thread(_checked_work, raw, shape, to_work, model)
    except BadRequest as err:
        return _error(err.message, err.status, err.param, err.code)
    except ClientDisconnect:  # the client left while sending its body: nobody waits for an answer
        return Response(status_code=CLIENT_GONE)
    if not loop.alive:
        return _error(SHUTTING_DOWN, 503)
    gen = Generation(loop, work, model.tokenizer, "chatcmpl" if chat else "cmpl")
    async with _abort_on_disconnect(request, gen):
        refused = await gen.wait_accepted()
    if refused is not None:
        if refused.kind == "closed":
            return Response(status_code=CLIENT_GONE)
        return _error(refused.error, refused.status, "prompt" if refused.status == 400 else None)
    if body.stream:
        return StreamingResponse(_stream(request, gen, body, model.name, chat), media_type="text/event-stream")
    try:
        async with _abort_on_disconnect(request, gen):
            async for _ in gen.updates():
                pass
    except EngineFailure as err:
        return _error(str(err), err.status)
    if any(not c.finished for c in gen.choices):
        return Response(status_code=CLIENT_GONE)
    build = responses.chat_completion if chat else responses.completion
    rendered = await asyncio.to_thread(_render, build, gen, model.name, body.return_token_ids)
    return Response(rendered, media_type="application/json")


def _checked_work(raw: bytes, shape: type[SamplingFields], to_work: Callable, model: ServedModel):
    """Parse, check and tokenize: on a worker thread, so that a body of megabytes never stops the event loop."""
    body = parse_request(raw, shape, model.limits)
    return body, to_work(body, model)


def _render(build: Callable, *args) -> bytes:
    """A whole response as JSON, on a worker thread: 256 prompts x n choices may make megabytes of it."""
    return json.dumps(build(*args), ensure_ascii=False, separators=(",", ":")).encode()


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to be longer than ``limit``: announced so, or sent so."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(f"{int(declared)} bytes", limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(f"over {limit} bytes", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: str, limit: int) -> BadRequest:
    return BadRequest(f"the request body is {size}; this server takes at most {limit} bytes (kvlib serve "
                      f"{LIMIT_FLAGS['max_body_bytes']}): send fewer or shorter prompts, over several requests",
                      code="request_too_large", status=413)


async def _stream(request: Request, gen: Generation, body: SamplingFields, model_name: str, chat: bool):
    """Server-sent events in OpenAI's chunk format; an engine failure is a last ``{"error": ...}`` event."""
    ids = body.return_token_ids
    try:
        async with _abort_on_disconnect(request, gen):
            if chat:
                for index in range(len(gen.choices)):
                    yield responses.sse(responses.chat_chunk(gen, model_name, index, {"role": "assistant", "content": ""},
                                                             None, None))
            async for changed in gen.updates():
                for index in changed:
                    choice = gen.choices[index]
                    text, tokens = choice.take()
                    if not (text or tokens or choice.finished):
                        continue
                    if chat:
                        chunk = responses.chat_chunk(gen, model_name, index, {"content": text} if text else {},
                                                     tokens if ids else None, choice.finish_reason)
                    else:
                        chunk = responses.completion_chunk(gen, model_name, index, text, tokens if ids else None,
                                                           choice.finish_reason)
                    yield responses.sse(chunk)
            if body.stream_options is not None and body.stream_options.include_usage:
                yield responses.sse(responses.usage_chunk(gen, model_name,
                                                          "chat.completion.chunk" if chat else "text_completion"))
    except EngineFailure as err:
        yield responses.sse(responses.error_body(str(err), err.status))
    except Exception as err:  # noqa: BLE001 - a defect of the server's own: the stream still ends with an event
        logger.exception("a stream of %s failed", gen.id)
        yield responses.sse(responses.error_body(f"the server failed: {type(err).__name__}: {err}", 500))
    finally:
        gen.close()
    yield responses.sse("[DONE]")


@asynccontextmanager
async def _abort_on_disconnect(request: Request, gen: Generation):
    """While the block runs, a client that closes its connection closes ``gen``, which aborts its engine requests."""
    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gen.close()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
