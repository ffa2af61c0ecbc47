"""Speculative decoding (nanoserve/ext/speculative.py, and the core's draft tokens: Sequence.num_draft_tokens,
Scheduler.keep_drafts). Exact: greedy output equal to decoding without drafts and to transformers, for n-gram drafts and
draft models (the target as its own draft: everything accepted; an unrelated one: almost nothing), with chunked prefill,
preemption in a tiny pool, shared prefixes, a stop id, a stop string and max_tokens inside an accepted run; sampled
output keeps the target's distribution (seeded requests identical with and without drafts; a chi-square test on a
16-token vocabulary; the rejection rule on hand-made p and q). Nothing left behind: the pool balanced and no block
keyed on an unverified token, over random accept/reject patterns (hypothesis, on the engine's real loop with a fake
model)."""

import random

import numpy as np
import pytest
import torch
from conftest import FAMILIES, FakeEngine, fake_next_token, hf_greedy, reference_completion, refused
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, LlamaConfig

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.ext.speculative import ngram_drafts, rejection_rule

ENGINE = {"device": "cpu", "max_model_len": 256, "num_kvcache_blocks": 64}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SIGNIFICANCE = 1e-6  # a chi-square test fails a correct sampler once in a million runs (at 0.001, the four of
# test_sampled_tokens_follow_the_target_distribution failed about one run in 250)


def repetitive_prompts() -> list[list[int]]:
    """Prompts whose continuations n-gram lookup finds (a repeated pattern), and a plain random one."""
    rng = random.Random(7)
    motif = [rng.randrange(3, 384) for _ in range(6)]
    return [motif * 5, [rng.randrange(3, 384) for _ in range(30)], (motif[:3] + [9, 9]) * 6, motif * 2 + [11, 12]]


