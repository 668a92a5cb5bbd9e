"""What only a GPU shows, held on a CPU: by the source where the interpreter cannot show it, by behaviour where it can.

Triton's interpreter runs a program as one, in float64, on the current thread: it divides exactly,
has no current device, no stream to capture and no order among atomics. So the rules a compiled
kernel needs (issue 42, docs/design.md "What only a GPU shows") are checked on the package's
source here, and what a CPU can show is run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import lightning_sparse as ls
from lightning_sparse.kernels import backend

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


def _name(node: ast.AST) -> str:
    """The last name of ``a.b.c`` or ``c``."""
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _inside(node: ast.AST, parents: dict[ast.AST, ast.AST], context: str) -> bool:
    """Whether ``node`` sits in a ``with`` whose item calls ``context`` with one argument (a device)."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.With):
            for item in node.items:
                call = item.context_expr
                if isinstance(call, ast.Call) and _name(call.func) == context and len(call.args) == 1:
                    return True
    return False


def _calls(where: dict[str, ast.Module], wanted) -> list[tuple[str, ast.Call, dict]]:
    found = []
    for name, tree in where.items():
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        found += [(name, node, parents) for node in ast.walk(tree) if isinstance(node, ast.Call) and wanted(node)]
    return found


def test_every_triton_launch_and_cuda_event_is_under_its_tensors_device():
    """Triton launches on the current device and stream, and an event records on the current device's stream: each
    ``kernel[grid](...)`` sits in ``launches.launch(device)``, each event's ``record()`` in ``on_device(device)``."""
    modules = _modules()
    kernels = {node.name for node in _jit_functions().values()}
    launches = _calls(modules, lambda call: isinstance(call.func, ast.Subscript) and _name(call.func.value) in kernels)
    records = _calls(modules, lambda call: _name(call.func) == "record" and "event" in ast.unparse(call.func).lower())
    assert len(launches) >= 10 and len(records) >= 2, (len(launches), len(records))  # the check reaches them
    unguarded = [f"{name} line {call.lineno}: {ast.unparse(call.func)}" for name, call, parents in launches
                 if not _inside(call, parents, "launch")]  # fmt: skip
    unguarded += [f"{name} line {call.lineno}: {ast.unparse(call.func)}" for name, call, parents in records
                  if not _inside(call, parents, "on_device")]  # fmt: skip
    assert not unguarded, unguarded


def test_a_launch_makes_its_tensors_cuda_device_current(monkeypatch):
    entered = []

    class Device:  # stands in for torch.cuda.device, which needs a GPU to enter
        def __init__(self, device: torch.device) -> None:
            self.device = device

        def __enter__(self) -> None:
            entered.append(self.device)

        def __exit__(self, *exc) -> None:
            entered.append("left")

    monkeypatch.setattr(torch.cuda, "device", Device)
    with backend.launches.launch(torch.device("cuda", 1)):
        assert entered == [torch.device("cuda", 1)]
    with backend.launches.launch(torch.device("cpu")):  # a CPU tensor (the interpreter): no CUDA device to make current
        pass
    assert entered == [torch.device("cuda", 1), "left"]
