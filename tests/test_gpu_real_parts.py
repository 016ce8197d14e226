"""The GPU check's real-shape parts on a CPU: the checkpoints they write, the tokens they compare, the victims
they time and the crossover they report, at a shape a CPU runs in seconds."""
import json

import pytest
import torch

from kvlib import LLM, EngineConfig
from kvlib.cli import gpu_real_parts
from kvlib.cli.gpu_parts import Results
from kvlib.cli.gpu_real_parts import agreeing_prefix, measured_runs_for
from kvlib.cli.gpu_shapes import COMPLETE, SHAPES, shape_folder


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.1-8b", "tiny"])
def test_each_shape_has_exactly_the_weights_transformers_builds_for_its_config(name):
    import transformers
    shape = SHAPES[name]
    config = transformers.LlamaConfig(**{k: v for k, v in shape.config(torch.bfloat16).items()
                                         if k not in ("architectures", "torch_dtype")})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if shape.tie_word_embeddings:
        expected.pop("lm_head.weight")  # the tied head is the embedding, saved once
    assert shape.tensor_shapes() == expected
    assert shape.parameters == sum(v.numel() for k, v in model.state_dict().items() if k in expected)


def test_the_published_sizes():
    assert round(SHAPES["llama-3.2-1b"].parameters / 1e9, 2) == 1.24
    assert round(SHAPES["llama-3.1-8b"].parameters / 1e9, 2) == 8.03
    assert SHAPES["llama-3.1-8b"].kv_bytes_per_token == 128 * 1024  # 32 layers x 8 kv heads x 128 x K and V x 2 B


def test_a_written_checkpoint_loads_in_kvlib_and_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_SHAPES_DIR", str(tmp_path))
    folder = shape_folder("tiny")
    assert (folder / COMPLETE).is_file() and json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"
    written = (folder / "model.safetensors").stat().st_mtime_ns
    assert shape_folder("tiny") == folder and (folder / "model.safetensors").stat().st_mtime_ns == written
    (folder / COMPLETE).unlink()  # a write cut short is written again
    shape_folder("tiny")
    assert (folder / COMPLETE).is_file()
    llm = LLM(folder, EngineConfig(num_gpu_blocks=16), verbose=False)
    assert llm.engine.runner.model.config.num_layers == SHAPES["tiny"].num_hidden_layers
    with pytest.raises(ValueError, match="unknown shape 'llama-70b'; the shapes are llama-3.2-1b"):
        shape_folder("llama-70b")


def test_the_real_tokens_part_compares_with_transformers_on_the_same_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_SHAPES_DIR", str(tmp_path))
    monkeypatch.setattr(gpu_real_parts, "TOKENS_SHAPE", "tiny")
    monkeypatch.setattr(gpu_real_parts, "TOKEN_PROMPT_LENGTHS", (3, 20))
    monkeypatch.setattr(gpu_real_parts, "TOKEN_STEPS", 8)
    out = Results(tmp_path / "r.jsonl", "real-tokens")
    assert gpu_real_parts.part_real_tokens(out) is True
    figures = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert figures[0]["figure"] == "tiny-shaped float32 greedy tokens equal transformers" and figures[0]["value"] is True
    assert figures[0]["agreeing_prefix"] == [8, 8]
    assert 0 <= figures[1]["value"] <= 1 and figures[1]["unit"] == "share of tokens"


