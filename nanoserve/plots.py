"""Pictures of a step trace (trace.py), as PNG files: plot_trace(trace_path, out_dir). Needs matplotlib.

kv_blocks.png: the block pool after each step: used (held by running sequences), cached (free, still holding a
findable prefix) and free. Used climbs with prefills and decodes and falls as requests finish; red dashed lines
mark preemptions (the pool ran dry and the youngest sequence gave its blocks back).
batches.png: top, each step's prefill (prompt chunk) tokens under its decodes (one token each): with a small
max_num_batched_tokens a long prompt is cut into chunks that ride beside decodes; bottom, the running and waiting
queues. block_tables.png: the first sequences' block tables, one cell per physical block labelled with its id;
orange cells are blocks shared through the prefix cache (one copy of a common prefix, computed once).
"""
import json
from pathlib import Path

try:
    import matplotlib
    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt
    import numpy as np
except ImportError as error:
    raise ImportError("nanoserve.plots needs matplotlib: pip install matplotlib") from error

MAX_ROWS, MAX_CELLS = 6, 32  # block_tables.png: sequences shown, blocks shown per sequence


def load_trace(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_kv_blocks(steps: list[dict], ax):
    x, b = [s["step"] for s in steps], [s["blocks"] for s in steps]  # "free" counts the cached blocks too
    ax.stackplot(x, [c["used"] for c in b], [c["cached"] for c in b], [c["free"] - c["cached"] for c in b],
                 labels=["used", "cached (free, prefix kept)", "free"], colors=["tab:blue", "tab:orange", "0.9"])
    for i, s in enumerate(s for s in steps if s["preempted"]):
        ax.axvline(s["step"], color="red", lw=0.8, ls="--", label=None if i else "preemption")
    total, top = b[0]["used"] + b[0]["free"], max(c["used"] + c["cached"] for c in b)
    ax.set_ylim(0, min(total, 2 * top + 4))  # in a big pool, the free blocks above this are cut off
    ax.set(xlabel="step", ylabel="KV blocks", title=f"KV block pool after each step (of {total} blocks)")
    ax.legend(loc="upper right", fontsize=8)


def plot_batches(steps: list[dict], top, bottom):
    x = [s["step"] for s in steps]
    prefill = [sum(q["tokens"] for q in s["seqs"] if q["kind"] == "prefill") for s in steps]
    decodes = [sum(q["kind"] == "decode" for q in s["seqs"]) for s in steps]
    top.bar(x, prefill, width=1.0, color="tab:purple", label="prefill tokens (prompt chunks)")
    top.bar(x, decodes, width=1.0, bottom=prefill, color="tab:green", label="decodes (1 token each)")
    top.set(ylabel="tokens in the step", title="Batch composition per step")
    top.legend(loc="upper right", fontsize=8)
    bottom.plot(x, [(s["running"], s["waiting"]) for s in steps], drawstyle="steps-post", label=["running", "waiting"])
    bottom.set(xlabel="step", ylabel="sequences")
    bottom.legend(loc="upper right", fontsize=8)


def plot_block_tables(steps: list[dict], ax):
    seqs = [q for s in steps for q in s["seqs"]]
    bs = next(b for b in 2 ** np.arange(16) if all(len(q["block_table"]) == -(-(q["start"] + q["tokens"]) // b)
                                                   for q in seqs))  # the block size: every table's length fits it
    tables, hits = {}, {}  # the first sequences: id -> longest block table, blocks found cached when admitted
    for q in seqs:
        if q["id"] in tables or len(tables) < MAX_ROWS:
            hits.setdefault(q["id"], q["start"] // bs)  # its first entry is its admission
            tables[q["id"]] = max(tables.get(q["id"], []), q["block_table"], key=len)
    ids, rows = list(tables), [t[:MAX_CELLS] for t in tables.values()]
    width = max(map(len, rows), default=1)
    grid = np.array([[0.0] * len(t) + [np.nan] * (width - len(t)) for t in rows]).reshape(-1, width)  # 1: shared
    for i, j in ((i, j) for i in range(len(rows)) for j in range(len(rows)) if i != j):
        n = next((k for k, (u, v) in enumerate(zip(rows[i], rows[j])) if u != v), min(len(rows[i]), len(rows[j])))
        grid[i, :min(n, max(hits[ids[i]], hits[ids[j]]))] = 1  # same blocks, found in the cache
    ax.pcolormesh(np.ma.masked_invalid(grid), cmap=matplotlib.colors.ListedColormap(["lightsteelblue", "orange"]),
                  vmin=0, vmax=1, edgecolors="white", linewidth=3)
    for i, j in np.argwhere(~np.isnan(grid)):
        ax.text(j + 0.5, i + 0.5, str(rows[i][j]), ha="center", va="center", fontsize=9 if width <= 16 else 6)
    ax.set_xticks(np.arange(width) + 0.5, range(width))
    ax.set_yticks(np.arange(len(rows)) + 0.5, [f"seq {i}" for i in ids])
    ax.set(ylim=(len(rows), 0), xlabel=f"position in the block table (at most {MAX_CELLS} shown)",
           title="Block tables (physical block ids); orange: shared through the prefix cache")


def plot_trace(trace_path, out_dir) -> list[Path]:
    """Write kv_blocks.png, batches.png and block_tables.png for the trace into out_dir; returns their paths."""
    steps, out_dir, paths = load_trace(trace_path), Path(out_dir), []
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, draw, panels in (("kv_blocks", plot_kv_blocks, 1), ("batches", plot_batches, 2),
                               ("block_tables", plot_block_tables, 1)):
        fig, axes = plt.subplots(panels, 1, figsize=(9, 1 + 3 * panels), sharex=True, squeeze=False, layout="tight")
        draw(steps, *axes[:, 0])
        fig.savefig(out_dir / f"{name}.png", dpi=100)
        plt.close(fig)
        paths.append(out_dir / f"{name}.png")
    return paths
