"""Lab 03's rule, "your Triton kernel does the attention", read from the learner's source in the grader.

The sandbox's launch log can only cost points: code loaded before the checks can rebind it, or hand
a kernel a torch-computed answer as an integer address. So the rule is also checked here, where the
learner's code never runs: in the definitions the grader extracted, outside ``@triton.jit``
functions, nothing computes attention in torch (softmax, exp, matrix products), nothing hands a
kernel an address (``data_ptr``, pointer casts, inside kernels too), nothing reaches around the
code's own names (``reach_rule``, every lab's), and imports are the lab's own list.
A breach fails every check of the task and is reported to the instructor.
"""
from __future__ import annotations

import ast

from kvlib.course.grading.reach_rule import importable, in_line_order, where

ALLOWED_IMPORTS = ("torch", "triton", "functools", "math", "typing", "__future__", "dataclasses", "itertools")
TORCH_ATTENTION = {"softmax", "log_softmax", "exp", "exp2", "matmul", "bmm", "baddbmm", "mm", "einsum", "tensordot",
                   "scaled_dot_product_attention", "linear", "functional",
                   # the same attention built from elementwise products and reductions
                   "sum", "amax", "amin", "mean", "prod", "cumsum", "logsumexp", "sigmoid", "pow", "mul", "multiply",
                   "div", "divide", "true_divide", "square", "dot", "vdot", "inner", "outer", "mv", "addmm", "addmv",
                   "norm", "reduce"}
ADDRESSES = {"data_ptr", "pointer_type", "int_to_ptr", "untyped_storage", "from_address"}


def breaches(statements) -> list[str]:
    """What in the graded definitions breaks the rule: one line each, naming the cell and line."""
    found: list[str] = []
    for statement in statements:
        tree = ast.parse(statement.source)
        kernels = {id(n) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and _is_jit(n)
                   for n in ast.walk(n)}
        for node in ast.walk(tree):
            name, at = _name(node), where(statement, node)
            operator = isinstance(node, ast.BinOp) and ("@" if isinstance(node.op, ast.MatMult) else
                                                        "**" if _power_of_a_value(node) else None)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or "."]
                found += [f"{at}: imports {n}; the lab allows torch, triton, functools and math" for n in names
                          if n.split(".")[0] not in ALLOWED_IMPORTS and importable(n)]  # the others: reach_rule says
            elif name in ADDRESSES:
                found.append(f"{at}: uses {name}; a kernel reads its inputs as tensors, through its own names")
            elif id(node) not in kernels and (name in TORCH_ATTENTION or operator):
                found.append(f"{at}: computes {name or operator} in torch, outside a @triton.jit kernel; the "
                             f"attention must be your kernel's")
    return in_line_order(found)


def _power_of_a_value(node: ast.BinOp) -> bool:
    """``x ** y`` with ``y`` computed (``math.e ** scores`` is exp); ``d ** -0.5`` is not."""
    exponent = node.right.operand if isinstance(node.right, ast.UnaryOp) else node.right
    return isinstance(node.op, ast.Pow) and not isinstance(exponent, ast.Constant)


def _is_jit(function: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in function.decorator_list)


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None
