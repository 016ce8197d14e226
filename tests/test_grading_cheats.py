"""Cheats that rewrite what the sandbox measures, graded as a class: each gets at most half the points of
the tasks it cheats.

Isolation keeps kvlib's answers out of the sandbox (``tests/test_grading.py``); these cheats need no
answer. The learner's code runs in the sandbox's interpreter before the checks, so it can rewrite the
grading module's helpers or the sandbox's loop, or send the same observations whatever the seed. Where
a check's comparison is one-sided or its answer is the same for every correct piece, the sandbox
sends back only the piece's decisions and the grader measures them (``decisions.py``).
"""
from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from fence import without_the_fence

from kvlib.course.grading import lab07, lab09
from kvlib.course.grading.checks import FEEDBACK_SEED, Observed, observe, verdict
from kvlib.course.grading.decisions import DECIDED, Answers, answer_of, choice_of, measured
from kvlib.course.grading.results import FAIL, PASS
from kvlib.course.grading.runner import grade_folder
from kvlib.course.grading.sandbox import Limits, reply_to_observed
from kvlib.course.labs import remove_hidden_tests

ROOT = Path(__file__).resolve().parents[1]
LABS = {"lab03": ROOT / "labs" / "lab03_decode_kernel.ipynb", "lab07": ROOT / "labs" / "lab07_victim_selection.ipynb",
        "lab09": ROOT / "labs" / "lab09_preemption_metrics.ipynb"}

# Lesson 08's mistake (the candidate holding the most shared blocks) as the policy behind the patches.
SHARED_FIRST = ("class MyVictimPolicy(LatestArrivalPolicy):\n    _patched = _patch()\n\n"
                "    def select_victim(self, candidates, shortfall):\n"
                "        return max(reversed(candidates), key=lambda c: c.num_shared_blocks)\n")
SHRINK = ("def _shrink(value):\n    if isinstance(value, dict):\n        return {k: _shrink(v) for k, v in value.items()}\n"
          "    if isinstance(value, list) and len(value) == 2 and value[1] in (True, False):\n        return [1, False]\n"
          "    return 0 if type(value) is int else value\n")
TORCH_DECODE = (
    "def _torch_decode(query, k_cache, v_cache, block_tables, context_lens, scale):\n"
    "    group = query.shape[1] // k_cache.shape[2]\n"
    "    answer = torch.empty(query.shape, dtype=torch.float32, device=query.device)\n"
    "    for i, n in enumerate(context_lens.tolist()):\n"
    "        blocks = block_tables[i, : -(-n // k_cache.shape[1])].long()\n"
    "        k = k_cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, 1)\n"
    "        v = v_cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, 1)\n"
    "        weights = (torch.einsum('hd,khd->hk', query[i].float(), k) * scale).softmax(-1)\n"
    "        answer[i] = torch.einsum('hk,khd->hd', weights, v)\n"
    "    return answer.to(query.dtype).contiguous()\n")
