"""The Triton kernels against their plain torch references: on CPU through Triton's interpreter, on a GPU compiled.

Each kernel is one contract with two implementations (lightning_sparse/kernels/backend.py). These
tests call the Triton side directly and compare it with the reference the CPU path uses, at the
tolerances of the parity tests; sizes are small (the interpreter runs a program at a time) but
hold runs longer than the hot threshold, so both reduction kernels run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import lightning_sparse as ls
from lightning_sparse.kernels import RuleState, Runs, StochasticRounding, UpdateRule, backend, segment_sum, sort_runs, update_rows
from lightning_sparse.kernels import rows as kernel_rows
from lightning_sparse.kernels import runs as kernel_runs
from lightning_sparse.kernels.rounding import noise_salt, rounding_noise, stochastic_round
from lightning_sparse.kernels.runs import TableSet, hot_tile, table_entries
from lightning_sparse.optim import functional as F

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not (INTERPRETING and backend.triton_available()), reason="needs triton's interpreter")
    ),  # fmt: skip
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            INTERPRETING or not torch.cuda.is_available() or not backend.triton_available(), reason="needs CUDA and triton"
        ),
    ),  # fmt: skip
]

# Tolerances across devices, each named once (issue 42). The GPU path against the torch path (a GPU's run against a
# CPU's, a kernel against its torch reference): a kernel rounds as torch does op for op (div_rn, sqrt_rn, no fused
# multiply-add), but a GPU sums in another order and its math library is not the CPU's: on an H100, distinct ids
# differed by up to 1 float32 ulp a step (row-wise Adagrad in 28 of 200 rows, Adam in 61 of 200), which a few steps
# compound. Triton's interpreter agrees more closely; the one bound serves both.
GPU_PATH_TOLERANCE = dict(rtol=1e-5, atol=1e-6)
# A capturable step's scalars computed on the device against the same step's from the host (a GPU's float64 pow may
# differ from the CPU's by an ulp); on a CPU the two are the same ops: exact.
DEVICE_SCALARS_TOLERANCE = dict(rtol=1e-6, atol=1e-7)
# Adam's bias correction 1 - beta**t in a kernel against torch's float32 pow on the CPU: one ulp of the power (near 1).
ONE_ULP_OF_ONE = dict(rtol=0, atol=1.2e-7)


# The fused update's implementations: Triton's (on CPU through its interpreter, or on a GPU), and numba's on CPU tensors.
UPDATE_DEVICES = [*KERNEL_DEVICES, pytest.param("numba", marks=pytest.mark.skipif(not backend.numba_available(),
                                                                                  reason="needs numba"))]  # fmt: skip


@pytest.fixture
def triton_kernels(monkeypatch):
    monkeypatch.setenv(backend.ENV, "triton")


def _update_kernels(monkeypatch, device: str) -> str:
    """The device of an UPDATE_DEVICES case, its kernels chosen: ``"numba"`` is numba's on CPU tensors."""
    monkeypatch.setenv(backend.ENV, "numba" if device == "numba" else "triton")
    return "cpu" if device == "numba" else device


def _skewed_keys(n: int, rows: int, seed: int) -> torch.Tensor:
    """Ids as N * u**4: row 0 occurs far more often than the hot threshold, most rows once or twice."""
    gen = torch.Generator().manual_seed(seed)
    return (rows * torch.rand(n, generator=gen) ** 4).long()


def _distinct(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference's view: distinct rows, their summed values (sequential order), their counts."""
    rows, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(rows), values.shape[1], dtype=values.dtype).index_add_(0, inverse, values)
    return rows, sums, counts


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("weighted", [False, True])
def test_segment_sum_matches_a_sequential_sum(triton_kernels, device, weighted):
    keys = _skewed_keys(2000, 60, seed=1)
    values = torch.randn(2000, 5, generator=torch.Generator().manual_seed(2))
    runs = sort_runs(keys.to(device), bound=60)
    assert runs.keys.dtype == torch.int32  # keys below 2**31 sort as int32
    assert int(torch.bincount(keys).max()) > hot_tile(5)[0], "the hottest run must span several of runs_hot's tiles"
    weights = torch.rand(2000, generator=torch.Generator().manual_seed(3)) if weighted else None
    sorted_weights = weights.index_select(0, runs.perm.cpu()) if weighted else None
    out = segment_sum(runs, values.to(device), 62, shift=1, weights=sorted_weights.to(device) if weighted else None)
    expected = torch.zeros(62, 5).index_add_(0, keys + 1, values * (weights.unsqueeze(1) if weighted else 1))
    assert int((torch.bincount(keys) > 32).sum()) >= 1, "the case must hold a run longer than the hot threshold"
    torch.testing.assert_close(out.cpu(), expected, **GPU_PATH_TOLERANCE)


