"""An extension, the engine's inner life for the course: LLM(..., trace=PATH) writes a step trace (off by default: this
file is then never imported), one JSON line per step: its sequences (prefill chunk or decode, block tables), blocks
allocated, freed, hit and revived, used/cached/free after it, preemptions, queues, the step's time (step_ms), the block
size, the K/V tokens held and the slots reserved but unused (kv_tokens, kv_unused_slots); with speculative decoding,
each sequence's draft tokens in the step (drafts; a decode with drafts is still a decode) and the running totals of
drafts proposed and accepted (spec); with a host tier (kv_offloading_size: ext/kv_offload.py), its running totals
(offload: blocks saved, loaded back and dropped, and how preempted sequences came back); plot_trace(trace, out_dir)
draws it (matplotlib).

kv_blocks.png: the block pool after each step: used (held by running sequences), cached (free, still holding a findable
prefix) and free; red dashed lines mark preemptions. batches.png: top, each step's prefill tokens under its decodes (one
token each): a small max_num_batched_tokens cuts a long prompt into chunks that ride beside decodes; bottom, the running
and waiting queues. block_tables.png: the first sequences' block tables, one cell per physical block labelled with its
id; orange cells are shared through the prefix cache (one copy of a common prefix, computed once). After a beam search
(LLM.beam_search), the rows are the beams alive at the end, and orange cells the blocks they share since their forks:
the prompt's, held once, and their common history. host_tier.png (with a host tier): blocks leaving the device for host
memory (down) and coming back (up) in each step, the host blocks held, preemptions, and each readmission marked by how
its blocks came back: swapped (copied back) or recomputed."""

import json
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from nanoserve.checks import InvalidField
from nanoserve.config import EngineConfig
from nanoserve.scheduler import ScheduledSeq, Step

if TYPE_CHECKING:  # matplotlib is needed only to draw
    from matplotlib.axes import Axes

    from nanoserve.llm import LLM

MAX_ROWS, MAX_CELLS = 6, 32  # block_tables.png: sequences shown, blocks shown per sequence


def check_config(config: EngineConfig) -> None:
    """trace: not a folder, and in a folder this process can write to: the nearest existing one (the trace writer
    makes the missing ones below it), tried by making a temporary file there and removing it. Asking the OS
    (os.access) is not enough: as root every folder looks writable, yet nothing can be made in /proc."""
    path = Path(config.trace).absolute()  # "" is the working folder: refused as a folder
    folder = next(p for p in path.parents if p.exists())
    if path.is_dir() or not folder.is_dir():
        raise InvalidField("trace", f"cannot write {config.trace!r}: a folder, or no folder there")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise InvalidField("trace", f"cannot write {config.trace!r}: {error.strerror or error}") from None


def start(llm: "LLM") -> "StepTrace":
    """The engine starts with trace=PATH: its trace writer (LLM.trace), which it tells when each step begins and
    ends."""
    llm.trace = StepTrace(llm.config.trace, llm)
    return llm.trace


class StepTrace:
    """The trace writer: the engine calls begin(step) when a step is launched and end(started) once it is finished."""

    def __init__(self, path: str, llm: "LLM") -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "w", buffering=1)  # line-buffered: a trace is readable while the engine runs
        self.scheduler = llm.scheduler  # its queues, and its block manager: the pool and its counters
        self.llm = llm  # for its proposer, when speculative decoding starts (after this writer)
        self.num_steps = 0
        # the pool's counters after the previous step; none before the first (the pool is as new as the engine: all 0)
        self.last = {}

    def begin(self, step: Step) -> None:
        """The step as launched (before finishing the previous one may free blocks)."""
        self.launched = {
            "seqs": [
                {
                    "id": s.seq.seq_id,
                    "start": s.start,
                    "tokens": s.num_new_tokens,
                    "block_table": list(s.seq.block_table),
                    "kind": "decode" if is_decode(s) else "prefill",
                    "drafts": s.seq.num_draft_tokens,
                }
                for s in step.scheduled
            ],
            "preempted": [seq.seq_id for seq in step.preempted],
        }

    def end(self, started: float) -> None:
        """The pool and queues after the step, and its time."""
        running = self.scheduler.running
        bm = self.scheduler.block_manager
        counters = {
            "allocated": bm.num_allocated,
            "freed": bm.num_freed,
            "hit": bm.num_hit_blocks,
            "revived": bm.num_revived,
        }
        kv_tokens = sum(seq.num_computed_tokens for seq in running)  # a shared block counts per user
        step = {
            "step": self.num_steps,
            "step_ms": round(1000 * (time.perf_counter() - started), 3),
            **self.launched,  # seqs, preempted
            "running": len(running),
            "waiting": len(self.scheduler.waiting),
            "blocks": dict(
                used=bm.num_used_blocks,
                cached=bm.count_cached_free_blocks(),
                free=bm.num_free_blocks,
                **{k: n - self.last.get(k, 0) for k, n in counters.items()},  # what the step did
            ),
            "block_size": bm.block_size,  # tokens per KV block
            "kv_tokens": kv_tokens,
            "kv_unused_slots": bm.block_size * sum(len(seq.block_table) for seq in running) - kv_tokens,
        }
        if self.llm.proposer is not None:  # speculative decoding's running totals
            step["spec"] = self.llm.proposer.stats()
        host_tier = self.llm.extensions.get("kv_offload")
        if host_tier is not None:  # the host tier's running totals (ext/kv_offload.py)
            step["offload"] = host_tier.stats()
        print(json.dumps(step), file=self.file)
        self.num_steps += 1
        self.last = counters

    def close(self) -> None:
        self.file.close()