def outputs(llm: LLM, prompts: list, params: SamplingParams | list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_nothing_held(llm: LLM, finished: list[list[int]]) -> None:
    """After a run: no request left, every block back in the pool, and every block the prefix cache can find holds
    verified tokens: a block-aligned run of some finished sequence's prompt + output (`finished`; a block keyed on
    a rejected draft would hold tokens no output has there)."""
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and not llm.has_unfinished_requests(), stats
    size = llm.block_manager.block_size
    verified = {tuple(ids[i : i + size]) for ids in finished for i in range(0, len(ids) - size + 1, size)}
    assert llm.block_manager.cached or not llm.config.enable_prefix_caching, "nothing cached: nothing checked"
    for _, tokens in llm.block_manager.cached:
        assert tokens in verified


def chi2_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square goodness of fit of counts to probs, over the tokens probs allows."""
    support = probs > 1e-12
    expected = probs[support] / probs[support].sum() * counts[support].sum()
    assert counts[~support].sum() == 0, "a token the distribution does not allow was drawn"
    return chisquare(counts[support], expected).pvalue


# ---- greedy: identical ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_ngram_greedy_equals_plain_decoding_and_transformers(tiny_model, family):
    """Guards against a draft kept that the model would not have drawn, a rejected draft's K/V read later, or a
    row of samples mixed up: n-gram drafts give the same greedy tokens as decoding without them and as transformers,
    and some drafts are accepted (the prompts repeat)."""
    path, hf = tiny_model(family)
    prompts = repetitive_prompts()
    spec = LLM(path, **ENGINE, speculative_config=NGRAM)
    got = outputs(spec, prompts, GREEDY)
    assert got == [hf_greedy(hf, p, 40) for p in prompts]
    stats = spec.stats()
    assert stats["spec_accepted_tokens"] > 10 and stats["spec_proposed_tokens"] >= stats["spec_accepted_tokens"]
    assert_nothing_held(spec, [p + g for p, g in zip(prompts, got, strict=True)])


@pytest.mark.parametrize(
    "engine",
    [
        {"max_num_batched_tokens": 16},  # chunked prefill beside draft rows, drafts cut to the budget
        {"num_kvcache_blocks": 9, "max_num_batched_tokens": 64},  # preemption: a preempted sequence drops its drafts
        {"enable_prefix_caching": True},  # a second wave takes the first's cached blocks
    ],
    ids=["chunked", "preemption", "prefix"],
)
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_under_chunking_preemption_and_prefix_caching(tiny_model, engine, method):
    """Guards against drafts meeting the scheduler's other paths: cut by the step budget, dropped by a preemption
    (a recompute must not take unverified drafts for tokens), or cached as a prefix before they are verified. For
    n-gram drafts and for a draft model (the target itself: every draft agrees, so runs are long)."""
    path, hf = tiny_model("qwen3")
    prompts = repetitive_prompts()
    proposer = NGRAM if method == "ngram" else {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    llm = LLM(path, **{**ENGINE, **engine}, speculative_config={**proposer, "disable_by_batch_size": 64})
    for _ in range(2):  # the second wave hits the first's cached prefixes
        got = outputs(llm, prompts, GREEDY)
        assert got == [hf_greedy(hf, p, 40) for p in prompts]
        assert_nothing_held(llm, [p + g for p, g in zip(prompts, got, strict=True)])
    if "num_kvcache_blocks" in engine:
        assert llm.stats()["preemptions"] > 0
    assert llm.stats()["spec_accepted_tokens"] > 0


def test_stop_rules_inside_an_accepted_run(tiny_model):
    """Guards against the tokens after a stop being kept because they came in the same step: a stop id, a stop
    string (its tokens' text) and max_tokens inside a run of accepted drafts end the output exactly where decoding
    without drafts ends it."""
    path, hf = tiny_model("llama")
    prompt = repetitive_prompts()[0]
    free = hf_greedy(hf, prompt, 40)
    plain = LLM(path, **ENGINE)
    spec = LLM(path, **ENGINE, speculative_config=NGRAM)
    cases = [
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[free[13]]),
        SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    ]
    finished = []
    for params in cases:
        want = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        got = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), params
        finished.append(prompt + list(got.token_ids))
    assert_nothing_held(spec, finished)


def test_stop_string_inside_an_accepted_run(tiny_model):
    """The same for a stop string, with the default model's tokenizer on the tiny model's ids (its text is what
    the stop string is found in): the output ends at the token that completes it, as without drafts."""
    from conftest import default_model_or_skip

    path, _ = tiny_model("llama")
    tokenizer = default_model_or_skip()
    plain = LLM(path, tokenizer=tokenizer, **ENGINE)
    spec = LLM(path, tokenizer=tokenizer, **ENGINE, speculative_config=NGRAM)
    # a stop string whose first occurrence comes late, after drafts have been accepted: three characters of the
    # output's second half that its first half does not hold
    candidates = []
    for prompt in repetitive_prompts():
        text = plain.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].text
        late = [text[i : i + 3] for i in range(len(text) // 2, len(text) - 3)]
        candidates += [(prompt, stop) for stop in late if text.find(stop) >= len(text) // 2]
    prompt, stop = candidates[0]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    want = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    got = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    assert got.finish_reason == "stop" and spec.stats()["spec_accepted_tokens"] > 0


def test_draft_models_accept_all_or_almost_nothing(tiny_model, tmp_path):
    """Guards against a draft model's proposals changing the output: the target as its own draft (every draft
    accepted) and an unrelated random model of the same vocabulary (almost none accepted) both give the greedy
    output of decoding without drafts; a draft of another vocabulary is refused by name."""
    path, hf = tiny_model("qwen2")
    prompts = repetitive_prompts()
    want = [hf_greedy(hf, p, 40) for p in prompts]
    config = {"method": "draft_model", "num_speculative_tokens": 3}
    itself = LLM(path, **ENGINE, speculative_config={**config, "model": path})
    assert outputs(itself, prompts, GREEDY) == want
    stats = itself.stats()
    assert stats["spec_acceptance_rate"] == 1.0 and stats["spec_mean_accepted_length"] > 2.5, stats
    other = LLM(path, **ENGINE, speculative_config={**config, "model": tiny_model("llama")[0]})
    assert outputs(other, prompts, GREEDY) == want
    assert other.stats()["spec_acceptance_rate"] < 0.3
    torch.manual_seed(3)
    small = LlamaConfig(**{**FAMILIES["llama"]().to_dict(), "vocab_size": 200})
    AutoModelForCausalLM.from_config(small).save_pretrained(tmp_path)
    refused("speculative_config.model", LLM, path, **ENGINE, speculative_config={**config, "model": str(tmp_path)})


# ---- sampling: the target's distribution -----------------------------------------------------------------------
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seeded_sampling_is_identical_with_and_without_drafts(tiny_model, method):
    """Guards against a sampled row drawn with other noise, or a draft kept that the model's draw did not agree with:
    a seeded request's noise depends on its seed and position only, so with drafts its tokens are exactly those
    without, for many seeds, with top-p and with top-k (at temperatures low enough for the tiny model's flat logits
    to repeat themselves, so that drafts are proposed and some accepted)."""
    path, _ = tiny_model("llama")
    prompts = repetitive_prompts()
    plain = LLM(path, **ENGINE)
    proposer = NGRAM if method == "ngram" else {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    spec = LLM(path, **ENGINE, speculative_config={**proposer, "disable_by_batch_size": 64})
    finished = []
    for filters in ({"temperature": 0.05}, {"temperature": 0.1, "top_p": 0.8}, {"temperature": 0.2, "top_k": 5}):
        params = [SamplingParams(**filters, seed=s, max_tokens=24, ignore_eos=True) for s in range(8)]
        batch = [p for p in prompts for _ in range(2)]
        got = outputs(spec, batch, params)
        assert got == outputs(plain, batch, params)
        finished += [p + g for p, g in zip(batch, got, strict=True)]
    assert spec.stats()["spec_accepted_tokens"] > 0
    assert_nothing_held(spec, finished)


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The distribution a request samples from, in plain PyTorch: softmax(logits / T), then top-p (tokens by falling
    probability, kept while the mass before them is below top_p), renormalised."""
    probs = (logits.double() / temperature).softmax(-1)
    sorted_probs, order = probs.sort(-1, descending=True)
    dropped_sorted = sorted_probs.cumsum(-1) - sorted_probs >= top_p
    dropped = torch.zeros_like(dropped_sorted).scatter(-1, order, dropped_sorted)  # back in token order
    probs = probs.masked_fill(dropped, 0)
    return probs / probs.sum(-1, keepdim=True)


@pytest.mark.parametrize("filters", [{"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.7}], ids=["plain", "top_p"])
def test_sampled_tokens_follow_the_target_distribution(tmp_path, filters):
    """Guards against speculation biasing sampling (drafts accepted too often, or the draw after a rejection not
    the model's): on a 16-token vocabulary, the third token after a repetitive prompt (drawn at a draft's row when the
    draft for the second was kept) follows the target's marginal, the sum over t1, t2 of p(t1) p(t2 | t1) p(t3 | t1,
    t2), by a chi-square test; the second token's too. Plain sampling, and with temperature and top-p (a draft is
    kept only if the filtered draw agrees: the filters must apply at draft rows exactly as at the last one)."""
    torch.manual_seed(5)
    config = LlamaConfig(**{**FAMILIES["llama"]().to_dict(), "vocab_size": 16, "initializer_range": 0.3})
    hf = AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_path)
    prompt = [3, 4, 5] * 6 + [3, 4]
    pairs = torch.cartesian_prod(torch.arange(16), torch.arange(16))  # every (t1, t2)
    with torch.no_grad():
        p1 = sampling_probs(hf(torch.tensor([prompt])).logits[0, -1], **filters)  # [16]
        p2 = sampling_probs(hf(torch.tensor([prompt + [t] for t in range(16)])).logits[:, -1], **filters)  # [t1, t2]
        logits3 = hf(torch.cat([torch.tensor([prompt]).expand(256, -1), pairs], 1)).logits[:, -1]
        p3 = sampling_probs(logits3, **filters)  # [pair, t3]
    second = (p1[:, None] * p2).sum(0)
    third = ((p1[:, None] * p2).flatten()[:, None] * p3).sum(0)
    llm = LLM(str(tmp_path), **ENGINE, max_num_seqs=256, speculative_config={**NGRAM, "disable_by_batch_size": 512})
    params = SamplingParams(**filters, max_tokens=3, ignore_eos=True)
    got = outputs(llm, [prompt] * 3000, params)  # twice 1,500: about the power 1,500 draws had at p < 0.001
    for position, marginal in ((1, second), (2, third)):
        counts = np.bincount([tokens[position] for tokens in got], minlength=16)
        assert chi2_p_value(counts, marginal.double().numpy()) > SIGNIFICANCE, position
    assert llm.stats()["spec_accepted_tokens"] > 100


def test_rejection_rule_on_hand_made_distributions():
    """Guards the rule itself: accept with min(1, p/q), draw the rest from max(0, p - q) normalised; the tokens it
    yields follow p (a million simulated draws), for a spread-out q and for a one-token q (the proposers' case)."""
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.2, 0.2, 0.1])
    for q in (np.array([0.1, 0.6, 0.2, 0.1]), np.array([0.0, 1.0, 0.0, 0.0])):
        accepted, residual = rejection_rule(p, q, 1, 0.2)
        assert accepted == (0.2 < min(1, p[1] / q[1]))
        assert np.allclose(residual, np.maximum(p - q, 0) / np.maximum(p - q, 0).sum())
        draws = rng.choice(4, size=200_000, p=q)
        uniforms = rng.random(200_000)
        tokens = []
        for draft, u in zip(draws, uniforms, strict=True):
            ok, rest = rejection_rule(p, q, draft, u)
            tokens.append(draft if ok else rng.choice(4, p=rest))
        assert chi2_p_value(np.bincount(tokens, minlength=4), p) > SIGNIFICANCE
    assert rejection_rule(p, np.array([0.0, 1.0, 0.0, 0.0]), 1, 0.19)[0]  # one-token q: accepted when u < p(draft)
    assert not rejection_rule(p, np.array([0.0, 1.0, 0.0, 0.0]), 1, 0.21)[0]


# ---- nothing left behind: random drafts on the real loop with a fake model --------------------------------------
class RandomDrafts:
    """A proposer for FakeEngine: for each decoding sequence, a few drafts that agree with the fake model for a
    random number of tokens, then disagree (or none at all)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def needs_tokens_on_host(self) -> bool:
        return True

    def propose(self, llm: LLM) -> None:
        for seq in llm.scheduler.running:
            if seq.num_pending or seq.num_uncomputed_tokens != 1 or self.rng.random() < 0.3:
                continue
            tokens, drafts = list(seq.token_ids), []
            for _ in range(self.rng.randrange(1, 6)):
                right = fake_next_token(tokens)
                drafts.append(right if self.rng.random() < 0.7 else (right + 1) % 50)
                tokens.append(drafts[-1])
            seq.token_ids += drafts
            seq.num_draft_tokens = len(drafts)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(12, 60), budget=st.integers(8, 64))
def test_random_drafts_leave_nothing_behind(seed, num_blocks, budget):
    """Guards against a rollback that leaks or double-frees a block, a block keyed on an unverified draft (FakeEngine
    checks after every step that no key holds PENDING, that ref counts match the running sequences' tables, and its
    fake KV cache that every read finds its own prefix), or a kept draft the model would not have drawn: random
    accept/reject patterns, tight pools (preemption) and budgets (chunking, drafts cut), outputs equal the fake
    model's own completions."""
    rng = random.Random(seed)
    engine = FakeEngine(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget)
    engine.llm.proposer = RandomDrafts(rng)
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(1, 20))] for _ in range(5)]
    seqs = [engine.add(p, rng.randrange(1, 25)) for p in prompts]
    engine.run()
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.completion_token_ids == reference_completion(prompt, seq.params.max_tokens)
        assert seq.num_draft_tokens == 0


