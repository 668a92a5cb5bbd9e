"""Jobs across stand-in hosts (network namespaces on one switch, tests/hosts.py), launched as users launch them.

Each host has its own address and reaches the others only over its link, so MASTER_ADDR, the
rendezvous and gloo's connections go over a network stack, not loopback. Results are compared
bitwise with a one-host run of the same world size: the recommender example through Lightning's
environment, and the collection model (tests/scripts/fit_collection.py) after a partition, a
killed host, or a killed rank that torchrun restarts; the one-host run itself matches plain torch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import lightning_models as lm
import pytest
import torch
from hosts import Hosts, skip_reason, wire_skip_reason
from processes import ABORT_MARK, assert_clean_exit
from run_queue import RunQueueWaits

from lightning_sparse import checkpoint

pytestmark = [
    pytest.mark.subprocesses,
    pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason())),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),  # DCP, when the test exports a checkpoint in this process
]

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 20  # the process groups' timeout (rendezvous and collectives)
RUN_TIMEOUT_S = 150

# The recommender example at a size that fits a test: one epoch, 4 steps of 2 x 512 samples.
RECOMMENDER = [
    sys.executable, "-W", "ignore", str(ROOT / "examples" / "recommender.py"), "fit",
    "--config", str(ROOT / "examples" / "recommender.yaml"), "--trainer.max_epochs", "1", "--trainer.logger", "false",
    "--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "true",
    "--trainer.strategy", "lightning_sparse.SparseDDPStrategy", "--trainer.strategy.timeout", f"0:00:{TIMEOUT_S}",
    "--model.num_users", "20000", "--model.num_items", "5000", "--data.num_users", "20000", "--data.num_items", "5000",
    "--data.train_interactions", "4096", "--data.val_interactions", "1024", "--data.batch_size", "512",
]  # fmt: skip


@pytest.fixture
def hosts():
    with Hosts(2) as made:
        yield made


def _env(**extra: str) -> dict[str, str]:
    """What every process of these tests gets on top of :meth:`Hosts.env` (which adds this process's environment)."""
    return {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "examples"), **extra}


def _finish(proc: subprocess.Popen, what: str) -> subprocess.CompletedProcess:
    """Wait for ``proc``; fail if it runs past RUN_TIMEOUT_S plus the time it and its children waited for a CPU."""
    waits = RunQueueWaits([proc.pid], descendants=True)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        try:
            out, _ = proc.communicate(timeout=1)
            return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")
        except subprocess.TimeoutExpired:
            waits.sample()
            if time.monotonic() > deadline + waits.most():
                break
    proc.kill()
    out, _ = proc.communicate()
    pytest.fail(f"{what} did not finish within {RUN_TIMEOUT_S} s (plus {waits.most():.0f} s waiting for a CPU):\n{out[-3000:]}")


def _finish_each(procs: dict, waits: RunQueueWaits) -> dict:
    """:func:`_finish` for every process at once: per key, the result and the monotonic time its process was seen to end.

    ``waits`` follows the processes meanwhile (sampled every 50 ms, so that a process that ends has a recent sample).
    """
    from concurrent.futures import ThreadPoolExecutor

    def finish(key, proc: subprocess.Popen) -> tuple[subprocess.CompletedProcess, float]:
        result = _finish(proc, str(key))
        return result, time.monotonic()

    with ThreadPoolExecutor(len(procs)) as pool:
        futures = {key: pool.submit(finish, key, proc) for key, proc in procs.items()}
        while not all(future.done() for future in futures.values()):
            waits.sample()
            time.sleep(0.05)
        return {key: future.result() for key, future in futures.items()}


def _exported(root: Path, out: Path) -> dict[str, torch.Tensor]:
    (ckpt,) = (root / "checkpoints").glob("*.ckpt")
    checkpoint.export(str(ckpt), str(out))
    return torch.load(out, weights_only=True)


def _recommender_on_one_host(root: str) -> None:
    """In a rank of the session's 2-rank pool (one host, loopback): the example's LightningCLI, devices=2."""
    sys.path.insert(0, str(ROOT / "examples"))
    from lightning.pytorch.cli import LightningCLI
    from recommender import Recommender, SyntheticInteractions

    lm.lightning_env(torch.distributed.get_rank(), 2)
    LightningCLI(Recommender, SyntheticInteractions, save_config_callback=None,
                 args=[*RECOMMENDER[4:], "--trainer.devices", "2", "--trainer.default_root_dir", root])  # fmt: skip


SLOW_LOSSY_LINK = (5, 0.01)  # every packet held 5 ms, 1% of them dropped (tests/wire.py; the kernel may lack netem)


