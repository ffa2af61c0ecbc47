"""The host tier (ext/kv_offload.py): blocks the device pool evicts are copied to host memory under their prefix keys
and copied back instead of recomputed. With a real (tiny) model in a device pool small enough to preempt, greedy (and
seeded) outputs must equal one engine's whose pool holds everything, and transformers', whether preemption turns into
swap (room in the host tier), into recompute (a host tier of one block), or the swap rule declines the copy. With the
fake model of conftest.py, hypothesis drives request orders and pool sizes and checks after every step that every block
of both pools is accounted for and that no host block is found under a key whose content it does not hold."""

import json
from functools import partial

import pytest
import torch
from conftest import FakeEngine, FakeRunner, extension_or_skip, hf_greedy, random_prompts, reference_completion, refused
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nanoserve
from nanoserve import SamplingParams
from nanoserve.config import EngineConfig

kv_offload = extension_or_skip("kv_offload")

LLM = partial(nanoserve.LLM, device="cpu", max_model_len=256)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SMALL = {"num_kvcache_blocks": 8, "max_num_batched_tokens": 32}  # blocks of 16: preempts, chunks prompts
ROOMY_GIB = 1e-3  # ~128 host blocks of the tiny model's 8 KiB
ALWAYS_COPY = kv_offload.SwapRule(copy_s_per_token=0.0, recompute_s_per_token=1.0, recompute_s_per_key=0.0)
NEVER_COPY = kv_offload.SwapRule(copy_s_per_token=1.0, recompute_s_per_token=0.0, recompute_s_per_key=0.0)


def token_ids(outputs) -> list[list[list[int]]]:
    return [[sample.token_ids for sample in out.outputs] for out in outputs]


def block_gib(llm) -> float:
    """kv_offloading_size for exactly one host block of this engine's."""
    return llm.runner.kv_cache[:, :, 0].nbytes / kv_offload.GIB


@pytest.fixture(scope="module")
def workload(tiny_model):
    """Six prompts, four sharing a 40-token prefix, and one engine's greedy tokens for them in a pool that holds all."""
    path, hf = tiny_model("qwen3")
    torch.manual_seed(47)
    shared = random_prompts([40])[0]
    prompts = [shared + p for p in random_prompts([5, 20, 33, 9])] + random_prompts([50, 17])
    reference = token_ids(LLM(path).generate(prompts, GREEDY, use_tqdm=False))
    return path, hf, prompts, reference


def check_emptied(llm) -> None:
    """After a run: the device pool holds nothing, and every host slot is in the index or free, once."""
    tier = llm.extensions["kv_offload"]
    assert llm.block_manager.num_used_blocks == 0
    slots = [held.slot for held in tier.index.values()]
    assert sorted(slots + tier.free_slots) == list(range(tier.num_blocks))


def test_swap_equals_one_engine_and_transformers(workload):
    """Guards against wrong K/V coming back from the host tier (a block copied before it was computed, loaded into the
    wrong block, saved after the step overwrote it, or restored under another prefix's key): in a pool of 8 blocks the
    preempted sequences come back by swap, with chunked prefill, and every token equals one engine's in a pool that
    holds everything, and transformers'."""
    path, hf, prompts, reference = workload
    llm = LLM(path, kv_offloading_size=ROOMY_GIB, **SMALL)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    for prompt, expected in zip(prompts[:2], reference, strict=False):
        assert hf_greedy(hf, prompt, GREEDY.max_tokens) == expected[0]
    stats = llm.extensions["kv_offload"].stats()
    assert llm.stats()["preemptions"] > 0
    assert stats["kv_offload_preemptions_swapped"] > 0 and stats["kv_offload_blocks_loaded"] > 0
    assert stats["kv_offload_preemptions_recomputed"] == 0 and stats["kv_offload_blocks_dropped"] == 0
    check_emptied(llm)


def test_a_full_host_tier_turns_preemption_into_recompute(workload):
    """Guards against a host tier that hands out a block it dropped or whose slot it reused (least recently used
    first): with one host block, most preempted sequences recompute, blocks are dropped there all the time, and the
    tokens still equal one engine's."""
    path, _, prompts, reference = workload
    one_block = block_gib(LLM(path, num_kvcache_blocks=1))
    llm = LLM(path, kv_offloading_size=one_block, **SMALL)
    assert llm.extensions["kv_offload"].num_blocks == 1
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    stats = llm.extensions["kv_offload"].stats()
    assert stats["kv_offload_preemptions_recomputed"] > 0 and stats["kv_offload_recomputed_tokens"] > 0
    assert stats["kv_offload_blocks_dropped"] > 0
    check_emptied(llm)


