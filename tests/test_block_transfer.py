"""Block moves between pools: the host path (one memmove per block) and the GPU's staged path, on its CPU twin.

The staged path runs here over CPU tensors with ``HostStreams`` (every event already happened) to
check the bytes, and with a twin that logs which stream each copy, wait and record happens on, to
check the ordering a GPU relies on: a copy across the link waits for the gather that filled the
staging buffer, the scatter waits for the copy that filled it, and a staging half is written only
after its last reader's event was waited on.
"""
import contextlib
import os

import pytest
import torch

from kvlib.runner.block_transfer import StagedTransfer, host_runs
from kvlib.runner.kv_cache import KVCachePool, KVCacheSpec, copy_blocks_between, copy_host_blocks
from kvlib.runner.streams import HostStreams

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=2, dtype=torch.float32)


def filled_pool(num_blocks: int, seed: int) -> KVCachePool:
    pool = KVCachePool(SPEC, num_blocks, "cpu")
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


def test_host_runs_are_maximal_runs_of_consecutive_blocks():
    assert host_runs([2, 3, 4, 7, 9, 10]) == [(2, 3, 0), (7, 1, 3), (9, 2, 4)]
    assert host_runs([]) == []


def test_host_to_host_copies_each_block_once():
    src, dst = filled_pool(8, 0), filled_pool(8, 1)
    before = dst.data.clone()
    copy_blocks_between(src, dst, [6, 0, 3], [1, 7, 2])
    expected = before.clone()
    expected[[1, 7, 2]] = src.data[[6, 0, 3]]
    assert torch.equal(dst.data, expected)


def test_host_copy_checks_ids_before_writing_anything():
    """memmove checks nothing: an id past the pool must be refused, not written past the tensor's end."""
    src, dst = filled_pool(4, 0), filled_pool(4, 1)
    before = dst.data.clone()
    with pytest.raises(IndexError, match="destination block 4 is outside its pool of 4 blocks"):
        copy_host_blocks(src, dst, [0, 1], [1, 4])
    with pytest.raises(IndexError, match="source block -1"):
        copy_host_blocks(src, dst, [-1], [0])
    assert torch.equal(dst.data, before)


def test_copies_within_one_pool_read_every_source_first():
    pool = filled_pool(6, 0)
    before = pool.data.clone()
    copy_blocks_between(pool, pool, [1, 2], [2, 3])  # block 2 is read, then overwritten
    assert torch.equal(pool.data[2], before[1]) and torch.equal(pool.data[3], before[2])


def test_pools_of_different_blocks_are_refused():
    other = KVCachePool(KVCacheSpec(2, 2, 4, 4, torch.float32), 4, "cpu")
    with pytest.raises(ValueError, match="different blocks"):
        copy_blocks_between(filled_pool(4, 0), other, [0], [0])


@pytest.mark.parametrize("staging_blocks", [2, 5, 64])  # chunked in turns, and all at once
def test_staged_transfer_moves_the_right_bytes(staging_blocks):
    device, host = filled_pool(40, 0), filled_pool(30, 1)
    transfer = StagedTransfer(device.data, HostStreams(), staging_blocks)
    out_device, out_host = [3, 17, 5, 30, 8, 2, 39], [10, 11, 12, 4, 25, 13, 0]  # runs 10-13 and 0
    expected_host = host.data.clone()
    expected_host[out_host] = device.data[out_device]
    transfer.to_host(host.data, out_device, out_host)
    assert torch.equal(host.data, expected_host)
    in_host, in_device = [25, 10, 29, 1], [0, 1, 2, 33]
    expected_device = device.data.clone()
    expected_device[in_device] = host.data[in_host]
    transfer.to_device(host.data, in_host, in_device)
    assert torch.equal(device.data, expected_device)


@pytest.mark.parametrize("staging_blocks", [2, 5, 64])
def test_runtime_copies_move_the_right_bytes(staging_blocks):
    """``copies="runtime"``: the copies across the link are raw byte copies at computed addresses (on a CPU the
    stand-in for ``cudaMemcpyAsync`` moves the bytes at once); the same bytes land as through torch."""
    device, host = filled_pool(40, 0), filled_pool(30, 1)
    transfer = StagedTransfer(device.data, HostStreams(), staging_blocks, copies="runtime")
    out_device, out_host = [3, 17, 5, 30, 8, 2, 39], [10, 11, 12, 4, 25, 13, 0]
    expected_host = host.data.clone()
    expected_host[out_host] = device.data[out_device]
    transfer.to_host(host.data, out_device, out_host)
    assert torch.equal(host.data, expected_host)
    in_host, in_device = [25, 10, 29, 1], [0, 1, 2, 33]
    expected_device = device.data.clone()
    expected_device[in_device] = host.data[in_host]
    transfer.to_device(host.data, in_host, in_device)
    assert torch.equal(device.data, expected_device)


