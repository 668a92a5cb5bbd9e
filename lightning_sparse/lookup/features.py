"""The input of a lookup, read without raising: a table's ids, or a collection's features.

A table's ids are any integer tensor (:func:`read_ids`: the one feature of a unit of one). A
collection's features come one entry per feature, and a feature's ids come as

* a tensor of ids: one output row per id with ``pooling="none"``, shaped like the ids; with a
  pooling mode, a 2-D ``[bags, ids per bag]`` tensor is a batch of equal bags (as for
  ``nn.EmbeddingBag``);
* :class:`JaggedIds`: bags of any length as flat ``values`` with ``offsets`` or ``lengths`` (the
  layout of ``nn.EmbeddingBag`` and of TorchRec's ``JaggedTensor``), optionally with
  per-value ``weights``;
* or, for all features at once, a TorchRec ``KeyedJaggedTensor`` (when torchrec is installed;
  it is not a dependency).

Reading never raises: a problem becomes an error code and the feature's position in the
lookup header (:class:`~lightning_sparse.wire.header.LookupHeader`), so that every rank raises the
same error in the same round. Checks that need the values (offsets that do not fit the values)
are made on the device and ride in the header too, with no host read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_sparse.wire.header import BAD_DTYPE, BAD_INPUT, NOT_A_TENSOR, OK, UNREADABLE

POOLING = ("none", "sum", "mean")

ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64)
# Dtypes, types and devices are named across ranks by their position here (a header carries integers only).
ID_SOURCE_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128, torch.bool, *ID_DTYPES,
)  # fmt: skip
ID_SOURCE_TYPES = ("list", "tuple", "ndarray", "int", "NoneType")
ID_DEVICES = ("cpu", "cuda", "meta")


def code_of(name: Any, names: tuple[Any, ...]) -> int:
    """``name``'s position in ``names`` (-1: another), as a header carries it."""
    return names.index(name) if name in names else -1


def code_name(code: int, names: tuple[Any, ...], unknown: str = "another kind") -> str:
    """The name a header's code stands for."""
    return str(names[code]) if 0 <= code < len(names) else unknown


@dataclass
class JaggedIds:
    """Bags of ids of one feature: ``values[offsets[b] : offsets[b + 1]]`` is bag ``b``.

    Args:
        values: 1-D integer ids of all bags, bag after bag.
        offsets: ``[bags + 1]``, starting at 0 and ending at ``len(values)`` (TorchRec's layout,
            ``nn.EmbeddingBag(include_last_offset=True)``); or give ``lengths`` instead.
        lengths: ``[bags]``, the number of ids in each bag.
        weights: optional ``[len(values)]`` per-id weights for a weighted sum (``pooling="sum"``).

    >>> bags = JaggedIds(torch.tensor([4, 7, 7]), lengths=torch.tensor([2, 0, 1]))
    >>> bags.bag_offsets().tolist(), bags.num_bags
    ([0, 2, 2, 3], 3)
    """

    values: Tensor
    offsets: Tensor | None = None
    lengths: Tensor | None = None
    weights: Tensor | None = None

    def __post_init__(self) -> None:
        if (self.offsets is None) == (self.lengths is None):
            raise ValueError("JaggedIds needs exactly one of offsets and lengths. HINT: JaggedIds(values, offsets=...).")

    @property
    def num_bags(self) -> int:
        return len(self.offsets) - 1 if self.offsets is not None else len(self.lengths)

    def bag_offsets(self) -> Tensor:
        """``[bags + 1]`` int64 offsets."""
        if self.offsets is not None:
            return self.offsets.to(torch.int64)
        return torch.cat([self.lengths.new_zeros(1, dtype=torch.int64), torch.cumsum(self.lengths, 0)])


@dataclass
class FeatureIds:
    """One feature of a batch as a collection reads it: flat ids on the tables' device, and how to shape the output."""

    name: str
    index: int  # position among the collection's features
    table: int  # position of its table among the collection's tables
    ids: Tensor  # flat int64
    shape: tuple[int, ...]  # output rows for pooling "none": the ids' shape
    offsets: Tensor | None = None  # [bags + 1] for pooled features
    weights: Tensor | None = None
    dtype: int = -1  # the given ids' dtype, as ``code_of(dtype, ID_SOURCE_DTYPES)``


