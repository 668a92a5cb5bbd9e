"""One GPU: a one-process training step of lightning_sparse against torch's own sparse and dense paths, in one run.

Workloads: a 1M x 64 float32 table with 65,536 ids per step and a 10M x 128 table with 262,144,
each with ids drawn skewed (``N * u**4``) and uniform (``N * u``). Every method trains the same
batches with the same loss (the bench's projection loss); a step is forward + backward +
optimizer step + zero_grad, timed with CUDA events, the median of ``steps`` after ``warmup``:

* ``ours/<family>``: SparseEmbedding with SparseAdagrad, SparseRowWiseAdagrad, SparseAdam with
  global bias correction (torch.optim.SparseAdam's), and Adagrad on a bf16 table (stochastic
  rounding, float32 lookups): ``adagrad_bf16``;
* ``torch_sparse/<family>``: ``nn.Embedding(sparse=True)`` with torch.optim.Adagrad or SparseAdam;
* ``torch_dense/<family>``: ``nn.Embedding`` with Adagrad (foreach) or Adam (fused);
* ``lookup``: ours in grad mode (forward only), ours under ``no_grad`` (which waits for its id
  check: one host read), and ``F.embedding``.

Per workload also: CUDA kernels per step (torch.profiler, one step, the loss's own kernels
counted apart), host syncs per step (``torch.cuda.set_sync_debug_mode("warn")``), and the fused
update kernel alone against a device copy of the bytes it must move (each touched row and its
state read and written, each id's gradient row, key and position read once); for the first
workload a profile summary of our Adagrad step, and the host side of it and of torch's sparse Adagrad step
(ops and CUDA runtime calls by their own CPU time: where a launch-bound step spends it).

Then the many-tables workload: a collection of 26 tables (200k x 64 each, 16,384 ids per table
per step, one unpooled feature each) with row-wise Adagrad and with Adagrad, against 26
``nn.Embedding(sparse=True)`` tables with torch's Adagrad, and the kernels of a 2-table
collection's step beside the 26-table one's.

On a CPU (``device="cpu"``, the tests' smoke run) the same code runs with wall-clock timing and
without the profiler counts.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from device_syncs import DeviceSyncs
from torch import nn

WORKLOADS = [dict(rows=1_000_000, dim=64, batch=65_536), dict(rows=10_000_000, dim=128, batch=262_144)]
COLLECTION = dict(tables=26, rows=200_000, dim=64, batch=16_384)  # issue 32's many-tables workload
DRAWS = {"skewed": lambda u: u**4, "uniform": lambda u: u}
OURS = {
    "adagrad": ("SparseAdagrad", dict(lr=0.1), {}),
    "rowwise_adagrad": ("SparseRowWiseAdagrad", dict(lr=0.1), {}),
    "adam": ("SparseAdam", dict(lr=1e-3, bias_correction="global"), {}),
    "adagrad_bf16": ("SparseAdagrad", dict(lr=0.1), dict(dtype=torch.bfloat16, output_dtype=torch.float32)),
}
TORCH_SPARSE = {"adagrad": lambda w: torch.optim.Adagrad([w], lr=0.1), "adam": lambda w: torch.optim.SparseAdam([w], lr=1e-3)}
TORCH_DENSE = {
    "adagrad": lambda w: torch.optim.Adagrad([w], lr=0.1, foreach=True),
    "adam": lambda w: torch.optim.Adam([w], lr=1e-3, fused=w.is_cuda),
}
# Per touched row, the state bytes the update reads and writes beside the row (float32).
STATE_BYTES = {"sgd": lambda d: 0, "adagrad": lambda d: 4 * d, "rowwise_adagrad": lambda d: 4, "adam": lambda d: 8 * d}


def make_batches(rows: int, batch: int, draw: str, count: int, device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [(rows * DRAWS[draw](torch.rand(batch, generator=gen))).long().clamp_(max=rows - 1).to(device) for _ in range(count)]


def _loss(out: torch.Tensor, target: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    return ((out @ proj) - target).pow(2).mean()


def median_ms(fn: Callable[[int], object], steps: int, warmup: int, device: torch.device) -> float:
    """The median of ``steps`` calls ``fn(i)`` after ``warmup``: CUDA events on a GPU, wall-clock time elsewhere (ms)."""
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn(i)
            times.append(1e3 * (time.perf_counter() - begin))
    return statistics.median(times)


def _counts(fn: Callable[[int], object], device: torch.device) -> dict:
    """CUDA kernels (and copies) of one call and the host syncs it makes; {} on a CPU."""
    if device.type != "cuda":
        return {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(0)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    with DeviceSyncs() as syncs:
        fn(1)
    return {"kernels": len(kernels), "syncs": len(syncs.calls), "profile": prof}


def _host_profile(fn: Callable[[int], object], device: torch.device) -> list[str]:
    """The host side of one call: ops and CUDA runtime calls by their own CPU time (a launch-bound step shows where)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        fn(0)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12).splitlines()


