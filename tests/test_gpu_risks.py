"""What only a GPU shows, held on a CPU: by the source where the interpreter cannot show it, by behaviour where it can.

Triton's interpreter runs a program as one, in float64, on the current thread: it divides exactly,
has no current device, no stream to capture and no order among atomics. So the rules a compiled
kernel needs (issue 42, docs/design.md "What only a GPU shows") are checked on the package's
source here, and what a CPU can show is run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_sparse as ls

PACKAGE = Path(ls.__file__).parent


def _modules() -> dict[str, ast.Module]:
    return {str(path.relative_to(PACKAGE)): ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def _is_jit(node: ast.AST) -> bool:
    """A function decorated with ``triton.jit`` (or ``@triton.jit(...)``)."""
    if not isinstance(node, ast.FunctionDef):
        return False
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
    return False


def _jit_functions() -> dict[str, ast.FunctionDef]:
    return {f"{name}:{node.name}": node for name, tree in _modules().items() for node in ast.walk(tree) if _is_jit(node)}


def test_no_kernel_divides_with_a_plain_slash():
    """``/`` compiles to ``div.full.f32`` (2 ulp); torch divides rounded to nearest: kernels use ``tl.div_rn``.

    A quotient of two literals is folded by Triton in Python (exactly, then rounded once) and may stay.
    """
    kernels = _jit_functions()
    assert len(kernels) > 20, sorted(kernels)  # the check reaches every kernel file
    slashes = []
    for name, function in kernels.items():
        for node in ast.walk(function):
            divides = isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
            if divides and not (isinstance(node.left, ast.Constant) and isinstance(node.right, ast.Constant)):
                slashes.append(f"{name} line {node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Div):
                slashes.append(f"{name} line {node.lineno}: {ast.unparse(node)}")
    assert not slashes, slashes
