"""The cost probe: its fits recover a known model from the timings it predicts; its timers run on a real engine."""
import pytest
import torch

from kvlib import LLM, EngineConfig
from kvlib.core.cost_model import PreemptionCostModel, attention_pairs
from kvlib.runner.cost_probe import (
    ForwardTimings,
    fit_copy,
    forward_pass,
    measure_cost_model,
    time_returning_turns,
    time_victims,
)

BATCH, SMALL, CONTEXT = 8, 16, 1024


def timings_of(truth: PreemptionCostModel, q: int) -> ForwardTimings:
    """The probe's passes as ``truth`` prices them (the decode batch's own attention left out)."""
    def with_prefill(n, cached=0):
        return truth.pass_seconds(BATCH + n, attention_pairs(n, cached), num_prefills=1)
    return ForwardTimings(BATCH, SMALL, q, CONTEXT, one=truth.pass_seconds(1), alone=truth.pass_seconds(BATCH),
                          with_small=with_prefill(SMALL), with_q=with_prefill(q), with_2q=with_prefill(2 * q),
                          with_q_behind=with_prefill(q, CONTEXT))


@pytest.mark.parametrize("truth, q", [
    # a GPU-like pass: the weight reads hide the first 150 tokens; the probe grows q past them
    (PreemptionCostModel(1.0, prefill_tokens_per_s=30_000.0, floor_seconds=5e-3, overlap=1.0,
                         attention_seconds_per_pair=2e-9, attention_call_seconds=1e-4), 256),
    # a CPU-core-like pass: reads and arithmetic add up, and a prefill's own attention calls cost
    (PreemptionCostModel(1.0, prefill_tokens_per_s=20_000.0, floor_seconds=2.5e-3, overlap=0.0,
                         attention_seconds_per_pair=6e-8, attention_call_seconds=8e-4), 64),
    # a knee below the smallest prefill: the overlap shows only in the decode batch
    (PreemptionCostModel(1.0, prefill_tokens_per_s=400.0, floor_seconds=0.06, overlap=0.3,
                         attention_seconds_per_pair=1e-6, attention_call_seconds=0.0), 64),
], ids=["roofline", "additive", "knee-below-one-block"])
def test_the_forward_fit_recovers_the_model_that_made_the_timings(truth, q):
    fit = timings_of(truth, q).fit()
    # the floor is read off a one-token pass, which carries one token's arithmetic where the reads do not hide it
    assert fit["floor_seconds"] == pytest.approx(truth.pass_seconds(1))
    assert fit["prefill_tokens_per_s"] == pytest.approx(truth.prefill_tokens_per_s)
    assert fit["attention_seconds_per_pair"] == pytest.approx(truth.attention_seconds_per_pair)
    assert fit["overlap"] == pytest.approx(truth.overlap, abs=0.02)
    assert fit["attention_call_seconds"] == pytest.approx(truth.attention_call_seconds, abs=1e-4 * truth.floor_seconds)


ADDITIVE = PreemptionCostModel(1.0, prefill_tokens_per_s=20_000.0, floor_seconds=2.5e-3, overlap=0.0,
                               attention_seconds_per_pair=6e-8, attention_call_seconds=8e-4)


def test_timings_a_busy_machine_made_contradictory_are_refused_not_fitted_to_a_negative_speed():
    """One pass slowed by other work (the chunk behind its context, by twenty times the batch's pass) makes attention look dearer than the chunks that
    contain it: taken out of them, it leaves them costing less than nothing, and a fit priced prefill at a negative
    speed, so that ``auto`` recomputed every victim for free."""
    from kvlib.runner.cost_probe import ContradictoryTimings
    timings = timings_of(ADDITIVE, 64)
    timings.with_q_behind += 20 * timings.alone
    with pytest.raises(ContradictoryTimings, match="cheaper"):
        timings.fit()


def probe_with(monkeypatch, passes_per_probe):
    """``measure_cost_model`` over stand-in passes: the n-th probe's pass times come from ``passes_per_probe(n)``."""
    from kvlib.runner import cost_probe
    monkeypatch.setattr(cost_probe, "forward_pass", lambda model, pool, backend, seqs: ("pass", seqs))
    monkeypatch.setattr(cost_probe, "copy_probes", lambda pool, n: (("copy", 1), ("copy", n)))
    probes = []

    def best_in_turns(fns, device):
        probes.append(len(probes))
        timings = passes_per_probe(probes[-1])
        passes = [timings.one, timings.alone, timings.with_small, timings.with_q, timings.with_2q, timings.with_q_behind]
        return passes + [1e-5 + arg * 1e-5 for kind, arg in fns if kind == "copy"]
    monkeypatch.setattr(cost_probe, "best_in_turns", best_in_turns)
    monkeypatch.setattr(cost_probe, "past_the_knee", lambda timings: True)
    pool = type("Pool", (), {"spec": type("Spec", (), {"block_size": SMALL, "block_bytes": 2**20})(),
                             "num_blocks": 4096, "device": torch.device("cpu")})()
    model = type("Model", (), {"config": type("Config", (), {"max_position_embeddings": CONTEXT + 64})()})()
    return (lambda: cost_probe.measure_cost_model(model, pool, backend=None, num_batch=BATCH)), probes


