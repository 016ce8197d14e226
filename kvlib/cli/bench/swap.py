"""``kvlib bench swap``: moving N scattered KV blocks against one contiguous copy of the same bytes.

Swap preemption moves a victim's blocks, which sit anywhere in the pool, to the host pool and
back. The engine moves them with ``kvlib.runner.kv_cache.copy_blocks_between``, which this benchmark calls
too; the yardstick is one contiguous ``copy_`` of a run of N blocks: the same bytes, with nothing
to find.

- ``out`` copies device pool -> host pool (swap-out), ``in`` the reverse (swap-in). On a GPU the
  host pool is pinned and the link is PCIe: the blocks go through the pool's staging buffer, one
  gather or scatter on the device and one transfer per run of consecutive host blocks, on the copy
  stream. With ``host blocks`` ``consecutive``, the host ids of a move are one run (what a block
  manager that hands a victim consecutive host blocks would give); ``scattered`` is the worst case.
  On a CPU both pools are host memory: each block is one ``memmove``, read once and written once,
  so the host ids' order does not matter there and only the scattered rows are measured.
- Each row moves ``total_mib`` of KV, so the smaller the block the more blocks: N distinct random
  ids in a pool of 2N blocks, to N distinct ids in another pool of 2N blocks.
- Times are the best of ``repeats`` runs after one warm-up run, the two copies taking turns so
  that load from other processes falls on both alike (the best run is the one least disturbed by
  them); the GPU is synchronized around each run. The
  warm-up's result is checked byte for byte against the source blocks (``copied right``).

``swap_paths_bench`` (for a GPU check) sets the engine's staged path against the same path with its copies
issued to the CUDA runtime (``StagedTransfer(copies="runtime")``) and one kernel moving the scattered blocks
over the pinned host memory directly (``StagedTransfer(direct=True)``), and all against the contiguous copy:
llama-3-8b blocks of 512 KiB and 2 MiB, scattered host blocks, both directions, every path's bytes checked.
"""
from __future__ import annotations

import argparse
from typing import Callable, Optional

import torch

from kvlib.cli.bench.memory import LLAMA3_8B_CONFIG
from kvlib.cli.bench.report import format_table
from kvlib.model.config import ModelConfig
from kvlib.model.default import DEFAULT_CONFIG
from kvlib.runner.block_transfer import StagedTransfer
from kvlib.runner.cost_probe import time_once
from kvlib.runner.device import resolve_device, resolve_dtype
from kvlib.runner.kv_cache import KVCachePool, KVCacheSpec, copy_blocks_between, staging_blocks
from kvlib.runner.streams import HostStreams

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
MODELS = {"default": DEFAULT_CONFIG, "llama-3-8b": LLAMA3_8B_CONFIG}


def block_spec(model: str, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
    """The KV block of ``model`` ("default" or "llama-3-8b") at this block size and dtype."""
    config = ModelConfig.from_dict(MODELS[model])
    return KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, block_size, dtype)


