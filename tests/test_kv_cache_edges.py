"""The runner's KV pools on a CPU: exact sizes, the views a step reads, and where each block move is sent.

Pins down a block's bytes, the staging buffer's size at each of its bounds, what torch's pinned
allocator would pin at the edges of a power of two, that a layer's K and V are views of their own
slice of the pool, that every refused copy names what is wrong and writes nothing, and that a move
between a device pool and a host pool goes through the device pool's transfer in the right
direction (here a recording twin on a ``meta`` pool, so no GPU is needed).
"""
import pytest
import torch

from kvlib.runner.kv_cache import (KVCachePool, KVCacheSpec, copy_blocks_between, copy_host_blocks, pinned_zeros,
                                   staging_blocks, torch_pinned_bytes)

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=5, dtype=torch.bfloat16)


def test_a_block_holds_every_layers_k_and_v_for_its_tokens():
    assert SPEC.block_bytes == 3 * 2 * 5 * 2 * 8 * 2 == 960
    assert SPEC.bytes_per_token == 192
    assert KVCacheSpec(1, 1, 1, 1, torch.float32).block_bytes == 8  # one K and one V of 4 bytes


def test_a_pool_is_block_major_and_zeroed():
    pool = KVCachePool(SPEC, 7, "cpu")
    assert pool.num_blocks == 7 and pool.data.shape == (7, 3, 2, 5, 2, 8) and pool.data.dtype == torch.bfloat16
    assert not pool.data.any() and pool.data.is_contiguous()
    assert pool.device == torch.device("cpu") and pool.transfer is None and pool.pinned_bytes == 0
    assert pool.data[0].nbytes == SPEC.block_bytes


def test_each_layers_k_and_v_are_views_of_their_own_slice_of_the_pool():
    pool = KVCachePool(SPEC, 4, "cpu")
    for layer in range(SPEC.num_layers):
        k, v = pool.layer(layer)
        assert k.shape == v.shape == (4, 5, 2, 8)
        k.fill_(layer + 1)
        v.fill_(-(layer + 1))
    for layer in range(SPEC.num_layers):
        assert torch.all(pool.data[:, layer, 0] == layer + 1) and torch.all(pool.data[:, layer, 1] == -(layer + 1))


@pytest.mark.parametrize("nbytes, pinned", [(0, 0), (1, 1), (2, 2), (3, 4), (4096, 4096), (4097, 8192)])
def test_torchs_pinned_allocator_rounds_up_to_a_power_of_two(nbytes, pinned):
    assert torch_pinned_bytes(nbytes) == pinned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_empty_pinned_tensor_pins_nothing_and_asks_cuda_nothing(dtype):
    tensor, pinned = pinned_zeros((0, 3), dtype, cudart=None)
    assert pinned == 0 and tensor.shape == (0, 3) and tensor.dtype == dtype


@pytest.mark.parametrize("num_blocks, expected", [
    (1, 2),        # at least two, whatever the pool
    (100, 100),    # at most the pool
    (1000, 256),   # at most STAGING_BYTES (256 MiB) of 1 MiB blocks
])
def test_the_staging_buffer_is_bounded_on_both_sides(num_blocks, expected):
    mib_block = KVCacheSpec(num_layers=1, num_kv_heads=8, head_dim=1024, block_size=16, dtype=torch.float32)
    assert mib_block.block_bytes == 2**20
    assert staging_blocks(mib_block, num_blocks) == expected
    huge_block = KVCacheSpec(num_layers=1, num_kv_heads=8, head_dim=1024, block_size=16 * 512, dtype=torch.float32)
    assert staging_blocks(huge_block, num_blocks) == 2  # a block of 512 MiB: still two


def test_the_staging_buffer_holds_whole_blocks():
    three_mib_block = KVCacheSpec(num_layers=3, num_kv_heads=8, head_dim=1024, block_size=16, dtype=torch.float32)
    blocks = staging_blocks(three_mib_block, 1000)
    assert blocks == 85 and isinstance(blocks, int)  # 256 MiB // 3 MiB, not 85.33


def filled(num_blocks: int, seed: int) -> KVCachePool:
    pool = KVCachePool(SPEC, num_blocks, "cpu")
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


