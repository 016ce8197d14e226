"""Grades an instructor can trust: the learner's code never holds the answer, the score or the pen.

Lab 02 is the worked example (``tests/test_labs_graded.py`` grades every lab's solution, untouched
lab and realistic bugs). Here: extraction, observations compared by the grader, the stubbed copy of
kvlib, the isolated sandbox, a suite of cheats of every kind graded as a class would be (each must
score zero on the tasks it cheats on), honest solutions in several styles (each must get full marks),
hangs within their budget, and the reports an instructor reads.
"""
from __future__ import annotations

import csv
import inspect
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from fence import without_the_fence

from kvlib.course.grading import Task, close, raised, same
from kvlib.course.grading.checks import FEEDBACK_SEED, observe, verdict
from kvlib.course.grading.extract import extract, load
from kvlib.course.grading.hidden import hiding, stub_source, stubbed_tree
from kvlib.course.grading.report import write_gradebook
from kvlib.course.grading.results import CRASHED, FAIL, NOT_GRADED, NOT_IMPLEMENTED, PASS, TIMED_OUT
from kvlib.course.grading.runner import InProcess, grade_cells, grade_folder, grade_notebook, lab_of
from kvlib.course.grading.sandbox import Limits, Sandbox, isolation, reply_to_observed
from kvlib.course.labs import remove_hidden_tests

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab02_allocator.ipynb"
LAB = ROOT / "labs" / "lab02_allocator.ipynb"
isolated = pytest.mark.skipif(isolation() is not None, reason=f"grading is not isolated here: {isolation()}")


# ---- the grader decides, from observations ------------------------------------------------------
def _toy() -> Task:
    task = Task("toy", ("square",), (), lambda: (lambda x: x * x))

    @task.check(2, "return x * x")
    def squares(fn, rng):
        xs = [rng.randint(-9, 9) for _ in range(4)]
        return {f"square(x) for x in {xs}": [fn(x) for x in xs]}
    return task


def test_a_check_passes_only_when_its_observation_agrees_with_kvlibs(capsys):
    task = _toy()
    assert task.grade(lambda x: x * x).full_marks
    result = task.grade(lambda x: x + x)
    assert result.points == 0
    out = capsys.readouterr().out
    assert "FAIL toy/squares: square(x) for x in" in out and "yours is" in out and "hint: return x * x" in out


def test_observations_depend_on_the_seed_so_a_hard_coded_answer_fails():
    task = _toy()
    check = task.checks[0]
    recorded = observe(check, task.reference(), FEEDBACK_SEED).observation
    replay = lambda fn, rng: recorded  # noqa: E731 - what a harness patched from inside would send
    forged = observe(type(check)("squares", 2, "", replay), None, 1)
    assert verdict(check, forged, observe(check, task.reference(), FEEDBACK_SEED)).status == PASS  # the cheat is real
    assert verdict(check, forged, observe(check, task.reference(), 12345)).status == FAIL


def test_comparisons_name_what_differs():
    assert same({"a": [1, 2]}, {"a": [1, 2]}) is None
    assert same({"a": [1, 3]}, {"a": [1, 2]}) == "a: yours is [1, 3], kvlib's is [1, 2]"
    assert same({}, {"a": 1}) == "a: nothing observed"
    assert same(True, 1) is not None  # a bool is not a count
    # too long to show whole (lab 10's traces were cut where they still agreed): where the two part
    trace, other = [[i, i + 1] for i in range(60)], [[i, i + 1] for i in range(60)]
    other[41] = [41, 43]
    assert same({"trace": other}, {"trace": trace}) == "trace, item 41 of 60: yours is [41, 43], kvlib's is [41, 42]"
    within = close(1e-3, 0)
    assert within({"out": [[1.0, 2.0]]}, {"out": [[1.0, 2.0005]]}) is None
    assert "1 of 2 values differ" in within({"out": [[1.0, 2.1]]}, {"out": [[1.0, 2.0]]})
    assert "NaN" in within([float("nan"), 1.0], [0.0, 1.0])
    assert raised(lambda: 1 / 0) == "ZeroDivisionError" and raised(lambda: None) is None


@pytest.mark.parametrize("reply, ok", [
    ({"status": "observed", "observation": {"x": 1}}, True),
    ({"status": "fail", "message": "broke"}, True),
    ({"status": "pass", "points": 1100}, False),  # a reply claiming points is malformed
    ({"status": "observed", "observation": 1, "points": 20}, False),
    ({"status": "fail", "message": 5}, False),
])
def test_replies_are_shape_checked_and_never_carry_a_score(reply, ok):
    if ok:
        assert reply_to_observed(reply).status in ("observed", FAIL)
    else:
        with pytest.raises(ValueError):
            reply_to_observed(reply)


