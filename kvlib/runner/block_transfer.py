"""Moving KV blocks between the device pool and pinned host pools at link speed, without the host waiting.

A victim's device blocks sit anywhere in the pool; its host blocks too. Copying them pair by pair
would be one small transfer per block, each paying the link's setup cost. Instead the device side
goes through a persistent staging buffer on the device:

- out (swap-out, demotion): one gather of the blocks into the staging buffer, on the compute stream
  (so nothing the step writes afterwards can overtake it), then one copy per run of consecutive host
  blocks from the staging buffer into the pinned host pool, on the copy stream, overlapping the
  model's work. Pairs are sorted by host block, so a victim whose host blocks are consecutive
  crosses the link in one transfer.
- in (swap-in, promotion): the host runs land in the staging buffer on the copy stream; the compute
  stream waits for them and scatters the blocks into place before the forward pass reads them.

The staging buffer has two halves used in turns, so a move larger than a half gathers the next
chunk while the previous one crosses the link; a half is reused only after the event of its last
reader. Block ids reach the device through a persistent pinned buffer (``PinnedIds``), one upload
per call, as do the runner's copy-on-write ids and forked samples' rows. Nothing here synchronizes
the device: ``streams`` (``kvlib.runner.streams``) orders everything with events.

``direct=True`` selects another path: one kernel (``kvlib.kernels.copy_blocks_across``) reads or writes
the pinned host pool itself, so scattered host blocks cost no copy each, at the price of running on
the compute stream (the model's work waits for the link) and of taking multiprocessors for the
transfer. ``copies="runtime"`` keeps the staged path but issues its copies across the link straight to
the CUDA runtime (``kvlib.runner.runtime_copies``) instead of through torch. The staged path with torch's
copies stays the default; ``kvlib bench swap`` measures all three.
"""
from __future__ import annotations

import torch

from kvlib.runner.runtime_copies import host_memcpy, issue, runtime_memcpy, spans

COPIES = ("torch", "runtime")  # who issues the staged path's copies across the link

OUT, IN = 0, 1  # rows of the id buffers: one per direction, so a swap-in never waits on the swap-out's upload


def host_runs(host_ids: list[int]) -> list[tuple[int, int, int]]:
    """``(first host block, count, index in host_ids)`` of each run of consecutive ids in sorted ``host_ids``."""
    runs = []
    for index, block in enumerate(host_ids):
        if runs and block == runs[-1][0] + runs[-1][1]:
            first, count, at = runs[-1]
            runs[-1] = (first, count + 1, at)
        else:
            runs.append((block, 1, index))
    return runs


class PinnedIds:
    """Rows of int64 ids bound for the device, written into a persistent pinned buffer and uploaded in one
    non-blocking copy per call.

    A device tensor built from a Python list is a blocking copy from pageable memory: the host
    stalls until the device has taken it. Here the host writes the pinned row and the copy is queued
    on the compute stream, ahead of the work that reads it. A row is rewritten only after its last
    upload has left it (an earlier step's, long done). On a CPU the host buffer is the device's.
    """

    def __init__(self, rows: int, width: int, device: torch.device, streams):
        self.streams, self.width = streams, width
        on_host = device.type == "cpu"
        self.host = torch.zeros(rows, width, dtype=torch.int64, pin_memory=not on_host)
        self.host_np = self.host.numpy()
        self.device = self.host if on_host else torch.zeros_like(self.host, device=device)
        self.uploaded = [streams.compute.record() for _ in range(rows)]

    def upload(self, row: int, ids) -> torch.Tensor:
        """``ids`` as a device tensor (a view of the row, valid until the row's next upload)."""
        count = len(ids)
        if count > self.width:
            raise ValueError(f"{count} ids do not fit a row of {self.width}")
        self.uploaded[row].synchronize()
        self.host_np[row, :count] = ids
        if self.device is not self.host:
            with self.streams.compute:
                self.device[row, :count].copy_(self.host[row, :count], non_blocking=True)
            self.uploaded[row] = self.streams.compute.record()
        return self.device[row, :count]