def test_the_real_tokens_part_fails_when_kvlib_differs(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_SHAPES_DIR", str(tmp_path))
    monkeypatch.setattr(gpu_real_parts, "TOKENS_SHAPE", "tiny")
    monkeypatch.setattr(gpu_real_parts, "TOKEN_PROMPT_LENGTHS", (3,))
    monkeypatch.setattr(gpu_real_parts, "TOKEN_STEPS", 4)
    real = gpu_real_parts.kvlib_greedy
    monkeypatch.setattr(gpu_real_parts, "kvlib_greedy",
                        lambda *a: [[t + 1 if i == 2 else t for i, t in enumerate(ids)] for ids in real(*a)])
    out = Results(tmp_path / "r.jsonl", "real-tokens")
    assert gpu_real_parts.part_real_tokens(out) is False
    first = json.loads((tmp_path / "r.jsonl").read_text().splitlines()[0])
    assert first["value"] is False and first["agreeing_prefix"] == [2]


def test_agreeing_prefix():
    assert agreeing_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert agreeing_prefix([1, 2], [1, 2]) == 2
    assert agreeing_prefix([5], [1]) == 0


def test_victims_are_timed_alone_and_beside_a_decode_batch(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setenv("KVLIB_SHAPES_DIR", str(tmp_path))
    llm = LLM(shape_folder("tiny"), EngineConfig(block_size=16, num_gpu_blocks=64, num_cpu_blocks=64), verbose=False)
    runner = llm.engine.runner
    alone, beside = measured_runs_for("tiny", runner, None, torch.float32, victim_lengths=[16, 200], contexts=[64],
                                      beside=(4, 48))
    assert (alone.batch, beside.batch) == (0, 4)
    assert "alone" in alone.name and "beside 4 decodes of 48 tokens" in beside.name
    assert alone.model == "tiny-shaped (random float32 weights)"
    for run in (alone, beside):
        assert [(v.num_tokens, v.num_blocks) for v in run.victims] == [(16, 1), (200, 13)]
        assert all(v.recompute_seconds > 0 for v in run.victims)
        assert [r.context for r in run.returning] == [64]
    assert all(v.swap_seconds > 0 for v in alone.victims)  # alone, a swap's time is all its own
    # Beside the batch, every victim carries the run's one noise figure: the spread of identical decode passes.
    assert {v.noise_seconds for v in alone.victims} == {0.0} and len({v.noise_seconds for v in beside.victims}) == 1
    assert beside.victims[0].noise_seconds >= 0


def test_the_engine_part_writes_each_pass_as_it_ends_then_the_ratio(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setenv("KVLIB_SHAPES_DIR", str(tmp_path))
    for name, value in (("REAL_SHAPES", ("tiny",)), ("ENGINE_REQUESTS", 6), ("ENGINE_SCALE", 0.05),
                        ("ENGINE_SLOTS", 512)):
        monkeypatch.setattr(gpu_real_parts, name, value)
    out = Results(tmp_path / "r.jsonl", "real-engine")
    assert gpu_real_parts.part_real_engine(out) is True
    records = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r["kind"] == "progress"]
    assert steps[:2] == ["building kvlib's engine", "loading transformers' model"]  # a cut run says where it was
    stages = [s.split(": ")[1] for s in steps[2:]]
    warm = stages.count("warm-up")  # every engine first, untimed, and not written as a figure
    assert stages == ["warm-up"] * warm + ["round 1"] * warm and warm > 1
    records = [r for r in records if r["kind"] == "figure"]
    passes = [r for r in records if r["figure"] == "engine output tokens/s"]
    assert [r["stage"] for r in passes] == ["round 1"] * len(passes)  # one static row cap: nothing to tune
    assert {r["engine"].split(" ")[0] for r in passes} == {"kvlib", "transformers"}
    assert all(r["ITL p50 s"] is not None and r["value"] > 0 for r in passes)
    (ratio,) = [r for r in records if r["figure"] == "engine"]
    kvlib = next(r["value"] for r in passes if r["engine"].startswith("kvlib"))
    strongest = next(r["value"] for r in passes if r["engine"] == ratio["strongest"] and r["stage"] == "round 1")
    assert ratio["value"] == pytest.approx(kvlib / strongest)


def test_the_preemption_part_writes_each_modes_row_as_its_run_ends(tmp_path, monkeypatch):
    """A mode that fails (here auto's start-up probe) costs only its own row: those before it are written."""
    torch.set_num_threads(1)
    monkeypatch.setenv("KVLIB_SHAPES_DIR", str(tmp_path))
    for name, value in (("REAL_SHAPES", ("tiny",)), ("PREEMPTION_REQUESTS", 6),
                        ("PREEMPTION_MODES", [("recompute", False), ("auto", False)])):
        monkeypatch.setattr(gpu_real_parts, name, value)

    def contradicting(*args, **kwargs):
        raise RuntimeError("the cost probe's timings contradicted each other three times")
    monkeypatch.setattr("kvlib.runner.model_runner.measure_cost_model", contradicting)
    out = Results(tmp_path / "r.jsonl", "preemption")
    with pytest.raises(RuntimeError, match="contradicted"):
        gpu_real_parts.part_preemption(out)
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [(r["mode"], r["value"]) for r in rows] == [("none (pool fits all)", 1.0), ("recompute", rows[1]["value"])]
    assert rows[1]["preemptions"] > 0  # the tight pool did preempt