def test_the_probe_times_again_when_its_timings_contradict_each_other(monkeypatch):
    def passes(attempt):
        timings = timings_of(ADDITIVE, 64)
        if attempt == 0:
            timings.with_q_behind += 20 * timings.alone
        return timings
    measure, probes = probe_with(monkeypatch, passes)
    fitted = measure()
    assert len(probes) == 2 and fitted.prefill_tokens_per_s == pytest.approx(ADDITIVE.prefill_tokens_per_s)


def test_a_machine_too_busy_to_probe_is_told_what_to_do(monkeypatch):
    def passes(attempt):
        timings = timings_of(ADDITIVE, 64)
        timings.with_2q = timings.with_q = timings.alone  # every prefill measured as free
        return timings
    measure, probes = probe_with(monkeypatch, passes)
    with pytest.raises(RuntimeError, match="preemption_mode='swap' or 'recompute'"):
        measure()
    assert len(probes) > 1


def test_the_copy_fit_recovers_call_cost_and_link_speed():
    call, link, block = 5e-5, 8e9, 737_280
    one, many = call + block / link, call + 32 * block / link
    assert fit_copy(one, many, 32, block) == pytest.approx((call, link))
    assert fit_copy(one, one, 1, block) == pytest.approx((0.0, block / one))  # one block: everything is bytes


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    llm = LLM("default", EngineConfig(block_size=16, num_gpu_blocks=96, num_cpu_blocks=64), verbose=False)
    return llm.engine.runner


def test_a_probe_pass_computes_what_the_model_computes(tiny):
    """The timed pass is a real forward pass: its logits for a prompt equal the model's own prefill's."""
    logits = forward_pass(tiny.model, tiny.device_pool, tiny.backend, [(40, 0)])()
    prompt = torch.tensor([(7 * p + 3) % tiny.model.config.vocab_size for p in range(40)])
    from kvlib.attention.metadata import AttentionMetadata
    meta = AttentionMetadata(slot_mapping=torch.arange(40), block_tables=torch.tensor([[0, 1, 2]], dtype=torch.int32),
                             context_lens=torch.tensor([40], dtype=torch.int32),
                             query_start=torch.tensor([0, 40], dtype=torch.int32), max_query_len=40, max_context_len=40)
    with torch.inference_mode():
        expected = tiny.model(prompt, torch.arange(40), tiny.device_pool, meta, tiny.backend, torch.tensor([39]))
    torch.testing.assert_close(logits, expected)


@pytest.mark.parametrize("num_gpu_blocks", [1, 16])
def test_the_probe_measures_every_term_even_in_a_small_pool(num_gpu_blocks):
    llm = LLM("default", EngineConfig(block_size=4, num_gpu_blocks=num_gpu_blocks, preemption_mode="auto"),
              verbose=False)
    cost = llm.engine.cost_model
    assert cost == llm.engine.scheduler.cost_model
    assert cost.host_link_bytes_per_s > 0 and cost.prefill_tokens_per_s > 0 and cost.floor_seconds > 0
    assert 0.0 <= cost.overlap <= 1.0
    assert min(cost.attention_seconds_per_pair, cost.attention_call_seconds, cost.copy_call_seconds) >= 0.0


def test_victims_are_timed_both_ways(tiny):
    victims = time_victims(tiny, [16, 40, 64], batch=2, repeats=1, min_seconds=0.0)
    assert [(v.num_tokens, v.num_blocks) for v in victims] == [(16, 1), (40, 3), (64, 4)]
    assert all(v.swap_seconds > 0 for v in victims)


def test_a_victim_beside_a_decode_batch_is_judged_against_the_spread_of_identical_passes(tiny, monkeypatch):
    """The decode pass alone is timed three times in turns: the least is what a victim's additions are taken from,
    and the spread of the three is the noise a swap or recompute must clear (it was not measured before)."""
    from kvlib.runner import cost_probe
    timed = []

    def bests(fns, device, repeats, min_seconds):
        timed.append(len(fns))
        passes = [1.000, 1.030, 1.010][:len(fns) - 4]
        return passes + [1.020, 1.500, 1.200, 2.000]  # per victim: swap (with the pass between), pass with it
    monkeypatch.setattr(cost_probe, "best_in_turns", bests)
    short, long = cost_probe.time_victims(tiny, [16, 64], batch=2, swap_beside=True)
    assert timed == [3 + 4]
    assert [short.swap_seconds, short.recompute_seconds, short.noise_seconds] == pytest.approx([0.02, 0.5, 0.03])
    assert [long.swap_seconds, long.noise_seconds] == pytest.approx([0.2, 0.03])
    alone, _ = cost_probe.time_victims(tiny, [16, 64], batch=0)
    assert timed[-1] == 1 + 4 and alone.noise_seconds == 0.0 and alone.swap_seconds == pytest.approx(1.02)