def test_the_first_id_outside_the_pool_is_named_and_nothing_is_written():
    src, dst = filled(4, 0), filled(4, 1)
    before = dst.data.clone()
    with pytest.raises(IndexError, match=r"^destination block 5 is outside its pool of 4 blocks$"):
        copy_host_blocks(src, dst, [0, 3, 1], [0, 5, 3])
    with pytest.raises(IndexError, match=r"^source block -2 is outside its pool of 4 blocks$"):
        copy_host_blocks(src, dst, [0, -2], [1, 2])
    assert torch.equal(dst.data, before)
    copy_host_blocks(src, dst, [0, 3], [3, 0])  # both ends of the pool are inside it
    assert torch.equal(dst.data[3], src.data[0]) and torch.equal(dst.data[0], src.data[3])


@pytest.mark.parametrize("which", ["src", "dst"])
def test_a_host_copy_refuses_a_pool_that_is_not_one_contiguous_run(which):
    pools = {"src": filled(4, 0), "dst": filled(4, 1)}
    shape = pools[which].data.shape
    pools[which].data = torch.zeros(shape[1], shape[0], *shape[2:], dtype=SPEC.dtype).transpose(0, 1)
    with pytest.raises(ValueError, match=r"both pools' data must be contiguous$"):
        copy_host_blocks(pools["src"], pools["dst"], [0], [1])


def test_a_copy_needs_one_destination_per_source():
    with pytest.raises(ValueError, match=r"^2 source blocks but 1 destination blocks$"):
        copy_blocks_between(filled(4, 0), filled(4, 1), [0, 1], [2])


class RecordingTransfer:
    def __init__(self):
        self.calls = []

    def to_host(self, host, src_ids, dst_ids):
        self.calls.append(("to_host", host, src_ids, dst_ids))

    def to_device(self, host, src_ids, dst_ids):
        self.calls.append(("to_device", host, src_ids, dst_ids))


def test_an_empty_move_does_nothing_whatever_the_pools():
    device, host = KVCachePool(SPEC, 4, "meta"), KVCachePool(SPEC, 4, "cpu")
    device.transfer = RecordingTransfer()
    copy_blocks_between(device, host, [], [])
    copy_blocks_between(KVCachePool(SPEC, 4, "meta"), host, [], [])  # no transfer, yet nothing to refuse
    assert device.transfer.calls == []


def test_a_move_across_the_link_goes_through_the_device_pools_transfer_each_way(monkeypatch):
    device, host = KVCachePool(SPEC, 6, "meta"), KVCachePool(SPEC, 4, "cpu")
    device.transfer = RecordingTransfer()
    pageable = (r"^the host pool is in pageable memory, which the GPU cannot copy to asynchronously: "
                r"create it with KVCachePool\(\.\.\., 'cpu', pin_memory=True\)$")
    with pytest.raises(ValueError, match=pageable):
        copy_blocks_between(device, host, [0], [1])
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    copy_blocks_between(device, host, [5, 0], [1, 3])
    copy_blocks_between(host, device, [2], [4])
    assert [(c[0], c[1] is host.data, c[2], c[3]) for c in device.transfer.calls] == [
        ("to_host", True, [5, 0], [1, 3]), ("to_device", True, [2], [4])]


def test_a_move_needs_one_pool_with_a_transfer_and_one_on_the_host():
    host = KVCachePool(SPEC, 4, "cpu")
    with pytest.raises(ValueError, match=r"^blocks move between a GPU pool and a host pool, not meta and cpu$"):
        copy_blocks_between(KVCachePool(SPEC, 4, "meta"), host, [0], [1])
    with pytest.raises(ValueError, match=r"^blocks move between a GPU pool and a host pool, not cpu and meta$"):
        copy_blocks_between(host, KVCachePool(SPEC, 4, "meta"), [0], [1])
    device, other = KVCachePool(SPEC, 4, "meta"), KVCachePool(SPEC, 4, "meta")
    device.transfer = RecordingTransfer()
    with pytest.raises(ValueError, match=r"^blocks move between a GPU pool and a host pool, not meta and meta$"):
        copy_blocks_between(device, other, [0], [1])
    assert device.transfer.calls == []