@dataclass
class Problem:
    """The first bad input found on this rank: header fields and this rank's own words."""

    error: int = OK
    feature: int = -1  # the feature's position
    detail: int = 0
    dtype: int = -1
    words: str | None = None


def as_feature_dict(features: Any) -> Mapping[str, Any] | None:
    """A mapping of feature name to input, from a dict or a TorchRec ``KeyedJaggedTensor``; else ``None``."""
    if isinstance(features, Mapping):
        return features
    if hasattr(features, "to_dict") and hasattr(features, "keys") and hasattr(features, "lengths"):  # KeyedJaggedTensor
        return {
            key: JaggedIds(jagged.values(), offsets=jagged.offsets(), weights=jagged.weights_or_none())
            for key, jagged in features.to_dict().items()
        }
    return None


def flat_ids(ids: Any, device: torch.device) -> tuple[Tensor, dict[str, int], str | None]:
    """``ids`` as flat int64 on ``device``, the header fields that describe them, and words for a problem.

    Never raises: a problem becomes ``error`` (and ``detail``) in the returned fields; the ids
    are then empty.
    """
    empty = torch.empty(0, dtype=torch.int64, device=device)
    if not isinstance(ids, Tensor):
        return empty, {"error": NOT_A_TENSOR, "detail": code_of(type(ids).__name__, ID_SOURCE_TYPES)}, type(ids).__name__
    verdict = {"dtype": code_of(ids.dtype, ID_SOURCE_DTYPES)}
    if ids.dtype not in ID_DTYPES:
        return empty, {**verdict, "error": BAD_DTYPE}, None
    try:
        flat = ids.reshape(-1)
        if flat.dtype == torch.uint64:  # ids of 2**63 or more turn negative: the range check names them
            flat = flat.view(torch.int64)
        return flat.to(device=device, dtype=torch.int64), verdict, None
    except Exception as err:  # e.g. a meta tensor, or a device that cannot be read from here
        return (
            empty,
            {**verdict, "error": UNREADABLE, "detail": code_of(ids.device.type, ID_DEVICES)},
            f"{type(err).__name__}: {err}",
        )


def read_ids(ids: Any, name: str, device: torch.device) -> tuple[list[FeatureIds], Problem]:
    """The ids of one table as the one feature of a lookup unit of one (see :class:`~lightning_sparse.lookup.units.OneTable`)."""
    flat, verdict, words = flat_ids(ids, device)
    error = verdict.get("error", OK)
    if error != OK:
        return [], Problem(error, 0, verdict.get("detail", 0), verdict.get("dtype", -1), words)
    return [FeatureIds(name, 0, 0, flat, tuple(ids.shape), dtype=verdict["dtype"])], Problem()