def test_the_swap_rule_declining_recomputes(workload):
    """Guards against a rule that is not followed, or a declined load that still books blocks as computed (their K/V
    never copied): where copying costs more than recomputing, nothing is loaded, found blocks are counted as declined,
    preempted sequences recompute, and the tokens equal one engine's."""
    path, _, prompts, reference = workload
    llm = LLM(path, kv_offloading_size=ROOMY_GIB, **SMALL)
    tier = llm.extensions["kv_offload"]
    tier.rule = NEVER_COPY
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    stats = tier.stats()
    assert stats["kv_offload_blocks_loaded"] == 0 and stats["kv_offload_blocks_declined"] > 0
    assert stats["kv_offload_preemptions_swapped"] == 0 and stats["kv_offload_preemptions_recomputed"] > 0
    check_emptied(llm)


def test_n_samples_with_seeds_equal_one_engine(workload):
    """Guards against samples of one request (n > 1, sharing their prompt's blocks) reading each other's or stale K/V
    after a swap: two seeded samples per prompt, and greedy pairs, equal one engine's in a pool that holds all."""
    path, _, prompts, _ = workload
    params = [
        SamplingParams(n=2, temperature=0.8, seed=i, max_tokens=16, ignore_eos=True) for i in range(len(prompts) - 2)
    ] + [SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True)] * 2
    expected = token_ids(LLM(path).generate(prompts, params, use_tqdm=False))
    llm = LLM(path, kv_offloading_size=ROOMY_GIB, **SMALL)
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
    assert llm.extensions["kv_offload"].stats()["kv_offload_blocks_loaded"] > 0
    check_emptied(llm)


def chat_turns(llm, conversations: list[list[int]], num_turns: int, params: SamplingParams) -> list[list[int]]:
    """Each turn sends every conversation whole (its history, the answer, and a new user message of 6 tokens), one
    after another; returns every answer, in order."""
    answers = []
    for turn in range(num_turns):
        for i, history in enumerate(conversations):
            torch.manual_seed(1000 * turn + i)
            history += random_prompts([6])[0]
            answer = llm.generate([history], params, use_tqdm=False)[0].outputs[0].token_ids
            history += answer
            answers.append(answer)
    return answers


def test_multi_turn_chat_loads_instead_of_recomputing(tiny_model):
    """Guards against a host tier that does not serve prefix hits (only swap): three conversations take turns in a
    device pool that holds about one, so each turn's history was evicted by the others; with the host tier it comes
    back from host memory (fewer prompt tokens computed), and every answer equals the one without."""
    path, _ = tiny_model("llama")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    runs = {}
    for gib in (None, ROOMY_GIB):
        llm = LLM(path, num_kvcache_blocks=6, kv_offloading_size=gib)
        torch.manual_seed(3)
        answers = chat_turns(llm, random_prompts([30, 26, 35]), 3, params)
        runs[gib] = (answers, llm.stats()["computed_tokens"], llm.extensions.get("kv_offload"))
    (plain, plain_computed, _), (offloaded, computed, tier) = runs[None], runs[ROOMY_GIB]
    assert offloaded == plain
    assert tier.stats()["kv_offload_blocks_loaded"] > 0
    assert computed < plain_computed - tier.stats()["kv_offload_blocks_loaded"] * 16 // 2


def test_the_trace_says_what_left_and_what_came_back(workload, tmp_path):
    """Guards against a trace that misses the host tier: every step line carries its running totals, the last equal
    to stats(), and plot_trace draws host_tier.png."""
    path, _, prompts, _ = workload
    trace = tmp_path / "trace.jsonl"
    llm = LLM(path, kv_offloading_size=ROOMY_GIB, trace=str(trace), **SMALL)
    llm.generate(prompts, GREEDY, use_tqdm=False)
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert all("offload" in step for step in steps)
    assert steps[-1]["offload"] == llm.extensions["kv_offload"].stats()
    saved = [s["offload"]["kv_offload_blocks_saved"] for s in steps]
    assert saved == sorted(saved) and saved[-1] > 0
    plots = pytest.importorskip("nanoserve.ext.plots")
    pytest.importorskip("matplotlib")
    written = plots.plot_trace(trace, tmp_path / "plots")
    assert [p.name for p in written][-1] == "host_tier.png" and written[-1].stat().st_size > 0


