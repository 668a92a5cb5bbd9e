"""One GPU: where a one-process step's time goes on the host, for steps bound by kernel launches.

For each case (a ``SparseEmbedding`` with Adagrad, torch's ``nn.Embedding(sparse=True)`` with
Adagrad, a ``DynamicEmbedding`` with room for every id, all on the same ids and loss as
``benchmarks/gpu.py``) it measures:

* ``step_ms``: the median step (forward, backward, step, zero_grad), CUDA events;
* ``host_ms``: the median time the host takes to enqueue that step, from the call to its return,
  with the GPU idle before it (the step is launch-bound where this is close to ``step_ms``);
* ``device_ms``: the step replayed from a CUDA graph (``capturable=True``; ours only), the GPU's
  own time for the same work.

and prints, for ours, the Python functions by their own time over 100 steps (cProfile) and the
GPU's kernels by their time over 10 steps (torch.profiler), to stderr.

Run on a GPU: ``python benchmarks/gpu_host.py [rows dim batch]``; prints one JSON object.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch
from gpu import _loss, _release, make_batches, median_ms
from gpu_capture import captured
from torch import nn


def _cases(rows: int, dim: int, device: torch.device):
    import lightning_sparse as ls

    def ours(capturable: bool = False):
        emb = ls.SparseEmbedding(rows, dim, init=ls.init.zeros(), device=device)
        return emb, ls.SparseAdagrad([emb], lr=0.1, capturable=capturable)

    def dynamic(capturable: bool = False):
        emb = ls.DynamicEmbedding(rows, dim, init=ls.init.zeros(), device=device)
        return emb, ls.SparseAdagrad([emb], lr=0.1, capturable=capturable)

    def torch_sparse(capturable: bool = False):
        emb = nn.Embedding(rows, dim, sparse=True, device=device)
        return emb, torch.optim.Adagrad([emb.weight], lr=0.1)

    return {"ours/adagrad": ours, "torch_sparse/adagrad": torch_sparse, "ours/dynamic_adagrad": dynamic}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _host_ms(step, steps: int, device: torch.device) -> float:
    times = []
    for i in range(steps):
        _sync(device)
        begin = time.perf_counter()
        step(i)
        times.append(1e3 * (time.perf_counter() - begin))
    _sync(device)
    return statistics.median(times)


def _captured_ms(build, batches: list, targets: list, proj: torch.Tensor, steps: int) -> float:
    """The median replay of the step captured in a CUDA graph (:func:`gpu_capture.captured`)."""
    emb, opt = build(capturable=True)
    static_ids, static_target = batches[0].clone(), targets[0].clone()

    def step():
        _loss(emb(static_ids), static_target, proj).backward()
        opt.step()
        opt.zero_grad()

    graph = captured(step)

    def replay(i):
        static_ids.copy_(batches[i % 4])
        static_target.copy_(targets[i % 4])
        graph.replay()

    return median_ms(replay, steps, 3, torch.device("cuda"))


def _python_profile(step, steps: int, device: torch.device) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(steps):
        step(i)
    _sync(device)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()


def _kernel_profile(step, steps: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)


def run(rows: int = 1_000_000, dim: int = 64, batch: int = 65_536, steps: int = 40, device: str = "cuda",
        profiled_steps: int = 100) -> dict:  # fmt: skip
    """The cases' figures on ``device`` (``cpu``: no capture and no kernel profile, for a dry run)."""
    device = torch.device(device)
    batches = make_batches(rows, batch, "skewed", 4, device)
    gen = torch.Generator().manual_seed(1)
    proj = torch.randn(dim, generator=gen).to(device)
    targets = [torch.randn(batch, generator=gen).to(device) for _ in batches]
    out = {
        "rows": rows,
        "dim": dim,
        "batch": batch,
        "cases": {},
        "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    for name, build in _cases(rows, dim, device).items():
        emb, opt = build()

        def step(i, emb=emb, opt=opt):
            _loss(emb(batches[i % 4]), targets[i % 4], proj).backward()
            opt.step()
            opt.zero_grad()

        case = {"step_ms": median_ms(step, steps, 5, device), "host_ms": _host_ms(step, steps, device)}
        if name.startswith("ours"):
            print(f"== {name}, {rows:,} x {dim}, {batch:,} ids: Python by own time, {profiled_steps} steps", file=sys.stderr)
            print(_python_profile(step, profiled_steps, device), file=sys.stderr)
            if device.type == "cuda":
                print(f"== {name}: kernels by GPU time, 10 steps", file=sys.stderr)
                print(_kernel_profile(step, 10), file=sys.stderr)
                try:
                    case["device_ms"] = _captured_ms(build, batches, targets, proj, steps)
                except Exception as err:  # noqa: BLE001 - the probe reports what breaks capture
                    case["device_ms"] = f"{type(err).__name__}: {str(err)[:300]}"
        out["cases"][name] = case
        del emb, opt, step
        _release(device)
    return out


if __name__ == "__main__":
    sizes = [int(a) for a in sys.argv[1:4]] if len(sys.argv) > 3 else []
    print(json.dumps(run(*sizes, device="cuda" if torch.cuda.is_available() else "cpu"), indent=1))