def read_features(
    features: Any,
    names: list[str],
    table_of_feature: list[int],
    pooling: list[str],
    device: torch.device,
) -> tuple[list[FeatureIds], Problem, Tensor | None]:
    """Read every given feature; returns them, the first problem found, and device flags (per feature read) for bad offsets.

    ``features``: a mapping of feature name to input, or a TorchRec ``KeyedJaggedTensor``.

    ``names``, ``table_of_feature`` and ``pooling`` describe the collection's features. Features after a
    problem are left out (the lookup will raise on every rank anyway).
    """
    read: list[FeatureIds] = []
    given = as_feature_dict(features)
    if given is None:
        words = (f"a collection takes a dict of feature name -> ids (or JaggedIds), or a KeyedJaggedTensor; got "
                 f"{type(features).__name__}. HINT: collection({{{names[0]!r}: ids, ...}}).")  # fmt: skip
        return read, Problem(BAD_INPUT, words=words), None
    features = given
    bad_offsets: list[Tensor] = []
    fits = torch.zeros((), dtype=torch.bool, device=device)
    jagged_seen = False
    for key in features:
        if key not in names:
            words = (f"unknown feature {key!r}; the collection's features are {names}. HINT: drop it, or map it to a "
                     f"table when building the collection: features={{{key!r}: table name, ...}}.")  # fmt: skip
            return read, Problem(BAD_INPUT, words=words), None
    for index, name in enumerate(names):
        if name not in features:
            continue
        given, mode = features[name], pooling[index]
        jagged = given if isinstance(given, JaggedIds) else None
        flat, verdict, words = flat_ids(jagged.values if jagged else given, device)
        if verdict.get("error", OK) != OK:
            return read, Problem(verdict["error"], index, verdict.get("detail", 0), verdict.get("dtype", -1), words), None
        shape = tuple(given.shape) if jagged is None else (len(flat),)
        feature = FeatureIds(name, index, table_of_feature[index], flat, shape, dtype=verdict.get("dtype", -1))
        words = _layout_problem(given, jagged, mode)
        if words is not None:
            return read, Problem(BAD_INPUT, index, dtype=verdict.get("dtype", -1), words=words), None
        if mode != "none":
            if jagged is None:  # [bags, ids per bag]
                bags, per_bag = given.shape
                feature.offsets = torch.arange(bags + 1, device=device) * per_bag
            else:
                jagged_seen = True
                feature.offsets = jagged.bag_offsets().to(device)
                feature.weights = jagged.weights.to(device).reshape(-1) if jagged.weights is not None else None
                bad_offsets.append(_offsets_misfit(feature.offsets, len(flat)))
        if len(bad_offsets) == len(read):
            bad_offsets.append(fits)
        read.append(feature)
    flags = torch.stack(bad_offsets) if jagged_seen else None
    return read, Problem(), flags


def _layout_problem(given: Any, jagged: JaggedIds | None, mode: str) -> str | None:
    """What is wrong with the layout (host-side facts only: shapes, dtypes), or ``None``."""
    if jagged is None:
        if mode != "none" and given.dim() != 2:
            return (f"pooling {mode!r} needs bags: got ids of shape {tuple(given.shape)}. HINT: pass 2-D "
                    f"[bags, ids per bag] ids or JaggedIds(values, offsets=...).")  # fmt: skip
        return None
    if jagged.values.dim() != 1:
        return f"JaggedIds values must be 1-D, got shape {tuple(jagged.values.shape)}. HINT: flatten them (values.reshape(-1))."
    if mode == "none":
        if jagged.weights is not None:
            return "per-id weights need pooling 'sum'. HINT: set the feature's pooling to 'sum'."
        return None
    structure = jagged.offsets if jagged.offsets is not None else jagged.lengths
    if structure.dim() != 1 or structure.dtype.is_floating_point or structure.dtype == torch.bool:
        return (f"JaggedIds offsets/lengths must be a 1-D integer tensor, got {structure.dtype} of shape "
                f"{tuple(structure.shape)}. HINT: one int64 entry per bag (lengths) or per bag + 1 (offsets).")  # fmt: skip
    if jagged.offsets is not None and len(jagged.offsets) == 0:
        return "JaggedIds offsets need bags + 1 entries (at least [0]). HINT: offsets start at 0 and end at len(values)."
    if jagged.weights is not None:
        if mode != "sum":
            return f"per-id weights need pooling 'sum', the feature's pooling is {mode!r}. HINT: set its pooling to 'sum'."
        if tuple(jagged.weights.shape) != tuple(jagged.values.shape) or not jagged.weights.dtype.is_floating_point:
            return (f"weights must be floating point and shaped like values {tuple(jagged.values.shape)}, got "
                    f"{jagged.weights.dtype} of shape {tuple(jagged.weights.shape)}. HINT: one float weight per id.")  # fmt: skip
    return None


def _offsets_misfit(offsets: Tensor, num_values: int) -> Tensor:
    """A 0-d device flag: the offsets do not start at 0, decrease, or do not end at ``num_values``."""
    misfit = (offsets[0] != 0) | (offsets[-1] != num_values)
    if len(offsets) > 1:
        misfit = misfit | (offsets[1:] < offsets[:-1]).any()
    return misfit
