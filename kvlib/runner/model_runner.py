"""The model runner: owns the model, the KV pools and the attention backend, and runs one plan.

For each step it carries out the block moves, packs the scheduled tokens into its persistent input
buffers, runs the forward pass (a decode step on a GPU by replaying a CUDA graph) and samples one
token per draw. It never decides anything: the plan comes from the scheduler, and what the tokens
mean is the scheduler's to record.

On a GPU, before serving, it measures a forward of the largest step to size the pool
(``memory_profile``, when it is built), then, as the engine asks, launches every kernel variant
once (``warm_up_kernels``) and captures the decode graphs (``capture_decode_graphs``). Nothing in a
step synchronizes the device except reading the sampled tokens back, which the scheduler needs:
copy-on-write ids and forked samples' rows go up through pinned buffers (``PinnedIds``), and the
block moves are timed with events read once they are done (``SpanTimer``).
"""
from __future__ import annotations

import torch

from kvlib.core.cost_model import PreemptionCostModel
from kvlib.core.plan import BlockMoves, ScheduledChunk, SchedulerOutput
from kvlib.runner.block_transfer import PinnedIds
from kvlib.runner.cost_probe import measure_cost_model
from kvlib.runner.decode_graphs import CudaGraphCapture, DecodeGraphs, batch_buckets, graph_safe
from kvlib.runner.kv_cache import KVCachePool, KVCacheSpec, copy_blocks_between, copy_blocks_reading_first
from kvlib.runner.memory_profile import device_blocks_that_fit
from kvlib.runner.sampler import Sampler
from kvlib.runner.step_inputs import Chunk, InputBuffers, table_width
from kvlib.runner.streams import HostStreams, SpanTimer, streams_for
from kvlib.runner.warm_up import warm_up

CPU_KV_BUDGET_BYTES = 256 * 2**20  # device pool size on a CPU when num_gpu_blocks is None
COPY_SOURCES, COPY_DESTINATIONS, DRAW_ROWS = range(3)  # rows of the runner's pinned id buffer


def chunk_of(planned: ScheduledChunk) -> Chunk:
    """The packing of a planned chunk: its tokens (sliced without copying the whole token list) and block table."""
    seq, start, end = planned.seq, planned.start, planned.end
    prompt, outputs = seq.prompt_token_ids, seq.output_token_ids
    if end <= len(prompt):
        tokens = prompt[start:end]
    elif start >= len(prompt):
        tokens = outputs[start - len(prompt):end - len(prompt)]
    else:
        tokens = prompt[start:] + outputs[:end - len(prompt)]
    return Chunk(tokens, start, seq.block_table.blocks, sampled=planned.samples)