CHEATS = {
    # attention in torch; the grading module's launch check is replaced by a plain call at load time
    "lab03_patches_the_launch_check": ("lab03", ("kernel", "engine"), [
        "import torch\n\n\n" + TORCH_DECODE + "\n\ndef _patch():\n    import kvlib.course.grading.lab03 as g\n"
        "    g.call_checked = lambda decode, *inputs: decode(*inputs)\n    return True\n\n\n_PATCHED = _patch()\n\n\n"
        "def paged_decode(query, k_cache, v_cache, block_tables, context_lens, scale):\n"
        "    return _PATCHED and _torch_decode(query, k_cache, v_cache, block_tables, context_lens, scale)\n"]),
    # attention in torch, handed to a Triton kernel as an integer address that it casts to a pointer and copies
    "lab03_relays_an_address": ("lab03", ("kernel", "engine"), [
        "import torch\nimport triton\nimport triton.language as tl\n\nTL_TYPES = {torch.float32: tl.float32, "
        "torch.float16: tl.float16}\n\n\n@triton.jit\ndef relay_kernel(out, q, k, v, answer_at, n, DTYPE: tl.constexpr, "
        "BLOCK: tl.constexpr):\n    offsets = tl.arange(0, BLOCK)\n    source = answer_at.to(tl.pointer_type(DTYPE))\n"
        "    tl.store(out + offsets, tl.load(source + offsets, mask=offsets < n), mask=offsets < n)\n\n\n" + TORCH_DECODE +
        "\n\ndef paged_decode(query, k_cache, v_cache, block_tables, context_lens, scale):\n"
        "    answer = _torch_decode(query, k_cache, v_cache, block_tables, context_lens, scale)\n"
        "    out = torch.empty_like(query)\n    relay_kernel[(1,)](out, query, k_cache, v_cache, answer.data_ptr(), "
        "query.numel(), DTYPE=TL_TYPES[query.dtype], BLOCK=triton.next_power_of_2(query.numel()))\n    return out\n"]),
    # the grading module's replay says one victim and no stall; the engine's costs are reported as none
    "lab07_patches_the_grading_module": ("lab07", ("select_victim", "engine"), [
        "from kvlib.core.preemption import LatestArrivalPolicy\n\n\ndef _patch():\n"
        "    import kvlib.course.grading.lab07 as g\n    real = g._run\n"
        "    g.replay = lambda policy, candidates, shortfall: [min(candidates, key=lambda c: c.is_requester)]\n"
        "    g._run = lambda cls, w, seed: (lambda out: ({**out[0], 'blocks swapped out': 0, 'tokens recomputed': 0},"
        " out[1]))(real(cls, w, seed))\n    return True\n\n\n" + SHARED_FIRST]),
    # the sandbox's loop runs each scenario, then shrinks every count a one-sided check compares
    "lab07_patches_the_sandbox_loop": ("lab07", ("select_victim", "engine"), [
        "import sys\n\nfrom kvlib.core.preemption import LatestArrivalPolicy\n\n\n" + SHRINK + "\n\ndef _patch():\n"
        "    import kvlib.course.grading.checks as c\n    import kvlib.course.grading.sandbox as s\n\n"
        "    def fake(*args):\n        check, piece, seed = args[-3:]\n        seen = c.observe(check, piece, seed)\n"
        "        forge = seen.status == 'observed' and check.compare is not c.same\n"
        "        return c.Observed('observed', _shrink(seen.observation)) if forge else seen\n"
        "    for loop, name in ((m, n) for m in (s, sys.modules['__main__']) for n in ('observe', 'decided')):\n"
        "        if hasattr(loop, name):\n            setattr(loop, name, fake)\n"
        "    return True\n\n\n" + SHARED_FIRST]),
    # the sandbox sends, for every check, what kvlib's detector showed in the notebook's feedback
    "lab09_sends_the_feedback_answers": ("lab09", ("engine",), [
        "import json\nimport sys\n\n\ndef _patch():\n    import kvlib.course.grading.checks as c\n"
        "    import kvlib.course.grading.sandbox as s\n    seen = json.loads(@SEEN@)\n\n"
        "    def fake(*args):\n        return c.Observed('observed', seen[args[-3].hint])\n"
        "    for loop, name in ((m, n) for m in (s, sys.modules['__main__']) for n in ('observe', 'decided')):\n"
        "        if hasattr(loop, name):\n            setattr(loop, name, fake)\n"
        "    return True\n\n\nclass MyOversubscriptionDetector:\n    _patched = _patch()\n\n"
        "    def observe(self, metrics):\n        return None\n"]),
    # what the hints say, taken literally: warn once when 8 requests have finished, whatever their preemptions
    "lab09_warns_at_eight": ("lab09", ("detector",), [
        "class MyOversubscriptionDetector:\n    def __init__(self):\n        self.warned = False\n\n"
        "    def observe(self, metrics):\n        if self.warned or metrics.num_finished < 8:\n            return None\n"
        "        self.warned = True\n        return 'oversubscribed: 2.0 preemptions per request; raise num_gpu_blocks "
        "or lower max_num_seqs'\n"]),
}