# ---- the option ------------------------------------------------------------------------------------------------
def test_ngram_lookup():
    """Guards the lookup: the latest earlier occurrence of the longest suffix that k tokens follow, else the earliest;
    nothing where no suffix of at least prompt_lookup_min tokens occurs earlier."""
    assert ngram_drafts([1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3], 2, 3, 1) == [8, 7]
    assert ngram_drafts([5, 5, 5, 5], 3, 2, 1) == [5, 5]  # the earliest run of two 5s: two tokens follow it
    assert ngram_drafts([1, 2, 3, 4], 2, 3, 1) == []
    assert ngram_drafts([4, 1, 2, 3, 9, 1, 2], 2, 3, 2) == [3, 9]
    assert ngram_drafts([4, 1, 2, 3, 9, 7, 2], 2, 3, 2) == []  # a one-token suffix is below prompt_lookup_min


@pytest.mark.parametrize(
    "value, field",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
        (
            {"method": "ngram", "num_speculative_tokens": 0, "prompt_lookup_max": 2},
            "speculative_config.num_speculative_tokens",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2}, "speculative_config.prompt_lookup_max"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
            "speculative_config.prompt_lookup_min",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "draft_tensor_parallel_size": 1},
            "speculative_config.draft_tensor_parallel_size",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        # the other method's keys: refused, not silently ignored
        (
            {"method": "draft_model", "model": "m", "num_speculative_tokens": 2, "prompt_lookup_min": 1},
            "speculative_config.prompt_lookup_min",
        ),
        (
            {"method": "draft_model", "model": "m", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
            "speculative_config.prompt_lookup_max",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "model": "m"},
            "speculative_config.model",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "disable_by_batch_size": 0},
            "speculative_config.disable_by_batch_size",
        ),
        ("{not json", "speculative_config"),
        (["ngram"], "speculative_config"),
    ],
)
def test_bad_speculative_configs_are_refused_by_name(value, field):
    """Guards against an unknown method or key, or a value out of range, being taken or failing late."""
    refused(field, EngineConfig, device="cpu", speculative_config=value)