class ModelRunner:
    def __init__(self, model, backend, *, block_size: int, num_gpu_blocks: int | None, num_cpu_blocks: int,
                 device: torch.device, dtype: torch.dtype, gpu_memory_utilization: float = 0.9,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 4096, max_model_len: int | None = None):
        self.model = model
        self.backend = backend
        self.device = device
        config = model.config
        self.max_model_len = max_model_len or config.max_position_embeddings
        self.spec = KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, block_size, dtype)
        self.buffers = InputBuffers(max(max_num_batched_tokens, max_num_seqs), max_num_seqs,
                                    table_width(self.max_model_len, block_size), device, streams_for(device),
                                    block_size=block_size, sliding_window=config.sliding_window)
        self.sampler = Sampler(max_num_seqs, device)
        self.buckets = batch_buckets(max_num_seqs)
        on_gpu = device.type == "cuda"
        if num_gpu_blocks is None:
            num_gpu_blocks = (device_blocks_that_fit(model, backend, self.spec, self.buffers, gpu_memory_utilization,
                                                     max_num_seqs, self.max_model_len, max(self.buckets)) if on_gpu
                              else max(1, CPU_KV_BUDGET_BYTES // self.spec.block_bytes))
        self.device_pool = KVCachePool(self.spec, num_gpu_blocks, device)
        self.host_pool = KVCachePool(self.spec, num_cpu_blocks, "cpu", pin_memory=on_gpu)
        self.graphs: DecodeGraphs | None = None
        streams = self.device_pool.transfer.streams if self.device_pool.transfer is not None else HostStreams()
        self.ids = PinnedIds(3, max(num_gpu_blocks, max_num_seqs), device, streams)
        self.move_timer = SpanTimer(streams)  # on the pool's own copy stream

    def warm_up_kernels(self) -> None:
        """On a GPU, launch every kernel variant once now, so that none compiles in the middle of a step."""
        if self.device.type == "cuda":
            warm_up(self)

    def capture_decode_graphs(self) -> None:
        """On a GPU, with a backend whose steps can be replayed, record the decode graphs."""
        if self.device.type == "cuda" and graph_safe(self.backend):
            self.set_decode_graphs(CudaGraphCapture(self.device))

    def set_decode_graphs(self, capture) -> None:
        """Replay decode steps from graphs recorded by ``capture`` (``CudaGraphCapture``, or the CPU twin
        ``EagerCapture``); None runs every step eagerly."""
        self.graphs = None  # the old graphs' memory goes back before new ones are recorded
        if capture is not None:
            self.graphs = DecodeGraphs(self.model, self.device_pool, self.backend, self.buffers,
                                       self.max_model_len, self.buckets, capture)

    def measure_cost_model(self) -> PreemptionCostModel:
        return measure_cost_model(self.model, self.device_pool, self.backend)

    def execute_moves(self, moves: BlockMoves) -> float:
        """Carry out a step's block moves in their three phases; returns the seconds the moves took, those
        of this step and earlier ones whose copies are done (``SpanTimer``: on a GPU the copies run on
        after this returns, ordered before anything that reads their blocks, and are timed by events).

        Device to host first, so a device block a swap-out freed or an eviction reclaimed can be reused
        by the later phases; then copy-on-write; then host to device, which may read a host block the first
        phase has just written (a prefix block evicted and wanted again in the same step).
        """
        if moves:
            start = self.move_timer.start()
            if moves.to_host:
                copy_blocks_between(self.device_pool, self.host_pool, *map(list, zip(*moves.to_host)))
            if moves.copies:
                self._copy_on_write(*map(list, zip(*moves.copies)))
            if moves.to_device:
                copy_blocks_between(self.host_pool, self.device_pool, *map(list, zip(*moves.to_device)))
            self.move_timer.stop(start)
        return self.move_timer.settled_seconds()

    def _copy_on_write(self, src: list[int], dst: list[int]) -> None:
        src_ids, dst_ids = self.ids.upload(COPY_SOURCES, src), self.ids.upload(COPY_DESTINATIONS, dst)
        if set(src) & set(dst):  # a source freed and reused in the same step: read all before writing any
            copy_blocks_reading_first(self.device_pool, src_ids, dst_ids)
        else:
            self.backend.copy_blocks(self.device_pool.data, src_ids, dst_ids)

    def forward(self, plan: SchedulerOutput) -> torch.Tensor:
        """Logits ``[sequences completing this step, vocab]``, in plan order."""
        chunks = [chunk_of(planned) for planned in plan.scheduled]
        if self.graphs is not None and len(chunks) <= self.graphs.largest and all(len(c.token_ids) == 1 for c in chunks):
            return self.graphs.run(chunks)
        inputs = self.buffers.pack(chunks)
        return self.model(inputs.token_ids, inputs.positions, self.device_pool, inputs.meta, self.backend,
                          inputs.logits_rows)

    def sample(self, logits: torch.Tensor, plan: SchedulerOutput) -> list[int]:
        """One token per draw of the plan, in its order."""
        if not plan.draws:
            return []
        rows = [row for _, row in plan.draws]
        if rows != list(range(logits.shape[0])):  # forked samples share their parent's row
            logits = logits.index_select(0, self.ids.upload(DRAW_ROWS, rows))
        return self.sampler.sample(logits, [seq for seq, _ in plan.draws])