def _case(name: str, dim: int):
    """(the kernel's rule, on state tensors of its own; the reference update, on copies of that state).

    The reference takes ``lr`` (default: the rule's), as a table of a TableSet has its own.
    """
    m, v, row_sum = torch.full((40, dim), 0.01), torch.full((40, dim), 0.02), torch.full((40,), 0.1)
    steps = torch.full((40,), 3, dtype=torch.int64)
    if name == "sgd":
        return UpdateRule("sgd", 0.3), lambda t, r, g, lr=0.3: F.sgd_(t, r, g, lr=lr, weight_decay=0.0)
    if name == "sgd_decay":
        return UpdateRule("sgd", 0.3, weight_decay=0.1), lambda t, r, g, lr=0.3: F.sgd_(t, r, g, lr=lr, weight_decay=0.1)
    if name == "adagrad":
        rule = UpdateRule("adagrad", 0.2, state=RuleState(first=v), eps=1e-10, weight_decay=0.05)
        v = v.clone()
        return rule, lambda t, r, g, lr=0.2: F.adagrad_(t, v, r, g, clr=lr, weight_decay=0.05, eps=1e-10)
    if name == "rowwise_adagrad":
        rule = UpdateRule("rowwise_adagrad", 0.2, state=RuleState(per_row=row_sum), eps=1e-10)
        row_sum = row_sum.clone()
        return rule, lambda t, r, g, lr=0.2: F.rowwise_adagrad_(t, row_sum, r, g, lr=lr, weight_decay=0.0, eps=1e-10)
    adam = dict(eps=1e-8, weight_decay=0.1)
    if name == "adam_row":
        rule = UpdateRule(
            "adam", 0.01, state=RuleState(m, v, steps), eps=1e-8, betas=(0.9, 0.999), row_bias=True, weight_decay=0.1
        )
        m, v, steps = m.clone(), v.clone(), steps.clone()
        return rule, lambda t, r, g, lr=0.01: F.adam_(t, m, v, r, g, step=steps.index_select(0, r).add_(1), beta1=0.9,
                                                      beta2=0.999, decoupled_weight_decay=False, lr=lr, **adam)  # fmt: skip
    assert name == "adamw_global"
    rule = UpdateRule("adam", 0.01, state=RuleState(m, v), eps=1e-8, betas=(0.8, 0.99), weight_decay=0.1,
                      decoupled_weight_decay=True, step_size=F.adam_step_size(0.01, 0.8, 0.99, 4))  # fmt: skip
    m, v = m.clone(), v.clone()
    return rule, lambda t, r, g, lr=0.01: F.adam_(t, m, v, r, g, step=4, beta1=0.8, beta2=0.99, decoupled_weight_decay=True,
                                                  lr=lr, **adam)  # fmt: skip


