"""Train DLRM on Criteo-shaped clicks with strategy="sparse_ddp", through LightningCLI.

    cd examples/dlrm && python main.py fit --config config.yaml
    # real Criteo data (TSV: label, I1..I13, C1..C26):
    python main.py fit --config config.yaml --data.tsv /path/to/day_0 --data.tsv_limit 2000000
"""

from __future__ import annotations

import torch
from lightning.pytorch.cli import LightningCLI

from data import CriteoDataModule
from model import DLRM


class DLRMCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.max_rows", "model.max_rows")  # the tables' sizes follow the data's


def main() -> None:
    torch.set_num_threads(1)
    try:
        DLRMCLI(DLRM, CriteoDataModule, save_config_callback=None)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
