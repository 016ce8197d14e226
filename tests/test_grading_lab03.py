"""Lab 03 grading: only a Triton kernel of the learner's own scores, and the engine checks see what they claim.

The realistic kernel bugs are test data in ``tests/lab_bugs/lab03.py`` (``test_labs_graded.py`` grades
them). Here: answers that are not the learner's Triton kernel score zero with a message that says
why, the launch log leaves Triton as it found it, kvlib's own kernels are refused at extraction, and
two notebooks are graded the way ``kvlib grade`` runs them.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvlib import kernels  # importing kvlib first switches on the Triton interpreter where there is no GPU
from kvlib.attention.torch_backend import paged_attention_reference
from kvlib.course.grading import grade_notebook, lab03
from kvlib.course.grading.extract import extract
from kvlib.course.grading.results import NOT_IMPLEMENTED
from kvlib.course.grading.runner import grade_cells
from kvlib.course.grading.sandbox import InProcess

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="Triton is not installed")

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab03_decode_kernel.ipynb"
LAB = ROOT / "labs" / "lab03_decode_kernel.ipynb"


def torch_launcher(query, k_cache, v_cache, block_tables, context_lens, scale):
    """A correct answer in plain torch: no Triton kernel at all."""
    starts = torch.arange(len(context_lens) + 1, dtype=torch.int32)
    meta = lab03.AttentionMetadata(torch.empty(0, dtype=torch.int64), block_tables, context_lens, starts, 1,
                                   int(context_lens.max()))
    return paged_attention_reference(query, k_cache, v_cache, meta, scale)


def _copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy(dst, src, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        tl.store(dst + offsets, tl.load(src + offsets, mask=offsets < n), mask=offsets < n)
    return copy


def torch_behind_a_kernel(query, k_cache, v_cache, block_tables, context_lens, scale):
    """Computes in torch, then launches a kernel of its own that only copies the answer out."""
    answer = torch_launcher(query, k_cache, v_cache, block_tables, context_lens, scale).contiguous()
    out = torch.empty_like(answer)
    _copy_kernel()[(1,)](out, answer, answer.numel(), BLOCK=4096)
    return out


def kvlibs_kernel(query, k_cache, v_cache, block_tables, context_lens, scale):
    return kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale)


@pytest.mark.parametrize("launcher, message", [
    (torch_launcher, "without launching a Triton kernel of your own"),
    (kvlibs_kernel, "it launched only _paged_decode_kernel"),
    (torch_behind_a_kernel, "never handed k_cache and v_cache themselves"),
])
def test_an_answer_that_is_not_your_own_triton_kernel_scores_zero(launcher, message):
    for result in (lab03.check_kernel(launcher), lab03.check_engine(launcher)):
        assert result.points == 0
        assert all(message in c.message for c in result.checks), [c.message for c in result.checks]


def test_the_launch_log_leaves_triton_as_it_found_it():
    classes = lab03._kernel_classes()
    before = [cls.__dict__["run"] for cls in classes]
    lab03.check_kernel(torch_launcher)
    assert [cls.__dict__["run"] for cls in classes] == before


def test_the_solution_in_this_process_gets_full_marks_and_a_stub_scores_zero():
    import nbformat
    cells = [c.source for c in nbformat.read(SOLUTION, as_version=4).cells if c.cell_type == "code"]
    results = grade_cells("lab03", cells, runner=InProcess)
    assert all(t.full_marks for t in results), [c.message for t in results for c in t.failed]

    def stub(*args):
        raise NotImplementedError("paged_decode")
    for result in (lab03.check_kernel(stub), lab03.check_engine(stub)):
        assert result.points == 0 and {c.status for c in result.checks} == {NOT_IMPLEMENTED}


@pytest.mark.parametrize("source, why", [
    ("from kvlib.kernels import paged_decode_attention\npaged_decode = paged_decode_attention",
     "imports paged_decode_attention from kvlib.kernels"),
    ("from kvlib.attention import torch_backend\n\ndef paged_decode(q, k, v, t, n, s):\n"
     "    return torch_backend.paged_decode_batched(q, k, v, t, n, s)", "imports torch_backend from kvlib.attention"),
    ("import kvlib.kernels.paged_decode as pd\n\ndef paged_decode(q, k, v, t, n, s):\n    return pd.x(q)",
     "imports kvlib.kernels.paged_decode"),
])
def test_kvlibs_own_kernel_or_torch_attention_is_refused(source, why):
    violations = extract([source], lab03.RULES).violations
    assert any(why in v for v in violations), violations


# ---- whole notebooks, as `kvlib grade` runs them -----------------------------------------------
def test_the_solution_gets_full_marks():
    report = grade_notebook(SOLUTION)
    assert report.full_marks, report.table()
    assert [(t.task, t.points) for t in report.tasks] == [("kernel", 10), ("engine", 7)]


def test_the_untouched_lab_gets_zero_and_says_not_implemented():
    report = grade_notebook(LAB)
    assert report.points == 0 and report.max_points == 17
    for task in ("kernel", "engine"):
        assert report.task(task).failed_summary() == "not implemented: paged_decode", report.table()