def test_runtime_copies_are_one_per_run_of_host_blocks_on_the_copy_stream():
    device, host = filled_pool(40, 0), filled_pool(30, 1)
    streams = HostStreams()
    streams.copy.handle = 7  # as a CUDA copy stream would be named, apart from the compute stream's 0
    transfer = StagedTransfer(device.data, streams, staging_blocks=64, copies="runtime")
    calls, copy = [], transfer.memcpy

    def logged(dst, src, nbytes, stream):
        calls.append((dst, src, nbytes, stream))
        return copy(dst, src, nbytes, stream)
    transfer.memcpy = logged
    transfer.to_host(host.data, [3, 17, 5, 30, 8, 2, 39], [10, 11, 12, 4, 25, 13, 0])
    block = device.data[0].numel() * device.data.element_size()
    staged = transfer.halves[transfer.turn].data_ptr()
    # sorted by host block: 0 | 4 | 10-13 | 25, staged in that order
    assert calls == [(host.data[0].data_ptr(), staged, block, 7), (host.data[4].data_ptr(), staged + block, block, 7),
                     (host.data[10].data_ptr(), staged + 2 * block, 4 * block, 7),
                     (host.data[25].data_ptr(), staged + 6 * block, block, 7)]


def test_runtime_copies_refuse_what_is_not_one_run_of_bytes_and_report_a_refused_copy():
    from kvlib.runner.runtime_copies import issue, spans
    a, b = torch.zeros(4, 4), torch.zeros(4, 4)
    with pytest.raises(ValueError, match="contiguous"):
        spans([a[:, :2]], [b[:, :2]])
    with pytest.raises(ValueError, match="cannot copy"):
        spans([a], [b[:2]])
    with pytest.raises(ValueError, match="1 destinations for 2 sources"):
        spans([a], [a, b])
    with pytest.raises(RuntimeError, match="failed with CUDA error 700"):
        issue(lambda dst, src, nbytes, stream: 700, spans([a], [b]), 0)
    with pytest.raises(ValueError, match="copies must be one of"):
        StagedTransfer(a, HostStreams(), 2, copies="memcpy")


def test_the_runtime_is_looked_up_among_the_libraries_this_process_loaded():
    from kvlib.runner.runtime_copies import _loaded
    path = _loaded("libc.so")
    assert path is not None and os.path.exists(path) and "libc.so" in os.path.basename(path)
    assert _loaded("libkvlib-nothing.so") is None


def test_the_runtime_is_found_by_its_file_name_not_a_folder_named_like_it(monkeypatch):
    """pip's CUDA wheels keep the runtime in folders of their own: only the file's name counts."""
    import io

    from kvlib.runner import runtime_copies
    maps = ("7f00-7f10 r-xp 00000000 08:01 11 /opt/libcudart.so.12-extras/lib/libnvrtc.so.12\n"
            "7f10-7f20 r-xp 00000000 08:01 12 /venv/nvidia/cuda_runtime/lib/libcudart.so.12\n")
    monkeypatch.setattr(runtime_copies, "open", lambda path: io.StringIO(maps), raising=False)
    assert runtime_copies._loaded("libcudart.so") == "/venv/nvidia/cuda_runtime/lib/libcudart.so.12"


def test_direct_transfer_moves_the_right_bytes():
    """``direct=True``: one kernel per move (the Triton kernel, interpreted on CPU tensors) instead of the staging
    buffer; the same bytes land, scattered host blocks and all."""
    pytest.importorskip("triton")
    device, host = filled_pool(40, 0), filled_pool(30, 1)
    transfer = StagedTransfer(device.data, HostStreams(), staging_blocks=2, direct=True)
    assert [half.shape[0] for half in transfer.halves] == [0, 0]  # no device memory for a buffer it never uses
    out_device, out_host = [3, 17, 5, 30, 8, 2, 39], [10, 11, 12, 4, 25, 13, 0]
    expected_host = host.data.clone()
    expected_host[out_host] = device.data[out_device]
    transfer.to_host(host.data, out_device, out_host)
    assert torch.equal(host.data, expected_host)
    in_host, in_device = [25, 10, 29, 1], [0, 1, 2, 33]
    expected_device = device.data.clone()
    expected_device[in_device] = host.data[in_host]
    transfer.to_device(host.data, in_host, in_device)
    assert torch.equal(device.data, expected_device)


class LoggingStreams:
    """A twin that logs every copy, wait and record with the stream it is issued on."""

    def __init__(self):
        self.log: list[tuple] = []
        self.active = "host"
        self.compute = self.Stream(self, "compute")
        self.copy = self.Stream(self, "copy")

    class Stream:
        def __init__(self, owner, name):
            self.owner, self.name = owner, name

        def __enter__(self):
            self.outer, self.owner.active = self.owner.active, self.name

        def __exit__(self, *exc):
            self.owner.active = self.outer

        def record(self):
            event = ("event", len(self.owner.log))
            self.owner.log.append((self.name, "record", event))
            return LoggedEvent(self.owner, event)

        def wait(self, event):
            self.owner.log.append((self.name, "wait", event.name))


class LoggedEvent:
    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def synchronize(self):
        self.owner.log.append(("host", "synchronize", self.name))