def is_decode(s: ScheduledSeq) -> bool:
    """A decode computes the sequence's newest token (and its draft tokens, with speculative decoding) after its
    prompt; anything else is a prefill chunk."""
    return s.num_new_tokens == 1 + s.seq.num_draft_tokens and s.start >= s.seq.num_prompt_tokens


def plot_kv_blocks(steps: list[dict], ax: "Axes") -> None:
    # per step; "free" counts the cached blocks too
    used, cached, free = (np.array([s["blocks"][key] for s in steps]) for key in ("used", "cached", "free"))
    total = used[0] + free[0]
    ax.stackplot(
        range(len(steps)),
        used,
        cached,
        free - cached,
        labels=["used", "cached (free, prefix kept)", "free"],
        colors=["tab:blue", "tab:orange", "0.9"],
    )
    preempted = [s["step"] for s in steps if s["preempted"]]
    ax.vlines(preempted, 0, total, color="red", lw=0.8, ls="--", label="preemption" if preempted else None)
    ax.set(
        ylim=(0, min(total, 2 * max(used + cached) + 4)),  # in a big pool, the free blocks above this are cut off
        xlabel="step",
        ylabel="KV blocks",
        title=f"KV block pool after each step (of {total} blocks)",
    )


def plot_batches(steps: list[dict], top: "Axes", bottom: "Axes") -> None:
    x = range(len(steps))  # the step numbers
    prefill = [sum(q["tokens"] for q in s["seqs"] if q["kind"] == "prefill") for s in steps]
    decodes = [sum(q["tokens"] for q in s["seqs"] if q["kind"] == "decode") for s in steps]  # drafts ride along
    top.bar(x, prefill, width=1.0, color="tab:purple", label="prefill tokens (prompt chunks)")
    top.bar(x, decodes, width=1.0, bottom=prefill, color="tab:green", label="decode tokens (1 each, more with drafts)")
    top.set(ylabel="tokens in the step", title="Batch composition per step")
    bottom.plot(x, [(s["running"], s["waiting"]) for s in steps], drawstyle="steps-post", label=["running", "waiting"])
    bottom.set(xlabel="step", ylabel="sequences")


