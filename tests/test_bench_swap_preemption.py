"""The swap and preemption benchmarks report what they measured consistently (no timing thresholds)."""
import pytest
import torch

from kvlib.cli.bench import preemption, swap
from kvlib.core.block_table import blocks_for
from kvlib.model.default import DEFAULT_CONFIG

BLOCK_SIZES = (1, 16, 128)


@pytest.fixture(scope="module")
def swap_rows():
    return swap.run_swap_bench(BLOCK_SIZES, total_mib=1, device="cpu", repeats=1)


def test_swap_has_both_directions_for_every_block_size(swap_rows):
    expected = [(b, d) for b in BLOCK_SIZES for d in ("out", "in")]
    assert [(r["block size"], r["direction"]) for r in swap_rows] == expected
    assert all(r["copied right"] for r in swap_rows)


def test_swap_bytes(swap_rows):
    c = DEFAULT_CONFIG
    per_token = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * 4  # K and V, float32 on a CPU
    for r in swap_rows:
        block_bytes = r["block size"] * per_token
        assert r["block KiB"] * 1024 == block_bytes
        assert r["blocks"] == 2**20 // block_bytes and r["MiB"] * 2**20 == r["blocks"] * block_bytes
        assert r["scattered GB/s"] == pytest.approx(r["scattered blocks/s"] * block_bytes / 1e9)
        assert r["contiguous GB/s"] > 0 and r["% of contiguous"] == pytest.approx(
            100 * r["scattered GB/s"] / r["contiguous GB/s"])


def test_llama_block_is_128_kib_per_token_in_fp16():
    assert swap.block_spec("llama-3-8b", 16, torch.float16).block_bytes == 16 * 128 * 1024


def test_swap_main_prints_a_row_per_block_size_and_direction(capsys):
    assert swap.main(["--block-sizes", "2", "8", "--total-mib", "0.25", "--repeats", "1", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("Swap:") and len(lines) == 3 + 4  # block sizes below 16: no target line


NUM_REQUESTS, SCALE, SEED = 8, 16, 2


@pytest.fixture(scope="module")
def workload():
    return preemption.oversubscribed_workload(NUM_REQUESTS, scale=SCALE, seed=SEED)


@pytest.fixture(scope="module")
def preemption_rows(workload):
    prompts, params = workload
    largest = max(blocks_for(len(p) + s.max_tokens, 16) for p, s in zip(prompts, params))
    return preemption.run_preemption_bench(NUM_REQUESTS, scale=SCALE, num_gpu_blocks=largest + 2, num_cpu_blocks=256,
                                           seed=SEED)


def test_workload_is_seeded_and_scaled(workload):
    prompts, params = workload
    assert preemption.oversubscribed_workload(NUM_REQUESTS, scale=SCALE, seed=SEED) == workload
    assert preemption.oversubscribed_workload(NUM_REQUESTS, scale=SCALE, seed=SEED + 1) != workload
    assert len(prompts) == NUM_REQUESTS and all(3 <= t < 259 for p in prompts for t in p)
    assert all(p.ignore_eos and p.greedy for p in params)
    assert preemption.blocks_needed(prompts, params, 16) == sum(
        -(-(len(p) + s.max_tokens) // 16) for p, s in zip(prompts, params))


def test_a_row_per_mode_after_the_reference(preemption_rows):
    reference, *modes = preemption_rows
    assert reference["preemptions"] == 0 and reference["outputs identical"] is None
    assert [(r["mode"], r["partial"]) for r in modes] == preemption.MODES


def test_outputs_identical_in_every_mode(preemption_rows):
    assert all(r["outputs identical"] is True for r in preemption_rows[1:])


def test_preemption_counts_are_consistent(preemption_rows):
    for r in preemption_rows[1:]:
        assert r["preemptions"] > 0 and r["warned"] in (True, False)
        assert r["by swap"] + r["by recompute"] == r["preemptions"]
        assert r["preemptions/request"] == pytest.approx(r["preemptions"] / NUM_REQUESTS)
        if r["mode"] == "recompute":
            assert r["by swap"] == r["swapped-out blocks"] == 0 and r["recomputed tokens"] > 0
            assert r["swap ms"] == 0 < r["recompute ms"]
        if r["mode"] == "swap":  # the host pool is large enough: no fallback to recompute
            assert r["by recompute"] == r["swap fallbacks"] == r["recomputed tokens"] == 0
            assert r["swapped-out blocks"] > 0 and r["recompute ms"] == 0 < r["swap ms"]
    rows = {(r["mode"], r["partial"]): r for r in preemption_rows[1:]}
    assert rows["swap", True]["swapped-out blocks"] <= rows["swap", False]["swapped-out blocks"]
    assert rows["recompute", True]["recomputed tokens"] <= rows["recompute", False]["recomputed tokens"]


def test_preemption_main_prints_the_table(capsys):
    args = ["--num-requests", "4", "--scale", "16", "--num-gpu-blocks", "12", "--threads", "0"]
    assert preemption.main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("Preemption:") and len(lines) == 3 + 1 + len(preemption.MODES)
