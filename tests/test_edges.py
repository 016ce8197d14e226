"""The engine's edges: values at the limits of float32, parameters and config changed after they were
given, steps that raise halfway, model files beside config.json, and inputs of the wrong shape."""
import json
import shutil

import pytest
import torch

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.config import MIN_TEMPERATURE
from kvlib.core.block_allocator import BlockAllocator
from kvlib.core.invariants import check_invariants
from kvlib.core.oversubscription import OversubscriptionDetector
from kvlib.core.preemption import LatestArrivalPolicy
from kvlib.core.scheduler import Scheduler
from kvlib.core.sequence import Sequence
from kvlib.core.sharing import BlockSharing
from kvlib.engine import EngineStoppedError
from kvlib.model.errors import CheckpointError
from kvlib.runner import model_runner
from kvlib.runner.sampler import Sampler, top_p_filter

PROMPT = [5, 6, 7, 8]


def default_llm(**config) -> LLM:
    return LLM("default", EngineConfig(**{"num_gpu_blocks": 64, **config}), verbose=False)


@pytest.fixture(scope="module")
def llm():
    return default_llm()


def run_to_completion(engine, max_steps=500) -> dict:
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
    raise AssertionError(f"not finished after {max_steps} steps")


def draw_seq(**params) -> Sequence:
    return Sequence("r", [1, 2], SamplingParams(**params), block_size=4, arrival_time=0.0, seed=3)


# ---- 1: temperature and top_p at the limits of float32 ---------------------------------------------
@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 1e-300])
def test_a_temperature_below_the_smallest_normal_float32_is_refused_by_name(temperature):
    with pytest.raises(ValueError, match=r"temperature must be a finite number >= 0: 0 \(greedy\) or at least 1\.175e-38"):
        SamplingParams(temperature=temperature)


@pytest.mark.parametrize("temperature", [MIN_TEMPERATURE, 1e-30, 1e-20])
def test_the_smallest_temperatures_draw_the_top_token_not_token_0(temperature):
    """logits / temperature overflows float32 here: the row is shifted by its maximum first, never NaN."""
    logits = 10 * torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
    logits[:, 0] = -50.0  # token 0 is the least likely of all
    seqs = [draw_seq(temperature=temperature, top_p=top_p) for top_p in (1.0, 0.9, 0.5) for _ in range(2)]
    assert Sampler(8, torch.device("cpu")).sample(logits, seqs) == logits.argmax(-1).tolist()


def test_the_smallest_temperature_follows_greedy_in_the_engine(llm):
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=8))[0].token_ids
    tiny = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=MIN_TEMPERATURE, seed=1))[0].token_ids
    assert tiny == greedy and set(greedy) != {0}


@pytest.mark.parametrize("top_p", [1e-46, 1e-30, 1e-3])
def test_a_top_p_below_the_top_tokens_probability_keeps_the_top_token(llm, top_p):
    """1e-46 is 0 in float32: no token reached it, so every probability became 0 and token 0 won."""
    probs = torch.tensor([[0.1, 0.5, 0.25, 0.15]])
    assert top_p_filter(probs, torch.tensor([top_p])).tolist() == [[0.0, 0.5, 0.0, 0.0]]
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=8))[0].token_ids
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=1.0, top_p=top_p, seed=1))[0]
    assert out.token_ids == greedy


# ---- 2, 4, 6: values checked at the door, and copied there -----------------------------------------
@pytest.mark.parametrize("arrival_time", ["soon", [1.0], float("nan"), True])
def test_an_arrival_time_that_is_not_a_number_is_refused_and_leaves_nothing_behind(llm, arrival_time):
    engine, late = llm.engine, f"late {arrival_time!r}"
    with pytest.raises(TypeError, match="arrival_time must be a finite number"):
        engine.add_request(late, PROMPT, SamplingParams(max_tokens=2), arrival_time=arrival_time)
    assert not engine.has_request(late) and not engine.has_unfinished_requests()
    engine.add_request(late, PROMPT, SamplingParams(max_tokens=2))  # the id is free, and the queues still work
    assert run_to_completion(engine)[late].finish_reason == "length"


def test_a_request_the_scheduler_fails_to_queue_is_not_half_added(monkeypatch):
    llm = default_llm()
    engine = llm.engine

    def refuse(seq):
        raise RuntimeError("queue is broken")
    monkeypatch.setattr(engine.scheduler, "add", refuse)
    with pytest.raises(RuntimeError, match="queue is broken"):
        engine.add_request("half", PROMPT, SamplingParams(max_tokens=2))
    assert not engine.has_request("half") and engine.metrics.num_prompt_tokens == 0
    monkeypatch.undo()
    assert llm.generate([PROMPT], SamplingParams(max_tokens=3))[0].finish_reason == "length"
    engine.add_request("half", PROMPT, SamplingParams(max_tokens=2))
    assert run_to_completion(engine)["half"].finish_reason == "length"