def plot_block_tables(steps: list[dict], ax: "Axes") -> None:
    entries = [q for s in steps for q in s["seqs"]]  # each sequence's entry in each step it ran in
    tables = {q["id"]: q["block_table"] for q in entries}  # id -> its last (longest) block table
    admissions = {q["id"]: q for q in reversed(entries)}  # id -> its first entry
    # a sequence first seen decoding is a forked beam (beam search): then draw the beams alive at the end, else the
    # first sequences admitted
    forked = any(q["kind"] == "decode" for q in admissions.values())
    ids = ([q["id"] for q in steps[-1]["seqs"]] if forked else list(tables))[:MAX_ROWS]
    longest = max(len(tables[i]) for i in ids)
    # a long table is cut to MAX_CELLS cells: its start, or for beams its end, where they part
    first = max(0, longest - MAX_CELLS) if forked else 0
    padded = [tables[i] + [np.nan] * (longest - len(tables[i])) for i in ids]  # NaN past a table's end
    blocks = np.array(padded)[:, first : first + MAX_CELLS]  # [row, cell]: the block ids shown
    width = blocks.shape[1]
    # Row r's block k is shared when another row holds the same blocks up to k, and one of the two found them cached
    # (its admission started past them) or forked from the other. NaN equals nothing: no sharing past a table's end.
    # (Beams' tables may be cut at their start, but what two beams share is a prefix of both: comparing from the cut
    # finds the same.)
    same = np.logical_and.accumulate(blocks[:, None] == blocks[None], axis=2)  # [row, other row, cell]
    # the blocks each row found at admission, counted from the first cell shown
    hit = np.array([admissions[i]["start"] for i in ids]) // steps[0]["block_size"] - first
    same &= np.arange(width) < np.maximum.outer(hit, hit)[..., None]
    same[np.diag_indices(len(ids))] = False  # a row shares nothing with itself
    for (row, k), block in np.ndenumerate(blocks):  # each cell labelled with its physical block id
        if not np.isnan(block):
            ax.text(k + 0.5, row + 0.5, f"{block:.0f}", ha="center", va="center", fontsize=9 if width <= 16 else 6)
    grid = np.ma.array(same.any(axis=1), mask=np.isnan(blocks))  # shared or not; no cell past a table's end
    # the first two of tab10's ten colours: 0 (private) blue, 1 (shared) orange
    ax.pcolormesh(grid, cmap="tab10", vmin=0, vmax=10, edgecolors="white", linewidth=3)
    ax.set_xticks(np.arange(width) + 0.5, range(first, first + width))
    ax.set_yticks(np.arange(len(ids)) + 0.5, [f"seq {i}" for i in ids])
    ax.invert_yaxis()  # the first row on top
    ax.set(
        xlabel=f"position in the block table (at most {MAX_CELLS} shown, from {first})",
        title="Block tables (physical block ids); orange: shared (a prefix-cache hit, or a forked beam's)",
    )


def plot_host_tier(steps: list[dict], ax: "Axes") -> None:
    totals = [s["offload"] for s in steps]

    def per_step(name: str) -> np.ndarray:  # a running total's increase in each step
        return np.diff([0] + [t[f"kv_offload_{name}"] for t in totals])

    x = np.arange(len(steps))
    ax.bar(x, -per_step("blocks_saved"), width=1.0, color="tab:orange", label="blocks saved to host (leaving)")
    ax.bar(x, per_step("blocks_loaded"), width=1.0, color="tab:green", label="blocks loaded back (returning)")
    ax.plot(x, [t["kv_offload_host_blocks_used"] for t in totals], color="0.3", label="host blocks held")
    preempted = [s["step"] for s in steps if s["preempted"]]
    ax.vlines(preempted, *ax.get_ylim(), color="red", lw=0.8, ls="--", label="preemption" if preempted else None)
    for name, marker, colour in (("swapped", "^", "tab:green"), ("recomputed", "x", "red")):
        readmitted = x[per_step(f"preemptions_{name}") > 0]
        ax.plot(readmitted, np.zeros(len(readmitted)), marker, color=colour, ms=9, label=f"readmitted: {name}")
    ax.axhline(0, color="black", lw=0.5)
    ax.set(xlabel="step", ylabel="blocks", title="Host tier: blocks leaving the device and returning, per step")


def plot_trace(trace_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Write kv_blocks.png, batches.png and block_tables.png for the trace into out_dir; returns their paths."""
    # plain Figures, not pyplot's: drawing into files needs no window, and a caller's pyplot state (its backend, its
    # open figures) stays as it was. Without matplotlib, an ImportError says how to install it
    try:
        import matplotlib.figure
    except ImportError as error:
        raise ImportError("nanoserve.ext.plots needs matplotlib to draw: pip install matplotlib") from error
    steps = [json.loads(line) for line in Path(trace_path).read_text().splitlines()]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    figures = [("kv_blocks", plot_kv_blocks, 1), ("batches", plot_batches, 2), ("block_tables", plot_block_tables, 1)]
    if "offload" in steps[0]:  # a host tier's (kv_offloading_size)
        figures.append(("host_tier", plot_host_tier, 1))
    for name, draw, panels in figures:
        fig = matplotlib.figure.Figure(figsize=(9, 1 + 3 * panels), layout="tight")
        axes = np.atleast_1d(fig.subplots(panels, sharex=True))  # one Axes, or an array of them: an array
        draw(steps, *axes)
        for ax in axes if name != "block_tables" else []:  # the block tables' colours are in their title
            ax.legend(loc="upper right", fontsize=8)
        paths.append(out_dir / f"{name}.png")
        fig.savefig(paths[-1])  # at the figure's dpi, matplotlib's default 100
    return paths