def test_options_are_checked_by_name(tiny_model):
    """Guards against options that are silently ignored or fail late: another backend, a size that is not a positive
    number, a tier without prefix caching, two connectors, and a size that holds no block are each refused naming
    their field; the backend alone asks for no tier, as in vLLM."""
    path, _ = tiny_model("llama")
    refused("kv_offloading_backend", EngineConfig, device="cpu", kv_offloading_backend="lmcache")
    refused("kv_offloading_size", EngineConfig, device="cpu", kv_offloading_size=0)
    refused("kv_offloading_size", EngineConfig, device="cpu", kv_offloading_size="1")
    refused("kv_offloading_size", EngineConfig, device="cpu", kv_offloading_size=1, enable_prefix_caching=False)
    two = {"kv_offloading_size": 1, "kv_transfer_config": {"kv_role": "kv_both"}}
    refused("kv_offloading_size", EngineConfig, device="cpu", **two)
    refused("kv_offloading_size", LLM, path, kv_offloading_size=1e-12)
    llm = LLM(path, kv_offloading_backend="native")
    assert llm.extensions["kv_offload"] is None and llm.scheduler.kv_connector is None


@settings(max_examples=300, deadline=None)
@given(
    start=st.integers(0, 500),
    num_tokens=st.integers(1, 200),
    costs=st.tuples(*[st.floats(0, 1e-3, allow_nan=False)] * 3),
)
def test_the_swap_rule_counts_every_key_once(start, num_tokens, costs):
    """Guards against the rule's closed form miscounting the attention it saves (each recomputed token attends to
    itself and every token before it): it agrees with a sum over the positions, wherever the two differ clearly."""
    rule = kv_offload.SwapRule(*costs)
    copy_s, token_s, key_s = costs
    recompute_s = sum(token_s + (p + 1) * key_s for p in range(start, start + num_tokens))
    if abs(num_tokens * copy_s - recompute_s) > 1e-9 * max(recompute_s, 1e-12):
        assert rule.copy_beats_recompute(start, num_tokens) == (num_tokens * copy_s < recompute_s)