def times_in_turns(fns: list[Callable[[], None]], device: torch.device, repeats: int) -> list[list[float]]:
    """Wall times of each of ``fns``, run in turns so that load from other processes falls on all alike; the
    GPU is waited for before and after each run."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            out.append(time_once(fn, device))
    return times


def measure_swap(spec: KVCacheSpec, num_blocks: int, device: torch.device, repeats: int = 5,
                 seed: int = 0) -> list[dict]:
    """Rows ``out`` and ``in`` (each with scattered and, on a GPU, consecutive host blocks) against one
    contiguous copy."""
    generator = torch.Generator().manual_seed(seed)
    pinned = device.type == "cuda"
    device_pool = KVCachePool(spec, 2 * num_blocks, device)
    host_pool = KVCachePool(spec, 2 * num_blocks, "cpu", pin_memory=pinned)
    for pool in (device_pool, host_pool):
        pool.data.copy_(torch.rand(pool.data.shape, generator=generator).to(spec.dtype))
    rows = []
    host_layouts = ("scattered", "consecutive") if pinned else ("scattered",)
    for direction, src, dst in [("out", device_pool, host_pool), ("in", host_pool, device_pool)]:
        for host_layout in host_layouts:
            device_ids = torch.randperm(2 * num_blocks, generator=generator)[:num_blocks].tolist()
            host_ids = (torch.randperm(2 * num_blocks, generator=generator)[:num_blocks].tolist()
                        if host_layout == "scattered" else list(range(num_blocks // 2, num_blocks // 2 + num_blocks)))
            src_ids, dst_ids = (device_ids, host_ids) if direction == "out" else (host_ids, device_ids)

            def scattered():
                copy_blocks_between(src, dst, src_ids, dst_ids)

            def contiguous():
                dst.data[:num_blocks].copy_(src.data[:num_blocks])

            scattered()  # the warm-up run, checked
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            copied_right = torch.equal(dst.data[dst_ids].cpu(), src.data[src_ids].cpu())
            contiguous()
            scattered_s, contiguous_s = map(min, times_in_turns([scattered, contiguous], device, repeats))
            nbytes = num_blocks * spec.block_bytes
            rows.append({
                "block size": spec.block_size, "block KiB": spec.block_bytes / 1024, "blocks": num_blocks,
                "MiB": nbytes / 2**20, "direction": direction, "host blocks": host_layout,
                "scattered blocks/s": num_blocks / scattered_s, "scattered GB/s": nbytes / scattered_s / 1e9,
                "contiguous GB/s": nbytes / contiguous_s / 1e9, "% of contiguous": 100 * contiguous_s / scattered_s,
                "copied right": copied_right,
            })
    return rows


PATH_BLOCK_SIZES = (4, 16)  # llama-3-8b blocks of 512 KiB and 2 MiB


def moved_right(src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> bool:
    """Whether blocks ``dst_ids`` of ``dst`` hold exactly blocks ``src_ids`` of ``src`` (the GPU waited for)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return torch.equal(dst[dst_ids].cpu(), src[src_ids].cpu())


def measure_swap_paths(spec: KVCacheSpec, num_blocks: int, repeats: int = 9, seed: int = 0,
                       device: torch.device = torch.device("cuda")) -> list[dict]:
    """Scattered blocks both ways between a GPU pool and a pinned host pool, four ways: the staged path (the
    engine's default), the staged path with its copies issued to the CUDA runtime
    (``StagedTransfer(copies="runtime")``, the row's ``runtime`` path), one direct kernel over the pinned memory
    (``StagedTransfer(direct=True)``) and one contiguous copy of the same bytes. One row per direction; each
    path's result is checked byte for byte after its warm-up, into destination blocks zeroed first. A path that
    fails (Triton refusing the pinned pointer, no CUDA runtime library to call) gets its error in the row
    instead of times. ``device``: a GPU's; on a CPU the paths' bookkeeping runs over host memory, for the tests."""
    generator = torch.Generator().manual_seed(seed)
    device_pool = KVCachePool(spec, 2 * num_blocks, device)
    host_pool = KVCachePool(spec, 2 * num_blocks, "cpu", pin_memory=device.type == "cuda")
    for pool in (device_pool, host_pool):
        pool.data.copy_(torch.rand(pool.data.shape, generator=generator).to(spec.dtype))
    staged = device_pool.transfer or StagedTransfer(device_pool.data, HostStreams(), staging_blocks(spec, 2 * num_blocks))
    transfers = {"staged": lambda: staged,
                 "runtime": lambda: StagedTransfer(device_pool.data, staged.streams, 2 * staged.halves[0].shape[0],
                                                   copies="runtime"),
                 "direct": lambda: StagedTransfer(device_pool.data, staged.streams, staging_blocks=2, direct=True)}
    built: dict[str, object] = {}
    for name, build in transfers.items():
        try:
            built[name] = build()
        except Exception as error:  # noqa: BLE001 - a path this machine cannot build is a finding, not a crash
            built[name] = f"{type(error).__name__}: {error}"[:300]
    rows = []
    for direction, src, dst in [("out", device_pool, host_pool), ("in", host_pool, device_pool)]:
        device_ids = torch.randperm(2 * num_blocks, generator=generator)[:num_blocks].tolist()
        host_ids = torch.randperm(2 * num_blocks, generator=generator)[:num_blocks].tolist()
        src_ids, dst_ids = (device_ids, host_ids) if direction == "out" else (host_ids, device_ids)

        def move(transfer: StagedTransfer) -> Callable[[], None]:
            if direction == "out":
                return lambda: transfer.to_host(host_pool.data, device_ids, host_ids)
            return lambda: transfer.to_device(host_pool.data, host_ids, device_ids)

        def contiguous():
            dst.data[:num_blocks].copy_(src.data[:num_blocks])

        nbytes = num_blocks * spec.block_bytes
        row = {"block KiB": spec.block_bytes / 1024, "blocks": num_blocks, "MiB": nbytes / 2**20,
               "direction": direction, "host blocks": "scattered"}
        working = {}
        for name, transfer in built.items():
            if isinstance(transfer, str):
                row[f"{name} error"] = transfer
                continue
            dst.data[dst_ids] = 0
            fn = move(transfer)
            try:
                fn()
            except Exception as error:  # noqa: BLE001 - a path this GPU or Triton refuses is a finding, not a crash
                row[f"{name} error"] = f"{type(error).__name__}: {error}"[:300]
                continue
            row[f"{name} copied right"] = moved_right(src.data, dst.data, src_ids, dst_ids)
            working[name] = fn
        contiguous()
        *path_seconds, contiguous_s = map(min, times_in_turns([*working.values(), contiguous], device, repeats))
        row["contiguous GB/s"] = nbytes / contiguous_s / 1e9
        for name, seconds in zip(working, path_seconds):
            row |= {f"{name} GB/s": nbytes / seconds / 1e9, f"{name} % of contiguous": 100 * contiguous_s / seconds}
        rows.append(row)
    return rows


