"""The DLRM example: Criteo TSV reading, hashed ids and their tables' memory, CI-sized runs of its LightningCLI."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).parent.parent / "examples" / "dlrm"
sys.path.insert(0, str(EXAMPLE))

import data as dlrm_data  # noqa: E402
import model as dlrm_model  # noqa: E402
from example_runs import run_script  # noqa: E402

import lightning_sparse as ls  # noqa: E402


def write_tsv(path: Path, lines: int, seed: int = 0) -> None:
    """A tiny file in Criteo's layout: label, 13 integer counts, 26 hex ids; some fields empty."""
    gen = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(lines):
            label = int(torch.randint(0, 2, (1,), generator=gen))
            dense = ["" if torch.rand(1, generator=gen) < 0.1 else str(int(torch.randint(0, 50, (1,), generator=gen)))
                     for _ in range(13)]  # fmt: skip
            cats = ["" if torch.rand(1, generator=gen) < 0.1 else f"{int(torch.randint(0, 2**31, (1,), generator=gen)):08x}"
                    for _ in range(26)]  # fmt: skip
            f.write("\t".join([str(label), *dense, *cats]) + "\n")


def test_read_tsv(tmp_path):
    path = tmp_path / "day_0"
    write_tsv(path, 40)
    data = dlrm_data.read_tsv(path, max_rows=1000)
    assert len(data) == 40 and data.dense.shape == (40, 13)
    first = path.read_text().splitlines()[0].split("\t")
    rows = dlrm_data.cardinalities(1000)
    expected = int(first[14], 16) % rows[0] if first[14] else 0
    assert int(data.single["C1"][0]) == expected
    for name, ids in data.single.items():
        assert 0 <= int(ids.min()) and int(ids.max()) < rows[dlrm_data.SPARSE.index(name)]
    dense, features, labels = data.collate([3, 1])
    assert dense.shape == (2, 13) and labels.shape == (2,)
    assert features["C3"].num_bags == 2 and len(features["C3"].values) == 2  # Criteo is single-hot: bags of one


def test_read_tsv_names_a_malformed_line(tmp_path):
    path = tmp_path / "bad.tsv"
    path.write_text("1\t2\t3\n")
    with pytest.raises(ValueError, match=r"bad.tsv:1: 3 fields, expected 40 .*HINT"):
        dlrm_data.read_tsv(path, max_rows=100)


def test_synthetic_bags_collate_into_jagged_ids():
    data = dlrm_data.synthetic(64, max_rows=500, seed=0, split_seed=1)
    dense, features, labels = data.collate(list(range(10, 20)))
    assert set(features) == set(dlrm_data.SPARSE)
    bags = features["C3"]
    values, offsets, _ = data.bags["C3"]
    assert bags.values.tolist() == values[offsets[10] : offsets[20]].tolist()
    assert features["C24"].weights is not None and len(features["C24"].weights) == len(features["C24"].values)


def test_hashed_ids_are_zipf_hashes_with_a_planted_effect_per_id():
    data = dlrm_data.hashed(20_000, features=2, seed=0, split_seed=1)
    other = dlrm_data.hashed(20_000, features=2, seed=0, split_seed=2)
    assert set(data.single) == {"H1", "H2"} and not data.bags
    ids = data.single["H1"]
    # Raw 64-bit hash values: both signs, the whole int64 range, distinct values' low bits uniform.
    values, counts = torch.unique(ids, return_counts=True)
    assert int(ids.min()) < -(2**62) and int(ids.max()) > 2**62
    assert torch.bincount(values & 7, minlength=8).min() > 0.8 * len(values) / 8
    # Zipf head: the most frequent value is rank 0's, with the power law's share ((2^(1-s) - 1) / ((N+1)^(1-s) - 1)).
    s, n = dlrm_data.HASHED_EXPONENT, dlrm_data.ID_SPACE
    head = (2 ** (1 - s) - 1) / ((n + 1) ** (1 - s) - 1)
    assert int(values[counts.argmax()]) == int(dlrm_data.hashed_ids(torch.tensor([0]), 0))
    assert abs(int(counts.max()) / len(ids) - head) < 0.01
    assert len(values) > 0.2 * len(ids)  # and a long tail of rare values
    assert not set(ids.tolist()) & set(data.single["H2"].tolist())  # features draw from separate id streams
    # Every id has its own effect, a function of the id: the same in another split and another call.
    effects = dlrm_data.planted_effect(values, 0)
    assert torch.equal(effects, dlrm_data.planted_effect(values.clone(), 0))
    shared = values[torch.isin(values, other.single["H1"])]
    assert len(shared) > 10 and torch.equal(dlrm_data.planted_effect(shared, 0), effects[torch.isin(values, shared)])
    assert abs(float(effects.mean())) < 0.1 and abs(float(effects.std()) - 1) < 0.1
    assert not torch.equal(effects, dlrm_data.planted_effect(values, 1))


