"""The lookup engine: read -> one sort -> ids to owners -> rows back -> expand or pool (``engine``).

A lookup's input (``features``) and the verdict on it (``verdict``, ``range_check``), its outputs
and where their gradient stops (``outputs``, ``pooling``, ``pending``), many tables' rows in one
round (``joint_rows``), a collection's round on one GPU (``joint``), and the custom op that
``torch.compile`` sees (``compiled``).
"""

from lightning_sparse.lookup.engine import serve_lookups
from lightning_sparse.lookup.features import JaggedIds

__all__ = ["JaggedIds", "serve_lookups"]
