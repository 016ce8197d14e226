"""Progress bars for cells and commands that serve for more than a few seconds.

A cell that is silent for a minute cannot be told from a hung one. :class:`TokenProgress` is one
bar over the tokens that the requests of one or more engines generate: it moves from the first
decode step on (a bar over finished requests sits at 0% until the first request ends, and its
estimate of the time left is wrong until then). A request that ends before its ``max_tokens`` (a
stop token, a rejection) has the rest of its budget counted when it ends, so the bar ends full.
While a bar is open, the engine's warnings (the oversubscription warning, say) are printed through
the bar's own writer, on a line of their own, where nothing else would show them.

:func:`run_bar` is a plain bar over whole runs, for a loop that repeats a run a number of times.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from typing import Iterable, Iterator, Optional, Union

from kvlib.config import SamplingParams

NO_WIDGETS = "IProgress not found"  # tqdm's warning where ipywidgets is missing; it falls back to a text bar


def _tqdm():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NO_WIDGETS)
        from tqdm.auto import tqdm
    return tqdm


def run_bar(runs: Union[int, Iterable], desc: str, unit: str = "run"):
    """A bar over a number of runs, or over the items of ``runs`` as a loop takes them (a notebook widget where
    ipywidgets is installed, else text)."""
    if isinstance(runs, int):
        return _tqdm()(total=runs, desc=desc, unit=unit)
    return _tqdm()(runs, desc=desc, unit=unit)


def tokens_of(params: Union[SamplingParams, Iterable[SamplingParams]], count: int = 1) -> int:
    """The most tokens the requests of ``params`` can generate: ``max_tokens`` times ``n`` each (one
    ``SamplingParams`` stands for ``count`` requests)."""
    if isinstance(params, SamplingParams):
        params = [params] * count
    return sum(p.max_tokens * p.n for p in params)


def counting(progress: Union[None, str, "TokenProgress"], llm, params, count: int = 1):
    """A context in which ``llm``'s tokens are counted on ``progress``: a :class:`TokenProgress`, or a
    label for a bar of its own over the tokens of ``params`` (see :func:`tokens_of`), or None for no bar."""
    if progress is None or progress is False:
        return contextlib.nullcontext()
    if isinstance(progress, TokenProgress):
        return progress.follow(llm)
    stack = contextlib.ExitStack()
    bar = stack.enter_context(TokenProgress(tokens_of(params, count), str(progress)))
    stack.enter_context(bar.follow(llm))
    return stack


class TokenProgress:
    """One bar over ``total`` generated tokens, fed by the engines it follows.

    Use it as a context manager; ``follow(llm)`` (itself a context manager) counts the tokens of the
    requests added to ``llm``'s engine while it is open, whoever adds them (``generate``, or a loop of
    ``add_request`` and ``step``).
    """

    def __init__(self, total: int, desc: str = "tokens"):
        self.bar = _tqdm()(total=total, desc=desc, unit="tok")
        self._log_handler: Optional[logging.Handler] = None

    def __enter__(self) -> "TokenProgress":
        logger = logging.getLogger("kvlib")
        if not logger.hasHandlers():  # its warnings would go to stderr through logging's last resort, onto the bar
            self._log_handler = _WriteThrough(self.bar)
            logger.addHandler(self._log_handler)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._log_handler is not None:
            logging.getLogger("kvlib").removeHandler(self._log_handler)
            self._log_handler = None
        self.bar.close()

    @contextlib.contextmanager
    def follow(self, llm) -> Iterator["TokenProgress"]:
        """Count the tokens that requests added to ``llm.engine`` generate while this is open."""
        engine = llm.engine
        own = {name: engine.__dict__.get(name) for name in ("add_request", "step")}  # a recorder's wrapper, say
        add, step = engine.add_request, engine.step
        budgets: dict[str, int] = {}
        counted: dict[str, int] = {}

        def adding(request_id, prompt, params=None, *args, **kwargs):
            add(request_id, prompt, params, *args, **kwargs)
            budgets[request_id] = tokens_of([params or SamplingParams()])

        def stepping(*args, **kwargs):
            outputs = step(*args, **kwargs)
            for out in outputs:
                if out.request_id in budgets:
                    done = (budgets[out.request_id] if out.finished
                            else sum(len(sample.token_ids) for sample in out.samples))
                    more = done - counted.get(out.request_id, 0)
                    if more > 0:
                        counted[out.request_id] = done
                        self.bar.update(more)
            return outputs

        engine.add_request, engine.step = adding, stepping
        try:
            yield self
        finally:
            for name, before in own.items():
                if before is None:
                    delattr(engine, name)
                else:
                    setattr(engine, name, before)


class _WriteThrough(logging.Handler):
    """Prints the engine's warnings with the bar's writer, as logging's last resort would print them."""

    def __init__(self, bar):
        super().__init__(logging.WARNING)
        self.bar = bar

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.bar.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging's own rule: a handler never raises
            self.handleError(record)