def swap_paths_bench(block_sizes=PATH_BLOCK_SIZES, total_mib: float = 64, model: str = "llama-3-8b",
                     repeats: int = 9, seed: int = 0) -> list[dict]:
    """``measure_swap_paths`` rows (``out``, ``in``) per block size, each moving ``total_mib`` of KV of ``model``
    in the dtype the engine serves the GPU in; empty without CUDA. One compile (the direct kernel)."""
    if not torch.cuda.is_available():
        return []
    dtype = resolve_dtype("auto", torch.device("cuda"))
    rows = []
    for block_size in block_sizes:
        spec = block_spec(model, block_size, dtype)
        rows += measure_swap_paths(spec, max(1, int(total_mib * 2**20 // spec.block_bytes)), repeats, seed)
    return rows


def run_swap_bench(block_sizes=BLOCK_SIZES, total_mib: float = 64, model: str = "default", device: str = "auto",
                   repeats: int = 5, seed: int = 0) -> list[dict]:
    """Two rows (``out``, ``in``) per block size, each moving ``total_mib`` of KV of ``model``."""
    where = resolve_device(device)
    dtype = resolve_dtype("auto", where)
    rows = []
    for block_size in block_sizes:
        spec = block_spec(model, block_size, dtype)
        num_blocks = max(1, int(total_mib * 2**20 // spec.block_bytes))
        rows += measure_swap(spec, num_blocks, where, repeats, seed)
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The options of ``kvlib bench swap``."""
    parser = argparse.ArgumentParser(prog="kvlib bench swap", description=__doc__.splitlines()[0])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=list(BLOCK_SIZES),
                        help="tokens per block, one pair of rows each")
    parser.add_argument("--total-mib", type=float, default=64, help="KV moved per measurement")
    parser.add_argument("--model", choices=sorted(MODELS), default="default", help="whose KV block shape")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where the device pool lives (auto: a CUDA GPU if there is one)")
    parser.add_argument("--repeats", type=int, default=9, help="timed copies per row; the row gives the best")
    parser.add_argument("--seed", type=int, default=0, help="seed of the KV contents and of which blocks move")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    where = resolve_device(args.device)
    rows = run_swap_bench(args.block_sizes, args.total_mib, args.model, args.device, args.repeats, args.seed)
    link = "device <-> pinned host" if where.type == "cuda" else "host memory <-> host memory (CPU)"
    print(format_table(rows, f"Swap: N scattered blocks vs one contiguous copy, {args.total_mib:g} MiB of "
                             f"{args.model} KV ({resolve_dtype('auto', where)}), {link}, best of {args.repeats}"))
    for label, low_kib, target in [("blocks of 256 KiB and up", 256, 80), ("blocks of 32 KiB", 32, 50)]:
        shares = [r["% of contiguous"] for r in rows if r["host blocks"] == "scattered"
                  and (r["block KiB"] >= low_kib if low_kib == 256 else r["block KiB"] == low_kib)]
        if shares:
            print(f"{label}, scattered both sides: {min(shares):.0f}% to {max(shares):.0f}% of the contiguous copy "
                  f"(target on a CPU: at least {target}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
