"""Half-precision tables: float32 state and updates, stochastic rounding, checkpoints, output dtype."""

from __future__ import annotations

import pytest
import torch

import lightning_sparse as ls
from lightning_sparse.kernels.rounding import rounding_noise, stochastic_round

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
HALF = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased(dtype, device):
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(40, generator=gen) * 10.0 ** torch.randint(-6, 3, (40,), generator=gen),
                   torch.tensor([0.0, 1.0, -2.5, 2.0**-20])]).to(device)  # fmt: skip
    draws = 4000
    noise = torch.randint(0, 2**16, (draws, len(x)), dtype=torch.int32, generator=gen).to(device)
    rounded = stochastic_round(x.expand(draws, -1).contiguous(), dtype, noise).float()
    nearest = x.to(dtype)
    other = torch.nextafter(nearest, torch.where(x > nearest.float(), torch.inf, -torch.inf).to(dtype))
    neighbours = (rounded == nearest.float()) | (rounded == other.float())
    assert bool(neighbours.all())
    exact = x == nearest.float()
    assert bool((rounded[:, exact] == x[exact]).all())  # representable values stay as they are
    gap = (other.float() - nearest.float()).abs()
    error = (rounded.mean(0) - x).abs()
    assert bool((error <= 4 * gap / draws**0.5 + 1e-12).all()), (error / gap).max()  # unbiased, within 4 sigma


def test_rounding_draws_depend_only_on_seed_step_row_and_column():
    rows = torch.tensor([3, 70, 2**40])
    draws = rounding_noise(rows, 5, seed=1, step=7)
    assert draws.shape == (3, 5) and torch.equal(rounding_noise(rows[1:], 5, seed=1, step=7), draws[1:])  # any rank
    assert not torch.equal(rounding_noise(rows, 5, seed=1, step=8), draws)
    assert not torch.equal(rounding_noise(rows, 5, seed=2, step=7), draws)
    assert bool(((draws >= 0) & (draws < 2**16)).all())
    many = rounding_noise(torch.arange(20_000), 64, seed=0, step=1).double()
    correlations = torch.corrcoef(many.T) - torch.eye(64, dtype=torch.float64)
    assert abs(many.mean().item() / 2**16 - 0.5) < 0.002 and correlations.abs().max() < 0.04  # columns independent


