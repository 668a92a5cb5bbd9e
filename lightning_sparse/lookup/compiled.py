"""How ``torch.compile`` sees a lookup: one opaque custom op, so that the user's dense part compiles around it.

A lookup reads the host (a CPU's id check, several ranks' split sizes), talks to the other ranks
and leaves records for the optimizer: nothing dynamo can or should trace. Under ``torch.compile``
the forward of a table or a collection is one ``torch.library`` custom op,
``lightning_sparse::lookup``, whose fake kernel gives the outputs' shapes and dtypes, so dynamo
traces the model around it with no graph break. At run time the op runs the eager lookup, with
autograd on inside it, and returns its outputs detached, with a handle: a small tensor that
holds the eager outputs and their graph. The op's backward, ``lightning_sparse::lookup_backward``,
runs that graph's backward with the outputs' gradients: the same sums and the same records as
an eager lookup, so a compiled model trains as an eager one does. The handle dies with the
compiled graph, and the eager graph with it: a lookup without backward leaves nothing behind.

Every rank runs the op as it would run the eager lookup: the collectives inside are the same.
Per-id weights that need a gradient are the one input the op does not take (it would have to
return their gradient): such a lookup runs eagerly, at the cost of a graph break, and trains as
eagerly. The eager lookups are ``torch.compiler.disable``-d, so dynamo never traces into them.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sparse.lookup import torch_compat as compat
from lightning_sparse.lookup.features import JaggedIds

# Each lookup unit (a table or a collection) by ``id``, for the op to find it: an op's arguments are tensors and numbers.
_UNITS: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()


def register(unit: nn.Module) -> Tensor:
    """Make ``unit`` (a table or a collection) one the op can run, and return the leaf its op's backward hangs on.

    The unit provides ``eager_lookup(inputs) -> list[Tensor]`` (its outputs in the order of
    ``output_specs``) and ``output_specs(inputs) -> list[(shape, dtype, device)]``, and keeps the
    returned leaf as ``compile_token``; a copy of the unit (``deepcopy``, pickle) registers itself again.
    """
    _UNITS[id(unit)] = unit
    # The op's backward returns this leaf's gradient (zeros): a value the compiled backward must compute, so it
    # runs every lookup's backward (an empty one would be computed without running them).
    return torch.zeros(1, requires_grad=True)


def register_copy(unit: nn.Module) -> None:
    """Register a copy of a unit (its ``__setstate__`` calls this): it keeps the original's ``compile_token``'s value."""
    _UNITS[id(unit)] = unit


def traceable(inputs: Any) -> bool:
    """Whether the op takes ``inputs``: not per-id weights that need a gradient (see the module)."""
    if isinstance(inputs, Tensor):
        return True
    return not any(isinstance(given, JaggedIds) and given.weights is not None and given.weights.requires_grad
                   for given in inputs.values())  # fmt: skip


def run_op(unit: nn.Module, inputs: Any) -> list[Tensor]:
    """The unit's outputs for ``inputs`` through the custom op (call it only while compiling, on :func:`traceable` inputs)."""
    layout, tensors = flatten(inputs)
    outputs, _handle = torch.ops.lightning_sparse.lookup(unit.compile_token, id(unit), layout, tensors, torch.is_grad_enabled())
    return outputs


def flatten(inputs: Any) -> tuple[str, list[Tensor]]:
    """A table's ids, or a collection's features, as (layout, tensors): what an op takes.

    The layout names each feature and what follows it: ``t`` a tensor of ids, ``o``/``l`` values
    then offsets/lengths, ``w`` weights after them. A table's ids are the layout ``""``.
    """
    if isinstance(inputs, Tensor):
        return "", [inputs]
    entries, tensors = [], []
    for name, given in inputs.items():
        if not isinstance(given, JaggedIds):
            entries.append(f"{name}:t")
            tensors.append(given)
            continue
        kind = ("o" if given.offsets is not None else "l") + ("w" if given.weights is not None else "")
        entries.append(f"{name}:{kind}")
        tensors += [given.values, given.offsets if given.offsets is not None else given.lengths]
        if given.weights is not None:
            tensors.append(given.weights)
    return ",".join(entries), tensors


