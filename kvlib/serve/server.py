"""uvicorn around the app: in the foreground (``kvlib serve``), or in a background thread of this process.

The background server is what the tests, ``kvlib bench serve`` and lesson 10 use: it binds its socket
before it starts (port 0 picks a free one, so two never race for a port), and ``engine_loop.call``
lets the caller inspect the engine safely between steps while it serves.
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Optional

import uvicorn

from kvlib.llm import LLM
from kvlib.serve.app import build_app
from kvlib.serve.engine_loop import EngineLoop
from kvlib.serve.limits import RequestLimits

START_TIMEOUT_S = 30.0


class EndingServer(uvicorn.Server):
    """uvicorn's server, which on shutdown (SIGTERM, SIGINT, ``should_exit``) first stops the engine loop: every open
    request ends at once, a stream with an ``error`` event and ``[DONE]``, a whole response with a 503. Only
    then does uvicorn wait for the connections to close, which they now do, well inside its grace period."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop):
        super().__init__(config)
        self.engine_loop = engine_loop

    async def shutdown(self, sockets=None) -> None:
        await asyncio.to_thread(self.engine_loop.stop)
        await super().shutdown(sockets)


def run_server(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve ``app`` (from ``build_app``) until SIGTERM or SIGINT (Ctrl-C), then end the open requests and stop."""
    EndingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5),
                 app.state.engine_loop).run()


class BackgroundServer:
    """``with BackgroundServer(llm, "default") as server:`` serves at ``server.url`` until the block ends."""

    def __init__(self, llm: LLM, model_name: str, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 limits: Optional[RequestLimits] = None):
        self.app = build_app(llm, model_name, limits)
        self.model_name = model_name
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = host, self._socket.getsockname()[1]
        self._server = EndingServer(uvicorn.Config(self.app, log_level=log_level, timeout_graceful_shutdown=5),
                                    self.engine_loop)
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def engine_loop(self) -> EngineLoop:
        return self.app.state.engine_loop

    def start(self) -> "BackgroundServer":
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="kvlib-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start; see the log above")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(START_TIMEOUT_S)
        self._socket.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
