"""Sharded checkpoints: every rank writes and reads only its own rows, one tensor at a time, through DCP.

Layout of a checkpoint (``path`` is a link to a data directory, see ``files.py``)::

    epoch=0-step=6.ckpt -> .sparse-ckpt-<hash of the name>-<id>/
        .metadata, __<rank>_0.distcp        DCP: dense tensors (module, dense optimizers, step counters)
        rows/<key>/part-<k>/.metadata, __<rank>_0.distcp
                                            DCP, per table and per per-row optimizer state: band k
                                            of the logical [num_embeddings, ...] tensor
        meta.pt                             everything else Lightning saves, and each per-row
                                            tensor's shape, dtype and bands (loads with weights_only=True)
        checksums.json                      CRC-32 of every file above, and what it holds

``<key>`` (defined in ``contents.py``) is the name the tensor would have in one flat checkpoint: ``state_dict.users.weight``,
``optimizer_1.state.0.exp_avg``. Each per-row tensor is stored in global row order, so a
checkpoint loads on any number of ranks and under either sharding scheme (``rows.py``).

Memory: per-row tensors are written band by band and loaded band by band, in place into the
existing shard and optimizer state. So saving and loading need a fraction of a shard of scratch
on top of what the rank already holds, whatever the number of state tensors.
"""

from lightning_sparse.checkpoint.contents import dense_module_state, dense_optimizer_state, split_tensors, tables
from lightning_sparse.checkpoint.exporting import export
from lightning_sparse.checkpoint.files import DATA_PREFIX, DCP_METADATA_FILE, FORMAT, METADATA_FILE, is_sharded, remove
from lightning_sparse.checkpoint.reading import (
    StoredTensor,
    load_file,
    load_meta,
    load_module,
    load_sparse_optimizer,
    load_tensors,
    stored_tensors,
    verify,
)
from lightning_sparse.checkpoint.writing import save

__all__ = [
    "DATA_PREFIX", "DCP_METADATA_FILE", "FORMAT", "METADATA_FILE", "StoredTensor", "dense_module_state",
    "dense_optimizer_state", "export", "is_sharded", "load_file", "load_meta", "load_module", "load_sparse_optimizer",
    "load_tensors", "remove", "save", "split_tensors", "stored_tensors", "tables", "verify",
]  # fmt: skip