def test_recommender_on_two_hosts_through_lightning_env_over_a_slow_lossy_link_equals_one_host(rank_pools, tmp_path):
    """NODE_RANK / MASTER_ADDR on host 0's address, one rank per host, 5 ms / 1% loss; the same job on one host.

    Without a TUN device for the wire, the hosts are linked by the bridge (no delay, no loss) instead.
    """
    wire = SLOW_LOSSY_LINK if wire_skip_reason() is None else None
    with Hosts(2, wire=wire) as hosts:
        spread = [
            hosts.popen(
                host,
                [
                    *RECOMMENDER,
                    "--trainer.num_nodes",
                    "2",
                    "--trainer.devices",
                    "1",
                    "--trainer.default_root_dir",
                    str(tmp_path / "two"),
                ],  # one checkpoint directory, as on a shared file system
                env=hosts.lightning_env(host, **_env()),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=tmp_path,
            )  # fmt: skip
            for host in range(2)
        ]
        rank_pools(2).run(_recommender_on_one_host, str(tmp_path / "one"))  # meanwhile, the reference on this host
        results = [_finish(proc, f"host {host}") for host, proc in enumerate(spread)]
    if wire is not None:  # the wire carried the job, and lost packets on the way
        assert hosts.wire_counts["forwarded"] > 1000 and hosts.wire_counts["dropped"] > 0, hosts.wire_counts
    for result in results:
        assert_clean_exit(result)
    assert "MEMBER: 2/2" in results[1].stdout and "epoch 0: val_auroc" in results[0].stdout, results[1].stdout[-2000:]
    ours, reference = _exported(tmp_path / "two", tmp_path / "two.pt"), _exported(tmp_path / "one", tmp_path / "one.pt")
    assert ours.keys() == reference.keys() and any(v.shape[0] == 20000 for v in ours.values())
    for key, value in reference.items():
        assert torch.equal(ours[key], value), f"{key}: the two-host run differs from the one-host run"


def test_wrong_master_addr_fails_on_every_host_within_the_timeout_with_a_hint(hosts, tmp_path):
    """Host 1 names an address where nobody listens: both hosts exit non-zero, naming the settings to fix, each having
    given up on the timeout it was configured with (before a second one could end), not on a default."""
    timeout_s = 5
    procs = []
    for host, master in enumerate([hosts.address(0), f"{hosts.subnet}.99"]):
        env = hosts.lightning_env(host, **_env(MASTER_ADDR=master, WORLD_SIZE="2", LOCAL_RANK="0", RANK=str(host)))
        procs.append(hosts.popen(host, [sys.executable, str(ROOT / "tests" / "scripts" / "fit_collection.py"),
                                        str(tmp_path / "never.pt"), "--num-nodes", "2",
                                        "--timeout", str(timeout_s)],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))  # fmt: skip
    results = [_finish(proc, f"host {host}") for host, proc in enumerate(procs)]
    for result in results:
        assert result.returncode != 0 and ABORT_MARK not in result.stdout, result.stdout[-3000:]
        assert "PeerFailure" in result.stdout and "could not start the job" in result.stdout, result.stdout[-3000:]
        assert "HINT: MASTER_ADDR must be the address of the host running NODE_RANK=0" in result.stdout
        waited = _stamp("PeerFailure raised", result.stdout) - _stamp("fit started", result.stdout)
        assert waited < 2 * timeout_s, f"a rank gave up {waited:.1f} s after it began to join (timeout {timeout_s} s)"
    assert f"MASTER_ADDR={hosts.subnet}.99" in results[1].stdout
    assert not (tmp_path / "never.pt").exists()


def _stamp(what: str, output: str) -> float:
    """The monotonic time a rank of fit_collection.py printed for ``what``."""
    found = re.search(rf"{what} at monotonic ([0-9.]+)", output)
    assert found, f"no '{what}' in the output:\n{output[-3000:]}"
    return float(found.group(1))


# ---------------------------------------------------------------- faults mid-fit, resume
FAULT_TIMEOUT_S = 10  # the process groups' timeout in the fault tests: a cut link shows only as this timeout
SCRIPT = str(ROOT / "tests" / "scripts" / "fit_collection.py")


