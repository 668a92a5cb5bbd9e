"""The docs agree with the code, the benchmark results and themselves (rules: tests/docs_consistency.py).

Each rule runs on the real pages, and on a planted mismatch that it must catch.
"""

from __future__ import annotations

import docs_consistency as docs

BENCHMARKS = (docs.ROOT / "docs" / "benchmarks.md").read_text()
README = (docs.ROOT / "README.md").read_text()


def test_every_figure_in_the_readme_the_guide_and_the_benchmarks_prose_is_a_measured_one():
    assert docs.figure_problems(docs.figure_pages(), BENCHMARKS) == []


def test_a_figure_that_was_not_measured_is_caught():
    planted = {"README.md": "Two ranks: 1.3-1.7x faster than DGL.\n", "docs/guide/half.md": "bf16 costs 2.28x.\n"}
    problems = docs.figure_problems(planted, BENCHMARKS)
    assert len(problems) == 1 and "README.md:1" in problems[0] and "1.3-1.7x" in problems[0]  # 2.28x was measured


def test_a_time_or_size_that_was_not_measured_is_caught():
    """Issue 44's mismatches are caught; quotes of the results (rounded, in any unit), marks, code and rates are not."""
    planted = {
        "docs/guide/dynamic.md": "The peak goes from 415-417 to 444-458 MiB.\n",
        "docs/guide/gpu.md": "The step took 2.38 ms eager\nand torch's 1.52 ms.\n",
        "docs/benchmarks.md": (
            "**Two hosts over slow, lossy links**: 5 ms per packet turns a 5.6 ms step into 60 ms.\n\n"
            "**Two hosts over slow, lossy links**: 5 ms per packet turns a 10.4 ms step into 66.2 ms.\n\n"
            "Rounded and converted: 1.76 ms, 1,760 us, 71 GiB; code `PART_BYTES = 3 MiB`; a rate, 450 GB/s.\n\n"
            "Bands of 4 MiB <!-- not a result: 4 MiB -->, 14 and 22 MiB <!-- not a result: 14 and 22 MiB -->.\n\n"
            "A stale mark <!-- not a result: 8 MiB -->.\n"
        ),
    }
    problems = docs.figure_problems(planted, BENCHMARKS)
    assert sorted(problems) == sorted(
        [
            "docs/guide/dynamic.md:1 (results: Dynamic tables): '415-417 to 444-458 MiB' is not a figure of the benchmark results",
            "docs/guide/gpu.md:1 (results: One GPU): '2.38 ms' is not a figure of the benchmark results",
            "docs/guide/gpu.md:1 (results: One GPU): '1.52 ms' is not a figure of the benchmark results",  # across a line break
            "docs/benchmarks.md:1 (results: Two hosts over slow, lossy links): '5.6 ms' is not a figure of the benchmark results",
            "docs/benchmarks.md:1 (results: Two hosts over slow, lossy links): '60 ms' is not a figure of the benchmark results",
            "docs/benchmarks.md:9: marks '8 MiB' as not a result, but the paragraph does not hold it",
        ]
    ), problems


def test_the_gpu_status_is_said_in_one_place():
    assert docs.status_problems(docs.all_pages()) == []
    assert docs.STATUS.search(README), "the README's status table is marked"
    for page in ("docs/index.md", "docs/guide/quickstart.md", "docs/guide/launching.md", "docs/benchmarks.md"):
        assert "status" in docs.COPIES[page], f"{page} shows a copy of the status table"


def test_each_page_reads_whole_with_the_readme_blocks_it_shows_as_the_readme_has_them():
    assert docs.copy_problems(docs.all_pages(), README) == []


def test_a_copy_that_drifted_a_missing_copy_or_an_include_line_is_caught_and_the_writer_mends_copies():
    pages = docs.all_pages()
    drifted = {
        "docs/index.md": pages["docs/index.md"].replace(
            "| several GPUs (NCCL) | **not yet run** |", "| several GPUs (NCCL) | ran |"
        ),
        "docs/guide/launching.md": docs.COPY.sub("", pages["docs/guide/launching.md"]),
        "docs/guide/fabric.md": pages["docs/guide/fabric.md"] + '\n--8<-- "README.md:status"\n',
    }
    assert drifted["docs/index.md"] != pages["docs/index.md"]
    assert sorted(problem.split(":")[0] for problem in docs.copy_problems(drifted, README)) == [
        "docs/guide/fabric.md",
        "docs/guide/launching.md",
        "docs/index.md",
    ]
    assert docs.copy_blocks(drifted, README)["docs/index.md"] == pages["docs/index.md"]


def test_a_second_gpu_status_is_caught():
    planted = {
        "README.md": "The CUDA tests are parametrized by device: all of them passed on one H100.\n",
        "docs/benchmarks.md": "Every CUDA-parametrized test passes.\n",
        "docs/guide/launching.md": "The Triton kernels have not yet run on a GPU.\n",
        "docs/guide/gpu.md": "Each pass over the rows on a GPU reads them once.\n",  # not a status claim
    }
    found = {problem.split(":")[0] for problem in docs.status_problems(planted)}
    assert found == {"README.md", "docs/benchmarks.md", "docs/guide/launching.md"}


def test_launches_on_several_gpus_carry_the_nccl_caveat_of_the_status_table():
    assert docs.launch_problems(docs.all_pages(), (docs.ROOT / "README.md").read_text()) == []


def test_a_launch_without_the_caveat_or_a_stale_caveat_is_caught():
    readme = (docs.ROOT / "README.md").read_text()
    planted = {
        "docs/guide/a.md": '```python\npl.Trainer(accelerator="gpu", devices=8)  # fast\n```\n',
        "docs/guide/b.md": "Run `Trainer(num_nodes=2, devices=4)` on\ntwo machines (NCCL: not yet run).\n",
        "docs/guide/c.md": '```python\npl.Trainer(accelerator="cpu", devices=8)\n```\n',  # gloo: no caveat needed
    }
    assert [p.split(":")[0] for p in docs.launch_problems(planted, readme)] == ["docs/guide/a.md"]
    ran = docs.NCCL_ROW.sub("| several GPUs (NCCL) | run on 8 H100s |", readme)
    assert [p.split(":")[0] for p in docs.launch_problems(planted, ran)] == ["docs/guide/b.md"]


def test_every_name_the_docs_mention_exists():
    assert docs.name_problems(docs.all_pages()) == []


def test_a_name_that_moved_is_caught():
    planted = {
        "docs/design.md": "`lookup._Lookup` is gone; `outputs._Expand` is here.\n",
        "docs/api.md": "::: lightning_sparse.checkpoint.load\n",
        "docs/guide/x.md": "`ls.SparseEmbedding` and `ls.SparseEmbedingCollection`; see `lightning_sparse/strategy.py`.\n",
    }
    problems = "\n".join(docs.name_problems(planted))
    assert "_Lookup" in problems and "_Expand" not in problems
    assert "lightning_sparse.checkpoint.load does not exist" in problems
    assert "ls.SparseEmbedingCollection" in problems and "ls.SparseEmbedding does" not in problems
    assert "lightning_sparse/strategy.py is not in the repository" in problems


def test_cross_references_are_links():
    assert docs.see_problems(docs.all_pages()) == []
    planted = {"docs/guide/lightning.md": 'for bf16 tables see "Half-precision tables".\nsee ["X"](x.md)\n'}
    assert len(docs.see_problems(planted)) == 1
