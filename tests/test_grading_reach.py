"""Every lab's rule, read in the grader: graded code that reaches around its own names scores 0, flagged.

The cheats here got full marks before the rule (a submission rewrote its lab's grading module, or walked
a traceback's frames up to the sandbox's loop and replaced lab 03's launch check, then did the attention
in torch from elementwise products); honest code in every style passes (``tests/test_grading_styles.py``).
"""
from __future__ import annotations

import textwrap

import pytest

from kvlib.course.grading.extract import Statement
from kvlib.course.grading.kernel_rule import breaches
from kvlib.course.grading.reach_rule import reaches
from kvlib.course.grading.results import FAIL
from kvlib.course.grading.runner import grade_cells


def reached(source: str) -> list[str]:
    return reaches([Statement(3, 1, textwrap.dedent(source))])


@pytest.mark.parametrize("source, named", [
    ("import kvlib.course.grading.lab02 as g\n", "imports kvlib.course.grading.lab02"),
    ("from kvlib.course.grading import lab10\n", "imports kvlib.course.grading"),
    ("import os, sys\n", "imports os"),
    ("from triton.runtime import jit\n", "imports triton.runtime"),
    ("import torch._dynamo\n", "imports torch._dynamo"),
    ("from kvlib.core import invariants as inv\ninv.check_invariants = print\n", "changes inv.check_invariants"),
    ("import torch\ntorch.Tensor.add = None\n", "changes torch.Tensor.add"),
    ("from kvlib.core.scheduler import Scheduler\ndel Scheduler.schedule\n", "changes Scheduler.schedule"),
    ("def f(candidate):\n    type(candidate).num_blocks = 0\n", "changes type(candidate).num_blocks"),
    ("import torch\nmodules = torch.sys.modules\n", "reads .sys"),
    ("import kvlib\ngrader = kvlib.course\n", "reads .course"),
    ("try:\n    raise RuntimeError\nexcept RuntimeError as e:\n    frame = e.__traceback__.tb_frame.f_back\n",
     "reads .__traceback__"),
    ("def walk():\n    yield gen.gi_frame.f_back.f_locals\n", "reads .gi_frame"),
    ("x = getattr(object(), 'y')\n", "uses getattr"),
    ("x = __builtins__\n", "uses __builtins__"),
    ("def f(x: \"__import__('os')\"):\n    return x\n", "uses __import__"),
    ("import torch\nC = torch._C\n", "reads torch._C, a private name"),
    ("import numpy as np\nlib = np.ctypeslib\n", "reads .ctypeslib"),
    ("class Lies:\n    def __torch_function__(self, *args):\n        return True\n", "defines __torch_function__"),
    ("class A:\n    def f(self):\n        return self.__class__.__mro__\n", "reads .__class__"),
])
def test_reaching_is_named_with_its_line(source, named):
    found = reached(source)
    assert any(named in line for line in found), found
    assert all(line.startswith("code cell 3, line ") for line in found)


def test_a_name_imported_in_one_cell_is_an_import_in_every_other():
    found = reaches([Statement(1, 1, "from kvlib.core import invariants as inv\n"),
                     Statement(2, 1, "def quiet():\n    inv.check_invariants = print\n")])
    assert found == ["code cell 2, line 2: changes inv.check_invariants, reached through inv: graded code may change "
                     "only its own objects"]


def test_honest_code_reaches_nothing():
    source = """
        from __future__ import annotations

        from collections import deque
        from dataclasses import dataclass

        import torch
        import triton
        import triton.language as tl

        from kvlib.core.block_allocator import AllocStatus, BlockAllocatorError


        @dataclass
        class Entry:
            block: int
            tokens: tuple[int, ...] = ()


        class Allocator:
            __slots__ = ("num_blocks", "_free")

            def __init__(self, num_blocks: int):
                super().__init__()
                self.num_blocks, self._free = num_blocks, deque(range(num_blocks))

            def __repr__(self) -> str:
                return f"{type(self).__name__}({self.num_blocks})"


        @triton.jit
        def copy_kernel(out, x, N: tl.constexpr):
            offsets = tl.arange(0, N)
            tl.store(out + offsets, tl.load(x + offsets))


        def launch(x):
            out = torch.empty_like(x)
            copy_kernel[(1,)](out, x, N=triton.next_power_of_2(x.numel()))
            scale = x.shape[-1] ** -0.5
            return out * scale if __name__ == "learner" else out
        """
    assert reached(source) == []


def test_attention_from_elementwise_products_outside_a_kernel_breaks_lab_03s_rule():
    source = textwrap.dedent("""
        import math
        def paged_decode(query, k, v, scale):
            scores = (query[:, None] * k).sum(-1) * scale
            weights = math.e ** (scores - scores.amax(-1, keepdim=True))
            return (weights[..., None] * v).sum(-2) / weights.sum(-1)[..., None]
        """)
    found = breaches([Statement(2, 1, source)])
    assert {"sum", "**", "amax"} <= {line.split("computes ")[1].split(" ")[0] for line in found}, found


def test_a_submission_that_rewrites_its_grader_scores_0_and_is_flagged():
    """Before the rule: 20/20 for an allocator whose honest score is 17, its class body rebinding lab 02's raised."""
    cheat = textwrap.dedent("""
        from collections import deque
        from kvlib.core.block_allocator import AllocStatus, BlockAllocatorError


        class MyBlockAllocator:
            import kvlib.course.grading.lab02 as _grader
            _grader.raised = lambda action: "BlockAllocatorError"

            def __init__(self, num_blocks: int):
                self.num_blocks, self._free = num_blocks, deque(range(num_blocks))
        """)
    graded = grade_cells("lab02", [cheat], seed=7)
    allocator = next(t for t in graded.tasks if t.task == "allocator")
    assert allocator.points == 0 and {c.status for c in allocator.checks} == {FAIL}
    assert any("allocator: scored 0" in flag and "changes _grader.raised" in flag for flag in graded.flags)


def suites_cheats() -> dict[str, str]:
    """The cheats the sandbox's own walls are tested with (graded there with the fence down), but those that reach
    nothing: a subclass of a hidden class, an address relayed to a kernel (lab 03's rule), a hint taken literally."""
    from test_grading import ALLOCATOR_CHEATS, HARNESS_CHEATS, _fill
    from test_grading_cheats import CHEATS
    cheats = {name: _fill(source, SOLUTION="'solution'", SEEN="'{}'", GRADEBOOK='"gradebook"')
              for name, source in {**ALLOCATOR_CHEATS, **HARNESS_CHEATS}.items() if name != "subclass"}
    cheats.update({name: "\n".join(cells) for name, (_, _, cells) in CHEATS.items()
                   if name not in ("lab03_relays_an_address", "lab09_warns_at_eight")})
    return cheats


@pytest.mark.parametrize("name", sorted(suites_cheats()))
def test_the_fence_stops_every_cheat_that_reaches_before_a_sandbox_starts(name):
    assert reached(suites_cheats()[name].replace("@SEEN@", "'{}'"))