def _feedback_answers() -> str:
    return json.dumps({c.hint: observe(c, t.reference(), FEEDBACK_SEED).observation
                       for t in (lab09.detector, lab09.engine) for c in t.checks})


def _submission(folder: Path, name: str, lab: str, cells: list[str]) -> None:
    nb = nbformat.read(LABS[lab], as_version=4)
    for cell in nb.cells:
        cell.source = remove_hidden_tests(cell.source)
    nb.cells += [nbformat.v4.new_code_cell(c.replace("@SEEN@", repr(_feedback_answers()))) for c in cells]
    nbformat.write(nb, folder / f"{name}.ipynb")


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("cheats")
    for name, (lab, _, cells) in CHEATS.items():
        _submission(folder, name, lab, cells)
    with without_the_fence():  # what the sandbox measures, on its own: tests/test_grading_reach.py has the fence
        return {r.notebook.stem: r for r in grade_folder(folder, jobs=2, limits=Limits(check_scale=2.0), seed=4242)}


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_a_cheat_gets_at_most_half_the_points_of_the_tasks_it_cheats(graded, name):
    report, cheated = graded[name], CHEATS[name][1]
    points = sum(report.task(t).points for t in cheated)
    assert points <= sum(report.task(t).max_points for t in cheated) / 2, report.table()


def test_the_patches_would_pass_a_one_sided_check_if_it_were_measured_in_the_sandbox():
    """The cheats are real: the sandbox loop's shrunken observation passes lab 07's comparison."""
    check = lab07.select_victim.named("requester_keeps_running")
    seen = observe(check, lab07.select_victim.reference(), 3).observation
    shrunk = {key: [1, False] for key in seen}
    reference = observe(check, lab07.select_victim.reference(), 3)
    assert verdict(check, Observed("observed", shrunk), reference).status == PASS
    assert verdict(check, measured(lab07.select_victim, check, Observed("observed", shrunk), 3), reference).status == FAIL


def test_decisions_replayed_by_the_grader_observe_what_the_piece_did_in_the_sandbox():
    from kvlib.core.preemption import SparingPolicy
    for task in (lab07.select_victim, lab09.detector):
        piece = SparingPolicy if task is lab07.select_victim else lab09._reference_detector()
        for check in task.checks:
            log: list = []
            direct = observe(check, piece, 7)
            assert observe(check, task.decisions.record(piece, log), 7) == direct and log, check.name
            assert measured(task, check, Observed(DECIDED, log), 7) == direct, check.name


def test_decisions_that_run_out_or_name_no_candidate_fail_the_check():
    check = lab07.select_victim.named("one_victim_when_one_suffices")
    assert measured(lab07.select_victim, check, Observed(DECIDED, []), 1).status == FAIL
    failed = measured(lab07.select_victim, check, Observed(DECIDED, ["a made-up victim"] * 40), 1)
    assert failed.status == FAIL and "a made-up victim" in failed.message


def test_answers_that_are_not_data_keep_their_truth_and_text():
    class Loud:
        def observe(self, metrics):
            return ["warn", 1]
    log: list = []
    answer_of("observe").record(Loud, log)().observe(None)
    replayed = answer_of("observe").replay(Answers(log))().observe(None)
    assert bool(replayed) and str(replayed) == "['warn', 1]" and not isinstance(replayed, str)
    picked = choice_of("pick").replay(Answers([1, True]))()
    assert picked.pick(["a", "b"]) == "b" and str(picked.pick(["a", "b"])) == "True"


def test_a_reply_of_decisions_is_shape_checked():
    assert reply_to_observed({"status": DECIDED, "decisions": [1, 2]}) == Observed(DECIDED, [1, 2])
    with pytest.raises(ValueError):
        reply_to_observed({"status": DECIDED, "observation": [1]})


