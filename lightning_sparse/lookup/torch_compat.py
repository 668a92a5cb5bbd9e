"""Every reach into torch's private API below the Lightning layer, in one place (Lightning's: ``lightning/compat.py``).

Each is named here once, with what it is for; ``tests/test_compat.py`` checks each assumption.
Checked against torch 2.13.0 (and 2.11, the GPU machine's).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor

TORCH_CHECKED = "2.13.0"


@contextmanager
def autograd_in_custom_op() -> Iterator[None]:
    """Autograd recording inside a ``torch.library`` custom op's implementation, which runs below autograd.

    Torch excludes the autograd dispatch keys while an op's implementation runs (its autograd is
    the op's registered formula). The compiled lookup (``compiled.py``) runs the eager lookup, and
    its backward the eager backward, inside such ops, with the keys included again here
    (``torch._C._SetExcludeDispatchKeyGuard``).
    """
    keys = ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView")
    with ExitStack() as stack:
        for key in keys:
            stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(getattr(torch._C.DispatchKey, key), False))
        with torch.enable_grad():
            yield


def handle_holding(value: Any) -> Tensor:
    """A 0-d tensor that holds ``value`` for as long as the tensor lives (:func:`held_by` gives it back).

    The value rides as an attribute of the tensor's Python object. Torch keeps that object, with
    its attributes, alive while the tensor lives in C++ (an autograd graph's saved tensors: "PyObject
    preservation"), so the value lives exactly as long as the graph that saved the handle, and dies
    with it: the compiled lookup's eager graph (``compiled.py``).
    """
    handle = torch.zeros((), dtype=torch.int64)
    handle.held_value = value
    return handle


def held_by(handle: Tensor) -> Any:
    """What :func:`handle_holding` put in ``handle`` (``None`` for a copy of it, which holds nothing)."""
    return getattr(handle, "held_value", None)


def version(tensor: Tensor) -> int:
    """``tensor``'s version counter (``Tensor._version``), which every in-place change of it increments.

    A pipelined lookup (``engine.Round``) compares it with the one its input had when its ids were sent ahead.
    """
    return tensor._version
