"""Honest solutions in other styles, made from each lab's solution by rewriting its source.

Grading must not depend on how a learner lays out correct code. Each style keeps what the solution
computes and changes only its form: all in one cell, every import under another name, slotted
classes (no attribute can be added to an instance, so a harness that writes into learner objects
breaks), and methods written as module-level functions bound in the class body.
"""
from __future__ import annotations

import ast
import copy

from notebook_cells import graded_cells

from kvlib.course.grading.extract import extract


def graded_source(solution, needs: tuple[str, ...]) -> str:
    """The statements the grader keeps from ``solution``, as one module's source."""
    return "\n\n\n".join(s.source for s in extract(graded_cells(solution), needs).statements)


def one_cell(source: str, needs: tuple[str, ...]) -> str:
    return source


def aliased_imports(source: str, needs: tuple[str, ...]) -> str:
    """``import x`` as ``_x_``, ``from m import n`` as ``_n_``, and every use renamed (Triton's names kept)."""
    tree = ast.parse(source)
    renames = {}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not (isinstance(node, ast.ImportFrom)
                                                                     and node.module == "__future__"):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                if alias.name == "*" or "." in alias.name and not alias.asname or _module(node, alias).startswith("triton"):
                    continue  # Triton's interpreter reads ``tl.constexpr`` in a kernel's source by that name
                renames[bound] = alias.asname = f"_{bound}_"

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node):
            node.id = renames.get(node.id, node.id)
            return node
    return ast.unparse(Rename().visit(tree))


def _module(node, alias) -> str:
    return alias.name if isinstance(node, ast.Import) else node.module or ""


def slotted(source: str, needs: tuple[str, ...]) -> str:
    """Graded classes with no base get ``__slots__`` naming every attribute their methods set."""
    tree = ast.parse(source)
    for cls in [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in needs and not n.bases
                and not n.decorator_list]:
        names = sorted({t.attr for f in ast.walk(cls) if isinstance(f, (ast.Assign, ast.AugAssign, ast.AnnAssign))
                        for t in ast.walk(f) if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                        and t.value.id == "self" and isinstance(t.ctx, ast.Store)})
        cls.body.insert(0, ast.parse(f"__slots__ = {tuple(names)!r}").body[0])
    return ast.unparse(tree)


def methods_outside(source: str, needs: tuple[str, ...]) -> str:
    """Each method of a graded class (one using neither ``super()`` nor ``__class__``) written as a
    module-level function and bound in the class body."""
    tree = ast.parse(source)
    body = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in needs:
            for i, method in enumerate(node.body):
                if isinstance(method, ast.FunctionDef) and not _needs_class_cell(method) \
                        and not method.name.startswith("__") and not method.decorator_list:
                    outside = copy.deepcopy(method)
                    outside.name = f"_{node.name}_{method.name}"
                    body.append(outside)
                    node.body[i] = ast.parse(f"{method.name} = {outside.name}").body[0]
        body.append(node)
    tree.body = body
    return ast.unparse(tree)


def _needs_class_cell(function: ast.FunctionDef) -> bool:
    return any(isinstance(n, ast.Name) and n.id in ("super", "__class__") for n in ast.walk(function)) or any(
        isinstance(n, ast.Attribute) and n.attr.startswith("__") and not n.attr.endswith("__") for n in ast.walk(function))


STYLES = {"one_cell": one_cell, "aliased_imports": aliased_imports, "slotted": slotted,
          "methods_outside": methods_outside}