class CarelessAllocator:
    """Refuses nothing: a double free, an unowned id and an empty pool all pass silently (or as IndexError)."""

    def __init__(self, num_blocks: int):
        self.num_blocks, self.free_ids, self.counts = num_blocks, list(range(num_blocks)), [0] * num_blocks

    num_free = property(lambda self: len(self.free_ids))
    num_used = property(lambda self: self.num_blocks - len(self.free_ids))

    def ref_count(self, block_id):
        return self.counts[block_id]

    def can_allocate(self, num_blocks, watermark_blocks=0):
        from kvlib.core.block_allocator import AllocStatus
        if num_blocks > self.num_blocks - watermark_blocks:
            return AllocStatus.NEVER
        return AllocStatus.OK if self.num_free - num_blocks >= watermark_blocks else AllocStatus.LATER

    def allocate(self):
        block = self.free_ids.pop(0)
        self.counts[block] = 1
        return block

    def fork(self, block_id):
        self.counts[block_id] += 1
        return block_id

    def free(self, block_id):
        self.counts[block_id] -= 1
        if self.counts[block_id] == 0:
            self.free_ids.append(block_id)


def test_lab_02s_answers_are_measured_by_the_grader_so_a_rebound_raised_gains_nothing(monkeypatch):
    """A submission rebound lab 02's ``raised`` in the sandbox to name BlockAllocatorError whatever happened, and the
    careless allocator's double-free check passed: its observation was made in the sandbox. Now the sandbox sends the
    allocator's answers (what it returned or raised, call by call) and the grader observes them itself."""
    from kvlib.course.grading import lab02
    from kvlib.course.grading.decisions import decided
    check = lab02.allocator.named("double_free_raises")
    reference = observe(check, lab02.allocator.reference(), 11)
    with monkeypatch.context() as sandbox:
        sandbox.setattr(lab02, "raised", lambda action: "BlockAllocatorError")
        forged = observe(check, CarelessAllocator, 11)
        sent = decided(lab02.allocator, check, CarelessAllocator, 11)
    assert verdict(check, forged, reference).status == PASS  # the cheat is real where the sandbox observes
    assert sent.status == DECIDED
    assert verdict(check, measured(lab02.allocator, check, sent, 11), reference).status == FAIL


def test_answers_that_part_from_the_graders_questions_fail_the_check():
    from kvlib.course.grading import lab02
    from kvlib.course.grading.decisions import decided
    check = lab02.allocator.named("refcount")
    sent = decided(lab02.allocator, check, CarelessAllocator, 3)
    assert measured(lab02.allocator, check, sent, 3).status == "observed"
    swapped = Observed(DECIDED, [[n, "allocate" if name == "fork" else name, answer] for n, name, answer in
                                 sent.observation])
    assert measured(lab02.allocator, check, swapped, 3).status == FAIL
    lying = Observed(DECIDED, [[n, name, {"stand_in": "an int that equals anything", "truthy": True}]
                               if name == "ref_count" else [n, name, answer] for n, name, answer in sent.observation])
    assert verdict(check, measured(lab02.allocator, check, lying, 3),
                   observe(check, lab02.allocator.reference(), 3)).status == FAIL


def test_an_allocator_answering_numpy_integers_is_measured_by_their_values():
    """Honest, and usable by the engine in the sandbox: the grader's replay must index with them too."""
    import numpy as np

    from kvlib.course.grading import lab02
    from kvlib.course.grading.decisions import decided

    class NumpyIds(CarelessAllocator):
        def allocate(self):
            return np.int64(super().allocate())

    check = lab02.allocator.named("free_returns_block")
    sent = decided(lab02.allocator, check, NumpyIds, 5)
    assert verdict(check, measured(lab02.allocator, check, sent, 5),
                   observe(check, lab02.allocator.reference(), 5)).status == PASS


class SharingThatNeverCopies:
    """Forks correctly and never copies: samples write into each other's blocks."""

    def fork(self, allocator, blocks):
        return [allocator.fork(block) for block in blocks]

    def make_writable(self, allocator, blocks, index, take_block):
        return None


