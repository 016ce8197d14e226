"""Compile every kernel variant serving can launch before the first request, not in the middle of a step.

Triton compiles a kernel the first time it is launched with a new set of compile-time values
(constexprs, which integer arguments equal 1 or are multiples of 16, which pointers are 16-byte
aligned). A variant first met mid-serving costs that step a second or more. The engine keeps the
set small and fixed (fixed-width block tables, aligned buffers, ``do_not_specialize`` on the
integers that vary from step to step), and this module launches each member once at start-up:

- a mixed step (a decode beside a two-token prefill, given as many blocks as two tokens take at
  the pool's block size, ids wrapped around a smaller pool): the store kernel, the plain decode
  kernel and the prefill kernel;
- one decode step at each context bound the backend declares
  (``capabilities.warm_up_decode_bounds``): for the Triton backend, one per split count a power of
  two apart, the split decode kernel and each width of the merge kernel, with the bound on the
  context length raised so that the split rule picks that count (the contexts themselves are one
  token; splits past them return at once);
- a copy-on-write copy and, when there is a host pool, a block out and back through the staging buffer.

All of it writes only into blocks the engine has not handed out yet. ``tests/test_warm_up.py``
serves a varied workload after it and checks that no launch needed a variant it had not seen.
"""
from __future__ import annotations

from kvlib.runner.kv_cache import copy_blocks_between
from kvlib.runner.step_inputs import Chunk


def prefill_blocks(num_tokens: int, block_size: int, num_blocks: int) -> list[int]:
    """A block table for ``num_tokens`` warm-up tokens: one block per ``block_size`` of them, ids taken in turn
    from a pool of ``num_blocks`` (a pool smaller than the chunk writes its blocks again, which is harmless)."""
    return [i % num_blocks for i in range(-(-num_tokens // block_size))]


def warm_up(runner) -> None:
    """Launch every kernel variant once on the runner's own pools and buffers."""
    block_size = runner.spec.block_size
    two_tokens = prefill_blocks(2, block_size, runner.device_pool.num_blocks)
    mixed = [Chunk([0], 0, [0], sampled=True), Chunk([0, 0], 0, two_tokens, sampled=True)]
    bounds = runner.backend.capabilities.warm_up_decode_bounds
    steps = [(mixed, None)] + [([Chunk([0], 0, [0], sampled=True)], bound) for bound in bounds]
    for chunks, bound in steps:
        inputs = runner.buffers.pack(chunks, max_context_len=bound)
        runner.model(inputs.token_ids, inputs.positions, runner.device_pool, inputs.meta, runner.backend,
                     inputs.logits_rows)
    if runner.device_pool.num_blocks > 1:
        runner.backend.copy_blocks(runner.device_pool.data, [0], [1])
    if runner.host_pool.num_blocks:
        copy_blocks_between(runner.device_pool, runner.host_pool, [0], [0])
        copy_blocks_between(runner.host_pool, runner.device_pool, [0], [0])