class StagedTransfer:
    """Block moves between one device pool and pinned host pools of the same block shape."""

    def __init__(self, data: torch.Tensor, streams, staging_blocks: int, direct: bool = False, copies: str = "torch"):
        """``data``: the device pool tensor, ``[num_blocks, *block]``; ``staging_blocks``: blocks the buffer holds;
        ``direct``: move blocks with one kernel over the host memory instead; ``copies``: who issues the copies
        across the link, torch or the CUDA runtime (see the module doc)."""
        if staging_blocks < 2:
            raise ValueError(f"the staging buffer needs room for at least 2 blocks (one per half), got {staging_blocks}")
        if copies not in COPIES:
            raise ValueError(f"copies must be one of {COPIES}, got {copies!r}")
        self.memcpy = None  # None: torch issues the copies
        if copies == "runtime":
            self.memcpy = runtime_memcpy() if data.device.type == "cuda" else host_memcpy
            if self.memcpy is None:
                raise RuntimeError("copies='runtime' found no CUDA runtime library to call (libcudart); "
                                   "use copies='torch'")
        self.data = data
        self.streams = streams
        half = 0 if direct else staging_blocks // 2  # the direct path stages nothing
        self.halves = [torch.empty((half, *data.shape[1:]), dtype=data.dtype, device=data.device) for _ in range(2)]
        self.released = [streams.compute.record() for _ in range(2)]  # after each half's last reader
        self.turn = 0
        self.ids = PinnedIds(2, data.shape[0], data.device, streams)
        self.direct = direct
        self.pair_ids = PinnedIds(2, 2 * data.shape[0], data.device, streams) if direct else None

    def to_host(self, host: torch.Tensor, device_ids: list[int], host_ids: list[int]) -> None:
        """Device blocks ``device_ids`` into blocks ``host_ids`` of the pinned host pool tensor ``host``."""
        if self.direct:
            self._move_directly(OUT, self.data, host, device_ids, host_ids)
            return
        compute, copy = self.streams.compute, self.streams.copy
        for ids, staged, host_views, staged_views in self._chunks(OUT, host, host_ids, device_ids):
            compute.wait(self.released[self.turn])
            with compute:
                torch.index_select(self.data, 0, ids, out=staged)
            gathered = compute.record()
            with copy:
                copy.wait(gathered)
                self._across(host_views, staged_views)
                self.released[self.turn] = copy.record()

    def to_device(self, host: torch.Tensor, host_ids: list[int], device_ids: list[int]) -> None:
        """Blocks ``host_ids`` of the pinned host pool tensor ``host`` into device blocks ``device_ids``."""
        if self.direct:
            self._move_directly(IN, host, self.data, host_ids, device_ids)
            return
        compute, copy = self.streams.compute, self.streams.copy
        for ids, staged, host_views, staged_views in self._chunks(IN, host, host_ids, device_ids):
            with copy:
                copy.wait(self.released[self.turn])
                self._across(staged_views, host_views)
                landed = copy.record()
            compute.wait(landed)
            with compute:
                self.data.index_copy_(0, ids, staged)
            self.released[self.turn] = compute.record()

    def _across(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        """Each run of blocks across the link, on the copy stream (the caller entered it)."""
        if self.memcpy is None:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        else:
            issue(self.memcpy, spans(dsts, srcs), self.streams.copy.handle)

    def _move_directly(self, row: int, src: torch.Tensor, dst: torch.Tensor, src_ids: list[int],
                       dst_ids: list[int]) -> None:
        """One kernel on the compute stream: work queued before it wrote the blocks it reads, work queued after
        it (a freed device block's next owner, the forward pass reading moved blocks) sees them moved."""
        from kvlib.kernels import for_device
        count = len(src_ids)
        ids = self.pair_ids.upload(row, [*src_ids, *dst_ids])
        with self.streams.compute:
            for_device(self.data.device).copy_blocks_across(src, dst, ids[:count], ids[count:])

    def _chunks(self, row: int, host: torch.Tensor, host_ids: list[int], device_ids: list[int]):
        """Per chunk of a move, in the staging halves by turns: ``(device ids, the half's rows for them, each run
        of consecutive host blocks as a view of ``host``, the half's matching rows)``.

        The pairs are sorted by host block, so consecutive host blocks cross the link as one run.
        """
        pairs = sorted(zip(host_ids, device_ids))
        ids = self.ids.upload(row, [d for _, d in pairs])
        size = self.halves[0].shape[0]
        for start in range(0, len(pairs), size):
            self.turn = 1 - self.turn
            count = min(size, len(pairs) - start)
            staged = self.halves[self.turn][:count]
            runs = host_runs([h for h, _ in pairs[start:start + count]])
            yield (ids[start:start + count], staged, [host[first:first + n] for first, n, _ in runs],
                   [staged[at:at + n] for _, n, at in runs])
