"""The block-pool view: the device and host KV pools as grids, watched step by step.

Each square is one block, coloured by the request that holds it: a request's samples share its
colour, a block held by several requests (a shared prefix) is dark, a block only the prefix cache
holds is grey, a free block is white. The number in a square is its reference count. A step's
block moves are drawn on top: a red edge for a copy-on-write destination, an orange one for a
block swapped out or demoted to the host, a green one for a block swapped in or copied back.

``PoolRecorder(llm)`` watches an engine; ``show(recorder)`` plays the steps in a notebook (a
slider-driven animation that works in Jupyter and Colab), ``save(recorder, path)`` writes a GIF,
or a PNG strip of a few steps.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

FREE, CACHED, SHARED = "free", "cached", "shared"


@dataclass
class PoolSnapshot:
    step: int
    device: list[tuple[str, int]]  # per device block: (owner, reference count)
    host: list[tuple[str, int]]
    moves: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # this step's copies, by kind
    running: int = 0
    preempted: int = 0


class PoolRecorder:
    """Keeps a snapshot of both pools after every step of ``llm.engine`` (it wraps ``step``)."""

    def __init__(self, llm, every: int = 1):
        self.engine = llm.engine
        self.every = every
        self.snapshots: list[PoolSnapshot] = [self._snapshot({}, 0)]
        self._steps = 0
        step, execute_moves = self.engine.step, self.engine.runner.execute_moves
        self._moves: dict = {}

        def recording_moves(moves):
            self._moves = {"copy": list(moves.copies), "out": moves.to_host, "in": moves.to_device}
            return execute_moves(moves)

        def recording_step():
            self._moves = {}
            outputs = step()
            self._steps += 1
            if self._steps % self.every == 0:
                self.snapshots.append(self._snapshot(self._moves, self._steps))
            return outputs
        self.engine.runner.execute_moves = recording_moves
        self.engine.step = recording_step

    def _snapshot(self, moves: dict, step: int) -> PoolSnapshot:
        bm, s = self.engine.block_manager, self.engine.scheduler
        device, host = defaultdict(set), defaultdict(set)
        for seq in s.waiting + s.running + s.swapped:
            for block in seq.block_table.blocks:
                device[block].add(seq.request_id)
            for block in seq.host_blocks:
                host[block].add(seq.request_id)
        cached = {e.block_id for e in bm.cache} if bm.cache is not None else set()
        tiered = {e.block_id for e in bm.host_tier} if bm.host_tier is not None else set()
        preempted = sum(1 for seq in s.waiting + s.swapped if seq.num_preemptions)
        return PoolSnapshot(step, _owners(bm.gpu, device, cached), _owners(bm.cpu, host, tiered), moves,
                            len(s.running), preempted)


def _owners(allocator, holders: dict, cached: set) -> list[tuple[str, int]]:
    out = []
    for block in range(allocator.num_blocks):
        requests = holders.get(block, set())
        owner = next(iter(requests)) if len(requests) == 1 else SHARED if requests else (
            CACHED if block in cached else FREE)
        out.append((owner, allocator.ref_count(block)))
    return out


def _colours(snapshots: list[PoolSnapshot]) -> dict[str, tuple]:
    import matplotlib
    palette = matplotlib.colormaps["tab20"]
    owners = dict.fromkeys(o for s in snapshots for o, _ in s.device + s.host if o not in (FREE, CACHED, SHARED))
    colours = {owner: palette(i % 20) for i, owner in enumerate(owners)}
    colours.update({FREE: (1, 1, 1, 1), CACHED: (0.75, 0.75, 0.75, 1), SHARED: (0.2, 0.2, 0.3, 1)})
    return colours


def _marks(moves: dict) -> tuple[dict[int, str], dict[int, str]]:
    """Edge colours for the blocks this step's moves touched, on the device and on the host."""
    device = {dst: "red" for _, dst in moves.get("copy", [])}
    device.update({src: "darkorange" for src, _ in moves.get("out", [])})
    device.update({dst: "green" for _, dst in moves.get("in", [])})
    host = {dst: "darkorange" for _, dst in moves.get("out", [])}
    host.update({src: "green" for src, _ in moves.get("in", [])})
    return device, host


