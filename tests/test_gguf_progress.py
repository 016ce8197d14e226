"""Converting a GGUF file shows its progress: a bar over the float32 bytes made, then the file written.

SmolLM2's first use converts 540 MB; a learner must see it move. The GGUF here is the tiny one
that tests/test_model_catalog.py writes from a transformers checkpoint.
"""
import pytest
from safetensors.torch import load_file
from tqdm import tqdm

from kvlib.model import catalog
from test_model_catalog import write_gguf

pytest.importorskip("gguf")


def test_the_conversion_shows_a_bar_that_reaches_the_bytes_it_writes(checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVLIB_CACHE_DIR", str(tmp_path / "cache"))
    folder = catalog.resolve_model_folder(write_gguf(checkpoint("llama-gqa"), tmp_path / "tiny.gguf"))
    err = capsys.readouterr().err
    written = sum(t.nbytes for t in load_file(folder / "model.safetensors").values())
    final = err.replace("\r", "\n").splitlines()
    bars = [line for line in final if line.startswith("dequantizing tiny.gguf")]
    size = tqdm.format_sizeof(written)
    assert bars and "100%" in bars[-1] and f" {size}/{size} " in bars[-1], err
    assert f"writing model.safetensors ({written / 1e6:.0f} MB)" in err


def test_a_second_use_converts_nothing_and_shows_no_bar(checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVLIB_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(checkpoint("llama-gqa"), tmp_path / "tiny.gguf")
    catalog.resolve_model_folder(path)
    capsys.readouterr()
    catalog.resolve_model_folder(path)
    assert "dequantizing" not in capsys.readouterr().err
