"""Faults and exits: a lost peer as one clear error on every rank (``peers``), and clean process exits (``exits``)."""

from lightning_sparse.faults.peers import PeerFailure

__all__ = ["PeerFailure"]
