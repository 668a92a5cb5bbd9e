"""Which rank owns an arbitrary 64-bit id: a fixed mix of its bits, and the mix's key space.

A :class:`~lightning_sparse.tables.dynamic.DynamicEmbedding` takes ids that are not row numbers (hashes
of user ids, URLs, query strings). ``id % W`` would cluster real hash values on a few ranks
(they often share low bits), so the owner is read from the high bits of :func:`mix`, a
bijection on 64 bits (SplitMix64's finalizer): distinct ids keep distinct keys, and
:func:`unmix` turns a key back into its id (for initialization and export).

The *key* of an id is its mix as a signed int64. Rank ``r`` owns the keys in
``[boundary(r), boundary(r + 1))``, equal slices of the int64 range, so sorting keys groups
them by owner, as owner-major row keys do for :class:`~lightning_sparse.wire.sharding.RowSharding`;
the same lookup stage (:func:`~lightning_sparse.wire.exchange.ids_to_owners`) sends them.

>>> ids = torch.tensor([0, 1, 2, -1, 2**62])
>>> bool((unmix(mix(ids)) == ids).all())
True
>>> HashSharding(3).owner_of_key(mix(torch.arange(9))).tolist()
[1, 2, 1, 1, 0, 0, 0, 1, 1]
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from lightning_sparse.kernels import computes_in_triton
from lightning_sparse.wire.grouping import SortedKeys

_BITS = 64
_MASK = (1 << _BITS) - 1
# SplitMix64's finalizer: xor-shift, multiply, xor-shift, multiply, xor-shift (all invertible).
_SHIFTS = (30, 27, 31)
_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
MIX_SHIFTS, MIX_MULTIPLIERS = _SHIFTS, _MULTIPLIERS  # for loops that mix ids as :func:`mix` does (tables/slot_kernels.py)


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    value &= _MASK
    return value - (1 << _BITS) if value >= 1 << (_BITS - 1) else value


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical (unsigned) right shift of int64 values: torch's ``>>`` copies the sign bit."""
    return (x >> bits) & ((1 << (_BITS - bits)) - 1)


def _unshift(x: Tensor, bits: int) -> Tensor:
    """Inverse of ``x ^ (x >>> bits)``: each pass recovers ``bits`` more of the high bits."""
    out = x ^ _shift_right(x, bits)  # right in the top 2 * bits bits
    for _ in range(-(-_BITS // bits) - 2):
        out = x ^ _shift_right(out, bits)
    return out


def mix(ids: Tensor) -> Tensor:
    """The key of each id (int64 in, int64 out): a bijection that spreads every input bit over the output.

    On a GPU one kernel (:func:`lightning_sparse.kernels.triton_slots.mix`) instead of 11 ops.
    """
    if computes_in_triton(ids) and ids.is_contiguous():
        from lightning_sparse.kernels import triton_slots

        return triton_slots.mix(ids, _SHIFTS, tuple(_signed(m) for m in _MULTIPLIERS))
    x = ids.to(torch.int64)
    x = (x ^ _shift_right(x, _SHIFTS[0])) * _signed(_MULTIPLIERS[0])
    x = (x ^ _shift_right(x, _SHIFTS[1])) * _signed(_MULTIPLIERS[1])
    return x ^ _shift_right(x, _SHIFTS[2])


def unmix(keys: Tensor) -> Tensor:
    """The id of each key: the inverse of :func:`mix`."""
    x = _unshift(keys.to(torch.int64), _SHIFTS[2])
    x = _unshift(x * _signed(pow(_MULTIPLIERS[1], -1, 1 << _BITS)), _SHIFTS[1])
    return _unshift(x * _signed(pow(_MULTIPLIERS[0], -1, 1 << _BITS)), _SHIFTS[0])


@dataclass(frozen=True)
class HashSharding:
    """Owners of hashed keys over ``world_size`` ranks: rank ``r`` owns ``[boundary(r), boundary(r + 1))``.

    The interface of :class:`~lightning_sparse.wire.sharding.RowSharding` that the lookup stage
    uses; the "local id" a requester sends is the key itself (the owner maps it to a slot).
    """

    world_size: int

    @cached_property
    def boundaries(self) -> tuple[int, ...]:
        """The first key of each rank (``-2**63`` for rank 0); the last rank's keys run to ``2**63 - 1``."""
        span = 1 << _BITS
        return tuple(-(1 << (_BITS - 1)) + -(-rank * span // self.world_size) for rank in range(self.world_size))

    def key(self, ids: Tensor) -> Tensor:
        return mix(ids)

    def owner_of_key(self, keys: Tensor) -> Tensor:
        if self.world_size == 1:
            return torch.zeros_like(keys)
        inner = torch.tensor(self.boundaries[1:], dtype=torch.int64, device=keys.device)
        return torch.bucketize(keys, inner, right=True)

    def local_of_key(self, keys: Tensor) -> Tensor:
        return keys

    def owner_counts_below(self, runs: SortedKeys, device: torch.device) -> Tensor:
        """``[W + 1]``: how many distinct keys of ``runs`` belong to ranks below each rank (and, last, all of them).

        The last boundary, ``2**63``, is no int64: the total is the number of distinct keys.
        """
        below = runs.counts_below(torch.tensor(self.boundaries, dtype=torch.int64, device=device))
        total = runs.run_index()[-1:] + 1 if len(runs.sorted) else below.new_zeros(1)
        return torch.cat([below, total])
