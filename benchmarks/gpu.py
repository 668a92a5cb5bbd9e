"""One GPU: the update kernels' achieved bandwidth against a measured device-to-device copy.

Each optimizer's step must read and write the touched rows of the table and of its state once,
and read their gradient once: ``rows x (2 x (row + state bytes) + gradient bytes)``. Achieved
bandwidth is that many bytes divided by the time of ``update`` (the kernel alone, on rows and
gradients prepared beforehand), timed with CUDA events. The reference is ``dst.copy_(src)`` of
a buffer of the same size (read + write), the best a memory-bound kernel can do.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from single_process import STATE_BYTES, make_ids


def _cuda_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run(rows: int, dim: int, batch: int, repeat: int = 20) -> dict:
    from lightning_sparse.optim import functional as F

    device = torch.device("cuda")
    touched = torch.unique(make_ids(rows, batch, count=1)[0]).to(device)
    grad = torch.randn(len(touched), dim, device=device)
    table = torch.randn(rows, dim, device=device)
    dense = [torch.zeros(rows, dim, device=device) for _ in range(2)]
    per_row = torch.zeros(rows, device=device)
    steps = torch.zeros(rows, dtype=torch.int64, device=device)
    kernels = {
        "sgd": lambda g: F.sgd_(table, touched, g, lr=0.1, weight_decay=0.0),
        "adagrad": lambda g: F.adagrad_(table, dense[0], touched, g, clr=0.1, weight_decay=0.0, eps=1e-10),
        "rowwise_adagrad": lambda g: F.rowwise_adagrad_(table, per_row, touched, g, lr=0.1, weight_decay=0.0, eps=1e-10),
        "adam_global": lambda g: F.adam_(table, dense[0], dense[1], touched, g, step=3, lr=1e-3, beta1=0.9, beta2=0.999,
                                         eps=1e-8, weight_decay=0.0, decoupled_weight_decay=False),
        "adam_row": lambda g: F.adam_(table, dense[0], dense[1], touched, g, step=steps.index_select(0, touched).add_(1),
                                      lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled_weight_decay=False),
    }  # fmt: skip
    results = []
    for family, kernel in kernels.items():
        moved = len(touched) * (2 * (4 * dim + STATE_BYTES[family](dim)) + 4 * dim)
        for _ in range(3):
            kernel(grad.clone())
        copies = [grad.clone() for _ in range(repeat)]
        it = iter(copies)
        ms = _cuda_ms(lambda kernel=kernel, it=it: kernel(next(it)), repeat)
        src = torch.empty(moved // 2 // 4 + 1, device=device)
        dst = torch.empty_like(src)
        copy_ms = _cuda_ms(lambda dst=dst, src=src: dst.copy_(src), repeat)
        results.append({"family": family, "rows": len(touched), "bytes": moved, "update_ms": ms,
                        "update_gbps": moved / ms / 1e6, "copy_gbps": 2 * src.numel() * 4 / copy_ms / 1e6})  # fmt: skip
        results[-1]["fraction_of_copy"] = results[-1]["update_gbps"] / results[-1]["copy_gbps"]
    return {"device_name": torch.cuda.get_device_name(), "table_rows": rows, "dim": dim, "batch": batch, "results": results}
