"""Every GPU a learner meets: what kvlib picks on each, with its capability mocked (no GPU needed).

Colab's free GPU is a T4 (sm_75, no fast bfloat16); its paid ones an L4 (sm_89) and an A100 (sm_80);
H100 and H200 are sm_90. README.md's GPU section tells learners the same table.
"""
import pytest
import torch

import kvlib.runner.device as device
from kvlib.course.gpu_profiles import load_profiles

CUDA = torch.device("cuda", 0)
# GPU, compute capability, the dtype kvlib serves in, its attention backend (with Triton installed)
LEARNER_GPUS = [("T4", (7, 5), torch.float16, "torch"),
                ("L4", (8, 9), torch.bfloat16, "triton"),
                ("A100", (8, 0), torch.bfloat16, "triton"),
                ("H100", (9, 0), torch.bfloat16, "triton"),
                ("H200", (9, 0), torch.bfloat16, "triton")]


@pytest.fixture
def gpu_of(monkeypatch):
    def pretend(capability):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
        monkeypatch.setattr(device, "triton_available", lambda: True)
    return pretend


@pytest.mark.parametrize("name, capability, dtype, backend", LEARNER_GPUS, ids=[g[0] for g in LEARNER_GPUS])
def test_what_kvlib_picks_on_each_gpu(gpu_of, name, capability, dtype, backend):
    gpu_of(capability)
    assert device.resolve_dtype("auto", CUDA) == dtype, name
    assert device.choose_attention_backend("auto", CUDA).name == backend, name


def test_a_t4_refuses_a_requested_triton_backend_with_the_reason(gpu_of):
    gpu_of((7, 5))
    with pytest.raises(ValueError, match="8.0"):
        device.choose_attention_backend("triton", CUDA)
    assert "below compute capability 8.0" in device.choose_attention_backend("auto", CUDA).reason


def test_without_triton_every_gpu_falls_back_to_torch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    monkeypatch.setattr(device, "triton_available", lambda: False)
    assert device.choose_attention_backend("auto", CUDA).name == "torch"


def test_every_learner_gpu_has_a_profile():
    names = {p.name.split()[0] for p in load_profiles()[0]}
    assert {name for name, *_ in LEARNER_GPUS} <= names