@pytest.mark.parametrize("field, value, message", [
    ("n", 0, "n must be a positive integer"),
    ("max_tokens", 0, "max_tokens must be a positive integer"),
    ("stop_token_ids", 5, r"stop_token_ids must be a list .* stop_token_ids=\[id\]"),
    ("temperature", -1.0, "temperature must be a finite number >= 0"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("seed", "x", "seed must be None or an integer"),
])
def test_sampling_params_changed_after_they_were_built_are_checked_when_given(llm, field, value, message):
    """n = 0 made generate() loop forever; stop_token_ids = 5 raised halfway through a step's recording."""
    engine, bystander = llm.engine, f"bystander of {field}"
    engine.add_request(bystander, PROMPT, SamplingParams(max_tokens=3))
    params = SamplingParams(max_tokens=3)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=message):
        engine.add_request("changed", PROMPT, params)
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=3), params])
    assert not engine.has_request("changed")
    finished = run_to_completion(engine)
    assert list(finished) == [bystander] and len(finished[bystander].token_ids) == 3
    assert llm.generate([PROMPT], SamplingParams(max_tokens=2))[0].finish_reason == "length"


def test_sampling_params_changed_after_the_request_was_added_do_not_reach_it(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=3)
    engine.add_request("kept", PROMPT, params)
    params.max_tokens, params.n = 40, 3
    params.stop_token_ids.append(engine.step()[0].token_ids[0])  # its first token: a stop, were the list shared
    out = run_to_completion(engine)["kept"]
    assert len(out.samples) == 1 and len(out.token_ids) == 3 and out.finish_reason == "length"


def test_the_engine_keeps_its_own_copy_of_the_config():
    """The caller's EngineConfig changed to build a second LLM reached into the first."""
    config = EngineConfig(num_gpu_blocks=64, max_num_seqs=4)
    first = LLM("default", config, verbose=False)
    config.max_num_seqs = 1
    config.block_size = 8
    outs = first.generate([PROMPT] * 4, SamplingParams(max_tokens=3))
    assert [o.finish_reason for o in outs] == ["length"] * 4
    assert first.engine.config.max_num_seqs == 4 and first.engine.scheduler.config.block_size == 16
    assert max(step.num_running for step in first.metrics.steps) == 4
    config.max_num_seqs = 0  # checked again when given again
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer"):
        LLM("default", config, verbose=False)


# ---- 3: a step that raises loses none of the outputs it held ---------------------------------------
def test_outputs_a_raising_step_held_come_back_from_the_next_one(monkeypatch):
    llm = default_llm()
    engine = llm.engine
    engine.add_request("empty", [], SamplingParams(max_tokens=2))  # rejected: waits in the ready list
    engine.add_request("live", PROMPT, SamplingParams(max_tokens=2))
    handed = llm.generate([PROMPT], SamplingParams(max_tokens=1))  # steps past both: hands them back
    assert handed[0].finish_reason == "length"

    def broken(plan):
        raise RuntimeError("device lost")
    monkeypatch.setattr(engine.runner, "forward", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    monkeypatch.undo()
    outs = {out.request_id: out for out in engine.step()}
    assert outs["empty"].rejected and "empty" in outs["empty"].error
    assert outs["live"].finish_reason == "length" and len(outs["live"].token_ids) == 2
    assert not engine.has_unfinished_requests()
    engine.add_request("empty", PROMPT, SamplingParams(max_tokens=1))  # handed out: the id is free again
    assert run_to_completion(engine)["empty"].finish_reason == "length"


def test_the_outputs_of_a_step_whose_detector_raised_come_back_from_the_next_one():
    """The requests that finished in that step were recorded (their ids taken) but never returned."""
    class Flaky(OversubscriptionDetector):
        calls = 0

        def observe(self, metrics):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise RuntimeError("detector failed")
            return super().observe(metrics)
    llm = LLM("default", EngineConfig(num_gpu_blocks=64), verbose=False, oversubscription_detector=Flaky())
    engine = llm.engine
    engine.add_request("one", PROMPT, SamplingParams(max_tokens=1))
    engine.add_request("two", PROMPT, SamplingParams(max_tokens=3))
    with pytest.raises(RuntimeError, match="detector failed"):
        engine.step()
    outs = {out.request_id: out for out in engine.step()}
    assert outs["one"].finished and len(outs["one"].token_ids) == 1
    assert len(outs["two"].token_ids) == 2  # the newer output of the same request replaced the older
    assert run_to_completion(engine)["two"].finish_reason == "length"


# ---- 5: a step's block moves all done, or the engine stops -----------------------------------------
SWAPPING = dict(block_size=4, num_gpu_blocks=12, num_cpu_blocks=64, preemption_mode="swap", watermark=0.0)
SWAP_PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(8)] for i in range(6)]


