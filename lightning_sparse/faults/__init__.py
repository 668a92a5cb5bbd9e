"""Faults and exits: a lost peer as one clear error on every rank (``peers``), clean process exits (``exits``), torch's flight recorder off (``flight_recorder``)."""

from lightning_sparse.faults.peers import PeerFailure

__all__ = ["PeerFailure"]
