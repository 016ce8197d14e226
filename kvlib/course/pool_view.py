"""The block-pool view: the device and host KV pools as grids, watched step by step.

Each square is one block, coloured by the request that holds it: a request's samples share its
colour, a block held by several requests (a shared prefix) is dark, a block only the prefix cache
holds is grey, a free block is white; the legend names every colour a figure uses. The number in
a square is the block's reference count. A step's block moves are drawn on top: a red edge for a
copy-on-write destination, an orange one for a block swapped out or demoted to the host, a green
one for a block swapped in or copied back. The host pool is drawn only where there is one.

``PoolRecorder(llm)`` watches an engine; ``show(recorder)`` plays the steps in a notebook (a
slider-driven animation that works in Jupyter and Colab), ``save(recorder, path)`` writes a GIF,
or a PNG strip of a few steps. ``PoolRecorder(llm, highlight=["A"])`` or
``highlight_prefix=tokens`` follows a request, or a prefix, in a colour of its own, also while
its blocks are kept only by the prefix cache or its host tier, where other traffic turns grey.

Everything is drawn on a ``matplotlib.figure.Figure`` of its own, never through pyplot, so saving
or showing a view leaves a notebook's backend and its open figures as they were.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Optional

FREE, CACHED, SHARED = "free", "cached", "shared"
HIGHLIGHT, HIGHLIGHT_CACHED = "highlight", "highlight, cache only"  # faces of followed blocks

# Hues the move edges (red, orange, green), the prefix cache (grey) and the highlight (magenta) do not
# use, strong ones first, so neighbouring requests differ and an edge never vanishes into a fill
PALETTE = ["#1f77b4", "#9467bd", "#8c564b", "#bcbd22", "#17becf", "#6b6ecf", "#7b4173", "#e7ba52",
           "#aec7e8", "#c5b0d5", "#c49c94", "#dbdb8d", "#9edae5"]
FIXED = {FREE: (1.0, 1.0, 1.0), CACHED: (0.75, 0.75, 0.75), SHARED: (0.2, 0.2, 0.3),
         HIGHLIGHT: (0.93, 0.0, 0.73), HIGHLIGHT_CACHED: (0.98, 0.72, 0.92)}
EDGES = {"copy": ("red", "copy-on-write copy"), "out": ("darkorange", "to the host"),
         "in": ("green", "back to the device")}
CAPTION = ("The number in a square is the block's reference count: one for each sequence that holds it,\n"
           "and one more while the prefix cache (or its host tier) keeps it.")

CELL, MIN_CELL = 0.3, 0.24  # inches: a square at most, and the least at which two grids sit side by side
MAX_WIDTH, MIN_WIDTH = 9.5, 6.5  # inches: the widest figure (a notebook's width), the narrowest
PAD = 0.15  # squares of margin inside each grid's axes, so no square or edge touches the border
SIDE, HEADER, TITLE, GAP, PANEL_GAP = 0.3, 0.3, 0.25, 0.15, 0.5  # inches of the layout
LEGEND_ROW, CAPTION_LINE = 0.21, 0.16


@dataclass
class PoolSnapshot:
    step: int
    device: list[tuple[str, int]]  # per device block: (owner, reference count)
    host: list[tuple[str, int]]
    moves: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # this step's copies, by kind
    running: int = 0
    preempted: int = 0
    device_highlighted: frozenset = frozenset()  # device blocks of what the recorder follows
    host_highlighted: frozenset = frozenset()


class PoolRecorder:
    """Keeps a snapshot of both pools after every step of ``llm.engine`` (it wraps ``step``).

    ``highlight`` (request ids) and ``highlight_prefix`` (token ids) choose what to follow. A
    followed block is recognised by its prefix-cache name, so it keeps the highlight while only
    the cache or the host tier holds it, and when a later request (a returning conversation) takes
    it again. ``highlight_label`` names it in the legend.
    """

    def __init__(self, llm, every: int = 1, *, highlight: Iterable[str] = (),
                 highlight_prefix: Optional[list[int]] = None, highlight_label: Optional[str] = None):
        self.engine = llm.engine
        self.every = every
        self.highlight = set(highlight)
        self.highlight_label = highlight_label or ", ".join(sorted(self.highlight)) or "the highlighted prefix"
        self._followed_names = self._prefix_names(highlight_prefix) if highlight_prefix is not None else set()
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

    def _prefix_names(self, tokens: list[int]) -> set[int]:
        """The prefix cache's names for the full blocks of ``tokens``: how the view recognises them."""
        from kvlib.core.prefix_cache import block_hash
        bm = self.engine.block_manager
        if bm.cache is None:
            raise ValueError("highlight_prefix follows a prefix by its prefix-cache names: build the engine with "
                             "enable_prefix_caching=True, or highlight request ids instead")
        names, name, size = set(), None, bm.block_size
        for start in range(0, len(tokens) - size + 1, size):
            name = block_hash(name, tuple(tokens[start:start + size]))
            names.add(name)
        return names

    def _snapshot(self, moves: dict, step: int) -> PoolSnapshot:
        bm, s = self.engine.block_manager, self.engine.scheduler
        device, host = defaultdict(set), defaultdict(set)
        device_names = {e.block_id: e.name for e in bm.cache} if bm.cache is not None else {}
        host_names = {e.block_id: e.name for e in bm.host_tier} if bm.host_tier is not None else {}
        device_followed, host_followed = set(), set()
        for seq in s.waiting + s.running + s.swapped:
            for block in seq.block_table.blocks:
                device[block].add(seq.request_id)
            for block in seq.host_blocks:
                host[block].add(seq.request_id)
            if seq.request_id in self.highlight:
                device_followed.update(seq.block_table.blocks)
                host_followed.update(seq.host_blocks)
                self._followed_names.update(device_names[b] for b in seq.block_table.blocks if b in device_names)
        device_followed.update(b for b, name in device_names.items() if name in self._followed_names)
        host_followed.update(b for b, name in host_names.items() if name in self._followed_names)
        preempted = sum(1 for seq in s.waiting + s.swapped if seq.num_preemptions)
        return PoolSnapshot(step, _owners(bm.device_pool, device, set(device_names)), _owners(bm.host_pool, host, set(host_names)),
                            moves, len(s.running), preempted, frozenset(device_followed), frozenset(host_followed))


