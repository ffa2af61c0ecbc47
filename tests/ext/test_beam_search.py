"""Beam search (nanoserve/beam_search.py) on forked sequences with copy-on-write blocks.

The trusted references: transformers' own beam search (`generate(num_beams=k, num_return_sequences=k,
do_sample=False, length_penalty=..., early_stopping=False)`) on the tiny models and the default model, every beam's
tokens in order; and, for the block bookkeeping, a plain beam search over the fake model's full distributions run
against the FakeEngine, whose fake KV cache checks that every position reads back its own prefix (a missing or
misplaced copy-on-write copy, or a write into a shared block, shows up there)."""

from collections import Counter
from functools import partial

import pytest
import torch
from conftest import (
    FAKE_VOCAB,
    FakeEngine,
    default_model_or_skip,
    fake_logprobs,
    hf_generate,
    hf_greedy,
    random_prompts,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nanoserve
from nanoserve import SamplingParams
from nanoserve.ext.chat import chat_prompts
from nanoserve.sampling_params import BeamSearchParams, InvalidField

LLM = partial(nanoserve.LLM, device="cpu")  # CPU semantics in fp32 on any machine


def hf_beams(hf, prompt, k, max_tokens, length_penalty, eos, early_stopping=False):
    """transformers' k beams, best first, each cut after its EOS (transformers pads the shorter ones)."""
    out = hf_generate(
        hf,
        prompt,
        num_beams=k,
        num_return_sequences=k,
        early_stopping=early_stopping,
        length_penalty=length_penalty,
        max_new_tokens=max_tokens,
        eos_token_id=eos,
    )
    beams = []
    for row in out.tolist():
        generated = row[len(prompt) : len(prompt) + max_tokens]
        if eos is not None and eos in generated:
            generated = generated[: generated.index(eos) + 1]
        beams.append(prompt + generated)
    return beams


TIE = 2e-6  # relative: transformers sums its beams' scores in fp32 (a dozen steps' sum of ~60 may be ~4e-7 of it off),
# nanoserve in fp64, so two scores this close may come in either order


def closest_decision(hf, prompt, k, max_tokens, length_penalty, eos) -> float:
    """The smallest relative gap between two scores that transformers' rule compares in this search, run plainly
    (reference_beam_search) on hf's logprobs summed in fp64."""
    gaps = []

    def hf_logprobs(tokens: list[int]) -> list[float]:
        with torch.no_grad():
            return hf(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1).tolist()

    reference_beam_search(prompt, k, max_tokens, length_penalty, set() if eos is None else {eos}, hf_logprobs, gaps)
    return min(gaps)


def assert_beams_match(ours, hf, prompt, k, max_tokens, length_penalty, eos):
    """ours (each beam's tokens, best first) are transformers' beams, unless the search met a near-tie (closer than
    TIE), which fp32 rounding may decide otherwise: on the tiny Qwen2, whose logits are flat, about one search in
    20,000 (2 of 530 runs of test_beams_match_transformers failed before this rule)."""
    theirs = hf_beams(hf, prompt, k, max_tokens, length_penalty, eos)
    if ours != theirs:
        closest = closest_decision(hf, prompt, k, max_tokens, length_penalty, eos)
        assert closest < TIE, f"beams differ without a near-tie (closest {closest:.2g}): {ours} != {theirs}"


def favourite_token(llm, prompt, k, max_tokens, length_penalty):
    """The token prompt's beams generate most often (EOS ignored): made the EOS, so that beams do end on it."""
    out = llm.beam_search([prompt], BeamSearchParams(k, max_tokens, ignore_eos=True, length_penalty=length_penalty))
    return Counter(t for s in out[0].sequences for t in s.tokens[len(prompt) :]).most_common(1)[0][0]


# (beam_width, max_tokens, length_penalty): widths 1-4, penalties that favour short, neutral and long beams
CASES = [(2, 8, 1.0), (4, 10, 0.5), (3, 12, 2.0), (1, 6, 1.0), (4, 9, -1.0)]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_beams_match_transformers(tiny_model, family):
    """Guards against any departure from transformers' rule: candidate ranking, which EOS candidates finish a beam,
    length normalisation (which length), when the search stops, the order of the beams returned; and against forks
    that share the wrong blocks or a copy-on-write that copies the wrong one (wrong K/V changes the tokens). Eight
    prompts per case, with EOS ignored (the search runs to max_tokens) and with an EOS each prompt's beams like (they
    end on it, and the search may stop early); fresh prompts each run, so a search that meets a near-tie may differ
    (assert_beams_match)."""
    path, hf = tiny_model(family)
    llm = LLM(path, max_model_len=256, num_kvcache_blocks=96, kvcache_block_size=16)
    prompts = random_prompts([3, 9, 14, 16, 17, 30, 33, 5])
    reasons = Counter()
    for k, max_tokens, length_penalty in CASES:
        params = BeamSearchParams(k, max_tokens, ignore_eos=True, length_penalty=length_penalty)
        outs = llm.beam_search(prompts, params)
        for prompt, out in zip(prompts, outs, strict=True):
            assert_beams_match([s.tokens for s in out.sequences], hf, prompt, k, max_tokens, length_penalty, None)
        for prompt in prompts:
            eos = favourite_token(llm, prompt, k, max_tokens, length_penalty)
            llm.eos_token_ids = frozenset({eos})  # what the model's config would say
            out = llm.beam_search([prompt], BeamSearchParams(k, max_tokens, length_penalty=length_penalty))[0]
            assert_beams_match([s.tokens for s in out.sequences], hf, prompt, k, max_tokens, length_penalty, eos)
            assert [s.score for s in out.sequences] == sorted((s.score for s in out.sequences), reverse=True)
            reasons.update(s.finish_reason for s in out.sequences)
            for s in out.sequences:
                assert (s.finish_reason == "stop") == (s.tokens[-1] == eos)
                assert s.score == pytest.approx(s.cum_logprob / (len(s.tokens) - len(prompt)) ** length_penalty)
            llm.eos_token_ids = frozenset()
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert reasons["stop"] > 0 and reasons["length"] > 0


def test_the_rule_is_early_stopping_false(tiny_model):
    """Guards against a test that could not tell the stopping rules apart: on these prompts (a fixed seed: the point
    is the difference) transformers' early_stopping=True and "never" each return other beams than False somewhere,
    and nanoserve returns False's."""
    path, hf = tiny_model("llama")
    llm = LLM(path, max_model_len=256, num_kvcache_blocks=96)
    torch.manual_seed(3)
    prompts = random_prompts([4, 11, 19, 25, 7, 13])
    differs = Counter()
    for k, max_tokens, length_penalty in [(2, 10, 1.0), (3, 16, 3.0)]:
        for prompt in prompts:
            eos = favourite_token(llm, prompt, k, max_tokens, length_penalty)
            llm.eos_token_ids = frozenset({eos})
            out = llm.beam_search([prompt], BeamSearchParams(k, max_tokens, length_penalty=length_penalty))[0]
            ours = [s.tokens for s in out.sequences]
            assert ours == hf_beams(hf, prompt, k, max_tokens, length_penalty, eos, early_stopping=False)
            for rule in (True, "never"):
                differs[rule] += ours != hf_beams(hf, prompt, k, max_tokens, length_penalty, eos, early_stopping=rule)
    assert differs[True] > 0 and differs["never"] > 0


def test_default_model_beams_match_transformers():
    """Guards against a departure that only a real model shows (its EOS, its tokenizer, near-ties of a trained
    distribution): a few chat prompts, every beam's tokens and text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = default_model_or_skip()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    llm = LLM(folder, max_model_len=256, num_kvcache_blocks=64)
    questions = ["What is the capital of France?", "Name a colour.", "Say hello."]
    prompts = chat_prompts(llm, [[{"role": "user", "content": q}] for q in questions])
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=1.0))
    eos = sorted(llm.eos_token_ids)[0]
    for prompt, out in zip(prompts, outs, strict=True):
        assert [s.tokens for s in out.sequences] == hf_beams(hf, prompt, 3, 6, 1.0, eos)
        for s in out.sequences:
            assert s.text == tokenizer.decode(s.tokens[len(prompt) :], skip_special_tokens=True)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_vllm_prompt_dicts():
    """Guards against vLLM's prompt dicts being refused or read wrongly by LLM.beam_search (vLLM's takes
    [{"prompt": text}] and [{"prompt_token_ids": ids}]): each gives the beams of its token ids, and a dict with another
    key is refused by name."""
    folder = default_model_or_skip()
    llm = LLM(folder, max_model_len=128, num_kvcache_blocks=32)
    text = "The sea is"
    ids = llm.get_tokenizer().encode(text)
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    expected = [s.tokens for s in llm.beam_search([ids], params)[0].sequences]
    for prompts in ([{"prompt": text}], [{"prompt_token_ids": ids}], [text, {"prompt_token_ids": ids}]):
        for out in llm.beam_search(prompts, params):
            assert [s.tokens for s in out.sequences] == expected
    with pytest.raises(InvalidField) as error:
        llm.beam_search([{"prompt": text, "multi_modal_data": {}}], params)
    assert error.value.field == "prompt"
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_triton_kernels_copy_on_write(tiny_model, family):
    """Guards against a copy-on-write that only the PyTorch path makes (the copy is on the KV cache both backends
    share): with the Triton kernels (the interpreter on a CPU) and blocks of 16, beams fork inside a partial block
    and copy it; the beams must equal transformers'."""
    path, hf = tiny_model(family)
    llm = nanoserve.LLM(path, kernels="triton", dtype="float32", max_model_len=64, num_kvcache_blocks=16)
    prompt = random_prompts([21])[0]  # 21 tokens: the beams fork inside their second block
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))[0]
    assert [s.tokens for s in out.sequences] == hf_beams(hf, prompt, 3, 5, 1.0, None)