@pytest.mark.parametrize("admit_after", [1, 2])
def test_memory_accounting_counts_every_tensor_of_a_dynamic_table(admit_after):
    dim = 16
    capacity = dlrm_model.capacity_for_budget(300_000, dim, ranks=1, admit_after=admit_after)
    planned = dlrm_model.dynamic_bytes_per_rank(capacity, dim, 1, admit_after=admit_after)
    assert planned <= 300_000 < dlrm_model.dynamic_bytes_per_rank(capacity + 1, dim, 1, admit_after=admit_after)
    table = ls.DynamicEmbedding(capacity, dim, admit_after=admit_after).materialize()
    assert dlrm_model.table_bytes(table) == planned
    rows = dlrm_model.modulo_rows(planned, dim, ranks=2)
    modulo = -(-rows // 2) * dim * 4  # bytes of the fuller rank of SparseEmbedding(rows, dim) on 2 ranks
    assert planned - dim * 4 < modulo <= planned  # equal within one row
    # on 2 ranks, each holds half the ids: a rank's part of the table shrinks with the ranks
    assert dlrm_model.dynamic_bytes_per_rank(capacity, dim, 2) < planned


@pytest.mark.parametrize("tables", ["dynamic", "modulo"])
def test_dlrm_trains_on_hashed_ids(tables):
    torch.manual_seed(0)
    data = dlrm_data.hashed(512, features=3, seed=0, split_seed=1)
    model = dlrm_model.DLRM(tables=tables, hashed_features=3, memory_per_rank=20_000, sparse_lr=0.1, dense_lr=0.01)
    dense_optimizer, sparse_optimizer = model.configure_optimizers(), model.configure_sparse_optimizers()
    dense, features, labels = data.collate(list(range(512)))
    losses = []
    for _ in range(6):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, features), labels)
        dense_optimizer.zero_grad()
        sparse_optimizer.zero_grad()
        loss.backward()
        dense_optimizer.step()
        sparse_optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    table = model.embeddings.tables["H1"]
    if tables == "dynamic":
        assert 0 < table.slot_stats.occupancy <= table.capacity  # ids got rows of their own
    else:
        assert table.num_embeddings == model.modulo == dlrm_model.modulo_rows(model.planned_bytes, 16, 1)
    assert float(table.shard.abs().sum()) > 0


def _fit(pool, args: list[str]) -> str:
    """``python main.py fit --config config.yaml ...`` on the pool's ranks (tests/example_runs.py); what rank 0 printed."""
    return pool.run(run_script, EXAMPLE / "main.py", ["fit", "--config", "config.yaml", "--trainer.logger", "false", *args])[0]


def test_dlrm_trains_on_two_processes_and_auroc_rises(rank_pools):
    out = _fit(rank_pools(2), ["--data.max_rows", "3000", "--data.train_samples", "60000", "--data.val_samples", "8000",
                "--data.batch_size", "1024", "--model.sparse_lr", "0.05", "--trainer.max_epochs", "2"])  # fmt: skip
    aurocs = [float(v) for v in re.findall(r"val_auroc ([0-9.]+)", out)]
    assert len(aurocs) == 2, out
    assert aurocs[0] > 0.6 and aurocs[1] > aurocs[0], out


def test_dlrm_reads_criteo_tsv_with_one_flag(rank_pools, tmp_path):
    write_tsv(tmp_path / "train.tsv", 600)
    # One process: the flag is about reading the file (test_dlrm_trains_on_two_processes... covers 2 processes).
    out = _fit(rank_pools(1), ["--data.tsv", str(tmp_path / "train.tsv"), "--data.val_samples", "100", "--data.max_rows", "500",
                "--data.batch_size", "64", "--trainer.max_epochs", "1", "--trainer.devices", "1"])  # fmt: skip
    assert "epoch 0: val_auroc" in out, out
