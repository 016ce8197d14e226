"""Lab 03 grading: only a Triton kernel of the learner's own, computing from the inputs alone, scores.

The realistic kernel bugs are test data in ``tests/lab_bugs/lab03.py`` (``test_labs_graded.py`` grades
them). Here: answers computed in torch score zero, however a kernel of the learner's dresses them up
(launched alongside, copying them out, reading them from a scratch tensor or an input); kvlib's own
decode is not there; the launch log leaves Triton as it found it; and two notebooks are graded the
way ``kvlib grade`` runs them.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from notebook_cells import graded_cells

from kvlib import kernels  # importing kvlib first switches on the Triton interpreter where there is no GPU
from kvlib.attention.torch_backend import gather_sequence_kv
from kvlib.course.grading import grade_notebook, lab03
from kvlib.course.grading.results import NOT_IMPLEMENTED, PASS
from kvlib.course.grading.runner import InProcess, grade_cells

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="Triton is not installed")

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab03_decode_kernel.ipynb"
LAB = ROOT / "labs" / "lab03_decode_kernel.ipynb"


def torch_answer(query, k_cache, v_cache, block_tables, context_lens, scale):
    """A correct answer in plain torch (kvlib's own decode is hidden while grading)."""
    out = torch.empty_like(query)
    group = query.shape[1] // k_cache.shape[2]
    for i, n in enumerate(context_lens.tolist()):
        k, v = (gather_sequence_kv(c, block_tables[i], n).float().repeat_interleave(group, 1) for c in (k_cache, v_cache))
        weights = (torch.einsum("hd,khd->hk", query[i].float(), k) * scale).softmax(-1)
        out[i] = torch.einsum("hk,khd->hd", weights, v).to(query.dtype)
    return out


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def copy(dst, src, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        tl.store(dst + offsets, tl.load(src + offsets, mask=offsets < n), mask=offsets < n)

    @triton.jit
    def touch(out, q, k, v):  # is handed everything, computes nothing
        tl.store(out, tl.load(out))
    return copy, touch


def copy_of_a_torch_answer(query, k_cache, v_cache, block_tables, context_lens, scale):
    answer = torch_answer(query, k_cache, v_cache, block_tables, context_lens, scale).contiguous()
    out = torch.empty_like(answer)
    _kernels()[0][(1,)](out, answer, answer.numel(), BLOCK=8192)
    return out


def answer_written_before_the_kernel(query, k_cache, v_cache, block_tables, context_lens, scale):
    out = torch_answer(query, k_cache, v_cache, block_tables, context_lens, scale)
    _kernels()[1][(1,)](out, query, k_cache, v_cache)
    return out


def answer_written_after_the_kernel(query, k_cache, v_cache, block_tables, context_lens, scale):
    out = torch.empty_like(query)
    _kernels()[1][(1,)](out, query, k_cache, v_cache)
    return out.copy_(torch_answer(query, k_cache, v_cache, block_tables, context_lens, scale))


def answer_smuggled_in_the_query(query, k_cache, v_cache, block_tables, context_lens, scale):
    answer = torch_answer(query, k_cache, v_cache, block_tables, context_lens, scale)
    query.copy_(answer)
    out = torch.empty_like(query)
    _kernels()[0][(1,)](out, query, query.numel(), BLOCK=8192)
    _kernels()[1][(1,)](out, query, k_cache, v_cache)
    return out


def kvlibs_kernel(query, k_cache, v_cache, block_tables, context_lens, scale):
    return kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale)


@pytest.mark.parametrize("launcher, message", [
    (torch_answer, "your launcher launched no Triton kernel of your own"),
    (copy_of_a_torch_answer, "never handed k_cache and v_cache"),
    (answer_written_before_the_kernel, "values differ from kvlib's"),  # zeroed when handed over: the kernel wrote 0s
    (answer_written_after_the_kernel, "the output changed after your kernel ran"),
    (answer_smuggled_in_the_query, "an input tensor (query, caches, block table or lengths) changed"),
])
def test_an_answer_not_computed_by_your_triton_kernel_scores_zero(launcher, message):
    for result in (lab03.check_kernel(launcher), lab03.check_engine(launcher)):
        assert result.points == 0
        assert all(message in c.message for c in result.checks), [c.message for c in result.checks]


def test_a_copy_kernel_handed_the_caches_too_scores_zero():
    def launcher(query, k_cache, v_cache, block_tables, context_lens, scale):
        answer = torch_answer(query, k_cache, v_cache, block_tables, context_lens, scale).contiguous()
        out = torch.empty_like(answer)
        _kernels()[1][(1,)](out, query, k_cache, v_cache)
        _kernels()[0][(1,)](out, answer, answer.numel(), BLOCK=8192)
        return out
    result = lab03.check_kernel(launcher)
    assert result.points == 0 and all("hand your kernel the inputs themselves" in c.message for c in result.checks)


def test_kvlibs_own_decode_is_not_there():
    for result in (lab03.check_kernel(kvlibs_kernel), lab03.check_kernel(lab03._reference_decode)):
        assert result.points == 0 and {c.status for c in result.checks} == {NOT_IMPLEMENTED}, result
    cells = ["from kvlib.course.grading.lab03 import _reference_decode as paged_decode"]
    assert sum(t.points for t in grade_cells("lab03", cells, runner=InProcess, seed=1).tasks) == 0


def test_the_launch_log_leaves_triton_as_it_found_it():
    from triton.runtime import interpreter, jit
    classes = (jit.JITFunction, interpreter.InterpretedFunction)
    before = [vars(cls).get("run") for cls in classes]
    for launcher in (torch_answer, answer_written_after_the_kernel):
        lab03.check_kernel(launcher)
    assert [vars(cls).get("run") for cls in classes] == before


def test_the_solution_in_this_process_gets_full_marks_and_a_stub_scores_zero():
    import nbformat
    cells = [c.source for c in nbformat.read(SOLUTION, as_version=4).cells if c.cell_type == "code"]
    tasks = grade_cells("lab03", cells, runner=InProcess, seed=11).tasks
    assert all(c.status == PASS for t in tasks for c in t.checks), [c.message for t in tasks for c in t.failed]

    def stub(*args):
        raise NotImplementedError("paged_decode")
    for result in (lab03.check_kernel(stub), lab03.check_engine(stub)):
        assert result.points == 0 and {c.status for c in result.checks} == {NOT_IMPLEMENTED}


# ---- whole notebooks, as `kvlib grade` runs them -----------------------------------------------
def test_the_solution_gets_full_marks():
    report = grade_notebook(SOLUTION)
    assert report.full_marks, report.table()
    assert [(t.task, t.points) for t in report.tasks] == [("kernel", 12), ("engine", 7)]


def test_the_untouched_lab_gets_zero_and_says_not_implemented():
    report = grade_notebook(LAB)
    assert report.points == 0 and report.max_points == 19
    for task in ("kernel", "engine"):
        assert report.task(task).failed_summary() == "not implemented: paged_decode", report.table()


def float16_engine_runs(seed: int):
    """The float16 engine check on ``seed``: the check, what the solution's kernel saw, and what kvlib's decode saw."""
    from kvlib.course.grading.checks import observe
    from kvlib.course.grading.extract import extract, load
    from kvlib.course.grading.hidden import hiding
    solution = load(extract(graded_cells(SOLUTION), ("paged_decode",)).statements).paged_decode
    check = lab03.engine.named("float16_engine")
    with hiding(lab03.engine.hidden):
        yours = observe(check, solution, seed)
    return check, yours, observe(check, lab03._reference_decode, seed)


def test_a_near_tie_that_parts_the_tokens_in_float16_costs_the_solution_nothing():
    """Seed 33: the solution's kernel and kvlib's decode agree within float16's tolerance at every call, but one
    greedy choice is a near tie that rounds the other way; the calls after it decode other tokens. Where a near tie
    falls is the CPU's float16 arithmetic: on an AMD EPYC seed 33 parts; on an Intel Xeon none of seeds 0-119 does."""
    from kvlib.course.grading.checks import verdict
    check, yours, reference = float16_engine_runs(33)
    if yours.observation[lab03.TOKENS] == reference.observation[lab03.TOKENS]:
        pytest.skip("seed 33's float16 near tie rounds the same way on this CPU; the parted path's comparison is "
                    "checked by test_until_the_tokens_part_every_decode_call_is_compared")
    assert verdict(check, yours, reference).status == PASS


def test_the_float16_engine_allows_the_drift_of_a_right_kernel_through_layers_and_steps():
    """Seed 89: the solution's kernel and kvlib's decode the same tokens, but by decode call 8 rounding in earlier
    layers has moved their float16 outputs up to 1.7x the kernel checks' float16 tolerance apart (8 of 260 seeds
    failed the solution that way, 3% of its grades)."""
    from kvlib.course.grading.checks import verdict
    check, yours, reference = float16_engine_runs(89)
    assert yours.observation[lab03.TOKENS] == reference.observation[lab03.TOKENS]  # no near tie: every call compared
    kernels_tolerance = lab03.until_tokens_part(lab03.CLOSE[torch.float16])
    assert "differ from kvlib's" in kernels_tolerance(yours.observation, reference.observation)
    assert verdict(check, yours, reference).status == PASS


def test_until_the_tokens_part_every_decode_call_is_compared():
    within = lab03.until_tokens_part(lab03.CLOSE[torch.float32])
    label = lambda n, step: f"decode call {n} (contexts of [{10 + step}] tokens)"  # noqa: E731
    kvlibs = {label(1, 0): [1.0], label(2, 1): [2.0], label(3, 2): [3.0], lab03.TOKENS: [[5, 6, 7, 8]]}
    parted = {label(1, 0): [1.0], label(2, 1): [2.0], label(3, 2): [9.0], lab03.TOKENS: [[5, 6, 9, 9]]}
    assert within(parted, kvlibs) is None  # step 2 fed another token: not compared
    wrong_before = dict(parted, **{label(2, 1): [2.5]})
    assert "1 of 1 values differ" in within(wrong_before, kvlibs)
    assert within(dict(kvlibs, **{label(3, 2): [9.0]}), kvlibs) is not None  # the same tokens: every call compared
    assert within({label(1, 0): [1.0], lab03.TOKENS: [[5]]}, kvlibs) is not None  # fewer tokens: compared as a whole
