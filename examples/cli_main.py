"""The ``main()`` every LightningCLI example shares: run the CLI, then release the process group it made.

``python main.py fit --config ...`` in ``examples/kge`` and ``examples/dlrm``, and
``examples/recommender.py``, all end the same way: a rank destroys its process group before it
exits (``lightning_sparse`` also does so at exit, see ``lightning_sparse/faults/exits.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.cli import LightningCLI


def run_cli(model_class: type, datamodule_class: type, cli_class: type[LightningCLI] = LightningCLI, threads: int | None = None,
            **kwargs: Any) -> LightningCLI:  # fmt: skip
    """``cli_class(model_class, datamodule_class, save_config_callback=None, **kwargs)``, destroying the process group
    after if the run made it (a group that existed before is its maker's).

    ``threads``: ``torch.set_num_threads`` first (each rank's share of the cores).
    """
    if threads is not None:
        torch.set_num_threads(threads)
    made_here = not torch.distributed.is_initialized()
    try:
        return cli_class(model_class, datamodule_class, save_config_callback=None, **kwargs)
    finally:
        if made_here and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