def raise_on_call(number: int, error: BaseException, copy):
    calls = []

    def failing(*args):
        calls.append(args)
        if len(calls) == number:
            raise error
        return copy(*args)
    return failing


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("CUDA error: an illegal memory access")])
def test_a_step_whose_block_copies_raise_stops_the_engine_with_the_recovery(monkeypatch, error):
    """The block manager had booked the swap; the host blocks were never written, and the swapped sequence
    later resumed from them: wrong tokens, silently."""
    llm = default_llm(**SWAPPING)
    monkeypatch.setattr(model_runner, "copy_blocks_between",
                        raise_on_call(1, error, model_runner.copy_blocks_between))
    with pytest.raises(type(error)):
        llm.generate(SWAP_PROMPTS, SamplingParams(max_tokens=24))
    monkeypatch.undo()
    for later in (lambda: llm.generate([PROMPT], SamplingParams(max_tokens=2)), llm.engine.step,
                  lambda: llm.engine.add_request("after", PROMPT)):
        with pytest.raises(EngineStoppedError, match=f"raised {type(error).__name__}.*copying the KV blocks.*"
                                                     f"build a new LLM"):
            later()
    assert llm.metrics.num_preemptions_swap >= 1  # the step's plan is counted all the same
    fresh = default_llm(**SWAPPING)  # the recovery the error names
    roomy = default_llm(num_gpu_blocks=256)
    params = SamplingParams(max_tokens=24)
    assert [o.token_ids for o in fresh.generate(SWAP_PROMPTS, params)] == \
           [o.token_ids for o in roomy.generate(SWAP_PROMPTS, params)]


def test_a_step_whose_copy_on_write_raises_stops_the_engine(monkeypatch):
    llm = default_llm(block_size=8)
    backend = llm.engine.runner.backend
    monkeypatch.setattr(backend, "copy_blocks", raise_on_call(1, KeyboardInterrupt(), backend.copy_blocks))
    with pytest.raises(KeyboardInterrupt):  # three samples share the prompt's last, partly filled block
        llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=0))
    with pytest.raises(EngineStoppedError, match="copying the KV blocks"):
        llm.generate([PROMPT])


def test_a_step_that_raises_while_recording_its_tokens_stops_the_engine(monkeypatch):
    """Half recorded, a sequence had its tokens counted computed but no token drawn: nothing ran again."""
    llm = default_llm()
    engine = llm.engine
    postprocess = engine.scheduler.postprocess

    def half(plan, tokens, now):
        postprocess(plan, tokens[:1], now)
        raise KeyboardInterrupt
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=4))
    engine.add_request("b", PROMPT, SamplingParams(max_tokens=4))
    monkeypatch.setattr(engine.scheduler, "postprocess", half)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    monkeypatch.undo()
    with pytest.raises(EngineStoppedError, match="recording the tokens it sampled.*build a new LLM"):
        engine.step()
    engine.abort_request("a")  # aborting still frees what a request holds
    engine.abort_request("b")
    check_invariants(engine)


def test_an_abort_that_raises_after_the_engine_stopped_keeps_the_first_cause(monkeypatch):
    """The stop's message names what stopped it, not a later failure while aborting (it was replaced)."""
    engine = default_llm().engine
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=4))
    monkeypatch.setattr(engine.scheduler, "postprocess", lambda plan, tokens, now: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        engine.step()
    monkeypatch.setattr(engine.scheduler, "finish", lambda seq: [][0])
    with pytest.raises(IndexError):
        engine.abort_request("a")
    with pytest.raises(EngineStoppedError, match="step 1 raised ZeroDivisionError.*recording the tokens it sampled"):
        engine.step()


def test_a_step_that_raises_before_its_moves_leaves_the_engine_usable(monkeypatch):
    """A failed forward pass changes nothing booked: the step is simply taken again."""
    llm = default_llm(**SWAPPING)
    roomy = default_llm(num_gpu_blocks=256)
    params = SamplingParams(max_tokens=24)
    monkeypatch.setattr(llm.engine.runner, "forward", raise_on_call(5, KeyboardInterrupt(), llm.engine.runner.forward))
    with pytest.raises(KeyboardInterrupt):
        llm.generate(SWAP_PROMPTS, params)
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(SWAP_PROMPTS, params)] == \
           [o.token_ids for o in roomy.generate(SWAP_PROMPTS, params)]
    assert llm.metrics.num_preemptions_swap >= 1