def test_a_victim_alone_is_its_own_prefill_and_a_swap_beside_decode_runs_the_batch_between_its_copies(tiny, monkeypatch):
    from kvlib.runner import cost_probe
    calls = cost_probe.victim_calls(tiny, 40, batch=0)
    assert calls["batch"]() is None  # no decode batch: nothing to subtract
    assert calls["batch with the victim"]().shape[0] == 1  # the victim's prefill alone, one last-token row
    order = []
    monkeypatch.setattr(cost_probe, "copy_blocks_between", lambda src, dst, *ids: order.append(
        "out" if src is tiny.device_pool else "in"))
    beside = cost_probe.victim_calls(tiny, 40, batch=2, swap_beside=True)
    real_pass = beside["batch"]
    monkeypatch.setattr(cost_probe, "forward_pass", lambda *a: (lambda: order.append("pass")))
    cost_probe.victim_calls(tiny, 40, batch=2, swap_beside=True)["swap"]()
    cost_probe.victim_calls(tiny, 40, batch=2)["swap"]()
    assert order == ["out", "pass", "in", "out", "in"]
    assert real_pass().shape[0] == 2


def test_returning_turns_are_timed_both_ways(tiny):
    turns = time_returning_turns(tiny, [64, 256], new_tokens=40, repeats=1, min_seconds=0.0)
    assert [t.context for t in turns] == [64, 256]
    assert all(t.recompute_seconds > 0 and t.copy_back_seconds > 0 for t in turns)


def test_measure_cost_model_uses_the_pools_it_is_given(tiny):
    cost = measure_cost_model(tiny.model, tiny.device_pool, tiny.backend)
    assert isinstance(cost, PreemptionCostModel) and cost.prefill_tokens_per_s > 0


def test_the_copy_probe_moves_enough_bytes_to_time_the_link_not_its_latency():
    from kvlib.runner.cost_probe import COPY_PROBE_BLOCKS, COPY_PROBE_BYTES, copy_probe_blocks

    def pool(num_blocks, block_bytes):
        spec = type("Spec", (), {"block_bytes": block_bytes})()
        return type("Pool", (), {"spec": spec, "num_blocks": num_blocks})()
    small = 16 * 1024  # the built-in model's blocks: 32 of them timed per-copy latency on a GPU
    assert copy_probe_blocks(pool(100_000, small)) == COPY_PROBE_BYTES // small
    assert copy_probe_blocks(pool(1_000, small)) == 1_000  # never more than the pool holds
    assert copy_probe_blocks(pool(100_000, 8 * 2**20)) == COPY_PROBE_BLOCKS  # big blocks: the floor


def test_the_probe_grows_its_prefill_past_timing_noise_at_the_floor(monkeypatch):
    """A GPU-like pass (tokens hide under a 5.6 ms floor until 840 of them) whose additions below the knee are
    noise that still doubles: the probe must not stop on that ratio."""
    from kvlib.runner import cost_probe
    truth = PreemptionCostModel(1.0, prefill_tokens_per_s=150_000.0, floor_seconds=5.6e-3, overlap=1.0,
                                attention_seconds_per_pair=0.0, attention_call_seconds=0.0)

    def noise(tokens):  # a few microseconds that grow with the tokens, as stray timings do
        return 1e-8 * tokens

    monkeypatch.setattr(cost_probe, "forward_pass", lambda model, pool, backend, seqs: ("pass", seqs))
    monkeypatch.setattr(cost_probe, "copy_probes", lambda pool, n: (("copy", 1), ("copy", n)))

    def best_in_turns(fns, device):
        times = []
        for kind, arg in fns:
            if kind == "copy":
                times.append(1e-5 + arg * 1e-5)
            else:
                tokens = sum(n for n, _ in arg)
                times.append(truth.pass_seconds(tokens) + noise(tokens))
        return times
    monkeypatch.setattr(cost_probe, "best_in_turns", best_in_turns)
    pool = type("Pool", (), {"spec": type("Spec", (), {"block_size": 16, "block_bytes": 2**20})(),
                             "num_blocks": 4096, "device": torch.device("cpu")})()
    model = type("Model", (), {"config": type("Config", (), {"max_position_embeddings": 131072})()})()
    fitted = cost_probe.measure_cost_model(model, pool, backend=None)
    assert fitted.prefill_tokens_per_s == pytest.approx(150_000, rel=0.05)
    assert fitted.floor_seconds == pytest.approx(5.6e-3, rel=0.01)


def test_a_probe_pass_sends_its_leading_decodes_to_the_decode_path_as_the_engine_does():
    from kvlib.runner.cost_probe import leading_decodes
    assert leading_decodes([(1, 0)] * 8 + [(64, 0)]) == 8
    assert leading_decodes([(1, 64)] * 3) == 3
    assert leading_decodes([(40, 0)]) == 0
    assert leading_decodes([(1, 0), (5, 0), (1, 0)]) == 1
