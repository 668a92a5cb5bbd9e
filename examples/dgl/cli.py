"""The command line both DGL examples share: LightningCLI, the graph's size linked into the model, test after fit."""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI


class GraphCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.num_nodes", "model.num_nodes", apply_on="instantiate")
        parser.link_arguments("data.communities", "model.num_classes")

    def after_fit(self) -> None:
        """Community recovery on the test nodes (never labelled, never used for early stopping)."""
        self.trainer.test(self.model, datamodule=self.datamodule)


def main(model_class, datamodule_class, args: list[str] | None = None) -> GraphCLI:
    # Lightning's launcher gives each process cores // processes threads (unless OMP_NUM_THREADS is set).
    return GraphCLI(model_class, datamodule_class, save_config_callback=None, args=args)