def unflatten(layout: str, tensors: list[Tensor]) -> Tensor | dict[str, Any]:
    """The inverse of :func:`flatten`."""
    if not layout:
        return tensors[0]
    features, at = {}, 0
    for entry in layout.split(","):
        name, kind = entry.rsplit(":", 1)
        if kind == "t":
            features[name], at = tensors[at], at + 1
            continue
        values, structure, at = tensors[at], tensors[at + 1], at + 2
        weights = None
        if "w" in kind:
            weights, at = tensors[at], at + 1
        structure_kw = {"offsets": structure} if kind[0] == "o" else {"lengths": structure}
        features[name] = JaggedIds(values, weights=weights, **structure_kw)
    return features


# A lookup runs Python and leaves records on the host for the optimizer's step: a CUDA graph would replay its kernels
# without them, and the step would miss the gradients. Inductor's CUDA graphs (``mode="reduce-overhead"``) leave ops
# with this tag out of their capture (a step of one's own is capturable: ``capturable=True``, docs/guide/gpu.md).
NOT_IN_CUDA_GRAPHS = tuple(tag for tag in (getattr(torch.Tag, "cudagraph_unsafe", None),) if tag is not None)  # 2025 on


@torch.library.custom_op("lightning_sparse::lookup", mutates_args=(), tags=NOT_IN_CUDA_GRAPHS)
def _lookup(token: Tensor, unit: int, layout: str, tensors: list[Tensor], record: bool) -> tuple[list[Tensor], Tensor]:
    """The eager lookup of unit ``unit``: its outputs, detached, and a handle holding them with their graph."""
    module = _UNITS[unit]
    with compat.autograd_in_custom_op(), torch.set_grad_enabled(record):
        outputs = module.eager_lookup(unflatten(layout, tensors))
    handle = compat.handle_holding(outputs)  # saved for backward: the eager graph lives as long as the compiled one
    return _unaliased(outputs, tensors), handle


def _unaliased(outputs: list[Tensor], inputs: list[Tensor]) -> list[Tensor]:
    """The outputs, detached; a copy of each that shares memory with an input or an earlier output.

    A custom op's outputs may not alias (torch checks it): a collection's outputs on one GPU are
    views of one gathered tensor (``lookup/joint.py``), so all but the first are copied here.
    """
    seen = {given.untyped_storage().data_ptr() for given in inputs}
    unaliased = []
    for output in outputs:
        output = output.detach()
        storage = output.untyped_storage().data_ptr()
        if storage in seen:
            output = output.clone()
        seen.add(storage)
        unaliased.append(output)
    return unaliased


@_lookup.register_fake
def _(token: Tensor, unit: int, layout: str, tensors: list[Tensor], record: bool) -> tuple[list[Tensor], Tensor]:
    module = _UNITS[unit]
    specs = module.output_specs(unflatten(layout, tensors))
    return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in specs], torch.empty((), dtype=torch.int64)


def _save_handle(ctx: Any, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(output[1])
    ctx.num_tensors = len(inputs[3])


def _backward(ctx: Any, grads: list[Tensor | None], _handle_grad: Tensor | None) -> tuple:
    (handle,) = ctx.saved_tensors
    given = [index for index, grad in enumerate(grads) if grad is not None]  # known when tracing: no gradient, no record
    token_grad = torch.ops.lightning_sparse.lookup_backward([grads[i] for i in given], given, handle)
    return token_grad, None, None, [None] * ctx.num_tensors, None


@torch.library.custom_op("lightning_sparse::lookup_backward", mutates_args=(), tags=NOT_IN_CUDA_GRAPHS)
def _lookup_backward(grads: list[Tensor], outputs: list[int], handle: Tensor) -> Tensor:
    """The eager lookup's backward for the outputs that received a gradient; returns the token's gradient (zeros)."""
    eager = compat.held_by(handle)
    if eager is None:
        raise RuntimeError("A compiled lookup's backward lost its lookup: the handle tensor was copied. HINT: report this.")
    pairs = [(eager[i], grad) for i, grad in zip(outputs, grads) if eager[i].requires_grad]
    with compat.autograd_in_custom_op():
        torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs], retain_graph=True)
    return torch.zeros(1)


@_lookup_backward.register_fake
def _(grads: list[Tensor], outputs: list[int], handle: Tensor) -> Tensor:
    return torch.empty(1)


torch.library.register_autograd("lightning_sparse::lookup", _backward, setup_context=_save_handle)
