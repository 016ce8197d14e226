"""The lab generator: solution regions become stubs, hidden tests vanish, stale labs are caught."""
from __future__ import annotations

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from kvlib.course.labs import LabError, make_labs, remove_hidden_tests, stale_labs, strip_solutions

METHOD = '''class Pool:
    def free(self, block_id):
        """Drop one owner."""
        ### BEGIN SOLUTION
        self.refs[block_id] -= 1
        ### END SOLUTION
        return None'''


def test_solution_region_becomes_a_stub_naming_the_method():
    assert strip_solutions(METHOD) == '''class Pool:
    def free(self, block_id):
        """Drop one owner."""
        raise NotImplementedError("Pool.free")
        return None'''


def test_stub_keeps_the_region_indentation_inside_nested_blocks():
    source = "def top(x):\n    if x:\n        ### BEGIN SOLUTION\n        return 1\n        ### END SOLUTION\n    return 0"
    assert strip_solutions(source) == 'def top(x):\n    if x:\n        raise NotImplementedError("top")\n    return 0'


@pytest.mark.parametrize("source, message", [
    ("### BEGIN SOLUTION\nx = 1\n### END SOLUTION", "inside a function body"),
    ("class C:\n    ### BEGIN SOLUTION\n    x = 1\n    ### END SOLUTION", "inside a function body"),
    ("def f():\n    pass\nif True:\n    ### BEGIN SOLUTION\n    x = 1\n    ### END SOLUTION", "inside a function body"),
    ("def f():\n    ### BEGIN SOLUTION\n    return 1", "never closed"),
    ("def f():\n    return 1\n    ### END SOLUTION", "without ### BEGIN SOLUTION"),
])
def test_regions_that_would_not_make_a_runnable_lab_are_refused(source, message):
    with pytest.raises(LabError, match=message):
        strip_solutions(source, "sol.ipynb, cell 3")


def test_hidden_tests_are_removed():
    source = "result = grade()\n### BEGIN HIDDEN TESTS\nassert result.full_marks\n### END HIDDEN TESTS"
    assert remove_hidden_tests(source) == "result = grade()"
    with pytest.raises(LabError, match="never closed"):
        remove_hidden_tests("### BEGIN HIDDEN TESTS\nassert False")


def _solution(path, body=METHOD):
    hidden = new_code_cell("### BEGIN HIDDEN TESTS\nassert Pool\n### END HIDDEN TESTS")
    check = new_code_cell(body, outputs=[new_output("stream", text="PASS\n")], execution_count=3)
    nb = new_notebook(cells=[new_markdown_cell("# Lab 99"), check, hidden], metadata={"kvlib": {"lab": "lab99"}})
    nbformat.write(nb, path)


def test_make_labs_writes_a_stubbed_lab_without_outputs_or_hidden_cells(tmp_path):
    (tmp_path / "solutions").mkdir()
    _solution(tmp_path / "solutions" / "lab99_pool.ipynb")
    _solution(tmp_path / "solutions" / "notes.ipynb")  # not a lab: no lab is generated from it
    written = make_labs(tmp_path / "solutions", tmp_path / "labs")
    assert written == [tmp_path / "labs" / "lab99_pool.ipynb"]
    lab = nbformat.read(written[0], as_version=4)
    assert [c.cell_type for c in lab.cells] == ["markdown", "code"]
    assert 'raise NotImplementedError("Pool.free")' in lab.cells[1].source
    assert lab.cells[1].outputs == [] and lab.cells[1].execution_count is None
    assert lab.metadata.kvlib.lab == "lab99"


def test_stale_labs_finds_edited_missing_and_orphaned_labs(tmp_path):
    solutions, labs = tmp_path / "solutions", tmp_path / "labs"
    solutions.mkdir()
    _solution(solutions / "lab98_a.ipynb")
    _solution(solutions / "lab99_b.ipynb")
    make_labs(solutions, labs)
    assert stale_labs(solutions, labs) == []
    _solution(solutions / "lab98_a.ipynb", METHOD.replace("return None", "return block_id"))
    (labs / "lab99_b.ipynb").unlink()
    (labs / "lab97_gone.ipynb").write_text("{}")
    assert stale_labs(solutions, labs) == [labs / "lab97_gone.ipynb", labs / "lab98_a.ipynb", labs / "lab99_b.ipynb"]


@pytest.mark.parametrize("marker", ["## BEGIN SOLUTION", "### Begin Solution", "#### BEGIN SOLUTION", "# BEGIN SOLUTION",
                                    "### BEGIN_SOLUTION", "### END HIDDEN TEST"])
def test_a_near_miss_marker_is_refused_and_nothing_is_written(tmp_path, marker):
    solutions, labs = tmp_path / "solutions", tmp_path / "labs"
    solutions.mkdir()
    _solution(solutions / "lab98_good.ipynb")
    make_labs(solutions, labs)
    before = {p.name: p.read_text() for p in labs.iterdir()}
    _solution(solutions / "lab99_typo.ipynb", METHOD.replace("### BEGIN SOLUTION", marker))
    with pytest.raises(LabError, match="looks like a marker"):
        make_labs(solutions, labs)
    assert {p.name: p.read_text() for p in labs.iterdir()} == before  # labs/ is replaced all at once, or not at all


def test_a_marker_outside_a_code_cell_is_refused(tmp_path):
    (tmp_path / "solutions").mkdir()
    path = tmp_path / "solutions" / "lab99_pool.ipynb"
    _solution(path)
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(1, new_markdown_cell("Write it here:\n### BEGIN SOLUTION\nthe answer\n### END SOLUTION"))
    nbformat.write(nb, path)
    with pytest.raises(LabError, match="in a markdown cell"):
        make_labs(tmp_path / "solutions", tmp_path / "labs")


def test_a_lab_with_nothing_to_write_is_refused(tmp_path):
    (tmp_path / "solutions").mkdir()
    _solution(tmp_path / "solutions" / "lab99_pool.ipynb", "def helper():\n    return 1")
    with pytest.raises(LabError, match="no ### BEGIN SOLUTION region"):
        make_labs(tmp_path / "solutions", tmp_path / "labs")