# ---- extraction and loading ---------------------------------------------------------------------
def test_only_the_graded_definitions_and_what_they_need_are_kept():
    cells = ["import pathlib, subprocess, sys\nroot = 1",
             "from collections import deque\n\nLIMIT = 3\n\ndef helper(x):\n    root = x  # a local, not the global\n"
             "    return x\n\nclass Pool:\n    def free(self, b):\n        return helper(deque([LIMIT]))\n",
             "Pool.free = lambda self, b: None\nprint('checks')\nopen('/tmp/x', 'w')"]
    extracted = extract(cells, ("Pool",))
    assert extracted.problems == []
    assert [s.source.split("\n")[0] for s in extracted.statements] == [
        "from collections import deque", "LIMIT = 3", "def helper(x):", "class Pool:"]
    assert extracted.statements[-1].cell == 2 and extracted.statements[-1].first_line == 9


def test_the_last_definition_of_a_name_wins_as_when_cells_run():
    cells = ["class Pool:\n    def free(self, b):\n        return 1", "class Pool:\n    def free(self, b):\n        return 2"]
    assert load(extract(cells, ("Pool",)).statements).Pool().free(0) == 2


def test_a_missing_name_or_a_broken_cell_is_reported():
    assert "defines no Pool" in extract(["x = 1"], ("Pool",)).problems[0]
    assert "code cell 1 does not parse" in extract(["def f(:"], ("Pool",)).problems[0]
    assert extract(["%matplotlib inline\n!ls\nclass Pool:\n    def free(self, b): pass"], ("Pool",)).problems == []


def test_honest_code_loads_as_a_module_dataclasses_enums_and_typing_included():
    """A learner's ``@dataclass`` once scored zero: the statements inherited ``from __future__ import
    annotations`` from the grader and ran in no module, so ``dataclasses`` could not resolve them."""
    cells = ["import dataclasses, enum\nfrom dataclasses import dataclass, field\nfrom typing import Optional\n\n"
             "class Color(enum.Enum):\n    RED = 1\n\n@dataclass\nclass Slot:\n    block: int\n"
             "    color: Color = Color.RED\n    tags: list[int] = field(default_factory=list)\n"
             "    parent: Optional['Slot'] = None\n\nclass Pool:\n    def make(self):\n        return Slot(3)\n"]
    module = load(extract(cells, ("Pool",)).statements)
    assert module.__name__ == "learner" and sys.modules["learner"] is module
    assert module.Pool().make() == module.Slot(3) and module.Slot.__module__ == "learner"
    assert "annotations" not in module.__dict__ and not module.Slot.__annotations__["block"] == "int"


def test_kept_definitions_show_their_source_as_triton_jit_needs_to_compile_them():
    cells = ["x = 1", "import math\n\nclass Pool:\n    def free(self, b):\n        return math.floor(b)\n\ndef kernel(x):\n    return x + 1"]
    module = load(extract(cells, ("Pool", "kernel")).statements)
    assert inspect.getsource(module.kernel) == "def kernel(x):\n    return x + 1\n"
    assert inspect.getsourcefile(module.kernel) == "<cell 2>"
    jit = pytest.importorskip("triton.runtime.jit")
    assert "return x + 1" in jit.JITFunction(module.kernel).src


# ---- the copy of kvlib without the answer -------------------------------------------------------
def test_the_stubbed_copy_keeps_the_engine_and_drops_the_answer():
    tree = stubbed_tree(("kvlib.core.block_allocator:BlockAllocator",))
    source = (tree / "kvlib" / "core" / "block_allocator.py").read_text()
    assert "self._free" not in source and "NotImplementedError" in source and "class AllocStatus" in source
    assert (tree / "kvlib" / "engine.py").read_text() == (ROOT / "kvlib" / "engine.py").read_text()
    assert not (tree / "solutions").exists()
    with pytest.raises(ValueError, match="nothing named Nope"):
        stub_source("class A:\n    def f(self): return 1\n", {"Nope"})


def test_feedback_hides_the_same_answer_in_this_process():
    from kvlib.core.block_allocator import BlockAllocator
    with hiding(("kvlib.core.block_allocator:BlockAllocator",)):
        with pytest.raises(NotImplementedError, match="kvlib.s own BlockAllocator.__init__ is not there"):
            BlockAllocator(4)
    assert BlockAllocator(4).allocate() in range(4)


