"""Turn the JSON of ``benchmarks/sparse_step.py`` into the plot and the numbers of ``docs/benchmarks.md``.

The page's prose is written by hand; this script replaces only the part between
``<!-- results:begin -->`` and ``<!-- results:end -->`` and rewrites the PNG. Run with ``make bench``
(measure + report) or alone to re-render the last results::

    python benchmarks/report.py [--results benchmarks/results/sparse_step.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

LABELS = {
    "ours": "lightning_sparse: SparseEmbedding(sharding=\"mod\") + SparseAdagrad",
    "dense_ddp": "replicated dense: nn.Embedding in DDP + torch.optim.Adagrad",
    "sparse_grad_ddp": "replicated sparse grads: nn.Embedding(sparse=True) in DDP + torch.optim.Adagrad",
    "dgl": "DGL: dgl.nn.NodeEmbedding + dgl.optim.SparseAdagrad",
}
SHORT = {"ours": "lightning_sparse", "dense_ddp": "DDP dense", "sparse_grad_ddp": "DDP sparse grads", "dgl": "DGL"}
STYLE = {"ours": ("tab:red", "o"), "dense_ddp": ("tab:blue", "s"), "sparse_grad_ddp": ("tab:green", "^"), "dgl": ("tab:purple", "D")}


def human_rows(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"


def human_bytes(b: float | None) -> str:
    if b is None:
        return "n/a"
    if b >= 2**30:
        return f"{b / 2**30:.2f} GiB"
    if b >= 2**20:
        return f"{b / 2**20:.2f} MiB"
    return f"{b / 2**10:.0f} KiB"


def code_line(doc: dict) -> str:
    code = doc.get("code") or {}
    before, after = code.get("before", {}), code.get("after", {})
    if not before:
        return ""
    line = f"lightning_sparse at commit `{before.get('commit')}`"
    if before.get("lightning_sparse_uncommitted"):
        line += " with uncommitted changes"
    if after and after != before:
        line += f" (changed during the run, to `{after.get('commit')}`)"
    return line + "."


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in doc["runs"] if "error" not in r]
    cfg = doc["config"]
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.8))
    for method in LABELS:
        mine = sorted((r for r in runs if r["method"] == method), key=lambda r: r["rows"])
        if not mine:
            continue
        color, marker = STYLE[method]
        rows = [r["rows"] for r in mine]
        med = [r["step_ms_median"] for r in mine]
        err = [[m - r["step_ms_p25"] for m, r in zip(med, mine)], [r["step_ms_p75"] - m for m, r in zip(med, mine)]]
        ax_t.errorbar(rows, med, yerr=err, color=color, marker=marker, capsize=3, label=SHORT[method])
        sent = [r.get("bytes_sent_per_step") for r in mine]
        if all(s is not None for s in sent):
            ax_b.plot(rows, [s / 2**20 for s in sent], color=color, marker=marker, label=SHORT[method])
    ax_t.set(xscale="log", yscale="log", xlabel="table rows", ylabel="median step time (ms), bars: p25-p75",
             title=f"step time, {doc['config']['world_size']} gloo ranks on CPU")  # fmt: skip
    ax_b.set(xscale="log", yscale="log", xlabel="table rows", ylabel="MiB sent to the other rank per step",
             title="communication per step (measured or computed, see docs)")  # fmt: skip
    for ax in (ax_t, ax_b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"dim {cfg['dim']}, {cfg['batch']} Zipf({cfg['zipf']}) lookups per rank per step, Adagrad, "
        f"{doc['machine']['cpu_count']}-core CPU, 1 thread per rank",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def results_markdown(doc: dict, results_path: str, png_name: str) -> str:
    cfg, machine = doc["config"], doc["machine"]
    runs = doc["runs"]
    by_key = {(r["method"], r["rows"]): r for r in runs}
    sizes = sorted({r["rows"] for r in runs})
    out = [
        f"Run: {machine['cpu_count']}-core CPU ({machine['processor']}), {machine['platform']}, Python "
        f"{machine['python']}, torch {machine['torch']}, dgl {machine['dgl']}; {cfg['world_size']} ranks on "
        f"{cfg['backend']}, {cfg['threads_per_rank']} thread per rank. Table dim {cfg['dim']} (float32), "
        f"{cfg['batch']} lookups per rank per step, ids ~ Zipf({cfg['zipf']}), `{cfg['loss']}`, "
        f"{cfg['optimizer']}. Whole benchmark: {doc['total_wall_s']:.0f} s wall; other processes used "
        f"{doc.get('other_cpu_s', float('nan')):.0f} CPU-s meanwhile (see caveats). {code_line(doc)}",
        "",
        "| rows | method | median step (ms) | p25-p75 (ms) | baseline / ours | sent to the other rank per step | "
        "peak RSS per rank | setup (s) | steps |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rows in sizes:
        ours = by_key.get(("ours", rows))
        for method in LABELS:
            r = by_key.get((method, rows))
            if r is None:
                continue
            if "error" in r:
                out.append(f"| {human_rows(rows)} | {SHORT[method]} | failed: {r['error']} | | | | | | |")
                continue
            if method == "ours":
                ratio = "1 (reference)"
            elif ours and "error" not in ours:
                ratio = f"**{r['step_ms_median'] / ours['step_ms_median']:.2f}x**"
            else:
                ratio = "n/a"
            rss = "/".join(f"{m:.0f}" for m in r["peak_rss_mib"]) + " MiB"
            out.append(
                f"| {human_rows(rows)} | {SHORT[method]} | {r['step_ms_median']:.1f} | "
                f"{r['step_ms_p25']:.1f}-{r['step_ms_p75']:.1f} | {ratio} | {human_bytes(r.get('bytes_sent_per_step'))} | "
                f"{rss} | {r['setup_s']:.1f} | {r['measured_steps']} |"
            )
    out += ["", "How each byte figure was obtained:", ""]
    seen = set()
    for method in LABELS:
        src = next((r.get("bytes_source") for r in runs if r["method"] == method and r.get("bytes_source")), None)
        if src and method not in seen:
            seen.add(method)
            out.append(f"- {SHORT[method]}: {src}.")
    ours_runs = [r for r in runs if r["method"] == "ours" and "error" not in r]
    if ours_runs:
        out += ["", "Where lightning_sparse's step goes (mean per step over the measured steps, mean over ranks; "
                "exchange times include waiting for the other rank):", "",
                "| rows | unique ids per rank | ExchangeStats bytes sent (lookup + grads) | computed from the ids | "
                "lookup exchange (ms) | grad exchange (ms) | row update (ms) |",
                "|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in sorted(ours_runs, key=lambda r: r["rows"]):
            out.append(
                f"| {human_rows(r['rows'])} | {r['unique_ids_per_step']:.0f} | "
                f"{human_bytes(r['lookup_bytes_sent_per_step'])} + {human_bytes(r['grad_bytes_sent_per_step'])} | "
                f"{human_bytes(r['bytes_sent_per_step'])} | {r['lookup_exchange_ms_per_step']:.1f} | "
                f"{r['grad_exchange_ms_per_step']:.1f} | {r['update_ms_per_step']:.1f} |"
            )
    pair = [by_key.get((m, r)) for m in doc.get("lightning_pair", []) for r in sizes if (m, r) in by_key]
    if len(pair) == 2 and all(p and "error" not in p for p in pair):
        plain, lit = pair
        out += ["", f"Lightning overhead ({human_rows(plain['rows'])} rows; the same table plus a {cfg['dim']}-element "
                "dense parameter in DDP, so that Lightning has a dense optimizer; "
                f"{plain['measured_steps']} steps after {plain['warmup_steps']} warm-up steps):", "",
                "| loop | median step (ms) | p25-p75 (ms) | / plain | ExchangeStats bytes sent per rank per step |",
                "|---|---:|---:|---:|---:|"]  # fmt: skip
        for name, r in (("plain torch loop (DDP head + SparseAdagrad)", plain),
                        ("`Trainer(strategy=\"sparse_ddp\")`, time between `on_train_batch_start` calls", lit)):  # fmt: skip
            out.append(
                f"| {name} | {r['step_ms_median']:.1f} | {r['step_ms_p25']:.1f}-{r['step_ms_p75']:.1f} | "
                f"{r['step_ms_median'] / plain['step_ms_median']:.2f}x | {human_bytes(r.get('bytes_sent_per_step'))} |"
            )
    elif pair:
        out += ["", "Lightning overhead: " + "; ".join(f"{p['method']} failed: {p['error']}" for p in pair if p and "error" in p)]
    link = results_path if Path(results_path).is_absolute() else f"../{results_path}"
    out += ["", f"![step time vs table rows]({png_name})", "", f"Raw results: [`{results_path}`]({link})."]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="benchmarks/results/sparse_step.json")
    parser.add_argument("--doc", default="docs/benchmarks.md")
    parser.add_argument("--png", default="docs/benchmarks.png")
    args = parser.parse_args()
    results = Path(args.results) if Path(args.results).is_absolute() else ROOT / args.results
    doc_path, png = ROOT / args.doc, ROOT / args.png
    doc = json.loads(results.read_text())
    plot(doc, png)
    rel = results.relative_to(ROOT).as_posix() if results.is_relative_to(ROOT) else str(results)
    block = f"{BEGIN}\n{results_markdown(doc, rel, png.name)}\n{END}"
    page = doc_path.read_text() if doc_path.exists() else f"# Benchmarks\n\n{BEGIN}\n{END}\n"
    if BEGIN not in page or END not in page:
        raise SystemExit(f"{doc_path} has no {BEGIN} ... {END} block to fill in")
    head, rest = page.split(BEGIN, 1)
    doc_path.write_text(head + block + rest.split(END, 1)[1])
    print(f"wrote {png.relative_to(ROOT)} and the results of {doc_path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
