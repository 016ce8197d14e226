"""A GPU's modelled cost model against a run measured on it, term by term: runs made up here, so each answer is known."""
from dataclasses import replace

import pytest

from kvlib.core.cost_model import PreemptionCostModel
from kvlib.course import measured_runs as mr
from kvlib.course.gpu_profiles import load_profiles
from kvlib.course.model_against_run import (
    TERMS,
    deciding_terms,
    picks,
    profile_for,
    run_shape,
    shown,
    term_by_term,
)
from kvlib.runner.cost_probe import VictimTiming

BLOCK_BYTES = 2 << 20
# A GPU-like model: short victims hide under the floor, the link moves a block in 40 us.
MODELLED = PreemptionCostModel(host_link_bytes_per_s=5e10, prefill_tokens_per_s=3e4, floor_seconds=4e-3,
                               attention_seconds_per_pair=1e-9)


def run_of(costs: dict[int, tuple[float, float]], measured: PreemptionCostModel, device="NVIDIA H200",
           model="llama-3.1-8b-shaped (random bfloat16 weights)", batch=32) -> mr.MeasuredRun:
    """A run whose victims cost ``{tokens: (swap s, recompute s)}`` and whose probe measured ``measured``."""
    return mr.MeasuredRun(
        name="made up", date="2026-12-04", device=device, model=model, dtype="bfloat16", block_size=16,
        block_bytes=BLOCK_BYTES, threads=8, torch_version="2.0", cost_model=measured, batch=batch,
        victims=[VictimTiming(n, -(-n // 16), s, r) for n, (s, r) in costs.items()], new_tokens=40, returning=[])


SWAP_EVERYWHERE = {16: (1e-4, 3e-3), 256: (5e-4, 3e-3), 4096: (16e-3, 110e-3)}


def test_each_device_finds_its_own_profile_and_no_other():
    profiles, _ = load_profiles()
    names = {device: getattr(profile_for(run_of({}, MODELLED, device=device), profiles), "name", None)
             for device in ("NVIDIA H200", "NVIDIA GH200 480GB", "Tesla T4", "NVIDIA A100-SXM4-80GB", "AMD MI300X")}
    assert names == {"NVIDIA H200": "H200 SXM 141GB", "NVIDIA GH200 480GB": "GH200 144GB", "Tesla T4": "T4",
                     "NVIDIA A100-SXM4-80GB": "A100 SXM4 80GB", "AMD MI300X": None}


def test_a_run_has_the_shape_of_the_model_it_measured():
    one_b = run_shape(run_of({}, MODELLED, model="llama-3.2-1b-shaped (random bfloat16 weights)"))
    eight_b = run_shape(run_of({}, MODELLED))
    built_in = run_shape(run_of({}, MODELLED, model="default"))
    assert (one_b.num_layers, one_b.hidden_size, one_b.head_dim) == (16, 2048, 64)
    assert (eight_b.num_layers, eight_b.intermediate_size, eight_b.head_dim) == (32, 14336, 128)
    assert (built_in.num_layers, built_in.hidden_size) == (4, 192)
    assert run_shape(run_of({}, MODELLED, model="smollm2-135m")) is None


def test_picks_counts_the_victims_whose_measured_winner_the_model_chooses():
    run = run_of({**SWAP_EVERYWHERE, 64: (0.0, 0.0)}, MODELLED)  # 64: both hidden, so no winner to pick
    always_swap = replace(MODELLED, attention_call_seconds=1.0)
    always_recompute = replace(MODELLED, host_link_bytes_per_s=1.0)
    assert picks(always_swap, run) == (3, 3)
    assert picks(always_recompute, run) == (0, 3)
    assert picks(MODELLED, run)[1] == 3


def test_the_term_that_alone_brings_the_model_to_the_measured_winners_is_named():
    """The modelled line recomputes the short victims; the run measured a 4 ms call per prefilling sequence, and
    with only that term measured the model swaps every victim, as the run did. Every other term, measured alone,
    leaves the short victims recomputing."""
    measured = replace(MODELLED, attention_call_seconds=4e-3, floor_seconds=5e-3)
    run = run_of(SWAP_EVERYWHERE, measured)
    modelled_agreed, decided = picks(MODELLED, run)
    assert modelled_agreed < decided == 3
    swaps = term_by_term(MODELLED, run)
    assert [s.term for s in swaps] == list(TERMS)
    by_term = {s.term: s for s in swaps}
    assert by_term["attention_call_seconds"].agreed == 3 and by_term["attention_call_seconds"].measured == 4e-3
    assert by_term["floor_seconds"].agreed == modelled_agreed  # unchanged terms leave the model where it was
    assert deciding_terms(swaps, modelled_agreed) == ["attention_call_seconds"]


def test_no_term_is_named_where_the_model_already_agrees_or_no_single_term_suffices():
    agreeing = run_of(SWAP_EVERYWHERE, MODELLED)
    always_swap = replace(MODELLED, attention_call_seconds=1.0)
    assert deciding_terms(term_by_term(always_swap, agreeing), picks(always_swap, agreeing)[0]) == []
    # the run recomputed the short victim; the modelled line overprices recompute twice over (a call and the speed),
    # so each measured term alone leaves the other still swapping it, and both together recompute it
    two_wrong = replace(MODELLED, attention_call_seconds=1.0, prefill_tokens_per_s=1.0)
    stubborn = run_of({16: (1e-3, 1e-5), 4096: (16e-3, 110e-3)}, MODELLED)
    swaps = term_by_term(two_wrong, stubborn)
    assert picks(two_wrong, stubborn) == (1, 2) and picks(MODELLED, stubborn) == (2, 2)
    assert deciding_terms(swaps, 1) == []


@pytest.mark.parametrize("term, value, text", [("host_link_bytes_per_s", 6.21e10, "62.1 GB/s"),
                                               ("prefill_tokens_per_s", 320595.05, "320,595 tokens/s"),
                                               ("attention_call_seconds", 1.6361e-3, "1.64 ms"),
                                               ("overlap", 0.7392, "0.739")])
def test_terms_are_shown_in_their_units(term, value, text):
    assert shown(term, value) == text
