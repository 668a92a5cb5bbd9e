"""Command line: ``python -m lightning_sparse export CHECKPOINT OUT.pt``."""

from __future__ import annotations

import argparse
import sys

from lightning_sparse import checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_sparse", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser(
        "export",
        help="write a sharded checkpoint's module state as one plain torch.save state dict",
        description="Tables become full [num_embeddings, embedding_dim] tensors loadable into nn.Embedding. "
        "Runs in one process; memory stays O(one table).",
    )
    export.add_argument("checkpoint", help="a sharded checkpoint (e.g. checkpoints/last.ckpt)")
    export.add_argument("out", help="output file, e.g. model.pt")
    args = parser.parse_args(argv)

    if not checkpoint.is_sharded(args.checkpoint):
        parser.error(f"{args.checkpoint} is not a sharded checkpoint (no {checkpoint.DCP_METADATA_FILE} inside)")
    tables = set(checkpoint.load_meta(args.checkpoint).get("sparse_tables", {}))
    summary = checkpoint.export(args.checkpoint, args.out)
    total = 0
    for key, shape, dtype, nbytes in summary:
        kind = "table" if key.removesuffix(".weight") in tables else "dense"
        print(f"{kind:5}  {key:40} {str(list(shape)):>20}  {str(dtype).removeprefix('torch.'):8} {nbytes / 2**20:10.2f} MiB")
        total += nbytes
    print(
        f"wrote {args.out}: {len(summary)} tensors ({sum(1 for k, *_ in summary if k.removesuffix('.weight') in tables)} tables), {total / 2**20:.2f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
