"""The benchmark suite: one command measures everything, writes one JSON and regenerates docs/benchmarks.md.

    python benchmarks/bench.py            # the full run (make bench), about 10 minutes on 2 cores
    python benchmarks/bench.py --quick    # a smoke run on small sizes, under a minute (run by the tests)
    python benchmarks/bench.py --device cuda   # adds the one-GPU section

Sections (see each module's docstring): ``single_process`` (every sparse optimizer against
torch's and FBGEMM's, and against memory floors), ``distributed`` (2 gloo ranks: ours, Lightning
``sparse_ddp``, DGL, DDP with sparse gradients, Lightning ``ddp`` with a dense table),
``collection`` (26 tables: one SparseEmbeddingCollection against 26 separate tables on 2 ranks,
and against FBGEMM's TBE in one process), ``scale`` (one rank of W up to 4,096, simulated),
``dynamic`` (DynamicEmbedding against SparseEmbedding, and a stream of 10^7 ids) and ``gpu``
(the update kernels' bandwidth against a device copy). The JSON records the machine, versions,
thread counts, allocator settings and commit; ``report.py`` turns it into tables, plots and the
verdict on each target. Measure on an otherwise idle machine: the figures are wall-clock times.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DGLBACKEND", "pytorch")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import collection  # noqa: E402
import distributed  # noqa: E402
import dynamic  # noqa: E402
import half  # noqa: E402
import network  # noqa: E402
import report  # noqa: E402
import scale  # noqa: E402
import single_process  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

FULL = {
    "single_process": dict(rows=1_000_000, dim=64, batch=65536, rounds=5, steps_per_round=4, threads=2),
    "distributed": dict(rows_list=[100_000, 1_000_000, 4_000_000], batches=[4096, 65536], methods=list(distributed.METHODS)),
    "gpu": dict(steps=40, warmup=5),  # the workloads of gpu.WORKLOADS
    "collection": dict(max_rows=1_000_000, batch=2048, rounds=5, steps_per_round=3),
    # (W, None): 1-D over W ranks; (W, G): 2-D, sharded over groups of G ranks, replicated W / G times.
    "scale": dict(
        worlds=[(8, None), (64, None), (512, None), (1024, None), (4096, None), (1024, 128), (4096, 512)],
        workloads=["26 tables", "1 table"],
        batch=4096,
        rows_cap=20_000,
        steps=5,
        rounds=3,
    ),  # fmt: skip
    "network": dict(epochs=8, rounds=2),  # two stand-in hosts over slow, lossy links (root only)
    # DynamicEmbedding against SparseEmbedding: 10% new ids per step; 10^7 distinct ids through capacity 10^5.
    "dynamic": dict(batch=4096, pool=200_000, steps=6, rounds=9, distinct=10_000_000, capacity=100_000),
    # bf16 and fp16 tables (stochastic rounding) against float32: one table, one process.
    "half": dict(rows=1_000_000, dim=64, batch=65536, steps=4, rounds=5),
}
# A smoke run (the test suite's): every section and the report at sizes that take no time, not for conclusions. One
# thread where the full run takes 2: next to other work on 2 cores, each op of 2 threads waits for the other core.
QUICK = {
    "single_process": dict(rows=2_000, dim=64, batch=128, rounds=2, steps_per_round=2, threads=1),
    "distributed": dict(
        rows_list=[2_000],
        batches=[64],
        methods=["ours", "sparse_ddp", "sparse_grad_ddp"],
        budget_s=0.1,
        min_steps=3,
        max_steps=3,
        warmup=2,
        shared_ranks=True,
    ),  # fmt: skip
    "gpu": dict(workloads=[dict(rows=100_000, dim=64, batch=4096)], steps=5, warmup=2),
    "collection": dict(max_rows=2_000, batch=32, rounds=2, steps_per_round=1, threads=1),
    "scale": dict(
        worlds=[(8, None), (256, None), (256, 32)], workloads=["26 tables"], batch=128, rows_cap=1000, steps=2, in_process=True
    ),  # fmt: skip
    "dynamic": dict(batch=512, pool=5000, steps=2, rounds=1, warmup_steps=1, two_ranks=False, distinct=0),
    "half": dict(rows=2_000, dim=64, batch=128, steps=2, rounds=1, threads=1),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke run under a minute")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: also run the one-GPU section")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench.json"))
    parser.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"), help="page whose results block is regenerated")
    parser.add_argument("--no-report", action="store_true")
    parser.add_argument(
        "--only",
        choices=["single_process", "distributed", "collection", "scale", "network", "dynamic", "half", "gpu"],
        help="measure this section again into the existing --out file (gpu: every GPU measurement)",
    )
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.only:
        return _rerun(args.only, plan, Path(args.out), None if args.no_report else Path(args.doc))
    start = time.perf_counter()
    doc = {"benchmark": "lightning_sparse", "quick": args.quick, "created": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": _machine(), "versions": _versions(), "allocator": _allocator(), "code": _code()}  # fmt: skip
    doc["threads"] = {"single_process": plan["single_process"]["threads"], "distributed_per_rank": 1}

    print("single process (CPU)...", flush=True)
    doc["single_process"] = _single_process(plan["single_process"], keeping_memory=not args.quick)
    print("2 ranks (gloo)...", flush=True)
    methods = plan["distributed"]["methods"]
    if not _importable("dgl"):
        methods = [m for m in methods if m != "dgl"]
    doc["distributed"] = distributed.run(**{**plan["distributed"], "methods": methods})
    print("26 tables (SparseEmbeddingCollection)...", flush=True)
    doc["collection"] = collection.run(**plan["collection"])
    print("scale simulator (one rank of W)...", flush=True)
    doc["scale"] = scale.run(**plan["scale"])
    if "network" in plan:
        print("two hosts over slow, lossy links...", flush=True)
        doc["network"] = network.run(**plan["network"])
    print("dynamic tables (hashed ids)...", flush=True)
    doc["dynamic"] = dynamic.run(**plan["dynamic"])
    print("half-precision tables...", flush=True)
    doc["half"] = half.run(**plan["half"])
    if args.device == "cuda":
        print("one GPU...", flush=True)
        _measure_gpu(doc, plan)
    else:
        doc["gpu"] = {"skipped": "not requested (--device cuda)" if torch.cuda.is_available() else "no CUDA device"}
        _keep_gpu_figures(doc, Path(args.out))
    doc["wall_s"] = time.perf_counter() - start
    doc["targets"] = report.targets(doc)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out} ({doc['wall_s']:.0f} s)")
    for target in doc["targets"]:
        print(f"  {'met ' if target['met'] else 'MISS'}  {target['name']}: {target['measured']}")
    if not args.no_report:
        report.write(doc, out, Path(args.doc))
    return 0


def _rerun(section: str, plan: dict, out: Path, page: Path | None) -> int:
    """Measure one section again and put it into the existing results (noted in the report with its commit)."""
    doc = json.loads(out.read_text())
    print(f"{section} (again)...", flush=True)
    if section == "gpu":
        _measure_gpu(doc, plan)
    else:
        runs = {
            "single_process": lambda **cfg: _single_process(cfg, keeping_memory=not doc.get("quick")),
            "distributed": distributed.run,
            "collection": collection.run,
            "scale": scale.run,
            "network": network.run,
            "dynamic": dynamic.run,
            "half": half.run,
        }
        measured = runs[section](**plan[section])
        if section == "dynamic":
            _keep_dynamic_gpu_row(doc, measured)
        doc[section] = measured
    code = _code()
    doc.setdefault("rerun", {})[section] = {"created": datetime.datetime.now().isoformat(timespec="seconds"),
                                            "commit": code["commit"] + (" with uncommitted changes" if code["uncommitted"] else ""),
                                            "processor": _machine()["processor"]}  # fmt: skip
    doc["targets"] = report.targets(doc)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    for target in doc["targets"]:
        print(f"  {'met ' if target['met'] else 'MISS'}  {target['name']}: {target['measured']}")
    if page is not None:
        report.write(doc, out, page)
    return 0


def _keep_gpu_figures(doc: dict, out: Path) -> None:
    """A run without a GPU keeps the last GPU figures of ``out`` (the report says when and where they were measured)."""
    previous = json.loads(out.read_text()) if out.exists() else {}
    if previous.get("quick") != doc["quick"] or "skipped" in previous.get("gpu", {"skipped": True}):
        return
    doc["gpu"] = previous["gpu"]
    _keep_dynamic_gpu_row(previous, doc["dynamic"])
    measured = previous.get("rerun", {}).get("gpu") or {"created": previous["created"], "commit": previous["code"]["commit"]}
    doc["rerun"] = {"gpu": measured}
    print(f"kept the GPU figures measured {measured['created']} at {measured['commit']}", flush=True)


def _keep_dynamic_gpu_row(source: dict, dynamic: dict) -> None:
    """The dynamic section's GPU row is the gpu measurement's (:func:`_measure_gpu`): a CPU measurement keeps ``source``'s."""
    row = source.get("dynamic", {}).get("step", {}).get("one process, GPU")
    if row is not None:
        dynamic["step"]["one process, GPU"] = row