# ---- whole notebooks, as `kvlib grade` runs them ------------------------------------------------
def submission(directory: Path, name: str, edits=(), extra_cells=(), base: Path = SOLUTION, replace=None) -> Path:
    """A learner's notebook: ``base`` without hidden tests, ``edits`` applied, ``extra_cells`` appended
    (or every code cell of ``base`` after the first ``replace``d by those cells)."""
    nb = nbformat.read(base, as_version=4)
    for cell in nb.cells:
        cell.source = remove_hidden_tests(cell.source)
    for old, new in edits:
        cells = [c for c in nb.cells if c.cell_type == "code" and old in c.source]
        assert len(cells) == 1 and cells[0].source.count(old) == 1, f"{old!r} must occur once in the notebook"
        cells[0].source = cells[0].source.replace(old, new)
    if replace is not None:
        nb.cells = [c for c in nb.cells if c.cell_type != "code"][:1]
    nb.cells += [nbformat.v4.new_code_cell(source) for source in [*(replace or ()), *extra_cells]]
    path = directory / name
    nbformat.write(nb, path)
    return path


ALLOCATOR_CHEATS = {
    # the answer reached through a string, an object walk, a container, pickling, or its source
    "string_route": "import importlib\nMyBlockAllocator = getattr(importlib.import_module('kvlib.core.' + 'block_allocator'), "
                    "'Block' + 'Allocator')\n",
    "object_walk": "import gc\nMyBlockAllocator = next(o for o in gc.get_objects() if isinstance(o, type) and "
                   "o.__name__ == 'BlockAllocator' and o.__module__ == 'kvlib.core.block_allocator')\n",
    "container": "import kvlib.core.block_allocator as k\nKEPT = {'methods': dict(vars(k.BlockAllocator))}\n"
                 "MyBlockAllocator = type('MyBlockAllocator', (), KEPT['methods'])\n",
    "pickled": "import pickle\nimport kvlib.core.block_allocator\nMyBlockAllocator = pickle.loads(pickle.dumps("
               "kvlib.core.block_allocator.BlockAllocator))\n",
    "source_read": "import inspect, kvlib.core.block_allocator as k\n\ndef _copy():\n    ns = {}\n"
                   "    exec(inspect.getsource(k), ns)\n    return ns['BlockAllocator']\n\nMyBlockAllocator = _copy()\n",
    "solution_read": "import json, pathlib\n\ndef _solution():\n    nb = json.loads(pathlib.Path(@SOLUTION@).read_text())\n"
                     "    ns = {}\n    exec(''.join(nb['cells'][3]['source']), ns)\n    return ns['MyBlockAllocator']\n\n"
                     "MyBlockAllocator = _solution()\n",
    "subclass": "from kvlib.core.block_allocator import BlockAllocator\nclass MyBlockAllocator(BlockAllocator):\n    pass\n",
}
TABLE = "from kvlib.core.block_table import BlockTable\nMyBlockTable = BlockTable\n"
HARNESS_CHEATS = {
    # code that runs at load time inside the sandbox and rewrites the checks or the replies
    "patches_the_harness": "import kvlib.course.grading.checks as c\n_real = c.observe\n"
                           "def _fake(check, piece, seed):\n    return c.Observed('observed', {'all': 'good'})\n"
                           "c.observe = _fake\nimport kvlib.course.grading.sandbox as s\ns.observe = _fake\n"
                           "class MyBlockAllocator:\n    pass\n",
    "forges_replies": "import os\nos.write(3, b'{\"ready\": true}\\n{\"status\": \"pass\", \"points\": 1100}\\n')\n"
                      "class MyBlockAllocator:\n    pass\n",
    "replays_feedback": "import json\nimport kvlib.course.grading.checks as c\n_SEEN = json.loads(@SEEN@)\n"
                        "c.observe = lambda check, piece, seed: c.Observed('observed', _SEEN[check.name])\n"
                        "import kvlib.course.grading.sandbox as s\ns.observe = c.observe\n"
                        "class MyBlockAllocator:\n    pass\n",
    "leaves_a_process": "import subprocess, sys\n_LEFT = subprocess.Popen([sys.executable, '-c', 'import time, pathlib\\n"
                        "time.sleep(4)\\npathlib.Path(@GRADEBOOK@).write_text(\"hacked\")'], start_new_session=True)\n"
                        "class MyBlockAllocator:\n    pass\n",
}


def _fill(source: str, **values: str) -> str:
    for name, value in values.items():
        source = source.replace(f"@{name}@", value)
    return source


def _feedback_observations() -> str:
    from kvlib.course.grading import lab02
    return json.dumps({c.name: observe(c, t.reference(), FEEDBACK_SEED).observation
                       for t in lab02.TASKS for c in t.checks})


