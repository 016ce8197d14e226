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


def test_the_demo_bar_counts_tokens_and_the_warning_gets_a_line_of_its_own(tmp_path, capsys, monkeypatch):
    """The bar counted finished requests (0% for a minute, a wrong time left), and the oversubscription warning
    was printed onto the bar's line."""
    import logging
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # pytest's capture handlers: as in a shell
    options = DemoOptions(num_requests=10, num_gpu_blocks=16, num_cpu_blocks=64, block_size=8, max_tokens=48,
                          model="default", plot_path=str(tmp_path / "timeline.png"),
                          pool_view_path=str(tmp_path / "pool.png"))
    summary = run_demo(options)
    captured = capsys.readouterr()
    bars = [text for line in captured.err.split("\n") for text in line.split("\r") if "/480" in text]
    assert bars and "tok" in bars[-1] and "480/480" in bars[-1]  # 10 requests x 48 tokens, counted as they come
    assert any(" 0/480" not in text and "/480" in text for text in bars[:-1])  # it moved before the end
    warning = [line for line in (captured.err + captured.out).split("\n") if "oversubscribed" in line]
    assert len(warning) == 1 and warning[0].split("\r")[-1].startswith("the engine is oversubscribed: 1.1 preemptions")
    report = next(line for line in captured.out.splitlines() if "preemptions per finished request" in line)
    final_rate = summary["preemptions_per_finished_request"]
    assert f"request {final_rate:.2f} (at the end; the warning's 1.1 was the rate when it fired: 9 preemptions over " \
           f"the first 8 finished requests" in report


def test_the_demo_report_says_nothing_of_a_warning_that_never_fired(tmp_path, capsys):
    options = DemoOptions(num_requests=6, num_gpu_blocks=16, num_cpu_blocks=24, block_size=8, max_tokens=24,
                          model="default", plot_path=str(tmp_path / "timeline.png"),
                          pool_view_path=str(tmp_path / "pool.png"))
    summary = run_demo(options)
    report = next(line for line in capsys.readouterr().out.splitlines() if "preemptions per finished request" in line)
    assert report.endswith(f"{summary['preemptions_per_finished_request']:.2f} (at the end)")


def _overlaps(ax) -> list:
    """The plotted points (curves and markers) that the axes' legend covers, in display coordinates."""
    import numpy as np
    ax.figure.canvas.draw()
    box = ax.get_legend().get_window_extent()
    covered = []
    for line in ax.get_lines():  # each line drawn as it runs between its points, in its own coordinates
        points = line.get_transform().transform(np.column_stack(line.get_data()))
        between = np.linspace(0, 1, 50)[:, None]
        for start, end in zip(points[:-1], points[1:]):
            covered += [tuple(p) for p in start + between * (end - start) if box.contains(*p)]
    return covered


def test_the_timelines_legend_covers_no_curve_and_its_ticks_count_whole_steps_and_blocks(tmp_path):
    """The legend sat over the curves at the upper right (the pool's size line and a full pool run along the top),
    and the step axis read 2.5, 7.5 ... on a short run."""
    from kvlib import LLM, EngineConfig, SamplingParams
    llm = LLM("default", EngineConfig(block_size=8, num_gpu_blocks=16, num_cpu_blocks=24, preemption_mode="swap"),
              verbose=False)
    llm.generate([[5 + i] * 20 for i in range(6)], SamplingParams(max_tokens=24, ignore_eos=True))
    assert llm.metrics.num_preemptions > 0
    for x in ("step", "seconds"):
        ax = llm.metrics.plot(str(tmp_path / f"timeline-{x}.png"), x=x)
        assert _overlaps(ax) == [], x
        assert all(float(t).is_integer() for t in ax.get_yticks())
    short = LLM("default", EngineConfig(block_size=8, num_gpu_blocks=16), verbose=False)
    short.generate(["The KV cache"], SamplingParams(max_tokens=6))
    ax = short.metrics.plot(str(tmp_path / "short.png"))
    assert all(float(t).is_integer() for t in ax.get_xticks()), list(ax.get_xticks())