def test_two_ranks_copy_on_write_in_the_worker(tiny_model):
    """Guards against a copy-on-write that only rank 0 makes: with tensor parallelism each rank holds its share of
    every block's KV heads, and the worker learns of the copies only from the step it receives (StepLists'
    block_copies). A worker that skipped them would read stale K/V in its heads, and the beams would differ."""
    path, hf = tiny_model("qwen2")
    llm = LLM(path, tensor_parallel_size=2, max_model_len=128, num_kvcache_blocks=16)
    prompt = random_prompts([21])[0]  # the beams fork inside their second block of 16
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))[0]
    llm.close()
    assert [s.tokens for s in out.sequences] == hf_beams(hf, prompt, 3, 6, 1.0, None)


def test_long_prompt_is_held_once_for_all_beams(tiny_model):
    """Guards against beams that copy the prompt (or leak blocks): a 200-token prompt in blocks of 16 (13 blocks,
    12 full) with 4 beams uses at its peak far fewer blocks than 4 copies of the prompt, in a pool too small to hold
    them; the prompt is computed once (the tokens computed are the prompt plus one per beam and step); every block
    is back in the pool afterwards, and the engine serves a plain request after it."""
    path, hf = tiny_model("llama")
    llm = LLM(path, max_model_len=256, num_kvcache_blocks=30)
    prompt = random_prompts([200])[0]
    k, max_tokens = 4, 8
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=k, max_tokens=max_tokens, ignore_eos=True))[0]
    assert [s.tokens for s in out.sequences] == hf_beams(hf, prompt, k, max_tokens, 1.0, None)
    stats = llm.stats()
    prompt_blocks = 13
    assert stats["kv_blocks_peak"] <= 12 + k * 2 < k * prompt_blocks / 2
    assert stats["computed_tokens"] == 200 + k * (max_tokens - 1)
    assert stats["kv_blocks_used"] == 0 and llm.block_manager.num_free_blocks == 30
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert greedy[0].outputs[0].token_ids == hf_greedy(hf, prompt, 4)


