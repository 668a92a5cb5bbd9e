"""DistMult on WN18RR with torch.distributed alone (no Lightning): 2 CPU processes on gloo.

Entities live in a row-sharded SparseEmbedding trained by SparseAdagrad; the small relation
table is a dense parameter trained through DistributedDataParallel. Run::

    python examples/train_plain_torch.py --world-size 2
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from wn18rr import data_dir, load_split

import lightning_sparse as ls


class DistMult(nn.Module):
    def __init__(self, num_entities: int, num_relations: int, dim: int) -> None:
        super().__init__()
        self.entities = ls.SparseEmbedding(num_entities, dim, name="entities")
        self.relations = nn.Embedding(num_relations, dim)
        nn.init.ones_(self.relations.weight)

    def forward(self, heads, relations, tails):
        # One lookup for all entity ids of the batch: one exchange round instead of two.
        ent = self.entities(torch.stack([heads, tails]))
        return (ent[0] * self.relations(relations) * ent[1]).sum(-1)


def run(rank: int, args: argparse.Namespace, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size, timeout=timedelta(seconds=60)
    )
    try:
        train(rank, args)
    finally:
        dist.destroy_process_group()


def train(rank: int, args: argparse.Namespace) -> None:
    world = dist.get_world_size()
    triples, num_entities, num_relations = load_split(data_dir(args.data), "train")
    model = DistMult(num_entities, num_relations, args.dim)
    model.entities.materialize()
    dense = DistributedDataParallel(model)
    sparse_opt = ls.SparseAdagrad([model.entities], lr=args.lr)
    dense_opt = torch.optim.Adagrad(model.relations.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(0)  # same order on every rank; each takes its slice
    for epoch in range(args.epochs):
        order = torch.randperm(len(triples), generator=gen)
        per_step = args.batch_size * world
        total, steps, start = 0.0, 0, time.perf_counter()
        for first in range(0, len(order) - per_step + 1, per_step):
            batch = triples[order[first : first + per_step]].chunk(world)[rank]
            heads, relations, tails = batch.unbind(1)
            # Each positive against `negatives` corrupted tails.
            corrupt = torch.randint(0, num_entities, (len(batch), args.negatives), generator=gen)
            candidates = torch.cat([tails.unsqueeze(1), corrupt], dim=1)
            scores = dense(heads.unsqueeze(1).expand_as(candidates), relations.unsqueeze(1), candidates)
            labels = torch.zeros_like(scores)
            labels[:, 0] = 1
            loss = F.binary_cross_entropy_with_logits(scores, labels, pos_weight=torch.tensor(float(args.negatives)))
            loss.backward()
            dense_opt.step()
            sparse_opt.step()
            dense_opt.zero_grad()
            sparse_opt.zero_grad()
            total += loss.item()
            steps += 1
            if args.max_steps and steps >= args.max_steps:
                break
        mean = torch.tensor([total / steps])
        dist.all_reduce(mean)
        if rank == 0:
            stats = sparse_opt.stats
            print(
                f"epoch {epoch}: mean train loss {mean.item() / world:.4f} over {steps} steps, "
                f"{time.perf_counter() - start:.1f}s, row gradients sent {stats.bytes_sent / 2**20:.1f} MiB",
                flush=True,
            )
        sparse_opt.stats.reset()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--data", default=None, help="WN18RR directory (default ../shared/data/wn18rr)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=0, help="stop each epoch after this many steps (0: all)")
    parser.add_argument("--batch-size", type=int, default=512, help="positives per rank per step")
    parser.add_argument("--negatives", type=int, default=16)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()
    data_dir(args.data)  # fail early, before spawning
    from rank_port import free_port

    mp.spawn(run, args=(args, free_port()), nprocs=args.world_size)


if __name__ == "__main__":
    main()