def _owners(allocator, holders: dict, cached: set) -> list[tuple[str, int]]:
    out = []
    for block in range(allocator.num_blocks):
        requests = holders.get(block, set())
        owner = next(iter(requests)) if len(requests) == 1 else SHARED if requests else (
            CACHED if block in cached else FREE)
        out.append((owner, allocator.ref_count(block)))
    return out


def _face(owner: str, highlighted: bool) -> str:
    """What a block's colour stands for: its owner, or the highlight (held, or kept by a cache only)."""
    if not highlighted or owner == FREE:
        return owner
    return HIGHLIGHT_CACHED if owner == CACHED else HIGHLIGHT


def _pools(snapshot: PoolSnapshot):
    """``(name, blocks, highlighted)`` for each pool the engine has: the host pool only where it exists."""
    yield "device", snapshot.device, snapshot.device_highlighted
    if snapshot.host:
        yield "host", snapshot.host, snapshot.host_highlighted


@dataclass
class _Style:
    """The colour of every face a recording uses, and what the legend calls it."""
    colours: dict[str, tuple]
    labels: dict[tuple, str]  # one legend label per colour, naming every request drawn in it
    edges: list[str]  # the kinds of move the recording draws
    cell: float  # inches per square


def _style(recorder: PoolRecorder, cell: float) -> _Style:
    """A colour per request drawn, cycling through the palette, and a legend label per colour."""
    faces = dict.fromkeys(_face(owner, index in followed) for snap in recorder.snapshots
                          for _, blocks, followed in _pools(snap) for index, (owner, _) in enumerate(blocks))
    requests = [face for face in faces if face not in FIXED]
    colours = {request: PALETTE[i % len(PALETTE)] for i, request in enumerate(requests)}
    sharing = defaultdict(list)  # past the palette's length, requests share colours: the label names them all
    for request in requests:
        sharing[colours[request]].append(request)
    labels = {colour: _shorten(group) for colour, group in sharing.items()}
    names = {SHARED: "held by several requests", CACHED: "prefix cache only", FREE: "free",
             HIGHLIGHT: recorder.highlight_label, HIGHLIGHT_CACHED: f"{recorder.highlight_label}, prefix cache only"}
    for face in [face for face in FIXED if face in faces]:
        colours[face] = FIXED[face]
        labels[FIXED[face]] = names[face]
    edges = [kind for kind in EDGES if any(snap.moves.get(kind) for snap in recorder.snapshots)]
    return _Style(colours, labels, edges, cell)


def _shorten(requests: list[str], most: int = 3) -> str:
    shown = ", ".join(requests[:most])
    return shown if len(requests) <= most else f"{shown} +{len(requests) - most} more"


def _marks(moves: dict) -> dict[str, dict[int, str]]:
    """Edge colours for the blocks this step's moves touched, on the device and on the host."""
    device = {dst: EDGES["copy"][0] for _, dst in moves.get("copy", [])}
    device.update({src: EDGES["out"][0] for src, _ in moves.get("out", [])})
    device.update({dst: EDGES["in"][0] for _, dst in moves.get("in", [])})
    host = {dst: EDGES["out"][0] for _, dst in moves.get("out", [])}
    host.update({src: EDGES["in"][0] for src, _ in moves.get("in", [])})
    return {"device": device, "host": host}