@pytest.fixture(scope="module")
def graded_class(tmp_path_factory):
    """The solution, the untouched lab, the cheats and honest solutions of other styles, graded as one class."""
    folder = tmp_path_factory.mktemp("class")
    gradebook = folder / "gradebook.csv"
    submission(folder, "lab02_solution.ipynb")
    submission(folder, "lab02_untouched.ipynb", base=LAB)
    for name, source in ALLOCATOR_CHEATS.items():
        submission(folder, f"lab02_{name}.ipynb", base=LAB, extra_cells=[_fill(source, SOLUTION=repr(str(SOLUTION))), TABLE])
    for name, source in HARNESS_CHEATS.items():
        submission(folder, f"lab02_{name}.ipynb", base=LAB, extra_cells=[
            _fill(source, SEEN=repr(_feedback_observations()), GRADEBOOK=json.dumps(str(gradebook))), TABLE])
    for name, cells in STYLES.items():
        submission(folder, f"lab02_style_{name}.ipynb", replace=cells)
    submission(folder, "lab02_hangs_forever.ipynb", edits=[
        ('        """NEVER if the blocks could never fit above the watermark, OK if they fit now, else LATER."""\n',
         '        """NEVER if the blocks could never fit above the watermark, OK if they fit now, else LATER."""\n'
         '        while True:\n            pass\n')])
    started = time.monotonic()
    with without_the_fence():  # the sandbox's walls, each on its own: tests/test_grading_reach.py has the fence
        reports = grade_folder(folder, jobs=2, limits=Limits(check_scale=0.25, submission_s=400), seed=2024)
    took = time.monotonic() - started
    write_gradebook(reports, gradebook)
    written = gradebook.read_text()
    time.sleep(5)  # longer than a leftover process waits before it writes
    return {r.notebook.stem.removeprefix("lab02_"): r for r in reports}, gradebook, written, took


def test_the_solution_gets_full_marks_and_is_flagged_as_kvlibs_own_code(graded_class):
    report = graded_class[0]["solution"]
    assert report.full_marks, report.table()
    assert [(t.task, t.points) for t in report.tasks] == [("allocator", 10), ("block_table", 5), ("engine", 5)]
    assert any("repeats" in f and "BlockAllocator" in f for f in report.flags)  # the solution is kvlib's code


def test_the_untouched_lab_gets_zero_and_says_not_implemented(graded_class):
    report = graded_class[0]["untouched"]
    assert (report.points, report.max_points) == (0, 20)
    for task in report.tasks:
        assert task.failed_summary().startswith("not implemented: MyBlock"), report.table()


@pytest.mark.parametrize("name", sorted(ALLOCATOR_CHEATS))
def test_a_task_answered_with_kvlibs_own_code_scores_zero(graded_class, name):
    if name == "solution_read" and isolation() is not None:
        pytest.skip(f"grading is not isolated here: {isolation()}")
    report = graded_class[0][name]
    assert report.task("allocator").points == 0 and report.task("engine").points == 0, report.table()
    assert report.task("block_table").points == 0, report.table()


@pytest.mark.parametrize("name", sorted(ALLOCATOR_CHEATS))
def test_each_cheat_would_get_kvlibs_allocator_if_it_were_there(name):
    """The cheats are real: in this process, where kvlib is whole, each one does get a working allocator."""
    source = _fill(ALLOCATOR_CHEATS[name], SOLUTION=repr(str(SOLUTION)))
    pool = load(extract([source], ("MyBlockAllocator",)).statements).MyBlockAllocator(4)
    assert pool.allocate() in range(4) and pool.num_free == 3


@pytest.mark.parametrize("name", sorted(HARNESS_CHEATS))
def test_a_submission_that_rewrites_the_checks_or_the_replies_scores_zero(graded_class, name):
    report = graded_class[0][name]
    assert report.points == 0 and report.max_points == 20, report.table()


@isolated
def test_nothing_the_sandbox_started_outlives_the_grade(graded_class):
    reports, gradebook, written, _ = graded_class
    assert gradebook.read_text() == written and "hacked" not in written
    left = subprocess.run(["pgrep", "-f", "time.sleep\\(4\\)"], capture_output=True, text=True).stdout.split()
    assert left == [], "a process a submission started is still running"


def test_a_hang_costs_its_own_checks_within_its_budget(graded_class):
    reports, _, _, took = graded_class
    hangs = reports["hangs_forever"]
    timed_out = {f"{t.task}/{c.name}" for t in hangs.tasks for c in t.checks if c.status == TIMED_OUT}
    assert "allocator/watermark" in timed_out and hangs.task("block_table").points == 5, hangs.table()
    assert took < 600


