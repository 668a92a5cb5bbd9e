"""The benchmark suite runs end to end in its smoke mode (it measures nothing worth asserting here)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from processes import assert_clean_exit

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.subprocesses
@pytest.mark.timeout(600)
def test_quick_benchmark_writes_results_and_report(tmp_path):
    """Its time limit only catches a hang (no speed claim): the quick run outlasted 280 s at a load of 20 on 2 cores."""
    page = tmp_path / "benchmarks.md"
    shutil.copy(ROOT / "docs" / "benchmarks.md", page)
    out = tmp_path / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-W", "ignore", str(ROOT / "benchmarks" / "bench.py"), "--quick", "--out", str(out), "--doc", str(page)],
        capture_output=True, text=True, timeout=540, env=env,
    )  # fmt: skip
    assert_clean_exit(run)
    doc = json.loads(out.read_text())
    assert doc["quick"] and doc["machine"]["cpu_count"] and doc["versions"]["torch"] and doc["code"]["commit"]
    kinds = {(r["name"], r["kind"]) for r in doc["single_process"][0]["results"]}
    for name in ("ours/adam_row", "ours/adagrad", "ours/rowwise_adagrad", "ours/sgd", "torch/adam_global"):
        assert (name, "step") in kinds and (name, "update") in kinds
    assert ("floor/gather_scatter/adam_row", "floor_gather_scatter") in kinds
    runs = doc["distributed"]["runs"]
    assert {r["method"] for r in runs} >= {"ours", "sparse_ddp", "sparse_grad_ddp"}
    assert all("error" not in r for r in runs), [r.get("error") for r in runs]
    ours = next(r for r in runs if r["method"] == "ours")
    assert ours["bytes_sent_per_step"] > 0 and ours["lower_bound_bytes_per_step"] > 0
    collection = doc["collection"]["distributed"]["methods"]
    assert collection["collection"]["all_to_all_per_step"] == 3 and collection["separate"]["all_to_all_per_step"] > 26
    assert "collection" in doc["collection"]["single_process"]["methods"]
    scale = {(r["world_size"], r["group_size"]): r for r in doc["scale"]["results"]}
    assert set(scale) == {(8, 8), (256, 256), (256, 32)}  # simulated: 3 all-to-alls per step, each to every other rank
    assert all(r["collectives"] == 3 and r["peer_messages"] == 3 * (w - 1) for (w, g), r in scale.items() if w == g)
    two_d = scale[256, 32]  # all-to-alls inside a group of 32, then 2 all-gathers over the 8 replicas
    assert two_d["collectives"] == 5 and two_d["all_to_all_peers"] == 3 * 31 and two_d["peer_messages"] == 3 * 31 + 2 * 7
    dynamic = doc["dynamic"]["step"]["one process"]
    assert set(dynamic["ms"]) == {"sparse", "dynamic_room", "dynamic_full"} and dynamic["full_evictions"] > 0
    half = {r["method"]: r for r in doc["half"]["results"]}
    assert set(half) == {"float32", "bfloat16", "bfloat16, nearest", "float16"}
    assert half["bfloat16"]["table_bytes"] * 2 == half["float32"]["table_bytes"] == half["bfloat16"]["state_bytes"]
    assert doc["targets"] and all({"name", "target", "measured", "met"} <= set(t) for t in doc["targets"])
    text = page.read_text()
    assert "### Targets" in text and "quick" in text and "![benchmarks-single.png]" in text
    assert "### Scale: one rank of W (simulator)" in text and "### Dynamic tables (hashed ids)" in text
    assert "### Half-precision tables" in text
    assert all(len(r["round_ms"]) == doc["single_process"][0]["rounds"] for r in doc["single_process"][0]["results"])
    assert (tmp_path / "benchmarks-single.png").stat().st_size > 0
    assert text.startswith((ROOT / "docs" / "benchmarks.md").read_text().split("<!-- results:begin -->")[0])


def test_scale_rounds_interleave_layouts_and_keep_the_median_round(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import scale

    calls, times = [], iter([90.0, 300.0, 120.0, 100.0, 80.0, 110.0])  # W=8, W=64, W=8, W=64, W=8, W=64

    def fake_measure(world_size, workload, batch, rows_cap, steps, group_size=None):
        calls.append(world_size)
        return {"world_size": world_size, "workload": workload, "step_ms": next(times), "call": len(calls)}

    monkeypatch.setattr(scale, "measure", fake_measure)
    section = scale.run([(8, None), (64, None)], ["26 tables"], 4, 10, 1, rounds=3, in_process=True)
    assert calls == [8, 64, 8, 64, 8, 64]  # round by round, not layout by layout
    by_world = {r["world_size"]: r for r in section["results"]}
    assert by_world[8]["step_ms"] == 90.0 and by_world[8]["call"] == 1  # the median round's whole record
    assert by_world[64]["step_ms"] == 110.0 and by_world[64]["step_ms_rounds"] == [300.0, 100.0, 110.0]
    assert section["rounds"] == 3


def test_a_ratio_is_the_median_of_the_rounds_ratios_where_both_sides_have_rounds(monkeypatch):
    """A machine that drifts between rounds moves both methods of a round together: the per-round ratio cancels it."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import report

    ours = {"ms_median": 10.0, "round_ms": [10.0, 20.0, 10.0]}  # its middle round ran in a slow phase of the machine
    theirs = {"ms_median": 20.0, "round_ms": [20.0, 40.0, 20.0]}
    assert report.ratio(ours, theirs) == 2.0
    assert report.ratio({"ms_median": 10.0}, {"ms_median": 25.0}) == 2.5  # results without rounds: of the medians
    assert report.ratio({"step_ms_median": 4.0}, {"step_ms_median": 2.0}) == 0.5
    assert report.ratio(None, theirs) is None