@pytest.mark.parametrize("device", UPDATE_DEVICES)
@pytest.mark.parametrize("case", ["sgd", "sgd_decay", "adagrad", "rowwise_adagrad", "adam_row", "adamw_global"])
@pytest.mark.parametrize("scaling", ["sum", "mean", "divided"])
def test_fused_update_matches_the_sum_then_the_functional_update(monkeypatch, device, case, scaling):
    device = _update_kernels(monkeypatch, device)
    dim = 6
    keys = _skewed_keys(300, 40, seed=4)
    values = torch.randn(300, dim, generator=torch.Generator().manual_seed(5))
    counts = torch.randint(1, 4, (300,), generator=torch.Generator().manual_seed(6)).float()
    table = torch.randn(40, dim, generator=torch.Generator().manual_seed(7))
    rule, reference = _case(case, dim)
    on_device = UpdateRule(
        **{**rule.__dict__, "state": RuleState(*(s.to(device) if s is not None else None for s in rule.state))}
    )
    fused = table.to(device, copy=True)
    update_rows(sort_runs(keys.to(device), 40), values.to(device), fused, on_device,
                counts=counts.to(device) if scaling == "mean" else None, mean=scaling == "mean",
                divisor=3.0 if scaling == "divided" else 1.0)  # fmt: skip
    rows, sums, _ = _distinct(keys, values)
    if scaling == "mean":
        sums = sums / torch.zeros(len(rows)).index_add_(0, torch.unique(keys, return_inverse=True)[1], counts).unsqueeze(1)
    elif scaling == "divided":
        sums = sums / 3
    expected = table.clone()
    reference(expected, rows, sums)
    torch.testing.assert_close(fused.cpu(), expected, **GPU_PATH_TOLERANCE)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", ["adagrad", "rowwise_adagrad", "adam_row"])
def test_one_launch_updates_many_tables_as_each_table_alone(triton_kernels, device, case):
    """A TableSet: keys ``table << shift | row`` over 3 tables, each with its own learning rate; weighted values."""
    sizes, dim, shift = (40, 13, 29), 6, 6
    gen = torch.Generator().manual_seed(11)
    tables = [torch.randn(n, dim, generator=gen) for n in sizes]
    table_ids = torch.randint(0, 3, (250,), generator=gen)
    rows = (torch.rand(250, generator=gen) ** 3 * torch.tensor(sizes)[table_ids]).long()
    values, weights = torch.randn(250, dim, generator=gen), torch.rand(250, generator=gen)
    rules, references = zip(*(_case(case, dim) for _ in sizes))  # per table: its own state tensors
    fused = [t.to(device, copy=True) for t in tables]
    states = [
        RuleState(*(x[:n].to(device, copy=True) if x is not None else None for x in rule.state)) for rule, n in zip(rules, sizes)
    ]
    counters = [torch.zeros((), dtype=torch.int64, device=device) for _ in sizes]
    lrs = (0.2, 0.05, 0.1)
    entries = table_entries(fused, states, counters, [(lr, 0.0, 1.0) for lr in lrs])
    runs = sort_runs((table_ids << shift | rows).to(device), 3 << shift)
    order = runs.perm.cpu()
    update_rows(Runs(runs.keys, runs.perm), values.to(device), TableSet(entries, shift, fused[0], states[0], counters[0]),
                rules[0], weights=weights.index_select(0, order).to(device))  # fmt: skip
    for t, (table, reference, lr) in enumerate(zip(tables, references, lrs)):
        mine = table_ids == t
        distinct, sums, _ = _distinct(rows[mine], values[mine] * weights[mine].unsqueeze(1))
        expected = table.clone()
        reference(expected, distinct, sums, lr=lr)
        torch.testing.assert_close(fused[t].cpu(), expected, msg=f"table {t}", **GPU_PATH_TOLERANCE)
        assert int(counters[t]) == len(distinct)


@pytest.mark.parametrize("device", UPDATE_DEVICES)
def test_fused_update_of_distinct_rows_needs_no_sort(monkeypatch, device):
    device = _update_kernels(monkeypatch, device)
    rows = torch.tensor([5, 2, 9, 0])
    grad = torch.randn(4, 3)
    table = torch.randn(10, 3)
    fused = table.to(device, copy=True)
    update_rows(Runs(rows.to(device)), grad.to(device), fused, UpdateRule("sgd", 0.5))
    expected = table.clone()
    F.sgd_(expected, rows, grad.clone(), lr=0.5, weight_decay=0.0)
    torch.testing.assert_close(fused.cpu(), expected, rtol=0, atol=0)