def test_json_text_and_defaults():
    """The server's --speculative-config JSON is the same dict as text; prompt_lookup_min defaults to 1 and
    disable_by_batch_size to 8 (ordinary chat at larger batches loses with drafts)."""
    config = EngineConfig(
        device="cpu", speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    )
    spec = config.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.disable_by_batch_size) == (
        "ngram",
        3,
        1,
        8,
    )


# ---- where the counts show: the trace, the server ---------------------------------------------------------------
def test_the_trace_counts_each_steps_drafts(tiny_model, tmp_path):
    """Guards against a trace that hides the drafts: each step lists its sequences' drafts (a decode with drafts is
    still a decode), they add up to the proposer's total, and the last line's running totals are stats()'."""
    import json

    pytest.importorskip("nanoserve.ext.plots")
    path, _ = tiny_model("llama")
    trace = tmp_path / "trace.jsonl"
    llm = LLM(path, **ENGINE, speculative_config=NGRAM, trace=str(trace))
    outputs(llm, repetitive_prompts(), GREEDY)
    llm.close()
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    seqs = [q for step in steps for q in step["seqs"]]
    stats = llm.stats()
    assert sum(q["drafts"] for q in seqs) == stats["spec_proposed_tokens"] > 0
    assert all(q["kind"] == "decode" for q in seqs if q["drafts"])
    assert steps[-1]["spec"] == {key: stats[key] for key in steps[-1]["spec"]}
    assert set(steps[-1]["spec"]) == {key for key in stats if key.startswith("spec_")}


