"""The block-pool view records what the engine holds after every step, and draws it."""
import random
from collections import Counter

import matplotlib
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgba

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.course import pool_view
from kvlib.course.pool_view import CACHED, FREE, SHARED, PoolRecorder, figure, save, show


def test_snapshots_match_the_pools_and_the_moves(checkpoint, tmp_path):
    llm = LLM(checkpoint("llama-gqa"), EngineConfig(block_size=4, num_gpu_blocks=14, num_cpu_blocks=16, watermark=0.0,
                                                    preemption_mode="swap", enable_prefix_caching=True), verbose=False)
    recorder = PoolRecorder(llm)
    system = list(range(10, 26))
    llm.generate([system + [i] for i in range(3)], SamplingParams(max_tokens=12, n=2))
    snapshots = recorder.snapshots
    assert len(snapshots) == llm.metrics.num_steps + 1 and snapshots[0].device == [(FREE, 0)] * 14
    for snap, record in zip(snapshots[1:], llm.metrics.timeline):
        assert sum(1 for owner, refs in snap.device if owner != FREE) == record.gpu_blocks_used
        assert all((refs == 0) == (owner == FREE) for owner, refs in snap.device + snap.host)
    owners = Counter(owner for snap in snapshots for owner, _ in snap.device)
    assert owners[CACHED] and owners[SHARED]  # a shared prefix, then a finished prefix stays cached
    assert any(snap.moves.get("out") for snap in snapshots) and any(snap.moves.get("copy") for snap in snapshots)
    assert snapshots[-1].device.count((FREE, 0)) + sum(1 for o, _ in snapshots[-1].device if o == CACHED) == 14
    recorder.snapshots = snapshots[::4]  # a shorter animation draws faster
    strip, gif = save(recorder, str(tmp_path / "strip.png")), save(recorder, str(tmp_path / "pool.gif"))
    assert (tmp_path / "strip.png").stat().st_size > 10_000 and (tmp_path / "pool.gif").stat().st_size > 10_000
    assert "<script" in show(recorder).data and strip and gif


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 90) for _ in range(n)]  # ids the tiny checkpoint knows