def _measure_gpu(doc: dict, plan: dict) -> None:
    """The GPU measurements, into ``doc``: the one-process step against torch's (gpu.py) and the dynamic table's step."""
    import gpu

    doc["gpu"] = gpu.run(**plan["gpu"])
    dyn = {**plan["dynamic"], "two_ranks": False, "distinct": 0, "device": "cuda"}
    doc.setdefault("dynamic", {}).setdefault("step", {})["one process, GPU"] = dynamic.run(**dyn)["step"]["one process"]


def _single_process(cfg: dict, keeping_memory: bool) -> list[dict]:
    """The one-process CPU section: glibc's defaults, then (``keeping_memory``) a second process that keeps freed memory."""
    runs = [single_process.run(**cfg, with_fbgemm=single_process.fbgemm_available())]
    if keeping_memory:  # another allocator setting: nothing a smoke run needs
        print("single process (CPU, freed memory kept)...", flush=True)
        runs.append(_single_process_keeping_memory(cfg))
    return runs


# glibc gives freed buffers back to the system and page-faults new ones in; these keep them, as
# jemalloc or tcmalloc would (read at process start, hence a separate process).
KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(2**32), "MALLOC_TRIM_THRESHOLD_": str(2**36)}


def _single_process_keeping_memory(cfg: dict) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "single.json"
        args = [f"--{key.replace('_', '-')}={value}" for key, value in cfg.items()]
        subprocess.run([sys.executable, "-W", "ignore", str(Path(__file__).parent / "single_process.py"), *args,
                        "--json", str(out)], check=True, capture_output=True, env={**os.environ, **KEEP_FREED_MEMORY})  # fmt: skip
        return json.loads(out.read_text())


