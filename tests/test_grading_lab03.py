"""Lab 03 grading: full marks for a correct kernel, zero for the stubs, and a bug costs exactly its checks.

The buggy launchers reproduce classic decode-kernel mistakes around kvlib's own kernel (feeding
it inputs that make it compute what the buggy kernel would) or in a few lines of torch, so they
run in this process. Two notebooks are graded the way ``kvlib grade`` runs them: the solution
and the untouched lab.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvlib import kernels  # importing kvlib first switches on the Triton interpreter where there is no GPU
from kvlib.attention.torch_backend import gather_sequence_kv
from kvlib.course.grading import grade_notebook, lab03
from kvlib.course.grading.results import FAIL, NOT_IMPLEMENTED

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="Triton is not installed")

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab03_decode_kernel.ipynb"
LAB = ROOT / "labs" / "lab03_decode_kernel.ipynb"


# ---- buggy launchers ---------------------------------------------------------------------------
def gqa_by_modulo(query, k_cache, v_cache, block_tables, context_lens, scale):
    """Query head h reads kv head h % num_kv_heads instead of h // group."""
    group = query.shape[1] // k_cache.shape[2]
    return kernels.paged_decode_attention(query, k_cache.repeat(1, 1, group, 1), v_cache.repeat(1, 1, group, 1),
                                  block_tables, context_lens, scale)


def reads_whole_last_block(query, k_cache, v_cache, block_tables, context_lens, scale):
    """Masks by whole blocks, so the stale slots after context_len take part."""
    block_size = k_cache.shape[1]
    rounded = (context_lens + block_size - 1) // block_size * block_size
    return kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, rounded, scale)


def ignores_block_table(query, k_cache, v_cache, block_tables, context_lens, scale):
    """Reads position p from block p // block_size, as if every sequence's blocks were 0, 1, 2, ..."""
    in_order = torch.arange(block_tables.shape[1], dtype=block_tables.dtype, device=block_tables.device)
    return kernels.paged_decode_attention(query, k_cache, v_cache, in_order.expand_as(block_tables).contiguous(),
                                  context_lens, scale)


def float32_output(query, k_cache, v_cache, block_tables, context_lens, scale):
    """Computes in float32 and forgets to cast back to the query's dtype."""
    return kernels.paged_decode_attention(query.float(), k_cache.float(), v_cache.float(), block_tables, context_lens, scale)


def tiled_softmax(query, k_cache, v_cache, block_tables, context_lens, scale, *, subtract_max=True, rescale=True,
                  tile=64):
    """The kernel's loop in torch: tiles of ``tile`` positions and a running softmax, with switchable bugs."""
    out = torch.empty_like(query)
    group = query.shape[1] // k_cache.shape[2]
    for i, n in enumerate(context_lens.tolist()):
        k, v = (gather_sequence_kv(c, block_tables[i], n).float().repeat_interleave(group, 1) for c in (k_cache, v_cache))
        q = query[i].float()
        m = torch.full(q.shape[:1], float("-inf"), device=q.device)
        l = torch.zeros(q.shape[:1], device=q.device)
        acc = torch.zeros_like(q)
        for start in range(0, n, tile):
            s = torch.einsum("hd,thd->ht", q, k[start:start + tile]) * scale
            m_new = torch.maximum(m, s.max(1).values) if subtract_max else torch.zeros_like(m)
            alpha = torch.exp(m - m_new) if subtract_max else torch.ones_like(m)
            p = torch.exp(s - m_new[:, None])
            l = l * alpha + p.sum(1)
            acc = (acc * alpha[:, None] if rescale else acc) + torch.einsum("ht,thd->hd", p, v[start:start + tile])
            m = m_new
        out[i] = (acc / l[:, None]).to(query.dtype)
    return out


def no_running_max(*args):
    """exp(score) with no max subtracted: overflows on large scores."""
    return tiled_softmax(*args, subtract_max=False)


def no_rescale(*args):
    """Forgets to rescale the accumulator when a later tile raises the running max."""
    return tiled_softmax(*args, rescale=False)


def stub(*args):
    raise NotImplementedError("paged_decode")


# ---- graded in this process --------------------------------------------------------------------
def test_kvlib_kernel_and_the_torch_loop_get_full_marks():
    assert lab03.check_kernel(kernels.paged_decode_attention).full_marks
    assert lab03.check_engine(kernels.paged_decode_attention).full_marks
    assert lab03.check_kernel(tiled_softmax).full_marks


TABLE_CHECKS = ["shuffled_block_tables", "lengths_mid_block", "gqa_groups", "long_context", "large_scores", "float16"]


BUGS = [  # (launcher, kernel checks it fails, whether it fails the engine check, text in the first failure)
    (gqa_by_modulo, ["gqa_groups"], True, "4 query heads over 2 kv heads"),  # the built-in model has GQA 2
    (reads_whole_last_block, ["lengths_mid_block"], True, "context_lens=[5, 18, 33, 1], block_size=4"),
    (ignores_block_table, TABLE_CHECKS, True, "differs from the reference; largest error"),
    (float32_output, ["float16"], False, "returned dtype torch.float32, expected the query's torch.float16"),
    (no_running_max, ["large_scores"], False, "the output holds inf or NaN"),
    (no_rescale, ["long_context"], False, "sequence 0 (context 320)"),
]


@pytest.mark.parametrize("piece, kernel_failed, engine_fails, message", BUGS, ids=[bug[0].__name__ for bug in BUGS])
def test_a_bug_costs_exactly_the_checks_that_cover_it(piece, kernel_failed, engine_fails, message):
    kernel_result = lab03.check_kernel(piece)
    assert [c.name for c in kernel_result.failed] == kernel_failed
    assert all(c.status == FAIL and c.hint for c in kernel_result.failed)
    assert message in kernel_result.failed[0].message
    engine_result = lab03.check_engine(piece)
    assert engine_result.full_marks is not engine_fails
    if engine_fails:
        assert "with the torch backend" in engine_result.failed[0].message


def test_a_stub_scores_zero_as_not_implemented():
    for result in (lab03.check_kernel(stub), lab03.check_engine(stub)):
        assert result.points == 0 and {c.status for c in result.checks} == {NOT_IMPLEMENTED}


# ---- whole notebooks, as `kvlib grade` runs them -----------------------------------------------
def test_the_solution_gets_full_marks():
    report = grade_notebook(SOLUTION)
    assert report.full_marks, report.table()
    assert [(t.task, t.points) for t in report.tasks] == [("kernel", 10), ("engine", 5)]


def test_the_untouched_lab_gets_zero_and_says_not_implemented():
    report = grade_notebook(LAB)
    assert report.points == 0 and report.max_points == 15
    for task in ("kernel", "engine"):
        assert report.task(task).failed_summary() == "not implemented: paged_decode", report.table()