def test_the_server_takes_the_flag_and_counts_drafts(tiny_model):
    """Guards against --speculative-config not reaching the engine (the server's flag is its JSON text), and against
    /metrics leaving the drafts out: with it, the proposed and accepted totals and the acceptance rate are there and
    agree with stats()."""
    server = pytest.importorskip("nanoserve.ext.server.app")
    httpx = pytest.importorskip("httpx")
    made = []

    class Stop(Exception):
        pass

    def make(**kwargs):
        made.append(kwargs)
        raise Stop

    path, _ = tiny_model("llama")
    flag = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(server, "LLM", make)
        with pytest.raises(Stop):
            server.main(["--model", path, "--device", "cpu", "--speculative-config", flag])
    assert made[0]["speculative_config"] == flag
    llm = LLM(path, **ENGINE, speculative_config=flag)
    assert llm.config.speculative_config.num_speculative_tokens == 3
    with server.serve_in_background(llm) as base_url:
        (model,) = httpx.get(f"{base_url}/models", timeout=30).json()["data"]
        body = {"model": model["id"], "prompt": repetitive_prompts()[0], "max_tokens": 24, "temperature": 0}
        assert httpx.post(f"{base_url}/completions", json=body, timeout=60).status_code == 200
        text = httpx.get(f"{base_url.removesuffix('/v1')}/metrics", timeout=30).text
    metrics = dict(line.split() for line in text.splitlines() if line and not line.startswith("#"))
    stats = llm.stats()
    assert float(metrics["nanoserve_spec_proposed_tokens_total"]) == stats["spec_proposed_tokens"] > 0
    assert float(metrics["nanoserve_spec_accepted_tokens_total"]) == stats["spec_accepted_tokens"]
    assert float(metrics["nanoserve_spec_acceptance_rate"]) == pytest.approx(stats["spec_acceptance_rate"])