# Honest solutions written in other styles than the course's: each must get full marks, unflagged.
STYLES = {
    "dataclasses": [
        "from __future__ import annotations\n\nimport enum\nfrom dataclasses import dataclass, field\n"
        "from kvlib.core.block_allocator import AllocStatus, BlockAllocatorError\n\n\nclass Owner(enum.IntEnum):\n"
        "    NOBODY = 0\n\n\n@dataclass\nclass Block:\n    id: int\n    owners: int = Owner.NOBODY\n\n\n"
        "@dataclass\nclass MyBlockAllocator:\n    num_blocks: int\n    blocks: list[Block] = field(init=False)\n"
        "    stack: list[int] = field(init=False)\n\n    def __post_init__(self) -> None:\n"
        "        self.blocks = [Block(i) for i in range(self.num_blocks)]\n"
        "        self.stack = list(reversed(range(self.num_blocks)))\n\n    @property\n"
        "    def num_free(self) -> int:\n        return len(self.stack)\n\n    @property\n"
        "    def num_used(self) -> int:\n        return self.num_blocks - self.num_free\n\n"
        "    def ref_count(self, block_id: int) -> int:\n        return self.blocks[block_id].owners\n\n"
        "    def can_allocate(self, n: int, watermark_blocks: int = 0) -> AllocStatus:\n"
        "        if self.num_blocks - watermark_blocks < n:\n            return AllocStatus.NEVER\n"
        "        return AllocStatus.OK if self.num_free - n >= watermark_blocks else AllocStatus.LATER\n\n"
        "    def allocate(self) -> int:\n        if not self.stack:\n            raise BlockAllocatorError('pool is empty')\n"
        "        block = self.blocks[self.stack.pop()]\n        block.owners = 1\n        return block.id\n\n"
        "    def _owned(self, block_id: int) -> Block:\n        if block_id not in range(self.num_blocks) or "
        "not self.blocks[block_id].owners:\n            raise BlockAllocatorError(f'block {block_id} is not owned')\n"
        "        return self.blocks[block_id]\n\n    def fork(self, block_id: int) -> int:\n"
        "        self._owned(block_id).owners += 1\n        return block_id\n\n    def free(self, block_id: int) -> None:\n"
        "        block = self._owned(block_id)\n        block.owners -= 1\n        if block.owners == Owner.NOBODY:\n"
        "            self.stack.append(block_id)\n",
        "from dataclasses import dataclass, field\n\n\n@dataclass\nclass MyBlockTable:\n    block_size: int\n"
        "    blocks: list = field(default_factory=list)\n\n    def append(self, block_id):\n        self.blocks.append(block_id)\n\n"
        "    @property\n    def capacity(self):\n        return self.block_size * len(self.blocks)\n\n"
        "    def num_missing_blocks(self, num_tokens):\n        whole, part = divmod(num_tokens, self.block_size)\n"
        "        return max(whole + (part > 0) - len(self.blocks), 0)\n\n    def slot(self, position):\n"
        "        return self.blocks[position // self.block_size] * self.block_size + position % self.block_size\n\n"
        "    def slots(self, start, end):\n        return list(map(self.slot, range(start, end)))\n\n"
        "    def pop_tail(self, count):\n        keep = len(self.blocks) - count\n"
        "        tail, self.blocks = self.blocks[keep:], self.blocks[:keep]\n        return tail\n",
    ],
    "class_hierarchy": [
        "import heapq\nfrom typing import Protocol\nfrom kvlib.core.block_allocator import AllocStatus, BlockAllocatorError\n\n"
        "SPARE = 0\n\n\nclass Counts(Protocol):\n    def count(self, block_id: int) -> int: ...\n\n\nclass FreeHeap:\n"
        "    \"\"\"Free ids, smallest first.\"\"\"\n\n    def __init__(self, n):\n        self.heap = list(range(n))\n\n"
        "    def take(self):\n        if not self.heap:\n            raise BlockAllocatorError('no free block')\n"
        "        return heapq.heappop(self.heap)\n\n    def give(self, block_id):\n        heapq.heappush(self.heap, block_id)\n\n\n"
        "class RefCounted:\n    def __init__(self, n):\n        self.counts = {}\n        self.size = n\n\n"
        "    def check(self, block_id):\n        if not isinstance(block_id, int) or not SPARE <= block_id < self.size "
        "or self.counts.get(block_id, 0) == 0:\n            raise BlockAllocatorError(f'block {block_id} has no owner')\n\n\n"
        "class MyBlockAllocator(RefCounted):\n    def __init__(self, num_blocks):\n        super().__init__(num_blocks)\n"
        "        self.num_blocks = num_blocks\n        self.free_ids = FreeHeap(num_blocks)\n\n    num_free = property("
        "lambda self: len(self.free_ids.heap))\n    num_used = property(lambda self: self.num_blocks - self.num_free)\n\n"
        "    def ref_count(self, block_id):\n        return self.counts.get(block_id, 0)\n\n"
        "    def can_allocate(self, num_blocks, watermark_blocks=0):\n        if num_blocks + watermark_blocks > self.num_blocks:\n"
        "            return AllocStatus.NEVER\n        if num_blocks + watermark_blocks <= self.num_free:\n"
        "            return AllocStatus.OK\n        return AllocStatus.LATER\n\n    def allocate(self):\n"
        "        block_id = self.free_ids.take()\n        self.counts[block_id] = 1\n        return block_id\n\n"
        "    def fork(self, block_id):\n        self.check(block_id)\n        self.counts[block_id] += 1\n        return block_id\n\n"
        "    def free(self, block_id):\n        self.check(block_id)\n        self.counts[block_id] -= 1\n"
        "        if not self.counts[block_id]:\n            del self.counts[block_id]\n            self.free_ids.give(block_id)\n",
        "import math\n\n\nclass Table:\n    def __init__(self, block_size):\n        self.block_size = block_size\n"
        "        self.blocks = []\n\n    def append(self, block_id):\n        self.blocks += [block_id]\n\n\n"
        "class MyBlockTable(Table):\n    @property\n    def capacity(self):\n        return len(self.blocks) * self.block_size\n\n"
        "    def num_missing_blocks(self, num_tokens):\n        return max(0, math.ceil(num_tokens / self.block_size) - len(self.blocks))\n\n"
        "    def slot(self, position):\n        index, offset = divmod(position, self.block_size)\n"
        "        return self.block_size * self.blocks[index] + offset\n\n    def slots(self, start, end):\n"
        "        return [self.slot(p) for p in range(start, end)]\n\n    def pop_tail(self, count):\n"
        "        if count == 0:\n            return []\n        tail = self.blocks[-count:]\n        del self.blocks[-count:]\n"
        "        return tail\n",
    ],
}


