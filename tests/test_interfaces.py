"""The contracts of the pluggable pieces: what a piece declares is what the engine asks, and the checks that
refuse a piece at construction can fail."""
import dataclasses

import pytest
import torch

from kvlib import LLM, EngineConfig, interfaces
from kvlib.attention.capabilities import FLOAT_DTYPES, BackendCapabilities
from kvlib.attention.torch_backend import TorchAttentionBackend
from kvlib.core.block_allocator import BlockAllocator
from kvlib.core.block_manager import BlockManager
from kvlib.core.oversubscription import OversubscriptionDetector
from kvlib.core.preemption import LatestArrivalPolicy, SparingPolicy
from kvlib.core.prefix_cache import HostPrefixTier
from kvlib.core.scheduler import Scheduler
from kvlib.core.sharing import BlockSharing
from kvlib.kernels import triton_available
from kvlib.runner.decode_graphs import graph_safe
from kvlib.runner.warm_up import warm_up


@pytest.fixture(scope="module")
def folder(checkpoint):
    return checkpoint("llama-gqa")


class DeclaredBackend(TorchAttentionBackend):
    """The torch backend's computation under a declaration of the test's choosing."""

    def __init__(self, capabilities: BackendCapabilities):
        super().__init__()
        self.capabilities = capabilities


class Undeclared:
    """A backend written from scratch that declares nothing."""

    name = "undeclared"

    def __init__(self):
        self.torch = TorchAttentionBackend()
        self.store_kv, self.forward, self.copy_blocks = self.torch.store_kv, self.torch.forward, self.torch.copy_blocks


# ---- backends declare what they can do ------------------------------------------------------------
def test_kvlibs_backends_declare_what_they_can_do():
    torch_caps = TorchAttentionBackend.capabilities
    assert not torch_caps.graph_safe and torch_caps.warm_up_decode_bounds == ()
    assert set(torch_caps.dtypes) == set(FLOAT_DTYPES)
    if triton_available():
        from kvlib.attention.triton_backend import TritonAttentionBackend
        from kvlib.kernels import paged_decode
        caps = TritonAttentionBackend().capabilities
        assert caps.graph_safe
        splits = [bound // paged_decode.MIN_SPLIT_TOKENS for bound in caps.warm_up_decode_bounds]
        assert splits == [2 ** k for k in range(1, paged_decode.MAX_SPLITS.bit_length())]  # 2, 4 ... MAX_SPLITS


def test_capabilities_are_frozen_and_name_real_dtypes():
    caps = BackendCapabilities(graph_safe=False, dtypes=(torch.float32,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.graph_safe = True
    for dtypes in ((), ("float32",)):
        with pytest.raises(TypeError, match="must name at least one torch.dtype"):
            BackendCapabilities(graph_safe=False, dtypes=dtypes)


def test_graph_safety_is_what_the_backend_declares_not_its_class():
    assert graph_safe(DeclaredBackend(BackendCapabilities(graph_safe=True, dtypes=FLOAT_DTYPES)))
    assert not graph_safe(DeclaredBackend(BackendCapabilities(graph_safe=False, dtypes=FLOAT_DTYPES)))


def test_warm_up_launches_a_decode_step_at_each_bound_the_backend_declares(folder):
    backend = DeclaredBackend(BackendCapabilities(graph_safe=False, dtypes=FLOAT_DTYPES,
                                                  warm_up_decode_bounds=(24, 40)))
    llm = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=16, num_cpu_blocks=4), attention_backend=backend,
              verbose=False)
    runner = llm.engine.runner
    bounds, pack = [], runner.buffers.pack

    def recording_pack(chunks, *args, max_context_len=None, **kwargs):
        bounds.append((len(chunks), max_context_len))
        return pack(chunks, *args, max_context_len=max_context_len, **kwargs)
    runner.buffers.pack = recording_pack
    warm_up(runner)
    assert bounds == [(2, None), (1, 24), (1, 40)]  # the mixed step, then one decode at each declared bound


# ---- a backend that declares nothing, or not the model's dtype, is refused ------------------------------
def test_a_backend_that_declares_no_capabilities_is_refused_when_the_engine_is_built(folder):
    with pytest.raises(TypeError, match="does not implement kvlib.interfaces.AttentionBackend: it has no capabilities;"):
        LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=16), attention_backend=Undeclared(), verbose=False)
    with pytest.raises(TypeError, match="it has no capabilities;"):
        interfaces.check_attention_backend(Undeclared(), torch.float32)