def _train(dtype: torch.dtype, device: str, stochastic_rounding: bool | None = None, steps: int = 1000, lr: float = 3e-3):
    """Adagrad on a 64 x 16 table pulled toward fixed targets, 32 ids per step: (initial rows, final rows) in float32."""
    options = {} if stochastic_rounding is None else {"stochastic_rounding": stochastic_rounding}
    emb = ls.SparseEmbedding(64, 16, init=ls.init.normal(1.0), seed=0, dtype=dtype, device=device, **options)
    opt = ls.SparseAdagrad([emb], lr=lr)
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(64, 16, generator=gen).to(device)
    start = emb.full_weight().float()
    for _ in range(steps):
        ids = torch.randint(0, 64, (32,), generator=gen).to(device)
        ((emb(ids).float() - target[ids]) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    return start, emb.full_weight().float()


@pytest.mark.parametrize("device", DEVICES)
def test_a_bf16_table_tracks_fp32_where_round_to_nearest_stalls(device):
    """SparseAdagrad(lr=3e-3), 1,000 steps from N(0, 1) rows: most steps are below half a bf16 spacing (2**-8 at |x| ~ 1)."""
    start, fp32 = _train(torch.float32, device)
    bf16_start, stochastic = _train(torch.bfloat16, device)
    _, nearest = _train(torch.bfloat16, device, stochastic_rounding=False)
    moved = (fp32 - start).norm()
    relative_error = ((stochastic - fp32).norm() / fp32.norm()).item()
    assert relative_error < 0.03, relative_error  # measured: 0.020 on CPU
    assert abs((stochastic - bf16_start).norm() / moved - 1) < 0.1  # it moves as far as fp32
    assert (nearest - bf16_start).norm() < 0.5 * moved  # round-to-nearest loses most steps: measured 29%
    assert ((nearest - fp32).norm() / fp32.norm()).item() > 3 * relative_error  # measured: 0.090


def test_stochastic_rounding_is_reproducible_for_a_seed():
    assert torch.equal(_train(torch.bfloat16, "cpu", steps=20)[1], _train(torch.bfloat16, "cpu", steps=20)[1])


@pytest.mark.parametrize("dtype", HALF)
def test_half_tables_keep_float32_state_and_their_dtypes_through_state_dicts(dtype):
    emb = ls.SparseEmbedding(10, 4, dtype=dtype, output_dtype=torch.float32)
    opt = ls.SparseAdam([emb], lr=0.01)
    out = emb(torch.tensor([1, 2, 2]))
    assert out.dtype == torch.float32
    out.sum().backward()
    opt.step()
    assert emb.shard.dtype == dtype
    assert {v.dtype for v in opt.state[emb.shard].values() if v.is_floating_point()} == {torch.float32}
    again = ls.SparseEmbedding(10, 4, dtype=dtype)
    again.load_state_dict(emb.state_dict())
    assert again.shard.dtype == dtype and torch.equal(again.shard, emb.shard)
    again_opt = ls.SparseAdam([again], lr=0.01)
    again_opt.load_state_dict(opt.state_dict())  # torch would cast the state to the table's dtype
    for key, value in opt.state[emb.shard].items():
        assert again_opt.state[again.shard][key].dtype == value.dtype and torch.equal(again_opt.state[again.shard][key], value)


def test_stochastic_rounding_is_for_half_tables():
    with pytest.raises(ValueError, match="HINT"):
        ls.SparseEmbedding(4, 2, stochastic_rounding=True)
    with pytest.raises(ValueError, match="HINT"):
        ls.SparseEmbedding(4, 2, output_dtype=torch.int64)


def test_a_sharded_checkpoint_and_its_export_keep_the_dtypes(tmp_path):
    from lightning_sparse import checkpoint

    def module_and_optimizer(seed: int):
        module = torch.nn.Module()
        module.emb = ls.SparseEmbedding(50, 4, dtype=torch.bfloat16, seed=seed)
        return module, ls.SparseAdagrad([module.emb], lr=0.1)

    module, optimizer = module_and_optimizer(0)
    module.emb(torch.tensor([1, 2, 3])).float().sum().backward()
    optimizer.step()
    dense = {"optimizer_0": checkpoint.split_tensors(checkpoint.dense_optimizer_state(optimizer))[0]}
    path = checkpoint.save(tmp_path / "half.ckpt", module, {0: optimizer}, dense)
    loaded, loaded_optimizer = module_and_optimizer(9)
    checkpoint.load_module(path, loaded)
    checkpoint.load_sparse_optimizer(path, 0, loaded_optimizer, loaded_optimizer.state_dict()["param_groups"])
    assert loaded.emb.shard.dtype == torch.bfloat16 and torch.equal(loaded.emb.shard, module.emb.shard)
    state = loaded_optimizer.state[loaded.emb.shard]
    assert state["sum"].dtype == torch.float32 and torch.equal(state["sum"], optimizer.state[module.emb.shard]["sum"])
    checkpoint.export(path, tmp_path / "rows.pt")
    assert torch.load(tmp_path / "rows.pt")["emb.weight"].dtype == torch.bfloat16


def test_a_bf16_dynamic_table_returns_the_requested_dtype_and_tracks_fp32():
    """DynamicEmbedding takes the same half-precision options: bf16 rows, float32 lookups and state, rounded updates."""

    def train(dtype: torch.dtype, stochastic_rounding: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        options = {} if stochastic_rounding is None else {"stochastic_rounding": stochastic_rounding}
        table = ls.DynamicEmbedding(capacity=200, embedding_dim=8, init=ls.init.normal(1.0), dtype=dtype,
                                    output_dtype=torch.float32, **options)  # fmt: skip
        optimizer = ls.SparseAdagrad([table], lr=3e-3)
        gen = torch.Generator().manual_seed(0)
        ids = (torch.arange(64) * 7919 + 12345) ** 2  # large, hashed-looking ids
        target = torch.randn(64, 8, generator=gen)
        for _ in range(300):
            pick = torch.randint(0, 64, (32,), generator=gen)
            rows = table(ids[pick])
            assert rows.dtype == torch.float32
            ((rows - target[pick]) ** 2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        assert table.shard.dtype == dtype and optimizer.state[table.shard]["sum"].dtype == torch.float32
        held, rows = table.export()
        initial = ls.init.normal(1.0)(held, 8, 0).to(dtype).float()
        return held, rows.float() - initial  # how far each row moved

    ids, moved = train(torch.float32)
    for stochastic_rounding, (least, most) in ((None, (0.9, 1.1)), (False, (0.0, 0.6))):
        half_ids, half_moved = train(torch.bfloat16, stochastic_rounding)
        assert torch.equal(half_ids, ids) and len(ids) == 64
        ratio = (half_moved.norm() / moved.norm()).item()  # stochastic rounding: 1.03; to nearest: 0.44 (stalls)
        assert least < ratio < most, (stochastic_rounding, ratio)


def test_a_collection_returns_each_tables_output_dtype():
    """A collection's features, plain and pooled, come in their table's output_dtype, and train as the table alone does."""

    def bf16_table() -> ls.SparseEmbedding:
        return ls.SparseEmbedding(50, 4, dtype=torch.bfloat16, output_dtype=torch.float32, seed=3)

    table, alone = bf16_table(), bf16_table()
    collection = ls.SparseEmbeddingCollection(
        {"t": table, "u": ls.SparseEmbedding(20, 4)}, features={"a": "t", "bag": "t", "u": "u"}, pooling={"bag": "sum"}
    )
    ids, bags = torch.tensor([1, 7, 7, 30]), torch.tensor([[1, 7], [7, 30]])
    out = collection({"a": ids, "bag": bags, "u": torch.tensor([2])})
    assert out["a"].dtype == out["bag"].dtype == out["u"].dtype == torch.float32
    torch.testing.assert_close(out["a"], alone(ids), rtol=0, atol=0)
    torch.testing.assert_close(out["bag"], alone(bags).sum(1))
    optimizer, optimizer_alone = ls.SparseAdagrad([collection], lr=0.1), ls.SparseAdagrad([alone], lr=0.1)
    (out["a"].sum() + 2 * out["bag"].sum()).backward()
    (alone(ids).sum() + 2 * alone(bags).sum()).backward()
    optimizer.step()
    optimizer_alone.step()
    assert table.shard.dtype == torch.bfloat16 and not torch.equal(table.shard, bf16_table().shard)
    torch.testing.assert_close(table.shard, alone.shard, rtol=0, atol=0)


@pytest.mark.parametrize("scheme", ["mod", "range"])
def test_each_ranks_rounded_rows_are_those_of_its_global_rows(scheme):
    """A rank's writer draws for its rows' global ids: 3 ranks' shards write the rows one rank writes at those ids."""
    from types import SimpleNamespace

    from lightning_sparse.kernels.rounding import writer_for
    from lightning_sparse.wire.sharding import RowSharding

    values = torch.randn(10, 5, generator=torch.Generator().manual_seed(0)) * 1e-3 + 1.0  # between bf16 values

    def written(world_size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        sharding = RowSharding(10, world_size, scheme)
        ids = sharding.global_ids(rank)
        local = torch.arange(len(ids))
        shard = torch.zeros(len(local), 5, dtype=torch.bfloat16)
        table = SimpleNamespace(shard=shard, sharding=sharding, rank=rank, seed=4, stochastic_rounding=None)
        writer_for(table, step=2)(local, values[ids])
        return ids, shard

    _, whole = written(1, 0)
    assert not torch.equal(whole, values.to(torch.bfloat16)), "rounding must matter"
    for rank in range(3):
        ids, shard = written(3, rank)
        assert torch.equal(shard, whole[ids]), f"rank {rank}"
