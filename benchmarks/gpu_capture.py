"""One GPU: a one-process training step captured in a CUDA graph (``capturable=True``) against the same step eager.

On the H100 that measures the library, a step is bound by kernel launches (about 40 us of host
time each; see docs/benchmarks.md), so capture is the lever (issue 32). This measures, for
``SparseEmbedding`` with SGD, Adagrad, row-wise Adagrad and Adam (global bias correction), for
a collection of 26 tables with row-wise Adagrad (issue 32's many-tables workload, fixed-size
inputs), and for ``nn.Embedding(sparse=True)`` with Adagrad (torch's own, capturable or not):

* whether the step (forward, backward, optimizer step, zero_grad, with the bench's loss) can be
  captured in a ``torch.cuda.CUDAGraph`` after a warm-up on a side stream;
* whether replaying it on new ids, copied into static input buffers, trains the tables as the
  eager steps do on the same ids (the largest difference of the final tables: 0 expected);
* the median replayed step against the median eager step (CUDA events).

Run on a GPU: ``python benchmarks/gpu_capture.py [rows dim batch]``; prints one JSON object.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch
from gpu import median_ms
from torch import nn

CASES = {
    "ours/sgd": ("SparseSGD", dict(lr=0.1)),
    "ours/adagrad": ("SparseAdagrad", dict(lr=0.1)),
    "ours/rowwise_adagrad": ("SparseRowWiseAdagrad", dict(lr=0.1)),
    "ours/adam": ("SparseAdam", dict(lr=1e-3, bias_correction="global")),
    "ours/collection_26_tables_rowwise_adagrad": ("SparseRowWiseAdagrad", dict(lr=0.1)),
    "torch_sparse/adagrad": (None, dict(lr=0.1)),
}
COLLECTION = dict(tables=26, rows=200_000, dim=64, batch=16_384)  # as benchmarks/gpu.py's many-tables workload


def _model(case: str, rows: int, dim: int, device: torch.device) -> tuple[nn.Module, Callable[[], None], Callable[[], None]]:
    """(table, step of its optimizer, zero_grad) for one case, the table starting from zeros."""
    import lightning_sparse as ls

    cls, kwargs = CASES[case]
    if cls is None:
        table = nn.Embedding(rows, dim, sparse=True, device=device)
        nn.init.zeros_(table.weight)
        opt = torch.optim.Adagrad([table.weight], **kwargs)
    elif "collection" in case:
        table = ls.SparseEmbeddingCollection({f"t{t}": ls.SparseEmbedding(COLLECTION["rows"], dim, init=ls.init.zeros(),
                                                                           device=device) for t in range(COLLECTION["tables"])})  # fmt: skip
        opt = getattr(ls, cls)([table], capturable=True, **kwargs)
    else:
        table = ls.SparseEmbedding(rows, dim, init=ls.init.zeros(), device=device)
        opt = getattr(ls, cls)([table], capturable=True, **kwargs)
    return table, opt.step, opt.zero_grad


def _weights(table: nn.Module) -> torch.Tensor:
    if hasattr(table, "tables"):  # a collection: its tables side by side
        return torch.cat([t.full_weight() for t in table.tables.values()])
    return table.full_weight() if hasattr(table, "full_weight") else table.weight.detach()


def captured(step: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """``step`` run once on a side stream (the warm-up torch.cuda.graphs asks for: it trains), then captured, not run."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def measure(case: str, rows: int, dim: int, batch: int, steps: int = 30) -> dict:
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    many = "collection" in case
    if many:  # one unpooled feature per table
        rows, batch, names = COLLECTION["rows"], COLLECTION["batch"], [f"t{t}" for t in range(COLLECTION["tables"])]
    draw = lambda: (rows * torch.rand(batch, generator=gen) ** 4).long().to(device)  # noqa: E731
    batches = [{name: draw() for name in names} if many else draw() for _ in range(steps + 3)]
    proj = torch.randn(dim, 1, generator=gen).to(device)
    target = torch.randn(batch, 1, generator=gen).to(device)

    def train_step(table, step, zero_grad, ids):
        outputs = table(ids).values() if many else [table(ids)]
        sum(((out @ proj - target) ** 2).mean() for out in outputs).backward()
        step()
        zero_grad()

    eager = _model(case, rows, dim, device)
    for ids in batches:
        train_step(*eager, ids)
    expected = _weights(eager[0]).clone()
    eager_ms = median_ms(lambda i: train_step(*eager, batches[0]), steps, 0, device)

    model = _model(case, rows, dim, device)
    static_ids = {name: ids.clone() for name, ids in batches[0].items()} if many else batches[0].clone()
    try:  # the warm-up trains the first batch; the capture is not run: the second batch is the first replay
        graph = captured(lambda: train_step(*model, static_ids))
    except Exception as err:  # noqa: BLE001 - the probe reports what breaks capture
        return {"eager_ms": eager_ms, "captured": False, "error": f"{type(err).__name__}: {str(err)[:300]}"}
    for ids in batches[1:]:
        for name, given in ids.items() if many else [(None, ids)]:
            (static_ids[name] if many else static_ids).copy_(given)
        graph.replay()
    torch.cuda.synchronize()
    difference = (_weights(model[0]) - expected).abs().max().item()
    replay_ms = median_ms(lambda i: graph.replay(), steps, 0, device)
    return {"eager_ms": eager_ms, "captured": True, "replay_ms": replay_ms, "replay_over_eager": replay_ms / eager_ms,
            "max_difference_from_eager": difference}  # fmt: skip


def run(rows: int = 1_000_000, dim: int = 64, batch: int = 65_536) -> dict:
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows, "dim": dim, "batch": batch,
            "cases": {case: measure(case, rows, dim, batch) for case in CASES}}  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(run(*map(int, sys.argv[1:4])), indent=1))