def test_max_model_len_ends_the_search(tiny_model):
    """Guards against beams that run past max_model_len: a 28-token prompt with max_model_len=32 and max_tokens=10
    generates 4 tokens, as transformers with max_new_tokens=4, every beam ending with "length"."""
    path, hf = tiny_model("qwen3")
    llm = LLM(path, max_model_len=32, num_kvcache_blocks=16)
    prompt = random_prompts([28])[0]
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True))[0]
    assert [s.tokens for s in out.sequences] == hf_beams(hf, prompt, 3, 4, 1.0, None)
    assert all(s.finish_reason == "length" for s in out.sequences)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
        ({"beam_width": 2.5, "max_tokens": 4}, "beam_width"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
        ({"beam_width": 2, "max_tokens": 4, "temperature": 0.7}, "temperature"),
        ({"beam_width": 2, "max_tokens": 4, "length_penalty": 11}, "length_penalty"),
        ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty"),
        ({"beam_width": 2, "max_tokens": 4, "ignore_eos": "no"}, "ignore_eos"),
    ],
)
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidField) as error:
        BeamSearchParams(**kwargs)
    assert error.value.field == field


def test_bad_requests_raise_before_work_and_engine_stays_usable(tiny_model):
    """Guards against checks that run after blocks were taken (a leak), or errors that are not InvalidFields: too
    many beams for a step, a search the pool cannot hold, bad prompts and params; and a search started while
    requests are in flight, which the driver refuses (it runs the steps itself)."""
    path, hf = tiny_model("llama")
    llm = LLM(path, max_model_len=256, num_kvcache_blocks=8, max_num_seqs=4)
    prompt = random_prompts([10])[0]
    bad = [
        ([prompt], BeamSearchParams(beam_width=5, max_tokens=4), "beam_width"),  # more than max_num_seqs
        ([prompt], BeamSearchParams(beam_width=4, max_tokens=100), "max_tokens"),  # 1 + 4 x 7 blocks > 8
        (prompt, BeamSearchParams(beam_width=2, max_tokens=4), "prompt"),  # not a list of prompts
        ([[]], BeamSearchParams(beam_width=2, max_tokens=4), "prompt"),
        ([prompt], SamplingParams(), "params"),
    ]
    for prompts, params, field in bad:
        with pytest.raises(InvalidField) as error:
            llm.beam_search(prompts, params)
        assert error.value.field == field
        assert llm.block_manager.num_free_blocks == 8 and not llm.scheduler.has_unfinished()
    llm.add_request(prompt, SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle"):
        llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=4))
    while llm.has_unfinished_requests():
        llm.step()
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))[0]
    assert [s.tokens for s in out.sequences] == hf_beams(hf, prompt, 2, 4, 1.0, None)
    assert llm.block_manager.num_free_blocks == 8