def draw(snapshot: PoolSnapshot, axes, colours: dict, columns: int = 16) -> None:
    """Both pools of one snapshot on two matplotlib axes."""
    from matplotlib.patches import Rectangle
    for ax, blocks, pool, marked in zip(axes, (snapshot.device, snapshot.host), ("device", "host"),
                                        _marks(snapshot.moves)):
        ax.clear()
        rows = max(1, math.ceil(len(blocks) / columns))
        for index, (owner, refs) in enumerate(blocks):
            x, y = index % columns, rows - 1 - index // columns
            edge = marked.get(index)
            ax.add_patch(Rectangle((x, y), 0.92, 0.92, facecolor=colours[owner], edgecolor=edge or "0.6",
                                   linewidth=2.5 if edge else 0.5))
            if refs:
                ax.text(x + 0.46, y + 0.46, str(refs), ha="center", va="center", fontsize=6,
                        color="white" if owner == SHARED else "black")
        ax.set_xlim(0, columns)
        ax.set_ylim(0, rows)
        ax.set_aspect("equal")
        ax.axis("off")
        used = sum(1 for owner, _ in blocks if owner != FREE)
        ax.set_title(f"{pool} pool: {used}/{len(blocks)} blocks held", fontsize=9)
    axes[0].figure.suptitle(f"step {snapshot.step}: {snapshot.running} running, {snapshot.preempted} preempted",
                            fontsize=10)


def legend(fig, colours: dict, max_requests: int = 10) -> None:
    """Which colour is which request, and what the edges mean."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    requests = [o for o in colours if o not in (FREE, CACHED, SHARED)][:max_requests]
    handles = [Patch(facecolor=colours[o], edgecolor="0.6", label=o) for o in requests]
    handles += [Patch(facecolor=colours[SHARED], label="several requests"),
                Patch(facecolor=colours[CACHED], label="prefix cache only"),
                Patch(facecolor=colours[FREE], edgecolor="0.6", label="free")]
    handles += [Line2D([], [], color=c, lw=2.5, label=what) for c, what in
                (("red", "copy-on-write"), ("darkorange", "to the host"), ("green", "back to the device"))]
    fig.legend(handles=handles, loc="lower center", ncol=min(8, len(handles)), fontsize=7, frameon=False)


def _figure(recorder: PoolRecorder, columns: int, colours: dict):
    import matplotlib.pyplot as plt
    first = recorder.snapshots[0]
    rows = max(math.ceil(len(first.device) / columns), math.ceil(len(first.host) / columns), 1)
    fig, axes = plt.subplots(1, 2, figsize=(10, 1.4 + 0.34 * rows))
    legend(fig, colours)
    fig.subplots_adjust(bottom=0.28, top=0.78)
    return fig, axes


def show(recorder: PoolRecorder, columns: int = 16, interval_ms: int = 400):
    """An animation of every recorded step, with play controls and a slider (HTML, for a notebook)."""
    import matplotlib.pyplot as plt
    from IPython.display import HTML
    from matplotlib.animation import FuncAnimation
    colours = _colours(recorder.snapshots)
    fig, axes = _figure(recorder, columns, colours)
    animation = FuncAnimation(fig, lambda i: draw(recorder.snapshots[i], axes, colours, columns),
                              frames=len(recorder.snapshots), interval=interval_ms)
    html = HTML(animation.to_jshtml())
    plt.close(fig)
    return html


def save(recorder: PoolRecorder, path: str, columns: int = 16, steps: Optional[list[int]] = None) -> str:
    """A GIF of every step (``path`` ending .gif), or a PNG strip of ``steps`` (default: up to six spread out)."""
    import matplotlib.pyplot as plt
    colours = _colours(recorder.snapshots)
    if path.endswith(".gif"):
        from matplotlib.animation import FuncAnimation, PillowWriter
        fig, axes = _figure(recorder, columns, colours)
        FuncAnimation(fig, lambda i: draw(recorder.snapshots[i], axes, colours, columns),
                      frames=len(recorder.snapshots)).save(path, writer=PillowWriter(fps=3))
        plt.close(fig)
        return path
    snapshots = recorder.snapshots
    chosen = steps or sorted({round(i * (len(snapshots) - 1) / 5) for i in range(6)})
    fig, grid = plt.subplots(len(chosen), 2, figsize=(10, 0.8 + 1.1 * len(chosen)), squeeze=False)
    for row, index in zip(grid, chosen):
        draw(snapshots[index], row, colours, columns)
        row[0].set_title(f"step {snapshots[index].step}: {row[0].get_title()}", fontsize=8)
        row[1].set_title(row[1].get_title(), fontsize=8)
    fig.suptitle("")
    legend(fig, colours)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
