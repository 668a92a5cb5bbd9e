"""Train DLRM on Criteo-shaped clicks with strategy="sparse_ddp", through LightningCLI.

cd examples/dlrm && python main.py fit --config config.yaml
# real Criteo data (TSV: label, I1..I13, C1..C26):
python main.py fit --config config.yaml --data.tsv /path/to/day_0 --data.tsv_limit 2000000
# raw 64-bit hashed ids: DynamicEmbedding vs id % N tables of the same memory (docs/dlrm-hashed.md)
python main.py fit --config hashed.yaml --model.tables dynamic
python main.py fit --config hashed.yaml --model.tables modulo
"""

from __future__ import annotations

import sys
from pathlib import Path

from data import CriteoDataModule
from lightning.pytorch.cli import LightningCLI
from model import DLRM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/: the main() they share
from cli_main import run_cli  # noqa: E402


class DLRMCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.max_rows", "model.max_rows")  # the tables' sizes follow the data's
        parser.link_arguments("data.hashed_features", "model.hashed_features")
        # The memory per rank of hashed-id tables is split over the trainer's processes.
        parser.link_arguments(("trainer.devices", "trainer.num_nodes"), "model.ranks", compute_fn=_ranks)


def _ranks(devices, num_nodes: int) -> int:
    """Processes of a trainer with ``devices`` per node (an int, a list of devices, or "auto": 1 per node)."""
    per_node = len(devices) if isinstance(devices, (list, tuple)) else int(devices) if str(devices).isdigit() else 1
    return per_node * num_nodes


def main() -> None:
    run_cli(DLRM, CriteoDataModule, DLRMCLI, threads=1)


if __name__ == "__main__":
    main()