@pytest.mark.parametrize("style", sorted(STYLES))
def test_honest_solutions_of_other_styles_get_full_marks_unflagged(graded_class, style):
    report = graded_class[0][f"style_{style}"]
    assert report.full_marks, report.table()
    assert report.flags == [], report.flags


def test_the_gradebook_and_gradescope_results_come_from_the_grader(graded_class, tmp_path):
    reports, gradebook, written, _ = graded_class
    rows = {row["submission"]: row for row in csv.DictReader(gradebook.open())}
    assert rows["lab02_solution.ipynb"]["total"] == "20" and rows["lab02_untouched.ipynb"]["total"] == "0"
    assert "BlockAllocator" in rows["lab02_solution.ipynb"]["flags"] and rows["lab02_style_dataclasses.ipynb"]["flags"] == ""
    results = reports["solution"].gradescope()
    assert results["score"] == 20 and len(results["tests"]) == 11
    assert {t["max_score"] for t in results["tests"]} <= {1, 2, 3} and all(t["status"] == "passed" for t in results["tests"])
    failing = reports["untouched"].gradescope()
    assert failing["score"] == 0 and failing["tests"][0]["output"].startswith("not implemented")


def test_isolation_or_a_report_that_says_there_is_none(graded_class):
    notes = graded_class[0]["solution"].notes
    if isolation() is None:
        assert not any("without isolation" in n for n in notes)
    else:
        assert any("grading without isolation" in n and "not for marks" in n for n in notes)


@isolated
def test_the_sandbox_sees_no_network_no_checkout_and_a_private_tmp(tmp_path):
    probe = ("import os, socket, pathlib\nclass MyBlockAllocator:\n    def __init__(self, n):\n"
             "        seen = [os.getuid(), pathlib.Path({root!r}).exists(), 'pytest-of-root' in os.listdir('/tmp'),\n"
             "                pathlib.Path({marker!r}).exists()]\n        try:\n"
             "            socket.create_connection(('127.0.0.1', 22), timeout=1); seen.append('net')\n"
             "        except OSError:\n            seen.append('no net')\n        raise RuntimeError(repr(seen))\n")
    marker = tmp_path / "grader-only"
    marker.write_text("x")
    statements = extract([probe.format(root=str(ROOT / "solutions"), marker=str(marker))], ("MyBlockAllocator",)).statements
    from kvlib.course.grading import lab02
    with Sandbox("lab02", statements, lab02.ALLOCATOR) as sandbox:
        seen = sandbox.observe("allocator", "allocate_unique", 1, 60)
    assert seen.status == FAIL and "[65534, False, False, False, 'no net']" in seen.message, seen.message


def test_a_hang_costs_at_most_the_submissions_budget_and_only_its_own_tasks_checks():
    """The allocator hangs; the block table is right. The hang's first check used the whole budget and the block
    table scored 0 ("the budget ran out"); now each task has its share, by its checks' limits."""
    source = "import time\nclass MyBlockAllocator:\n    def __init__(self, n):\n        while True: time.sleep(0.1)\n"
    from kvlib.course.grading.runner import code_cells
    table = next(cell for cell in code_cells(SOLUTION) if "class MyBlockTable" in cell)
    started = time.monotonic()
    graded = grade_cells("lab02", [source, table], Limits(submission_s=24), seed=1)
    took = time.monotonic() - started
    allocator, block_table, engine = graded.tasks
    statuses = [c.status for c in allocator.checks]
    assert statuses[0] == TIMED_OUT and "still running after 13.1 s" in allocator.checks[0].message  # 24 * 360 / 660
    assert set(statuses[1:]) == {TIMED_OUT} and "share (13.1 s) of the submission's time budget (24 s) ran out" in \
        allocator.checks[1].message
    assert engine.points == 0 and {c.status for c in engine.checks} == {TIMED_OUT}  # it serves with the allocator
    assert block_table.full_marks, block_table
    assert took < 24 + 30, took  # the budget, plus starting two sandboxes


