"""Text in, token ids out, through a model folder's ``tokenizer.json``."""
from __future__ import annotations

from pathlib import Path
from typing import Optional


class Tokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HFTokenizer
        self._tok = HFTokenizer.from_file(str(path))

    @classmethod
    def from_folder(cls, folder: Path) -> Optional["Tokenizer"]:
        path = Path(folder) / "tokenizer.json"
        return cls(path) if path.is_file() else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)