# ---- hypothesis over the fake model: nothing lost, nothing found under the wrong key ---------------------------------
class TensorKV(FakeRunner):
    """conftest's FakeRunner with its fake K/V in a tensor the host tier copies, [K or V, layer, block, slot, head,
    head_dim] = [2, 1, blocks, block_size, 1, 1]: each slot holds the number of the token prefix whose K/V it holds (0:
    none), in both halves. Its dict (what FakeRunner's checks read: every earlier position must read back its own
    prefix) is read from the tensor before each step, after the step hooks made their copies, and written back after,
    before the output hooks run (their finishers at once: on a CPU the copies they queued are complete)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks)
        self.kv_cache = torch.zeros(2, 1, num_blocks, block_size, 1, 1, dtype=torch.float64)
        self.on_gpu = False
        self.step_hooks = []
        self.output_hooks = []
        self.prefixes = [None]  # number -> token prefix
        self.numbers = {None: 0}

    def number(self, prefix: tuple | None) -> int:
        if prefix not in self.numbers:
            self.numbers[prefix] = len(self.prefixes)
            self.prefixes.append(prefix)
        return self.numbers[prefix]

    def launch(self, step, previous, processors):
        for hook in self.step_hooks:
            hook(step)
        k, v = self.kv_cache.reshape(2, -1).tolist()  # [K or V, slot]
        assert k == v
        self.kv = {slot: self.prefixes[int(n)] for slot, n in enumerate(k) if n}
        launched = super().launch(step, previous, processors)
        numbers = [0.0] * len(k)
        for slot, prefix in self.kv.items():
            numbers[slot] = self.number(prefix)
        self.kv_cache[:] = torch.tensor(numbers, dtype=torch.float64).view(self.kv_cache.shape[2:])
        for hook in self.output_hooks:
            finish = hook(step, None)
            if finish is not None:
                finish()
        return launched


def check_tiers(engine: FakeEngine, tier, named: dict) -> None:
    """Every host slot in the index or free, once; every host block holds, slot by slot, the K/V of the token prefix its
    key names: its own tokens after the prefix its parent's prefix id names (the device's names, learned from every
    keyed device block, never changing), or after nothing for a first block."""
    runner, bm = engine.runner, engine.bm
    size = bm.block_size
    for block in bm.blocks:
        if block.key is not None:
            last = runner.kv.get(block.block_id * size + size - 1)
            assert named.setdefault(block.prefix_id, last) == last, f"prefix id {block.prefix_id} renamed"
    slots = [held.slot for held in tier.index.values()]
    assert sorted(slots + tier.free_slots) == list(range(tier.num_blocks)), "a host slot lost or held twice"
    for (parent, tokens), held in tier.index.items():
        content = [runner.prefixes[int(n)] for n in tier.blocks[held.slot, 0, 0, :, 0, 0].tolist()]
        assert (tier.blocks[held.slot, 0] == tier.blocks[held.slot, 1]).all()
        prefix = content[-1]
        assert prefix is not None and prefix[len(prefix) - size :] == tokens, (held, content)
        assert content == [prefix[: len(prefix) - size + j + 1] for j in range(size)], content
        assert named.get(parent, ()) == prefix[: len(prefix) - size], "a host block under another prefix's key"


BASES = [[], [1, 2, 1, 2, 1, 2, 0], [2, 2, 1], [1, 2, 1, 2, 2, 2, 2, 1, 0]]  # shared prompt starts


def prompts_of(requests: list[tuple], block_size: int, num_blocks: int) -> list[tuple[int, list[int], int]]:
    """(arrival step, prompt, max_tokens) per request that fits the pool alone, by arrival. A prompt starts with one of
    BASES, or, as a chat's next turn does, with an earlier request's prompt and its answer."""
    made = []
    for start, own, max_tokens, arrival in requests:
        head = BASES[start % len(BASES)]
        if start >= len(BASES) and made:
            _, earlier, earlier_max = made[start % len(made)]
            head = earlier + reference_completion(earlier, earlier_max)
        prompt = (head + own)[:16]
        if -(-(len(prompt) + max_tokens) // block_size) <= num_blocks:
            made.append((arrival, prompt, max_tokens))
    return sorted(made, key=lambda request: request[0])


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 2, 2, 4]),
    num_blocks=st.integers(4, 12),
    host_blocks=st.integers(1, 12),
    overlap=st.booleans(),
    copies=st.sampled_from([ALWAYS_COPY, ALWAYS_COPY, NEVER_COPY]),
    requests=st.lists(
        st.tuples(
            st.integers(0, 2 * len(BASES) - 1),  # how it starts: one of BASES, or an earlier request and its answer
            st.lists(st.integers(0, 2), min_size=1, max_size=8),  # then its own tokens
            st.integers(1, 8),  # max_tokens
            st.integers(0, 20),  # the step it arrives before
        ),
        min_size=1,
        max_size=10,
    ),
)
def test_nothing_lost_and_nothing_found_under_a_wrong_key(
    block_size, num_blocks, host_blocks, overlap, copies, requests
):
    """Guards against the bookkeeping of two pools going wrong where preemption, prefix hits, chunked prefill and the
    host tier meet: a host slot leaked or given to two blocks, a block saved after its step wrote it or loaded after its
    slot was reused, a chain restored under the wrong prefix id, a booked block never filled. Requests sharing prompt
    starts (or a chat's earlier turn) arrive over the first steps into a tiny device pool with a tiny host tier; after
    every step both pools are checked (check_pool, check_tiers), and every output equals the fake model's."""
    engine = FakeEngine(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=6, overlap=overlap)
    runner = TensorKV(num_blocks, block_size)
    runner.engine = engine.llm
    engine.runner = engine.llm.runner = runner
    tier = kv_offload.HostTier(engine.bm, runner, host_blocks, copies)
    tier.connect(engine.llm)
    arrivals = prompts_of(requests, block_size, num_blocks)
    added, named, step = [], {}, 0
    while arrivals or engine.llm.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step:
            _, prompt, max_tokens = arrivals.pop(0)
            added.append((engine.add(prompt, max_tokens), prompt, max_tokens))
        engine.step()
        check_tiers(engine, tier, named)
        step += 1
        assert step < 2000, "no progress"
    assert engine.bm.num_used_blocks == 0
    for seq, prompt, max_tokens in added:
        assert seq.token_ids[len(prompt) :] == reference_completion(prompt, max_tokens)