@dataclass
class _Frame:
    """One step's row of a figure: its header line and one grid per pool, ``(pool, axes, rows)``."""
    header: object
    panels: list[tuple[str, object, int]]
    columns: int


def _draw_frame(frame: _Frame, snapshot: PoolSnapshot, style: _Style) -> None:
    frame.header.set_text(f"step {snapshot.step}: {snapshot.running} running, {snapshot.preempted} preempted")
    marks = _marks(snapshot.moves)
    pools = {name: (blocks, followed) for name, blocks, followed in _pools(snapshot)}
    for pool, ax, rows in frame.panels:
        blocks, followed = pools[pool]
        _draw_pool(ax, blocks, followed, marks[pool], style, frame.columns, rows)
        used = sum(1 for owner, _ in blocks if owner != FREE)
        ax.set_title(f"{pool} pool: {used}/{len(blocks)} blocks held", fontsize=9)


def _draw_pool(ax, blocks, followed, marked: dict[int, str], style: _Style, columns: int, rows: int) -> None:
    """The pool's squares, block ``i`` the ``i``-th path of one collection: one artist, not one per block, so a
    pool of hundreds of blocks draws in a fraction of the time."""
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle
    ax.clear()
    ax.axis("off")
    ax.set_xlim(-PAD, columns + PAD)
    ax.set_ylim(rows + PAD, -PAD)  # row 0 at the top, read like text
    scale = style.cell / CELL
    squares, faces, edges, widths = [], [], [], []
    for index, (owner, refs) in enumerate(blocks):
        x, y = index % columns + 0.04, index // columns + 0.04
        face = _face(owner, index in followed)
        edge = marked.get(index)
        squares.append(Rectangle((x, y), 0.92, 0.92))
        faces.append(style.colours[face])
        edges.append(edge or "0.6")
        widths.append((2.5 if edge else 0.5) * scale)
        if refs:
            ax.text(x + 0.46, y + 0.46, str(refs), ha="center", va="center", fontsize=7.5 * scale,
                    color="white" if face in (SHARED, HIGHLIGHT) else "black")
    ax.add_collection(PatchCollection(squares, facecolors=faces, edgecolors=edges, linewidths=widths,
                                      joinstyle="miter"), autolim=False)  # square corners, as one patch each had


def _legend(fig, style: _Style, top: float, ncol: int) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    handles = [Patch(facecolor=colour, edgecolor="0.6", label=label) for colour, label in style.labels.items()]
    handles += [Line2D([], [], color=EDGES[kind][0], lw=2.5, label=EDGES[kind][1]) for kind in style.edges]
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, top), ncol=ncol, fontsize=8,
               frameon=False, handlelength=1.6, columnspacing=1.2)


