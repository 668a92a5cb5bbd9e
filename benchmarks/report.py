"""Turn the JSON of ``benchmarks/bench.py`` into the results of ``docs/benchmarks.md``: targets, tables, plots.

The page's prose (the performance model) is written by hand; this replaces only the part
between ``<!-- results:begin -->`` and ``<!-- results:end -->`` and writes the plots beside the
page. Run with ``make bench``, or alone to re-render the last results::

    python benchmarks/report.py [benchmarks/results/bench.json] [--doc docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import gpu_report

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
FAMILIES = ("sgd", "adagrad", "rowwise_adagrad", "adam_row", "adam_global")
FAMILY_LABEL = {"sgd": "SGD", "adagrad": "Adagrad", "rowwise_adagrad": "row-wise Adagrad",
                "adam_row": "Adam (per-row bias correction)", "adam_global": "Adam (global bias correction)"}  # fmt: skip
SHORT_FAMILY = {"sgd": "SGD", "adagrad": "Adagrad", "rowwise_adagrad": "row-wise\nAdagrad", "adam_row": "Adam\n(row)",
                "adam_global": "Adam\n(global)"}  # fmt: skip
METHOD_LABEL = {
    "ours": "lightning_sparse (plain loop)",
    "sparse_ddp": 'lightning_sparse in `Trainer(strategy="sparse_ddp")`',
    "dgl": "DGL `NodeEmbedding` + `dgl.optim.SparseAdagrad`",
    "sparse_grad_ddp": "`nn.Embedding(sparse=True)` in DDP",
    "lightning_ddp": '`nn.Embedding` in `Trainer(strategy="ddp")` (dense)',
}
STYLE = {"ours": ("tab:red", "o"), "sparse_ddp": ("tab:orange", "v"), "dgl": ("tab:purple", "D"),
         "sparse_grad_ddp": ("tab:green", "^"), "lightning_ddp": ("tab:blue", "s")}  # fmt: skip


# ---------------------------------------------------------------------------- targets
def _single(doc: dict, device: str = "cpu") -> dict[tuple[str, str], dict]:
    """The first one-process section on ``device`` (with glibc's defaults, what users run): its results by (name, kind)."""
    for section in doc.get("single_process", []):
        if section["device"] == device:
            return {(r["name"], r["kind"]): r for r in section["results"]}
    return {}


def ratio(a: dict | None, b: dict | None) -> float | None:
    """``b``'s time over ``a``'s: the median over rounds of each round's ratio where both were measured in the same
    interleaved rounds (``round_ms``: a drift of the machine between rounds cancels), else the ratio of the medians."""
    if not a or not b:
        return None
    if len(a.get("round_ms") or ()) == len(b.get("round_ms") or ()) > 0:
        return statistics.median(y / x for x, y in zip(a["round_ms"], b["round_ms"]))
    key = "ms_median" if "ms_median" in a else "step_ms_median"
    return b[key] / a[key]


def targets(doc: dict) -> list[dict]:
    """Every target of the performance issue, with its measured ratio and whether it is met."""
    out: list[dict] = []

    def add(name: str, target: str, value: float | None, met: bool | None, unit: str = "x") -> None:
        measured = "not measured" if value is None else f"{value:.2f}{unit}"
        out.append(
            {
                "name": name,
                "target": target,
                "measured": measured,
                "value": value,
                "met": bool(met) if value is not None else False,
            }
        )

    s = _single(doc)
    for family in ("adam_row", "adam_global"):
        value = ratio(s.get((f"ours/{family}", "step")), s.get(("torch/adam_global", "step")))
        add(f"1 process: {FAMILY_LABEL[family]} vs torch SparseAdam, fwd+bwd+step", ">= 3x faster", value, value and value >= 3)
    value = ratio(s.get(("ours/adagrad", "step")), s.get(("torch/adagrad", "step")))
    add("1 process: Adagrad vs torch Adagrad, fwd+bwd+step", ">= 2x faster", value, value and value >= 2)
    for family in ("rowwise_adagrad", "sgd"):
        value = ratio(s.get((f"ours/{family}", "step")), s.get((f"fbgemm/{family}", "step")))
        add(
            f"1 process: {FAMILY_LABEL[family]} vs FBGEMM CPU TBE, fwd+bwd+step", "no slower (>= 1x)", value, value and value >= 1
        )
    for family in FAMILIES:
        value = ratio(s.get((f"floor/gather_scatter/{family}", "floor_gather_scatter")), s.get((f"ours/{family}", "update")))
        add(f"1 process: {FAMILY_LABEL[family]} step / gather+scatter floor", "<= 1.5x", value, value and value <= 1.5)
    value = ratio(s.get(("torch/lookup", "lookup")), s.get(("ours/lookup", "lookup")))
    add("1 process: lookup (fwd+bwd) / nn.Embedding(sparse=True)", "<= 1.5x", value, value and value <= 1.5)

    runs = [r for r in doc.get("distributed", {}).get("runs", []) if "error" not in r]
    by = {(r["method"], r["rows"], r["batch"]): r for r in runs}
    for (method, rows, batch), r in sorted(by.items(), key=lambda kv: (kv[0][2], kv[0][1])):
        if method != "ours":
            continue
        ms = r["step_ms_median"]
        for other, need in (("dgl", 1.3 if batch >= 65536 else 1.0), ("sparse_grad_ddp", 2.0 if batch >= 65536 else None)):
            if need is None or (other, rows, batch) not in by:
                continue
            value = by[(other, rows, batch)]["step_ms_median"] / ms
            label = "no slower" if need == 1.0 else f">= {need}x faster"
            add(f"2 ranks, {_rows(rows)} rows, {batch} ids/rank: vs {METHOD_LABEL[other]}", label, value, value >= need)
        if r.get("lower_bound_bytes_per_step"):
            value = r["bytes_sent_per_step"] / r["lower_bound_bytes_per_step"]
            add(f"2 ranks, {_rows(rows)} rows, {batch} ids/rank: bytes sent / lower bound", "<= 1.1x", value, value <= 1.1)
    coll = doc.get("collection", {})
    d = coll.get("distributed", {}).get("methods", {})
    if "collection" in d and "separate" in d:
        value = ratio(d["collection"], d["separate"])
        add("2 ranks, 26 tables: collection vs 26 separate tables, fwd+bwd+step", "faster (> 1x)", value, value > 1)
        add(
            "2 ranks, 26 tables: all-to-alls per step, collection",
            "3 (independent of the tables)",
            d["collection"]["all_to_all_per_step"],
            d["collection"]["all_to_all_per_step"] <= 3,
            unit="",
        )
    s1 = coll.get("single_process", {}).get("methods", {})
    if "collection" in s1 and "fbgemm" in s1:
        value = ratio(s1["collection"], s1["fbgemm"])
        add("1 process, 26 tables: collection vs FBGEMM CPU TBE (row-wise Adagrad fused)", "no slower (>= 1x)", value, value >= 1)
    scale = {(r["workload"], r["world_size"]): r for r in doc.get("scale", {}).get("results", [])
             if r.get("group_size", r["world_size"]) == r["world_size"]}  # 1-D runs  # fmt: skip
    for world, need in ((1024, 1.25), (4096, 1.5)):
        if ("26 tables", 8) in scale and ("26 tables", world) in scale:
            value = scale[("26 tables", world)]["step_ms"] / scale[("26 tables", 8)]["step_ms"]
            add(f"simulator, 26 tables: step host time at W={world} / at W=8", f"<= {need}x", value, value <= need)
    for where, r in doc.get("dynamic", {}).get("step", {}).items():
        add(f"{where}: DynamicEmbedding step with 10% new ids / SparseEmbedding step of the same batch", "<= 1.5x",
            r["ratio_room"], r["ratio_room"] <= 1.5)  # fmt: skip
    stream = doc.get("dynamic", {}).get("stream")
    if stream:
        growth = max(r["peak_rss_mib_at_end"] - r["peak_rss_mib_at_10pct"] for r in stream["ranks"])
        add(f"2 ranks: {stream['config']['distinct']:,} distinct ids through capacity {stream['config']['capacity']:,}: "
            "peak RSS growth per rank after the first tenth of the stream", "flat (< 5 MiB)", growth, growth < 5, unit=" MiB")  # fmt: skip
    gpu_report.targets(doc.get("gpu", {}), add)
    return out


# ---------------------------------------------------------------------------- markdown
def _rows(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"


def _bytes(b: float | None) -> str:
    if b is None:
        return "n/a"
    return f"{b / 2**20:.2f} MiB" if b >= 2**20 else f"{b / 2**10:.0f} KiB"


def _elsewhere(again: dict, machine: dict) -> str:
    """The processor a section was measured again on, where it differs from the whole run's (recorded since 2026-11-27)."""
    processor = again.get("processor")
    return f", on {processor}" if processor and processor != machine["processor"] else ""


def markdown(doc: dict, json_name: str, plots: list[str]) -> str:
    m, v = doc["machine"], doc["versions"]
    lines = [
        f"Measured {doc['created']} on {m['cpu_count']} CPU cores ({m['processor']}, {m['memory_gib']} GiB), "
        f"{m['platform']}; Python {m['python']}, torch {v['torch']}, lightning {v['lightning']}, dgl {v['dgl'] or 'not installed'}, "
        f"fbgemm_gpu {v['fbgemm_gpu'] or 'not installed'}; lightning_sparse at commit `{doc['code']['commit']}`"
        f"{' with uncommitted changes' if doc['code']['uncommitted'] else ''}. Threads: {doc['threads']['single_process']} "
        f"in the one-process section, 1 per rank with 2 ranks. Allocator: "
        f"{', '.join(f'{k}={val}' for k, val in doc['allocator'].items())}. Whole run: {doc['wall_s']:.0f} s"
        f"{' (**--quick smoke run: small sizes, not for conclusions**)' if doc['quick'] else ''}."
        + "".join(
            f" The {name} section was measured again on {again['created']} at commit `{again['commit']}`"
            f"{_elsewhere(again, m)} (`bench.py --only {name}`)."
            for name, again in doc.get("rerun", {}).items()
        ),
        "",
        "### Targets",
        "",
        "| target | goal | measured | |",
        "|---|---|---:|---|",
    ]
    for t in doc["targets"]:
        lines.append(
            f"| {t['name']} | {t['goal'] if 'goal' in t else t['target']} | {t['measured']} | {'met' if t['met'] else '**missed**'} |"
        )
    for section in doc.get("single_process", []):
        lines += _single_markdown(section)
    lines += _distributed_markdown(doc.get("distributed", {}))
    lines += _collection_markdown(doc.get("collection", {}))
    lines += _scale_markdown(doc.get("scale", {}))
    lines += _network_markdown(doc.get("network", {}))
    lines += _dynamic_markdown(doc.get("dynamic", {}))
    lines += _half_markdown(doc.get("half", {}))
    if not doc.get("quick"):
        lines += _scaling_model_markdown(doc)
    lines += gpu_report.markdown(doc.get("gpu", {}))
    lines += [""] + [f"![{name}]({name})" for name in plots] + ["", f"Raw results: `{json_name}`."]
    return "\n".join(lines)


def _collection_markdown(section: dict) -> list[str]:
    if not section:
        return []
    d, s = section["distributed"], section["single_process"]
    lines = ["", "### Many tables: SparseEmbeddingCollection", "",
             f"{d['tables']} tables of dim {d['dim']} ({d['rows'] / 1e6:.1f}M rows: Criteo's cardinalities clamped to "
             f"[100, 1M]), 3 multi-hot features (bags of 1-5 ids, sum-pooled), row-wise Adagrad; "
             f"`benchmarks/collection.py`.", "",
             f"2 gloo ranks, {d['batch_per_rank']} samples per rank:", "",
             "| method | step (ms) | all-to-alls per step |", "|---|---:|---:|"]  # fmt: skip
    for name, m in d["methods"].items():
        lines.append(f"| {name} | {m['step_ms_median']:.1f} | {m['all_to_all_per_step']} |")
    lines += ["", f"1 process, {s['threads']} threads, {s['batch']} samples:", "", "| method | step (ms) |", "|---|---:|"]
    for name, m in s["methods"].items():
        lines.append(f"| {name} | {m['step_ms_median']:.1f} |")
    if "fbgemm_skipped" in s:
        lines.append(f"\nFBGEMM not run: {s['fbgemm_skipped']}.")
    return lines


def _scale_markdown(section: dict) -> list[str]:
    if not section:
        return []
    import scale

    return ["", "### Scale: one rank of W (simulator)", "",
            f"Rank {section['rank']} of a W-rank job whose peers mirror it (`benchmarks/scale.py`): the all-to-alls are "
            f"copies, so the step time is this rank's host work. {section['batch_per_rank']} samples per rank, at most "
            f"{section['rows_cap']} rows per table per rank (the tables grow with W), dim 64, row-wise Adagrad, 1 thread. "
            f"Each layout ran {section.get('rounds', 1)} time(s) in interleaved rounds; shown: the round with the median "
            "step time (every round's step time in the last column). "
            "Bytes and messages: what this rank would send to other ranks per step. G < W: 2-D sharding, tables "
            "sharded over groups of G ranks (rows per rank as above) and replicated W / G times; the all-to-alls stay "
            "inside the group, and the replicas' gradients are summed by two all-gathers over W / G ranks.", "",
            scale.table(section)]  # fmt: skip


def _dynamic_markdown(section: dict) -> list[str]:
    if not section:
        return []
    cfg = section["config"]
    lines = ["", "### Dynamic tables (hashed ids)", "",
             f"`benchmarks/dynamic.py`: {cfg['batch']} ids per rank and step, {100 * cfg['new_fraction']:.0f}% of them never "
             f"seen before, the rest skewed over {cfg['pool']:,} ids that hold rows; dim {cfg['dim']}, {cfg['optimizer']}; "
             f"{cfg['rounds']} interleaved rounds of {cfg['steps']} steps: each method's median step over the rounds' medians, "
             "and each ratio the median over the rounds of the round's ratio to the SparseEmbedding. *room*: capacity for "
             "every id of the run; *full*: capacity for the pool only, so each new id evicts the least recently used one.", "",
             "| where | SparseEmbedding (ms) | DynamicEmbedding, room (ms) | ratio | DynamicEmbedding, full (ms) | ratio |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for where, r in section["step"].items():
        ms = r["ms"]
        lines.append(f"| {where} | {ms['sparse']:.2f} | {ms['dynamic_room']:.2f} | {r['ratio_room']:.2f}x | "
                     f"{ms['dynamic_full']:.2f} | {r['ratio_full']:.2f}x |")  # fmt: skip
    stream = section.get("stream")
    if not stream:
        return lines
    c = stream["config"]
    lines += ["", f"A stream of {c['distinct']:,} distinct ids ({c['batch']:,} new ids per rank and step) through a table of "
              f"capacity {c['capacity']:,} on 2 ranks:", "",
              "| rank | steps | seconds | peak RSS after 10% (MiB) | peak RSS at the end (MiB) | RSS at 10% / 50% / end (MiB) "
              "| occupancy / room | admissions | evictions |",
              "|---:|---:|---:|---:|---:|---|---:|---:|---:|"]  # fmt: skip
    for rank, r in enumerate(stream["ranks"]):
        now = r.get("rss_mib_by_progress", {})
        current = " / ".join(f"{now[k]:.0f}" if k in now else "n/a" for k in ("10%", "49%" if "49%" in now else "50%", "100%"))
        lines.append(f"| {rank} | {r['steps']} | {r['seconds']:.0f} | {r['peak_rss_mib_at_10pct']:.0f} | "
                     f"{r['peak_rss_mib_at_end']:.0f} | {current} | {r['occupancy']:,} / {r['rank_capacity']:,} | "
                     f"{r['admissions']:,} | {r['evictions']:,} |")  # fmt: skip
    return lines


def _half_markdown(section: dict) -> list[str]:
    if not section:
        return []
    cfg = section["config"]
    lines = ["", "### Half-precision tables", "",
             f"`benchmarks/half.py`: one table of {_rows(cfg['rows'])} x {cfg['dim']}, {cfg['batch']} skewed ids per step, "
             f"{cfg['optimizer']}, {cfg['threads']} threads, one process; {cfg['rounds']} interleaved rounds of {cfg['steps']} "
             "steps (medians; the ratio is the median of the rounds' ratios). Half tables keep float32 optimizer state and "
             "write their updates back with stochastic rounding unless marked *nearest*.", "",
             "| table | step (ms) | vs float32 | table | optimizer state |", "|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in section["results"]:
        lines.append(f"| {r['method']} | {r['ms']:.2f} | {r['ratio_to_float32']:.2f}x | {_bytes(r['table_bytes'])} | "
                     f"{_bytes(r['state_bytes'])} |")  # fmt: skip
    return lines


def _network_markdown(section: dict) -> list[str]:
    if not section:
        return []
    lines = ["", "### Two hosts over slow, lossy links", ""]
    if "skipped" in section:
        return lines + [f"Not run: {section['skipped']}."]
    import network

    return lines + [f"`benchmarks/network.py`: the collection model of the multi-host tests, one rank on each of two "
                    f"stand-in hosts (network namespaces), {section['epochs']} epochs x {section['rounds']} rounds per "
                    "link, the first epoch of each round left out; rank 0's median training step.", "",
                    network.table(section)]  # fmt: skip


def _scaling_model_markdown(doc: dict) -> list[str]:
    import scaling_model

    rows = scaling_model.model([8, 64, 512, 1024, 4096], scaling_model.host_times(doc))
    return ["", "### Scaling model: DLRM-sized, W = 8 ... 4,096", "",
            "`benchmarks/scaling_model.py` (assumptions in its docstring and under *Scaling model* above): Criteo's 26 "
            "tables at dim 128, 65,536 samples per rank, per rank and step. Host ms: this run's simulator, scaled by 16.",
            "", scaling_model.table(rows)]  # fmt: skip


def _has_rounds(section: dict) -> bool:
    return all(x.get("round_ms") for x in section["results"])


def _single_markdown(section: dict) -> list[str]:
    r = {(x["name"], x["kind"]): x for x in section["results"]}

    def ms(name: str, kind: str) -> str:
        x = r.get((name, kind))
        return f"{x['ms_median']:.2f}" if x else "n/a"

    def times(a: tuple[str, str], b: tuple[str, str]) -> str:
        value = ratio(r.get(a), r.get(b))
        return f"{value:.2f}x" if value is not None else "n/a"

    lines = [
        "", f"### One process ({section['device']}, {section.get('allocator', 'glibc defaults')})", "",
        f"Table {_rows(section['rows'])} x {section['dim']} float32, {section['batch']} ids per step drawn as "
        f"`(rows * rand() ** 4).long()` ({section['distinct_ids_mean']:.0f} distinct on average), {section['threads']} threads, "
        f"{section['rounds']} interleaved rounds of {section['steps_per_round']} steps per method; medians in ms; each "
        f"ratio the median over rounds of that round's ratio{'' if _has_rounds(section) else ' (here: of the medians)'}.", "",
        "| optimizer | ours fwd+bwd+step | torch | FBGEMM TBE | torch / ours | FBGEMM / ours | ours step | "
        "gather+scatter floor | step / floor | copy floor |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for family in FAMILIES:
        torch_name = "torch/adam_global" if family.startswith("adam") else f"torch/{family}"
        step = (f"ours/{family}", "step")
        floor = (f"floor/gather_scatter/{family}", "floor_gather_scatter")
        lines.append(
            f"| {FAMILY_LABEL[family]} | {ms(*step)} | {ms(torch_name, 'step')} | {ms(f'fbgemm/{family}', 'step')} | "
            f"{times(step, (torch_name, 'step'))} | {times(step, (f'fbgemm/{family}', 'step'))} | {ms(f'ours/{family}', 'update')} | "
            f"{ms(*floor)} | {times(floor, (f'ours/{family}', 'update'))} | {ms(f'floor/copy/{family}', 'floor_copy')} |"
        )
    lines += ["", f"Lookup (forward + backward, no step): ours {ms('ours/lookup', 'lookup')} ms, "
              f"`nn.Embedding(sparse=True)` {ms('torch/lookup', 'lookup')} ms. torch has no row-wise Adagrad; its "
              "SparseAdam is the global-bias-correction one, compared with both of ours."]  # fmt: skip
    return lines


def _distributed_markdown(section: dict) -> list[str]:
    if not section:
        return []
    runs = section["runs"]
    by = {(r["method"], r["rows"], r["batch"]): r for r in runs}
    lines = [
        "", "### Two ranks (gloo, CPU)", "",
        f"Dim {section['dim']} float32, ids ~ Zipf({section['zipf']}), {section['optimizer']}, 1 thread per rank. "
        "A step ends when the slower rank finishes it; bytes are per rank per step.", "",
        "| ids/rank | rows | method | median (ms) | p25-p75 | method / ours | bytes sent | lower bound | sent / bound | "
        "peak RSS per rank |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for batch in sorted({r["batch"] for r in runs}):
        for rows in sorted({r["rows"] for r in runs}):
            ours = by.get(("ours", rows, batch))
            for method in METHOD_LABEL:
                r = by.get((method, rows, batch))
                if r is None:
                    continue
                if "error" in r:
                    lines.append(f"| {batch} | {_rows(rows)} | {METHOD_LABEL[method]} | failed: {r['error']} | | | | | | |")
                    continue
                vs = f"{r['step_ms_median'] / ours['step_ms_median']:.2f}x" if ours and "error" not in ours else "n/a"
                bound = r.get("lower_bound_bytes_per_step")
                sent = r.get("bytes_sent_per_step")
                lines.append(
                    f"| {batch} | {_rows(rows)} | {METHOD_LABEL[method]} | {r['step_ms_median']:.1f} | "
                    f"{r['step_ms_p25']:.1f}-{r['step_ms_p75']:.1f} | {vs} | {_bytes(sent)} | {_bytes(bound)} | "
                    f"{sent / bound:.2f}x | {'/'.join(f'{x:.0f}' for x in r['peak_rss_mib'])} MiB |"
                    if sent and bound else
                    f"| {batch} | {_rows(rows)} | {METHOD_LABEL[method]} | {r['step_ms_median']:.1f} | "
                    f"{r['step_ms_p25']:.1f}-{r['step_ms_p75']:.1f} | {vs} | {_bytes(sent)} | {_bytes(bound)} | n/a | "
                    f"{'/'.join(f'{x:.0f}' for x in r['peak_rss_mib'])} MiB |"
                )  # fmt: skip
    lines += ["", "How the bytes were obtained:", ""]
    for method in METHOD_LABEL:
        source = next((r.get("bytes_source") for r in runs if r["method"] == method and r.get("bytes_source")), None)
        if source:
            lines.append(f"- {METHOD_LABEL[method]}: {source}.")
    for r in runs:
        if "exit" in r:
            lines.append(f"- {METHOD_LABEL[r['method']]}, {_rows(r['rows'])} rows, {r['batch']} ids: a rank ended with "
                         f"{r['exit']} (its figures stand).")  # fmt: skip
    ours = [r for r in runs if r["method"] == "ours" and "collectives_per_step" in r]
    if ours:
        lines.append(f"- lightning_sparse made {ours[0]['collectives_per_step']:.0f} all-to-alls per step "
                     "(ids with headers, rows, gradients).")  # fmt: skip
    return lines


# ---------------------------------------------------------------------------- plots
def plots(doc: dict, folder: Path, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for index, section in enumerate(s for s in doc.get("single_process", []) if s["device"] == "cpu"):
        r = {(x["name"], x["kind"]): x["ms_median"] for x in section["results"]}
        fig, (ax_step, ax_floor) = plt.subplots(1, 2, figsize=(13, 4.5))
        width = 0.27
        for i, family in enumerate(FAMILIES):
            torch_name = "torch/adam_global" if family.startswith("adam") else f"torch/{family}"
            for j, (name, color, label) in enumerate(((f"ours/{family}", "tab:red", "lightning_sparse"),
                                                      (torch_name, "tab:gray", "torch nn.Embedding(sparse=True)"),
                                                      (f"fbgemm/{family}", "tab:blue", "FBGEMM CPU TBE"))):  # fmt: skip
                if (name, "step") in r:
                    ax_step.bar(
                        i + (j - 1) * width,
                        r[(name, "step")],
                        width,
                        color=color,
                        label=label if i == 0 or (j == 2 and family == "sgd") else None,
                    )
            for j, (name, kind, color, label) in enumerate(((f"ours/{family}", "update", "tab:red", "lightning_sparse step"),
                                                            (f"floor/gather_scatter/{family}", "floor_gather_scatter", "tab:olive", "gather + scatter floor"),
                                                            (f"floor/copy/{family}", "floor_copy", "tab:cyan", "sequential copy floor"))):  # fmt: skip
                if (name, kind) in r:
                    ax_floor.bar(i + (j - 1) * width, r[(name, kind)], width, color=color, label=label if i == 0 else None)
        for ax, title in ((ax_step, "forward + backward + step"), (ax_floor, "optimizer step alone, against two floors")):
            ax.set_xticks(range(len(FAMILIES)), [SHORT_FAMILY[f] for f in FAMILIES], fontsize=8)
            ax.set(ylabel="median ms", title=title)
            ax.legend(fontsize=8)
            ax.grid(True, axis="y", alpha=0.3)
        fig.suptitle(f"one process, {_rows(section['rows'])} x {section['dim']} table, {section['batch']} ids per step, "
                     f"{section['threads']} threads, {section.get('allocator', 'glibc defaults')}", fontsize=10)  # fmt: skip
        fig.tight_layout()
        names.append(f"{stem}-single{'-kept' if index else ''}.png")
        fig.savefig(folder / names[-1], dpi=100)
        plt.close(fig)
    runs = [r for r in doc.get("distributed", {}).get("runs", []) if "error" not in r]
    batches = sorted({r["batch"] for r in runs})
    if runs:
        fig, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 4.5), squeeze=False)
        for ax, batch in zip(axes[0], batches):
            for method in METHOD_LABEL:
                mine = sorted((r for r in runs if r["method"] == method and r["batch"] == batch), key=lambda r: r["rows"])
                if not mine:
                    continue
                color, marker = STYLE[method]
                med = [r["step_ms_median"] for r in mine]
                err = [[m - r["step_ms_p25"] for m, r in zip(med, mine)], [r["step_ms_p75"] - m for m, r in zip(med, mine)]]
                ax.errorbar(
                    [r["rows"] for r in mine],
                    med,
                    yerr=err,
                    color=color,
                    marker=marker,
                    capsize=3,
                    label=METHOD_LABEL[method].replace("`", ""),
                )
            ax.set(xscale="log", yscale="log", xlabel="table rows", ylabel="median step (ms), bars p25-p75",
                   title=f"2 gloo ranks, {batch} ids per rank per step")  # fmt: skip
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        names.append(f"{stem}-distributed.png")
        fig.savefig(folder / names[-1], dpi=100)
        plt.close(fig)
    return names


# ---------------------------------------------------------------------------- page
def write(doc: dict, json_path: Path, doc_path: Path) -> None:
    """Regenerate the results block of ``doc_path`` and the plots beside it."""
    doc_path = Path(doc_path)
    names = plots(doc, doc_path.parent, doc_path.stem)
    try:
        json_name = str(Path(json_path).resolve().relative_to(doc_path.resolve().parent.parent))
    except ValueError:
        json_name = str(json_path)
    block = f"{BEGIN}\n{markdown(doc, json_name, names)}\n{END}"
    page = doc_path.read_text() if doc_path.exists() else f"# Benchmarks\n\n{BEGIN}\n{END}\n"
    if BEGIN not in page or END not in page:
        raise SystemExit(f"{doc_path} has no {BEGIN} ... {END} block to fill in")
    head, rest = page.split(BEGIN, 1)
    doc_path.write_text(head + block + rest.split(END, 1)[1])
    print(f"wrote {doc_path} and {', '.join(names)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", default=str(Path(__file__).resolve().parent / "results" / "bench.json"))
    parser.add_argument("--doc", default=str(Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"))
    args = parser.parse_args()
    data = json.loads(Path(args.results).read_text())
    data["targets"] = targets(data)
    write(data, Path(args.results), Path(args.doc))
