"""Train knowledge-graph embeddings on WN18RR (or any head<TAB>relation<TAB>tail graph) with sparse_ddp.

cd examples/kge && python main.py fit --config distmult.yaml
python main.py test --config distmult.yaml --ckpt_path best
"""

from __future__ import annotations

import sys
from pathlib import Path

from data import KGDataModule
from lightning.pytorch.cli import LightningCLI
from model import KGE

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/: the main() they share
from cli_main import run_cli  # noqa: E402


class KGECLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.num_entities", "model.num_entities", apply_on="instantiate")
        parser.link_arguments("data.num_relations", "model.num_relations", apply_on="instantiate")


def main() -> None:
    run_cli(KGE, KGDataModule, KGECLI)


if __name__ == "__main__":
    main()