@pytest.mark.skipif(not backend.numba_available(), reason="needs numba")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_cpu_kernel_skips_placeholder_runs_weighs_counts_and_keeps_float64(monkeypatch, dtype):
    """numba's update: weighted values, runs of placeholders only (counts 0: row and state untouched), the distinct-key
    counter, a float64 table summed and stepped in float64; a verdict that shows a bad id updates and counts nothing."""
    monkeypatch.setenv(backend.ENV, "numba")
    gen = torch.Generator().manual_seed(12)
    keys = _skewed_keys(300, 40, seed=13)
    values, weights = torch.randn(300, 5, generator=gen, dtype=dtype), torch.rand(300, generator=gen, dtype=dtype)
    present = (keys % 3 != 0).to(dtype)  # rows 0, 3, 6, ... have placeholders only
    table, state = torch.randn(40, 5, generator=gen, dtype=dtype), torch.full((40, 5), 0.1, dtype=dtype)
    fused, fused_state, counter = table.clone(), state.clone(), torch.zeros((), dtype=torch.int64)
    runs = sort_runs(keys, 40)
    rule = UpdateRule("adagrad", 0.2, state=RuleState(first=fused_state), eps=1e-10, weight_decay=0.05)
    update_rows(runs, values, fused, rule, counts=present, weights=weights.index_select(0, runs.perm), unique=counter)
    rows, sums, _ = _distinct(keys, values * weights.unsqueeze(1))
    kept = rows % 3 != 0
    expected, expected_state = table.clone(), state.clone()
    F.adagrad_(expected, expected_state, rows[kept], sums[kept], clr=0.2, weight_decay=0.05, eps=1e-10)
    tolerance = GPU_PATH_TOLERANCE if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(fused, expected, **tolerance)
    torch.testing.assert_close(fused_state, expected_state, **tolerance)
    assert torch.equal(fused[rows[~kept]], table[rows[~kept]]) and len(rows[~kept]) > 0
    assert int(counter) == len(rows)  # every run counts, placeholders' too (as the Triton kernel counts)
    before = fused.clone()
    update_rows(runs, values, fused, rule, verdict=torch.tensor([0, 40]), unique=counter)  # id 40 of a 40-row table
    assert torch.equal(fused, before) and int(counter) == len(rows)