def returning_conversation(checkpoint, **recorder_options):
    """A conversation, traffic that pushes it to the host tier, and the conversation again (lesson 09's run)."""
    llm = LLM(checkpoint("llama-gqa"), EngineConfig(block_size=4, num_gpu_blocks=12, num_cpu_blocks=24, watermark=0.0,
                                                    max_num_seqs=4, enable_prefix_caching=True,
                                                    host_prefix_cache=True), verbose=False)
    rng = random.Random(3)
    conversation = random_tokens(rng, 24)
    recorder = PoolRecorder(llm, highlight_prefix=conversation, **recorder_options)
    reply = llm.generate([conversation], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    llm.generate([random_tokens(rng, 20) for _ in range(4)], SamplingParams(max_tokens=1))
    llm.generate([conversation + reply + random_tokens(rng, 4)], SamplingParams(max_tokens=2))
    assert llm.metrics.prefix_cache_host_hit_tokens == len(conversation)  # it went to the host and came back
    return llm, recorder, conversation


def pool_squares(ax) -> list[tuple]:
    """``(extent on the canvas, line width, face colour)`` of each square of one grid, block 0 first."""
    (squares,) = ax.collections
    faces, widths = squares.get_facecolors(), squares.get_linewidths()
    return [(path.get_extents(squares.get_transform()), widths[i % len(widths)], tuple(faces[i % len(faces)]))
            for i, path in enumerate(squares.get_paths())]


def drawn(fig):
    """``(axes, extent, line width)`` for every square drawn, after drawing the figure."""
    FigureCanvasAgg(fig).draw()
    return [(ax, box, width) for ax in fig.axes for box, width, _ in pool_squares(ax)]


def test_every_square_and_its_edge_lie_inside_their_grid_and_the_figure(checkpoint):
    llm, recorder, _ = returning_conversation(checkpoint)
    fig = figure(recorder, list(range(len(recorder.snapshots))))
    squares = drawn(fig)
    assert len(squares) == len(recorder.snapshots) * (12 + 24)
    for ax, box, width in squares:
        grid = ax.get_window_extent()
        stroke = width * fig.dpi / 72 / 2
        assert (box.x0 - stroke >= grid.x0 and box.x1 + stroke <= grid.x1 and box.y0 - stroke >= grid.y0
                and box.y1 + stroke <= grid.y1), f"a square at {box} is cut by its grid {grid}"
    width, height = fig.bbox.width, fig.bbox.height
    for artist in fig.axes + fig.legends:
        box = artist.get_window_extent()
        assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= width and box.y1 <= height, f"{artist} leaves the figure"


def test_a_view_without_a_host_pool_draws_the_device_pool_alone(checkpoint):
    llm = LLM(checkpoint("llama-gqa"), EngineConfig(block_size=4, num_gpu_blocks=20), verbose=False)
    recorder = PoolRecorder(llm)
    llm.generate([random_tokens(random.Random(0), 9)], SamplingParams(max_tokens=3))
    fig = figure(recorder, [0, len(recorder.snapshots) - 1])
    assert [ax.get_title() for ax in fig.axes] == ["device pool: 0/20 blocks held"] * 2


def square_colours(fig) -> list[tuple]:
    return [face for ax in fig.axes for _, _, face in pool_squares(ax)]


def test_a_highlighted_prefix_keeps_a_colour_of_its_own_on_the_device_in_the_cache_and_on_the_host(checkpoint):
    llm, recorder, conversation = returning_conversation(checkpoint, highlight_label="the conversation")
    full_blocks = len(conversation) // 4
    snapshots = recorder.snapshots
    where = [(len(s.device_highlighted), len(s.host_highlighted),
              sum(s.device[b][0] == CACHED for b in s.device_highlighted)) for s in snapshots]
    assert any(device == full_blocks and cached == 0 for device, _, cached in where)  # held by its request
    assert any(device == full_blocks and cached == full_blocks for device, _, cached in where)  # cache only
    assert any(host == full_blocks and device == 0 for device, host, _ in where)  # only on the host tier
    assert where[-1][0] == full_blocks  # back on the device
    for index, snap in enumerate(snapshots):
        fig = figure(recorder, [index])
        device, host = ([face for _, _, face in pool_squares(ax)] for ax in fig.axes)
        followed = [device[b] for b in snap.device_highlighted] + [host[b] for b in snap.host_highlighted]
        others = [face for pool, marked in ((device, snap.device_highlighted), (host, snap.host_highlighted))
                  for b, face in enumerate(pool) if b not in marked]
        followed_colours = set(followed)
        assert followed_colours <= {to_rgba(pool_view.FIXED[pool_view.HIGHLIGHT]),
                                    to_rgba(pool_view.FIXED[pool_view.HIGHLIGHT_CACHED])}
        assert not followed_colours & set(others), f"step {snap.step}"
    labels = [t.get_text() for t in figure(recorder, [0]).legends[0].get_texts()]
    assert "the conversation" in labels and "the conversation, prefix cache only" in labels


def test_highlighting_a_prefix_needs_the_prefix_cache(checkpoint):
    llm = LLM(checkpoint("llama-gqa"), EngineConfig(block_size=4, num_gpu_blocks=20), verbose=False)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        PoolRecorder(llm, highlight_prefix=[5] * 8)


def test_a_highlighted_request_is_followed_into_the_cache(checkpoint):
    llm = LLM(checkpoint("llama-gqa"), EngineConfig(block_size=4, num_gpu_blocks=20, enable_prefix_caching=True),
              verbose=False)
    recorder = PoolRecorder(llm, highlight=["A"])
    llm.engine.add_request("A", random_tokens(random.Random(1), 12), SamplingParams(max_tokens=2))
    llm.engine.add_request("B", random_tokens(random.Random(2), 12), SamplingParams(max_tokens=2))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    last = recorder.snapshots[-1]
    assert len(last.device_highlighted) == 3 and all(last.device[b][0] == CACHED for b in last.device_highlighted)
    assert sum(owner == CACHED for owner, _ in last.device) == 6  # B's three blocks stay plain grey


def test_the_legend_names_every_colour_drawn_and_every_request_and_says_what_the_numbers_are(checkpoint):
    llm = LLM(checkpoint("llama-gqa"), EngineConfig(block_size=4, num_gpu_blocks=64, max_num_seqs=20), verbose=False)
    recorder = PoolRecorder(llm)
    requests = [f"r{i}" for i in range(20)]  # more requests than the palette has colours
    for request_id in requests:
        llm.engine.add_request(request_id, random_tokens(random.Random(request_id), 6), SamplingParams(max_tokens=2))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    fig = figure(recorder, list(range(len(recorder.snapshots))))
    legend = fig.legends[0]
    named = {to_rgba(handle.get_facecolor()): text.get_text()
             for handle, text in zip(legend.legend_handles, legend.get_texts()) if hasattr(handle, "get_facecolor")}
    assert set(square_colours(fig)) <= set(named), "a colour drawn that the legend does not name"
    assert all(any(r in label.split(", ") for label in named.values()) for r in requests)
    assert any("reference count" in text.get_text() for text in fig.texts)


def test_saving_and_showing_leave_pyplot_and_the_backend_alone(checkpoint, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    llm = LLM(checkpoint("llama-gqa"), EngineConfig(block_size=4, num_gpu_blocks=20, num_cpu_blocks=8), verbose=False)
    recorder = PoolRecorder(llm)
    llm.generate([random_tokens(random.Random(0), 9)], SamplingParams(max_tokens=3))
    backend, open_figures = matplotlib.get_backend(), plt.get_fignums()

    def refuse(*args, **kwargs):
        raise AssertionError("the block-pool view went through pyplot")
    for name in ("figure", "subplots", "close", "switch_backend"):
        monkeypatch.setattr(plt, name, refuse)
    save(recorder, str(tmp_path / "strip.png"))
    save(recorder, str(tmp_path / "pool.gif"))
    show(recorder)
    assert matplotlib.get_backend() == backend and plt.get_fignums() == open_figures