# ---- the block bookkeeping, on the fake engine ----------------------------------------------------
def reference_beam_search(prompt, k, max_tokens, length_penalty, stop_ids, logprobs=fake_logprobs, gaps=None):
    """transformers' rule written plainly over a model's whole distribution (logprobs: a beam's tokens -> every
    token's logprob; the fake model's, all FAKE_VOCAB tokens, by default). With gaps, the relative gap of every pair
    of scores the rule compares is appended to it: at each step the k-th and (k+1)-th candidates (the last to finish
    or go on), the k-th and (k+1)-th that go on, neighbouring finished beams (their order, and which are kept), and
    the best running beam against the worst finished one (the stopping test)."""

    def compared(a: float, b: float) -> None:
        if gaps is not None:
            gaps.append(abs(a - b) / max(abs(a), abs(b), 1e-30))

    beams, finished = [(0.0, list(prompt))], []
    for length in range(1, max_tokens + 1):
        candidates = sorted(
            ((cum + lp, tokens + [t]) for cum, tokens in beams for t, lp in enumerate(logprobs(tokens))),
            key=lambda c: -c[0],
        )
        going_on = [c for c in candidates if c[1][-1] not in stop_ids]
        for ranked in (candidates, going_on):
            if len(ranked) > k:
                compared(ranked[k - 1][0], ranked[k][0])
        for cum, tokens in candidates[:k]:
            if tokens[-1] in stop_ids or length == max_tokens:
                finished.append((cum / length**length_penalty, tokens))
        finished.sort(key=lambda f: -f[0])
        for (a, _), (b, _) in zip(finished, finished[1 : k + 1], strict=False):
            compared(a, b)
        finished, beams = finished[:k], going_on[:k]
        if len(finished) == k and length < max_tokens:
            compared(beams[0][0] / length**length_penalty, finished[-1][0])
        if length == max_tokens or (len(finished) == k and beams[0][0] / length**length_penalty <= finished[-1][0]):
            return [tokens for _, tokens in finished]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.lists(st.integers(3, FAKE_VOCAB - 1), min_size=1, max_size=13),
    block_size=st.sampled_from([1, 2, 4]),
    k=st.integers(1, 4),
    max_tokens=st.integers(1, 9),
    length_penalty=st.sampled_from([-1.0, 0.0, 1.0, 2.0]),
    stop_ids=st.sets(st.integers(3, FAKE_VOCAB - 1), max_size=3),
    spare_blocks=st.integers(0, 3),
    budget=st.sampled_from([4, 7, 512]),
    prefix_caching=st.booleans(),
)
def test_fake_engine_beams_and_blocks(
    prompt, block_size, k, max_tokens, length_penalty, stop_ids, spare_blocks, budget, prefix_caching
):
    """Guards against fork and copy-on-write bookkeeping bugs at every block size: a fork that does not share its
    parent's blocks (or shares without counting), a write into a shared block, a copy missing or into the wrong
    block, a block freed while shared, a pool bound too tight (the search runs in a pool of exactly that bound, plus
    0-3 blocks: a preempted beam would fail the driver's asserts), prompts prefilled in chunks, and a second search
    of the same prompt taking its blocks from the prefix cache. The FakeRunner checks every read; the beams must
    equal the plain reference; the pool is whole afterwards."""
    shared = len(prompt) // block_size  # the prompt's full blocks, held once
    needed = shared + k * (-(-(len(prompt) + max_tokens - 1) // block_size) - shared)
    engine = FakeEngine(
        num_blocks=needed + spare_blocks,
        block_size=block_size,
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        enable_prefix_caching=prefix_caching,
    )
    engine.llm.eos_token_ids = frozenset(stop_ids)
    expected = reference_beam_search(prompt, k, max_tokens, length_penalty, stop_ids)
    for _ in range(2):
        out = engine.llm.beam_search([prompt], BeamSearchParams(k, max_tokens, length_penalty=length_penalty))[0]
        assert [s.tokens for s in out.sequences] == expected
        engine.check_pool()
        assert engine.bm.num_used_blocks == 0 and all(b.ref_count == 0 for b in engine.bm.blocks)
        assert engine.bm.peak_used_blocks <= needed
    if k > 1 and max_tokens > 1 and len(prompt) % block_size and not stop_ids:
        assert any(engine.runner.copies), "beams forked inside a partial block copy it"


def block_table_picture(steps):
    """plot_block_tables' grid (1: shared, 0: private), row labels and first position shown."""
    import matplotlib.pyplot as plt

    from nanoserve.ext.plots import plot_block_tables

    fig, ax = plt.subplots()
    plot_block_tables(steps, ax)
    grid = ax.collections[0].get_array().filled(0).reshape(len(ax.get_yticks()), -1)
    labels = [label.get_text() for label in ax.get_yticklabels()]
    first = int(ax.get_xticklabels()[0].get_text())
    plt.close(fig)
    return grid, labels, first


def test_trace_picture_shows_the_beams_sharing_blocks(tiny_model, tmp_path):
    """Guards against a block-table picture that hides the sharing: after a beam search with a 200-token prompt
    (12 full blocks of 16, then 8 tokens), the rows are the k beams alive at the end, the prompt's full blocks are the
    same physical blocks in every row and marked shared, and each beam's last block, which it writes, is its own."""
    pytest.importorskip("matplotlib")
    import json

    path, _ = tiny_model("llama")
    trace = tmp_path / "trace.jsonl"
    llm = LLM(path, max_model_len=256, num_kvcache_blocks=40, trace=str(trace))
    k = 4
    llm.beam_search(random_prompts([200]), BeamSearchParams(beam_width=k, max_tokens=20, ignore_eos=True))
    llm.close()
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert sum(q["tokens"] for s in steps for q in s["seqs"]) == llm.stats()["computed_tokens"]
    last = steps[-1]["seqs"]
    assert len(last) == k and len({tuple(q["block_table"][:12]) for q in last}) == 1
    assert len({q["block_table"][-1] for q in last}) == k
    grid, labels, first = block_table_picture(steps)
    assert labels == [f"seq {q['id']}" for q in last] and first == 0
    assert (grid[:, :12] == 1).all()
    assert all(grid[i, len(q["block_table"]) - 1] == 0 for i, q in enumerate(last))


def test_trace_picture_of_long_beams_shows_where_they_part():
    """Guards against cutting long beams' tables at their start, where they are all the same prompt: tables of 38
    blocks are drawn from position 6 (the last 32 cells), with the shared part still marked shared."""
    pytest.importorskip("matplotlib")
    table = list(range(38))
    steps = [
        {"seqs": [{"id": 0, "start": 0, "tokens": 600, "block_table": table, "kind": "prefill"}], "block_size": 16},
        {
            "seqs": [
                {"id": 0, "start": 600, "tokens": 1, "block_table": table, "kind": "decode"},
                {"id": 1, "start": 600, "tokens": 1, "block_table": table[:-1] + [99], "kind": "decode"},  # a fork
            ],
            "block_size": 16,
        },
    ]
    grid, labels, first = block_table_picture(steps)
    assert labels == ["seq 0", "seq 1"] and first == 6
    assert (grid[:, :31] == 1).all() and (grid[:, 31] == 0).all()