@pytest.mark.skipif(not backend.numba_available(), reason="needs numba")
def test_the_cpu_kernel_runs_from_two_threads_at_once(monkeypatch):
    """Two Python threads step their own tables through numba's parallel kernel at the same time, with 2 threads each
    (numba's workqueue layer aborts the process on overlapping launches): each ends as when it ran alone."""
    import threading

    monkeypatch.setenv(backend.ENV, "numba")

    def train(seed: int, out: dict) -> None:
        emb = ls.SparseEmbedding(500, 16, seed=seed)
        opt = ls.SparseAdam([emb], lr=0.01)
        gen = torch.Generator().manual_seed(seed)
        for _ in range(30):
            emb(_skewed_keys(4000, 500, seed=int(torch.randint(0, 1000, (), generator=gen)))).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        out[seed] = emb.full_weight()

    threads_before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        alone, together = {}, {}
        for seed in (1, 2):
            train(seed, alone)
        workers = [threading.Thread(target=train, args=(seed, together)) for seed in (1, 2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        torch.set_num_threads(threads_before)
    for seed in (1, 2):
        assert torch.equal(together[seed], alone[seed]), f"table {seed}"


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_bf16_rows_round_with_the_same_draws_as_the_reference(triton_kernels, device):
    """SGD's arithmetic is exact in both, so the rounded rows must agree bit for bit: the hash is the same."""
    keys = _skewed_keys(200, 30, seed=8)
    values = torch.randn(200, 7, generator=torch.Generator().manual_seed(9)) * 1e-3
    table = torch.randn(30, 7, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    seed, step, world, rank = 11, 5, 3, 2  # a "mod" table's rank 2 of 3: global row = local * 3 + 2
    fused = table.to(device, copy=True)
    update_rows(sort_runs(keys.to(device), 30), values.to(device), fused, UpdateRule("sgd", 0.1),
                rounding=StochasticRounding(noise_salt(seed, step), world, rank))  # fmt: skip
    rows, sums, _ = _distinct(keys, values)
    new = table.index_select(0, rows).float().add_(sums.mul(-0.1))
    noise = rounding_noise(rows * world + rank, 7, seed, step)
    expected = table.clone().index_copy_(0, rows, stochastic_round(new, torch.bfloat16, noise))
    assert not torch.equal(expected, table.clone().index_copy_(0, rows, new.to(torch.bfloat16))), "rounding must matter"
    torch.testing.assert_close(fused.cpu(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("shape, dtype, expanded", [((6,), torch.float32, False), ((6,), torch.float32, True),
                                                    ((), torch.int64, True), ((2, 3), torch.bfloat16, False)])  # fmt: skip
def test_put_writes_rows_as_index_copy_and_skips_the_padding(triton_kernels, device, shape, dtype, expanded):
    """A dynamic table's new rows and their fresh optimizer state: one kernel, and the filler row 0 is never written."""
    rows = torch.tensor([5, 0, 2, 0, 0, 7, 1, 0])  # 0: padding
    src = (torch.arange(len(rows) * max(1, torch.Size(shape).numel())).view(len(rows), *shape) + 1).to(dtype)
    if expanded:  # one fresh row for all (optimizer.reset_rows)
        src = src[:1].expand(len(rows), *shape)
    dst = torch.full((9, *shape), -1).to(dtype)
    expected = dst.clone().index_copy_(0, rows, src)
    expected[0] = -1  # never written
    before = backend.launches.count
    out = dst.to(device)
    kernel_rows.put(out, rows.to(device), src.to(device), skip=0)
    assert backend.launches.count == before + 1 and torch.equal(out.cpu(), expected)


@pytest.mark.parametrize(
    "dtype, dim, layout, as_words",
    [(torch.float32, 64, "contiguous", True), (torch.bfloat16, 8, "contiguous", True), (torch.float64, 6, "contiguous", True),
     (torch.float32, 7, "contiguous", False), (torch.float32, 8, "column slice", False), (torch.float32, 4, "offset by half a row", False),
     (torch.int64, 2, "contiguous", True)],
)  # fmt: skip
def test_copy_rows_is_index_copy_bit_for_bit(dtype, dim, layout, as_words):
    """The update's row writes move 16-byte words where a row allows it, and are index_copy_'s bytes everywhere."""
    gen = torch.Generator().manual_seed(dim)
    base = (torch.randn(41, dim + 4, generator=gen) * 1e3).to(dtype)
    dst = {
        "contiguous": base[:40, :dim],
        "column slice": base[:40, 1 : dim + 1],
        "offset by half a row": base.view(-1)[dim // 2 : dim // 2 + 40 * dim].view(40, dim),
    }[layout]
    dst = dst.contiguous() if layout == "contiguous" else dst
    rows = torch.tensor([3, 17, 0, 39, 8])
    src = (torch.randn(len(rows), dim, generator=gen) * 1e3).to(dtype)
    if dtype.is_floating_point:
        src[0, 0] = float("nan")  # a NaN's payload, and -0.0, survive as bytes
        src[1, 0] = -0.0
    expected = dst.clone().index_copy_(0, rows, src)
    assert kernel_rows._as_words(dst) is as_words
    kernel_rows.copy_rows(dst, rows, src)
    assert torch.equal(
        dst.view(torch.uint8) if dst.is_contiguous() else dst.contiguous().view(torch.uint8),
        expected.contiguous().view(torch.uint8),
    )


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dim, std, mean, seed", [(64, None, 0.0, 0), (7, 0.1, 0.5, 3), (1, None, 0.0, 2**40 + 5)])
def test_new_normal_rows_are_the_torch_versions_bit_for_bit(device, dim, std, mean, seed):
    """One kernel draws the rows of ``init.normal`` (a dynamic table's new ids, on its step) as the torch ops do."""
    from lightning_sparse.tables import init

    ids = torch.cat([torch.randint(-(2**62), 2**62, (500,), generator=torch.Generator().manual_seed(seed)), torch.arange(40)])
    expected = init._normal(ids, dim, seed, std=std, mean=mean)  # the CPU path's torch ops
    out = kernel_rows.normal(ids.to(device), dim, seed, std if std is not None else dim**-0.5, mean)
    assert out.dtype == torch.float32 and torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(
    "init", [ls.init.normal(), ls.init.normal(0.1, mean=0.5), ls.init.uniform(-0.2, 0.3)], ids=["normal", "shifted", "uniform"]
)
def test_an_initializer_gives_the_gpu_path_the_cpu_paths_rows(monkeypatch, device, init):
    """``init(ids, dim, seed)`` as a dynamic table's step calls it: the same rows whichever path computes them."""
    ids = torch.tensor([0, 7, 2**40 + 3, -5, 7])
    monkeypatch.setenv(backend.ENV, "torch")
    expected = init(ids, 7, 3)
    monkeypatch.setenv(backend.ENV, "triton")
    got = init(ids.to(device), 7, 3)
    assert got.dtype == torch.float32 and torch.equal(got.cpu(), expected)


@pytest.mark.skipif(not backend.numba_available(), reason="needs numba")
@pytest.mark.parametrize("columns, blocks, seed", [(32, 2, 0), (7, 1, 3), (1, 2, 2**40 + 5), (3, 1, -5)])
def test_the_cpu_loop_hashes_rows_as_the_torch_ops(monkeypatch, columns, blocks, seed):
    """numba's loop (a dynamic table's new rows and the rounding draws, on a CPU) gives the torch ops' bits and uniforms."""
    ids = torch.cat([torch.randint(-(2**62), 2**62, (500,), generator=torch.Generator().manual_seed(1)),
                     torch.tensor([0, -1, 2**63 - 1, -(2**63)])])  # fmt: skip
    looped = [kernel_rows.hashes(ids, columns, seed, blocks), kernel_rows.uniforms(ids, columns, seed, blocks)]
    monkeypatch.setenv(backend.ENV, "torch")
    for got, expected in zip(
        looped, [kernel_rows.hashes(ids, columns, seed, blocks), kernel_rows.uniforms(ids, columns, seed, blocks)]
    ):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert looped[0].dtype == torch.int32 and looped[1].dtype == torch.float64


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_the_bags_kernel_pools_as_its_torch_reference(triton_kernels, device):
    """Jagged bags by mean (one empty) and by weighted sum, 2-D bags by mean, plain ids, over two tables: each bag's
    output, and each id's key, bag and backward scale (1 / its bag's length under mean)."""
    from lightning_sparse.kernels.bags import Feature, gather_bags, torch_gather_bags, verdict_size
    from lightning_sparse.kernels.host import KeptValues

    gen = torch.Generator().manual_seed(13)
    shards = [torch.randn(9, 5, generator=gen), torch.randn(6, 5, generator=gen)]
    ids = [torch.tensor([3, 8, 1, 1, 0, 5]), torch.tensor([5, 0, 2]), torch.tensor([1, 4, 4, 0, 2, 5]), torch.tensor([4, 4, 7])]
    offsets = [torch.tensor([0, 2, 2, 6]), torch.tensor([0, 1, 3]), None, None]
    shapes = [(0, 3, 0, True), (0, 2, 1, False), (3, 2, 1, True), (1, 3, 0, False)]  # per bag, bags, table, mean
    weights = [None, torch.rand(3, generator=gen), None, None]

    def features(on: str) -> list[Feature]:
        return [Feature(i.to(on), o.to(on) if o is not None else None, w.to(on) if w is not None else None, per_bag, bags,
                        table, len(shards[table]), mean, report_as)
                for report_as, (i, o, w, (per_bag, bags, table, mean)) in enumerate(zip(ids, offsets, weights, shapes))]  # fmt: skip

    on_device = [s.to(device) for s in shards]
    entries = table_entries(on_device, [RuleState(), RuleState()], [None, None], [(0.0, 0.0, 1.0)] * 2)
    verdict = torch.zeros(verdict_size(4), dtype=torch.int64, device=device)
    out, keys, sources, scales = gather_bags(features(device), entries, on_device[0], torch.float32, 4, verdict, True,
                                             KeptValues())  # fmt: skip
    expected, expected_keys, expected_sources, expected_scales = torch_gather_bags(features("cpu"), shards, 4, True)
    torch.testing.assert_close(out.cpu(), torch.cat(expected), **GPU_PATH_TOLERANCE)
    assert torch.equal(keys.cpu(), expected_keys) and torch.equal(sources.cpu().long(), expected_sources)
    torch.testing.assert_close(scales.cpu(), expected_scales, rtol=0, atol=0)
    assert not verdict.any()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_gather_reads_clamped_rows_and_widens_the_verdict(device, ids_dtype):
    table = torch.randn(20, 5)
    ids = torch.tensor([3, 19, 0, 3, 7], dtype=ids_dtype)
    verdict = torch.zeros(2, dtype=torch.int64)
    out, keys = kernel_rows.gather(table.to(device), ids.to(device), torch.float64, verdict.to(device), keys=True)
    expected, expected_keys = kernel_rows.reference_gather(table, ids, torch.float64, verdict)
    assert keys.dtype == torch.int32 and torch.equal(keys.cpu(), expected_keys)
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)
    bad = torch.tensor([4, -2, 25, 21], dtype=ids_dtype)
    device_verdict = torch.zeros(2, dtype=torch.int64, device=device)
    out, _ = kernel_rows.gather(table.to(device), bad.to(device), torch.float32, device_verdict, keys=False)
    assert device_verdict.tolist() == [-2, 25]
    torch.testing.assert_close(out.cpu(), table[[4, 0, 19, 19]], rtol=0, atol=0)  # clamped for the read


if backend.triton_available():
    import triton
    import triton.language as tl

    from lightning_sparse.kernels.triton_update import _one_minus_power

    @triton.jit
    def _bias_probe(steps, out, log2_beta, n, BLOCK: tl.constexpr):
        """``out = 1 - beta**steps`` as the Adam kernel computes it."""
        at = tl.arange(0, BLOCK)
        t = tl.load(steps + at, mask=at < n, other=1).to(tl.float32)
        tl.store(out + at, _one_minus_power(t, log2_beta), mask=at < n)


@pytest.mark.skipif(not backend.triton_available(), reason="needs triton")
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_adam_bias_correction_is_the_cpu_paths_near_one(device):
    """``1 - beta**t`` as torch computes it in float32, to one ulp of the power: a GPU's fast exp2 missed by four."""
    steps = torch.tensor([1, 2, 3, 10, 100, 693, 1000, 10_000, 10**6], dtype=torch.int64)
    for beta in (0.9, 0.999, 0.99999, 0.0):
        out = torch.empty(len(steps), dtype=torch.float32, device=device)
        _bias_probe[(1,)](steps.to(device), out, kernel_runs._log2_float32(beta), len(steps), BLOCK=16)
        expected = 1 - torch.pow(torch.tensor(beta, dtype=torch.float32), steps.float())  # the CPU path's (optim/functional.py)
        torch.testing.assert_close(out.cpu(), expected, msg=f"beta={beta}", **ONE_ULP_OF_ONE)


def test_the_update_reads_everything_before_one_barrier_and_writes_after_it():
    """A row's state is held by several warps: a write before another warp's read steps the row twice (seen on an H100).

    The interpreter runs a program as one and cannot show that race, so this holds the source to the rule instead.
    """
    import ast
    import inspect

    from lightning_sparse.kernels import triton_update

    tree = ast.parse(inspect.getsource(triton_update.apply_rows.fn))
    calls = {"load": [], "debug_barrier": [], "store": []}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in calls:
            calls[node.func.attr].append(node.lineno)
    assert len(calls["debug_barrier"]) == 1 and calls["load"] and calls["store"]
    assert max(calls["load"]) < calls["debug_barrier"][0] < min(calls["store"]), calls


def test_the_new_row_kernels_float_literals_are_exact_in_float32():
    """A float literal is float32 in a compiled kernel (the interpreter keeps float64 and cannot show it): the new rows'
    float64 arithmetic must not meet a literal that float32 rounds, or the GPU's rows would differ from the CPU's."""
    import ast
    import inspect

    from lightning_sparse.kernels import triton_rows

    for kernel in (triton_rows.normal_rows, triton_rows._uniform):
        tree = ast.parse(inspect.getsource(kernel.fn))
        floats = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, float)]
        assert all(float(torch.tensor(v, dtype=torch.float32)) == v for v in floats), (kernel.fn.__name__, floats)


# ---------------------------------------------------------------- compiled for an H100, without one
# The kernels compile for sm_90 with two Tritons: the suite's, and the GPU machine's (3.6, what torch 2.11 ships), which
# `make setup` installs apart from the venv's packages (pip --target), for this check alone.
GPU_MACHINE_TRITON = Path(sys.prefix) / "triton-3.6"


@pytest.fixture(scope="module", params=["installed", "3.6"])
def h100_builds(request):
    """(Triton version, every kernel the package launches compiled for sm_90: tests/scripts/compile_for_h100.py).

    In a process of its own: Triton compiles nothing where it was imported to interpret.
    """
    import json
    import subprocess

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if request.param == "3.6":
        import triton

        if triton.__version__.startswith("3.6."):
            pytest.skip("the installed Triton is 3.6 (the GPU machine's)")
        if not (GPU_MACHINE_TRITON / "triton").is_dir():
            pytest.skip(f"no Triton 3.6 at {GPU_MACHINE_TRITON}. HINT: `make setup` installs it")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(GPU_MACHINE_TRITON), env.get("PYTHONPATH")]))
    script = Path(__file__).parent / "scripts" / "compile_for_h100.py"
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    version, builds = run.stdout.split("\n", 1)
    assert request.param == "installed" or version.startswith("3.6."), version
    return version, json.loads(builds)


