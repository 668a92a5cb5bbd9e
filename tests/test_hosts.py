"""Jobs across stand-in hosts (network namespaces on one switch, tests/hosts.py), launched as users launch them.

Each host has its own address and reaches the others only over its link, so MASTER_ADDR, the
rendezvous and gloo's connections go over a network stack, not loopback. Results are compared
with a one-host run of the same world size (the recommender example, bitwise) and with the
plain-torch reference (the collection model under torchrun).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import lightning_models as lm
from hosts import Hosts, skip_reason
from lightning_sparse import checkpoint
from processes import ABORT_MARK, assert_clean_exit

pytestmark = [
    pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason())),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),  # DCP, when the test exports a checkpoint in this process
]

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 20  # the process groups' timeout (rendezvous and collectives)
RUN_TIMEOUT_S = 150

# The recommender example at a size that fits a test: one epoch, 8 steps of 2 x 512 samples.
RECOMMENDER = [
    sys.executable, "-W", "ignore", str(ROOT / "examples" / "recommender.py"), "fit",
    "--config", str(ROOT / "examples" / "recommender.yaml"), "--trainer.max_epochs", "1", "--trainer.logger", "false",
    "--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "true",
    "--trainer.strategy", "lightning_sparse.SparseDDPStrategy", "--trainer.strategy.timeout", f"0:00:{TIMEOUT_S}",
    "--model.num_users", "20000", "--model.num_items", "5000", "--data.num_users", "20000", "--data.num_items", "5000",
    "--data.train_interactions", "8192", "--data.val_interactions", "2048", "--data.batch_size", "512",
]  # fmt: skip


@pytest.fixture
def hosts():
    with Hosts(2) as made:
        yield made


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "examples"), **extra}


def _finish(proc: subprocess.Popen, what: str) -> subprocess.CompletedProcess:
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"{what} did not finish within {RUN_TIMEOUT_S} s:\n{out[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


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


def test_recommender_on_two_hosts_through_lightning_env_equals_one_host(hosts, rank_pools, tmp_path):
    """NODE_RANK / MASTER_ADDR on host 0's address, one rank per host; the same job on one host with devices=2."""
    spread = [
        hosts.popen(host, [*RECOMMENDER, "--trainer.num_nodes", "2", "--trainer.devices", "1",
                           "--trainer.default_root_dir", str(tmp_path / "two")],  # one checkpoint directory, as on a shared file system
                    env=hosts.env(host, **_env(MASTER_ADDR=hosts.address(0), MASTER_PORT="29500", NODE_RANK=str(host))),
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)  # fmt: skip
        for host in range(2)
    ]
    rank_pools(2).run(_recommender_on_one_host, str(tmp_path / "one"))  # meanwhile, the reference on this host
    results = [_finish(proc, f"host {host}") for host, proc in enumerate(spread)]
    for result in results:
        assert_clean_exit(result)
    assert "MEMBER: 2/2" in results[1].stdout and "epoch 0: val_auroc" in results[0].stdout, results[1].stdout[-2000:]
    ours, reference = _exported(tmp_path / "two", tmp_path / "two.pt"), _exported(tmp_path / "one", tmp_path / "one.pt")
    assert ours.keys() == reference.keys() and any(v.shape[0] == 20000 for v in ours.values())
    for key, value in reference.items():
        assert torch.equal(ours[key], value), f"{key}: the two-host run differs from the one-host run"


def test_collection_model_under_torchrun_on_two_hosts_matches_plain_torch(hosts, tmp_path):
    """torchrun --nnodes 2 with the c10d rendezvous on host 0; the collection's one round per step crosses hosts."""
    out = tmp_path / "state.pt"
    procs = [
        hosts.popen(host, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.address(0)}:29400", "--rdzv-id", "hosts-test",
                           "--local-addr", hosts.address(host), "--max-restarts", "0",
                           # the hosts share one hostname, so torchrun cannot tell by name which one holds the store
                           "--rdzv-conf", f"is_host={int(host == 0)}",
                           str(ROOT / "tests" / "scripts" / "fit_collection.py"), str(out), "2", "1", str(TIMEOUT_S)],
                    env=hosts.env(host, **_env()), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)  # fmt: skip
        for host in range(2)
    ]
    for host, proc in enumerate(procs):
        assert_clean_exit(_finish(proc, f"torchrun on host {host}"))
    saved = torch.load(out, weights_only=True)
    assert (saved["world_size"], saved["num_nodes"]) == (2, 2)
    expected = lm.reference(lm.global_batches(2, batch_size=4, epochs=2), torch.optim.Adagrad, {"lr": 0.2})
    assert not torch.equal(expected["users"], lm.reference([], torch.optim.Adagrad, {"lr": 0.2})["users"])
    for key, value in expected.items():
        torch.testing.assert_close(saved["state"][key], value, rtol=0, atol=1e-6, msg=key)


def test_wrong_master_addr_fails_on_every_host_within_the_timeout_with_a_hint(hosts, tmp_path):
    """Host 1 names an address where nobody listens: both hosts exit non-zero, naming the settings to fix."""
    timeout_s = 5
    procs, start = [], time.monotonic()
    for host, master in enumerate([hosts.address(0), f"{hosts.subnet}.99"]):
        env = hosts.env(host, **_env(MASTER_ADDR=master, MASTER_PORT="29500", NODE_RANK=str(host), WORLD_SIZE="2",
                                     LOCAL_RANK="0", RANK=str(host)))  # fmt: skip
        procs.append(hosts.popen(host, [sys.executable, str(ROOT / "tests" / "scripts" / "fit_collection.py"),
                                        str(tmp_path / "never.pt"), "2", "1", str(timeout_s)],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))  # fmt: skip
    results = [_finish(proc, f"host {host}") for host, proc in enumerate(procs)]
    elapsed = time.monotonic() - start
    assert elapsed < timeout_s + 60, f"the ranks took {elapsed:.0f} s to give up (timeout {timeout_s} s)"
    for host, result in enumerate(results):
        assert result.returncode != 0 and ABORT_MARK not in result.stdout, result.stdout[-3000:]
        assert "PeerFailure" in result.stdout and "could not start the job" in result.stdout, result.stdout[-3000:]
        assert "HINT: MASTER_ADDR must be the address of the host running NODE_RANK=0" in result.stdout
    assert f"MASTER_ADDR={hosts.subnet}.99" in results[1].stdout
    assert not (tmp_path / "never.pt").exists()
