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
reader. Block ids reach the device through a persistent pinned buffer, one upload per call. Nothing
here synchronizes the device: ``streams`` (``kvlib.runner.streams``) orders everything with events.
"""
from __future__ import annotations

import torch

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


class StagedTransfer:
    """Block moves between one device pool and pinned host pools of the same block shape."""

    def __init__(self, data: torch.Tensor, streams, staging_blocks: int):
        """``data``: the device pool tensor, ``[num_blocks, *block]``; ``staging_blocks``: blocks the buffer holds."""
        if staging_blocks < 2:
            raise ValueError(f"the staging buffer needs room for at least 2 blocks (one per half), got {staging_blocks}")
        self.data = data
        self.streams = streams
        half = staging_blocks // 2
        self.halves = [torch.empty((half, *data.shape[1:]), dtype=data.dtype, device=data.device) for _ in range(2)]
        self.released = [streams.compute.record() for _ in range(2)]  # after each half's last reader
        self.turn = 0
        pinned = data.device.type == "cuda"
        self.ids_host = torch.zeros(2, data.shape[0], dtype=torch.int64, pin_memory=pinned)
        self.ids_device = torch.zeros(2, data.shape[0], dtype=torch.int64, device=data.device)
        self.uploaded = [streams.compute.record() for _ in range(2)]

    @property
    def staging_bytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self.halves)

    def to_host(self, host: torch.Tensor, device_ids: list[int], host_ids: list[int]) -> None:
        """Device blocks ``device_ids`` into blocks ``host_ids`` of the pinned host pool tensor ``host``."""
        compute, copy = self.streams.compute, self.streams.copy
        pairs = sorted(zip(host_ids, device_ids))
        ids = self._upload(OUT, [d for _, d in pairs])
        for start, half in self._chunks(len(pairs)):
            count = min(half.shape[0], len(pairs) - start)
            compute.wait(self.released[self.turn])
            with compute:
                torch.index_select(self.data, 0, ids[start:start + count], out=half[:count])
            gathered = compute.record()
            with copy:
                copy.wait(gathered)
                runs = host_runs([h for h, _ in pairs[start:start + count]])
                torch._foreach_copy_([host[first:first + n] for first, n, _ in runs],
                                     [half[at:at + n] for _, n, at in runs], non_blocking=True)
                self.released[self.turn] = copy.record()

    def to_device(self, host: torch.Tensor, host_ids: list[int], device_ids: list[int]) -> None:
        """Blocks ``host_ids`` of the pinned host pool tensor ``host`` into device blocks ``device_ids``."""
        compute, copy = self.streams.compute, self.streams.copy
        pairs = sorted(zip(host_ids, device_ids))
        ids = self._upload(IN, [d for _, d in pairs])
        for start, half in self._chunks(len(pairs)):
            count = min(half.shape[0], len(pairs) - start)
            with copy:
                copy.wait(self.released[self.turn])
                runs = host_runs([h for h, _ in pairs[start:start + count]])
                torch._foreach_copy_([half[at:at + n] for _, n, at in runs],
                                     [host[first:first + n] for first, n, _ in runs], non_blocking=True)
                landed = copy.record()
            compute.wait(landed)
            with compute:
                self.data.index_copy_(0, ids[start:start + count], half[:count])
            self.released[self.turn] = compute.record()

    def _chunks(self, count: int):
        """``(first pair, staging half)`` of each chunk of a move, the halves taken in turns."""
        for start in range(0, count, self.halves[0].shape[0]):
            self.turn = 1 - self.turn
            yield start, self.halves[self.turn]

    def _upload(self, row: int, ids: list[int]) -> torch.Tensor:
        """``ids`` as a device tensor, through the pinned buffer of one direction (its last upload is long done)."""
        self.uploaded[row].synchronize()
        count = len(ids)
        self.ids_host[row, :count] = torch.tensor(ids, dtype=torch.int64)
        with self.streams.compute:
            self.ids_device[row, :count].copy_(self.ids_host[row, :count], non_blocking=True)
        self.uploaded[row] = self.streams.compute.record()
        return self.ids_device[row, :count]

