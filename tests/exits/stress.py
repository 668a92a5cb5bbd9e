"""Run the exit-shape programs many times and count the runs that did not exit cleanly.

Usage::

    python tests/exits/stress.py --runs 1000              # round-robin over every shape, race widened
    python tests/exits/stress.py --runs 40 --shapes fit,torch-spawn --no-widen --json out.json
    python tests/exits/stress.py --runs 1000 --progress runs.jsonl  # one line per run as it ends

A run is *aborted* when its output says "terminate called" or a process died of SIGABRT, *failed*
when it exited non-zero or did not finish within ``--timeout`` seconds, and *left a group* when
one of its processes still held a process group as the interpreter finalized (the abort's
precondition, checked in every process with ``--widen``: ``widen/sitecustomize.py``). ``--widen``
(the default) puts ``widen/sitecustomize.py`` on PYTHONPATH: one CPU per process and a one-second
GIL switch interval, which turns the rare abort at exit into a frequent one on code that has it.
Exits 0 when every run was clean. tests/test_exits.py runs a small sample of it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from programs import SHAPES  # noqa: E402

ABORT_MARKS = ("terminate called", "SIGABRT", "Signals.SIGABRT", "exitcode -6", "exit code -6")
GROUP_ALIVE_MARK = "exit check: a process group is still alive as the interpreter finalizes"  # widen/sitecustomize.py


@dataclass
class Run:
    shape: str
    returncode: int | None  # None: killed at the timeout
    aborted: bool
    seconds: float
    tail: str
    group_left: bool = False

    @property
    def clean(self) -> bool:
        return self.returncode == 0 and not self.aborted and not self.group_left


def run_once(shape: str, widen: bool, timeout: float) -> Run:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if widen:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "widen"), env.get("PYTHONPATH")]))
        env["LS_EXIT_WIDEN"] = "1"
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"exit-{shape}-") as workdir:
        process = subprocess.Popen([sys.executable, str(HERE / "programs.py"), shape], cwd=workdir, env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            output, _ = process.communicate(timeout=timeout)
            code: int | None = process.returncode
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the program and every rank it launched
            output, _ = process.communicate()
            code = None
    aborted = code in (-signal.SIGABRT, 128 + signal.SIGABRT) or any(mark in output for mark in ABORT_MARKS)
    return Run(shape, code, aborted, time.monotonic() - start, output[-3000:], GROUP_ALIVE_MARK in output)


def stress(
    runs: int, shapes: list[str], widen: bool = True, parallel: int = 2, timeout: float = 240, progress: Path | None = None
) -> list[Run]:
    """``runs`` programs, round-robin over ``shapes``, ``parallel`` at a time.

    With ``progress``, every finished run is appended to that file as one JSON line and counted on
    stdout, so a long stress that is cut off keeps what it measured.
    """
    plan = [shapes[i % len(shapes)] for i in range(runs)]
    results: list[Run] = []
    with ThreadPoolExecutor(parallel) as pool:
        for done in as_completed([pool.submit(run_once, shape, widen, timeout) for shape in plan]):
            run = done.result()
            results.append(run)
            if progress is not None:
                with progress.open("a") as f:
                    f.write(json.dumps(asdict(run)) + "\n")
                bad = sum(not r.clean for r in results)
                print(f"[{len(results)}/{runs}] {run.shape}: exit code {run.returncode}, "
                      f"{'ABORT' if run.aborted else 'GROUP LEFT' if run.group_left else 'ok'} ({bad} not clean so far)", flush=True)  # fmt: skip
    return results


def report(results: list[Run]) -> str:
    lines = [f"{'shape':<22}{'runs':>6}{'aborted':>9}{'group left':>12}{'failed':>8}{'mean s':>8}"]
    for shape in dict.fromkeys(r.shape for r in results):
        mine = [r for r in results if r.shape == shape]
        failed = sum(not r.clean for r in mine)
        lines.append(f"{shape:<22}{len(mine):>6}{sum(r.aborted for r in mine):>9}{sum(r.group_left for r in mine):>12}"
                     f"{failed:>8}{sum(r.seconds for r in mine) / len(mine):>8.1f}")  # fmt: skip
    codes = Counter(r.returncode for r in results)
    lines.append(f"{'all':<22}{len(results):>6}{sum(r.aborted for r in results):>9}{sum(r.group_left for r in results):>12}"
                 f"{sum(not r.clean for r in results):>8}   exit codes: {dict(codes)}")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=len(SHAPES) * 10)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, from: " + ", ".join(SHAPES))
    parser.add_argument("--widen", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--json", type=Path, help="write every run's result here")
    parser.add_argument("--progress", type=Path, help="append each run's result here as it finishes (JSON lines)")
    args = parser.parse_args()
    start = time.monotonic()
    results = stress(args.runs, args.shapes.split(","), args.widen, args.parallel, args.timeout, args.progress)
    print(report(results))
    print(f"{len(results)} runs in {time.monotonic() - start:.0f} s, race {'widened' if args.widen else 'not widened'}")
    for bad in [r for r in results if not r.clean][:3]:
        print(f"--- {bad.shape}: exit code {bad.returncode}\n{bad.tail[-1500:]}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0 if all(r.clean for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