def test_a_bad_draft_folder_is_refused_as_the_draft_model(tiny_model, tmp_path):
    """Guards against a draft model's fault named as the target's (a missing path refused as `model`, a shorter context
    as `max_model_len`) or not named at all (a broken tokenizer raised the tokenizers library's own exception): each is
    an InvalidField naming speculative_config.model, with the reason, and the engine is never made."""
    import shutil

    from transformers import LlamaConfig as Config

    path, _ = tiny_model("llama")
    config = {"method": "draft_model", "num_speculative_tokens": 2}
    missing = refused("speculative_config.model", LLM, path, **ENGINE, speculative_config={**config, "model": "nope"})
    assert "nope" in str(missing)
    short = tmp_path / "short"  # a draft whose context (64) is shorter than the target's max_model_len (256)
    AutoModelForCausalLM.from_config(
        Config(**{**FAMILIES["llama"]().to_dict(), "max_position_embeddings": 64})
    ).save_pretrained(short)
    error = refused("speculative_config.model", LLM, path, **ENGINE, speculative_config={**config, "model": str(short)})
    assert "max_model_len" in str(error)
    broken = tmp_path / "broken"  # the tiny model, with a tokenizer.json that is not JSON
    shutil.copytree(path, broken)
    (broken / "tokenizer.json").write_text("{not json")
    (broken / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    refused("speculative_config.model", LLM, path, **ENGINE, speculative_config={**config, "model": str(broken)})


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_beam_search_runs_as_without_drafts(tiny_model, method):
    """Guards against drafts given to beam search's beams (its driver takes one token per beam and step: a run of kept
    drafts left tokens pending, and the engine found nothing to run): with speculative decoding on, LLM.beam_search
    gives the beams it gives without, and leaves the pool empty."""
    from nanoserve.sampling_params import BeamSearchParams

    path, _ = tiny_model("llama")
    proposer = NGRAM if method == "ngram" else {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    prompts = repetitive_prompts()[:2]
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    plain = LLM(path, **ENGINE).beam_search(prompts, params)
    spec = LLM(path, **ENGINE, speculative_config=proposer)
    beams = spec.beam_search(prompts, params)
    assert [[s.tokens for s in out.sequences] for out in beams] == [[s.tokens for s in out.sequences] for out in plain]
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks
