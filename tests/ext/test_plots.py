"""The step trace and its pictures on a real (tiny) run: a pool small enough to preempt and a shared prefix that
hits the cache. The trace must add up to what stats() says, and plot_trace must write three readable PNGs."""

import importlib
import json
import pathlib
import sys
from functools import partial

import pytest
import torch
from conftest import random_prompts, refused

import nanoserve
from nanoserve import SamplingParams

LLM = partial(nanoserve.LLM, device="cpu", max_model_len=256)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NUM_BLOCKS = 8  # blocks of 16: one request needs 5 at most, the batch about 30


@pytest.fixture(scope="module")
def traced(tiny_model, tmp_path_factory):
    """A shared 40-token prefix computed once, then 6 requests starting with it, in a pool of 8 blocks."""
    path, _ = tiny_model("llama")
    trace = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    torch.manual_seed(0)
    system = random_prompts([40])[0]
    llm = LLM(path, num_kvcache_blocks=NUM_BLOCKS, trace=str(trace))
    llm.generate([system], SamplingParams(max_tokens=1), use_tqdm=False)
    outs = llm.generate([system + q for q in random_prompts([5, 9, 12, 7, 3, 10])], GREEDY, use_tqdm=False)
    return llm, outs, [json.loads(line) for line in trace.read_text().splitlines()], trace


def test_trace_pool_counts_agree_with_stats(traced):
    """Guards against a trace that misreports the pool: block counts taken before the step finished, counters
    double-counted or dropped between steps, or a pool state that does not add up."""
    llm, _, steps, _ = traced
    stats, bm = llm.stats(), llm.block_manager
    assert [s["step"] for s in steps] == list(range(len(steps)))
    last = steps[-1]["blocks"]
    assert (last["used"], last["cached"], last["free"]) == (
        stats["kv_blocks_used"],
        stats["kv_blocks_cached"],
        stats["kv_blocks_free"],
    )
    assert last["used"] == 0 and last["free"] == NUM_BLOCKS and last["cached"] > 0
    used_before = 0
    for s in steps:
        b = s["blocks"]
        assert b["used"] + b["free"] == NUM_BLOCKS and 0 <= b["cached"] <= b["free"]
        # used changes by the fresh blocks handed out, minus those returned, plus the free cached blocks a hit took
        # back from the pool (revived: at most the step's hits)
        assert b["used"] - used_before == b["allocated"] - b["freed"] + b["revived"] and b["revived"] <= b["hit"], s
        used_before = b["used"]
    assert sum(s["blocks"]["revived"] for s in steps) == bm.num_revived > 0  # this run did take some back
    assert sum(s["blocks"]["allocated"] for s in steps) == bm.num_allocated
    assert sum(s["blocks"]["freed"] for s in steps) == bm.num_freed
    assert sum(s["blocks"]["hit"] for s in steps) == bm.num_hit_blocks
    assert max(s["blocks"]["used"] for s in steps) <= stats["kv_blocks_peak"] <= NUM_BLOCKS