class SlowSandbox(InProcess):
    """The learner's code in this process on a fake clock: each check of a task in ``SECONDS`` takes that long (a
    hang: forever), every other check 1 s."""
    SECONDS: dict = {}
    clock = [0.0]

    def observe(self, task, check, seed, limit_s):
        from kvlib.course.grading.sandbox import Crashed
        took = self.SECONDS.get(task, 1.0)
        if took > limit_s:
            self.clock[0] += limit_s
            raise Crashed(f"still running after {limit_s:.3g} s", TIMED_OUT)
        self.clock[0] += took
        return super().observe(task, check, seed, limit_s)


@pytest.mark.parametrize("seconds, lost", [(40.0, set()), (float("inf"), {"measure"})])
def test_honest_slow_checks_keep_the_budget_that_quick_tasks_leave_and_a_hang_costs_its_own_task(monkeypatch, seconds,
                                                                                                  lost):
    """Lab 08's checks have 1,020 s of limits against a 600 s budget. Its first task's checks each taking 40 s of
    their 60 (120 s in all, 124 s with the quick rest) lost the third to the task's share (106 s): the share caps
    one check, and a task's total only once it has hung. A hang still costs that task alone."""
    import types

    from kvlib.course.grading import runner
    monkeypatch.setattr(runner, "time", types.SimpleNamespace(monotonic=lambda: SlowSandbox.clock[0]))
    monkeypatch.setattr(SlowSandbox, "SECONDS", {"measure": seconds})
    cells = runner.code_cells(ROOT / "solutions" / "lab08_cost_model.ipynb")
    graded = grade_cells("lab08", cells, Limits(), runner=SlowSandbox, seed=3)
    assert {task.task for task in graded.tasks if not task.full_marks} == lost, graded.tasks
    if lost:
        first, *rest = graded.tasks[0].checks
        assert first.message == "still running after 60 s" and [c.status for c in rest] == [TIMED_OUT] * 2
        assert rest[0].message == "still running after 45.9 s"  # what was left of its share
        assert "share (106 s) of the submission's time budget (600 s) ran out" in rest[1].message


def test_a_reply_nested_too_deep_to_read_fails_its_check_and_grading_goes_on():
    """Written straight to the reply channel, a reply nested 100,000 deep made the grader's json.loads raise
    RecursionError out of grade_cells: `kvlib grade` stopped with a traceback instead of a score."""
    source = ("import os\nclass MyBlockAllocator:\n    def __init__(self, n):\n"
              "        os.write(3, b'{\"status\": \"observed\", \"observation\": ' + b'[' * 100000 + b']' * 100000"
              " + b'}\\n')\n        os._exit(0)\n")
    with without_the_fence():
        graded = grade_cells("lab02", [source, TABLE], Limits(submission_s=60), seed=1)
    first = graded.tasks[0].checks[0]
    assert first.status == CRASHED and "nested too deep" in first.message, first
    assert graded.tasks[1].points == 0 and graded.tasks[1].checks[0].status == NOT_IMPLEMENTED


def test_a_crash_or_a_definition_that_raises_is_reported_per_check():
    from kvlib.course.grading import lab02
    source = "import torch\nclass MyBlockAllocator:\n    def __init__(self, n):\n        torch.empty(2**40)\n"
    graded = grade_cells("lab02", [source, TABLE], Limits(check_scale=0.5), seed=1)
    crashed = graded.tasks[0].checks[0]
    assert crashed.status in (FAIL, CRASHED) and "memory" in crashed.message.lower(), crashed
    graded = grade_cells("lab02", ["class MyBlockAllocator:\n    x = 1 / 0\n", TABLE], seed=1)
    assert graded.tasks[0].checks[0].status == CRASHED and "ZeroDivisionError" in graded.tasks[0].checks[0].message
    assert stubbed_tree(lab02.ALLOCATOR) == stubbed_tree(lab02.ALLOCATOR)  # built once per process