def _legend_shape(style: _Style, width: float) -> tuple[int, int]:
    """``(columns, rows)`` of a legend that fits ``width`` inches, from the longest label."""
    labels = list(style.labels.values()) + [EDGES[kind][1] for kind in style.edges]
    entry = 0.55 + 0.07 * max(len(label) for label in labels)  # inches: handle, gap, text at 8 points
    ncol = max(1, min(len(labels), int((width - 0.4) // entry)))
    return ncol, math.ceil(len(labels) / ncol)


@dataclass
class _Geometry:
    """One frame's layout in inches: the square's size, each pool's grid, and how much room it takes."""
    cell: float
    beside: bool  # the host grid beside the device grid, or below it
    grids: list[tuple[str, int]]  # (pool, rows drawn): grids side by side are drawn equally tall
    width: float  # of the grids together
    height: float  # of a frame: its header, and each grid with its title


def _geometry(first: PoolSnapshot, columns: int) -> _Geometry:
    """Squares of 0.3 inches, smaller where a pool is too wide; two grids side by side while squares stay >= 0.24."""
    rows = [(pool, max(1, math.ceil(len(blocks) / columns))) for pool, blocks, _ in _pools(first)]
    squares = columns + 2 * PAD
    beside = len(rows) == 1 or (MAX_WIDTH - 2 * SIDE - PANEL_GAP) / (2 * squares) >= MIN_CELL
    across = len(rows) if beside else 1
    cell = min(CELL, (MAX_WIDTH - 2 * SIDE - PANEL_GAP * (across - 1)) / (across * squares))
    if beside:
        tallest = max(r for _, r in rows)
        rows = [(pool, tallest) for pool, _ in rows]
        height = HEADER + TITLE + (tallest + 2 * PAD) * cell + GAP
    else:
        height = HEADER + sum(TITLE + (r + 2 * PAD) * cell + GAP for _, r in rows)
    return _Geometry(cell, beside, rows, across * squares * cell + PANEL_GAP * (across - 1), height)


def _place(fig, geometry: _Geometry, top: float, columns: int) -> _Frame:
    """A frame's header and empty grids, ``top`` inches below the figure's top edge."""
    width, height = fig.get_size_inches()
    header = fig.text(0.5, 1 - (top + HEADER / 2) / height, "", ha="center", va="center", fontsize=10)
    x, y, panels = (width - geometry.width) / 2, top + HEADER, []
    for pool, rows in geometry.grids:
        size = ((columns + 2 * PAD) * geometry.cell, (rows + 2 * PAD) * geometry.cell)
        ax = fig.add_axes((x / width, 1 - (y + TITLE + size[1]) / height, size[0] / width, size[1] / height))
        panels.append((pool, ax, rows))
        if geometry.beside:
            x += size[0] + PANEL_GAP
        else:
            y += TITLE + size[1] + GAP
    return _Frame(header, panels, columns)


def figure(recorder: PoolRecorder, indices: list[int], columns: int = 16):
    """A ``Figure`` with one frame per snapshot index, a legend of every colour it uses, and a caption."""
    return _build(recorder, indices, columns)[0]


def _build(recorder: PoolRecorder, indices: list[int], columns: int):
    """``(figure, its frames, the style)``: what ``figure`` draws, and what an animation redraws."""
    from matplotlib.figure import Figure
    geometry = _geometry(recorder.snapshots[0], columns)
    style = _style(recorder, geometry.cell)
    width = max(MIN_WIDTH, geometry.width + 2 * SIDE)
    ncol, legend_rows = _legend_shape(style, width)
    legend_height = LEGEND_ROW * legend_rows + 0.1
    caption_height = CAPTION_LINE * (CAPTION.count("\n") + 1) + 0.1
    frames_height = geometry.height * len(indices)
    height = 0.1 + frames_height + legend_height + caption_height
    fig = Figure(figsize=(width, height), dpi=100)
    frames = [_place(fig, geometry, 0.1 + n * geometry.height, columns) for n in range(len(indices))]
    for frame, index in zip(frames, indices):
        _draw_frame(frame, recorder.snapshots[index], style)
    _legend(fig, style, 1 - (0.1 + frames_height) / height, ncol)
    fig.text(0.5, 1 - (0.1 + frames_height + legend_height) / height, CAPTION, ha="center", va="top",
             fontsize=8, color="0.25")
    return fig, frames, style


def _animation(recorder: PoolRecorder, columns: int, interval_ms: int):
    from matplotlib.animation import FuncAnimation
    fig, (frame,), style = _build(recorder, [0], columns)
    return FuncAnimation(fig, lambda i: _draw_frame(frame, recorder.snapshots[i], style),
                         frames=len(recorder.snapshots), interval=interval_ms)


def show(recorder: PoolRecorder, columns: int = 16, interval_ms: int = 400, progress: bool = True):
    """An animation of every recorded step, with play controls and a slider (HTML, for a notebook).

    ``progress``: a bar over the frames as they are drawn (a large pool takes about a second a frame).
    """
    import tempfile
    from pathlib import Path

    from IPython.display import HTML
    from matplotlib.animation import HTMLWriter

    animation = _animation(recorder, columns, interval_ms)
    bar = None
    if progress:
        from kvlib.course.progress import run_bar
        bar = run_bar(len(recorder.snapshots), "drawing the steps", unit="frame")
    with tempfile.TemporaryDirectory() as folder:  # what Animation.to_jshtml does, with a callback per frame
        path = Path(folder, "pool.html")
        animation.save(str(path), writer=HTMLWriter(fps=1000 / interval_ms, embed_frames=True, default_mode="loop"),
                       progress_callback=None if bar is None else lambda done, total: bar.update(1))
        html = path.read_text()
    if bar is not None:
        bar.close()
    return HTML(html)


def save(recorder: PoolRecorder, path: str, columns: int = 16, steps: Optional[list[int]] = None) -> str:
    """A GIF of every step (``path`` ending .gif), or a PNG strip of ``steps`` (default: up to six spread out)."""
    if path.endswith(".gif"):
        from matplotlib.animation import PillowWriter
        _animation(recorder, columns, 400).save(path, writer=PillowWriter(fps=3))
        return path
    last = len(recorder.snapshots) - 1
    chosen = steps or sorted({round(i * last / 5) for i in range(6)})
    figure(recorder, chosen, columns).savefig(path)
    return path