def test_trace_steps_agree_with_stats(traced):
    """Guards against a trace that loses or invents work: scheduled tokens, preemptions and prefix hits must sum to
    the engine's own counters, and the run must really have preempted and hit the cache."""
    llm, outs, steps, _ = traced
    stats = llm.stats()
    assert sum(q["tokens"] for s in steps for q in s["seqs"]) == stats["computed_tokens"]
    assert sum(len(s["preempted"]) for s in steps) == stats["preemptions"] > 0
    assert stats["prefix_hit_tokens"] == sum(o.num_cached_tokens for o in outs) == 6 * 32  # 2 blocks of the prefix
    assert sum(s["blocks"]["hit"] for s in steps) * 16 >= stats["prefix_hit_tokens"]  # + hits of recomputes
    for s in steps:
        assert s["kv_tokens"] >= 0 and s["kv_unused_slots"] >= 0 and s["step_ms"] >= 0
        assert all(q["kind"] == "decode" or q["tokens"] >= 1 for q in s["seqs"])
        assert all(len(q["block_table"]) == -(-(q["start"] + q["tokens"]) // 16) for q in s["seqs"])
    assert steps[-1]["running"] == steps[-1]["waiting"] == 0


def test_plot_trace_writes_three_valid_pngs(traced, tmp_path):
    """Guards against plots that crash on a real trace or write files that are not images."""
    pytest.importorskip("matplotlib")
    from PIL import Image

    from nanoserve.ext.plots import plot_trace

    paths = plot_trace(traced[3], tmp_path / "pictures")
    assert [p.name for p in paths] == ["kv_blocks.png", "batches.png", "block_tables.png"]
    for path in paths:
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        with Image.open(path) as image:
            image.load()
            assert image.width >= 400 and image.height >= 200


def test_block_tables_picture_marks_exactly_the_shared_prefix(traced):
    """Guards against a block-table picture that highlights the wrong blocks: the first rows (the warm-up and
    the first requests) share the prefix's 2 blocks and nothing else."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from nanoserve.ext.plots import plot_block_tables

    fig, ax = plt.subplots()
    plot_block_tables(traced[2], ax)
    grid = ax.collections[0].get_array().filled(0).reshape(len(ax.get_yticks()), -1)
    plt.close(fig)
    assert grid.shape[0] == 6 and (grid[:, :2] == 1).all() and not (grid[:, 2:] == 1).any()


def test_trace_off_writes_nothing(tiny_model, tmp_path, monkeypatch):
    """Guards against a trace that costs something when off: the engine must not even import plots.py."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "nanoserve.ext.plots", None)  # importing it now raises
    llm = LLM(tiny_model("llama")[0], num_kvcache_blocks=NUM_BLOCKS)
    llm.generate(random_prompts([20, 30]), GREEDY, use_tqdm=False)
    assert llm.trace is None and llm.config.trace is None and list(tmp_path.iterdir()) == []


def test_plots_without_matplotlib_name_the_install(monkeypatch, traced, tmp_path):
    """Guards against a bare ModuleNotFoundError when the optional extra is missing, and against the trace itself
    needing matplotlib (only drawing does)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "nanoserve.ext.plots", raising=False)
    plots = importlib.import_module("nanoserve.ext.plots")  # the trace writer loads without matplotlib
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plots.plot_trace(traced[3], tmp_path)


# ---- trace=: the option's checks ----------------------------------------------------------------------------------
def test_a_trace_that_cannot_be_written_is_refused_before_the_weights_load(tiny_model, tmp_path, monkeypatch):
    """Guards against a trace path found bad only after the model had loaded, or failing with the OS's own error: a
    folder, a file where a folder should be, and a path in /proc (which looks writable to root, yet nothing can be
    made there) are each an InvalidField naming trace, before any weight is read; checking makes no file."""
    import nanoserve.model_runner

    def fail(*args: object) -> None:
        raise AssertionError("the weights were loaded before the trace was checked")

    monkeypatch.setattr(nanoserve.model_runner, "build_model", fail)
    path, _ = tiny_model("llama")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for trace in (a_file / "trace.jsonl", tmp_path, "", "/proc/self/nowhere/trace.jsonl"):
        refused("trace", LLM, path, trace=trace)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_the_trace_may_be_a_pathlib_path_in_folders_not_made_yet(tiny_model, tmp_path):
    """Guards against trace=pathlib.Path(...) being refused as "not a path", and against the writer not making the
    missing folders."""
    path, _ = tiny_model("llama")
    trace = tmp_path / "runs" / "first" / "trace.jsonl"
    llm = LLM(pathlib.Path(path), num_kvcache_blocks=8, trace=trace)
    assert llm.config.trace == str(trace)
    llm.generate(random_prompts([5]), GREEDY, use_tqdm=False)
    llm.close()
    assert trace.read_text().count("\n") > 0
