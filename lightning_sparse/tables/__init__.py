"""What a user builds: ``SparseEmbedding``, ``DynamicEmbedding``, ``SparseEmbeddingCollection``, and row initializers."""

from lightning_sparse.tables.collection import SparseEmbeddingCollection
from lightning_sparse.tables.dynamic import DynamicEmbedding
from lightning_sparse.tables.embedding import SparseEmbedding
from lightning_sparse.tables.shard_state import full_state_dict

__all__ = ["DynamicEmbedding", "SparseEmbedding", "SparseEmbeddingCollection", "full_state_dict"]
