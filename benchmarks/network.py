"""Two stand-in hosts over slow and lossy links: what a delay and packet loss cost per training step.

The collection model of the multi-host tests (tests/scripts/fit_collection.py: two tables in a
``SparseEmbeddingCollection``, an MLP, batches of 4 per rank) runs with one rank on each of two
hosts (network namespaces, tests/hosts.py), launched through Lightning's environment, over:

* ``bridge``: veth pairs on a kernel bridge (the kernel's own network stack, no impairment);
* ``wire``: the user-space wire of tests/wire.py, with no delay and no loss (its own cost);
* ``wire 5 ms``: every packet held 5 ms (10 ms round trips);
* ``wire 5 ms, 1% loss``: and 1% of the packets dropped (TCP retransmits them).

Reported per link: the median training step of rank 0 and its ratio to the bridge. Each step
runs 3 all-to-alls of the collection, DDP's all-reduce and Lightning's logging: a step of this
small model is all latency, so it shows the cost of round trips, not of bandwidth. Needs root
and ``ip`` (network namespaces); skipped otherwise.

    sudo python benchmarks/network.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from hosts import Hosts, skip_reason, wire_skip_reason  # noqa: E402

LINKS = {"bridge": None, "wire": (0, 0.0), "wire 5 ms": (5, 0.0), "wire 5 ms, 1% loss": (5, 0.01)}


def step_times(wire: tuple[float, float] | None, epochs: int, directory: Path) -> tuple[list[float], dict]:
    """Rank 0's training step times (s) of one 2-host fit over ``wire`` (None: the bridge), and the wire's packet counts."""
    times = directory / "times.json"
    with Hosts(2, wire=wire) as hosts:
        procs = [
            hosts.popen(
                host,
                [
                    sys.executable,
                    "-W",
                    "ignore",
                    str(ROOT / "tests" / "scripts" / "fit_collection.py"),
                    str(directory / "state.pt"),
                    "--num-nodes",
                    "2",
                    "--timeout",
                    "60",
                    "--epochs",
                    str(epochs),
                    "--times",
                    str(times),
                ],
                env=hosts.lightning_env(host, OMP_NUM_THREADS="1"),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
            for host in range(2)
        ]
        outputs = [proc.communicate(timeout=600)[0] for proc in procs]
        if any(proc.returncode for proc in procs):
            raise RuntimeError(f"the 2-host fit failed over {wire}:\n" + "\n".join(out[-2000:] for out in outputs))
    return json.loads(times.read_text()), hosts.wire_counts


def run(epochs: int = 8, rounds: int = 2) -> dict:
    """Every link ``rounds`` times, interleaved; per link the median step over all its rounds' steps (the first epoch left out)."""
    reason = skip_reason() or wire_skip_reason()
    if reason is not None:
        return {"skipped": reason}
    steps: dict[str, list[float]] = {name: [] for name in LINKS}
    counts: dict[str, dict] = {}
    for _ in range(rounds):
        for name, wire in LINKS.items():
            with tempfile.TemporaryDirectory() as directory:
                times, counts[name] = step_times(wire, epochs, Path(directory))
            per_epoch = len(times) // epochs
            steps[name] += times[per_epoch:]  # the first epoch warms up (allocations, gloo's first buffers)
            print(f"  {name:<20} median step {statistics.median(times[per_epoch:]) * 1e3:7.2f} ms", flush=True)
    bridge = statistics.median(steps["bridge"])
    results = [{"link": name, "delay_ms": (wire or (0, 0))[0], "loss": (wire or (0, 0))[1], "steps": len(steps[name]),
                "step_ms": statistics.median(steps[name]) * 1e3, "vs_bridge": statistics.median(steps[name]) / bridge,
                "packets": counts[name]} for name, wire in LINKS.items()]  # fmt: skip
    return {"epochs": epochs, "rounds": rounds, "ranks": 2, "hosts": 2, "results": results}


def table(section: dict) -> str:
    lines = ["| link | delay per packet | loss | steps | median step (ms) | vs bridge | packets forwarded / dropped (last round) |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in section["results"]:
        packets = r["packets"]
        moved = f"{packets['forwarded']} / {packets['dropped']}" if packets else "kernel"
        lines.append(f"| {r['link']} | {r['delay_ms']:g} ms | {r['loss'] * 100:g}% | {r['steps']} | {r['step_ms']:.1f} | "
                     f"{r['vs_bridge']:.2f}x | {moved} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    section = run()
    print(json.dumps(section, indent=1) if "skipped" in section else table(section))