@contextlib.contextmanager
def logging_copies(streams: LoggingStreams, transfer: StagedTransfer):
    """Log the transfer's data movements, naming the staging half each reads or writes."""
    def half_of(tensor):
        for index, half in enumerate(transfer.halves):
            if tensor.untyped_storage().data_ptr() == half.untyped_storage().data_ptr():
                return index
        return None

    real_select, real_foreach, real_index_copy = torch.index_select, torch._foreach_copy_, torch.Tensor.index_copy_

    def index_select(data, dim, index, out):
        streams.log.append((streams.active, "gather into", half_of(out)))
        return real_select(data, dim, index, out=out)

    def foreach_copy(dsts, srcs, non_blocking=False):
        into = half_of(dsts[0])
        streams.log.append((streams.active, "link into" if into is not None else "link from", into
                            if into is not None else half_of(srcs[0])))
        return real_foreach(dsts, srcs, non_blocking=non_blocking)

    def index_copy(self, dim, index, source):
        streams.log.append((streams.active, "scatter from", half_of(source)))
        return real_index_copy(self, dim, index, source)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "index_select", index_select)
        patch.setattr(torch, "_foreach_copy_", foreach_copy)
        patch.setattr(torch.Tensor, "index_copy_", index_copy)
        yield


def waited_before(log, position, stream, event) -> bool:
    return any(entry == (stream, "wait", event) for entry in log[:position])


def test_staged_transfer_orders_its_copies_with_events():
    device, host = filled_pool(40, 0), filled_pool(40, 1)
    streams = LoggingStreams()
    transfer = StagedTransfer(device.data, streams, staging_blocks=4)  # halves of 2: 5 blocks take 3 chunks
    start = len(streams.log)
    with logging_copies(streams, transfer):
        transfer.to_host(host.data, [1, 2, 3, 4, 5], [9, 8, 7, 6, 5])
        transfer.to_device(host.data, [5, 6, 7, 8, 9], [11, 12, 13, 14, 15])
    log = streams.log[start:]
    last_release = {}  # staging half -> event of its last reader
    for position, (stream, op, arg) in enumerate(log):
        if op in ("gather into", "link into"):  # writes a half: its last reader must be waited for on this stream
            assert arg not in last_release or waited_before(log, position, stream, last_release[arg]), log[position]
        if op == "link from":  # the copy across the link waits for the gather, on the copy stream
            gather = max(i for i in range(position) if log[i][1] == "gather into")
            assert log[gather][0] == "compute" and stream == "copy"
            assert waited_before(log, position, "copy", log[gather + 1][2])
        if op == "scatter from":  # the scatter waits for the copy that filled the half, on the compute stream
            link = max(i for i in range(position) if log[i][1] == "link into")
            assert stream == "compute" and waited_before(log, position, "compute", log[link + 1][2])
        if op == "record":
            previous = [entry for entry in log[:position] if entry[1] in ("gather into", "link into", "link from",
                                                                           "scatter from")]
            if previous and previous[-1][0] == stream:
                last_release[previous[-1][2]] = arg
    assert [op for _, op, _ in log if op in ("gather into", "link from")].count("link from") == 3
    assert [op for _, op, _ in log].count("scatter from") == 3
    host_waits = [arg for stream, op, arg in log if op == "synchronize"]
    recorded_here = {arg for _, op, arg in log if op == "record"}
    assert not set(host_waits) & recorded_here, "the host waited on work it had just issued"


def test_the_swap_paths_bench_moves_every_path_right():
    """``kvlib bench swap``'s comparison of the paths, run over host memory: each path's bytes land where they
    should and each gets its times; a path that cannot be built gets its error instead."""
    pytest.importorskip("triton")
    from kvlib.cli.bench.swap import measure_swap_paths
    rows = measure_swap_paths(SPEC, num_blocks=6, repeats=2, device=torch.device("cpu"))
    assert [row["direction"] for row in rows] == ["out", "in"]
    for row in rows:
        assert all(row[f"{path} copied right"] for path in ("staged", "runtime", "direct")), row
        assert all(row[f"{path} GB/s"] > 0 for path in ("staged", "runtime", "direct", "contiguous"))


def test_a_swap_path_that_cannot_be_built_reports_why(monkeypatch):
    pytest.importorskip("triton")
    from kvlib.cli.bench import swap
    real = swap.StagedTransfer

    def without_a_runtime(*args, copies="torch", **kwargs):
        if copies == "runtime":
            raise RuntimeError("copies='runtime' found no CUDA runtime library to call (libcudart)")
        return real(*args, copies=copies, **kwargs)
    monkeypatch.setattr(swap, "StagedTransfer", without_a_runtime)
    out, back = swap.measure_swap_paths(SPEC, num_blocks=4, repeats=1, device=torch.device("cpu"))
    for row in (out, back):
        assert row["runtime error"].startswith("RuntimeError: copies='runtime' found no CUDA runtime")
        assert "runtime GB/s" not in row and row["staged copied right"] and row["direct copied right"]