def test_capabilities_of_the_wrong_type_are_refused():
    backend = DeclaredBackend({"graph_safe": True})
    with pytest.raises(TypeError, match="must be a kvlib.attention.capabilities.BackendCapabilities"):
        interfaces.check_attention_backend(backend, torch.float32)


def test_a_dtype_the_backend_does_not_compute_is_refused_naming_the_backend_and_its_dtypes():
    backend = DeclaredBackend(BackendCapabilities(graph_safe=False, dtypes=(torch.float16, torch.bfloat16)))
    interfaces.check_attention_backend(backend, torch.float16)
    with pytest.raises(ValueError, match="attention backend 'torch' computes in float16, bfloat16, not float32: "
                                         r"set EngineConfig\(dtype=...\)"):
        interfaces.check_attention_backend(backend, torch.float32)


def test_the_engine_refuses_a_backend_that_cannot_compute_its_dtype_before_loading_the_pool(folder):
    backend = DeclaredBackend(BackendCapabilities(graph_safe=False, dtypes=(torch.float16,)))
    with pytest.raises(ValueError, match="computes in float16, not float32"):
        LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=16, dtype="float32"), attention_backend=backend,
            verbose=False)


# ---- check_implements can fail on a subclass of kvlib's own class -----------------------------------------
def test_every_kvlib_piece_fits_its_protocol():
    pieces = [(BlockAllocator(4), interfaces.BlockAllocator), (TorchAttentionBackend(), interfaces.AttentionBackend),
              (BlockSharing(), interfaces.BlockSharing), (HostPrefixTier(BlockAllocator(4)), interfaces.HostPrefixTier),
              (OversubscriptionDetector(), interfaces.OversubscriptionDetector)]
    for piece, protocol in pieces:
        interfaces.check_implements(piece, protocol, "piece")


@pytest.mark.parametrize("method, message", [
    ("def free(self):\n    pass", r"free\(\) cannot be called as free\(block_id\)"),
    ("def can_allocate(self, num_blocks, watermark_blocks):\n    pass",
     r"can_allocate\(num_blocks, watermark_blocks\) cannot be called as can_allocate\(num_blocks\)"),
    ("@property\ndef ref_count(self):\n    raise NotImplementedError('Task 1')",
     r"ref_count is a property, but the engine calls it as a method ref_count\(block_id\)"),
    ("def alocate(self):\n    return 0", "it defines alocate, which the engine never calls: is it meant to be allocate?"),
])
def test_a_subclass_whose_method_the_engine_cannot_call_is_refused(method, message):
    """The subclass inherits every member, so a missing-member check alone could never fail on it."""
    namespace = {}
    exec("class Mine(BlockAllocator):\n" + "".join(f"    {line}\n" for line in method.splitlines()),
         {"BlockAllocator": BlockAllocator}, namespace)
    with pytest.raises(TypeError, match=f"allocator=.* does not fit kvlib.interfaces.BlockAllocator: {message}"):
        interfaces.check_implements(namespace["Mine"](4), interfaces.BlockAllocator, "allocator")


def test_the_engine_refuses_a_block_manager_whose_override_is_misnamed(folder):
    class Misnamed(BlockManager):
        def swap_outt(self, seq, count=None):
            raise AssertionError("never called: the inherited swap_out runs instead")
    with pytest.raises(TypeError, match="block_manager=.* does not fit kvlib.interfaces.PreemptionMechanism: it defines "
                                        "swap_outt, which the engine never calls: is it meant to be swap_out?"):
        LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=16), block_manager=Misnamed, verbose=False)