def test_a_run_without_a_gpu_keeps_the_gpu_figures_of_the_results_it_replaces(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench

    gpu = {"device_name": "NVIDIA H100", "workloads": []}
    previous = {"quick": False, "created": "2026-11-26T00:00:00", "code": {"commit": "abc1234"}, "gpu": gpu,
                "dynamic": {"step": {"one process, GPU": {"ratio_room": 2.0}}}}  # fmt: skip
    out = tmp_path / "bench.json"
    out.write_text(json.dumps(previous))
    doc = {"quick": False, "gpu": {"skipped": "no CUDA device"}, "dynamic": {"step": {"one process": {"ratio_room": 1.5}}}}
    bench._keep_gpu_figures(doc, out)
    assert doc["gpu"] == gpu and doc["dynamic"]["step"]["one process, GPU"] == {"ratio_room": 2.0}
    assert doc["rerun"]["gpu"] == {"created": "2026-11-26T00:00:00", "commit": "abc1234"}  # the page says when
    smoke = {"quick": True, "gpu": {"skipped": "no CUDA device"}, "dynamic": {"step": {}}}
    bench._keep_gpu_figures(smoke, out)  # a smoke run keeps nothing of a full run's
    assert smoke["gpu"] == {"skipped": "no CUDA device"} and "rerun" not in smoke


def test_gpu_benchmark_runs_the_gpu_path_and_reports_every_target(monkeypatch):
    """benchmarks/gpu.py on CPU through Triton's interpreter (timings meaningless): every method, lookup and target."""
    from lightning_sparse.kernels import backend

    if not (backend.interpreting() and backend.triton_available()):
        pytest.skip("needs triton's interpreter")
    monkeypatch.setenv(backend.ENV, "triton")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu
    import gpu_report

    # one timed call after one warm-up: a method's first step (its state made) and a later one, each interpreted once
    doc = gpu.run([dict(rows=2000, dim=8, batch=256)], draws=("skewed",), steps=1, warmup=1, device="cpu",
                  collection=dict(tables=3, rows=500, dim=8, batch=64))  # fmt: skip
    (workload,) = doc["workloads"]
    assert set(workload["step_ms"]) == {"ours/adagrad", "ours/rowwise_adagrad", "ours/adam", "ours/adagrad_bf16",
                                        "torch_sparse/adagrad", "torch_sparse/adam", "torch_dense/adagrad", "torch_dense/adam"}  # fmt: skip
    assert set(workload["lookup_ms"]) == {"ours, grad mode", "ours, no_grad", "torch F.embedding"}
    assert [u["family"] for u in workload["update"]] == ["adagrad", "rowwise_adagrad", "adam"]
    found = []
    gpu_report.targets(doc, lambda name, goal, value, met, unit="x": found.append(name))
    assert len(found) == 10  # 5 step ratios, the lookup, 3 update bandwidths, the collection's (no profiler counts on a CPU)
    assert set(doc["collection"]["step_ms"]) == {"ours/rowwise_adagrad", "ours/adagrad", "torch_sparse/adagrad"}
    assert "**0.002M x 8, 256 ids, skewed ids**" in "\n".join(gpu_report.markdown(doc))
    import gpu_host  # host time against step time (no capture on a CPU; the torch kernels: the script is what is tested)

    monkeypatch.setenv(backend.ENV, "torch")
    cases = gpu_host.run(500, 8, 64, steps=2, device="cpu", profiled_steps=2)["cases"]
    assert set(cases) == {"ours/adagrad", "torch_sparse/adagrad", "ours/dynamic_adagrad"}
    assert all(case["step_ms"] > 0 and case["host_ms"] > 0 for case in cases.values())


@pytest.mark.parametrize("tests", ["pass", "fail", "out of time"])
def test_the_gpu_checks_fail_when_a_test_fails_or_runs_out_of_time(tmp_path, tests):
    """benchmarks/gpu_checks.sh with stand-ins for the GPU's tools: its exit status is the tests' (and every section's)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    pytest_run = {"pass": "exit 0", "fail": "exit 1", "out of time": "exec sleep 30"}[tests]
    (fake / "python3").write_text(f'#!/bin/sh\ncase "$1 $2" in "-m pytest") {pytest_run};; esac\nexit 0\n')
    for tool in fake.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"), "TESTS_S": "2"}
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_checks.sh")], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env=env)  # fmt: skip
    if tests == "pass":
        assert run.returncode == 0 and "== all sections passed" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    else:
        why = r"exit 1\)" if tests == "fail" else r"exit 1(24|37): out of time\)"  # 137: a TERM ignored, then killed
        assert (
            run.returncode == 1
            and run.stdout.count("== FAILED") == 1
            and re.search(rf"== FAILED: CUDA tests \({why}", run.stdout)
        ), run.stdout[-2000:] + run.stderr[-2000:]


def test_the_trainer_benchmark_fits_every_way_at_tiny_sizes(monkeypatch, tmp_path):
    """benchmarks/gpu_trainer.py on CPU at tiny sizes (the captured fit with tests/graph_double.py; timings
    meaningless): every workload fit each way, the ratios and the captures written."""
    from graph_double import CallAgainGraphs

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_trainer

    workloads = {"dlrm": dict(tables=3, rows=200, dim=8, batch=32), "one_table": dict(users=300, items=50, dim=8, batch=32)}
    doc = gpu_trainer.run(workloads, steps=2, warmup=3, device="cpu", graphs=CallAgainGraphs(), out=tmp_path / "trainer.json")
    assert not torch.distributed.is_initialized(), "the fits' process groups are destroyed (later tests in this process)"
    assert json.loads((tmp_path / "trainer.json").read_text()) == json.loads(json.dumps(doc))
    for name, found in doc["workloads"].items():
        assert found["errors"] == {} and set(found["fits"]) == set(gpu_trainer.WAYS), (name, found["errors"])
        assert set(found["ratios"]) == {"ours captured / torch ddp", "ours eager / torch ddp", "ours captured / ours eager"}
        assert all(fit["samples_per_s"] > 0 for fit in found["fits"].values())
        assert found["fits"]["ours captured"]["captures"] == {
            "warm-up": 2,
            "captured": 1,
            "replayed": 3,
            "eager": 0,
            "dropped": 0,
        }


@pytest.mark.subprocesses
def test_the_shared_gpu_benchmark_runs_its_ranks(monkeypatch):
    """benchmarks/gpu_ranks.py on CPU with tiny sizes (torch kernels, no syncs to count): the script a GPU run relies on."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_ranks

    doc = gpu_ranks.run(300, 8, 64, steps=2, warmup=1, sync_steps=1, device="cpu")
    assert set(doc["step_ms"]) == {"1 rank", "2 ranks sharing the device"} and all(ms > 0 for ms in doc["step_ms"].values())
    assert doc["ratio_2_ranks_to_1"] > 0 and doc["host_syncs_per_step"] == {"1 rank": 0, "2 ranks, rank 0": 0}
    assert doc["host_syncs_at"] == {"1 rank": {}, "2 ranks, rank 0": {}}


def test_the_huge_pages_benchmark_times_both_pages_for_every_workload(monkeypatch):
    """benchmarks/huge_pages.py at tiny sizes (timings meaningless): each workload on both pages, the switch put back."""
    from lightning_sparse.tables.placement import HUGE_PAGES_ENV

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import huge_pages

    doc = huge_pages.run(rows=20_000, batch=64, pool=2_000, rounds=2, steps=1, warmup=1, log=lambda *_: None)
    assert [r["workload"] for r in doc["results"]] == ["adagrad", "adam", "dynamic"]
    assert all(set(r["ms"]) == {"4 KiB", "2 MiB"} and r["ratio_4k_over_2m"] > 0 for r in doc["results"])
    assert HUGE_PAGES_ENV not in os.environ
