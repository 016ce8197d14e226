"""kvlib bench peers times every engine on the same prompts and checks their tokens against kvlib's (no timings)."""
import importlib.util

import pytest

from kvlib.cli.bench import peers

CPUINFO = """processor\t: 0
model name\t: Example CPU 9000
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile
processor\t: 1
model name\t: Example CPU 9000
"""


def test_cpu_description_names_the_model_and_its_isa():
    assert peers.cpu_description(CPUINFO) == {"cpu": "Example CPU 9000", "isa": "avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile"}
    assert peers.cpu_description("") == {"cpu": "unknown", "isa": "none"}


def test_prompts_are_seeded_and_of_the_asked_length():
    a = peers.make_prompts(3, 5, vocab_size=50, seed=1)
    assert a == peers.make_prompts(3, 5, vocab_size=50, seed=1) != peers.make_prompts(3, 5, vocab_size=50, seed=2)
    assert [len(p) for p in a] == [5, 5, 5] and all(3 <= t < 50 for p in a for t in p)


def test_tiny_run_without_onnxruntime_genai(checkpoint, monkeypatch):
    """Without onnxruntime-genai its rows are left out with the message; kvlib and transformers decode the same
    prompts, every engine at every batch, and transformers' fp32 tokens are kvlib's."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(peers.importlib.util, "find_spec",
                        lambda name, *a: None if name == "onnxruntime_genai" else real_find_spec(name, *a))
    opts = peers.PeersOptions(model="tiny", batches=(1, 3), prompt_len=5, new_tokens=6, rounds=2,
                              weight_formats=("float32",))
    engines, missing = peers.build_engines(opts, checkpoint("llama-gqa"))
    assert missing == peers.MISSING_GENAI
    assert [e.name for e in engines] == ["kvlib fp32", "transformers fp32"]
    rows, agree = peers.run_peers(opts, engines)
    assert [(r["batch"], r["engine"]) for r in rows] == [(b, e) for b in (1, 3) for e in ("kvlib fp32", "transformers fp32")]
    for row in rows:
        assert 0 < row["min"] <= row["decode tok/s"] <= row["max"]
        assert row["kvlib fp32 / this"] == pytest.approx(rows[2 * (row["batch"] == 3)]["decode tok/s"] / row["decode tok/s"])
    assert agree == [{"batch": b, "engine": "transformers fp32", "% tokens equal to kvlib fp32": 100.0,
                      "sequences identical": b, "of": b, "median tokens before the first difference": 6}
                     for b in (1, 3)]


def test_decoded_counts_the_tokens_after_the_first():
    decoded = peers.Decoded([[1, 2, 3], [4, 5, 6]], decode_seconds=2.0)
    assert decoded.decode_tokens_per_s() == 2.0
    assert peers.agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 0], [4, 5, 6]]) == pytest.approx(500 / 6)
    assert peers.tokens_before_difference([1, 2, 3, 4], [1, 2, 0, 4]) == 2  # position 3 agrees again: not counted
    assert peers.tokens_before_difference([1, 2], [1, 2]) == 2 and peers.tokens_before_difference([5], [6]) == 0


def test_bad_batches_are_refused(capsys):
    assert peers.main(["--batches", "1,x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


def test_a_failing_model_builder_leaves_its_rows_out_with_its_message(checkpoint, monkeypatch, tmp_path):
    """The builder's own import error (it needs onnx_ir) was a traceback that stopped the whole bench."""
    class Failed:
        returncode, stderr = 1, "Traceback (most recent call last):\nModuleNotFoundError: No module named 'onnx_ir'\n"

    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(peers.subprocess, "run", lambda *a, **k: Failed())
    opts = peers.PeersOptions(model="tiny", batches=(1,), prompt_len=5, new_tokens=6, rounds=1,
                              weight_formats=("float32",), onnx_dir=tmp_path)
    engines, missing = peers.build_engines(opts, checkpoint("llama-gqa"))
    assert [e.name for e in engines] == ["kvlib fp32", "transformers fp32"]
    assert "No module named 'onnx_ir'" in missing and "in fp32" in missing and '.[peers]' in missing
