"""The wire: where rows live (``sharding``, ``hashing``), the one sort (``grouping``), and the all-to-all stages.

Ids to owners and rows to requesters (``exchange``), grads to owners (``grads_exchange``), over the
two all-to-all primitives (``alltoall``) with the lookup header in front (``header``), many tables
in one buffer (``packing``), 2-D sharding's replicas (``replicas``), and a batch's ids sent ahead of its
lookup while the batch before it trains (``ahead``: :func:`pipelined`).
"""

from lightning_sparse.wire.ahead import Pipeline, pipelined
from lightning_sparse.wire.replicas import sharding_groups
from lightning_sparse.wire.sharding import JointSharding, RowSharding

__all__ = ["JointSharding", "Pipeline", "RowSharding", "pipelined", "sharding_groups"]