def test_lab_05s_acts_are_done_again_by_the_grader_so_a_forged_engine_observation_gains_nothing(monkeypatch):
    """Labs 03-06, 08 and 10 observed in the sandbox, where a module bound to another name (``m = lab; m.f = ...``)
    is out of the fence's sight. Lab 05's sandbox now sends what each call did (the allocator's acts, take_block's
    blocks, the tables after, the answer), and the grader does it again to its own pool and engine."""
    from kvlib.course.grading import lab05
    from kvlib.course.grading.decisions import decided
    check = lab05.engine.named("greedy_samples")
    reference = observe(check, lab05.engine.reference(), 6)
    forged = reference.observation
    with monkeypatch.context() as sandbox:
        sandbox.setattr(lab05, "_observed", lambda llm, outputs: forged)
        assert verdict(check, observe(check, SharingThatNeverCopies, 6), reference).status == PASS  # the cheat is real
        sent = decided(lab05.engine, check, SharingThatNeverCopies, 6)
    assert sent.status == DECIDED
    result = verdict(check, measured(lab05.engine, check, sent, 6), reference)
    assert result.status == FAIL and "copy-on-write copies: yours is 0" in result.message


def test_lab_05s_record_done_again_gives_what_the_piece_gave_and_parts_when_forged():
    from kvlib.core.sharing import BlockSharing
    from kvlib.course.grading import lab05
    for piece in (BlockSharing, SharingThatNeverCopies):
        for check in lab05.fork.checks + lab05.copy_on_write.checks + [lab05.engine.named("under_preemption")]:
            log: list = []
            direct = observe(check, piece, 9)
            assert observe(check, lab05.ACTS.record(piece, log), 9) == direct and log, check.name
            assert measured(lab05.copy_on_write, check, Observed(DECIDED, log), 9) == direct, check.name
    check = lab05.copy_on_write.named("shared_block_gets_a_copy")
    log = []
    observe(check, lab05.ACTS.record(BlockSharing, log), 9)
    taken = [[n, name, [[i, act, args, keywords, answer + 1 if act is None else answer]
                        for i, act, args, keywords, answer in effects],
              tables, returned] for n, name, effects, tables, returned in log]  # take_block's blocks misreported
    failed = measured(lab05.copy_on_write, check, Observed(DECIDED, taken), 9)
    assert failed.status == FAIL and "record parts from the grader" in failed.message
    forged_tables = [[n, name, effects, [[i, [0] * len(items)] for i, items in tables], returned]
                     for n, name, effects, tables, returned in log]  # graded as the acts that would make them
    assert verdict(check, measured(lab05.copy_on_write, check, Observed(DECIDED, forged_tables), 9),
                   observe(check, BlockSharing, 9)).status == FAIL


class TierThatNeverFrees:
    """Evicts by forgetting, never frees: the host pool fills with blocks nobody keeps."""

    def __init__(self, allocator):
        self.allocator, self.kept = allocator, {}

    def put(self, name, tokens, host_block):
        from kvlib.core.prefix_cache import CachedBlock
        self.kept[name] = CachedBlock(name, host_block, tokens)

    def lookup(self, name, tokens):
        entry = self.kept.get(name)
        return entry if entry is not None and entry.tokens == tokens else None

    def touch(self, name):
        self.kept[name] = self.kept.pop(name)

    def evict_one(self):
        for name, entry in self.kept.items():
            if self.allocator.ref_count(entry.block_id) == 1:
                del self.kept[name]
                return True
        return False

    def __contains__(self, name):
        return name in self.kept

    def __iter__(self):
        return iter(list(self.kept.values()))

    @property
    def num_cached(self):
        return len(self.kept)


def test_lab_10s_tier_is_done_again_by_the_grader_so_a_patch_beside_it_gains_nothing(monkeypatch):
    """Lab 10 observed the tier in the sandbox, where a module bound to another name could rewrite the check's
    helpers (here: a wrapper that frees what the tier forgot); now the grader does each call's acts again on its
    own host pool, and holds evict_one to its word there."""
    from kvlib.course.grading import lab10
    from kvlib.course.grading.decisions import decided
    check = lab10.tier.named("evicts_the_least_recently_used")
    reference = observe(check, lab10.tier.reference(), 8)

    def mended(tier_cls):  # a patch that frees what the learner's tier forgot, beside it
        class Mended(tier_cls):
            def __init__(self, allocator):
                super().__init__(allocator)
                self.pool = allocator

            def evict_one(self):
                before = {entry.block_id for entry in self}
                found = super().evict_one()
                for block in before - {entry.block_id for entry in self}:
                    self.pool.free(block)
                return found
        return Mended
    with monkeypatch.context() as sandbox:
        sandbox.setattr(lab10, "checked", mended)
        assert verdict(check, observe(check, TierThatNeverFrees, 8), reference).status == PASS  # the cheat is real
        sent = decided(lab10.tier, check, TierThatNeverFrees, 8)
    assert sent.status == DECIDED
    result = verdict(check, measured(lab10.tier, check, sent, 8), reference)
    assert result.status == FAIL  # the patch's own calls part from the grader's, or its frees are missing
    plain = verdict(check, measured(lab10.tier, check, decided(lab10.tier, check, TierThatNeverFrees, 8), 8), reference)
    assert plain.status == FAIL and "allocator.free, once" in plain.message


def test_lab_10s_record_done_again_gives_what_the_tier_gave():
    from kvlib.core.prefix_cache import HostPrefixTier
    from kvlib.course.grading import lab10
    for piece in (HostPrefixTier, TierThatNeverFrees):
        for check in lab10.tier.checks + lab10.engine.checks:
            log: list = []
            direct = observe(check, piece, 5)
            assert observe(check, lab10.ACTS.record(piece, log), 5) == direct and log, check.name
            assert measured(lab10.tier, check, Observed(DECIDED, log), 5) == direct, check.name


def _manager_that_keeps_host_blocks():
    from kvlib.core.block_manager import BlockManager

    class KeepsHostBlocks(BlockManager):
        """kvlib's mechanisms, but swap_in never lets go of the host blocks: the host pool leaks."""

        def swap_in(self, seq):
            for host in seq.host_blocks:
                block = self.take()
                self.copy_in(host, block)
                seq.block_table.append(block)
            seq.host_blocks = []
    return KeepsHostBlocks


def test_lab_06s_mechanisms_are_done_again_by_the_grader_so_switching_off_the_invariants_gains_nothing(monkeypatch):
    """A leaking swap_in gives the right tokens while the host pool has room; only the invariant checks after every
    step catch it. The sandbox could serve without them (``s = lab06; s.serve_checked = ...``); now the grader
    serves the recorded mechanisms itself, with the checks."""
    from kvlib.course.grading import lab06
    from kvlib.course.grading.decisions import decided
    check = lab06.engine.named("swaps_whole_sequences")
    reference = observe(check, lab06.engine.reference(), 12)
    leaky = _manager_that_keeps_host_blocks()
    with monkeypatch.context() as sandbox:
        sandbox.setattr(lab06, "serve_checked", lambda llm, prompts, params, max_steps: llm.generate(prompts, params))
        assert verdict(check, observe(check, leaky, 12), reference).status == PASS  # the cheat is real
        sent = decided(lab06.engine, check, leaky, 12)
    result = verdict(check, measured(lab06.engine, check, sent, 12), reference)
    assert sent.status == DECIDED and result.status == FAIL and "host block" in result.message


def test_lab_06s_record_done_again_gives_what_the_mechanisms_gave():
    from kvlib.core.block_manager import BlockManager
    from kvlib.course.grading import lab06
    for piece in (BlockManager, _manager_that_keeps_host_blocks()):
        shared_tails = lab06.engine.named("swaps_partial_tails_of_shared_sequences")
        for check in [*lab06.swap.checks, *lab06.drop.checks, shared_tails]:
            log: list = []
            direct = observe(check, piece, 4)
            assert observe(check, lab06.MOVES.record(piece, log), 4) == direct and log, check.name
            assert measured(lab06.swap, check, Observed(DECIDED, log), 4) == direct, check.name


