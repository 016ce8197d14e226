"""The built-in default model: a small Llama trained on CPython's own documentation.

It ships inside the package as an ordinary Hugging Face folder (see its README.md), so it needs
no download and goes through exactly the loader a real checkpoint does.
"""
from __future__ import annotations

import json
from pathlib import Path

DEFAULT_MODEL_PATH = Path(__file__).resolve().parents[1] / "assets" / "default-model"
DEFAULT_CONFIG: dict = json.loads((DEFAULT_MODEL_PATH / "config.json").read_text())  # its config.json


def default_model_path() -> Path:
    return DEFAULT_MODEL_PATH