def _importable(name: str) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            __import__(name)
        return True
    except Exception:  # noqa: BLE001 - missing, or built for another torch
        return False


def _machine() -> dict:
    processor = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                processor = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 if hasattr(os, "sysconf") else None
    return {"cpu_count": os.cpu_count(), "processor": processor, "memory_gib": round(memory, 1) if memory else None,
            "platform": platform.platform(), "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}  # fmt: skip


def _versions() -> dict:
    """The baselines' versions where they import (else None); Lightning's from its metadata: lightning_sparse requires
    it, and importing it here (torchmetrics, scipy) would cost seconds of a run that uses it only in its ranks."""
    versions = {"torch": torch.__version__, "lightning": importlib.metadata.version("lightning")}
    for name, module in (("lightning_sparse", "lightning_sparse"), ("dgl", "dgl"), ("fbgemm_gpu", "fbgemm_gpu")):
        versions[name] = getattr(sys.modules.get(module), "__version__", None) if _importable(module) else None
    return versions


def _allocator() -> dict:
    """Settings that change how fresh buffers are paged in (the figures depend on them, see docs/benchmarks.md)."""
    keys = [k for k in os.environ if k.startswith(("MALLOC_", "LD_PRELOAD", "THP_"))]
    return {k: os.environ[k] for k in sorted(keys)} or {"glibc": "defaults"}


def _code() -> dict:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "--short", "HEAD"),
            "uncommitted": git("status", "--porcelain", "--", "lightning_sparse").splitlines()}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
