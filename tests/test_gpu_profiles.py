"""GPU profiles: published figures with their sources, turned into the cost model by hand-checked arithmetic."""
import pytest

from kvlib.cli.bench.memory import LLAMA3_8B_CONFIG
from kvlib.course.gpu_profiles import GPUProfile, ModelShape, load_profiles
from kvlib.model.config import ModelConfig

LLAMA3_8B = ModelShape.from_config(ModelConfig.from_dict(LLAMA3_8B_CONFIG))


def test_every_profile_names_its_sources_and_every_assumption_says_why():
    profiles, assumptions = load_profiles()
    assert {p.name.split()[0] for p in profiles} >= {"T4", "L4", "A100", "H100", "H200", "GH200"}
    for p in profiles:
        assert p.fp16_dense_tflops > 0 and p.memory_gb_per_s > 0 and p.host_link_gb_per_s > 0
        assert any("datasheet" in s for s in p.sources), p.name
        assert any(p.host_link.split()[0] in s for s in p.sources), f"{p.name}: no source for its {p.host_link}"
    assert set(assumptions.why) == {"mfu", "memory_share", "link_share", "copy_call_seconds",
                                    "attention_call_seconds", "overlap"}
    assert all(assumptions.why.values())


def test_llama3_8b_shape_by_hand():
    # 32 layers of q, o (4096 x 4096), k, v (4096 x 1024) and gate, up, down (4096 x 14336)
    assert LLAMA3_8B.matmul_weights == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) == 6_979_321_856
    assert LLAMA3_8B.weights_read_per_pass == 6_979_321_856 + 128_256 * 4096
    assert LLAMA3_8B.kv_bytes_per_token(2) == 32 * 2 * 8 * 128 * 2 == 131_072
    assert LLAMA3_8B.attention_flops_per_pair == 4 * 32 * 32 * 128


def test_a_profile_prices_a_model_from_its_figures():
    _, assumed = load_profiles()
    gpu = GPUProfile("test", fp16_dense_tflops=1000, memory_gb_per_s=4000, host_link="PCIe", host_link_gb_per_s=50,
                     sources=("made up",))
    cost = gpu.cost_model(LLAMA3_8B, assumed)
    flops = 1000e12 * assumed.mfu
    assert cost.prefill_tokens_per_s == pytest.approx(flops / (2 * 6_979_321_856))
    assert cost.floor_seconds == pytest.approx(2 * LLAMA3_8B.weights_read_per_pass / (4000e9 * assumed.memory_share))
    assert cost.host_link_bytes_per_s == pytest.approx(50e9 * assumed.link_share)
    assert cost.attention_seconds_per_pair == pytest.approx(4 * 32 * 32 * 128 / flops)
    assert (cost.overlap, cost.copy_call_seconds) == (assumed.overlap, assumed.copy_call_seconds)


def test_a_faster_host_link_swaps_from_shorter_victims():
    profiles, assumed = load_profiles()
    h100 = next(p for p in profiles if p.name.startswith("H100"))
    superchip = GPUProfile(**{**h100.__dict__, "host_link_gb_per_s": 450.0})
    bb = 16 * LLAMA3_8B.kv_bytes_per_token(2)
    pcie = h100.cost_model(LLAMA3_8B, assumed).recompute_range(16, bb, 4)
    c2c = superchip.cost_model(LLAMA3_8B, assumed).recompute_range(16, bb, 4)
    assert pcie is not None and (c2c is None or c2c[1] <= pcie[1])