# ---- 7: generation_config.json ---------------------------------------------------------------------
def hf_generate(folder, prompt, max_tokens):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("as_list", [True, False])
def test_generation_config_end_ids_stop_as_transformers_stops(checkpoint, tmp_path, as_list):
    """Instruct checkpoints (Llama-3) list their end-of-turn id only in generation_config.json."""
    folder = shutil.copytree(checkpoint("llama-gqa"), tmp_path / "model")
    prompt = [3, 14, 15, 92, 65]
    free = hf_generate(folder, prompt, 12)
    at = next(i for i in range(3, 12) if free[i] not in free[:i])  # the first time this token comes
    end, unused = free[at], next(t for t in range(96) if t not in free)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [unused, end] if as_list else end}))
    expected = hf_generate(folder, prompt, 12)
    assert expected == free[:at + 1]
    llm = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=32), verbose=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=12))[0]
    assert out.token_ids == expected and out.finish_reason == "stop"
    assert llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids == free


@pytest.mark.parametrize("file", ["generation_config.json", "config.json"])
def test_a_bad_end_id_is_refused_naming_its_file(checkpoint, tmp_path, file):
    folder = shutil.copytree(checkpoint("llama-gqa"), tmp_path / "model")
    path = folder / file
    raw = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**raw, "eos_token_id": ["</s>"]}))
    with pytest.raises(CheckpointError, match=f"{file}: eos_token_id must be a token id or a list of them"):
        LLM(folder, EngineConfig(num_gpu_blocks=32), verbose=False)


# ---- 10: inputs of the wrong shape get errors that say what to write -------------------------------
def test_a_dict_for_the_config_says_to_build_an_engine_config():
    with pytest.raises(TypeError, match=r"config must be an EngineConfig, got a dict.*EngineConfig\(\*\*that_dict\)"):
        LLM("default", {"num_gpu_blocks": 64}, verbose=False)


@pytest.mark.parametrize("name, instance", [
    ("allocator", lambda: BlockAllocator(8)),
    ("scheduler", lambda: object.__new__(Scheduler)),
])
def test_an_instance_where_a_class_is_expected_says_to_pass_the_class(name, instance):
    built = instance()
    kind = type(built).__name__
    with pytest.raises(TypeError, match=rf"{name} must be .*got an instance of {kind}.*pass the class itself "
                                        rf"\({name}={kind}\)"):
        LLM("default", EngineConfig(num_gpu_blocks=64), verbose=False, **{name: built})


@pytest.mark.parametrize("name, cls", [("preemption_policy", LatestArrivalPolicy), ("block_sharing", BlockSharing),
                                       ("oversubscription_detector", OversubscriptionDetector)])
def test_a_class_where_an_object_is_expected_says_to_pass_an_instance(name, cls):
    with pytest.raises(TypeError, match=rf"{name} must be an object, got the class {cls.__name__}; pass an instance "
                                        rf"\({name}={cls.__name__}\(\)\)"):
        LLM("default", EngineConfig(num_gpu_blocks=64), verbose=False, **{name: cls})


def test_a_text_prompt_with_a_lone_surrogate_is_rejected_by_name(llm):
    outs = llm.generate(["ab\ud800c", "The KV cache"], SamplingParams(max_tokens=2))
    assert outs[0].rejected and "lone surrogate '\\ud800' at character 2" in outs[0].error
    assert outs[1].finish_reason == "length"
    with pytest.raises(ValueError, match="lone surrogate '\\\\udcff' at character 3"):
        llm.tokenizer.encode("hi \udcff")


def test_a_tuple_of_token_ids_is_one_prompt_as_a_list_is(llm):
    params = SamplingParams(max_tokens=3)
    as_tuple = llm.generate((5, 6, 7), params)
    assert len(as_tuple) == 1 and as_tuple[0].token_ids == llm.generate([5, 6, 7], params)[0].token_ids
    assert [o.token_ids for o in llm.generate(((5, 6, 7), [8, 9]), params)] == \
           [o.token_ids for o in llm.generate([[5, 6, 7], [8, 9]], params)]


class CountedId(str):
    """A request id that counts how often it is compared: a scan of the ready list compares it with each entry."""
    comparisons = 0
    __hash__ = str.__hash__

    def __eq__(self, other):
        CountedId.comparisons += 1
        return str.__eq__(self, other)


def test_rejected_requests_are_found_without_scanning_the_ready_list(llm):
    """has_request compared each new id with every rejection waiting: quadratic in the queue."""
    engine = llm.engine
    count = 300
    CountedId.comparisons = 0
    for i in range(count):
        engine.add_request(CountedId(f"bad-{i}"), [])
    assert CountedId.comparisons <= count  # a scan makes about count**2 / 2 of them
    assert len(engine.step()) == count