def test_the_table_says_what_failed_and_why(tmp_path):
    path = submission(tmp_path, "lab02_bug.ipynb", edits=[("        return max(0, needed - len(self.blocks))\n",
                                                           "        return needed - len(self.blocks)\n")])
    report = grade_notebook(path)
    assert report.failed_checks() == {"block_table/missing_blocks"} and report.points == 18
    table = report.table()
    assert "block_table/missing_blocks: num_missing_blocks(n) with 2 blocks" in table and "kvlib's is" in table
    assert "hint:" in table and "as saved at" in table


def test_an_unreadable_submission_keeps_the_gradebook_columns(tmp_path):
    (tmp_path / "lab02_truncated.ipynb").write_text('{"cells": [')
    (tmp_path / "homework.ipynb").write_text("{}")
    reports = {r.notebook.name: r for r in grade_folder(tmp_path)}
    truncated = reports["lab02_truncated.ipynb"]
    assert (truncated.points, truncated.max_points) == (0, 20)
    assert {c.status for t in truncated.tasks for c in t.checks} == {NOT_GRADED}
    assert "pass --lab" in reports["homework.ipynb"].notes[0]


def test_the_lab_comes_from_the_grader_not_from_the_notebook(tmp_path):
    assert lab_of("submissions/lab02_ada_lovelace.ipynb") == "lab02"
    with pytest.raises(ValueError, match="pass --lab"):
        lab_of("homework.ipynb")
    path = submission(tmp_path, "homework.ipynb")
    nb = json.loads(path.read_text())
    nb["metadata"]["kvlib"] = {"lab": "lab99"}  # editable metadata plays no part
    path.write_text(json.dumps(nb))
    assert grade_notebook(path, lab="lab02").full_marks


def test_a_sandbox_starts_without_the_graders_notebook_reader():
    """nbformat (and jsonschema under it) took 1.4 s of every sandbox's 2.6 s start, imported by extract.py for
    ``code_cells``, which only the grader runs (now in runner.py): a class of 16 submissions starts 32 sandboxes."""
    probe = ("import sys\nclass MyBlockAllocator:\n    def __init__(self, n):\n"
             "        raise RuntimeError('loaded: ' + repr(sorted(m for m in ('nbformat', 'jsonschema') if m in sys.modules)))\n")
    statements = extract([probe], ("MyBlockAllocator",)).statements
    from kvlib.course.grading import lab02
    with Sandbox("lab02", statements, lab02.ALLOCATOR) as sandbox:
        seen = sandbox.observe("allocator", "allocate_unique", 1, 60)
    assert seen.status == FAIL and "loaded: []" in seen.message, seen.message


def test_in_process_grading_hides_kvlibs_answer_as_the_sandbox_does():
    cells = [ALLOCATOR_CHEATS["subclass"], TABLE]
    graded = grade_cells("lab02", cells, runner=InProcess, seed=random.randrange(1000))
    assert sum(t.points for t in graded.tasks) == 0
    assert {c.status for t in graded.tasks for c in t.checks} == {NOT_IMPLEMENTED}


def test_grading_from_inside_the_notebook_warns_about_unsaved_edits(tmp_path, monkeypatch, capsys):
    import os

    from kvlib.course.grading.runner import grade_here, mark_cell_run
    path = submission(tmp_path, "lab02_mine.ipynb", base=LAB)
    os.utime(path, (time.time() - 60, time.time() - 60))  # saved a minute ago ...
    mark_cell_run()  # ... and a cell ran just now
    grade_here(path)  # nbclient runs have no Jupyter session to find the file from: it is passed
    out = capsys.readouterr().out
    assert "save it (Ctrl+S) first" in out
    assert "lab02_mine.ipynb (lab02)" in out and "not implemented" in out
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    with pytest.raises(RuntimeError, match="grade_here\\('labs/lab02_allocator.ipynb'\\)"):
        grade_here()


def test_an_exit_fails_its_own_check_and_an_os_exit_is_named():
    """Both were "died (out of memory, or a hard crash)": sys.exit() in a method ended the sandbox's process."""
    allocator = "class MyBlockAllocator:\n    def __init__(self, n):\n        self.num_blocks = n\n\n    @property\n" \
                "    def num_free(self):\n        {ends}\n"
    with without_the_fence():  # os is refused before any sandbox starts; this is the sandbox's own report
        exits = grade_cells("lab02", [allocator.format(ends="raise SystemExit(2)")], Limits(submission_s=60), seed=1)
        os_exits = grade_cells("lab02", ["import os\n" + allocator.format(ends="os._exit(3)")], Limits(submission_s=60),
                               seed=1)
    first, second = exits.tasks[0].checks[:2]
    assert first.status == FAIL and "SystemExit(2)" in first.message and "sys.exit()" in first.message, first
    assert second.status == FAIL and "allocate" in second.message, second  # the process went on
    assert os_exits.tasks[0].checks[0].status == CRASHED
    assert "exited with status 3" in os_exits.tasks[0].checks[0].message, os_exits.tasks[0].checks[0]
