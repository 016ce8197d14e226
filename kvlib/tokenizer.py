"""Text in, token ids out, through a model folder's ``tokenizer.json``.

An instruct model also brings a chat template (``chat_template.jinja`` or the ``chat_template``
of ``tokenizer_config.json``): the exact text layout it was tuned on. A question wrapped in it
gets an answer; the same question as bare text gets a continuation.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional, Sequence

from kvlib.model.config import read_json_object
from kvlib.model.errors import CheckpointError

ChatMessages = Sequence[Mapping[str, str]]  # [{"role": "system" | "user" | "assistant", "content": "..."}]
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    def __init__(self, path: Path, chat_template: Optional[str] = None, special_tokens: Optional[dict] = None,
                 template_source: Optional[Path] = None):
        from tokenizers import Tokenizer as HFTokenizer
        self.path = Path(path)
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as err:  # the tokenizers library raises a bare Exception for every defect
            raise CheckpointError(f"{path} cannot be read by the tokenizers library ({err}); "
                                  f"replace it with the model's own tokenizer.json") from None
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})  # what a template may name: bos_token, eos_token ...
        self._template = _compile(chat_template, template_source or self.path) if chat_template else None

    @classmethod
    def from_folder(cls, folder: Path) -> Optional["Tokenizer"]:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            return None
        config_path, jinja_path = folder / "tokenizer_config.json", folder / "chat_template.jinja"
        config = read_json_object(config_path) if config_path.is_file() else {}
        template, source = _chat_template(config), config_path
        if jinja_path.is_file():  # transformers writes the template here and prefers it
            template, source = jinja_path.read_text(encoding="utf-8"), jinja_path
        special = {key: _token_text(config[key]) for key in SPECIAL_TOKEN_KEYS if config.get(key)}
        return cls(path, template, special, source)

    def encode(self, text: str) -> list[int]:
        _require_unicode(text, "the text")
        return self._tok.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: ChatMessages, add_generation_prompt: bool = True) -> str:
        """The conversation as the text the model was tuned on, ending where the assistant speaks."""
        if self._template is None:
            raise ValueError(f"{self.path.parent} has no chat template (no chat_template in tokenizer_config.json, "
                             f"no chat_template.jinja): pass the prompt as plain text or token ids")
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping) or not {"role", "content"} <= message.keys():
                raise ValueError(f"chat message {index} is {message!r}; each message is a dict with "
                                 f"'role' and 'content', e.g. {{'role': 'user', 'content': 'Hi'}}")
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens)

    def encode_chat(self, messages: ChatMessages, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of :meth:`apply_chat_template`; the template writes any BOS itself, so none is added."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        _require_unicode(text, "the conversation")
        return self._tok.encode(text, add_special_tokens=False).ids


def unicode_problem(text: str, what: str) -> Optional[str]:
    """Why ``text`` cannot be tokenized, or None: a lone surrogate (from ``errors="surrogateescape"`` or a JSON
    ``"\\ud800"`` escape) is no character, and UTF-8, which the tokenizer reads, cannot hold it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return (f"{what} holds a lone surrogate {text[err.start]!r} at character {err.start}, which is not a "
                f"Unicode character and cannot be tokenized; repair the text, e.g. "
                f"text.encode('utf-8', 'replace').decode('utf-8'), or pass token ids")
    return None


def _require_unicode(text: str, what: str) -> None:
    problem = unicode_problem(text, what)
    if problem:
        raise ValueError(problem)


def _chat_template(config: dict) -> Optional[str]:
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one serves chat
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template


def _token_text(token) -> str:
    return token["content"] if isinstance(token, dict) else str(token)


def _compile(template: str, source: Path):
    """Compile as transformers does: sandboxed, trimmed blocks, ``raise_exception`` and ``tojson``."""
    import json

    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except TemplateError as err:
        raise CheckpointError(f"{source}: the chat template is not valid Jinja ({err}); "
                              f"replace it with the model's own") from None
