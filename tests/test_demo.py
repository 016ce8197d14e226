"""``kvlib demo`` serves its workload, reports preemption and writes its pictures."""
from kvlib.cli.demo import DemoOptions, run_demo


def test_the_demo_preempts_and_writes_its_timeline_and_pool_view(tmp_path, capsys):
    options = DemoOptions(num_requests=6, num_gpu_blocks=16, num_cpu_blocks=24, block_size=8, max_tokens=24,
                          model="default", plot_path=str(tmp_path / "timeline.png"),
                          pool_view_path=str(tmp_path / "pool.png"))
    summary = run_demo(options)
    out = capsys.readouterr().out
    assert summary["num_finished"] == 6 and summary["num_preemptions"] > 0
    assert "preemption report" in out and "sample completions" in out
    assert (tmp_path / "timeline.png").stat().st_size > 0 and (tmp_path / "pool.png").stat().st_size > 0


def test_plotting_the_timeline_to_a_file_leaves_the_backend_and_pyplot_alone(tmp_path):
    """Lesson 00 lost every later plot once the demo saved its timeline: saving switched the backend to Agg."""
    import matplotlib
    import matplotlib.pyplot as plt
    from kvlib import LLM, EngineConfig, SamplingParams
    before = matplotlib.get_backend()
    matplotlib.use("svg")  # a backend of the notebook's own, which saving a file must not replace
    try:
        llm = LLM("default", EngineConfig(block_size=8, num_gpu_blocks=16))
        llm.generate(["The KV cache is"], SamplingParams(max_tokens=4))
        figures = plt.get_fignums()
        llm.metrics.plot(str(tmp_path / "timeline.png"))
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == figures
        assert (tmp_path / "timeline.png").stat().st_size > 0
    finally:
        matplotlib.use(before)


def test_auto_weight_format_is_the_fastest_this_machine_serves(monkeypatch):
    import torch

    from kvlib.cli import demo
    from kvlib.model import weight_formats
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(weight_formats, "bf16_dot_products", lambda: "avx512_bf16")
    assert demo.demo_weight_format("auto", "smollm2-135m") == "bfloat16"
    assert demo.demo_weight_format("auto", "default") == "float32"  # the tiny model's own weights, exact
    assert demo.demo_weight_format("q4_1", "smollm2-135m") == "q4_1"
    monkeypatch.setattr(weight_formats, "bf16_dot_products", lambda: None)
    assert demo.demo_weight_format("auto", "smollm2-135m") == "float32"
    monkeypatch.setattr(weight_formats, "bf16_dot_products", lambda: "avx512_bf16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert demo.demo_weight_format("auto", "smollm2-135m") == "float32"  # a GPU serves its own dtype