@pytest.mark.subprocesses
@pytest.mark.skipif(not backend.triton_available(), reason="needs triton")
def test_every_kernel_compiles_for_an_h100_without_spills(h100_builds):
    """No GPU needed: the kernels compile for sm_90, with no spills and registers that leave room for occupancy."""
    version, builds = h100_builds
    # 9 cases x (cold, hot) at dim 64, 6 cold at dim 128, the two gathers, new normal rows, two puts (rows, an int64
    # per-row state), the slot map's five (find, reserve's three rounds, write) and the ids' keys (see the script)
    assert len(builds) == 35
    # ptxas spills nothing, and a stack holds only the local memory the PTX itself declares: libdevice's, whose float64
    # sin and cos reduce huge arguments in a 40-byte local array (Triton 3.6's libdevice also passes the quadrant through
    # 4 bytes: 48 bytes of stack with alignment). The new rows' angles lie in (0, 2 pi): that path never runs.
    libdevice = ["__internal_trig_reduction_slowpathd"]
    too_big = {name: build for name, build in builds.items() if build["spill_stores"] or build["spill_loads"]
               or build["registers"] > 128 or build["stack"] > -(-build["local"] // 8) * 8
               or (build["local"] and build["calls"] != libdevice)}  # fmt: skip
    assert not too_big, (version, too_big)


def test_the_package_imports_numba_at_its_first_step_not_with_the_package():
    """No module the package imports at load time (module level, followed from ``lightning_sparse``) imports numba or the
    numba kernels: they come with the first CPU step that takes them (``backend.numba_module``)."""
    import ast

    package = Path(ls.__file__).parent
    loaded, pending, numba_at_load = set(), ["lightning_sparse"], []
    while pending:
        name = pending.pop()
        if name in loaded:
            continue
        loaded.add(name)
        path = package.parent / (name.replace(".", "/") + ".py")
        path = path if path.exists() else package.parent / name.replace(".", "/") / "__init__.py"
        tree = ast.parse(path.read_text())
        top = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
        inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)}
        for node in (n for n in top if id(n) not in inside):
            targets = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_sparse"):
                targets += [f"{node.module}.{a.name}" for a in node.names]
            for target in targets:
                if target.split(".")[0] == "numba" or target.endswith("numba_runs"):
                    numba_at_load.append(f"{name} imports {target}")
                elif (
                    target.startswith("lightning_sparse")
                    and (package.parent / target.replace(".", "/")).with_suffix(".py").exists()
                ):
                    pending.append(target)
                elif (
                    target.startswith("lightning_sparse") and (package.parent / target.replace(".", "/") / "__init__.py").exists()
                ):
                    pending.append(target)
    assert "lightning_sparse.kernels.backend" in loaded and "lightning_sparse.optim.fused" in loaded
    assert not numba_at_load, numba_at_load
