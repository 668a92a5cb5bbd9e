"""Every reach into torch's private API below the Lightning layer, in one place (Lightning's: ``lightning/compat.py``).

Each is named here once, with what it is for; ``tests/test_compat.py`` checks each assumption.
Checked against torch 2.13.0 (and 2.11, the GPU machine's).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch

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
