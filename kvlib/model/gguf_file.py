"""Open a GGUF file and read its metadata, with errors that name the file and the key."""
from __future__ import annotations

from pathlib import Path

from kvlib.model.errors import CheckpointError

REQUIRED = object()


def read_gguf(path: Path):
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped: tensors are read when dequantized)."""
    try:
        import gguf
    except ImportError:
        raise ImportError(f"reading {path} needs the gguf package: pip install \"gguf>=0.19\"") from None
    try:
        return gguf.GGUFReader(path)
    except Exception as err:  # the reader raises ValueError, KeyError or struct errors on a damaged file
        raise CheckpointError(f"{path} is not a readable GGUF file ({type(err).__name__}: {err}); "
                              f"it may be truncated: download or copy it again") from None


def metadata(reader, key: str, source: Path, default=REQUIRED):
    """The value stored under ``key``; without a default, a missing key is an error naming it."""
    field = reader.fields.get(key)
    if field is None:
        if default is REQUIRED:
            raise CheckpointError(f"{source} has no {key!r} in its metadata; is it a complete llama GGUF file?")
        return default
    return field.contents()