def _scheduler_blind_to_the_budget():
    from kvlib.core.scheduler import Scheduler
    from kvlib.core.sequence import SequenceStatus

    class BudgetBlind(Scheduler):
        """Gives every running sequence all its uncomputed tokens and takes none from the budget, which the
        waiting sequences then get whole: the tokens come out right, the budget is broken."""

        def schedule_running(self, out, budget):
            for seq in list(self.running):
                if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens == 0:
                    continue
                num_new = seq.num_uncomputed_tokens
                end = seq.num_computed_tokens + num_new
                if self.make_room(seq, end, out):
                    self.start(seq, num_new, end, out)
            return budget
    return BudgetBlind


def test_lab_04s_step_is_done_again_by_the_grader_so_switching_off_the_plan_checks_gains_nothing(monkeypatch):
    """A scheduler that ignores the token budget serves the right tokens; only the checks of every plan catch it.
    The sandbox could serve without them (``c = lab04; c.checked = ...``); now the grader replays the step itself."""
    from kvlib.course.grading import lab04
    from kvlib.course.grading.decisions import decided
    check = lab04.engine.named("serves_chunked_prefills_and_recomputation")
    reference = observe(check, lab04.engine.reference(), 3)
    blind = _scheduler_blind_to_the_budget()
    with monkeypatch.context() as sandbox:
        sandbox.setattr(lab04, "checked", lambda scheduler_cls: scheduler_cls)
        assert verdict(check, observe(check, blind, 3), reference).status == PASS  # the cheat is real
        sent = decided(lab04.engine, check, blind, 3)
    result = verdict(check, measured(lab04.engine, check, sent, 3), reference)
    assert sent.status == DECIDED and result.status == FAIL and "past the budget" in result.message


def test_lab_04s_record_done_again_gives_what_the_step_gave():
    from kvlib.course.grading import lab04
    for piece in (lab04.engine.reference(), _scheduler_blind_to_the_budget()):
        for check in [*lab04.running.checks[:2], *lab04.waiting.checks[:3], lab04.engine.checks[1]]:
            log: list = []
            direct = observe(check, piece, 2)
            assert observe(check, lab04.STEP.record(piece, log), 2) == direct and log, check.name
            assert measured(lab04.engine, check, Observed(DECIDED, log), 2) == direct, check.name


def test_lab_08s_choices_are_asked_again_by_the_grader():
    """Lab 08's choose_mode answers come back as a record; the grader's own scenarios and engine ask for them
    again, so what is measured (modes, preemptions, fallbacks) is measured there."""
    from kvlib.core.preemption import LatestArrivalPolicy
    from kvlib.course.grading import lab08
    from kvlib.course.grading.decisions import decided

    class AlwaysSwaps(LatestArrivalPolicy):
        def choose_mode(self, victim, context):
            return "swap"
    for piece in (lab08.engine.reference(), AlwaysSwaps):
        for task in (lab08.choose_mode, lab08.engine):
            for check in task.checks:
                sent = decided(task, check, piece, 6)
                assert sent.status == DECIDED and measured(task, check, sent, 6) == observe(check, piece, 6)
    check = lab08.engine.named("small_host_pool")
    sent = decided(lab08.engine, check, AlwaysSwaps, 6)
    recomputes = Observed(DECIDED, [[*entry[:5], "recompute", entry[6]] for entry in sent.observation])
    assert measured(lab08.engine, check, recomputes, 6) != observe(check, AlwaysSwaps, 6)  # graded as what it answered


def test_a_record_answers_only_the_questions_it_was_asked():
    """A record of a subclass's calls is tied to what each call was given: replayed where the grader asks other
    questions (another seed's scenario), it fails, saying so. It answered them in order, whatever they were."""
    from kvlib.course.grading import lab08
    from kvlib.course.grading.decisions import decided
    from kvlib.course.grading.results import FAIL
    refused = 0
    for task in (lab08.choose_mode, lab08.engine):
        piece = task.reference()
        for check in task.checks:
            sent = decided(task, check, piece, 6)
            assert measured(task, check, sent, 6) == observe(check, piece, 6), check.name
            elsewhere = measured(task, check, sent, 11)
            if elsewhere != observe(check, piece, 11):
                assert elsewhere.status == FAIL and "answers other questions" in elsewhere.message, elsewhere
                refused += 1
    assert refused >= 3