def test_the_engine_refuses_a_scheduler_step_that_cannot_take_the_budget(folder):
    class NoBudget(Scheduler):
        def schedule_running(self, out):
            return 0
    with pytest.raises(TypeError, match=r"scheduler=.* does not fit kvlib.interfaces.SchedulingStep: "
                                        r"schedule_running\(out\) cannot be called as schedule_running\(out, budget\)"):
        LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=16), scheduler=NoBudget, verbose=False)


# ---- the preemption policy is checked against its contract, not against kvlib's default class --------------
class Delegating:
    """A wrapper that records each victim its policy picks: every other member comes from the wrapped policy."""

    def __init__(self, policy):
        self.policy, self.victims = policy, []

    def select_victim(self, candidates, shortfall):
        victim = self.policy.select_victim(candidates, shortfall)
        self.victims.append(victim)
        return victim

    def __getattr__(self, name):
        return getattr(self.policy, name)


class Chooser(LatestArrivalPolicy):
    def choose_mode(self, victim, context):
        return "swap"


def test_a_policy_whose_choice_comes_through_delegation_may_choose_in_auto_mode():
    for mode in ("auto", "swap", "recompute"):
        interfaces.check_preemption_policy(Delegating(LatestArrivalPolicy()), mode)
        interfaces.check_preemption_policy(SparingPolicy(), mode)


def test_a_choice_of_its_own_in_a_fixed_mode_is_refused_however_the_policy_is_built():
    interfaces.check_preemption_policy(Chooser(), "auto")
    for policy in (Chooser(), Delegating(Chooser())):
        with pytest.raises(ValueError, match="fixes the mode and never asks it; set preemption_mode='auto'"):
            interfaces.check_preemption_policy(policy, "swap")


def test_a_policy_whose_methods_the_engine_cannot_call_is_refused():
    class NoShortfall(LatestArrivalPolicy):
        def select_victim(self, candidates):
            return candidates[-1]
    with pytest.raises(TypeError, match=r"select_victim\(candidates\) cannot be called as "
                                        r"select_victim\(candidates, shortfall\)"):
        interfaces.check_preemption_policy(NoShortfall(), "recompute")
    with pytest.raises(TypeError, match=r"has no choose_mode\(victim, context\) method"):
        interfaces.check_preemption_policy(Delegating(object()), "auto")


def test_a_mechanism_is_told_of_block_actions_that_exist_each_with_one_meaning():
    """PreemptionMechanism names the block manager's actions a mechanism works with; the lab 06 solution,
    graded in tests/test_labs_graded.py, is written with these alone."""
    import re
    named = set(re.findall(r"``([a-z_]+)\(", interfaces.PreemptionMechanism.__doc__))
    named -= set(interfaces.protocol_members(interfaces.PreemptionMechanism))
    assert named == {"take", "take_host", "release", "release_host", "copy_out", "copy_in"}
    assert all(callable(getattr(BlockManager, name)) for name in named)


def test_auto_mode_refuses_a_policy_without_the_cost_model_it_prices_with():
    class ChoosesWithoutPrices:
        def select_victim(self, candidates, shortfall):
            return candidates[-1]

        def choose_mode(self, victim, context):
            return "swap"

    with pytest.raises(TypeError, match="has none; give it cost_model = None"):
        LLM("default", EngineConfig(preemption_mode="auto", num_gpu_blocks=32), preemption_policy=ChoosesWithoutPrices())
    policy = ChoosesWithoutPrices()
    policy.cost_model = None
    assert LLM("default", EngineConfig(preemption_mode="auto", num_gpu_blocks=32), preemption_policy=policy,
               verbose=False).engine.cost_model is not None  # measured at start-up
