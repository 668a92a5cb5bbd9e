"""Train knowledge-graph embeddings on WN18RR (or any head<TAB>relation<TAB>tail graph) with sparse_ddp.

cd examples/kge && python main.py fit --config distmult.yaml
python main.py test --config distmult.yaml --ckpt_path best
"""

from __future__ import annotations

import torch
from data import KGDataModule
from lightning.pytorch.cli import LightningCLI
from model import KGE


class KGECLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.num_entities", "model.num_entities", apply_on="instantiate")
        parser.link_arguments("data.num_relations", "model.num_relations", apply_on="instantiate")


def main() -> None:
    try:
        KGECLI(KGE, KGDataModule, save_config_callback=None)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