def _methods(rows: int, dim: int, device: torch.device):
    """(name, family, builder) per method; a builder returns (step(i), lookup(i) or None, teardown objects)."""
    import lightning_sparse as ls

    for family, (cls, kwargs, table_kwargs) in OURS.items():

        def build(cls=cls, kwargs=kwargs, table_kwargs=table_kwargs):
            emb = ls.SparseEmbedding(rows, dim, init=ls.init.zeros(), device=device, **table_kwargs)
            return emb, getattr(ls, cls)([emb], **kwargs)

        yield f"ours/{family}", family, build
    for kind, makers in (("torch_sparse", TORCH_SPARSE), ("torch_dense", TORCH_DENSE)):
        for family, make in makers.items():

            def build(make=make, sparse=kind == "torch_sparse"):
                emb = nn.Embedding(rows, dim, sparse=sparse, device=device)
                nn.init.zeros_(emb.weight)
                return emb, make(emb.weight)

            yield f"{kind}/{family}", family, build


def _update_bandwidth(rows: int, dim: int, batch: torch.Tensor, steps: int, device: torch.device) -> list[dict]:
    """The fused update kernel alone on one batch's prepared runs, against a device copy of the bytes it moves."""
    from lightning_sparse.kernels import RuleState, UpdateRule, sort_runs, update_rows

    runs = sort_runs(batch, rows)
    values = torch.randn(len(batch), dim, device=device)
    distinct = len(torch.unique(batch))
    table = torch.zeros(rows, dim, device=device)
    state = torch.zeros(rows, dim, device=device)
    rules = {
        "adagrad": UpdateRule("adagrad", 0.1, state=RuleState(first=state), eps=1e-10),
        "rowwise_adagrad": UpdateRule("rowwise_adagrad", 0.1, state=RuleState(per_row=state[:, 0].contiguous()), eps=1e-10),
        "adam": UpdateRule("adam", 1e-3, state=RuleState(state, torch.zeros_like(state)), eps=1e-8, betas=(0.9, 0.999),
                           step_size=1e-3),
    }  # fmt: skip
    out = []
    for family, rule in rules.items():
        moved = distinct * 2 * (4 * dim + STATE_BYTES[family](dim)) + len(batch) * (4 * dim + 4 + 8)
        ms = median_ms(lambda i, rule=rule: update_rows(runs, values, table, rule), steps, 3, device)
        src = torch.empty(moved // 8 + 1, device=device)  # a copy reads and writes: moved / 2 bytes each way
        dst = torch.empty_like(src)
        copy_ms = median_ms(lambda i, dst=dst, src=src: dst.copy_(src), steps, 3, device)
        out.append({"family": family, "distinct_rows": distinct, "bytes": moved, "update_ms": ms, "copy_ms": copy_ms,
                    "update_gbps": moved / ms / 1e6, "copy_gbps": 2 * src.numel() * 4 / copy_ms / 1e6})  # fmt: skip
        out[-1]["fraction_of_copy"] = out[-1]["update_gbps"] / out[-1]["copy_gbps"]
    return out


def measure(rows: int, dim: int, batch: int, draw: str, steps: int, warmup: int, device: torch.device, profile: bool) -> dict:
    """One workload with one draw of ids: every method's step, the lookups, counts, the update's bandwidth."""
    batches = make_batches(rows, batch, draw, 4, device)
    gen = torch.Generator().manual_seed(1)
    proj = torch.randn(dim, generator=gen).to(device)
    targets = [torch.randn(batch, generator=gen).to(device) for _ in batches]
    result = {"rows": rows, "dim": dim, "batch": batch, "ids": draw, "distinct": len(torch.unique(batches[0])),
              "step_ms": {}, "kernels": {}, "syncs": {}}  # fmt: skip
    loss_only = torch.zeros(batch, dim, device=device, requires_grad=True)
    counted = _counts(lambda i: _loss(loss_only, targets[i % 4], proj).backward(), device)
    result["loss_kernels"] = counted.get("kernels")
    for name, _family, build in _methods(rows, dim, device):
        emb, opt = build()

        def step(i, emb=emb, opt=opt):
            _loss(emb(batches[i % 4]), targets[i % 4], proj).backward()
            opt.step()
            opt.zero_grad()

        result["step_ms"][name] = median_ms(step, steps, warmup, device)
        counted = _counts(step, device)
        if counted:
            result["kernels"][name], result["syncs"][name] = counted["kernels"], counted["syncs"]
            if profile and name == "ours/adagrad":
                table = counted["profile"].key_averages().table(sort_by="cuda_time_total", row_limit=10)
                result["profile_ours_adagrad"] = table.splitlines()
        if profile and name in ("ours/adagrad", "torch_sparse/adagrad"):  # where the host's time goes
            result.setdefault("host_profile", {})[name] = _host_profile(step, device)
        if name == "ours/adagrad":
            result["lookup_ms"] = {"ours, grad mode": median_ms(lambda i, emb=emb: emb(batches[i % 4]), steps, warmup, device)}
            with torch.no_grad():
                result["lookup_ms"]["ours, no_grad"] = median_ms(lambda i, emb=emb: emb(batches[i % 4]), steps, warmup, device)
        if name == "torch_sparse/adagrad":
            with torch.no_grad():
                lookup = lambda i, emb=emb: F.embedding(batches[i % 4], emb.weight)  # noqa: E731
                result["lookup_ms"]["torch F.embedding"] = median_ms(lookup, steps, warmup, device)
        del emb, opt, step
        _release(device)
    result["update"] = _update_bandwidth(rows, dim, batches[0], steps, device)
    _release(device)
    return result


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _joint_loss(outputs: list[torch.Tensor]) -> torch.Tensor:
    """The many-tables workload's loss: one cat and one sum, whatever the number of features (their kernels stay apart)."""
    return torch.cat(outputs).sum()


def measure_collection(tables: int, rows: int, dim: int, batch: int, steps: int, warmup: int, device: torch.device) -> dict:
    """A collection of ``tables`` tables (one unpooled feature each, ``batch`` skewed ids per table per step) against as
    many ``nn.Embedding(sparse=True)`` tables with torch's Adagrad; and the kernels of a 2-table collection's step
    (each with its loss's own kernels, counted apart)."""
    import lightning_sparse as ls

    gen = torch.Generator().manual_seed(2)
    batches = [
        {f"t{t}": (rows * torch.rand(batch, generator=gen) ** 4).long().to(device) for t in range(tables)} for _ in range(4)
    ]
    result = {"tables": tables, "rows": rows, "dim": dim, "batch": batch, "step_ms": {}, "kernels": {}, "syncs": {}}
    for name, optimizer in (("ours/rowwise_adagrad", "SparseRowWiseAdagrad"), ("ours/adagrad", "SparseAdagrad")):
        for count in (tables, 2) if name == "ours/rowwise_adagrad" else (tables,):
            collection = ls.SparseEmbeddingCollection(
                {f"t{t}": ls.SparseEmbedding(rows, dim, init=ls.init.zeros(), device=device) for t in range(count)}
            )
            opt = getattr(ls, optimizer)([collection], lr=0.1)

            def step(i, collection=collection, opt=opt, count=count):
                out = collection({f"t{t}": batches[i % 4][f"t{t}"] for t in range(count)})
                _joint_loss(list(out.values())).backward()
                opt.step()
                opt.zero_grad()

            label = name if count == tables else f"{name}, 2 tables"
            if count == tables:
                result["step_ms"][label] = median_ms(step, steps, warmup, device)
            counted = _counts(step, device)
            if counted:
                result["kernels"][label], result["syncs"][label] = counted["kernels"], counted["syncs"]
                # The loss's own kernels, counted apart as for one table (the same for any number of features).
                outputs = [torch.zeros(batch, dim, device=device, requires_grad=True) for _ in range(count)]

                def loss_alone(i, outputs=outputs):
                    _joint_loss(outputs).backward()

                result.setdefault("loss_kernels", {})[label] = _counts(loss_alone, device)["kernels"]
            del collection, opt, step
            _release(device)
    embeddings = [nn.Embedding(rows, dim, sparse=True, device=device) for _ in range(tables)]
    opt = torch.optim.Adagrad([e.weight for e in embeddings], lr=0.1)

    def torch_step(i, embeddings=embeddings, opt=opt):
        _joint_loss([e(batches[i % 4][f"t{t}"]) for t, e in enumerate(embeddings)]).backward()
        opt.step()
        opt.zero_grad()

    result["step_ms"]["torch_sparse/adagrad"] = median_ms(torch_step, steps, warmup, device)
    counted = _counts(torch_step, device)
    if counted:
        result["kernels"]["torch_sparse/adagrad"], result["syncs"]["torch_sparse/adagrad"] = counted["kernels"], counted["syncs"]
    del embeddings, opt
    _release(device)
    return result


def run(workloads: list[dict] | None = None, draws: tuple[str, ...] = ("skewed", "uniform"), steps: int = 40,
        warmup: int = 5, device: str = "cuda", collection: dict | None = None) -> dict:  # fmt: skip
    """Every workload with every draw of ids (the first also gives a profile summary), then the many-tables workload."""
    where = torch.device(device)
    results = []
    for index, workload in enumerate(workloads or WORKLOADS):
        for draw in draws:
            results.append(measure(**workload, draw=draw, steps=steps, warmup=warmup, device=where,
                                   profile=index == 0 and draw == draws[0]))  # fmt: skip
    many = measure_collection(**(collection or COLLECTION), steps=steps, warmup=warmup, device=where)
    name = torch.cuda.get_device_name() if where.type == "cuda" else "CPU"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device_name": name, "torch": torch.__version__, "triton": triton_version, "workloads": results, "collection": many}