def _fit_on_hosts(hosts: Hosts, out: Path, timeout_s: float, *extra: str) -> list[subprocess.Popen]:
    """fit_collection.py on both hosts through Lightning's environment (one rank per host)."""
    return [
        hosts.popen(
            host,
            [sys.executable, SCRIPT, str(out), "--num-nodes", "2", "--timeout", str(timeout_s), *extra],
            env=hosts.lightning_env(host, **_env()),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for host in range(2)
    ]


def _pool_fit(directory: str, num_nodes: int, ckpt_path: str | None) -> dict:
    """In a rank of the 2-rank pool, posing as ``num_nodes`` hosts: the fault tests' fit (tests/scripts/fit_collection.py's),
    from ``ckpt_path`` if given. Its tables and dense weights, its size, and the global step it started from."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    environ = dict(os.environ)  # the pool's other jobs pose as hosts of their own
    lm.lightning_env(torch.distributed.get_rank(), 2, num_nodes=num_nodes)
    try:
        module, first = lm.CollectionTower(), lm.FirstStep()
        callbacks = [ModelCheckpoint(dirpath=directory, save_top_k=-1, save_last=True), first]
        trainer = lm.trainer(2 // num_nodes, num_nodes=num_nodes, max_epochs=2, enable_checkpointing=True, callbacks=callbacks)
        trainer.fit(module, ckpt_path=ckpt_path)
        return {"state": lm.state(module), "world_size": trainer.world_size, "num_nodes": trainer.num_nodes,
                "first_step": first.step}  # fmt: skip
    finally:
        os.environ.clear()
        os.environ.update(environ)


@pytest.fixture(scope="module")
def straight(rank_pools, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The fault tests' fit with nothing going wrong, on this host (the 2-rank pool)."""
    return rank_pools(2).run(_pool_fit, str(tmp_path_factory.mktemp("straight")), 1, None)[0]["state"]


def _wait_for(path: Path, procs: list[subprocess.Popen], timeout_s: float = RUN_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        ended = [p for p in procs if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            outputs = "\n".join(_finish(p, "rank").stdout[-2000:] for p in procs)
            pytest.fail(f"the fit never reached the fault's step:\n{outputs}")
        time.sleep(0.05)


FAULTS = ("partition", "host-kill")  # resumed by hand; the third job is resumed by torchrun


def test_the_uninterrupted_fit_is_the_plain_torch_replay(straight):
    expected = lm.reference(lm.global_batches(2, batch_size=4, epochs=2), torch.optim.Adagrad, {"lr": 0.2})
    assert not torch.equal(expected["users"], lm.reference([], torch.optim.Adagrad, {"lr": 0.2})["users"])
    for key, value in expected.items():
        torch.testing.assert_close(straight[key], value, rtol=0, atol=1e-6, msg=key)


def test_failures_mid_fit_stop_every_rank_in_time_and_every_job_resumes_exactly(straight, rank_pools, tmp_path):
    """Three jobs at once (their timeouts overlap), each on its own pair of hosts, fail at step 9 of 12:
    host 1's link is cut; host 1's processes are SIGKILLed; rank 1 SIGKILLs itself under torchrun --max-restarts 1.
    In the first two, every rank raises PeerFailure, naming the lost rank, before a second timeout could have ended
    (stamped by the rank itself, on the clock the processes share), and exits before two more could; both limits add the
    time the rank waited for a CPU meanwhile (tests/run_queue.py: exiting is CPU work, and at a load of 22 on 2 cores it
    took 13-21 s), which a rank that waits on a lost peer or hangs does not accrue. The first two resume from
    last.ckpt (step 6) in the 2-rank pool, posing as 2 hosts (interpreters already started: the relaunch across hosts is
    the third job's, which torchrun restarts by itself on them).
    All three end bitwise equal to the uninterrupted fit."""
    runs = {name: tmp_path / name for name in (*FAULTS, "torchrun")}
    for run in runs.values():
        run.mkdir()
    with Hosts(2) as cut, Hosts(2) as killed, Hosts(2) as restarting:
        torchrun = _torchrun_with_restarts(restarting, runs["torchrun"])
        pairs = dict(zip(FAULTS, (cut, killed)))
        procs = {fault: _fit_on_hosts(pairs[fault], runs[fault] / "never.pt", FAULT_TIMEOUT_S, "--checkpoints",
                                      str(runs[fault] / "checkpoints"), "--pause", "1", "9", str(runs[fault]))
                 for fault in FAULTS}  # fmt: skip
        for fault in FAULTS:
            _wait_for(runs[fault] / "paused", procs[fault])  # rank 1 waits at step 9, rank 0 in step 9's first collective
        cut.cut(1)
        killed.kill(1)
        survivors = {(fault, host): procs[fault][host] for fault, host in (("partition", 0), ("partition", 1), ("host-kill", 0))}
        waits = RunQueueWaits([proc.pid for proc in survivors.values()])
        start = time.monotonic()
        for fault in FAULTS:
            (runs[fault] / "go").touch()
        finished = _finish_each({(fault, host): proc for fault in FAULTS for host, proc in enumerate(procs[fault])}, waits)
        results = {fault: [finished[fault, host][0] for host in range(2)] for fault in FAULTS}
        for (fault, host), proc in survivors.items():  # every rank that outlived the fault; limits past its CPU waits
            raised = _stamp("PeerFailure raised", results[fault][host].stdout)
            waited = waits.waited_between(proc.pid, start, raised)
            assert raised - start < 2 * FAULT_TIMEOUT_S + waited, (
                f"{fault}, host {host}: PeerFailure {raised - start:.1f} s after the fault ({waited:.1f} s waiting for a CPU)"
            )
            exiting, waited = finished[fault, host][1] - raised, waits.waited_between(proc.pid, raised)
            assert exiting < 2 * FAULT_TIMEOUT_S + waited, (
                f"{fault}, host {host} exited {exiting:.1f} s after its PeerFailure ({waited:.1f} s waiting for a CPU)"
            )
        for fault, hosts in pairs.items():
            assert hosts.pids(0) == [] and hosts.pids(1) == [], f"{fault}: a process outlived the fault"
            survivor = results[fault][0].stdout
            assert results[fault][0].returncode != 0 and ABORT_MARK not in survivor, survivor[-3000:]
            assert "PeerFailure" in survivor and "rank 1 (node 1)" in survivor and "HINT: " in survivor, survivor[-3000:]
            last = runs[fault] / "checkpoints" / "last.ckpt"
            assert checkpoint.is_sharded(last) and checkpoint.load_meta(last)["global_step"] == 6, fault
        cut_off = results["partition"][1]  # the cut-off side knows it is the one cut off
        assert cut_off.returncode != 0 and "PeerFailure" in cut_off.stdout and ABORT_MARK not in cut_off.stdout, cut_off.stdout[
            -3000:
        ]
        assert "this host is probably the one cut off" in cut_off.stdout, cut_off.stdout[-3000:]
        assert results["host-kill"][1].returncode == -9
        resumed = {fault: rank_pools(2).run(_pool_fit, str(runs[fault] / "checkpoints"), 2, "last")[0] for fault in FAULTS}
        assert [resumed[fault]["first_step"] for fault in FAULTS] == [6, 6], "a job did not resume from its last.ckpt"
        _check_restarted(torchrun, runs["torchrun"])
    resumed["torchrun"] = torch.load(runs["torchrun"] / "resumed.pt", weights_only=True)
    for name, result in resumed.items():
        assert (result["world_size"], result["num_nodes"]) == (2, 2)
        for key, value in straight.items():
            assert torch.equal(result["state"][key], value), f"{name}, {key}: the resumed run differs from the uninterrupted one"


def _torchrun_with_restarts(hosts: Hosts, run: Path) -> list[subprocess.Popen]:
    """torchrun --nnodes 2 --max-restarts 1 on both hosts (c10d rendezvous on host 0); rank 1 dies at step 9, once."""
    return [
        hosts.popen(
            host,
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"{hosts.address(0)}:29400",
                "--rdzv-id",
                "restarts",
                # the hosts share one hostname, so torchrun cannot tell by name which one holds the store
                "--rdzv-conf",
                f"is_host={int(host == 0)}",
                "--local-addr",
                hosts.address(host),
                "--max-restarts",
                "1",
                "--monitor-interval",
                "0.5",
                SCRIPT,
                str(run / "resumed.pt"),
                "--num-nodes",
                "2",
                "--timeout",
                str(FAULT_TIMEOUT_S),
                "--checkpoints",
                str(run / "checkpoints"),
                "--resume",
                "--die",
                "1",
                "9",
                str(run / "died"),
            ],
            # the workers' own store per attempt: torchrun's shared one breaks such restarts (pytorch/pytorch#135712)
            env=hosts.env(**_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for host in range(2)
    ]


def _check_restarted(procs: list[subprocess.Popen], run: Path) -> None:
    results = [_finish(proc, f"torchrun on host {host}") for host, proc in enumerate(procs)]
    log = "".join(f"--- host {host}\n{r.stdout[-4000:]}" for host, r in enumerate(results))
    assert all(r.returncode == 0 for r in results) and ABORT_MARK not in log, log
    assert (run / "died").exists() and "Restored all states from the checkpoint" in log, log  # a rank died; the restart resumed
    assert checkpoint.load_meta(run / "checkpoints" / "last.ckpt")["global_step"] == 12
