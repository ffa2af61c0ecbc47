"""Tests for the scheduler, driven through the engine's real loop (LLM.step: schedule and book, launch, read
back, stop rules, finish; overlapped or not) with conftest's FakeRunner in place of a model, so every test
runs in milliseconds.

The fake model's next token is a fixed function of the whole token list, so the trusted reference for
any request is simply to iterate that function from its prompt: whatever the pool size, budget,
preemptions or prefix hits, every run must produce exactly those tokens. The fake KV cache maps each
physical slot to the token prefix whose K/V it holds; before a step writes a sequence's new positions,
every earlier position must read back its own prefix (a wrong prefix hit, a shared block that gets
written, a stale block table or a block handed out twice all fail there). FakeEngine checks the pool
after every step and that nothing leaked at the end. The tests aim at where chunked prefill, prefix
caching and preemption meet: a fully cached prompt, a preempted sequence that hits its own blocks,
sequences sharing a prefix admitted in one step.
"""

import random

import pytest
from conftest import FAKE_VOCAB, FakeEngine, reference_completion

from nanoserve.sampling_params import SamplingParams
from nanoserve.sequence import Sequence, SequenceStatus

MAX_STEPS = 20_000  # a run that needs more has livelocked


def random_requests(
    rng: random.Random, n: int, prompt_len=(30, 60), max_tokens=(20, 40), num_prefixes=3
) -> list[tuple[list[int], int]]:
    """Prompts that often start with one of a few shared prefixes, so prefix hits happen."""
    prefixes = [[rng.randrange(FAKE_VOCAB) for _ in range(prompt_len[1])] for _ in range(num_prefixes)]
    requests = []
    for _ in range(n):
        length = rng.randint(*prompt_len)
        shared = rng.choice([0, rng.randint(0, length - 1)])
        prompt = rng.choice(prefixes)[:shared] + [rng.randrange(FAKE_VOCAB) for _ in range(length - shared)]
        requests.append((prompt, rng.randint(*max_tokens)))
    return requests


def run_requests(requests, arrivals=None, stop_token_ids=(), **engine_kwargs) -> tuple[FakeEngine, list[list[int]]]:
    """Runs requests through a FakeEngine, each added at its arrival step (default: all at once); returns the
    engine and the requests' outputs."""
    engine = FakeEngine(**engine_kwargs)
    arrivals = arrivals or [0] * len(requests)
    pending = sorted(range(len(requests)), key=lambda i: arrivals[i])
    seqs: dict[int, Sequence] = {}
    step = 0
    while pending or engine.llm.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            seqs[i] = engine.add(*requests[i], stop_token_ids)
        if engine.llm.has_unfinished_requests():
            engine.step()  # the runner checks the budget, the cap and the fake KV cache; FakeEngine the pool
            assert len(engine.scheduler.running) <= engine.scheduler.max_num_seqs
        step += 1
        assert step < MAX_STEPS, "the scheduler stopped making progress"
    engine.run()  # nothing left to run: asserts that no block leaked
    assert all(seq.is_finished for seq in seqs.values())
    return engine, [seqs[i].completion_token_ids for i in range(len(requests))]


def blocks_for(requests, block_size) -> int:
    return max(-(-(len(p) + m) // block_size) for p, m in requests)


# ---- chunked prefill and the budget -------------------------------------------------------------
def test_chunked_prefill_splits_by_budget():
    """Guards against a prompt longer than the budget being scheduled whole (over budget) or split
    wrongly, and against sampling a token after a partial chunk: 20 tokens at budget 8 run as 8, 8, 4,
    and the first output token exists only after the last chunk."""
    engine = FakeEngine(max_num_batched_tokens=8)
    prompt = list(range(20))
    seq = engine.add(prompt, max_tokens=3)
    for expected in (8, 8):
        assert engine.step() == [(seq, expected)]
        assert seq.num_completion_tokens == 0
    assert engine.step() == [(seq, 4)]
    assert seq.num_completion_tokens == 1
    engine.run()
    assert [n for step in engine.steps for _, _, n in step] == [8, 8, 4, 1, 1]
    assert seq.completion_token_ids == reference_completion(prompt, 3)


def test_decodes_ride_with_prefill_chunks():
    """Guards against a long prefill stalling running decodes, or decodes pushing the batch over
    budget: a decoding sequence and a new prompt's chunk share one step, decode first, and the
    chunk takes exactly the rest of the budget."""
    engine = FakeEngine(max_num_batched_tokens=8)
    short = engine.add([1, 2, 3], max_tokens=10)
    engine.step()  # short's prefill; it decodes from now on
    long = engine.add(list(range(30)), max_tokens=2)
    assert engine.step() == [(short, 1), (long, 7)]
    assert engine.step() == [(short, 1), (long, 7)]
    mixed = [step for step in engine.steps if any(n == 1 for _, _, n in step) and any(n > 1 for _, _, n in step)]
    assert len(mixed) == 2
    engine.run()
    assert short.completion_token_ids == reference_completion([1, 2, 3], 10)
    assert long.completion_token_ids == reference_completion(list(range(30)), 2)


def test_max_num_seqs_is_respected():
    """Guards against admitting past max_num_seqs: with a cap of 2, four requests run two at a time,
    the rest wait, and all finish correctly."""
    engine = FakeEngine(max_num_seqs=2)
    requests = [([i, i + 1, i + 2], 5) for i in range(4)]
    seqs = [engine.add(*r) for r in requests]
    engine.step()
    assert len(engine.scheduler.running) == 2 and len(engine.scheduler.waiting) == 2
    while engine.llm.has_unfinished_requests():  # the runner asserts the cap on every launched step
        engine.step()
        assert len(engine.scheduler.running) <= 2
    engine.run()
    assert max(len(step) for step in engine.steps) == 2
    assert [s.completion_token_ids for s in seqs] == [reference_completion(*r) for r in requests]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("seed", range(4))
def test_budget_and_chunks_under_random_load(seed, overlap):
    """Guards against budget or cap overruns, and output drift, when chunks, decodes and arrivals mix
    at random (every launched step is checked against the budget, the cap and the fake KV cache)."""
    rng = random.Random(seed)
    requests = random_requests(rng, 10, prompt_len=(5, 40), max_tokens=(1, 15))
    arrivals = [rng.randint(0, 30) for _ in requests]
    engine, outputs = run_requests(
        requests,
        arrivals,
        max_num_batched_tokens=rng.choice([1, 5, 16, 37]),
        max_num_seqs=rng.choice([1, 3, 8]),
        block_size=rng.choice([1, 4, 16]),
        overlap=overlap,
    )
    assert outputs == [reference_completion(*r) for r in requests]


# ---- preemption ---------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_tiny_pool_preempts_and_matches_unconstrained_run(block_size, enable_prefix_caching, overlap):
    """Guards against preemption by recompute losing or repeating tokens, leaking blocks, or
    livelocking: with a pool of about a tenth of what the batch needs (just enough for the largest
    request), every request finishes, preemptions happen, and outputs equal an unconstrained run's."""
    rng = random.Random(block_size)
    requests = random_requests(rng, 12)
    tiny = blocks_for(requests, block_size)
    total = sum(-(-(len(p) + m) // block_size) for p, m in requests)
    assert tiny <= total // 8
    big, expected = run_requests(
        requests, block_size=block_size, num_blocks=total, enable_prefix_caching=enable_prefix_caching
    )
    small, outputs = run_requests(
        requests,
        block_size=block_size,
        num_blocks=tiny,
        enable_prefix_caching=enable_prefix_caching,
        max_num_batched_tokens=64,
        overlap=overlap,
    )
    assert big.scheduler.num_preemptions == 0
    assert small.scheduler.num_preemptions > 0
    assert outputs == expected == [reference_completion(*r) for r in requests]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_preempted_sequence_hits_its_own_blocks(overlap):
    """Guards against a readmitted sequence reusing its own cached K/V wrongly (stale table, blocks
    overwritten meanwhile, wrong position): distinct prompts, so any hit on readmission is of blocks
    the sequence itself held before preemption; the fake KV check and the outputs must stay right."""
    rng = random.Random(7)
    requests = [
        ([rng.randrange(FAKE_VOCAB) for _ in range(rng.randint(30, 60))], rng.randint(20, 40)) for _ in range(12)
    ]
    engine, outputs = run_requests(
        requests, block_size=4, num_blocks=blocks_for(requests, 4) + 4, max_num_batched_tokens=64, overlap=overlap
    )
    assert outputs == [reference_completion(*r) for r in requests]
    own_hits = 0
    for seq, num_cached, hit_blocks in engine.admissions:
        if num_cached and seq.seq_id in engine.tables_when_preempted:
            last_table = engine.tables_when_preempted[seq.seq_id][-1]
            assert hit_blocks == last_table[: len(hit_blocks)]  # its own blocks, in its own places
            own_hits += 1
    assert engine.scheduler.num_preemptions > 0 and own_hits > 0


def test_overlap_with_stop_tokens_and_preemption():
    """Guards against the overlapped loop mishandling a sequence that stops on a token still pending when the
    next step launched (its extra token must vanish, its blocks return), including one preempted meanwhile."""
    rng = random.Random(8)  # a seed where a preempted sequence's pending token turns out to be a stop token
    requests = random_requests(rng, 12, max_tokens=(10, 40))
    stop = (3, 17)  # 2 of 50 fake tokens: most requests stop early, some run to max_tokens
    engine = FakeEngine(block_size=4, num_blocks=blocks_for(requests, 4) + 2, max_num_batched_tokens=64, overlap=True)
    seqs = [engine.add(*r, stop) for r in requests]
    schedule, preempted = engine.scheduler.schedule, []

    def recording_schedule():  # the engine's own schedule(), noting which sequences each step preempts
        step = schedule()
        preempted[:] = step.preempted
        return step

    engine.scheduler.schedule = recording_schedule
    stopped_while_preempted = 0  # preempted with a pending token that turned out to be a stop token
    while engine.llm.has_unfinished_requests():
        waiting = [seq for seq in engine.scheduler.waiting if seq.num_pending]
        engine.step()  # a sequence preempted in this step has its pending token read back in it too
        stopped_while_preempted += sum(seq.finish_reason == "stop" for seq in set(waiting + preempted))
    engine.run()
    outputs = [seq.completion_token_ids for seq in seqs]
    assert outputs == [reference_completion(*r, stop) for r in requests]
    assert any(out[-1] in stop for out in outputs) and engine.scheduler.num_preemptions > 0
    assert stopped_while_preempted > 0  # the workload reaches the case named above
    assert all(seq.num_pending == 0 and not seq.block_table for seq in seqs)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_prefix_computed_by_a_chunk_serves_the_next_admission(overlap):
    """Guards against prefix blocks becoming findable only once a step is read back: with overlap that is
    after the next step is scheduled, so a request admitted right behind a chunked prefill would miss them."""
    engine = FakeEngine(block_size=4, max_num_batched_tokens=16, overlap=overlap)
    shared = list(range(16))
    a = engine.add(shared + [40, 41, 42, 43], max_tokens=3)
    engine.step()  # a's first chunk: the 16 shared tokens
    b = engine.add(shared + [44, 45, 46, 47], max_tokens=3)
    engine.run()
    assert [cached for seq, cached, _ in engine.admissions if seq is b] == [16]
    assert a.completion_token_ids == reference_completion(shared + [40, 41, 42, 43], 3)
    assert b.completion_token_ids == reference_completion(shared + [44, 45, 46, 47], 3)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_block_completed_by_a_decode_serves_the_next_turn(overlap):
    """Guards against a block whose last token was still pending when its decode was booked never becoming
    findable: with overlap, [1, 2, 3, first output] is computed by a step booked before the first output was
    read back, and the sequence ends without being booked again, so only the read-back (update) can make the
    block findable. A next turn that resends prompt and completion must hit it."""
    engine = FakeEngine(block_size=4, overlap=overlap)
    a = engine.add([1, 2, 3], max_tokens=2)
    engine.run()
    assert engine.tokens_computed(a) == 4
    follow_up = [1, 2, 3] + a.completion_token_ids + [9, 9]
    b = engine.add(follow_up, max_tokens=3)
    engine.run()
    assert b.num_cached_tokens == 4
    assert b.completion_token_ids == reference_completion(follow_up, 3)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_preempted_sequence_keeps_its_last_blocks_cached(overlap):
    """Guards against a sequence preempted right after its first step losing that step's blocks (with overlap
    that step is not read back yet when the preemption happens, so its blocks must be findable from launch on):
    readmitted, it must hit them."""
    engine = FakeEngine(num_blocks=4, block_size=4, max_num_batched_tokens=64, overlap=overlap)
    a = engine.add([1, 2, 3], max_tokens=8)
    engine.step()
    b = engine.add(list(range(100, 109)), max_tokens=2)  # admitted next step, then preempted by a's decodes
    engine.run()
    assert engine.scheduler.num_preemptions > 0
    assert [cached for seq, cached, _ in engine.admissions if seq is b][-1] == 4
    assert a.completion_token_ids == reference_completion([1, 2, 3], 8)
    assert b.completion_token_ids == reference_completion(list(range(100, 109)), 2)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_preempted_prefill_resumes_from_its_cached_chunks(overlap):
    """Guards against a sequence preempted mid-prefill (chunked) restarting wrongly: the older
    request's decodes evict the newer one's partially computed prompt, which is readmitted hitting the
    chunks of its own that are still cached and finishes with the right tokens."""
    engine = FakeEngine(num_blocks=10, block_size=4, max_num_batched_tokens=8, overlap=overlap)
    a = engine.add(list(range(10)), max_tokens=20)  # up to 30 tokens: 8 blocks
    engine.step()
    engine.step()  # a prefilled, decoding
    b = engine.add(list(range(20, 48)), max_tokens=5)  # 28-token prompt, chunks of 7
    preempted_at = []
    while engine.llm.has_unfinished_requests():
        was_running = b.status == SequenceStatus.RUNNING
        computed = b.num_computed_tokens
        engine.step()
        if was_running and b.status == SequenceStatus.WAITING:
            preempted_at.append(computed)
    engine.run()  # nothing left to run: checks that no block leaked
    assert preempted_at and preempted_at[0] < b.num_prompt_tokens
    assert [cached for seq, cached, _ in engine.admissions if seq is b][-1] > 0
    assert a.completion_token_ids == reference_completion(list(range(10)), 20)
    assert b.completion_token_ids == reference_completion(list(range(20, 48)), 5)


# ---- requests that cannot fit -------------------------------------------------------------------
def test_request_that_can_never_fit_is_refused():
    """Guards against accepting a request larger than the whole pool (it would wait forever): add
    raises ValueError, queues nothing, and the engine still serves requests that fit."""
    engine = FakeEngine(num_blocks=4, block_size=4)
    with pytest.raises(ValueError):
        engine.add(list(range(10)), max_tokens=10)  # 20 tokens: 5 blocks
    assert not engine.scheduler.has_unfinished() and not engine.llm.has_unfinished_requests()
    seq = engine.add(list(range(10)), max_tokens=6)  # 16 tokens: 4 blocks, fits exactly
    engine.run()
    assert seq.completion_token_ids == reference_completion(list(range(10)), 6)


def test_prompt_longer_than_max_model_len_is_refused():
    """Guards against check_fits capping a request at max_model_len even when its prompt alone is
    longer: such a prompt needs more blocks than the pool, so without a refusal the scheduler spins
    on empty batches forever. LLM refuses these prompts itself; the scheduler must too."""
    engine = FakeEngine(num_blocks=4, block_size=4, max_model_len=16, max_num_batched_tokens=8)
    with pytest.raises(ValueError):
        engine.add(list(range(20)), max_tokens=2)  # 20 prompt tokens: 5 blocks, pool has 4
    seq = Sequence(list(range(20)), SamplingParams(max_tokens=2, ignore_eos=True), 4)
    with pytest.raises(ValueError):
        engine.scheduler.add(seq)  # the scheduler's own check, behind LLM's
    assert not engine.scheduler.has_unfinished()


# ---- prefix caching -----------------------------------------------------------------------------
def test_second_wave_computes_only_uncached_tokens():
    """Guards against prefix hits that are not really used (tokens recomputed) or that change
    results: the first wave's first request computes a shared 32-token prefix and the other three take
    it in the same step; a second wave after the first has finished computes only its own tails (and
    decodes); outputs are identical with caching on and off."""
    rng = random.Random(3)
    prefix = [rng.randrange(FAKE_VOCAB) for _ in range(32)]
    wave1 = [(prefix + [1, i, 5, 6, 7], 6) for i in range(4)]
    wave2 = [(prefix + [2, i, 9], 6) for i in range(4)]  # tails differ from wave 1's first token on
    outputs = {}
    for caching in (True, False):
        engine = FakeEngine(block_size=4, enable_prefix_caching=caching)
        first = [engine.add(*r) for r in wave1]
        engine.run()
        second = [engine.add(*r) for r in wave2]
        engine.run()
        hit = 32 if caching else 0
        for seq, (prompt, max_tokens) in zip(second, wave2, strict=False):
            assert engine.tokens_computed(seq) == len(prompt) - hit + max_tokens - 1
            assert seq.num_cached_tokens == hit
            assert seq.num_computed_tokens == 0  # freed
        for i, (seq, (prompt, max_tokens)) in enumerate(zip(first, wave1, strict=False)):
            assert engine.tokens_computed(seq) == len(prompt) - (hit if i else 0) + max_tokens - 1
        outputs[caching] = [s.completion_token_ids for s in first + second]
    assert outputs[True] == outputs[False] == [reference_completion(*r) for r in wave1 + wave2]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("budget", [100, 24])
def test_shared_prefix_admitted_in_one_step(budget, overlap):
    """Guards against sharing within one step going wrong: b, admitted in the same step as a, takes the
    four prefix blocks a computes in that very step (every K/V write of a step comes before its reads,
    which the fake KV check enforces), computes only its own tail, and nobody overwrites the other; a
    later request hits the prefix too, and every output is right."""
    prefix = list(range(16))
    engine = FakeEngine(block_size=4, max_num_batched_tokens=budget, overlap=overlap)
    a = engine.add(prefix + [40, 41], max_tokens=4)
    b = engine.add(prefix + [42], max_tokens=4)
    first = engine.step()
    assert first == [(a, 18), (b, 1)] and b.num_cached_tokens == 16
    assert list(b.block_table[:4]) == list(a.block_table[:4]) and b.block_table[4] not in a.block_table
    c = engine.add(prefix + [43, 44, 45], max_tokens=4)
    engine.run()
    assert [s.completion_token_ids for s in (a, b, c)] == [
        reference_completion(prefix + [40, 41], 4),
        reference_completion(prefix + [42], 4),
        reference_completion(prefix + [43, 44, 45], 4),
    ]
    assert any(seq is c and cached == 16 for seq, cached, _ in engine.admissions)


@pytest.mark.parametrize("prompt_len", [16, 17, 3])
def test_fully_cached_prompt_still_computes_and_samples(prompt_len):
    """Guards against a prompt whose every block is cached being admitted with nothing to compute
    (no logits, no first token, or a stuck sequence): the repeat computes at least one token,
    samples, and matches the first run."""
    prompt = list(range(prompt_len))
    engine = FakeEngine(block_size=4)
    first = engine.add(prompt, max_tokens=5)
    engine.run()
    again = engine.add(prompt, max_tokens=5)
    batch = engine.step()
    ((seq, num_new),) = batch
    assert seq is again and num_new >= 1 and again.num_completion_tokens == 1
    assert again.num_cached_tokens == (prompt_len - 1) // 4 * 4
    assert num_new == prompt_len - again.num_cached_tokens
    engine.run()
    assert again.completion_token_ids == first.completion_token_ids == reference_completion(prompt, 5)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_one_token_request_with_cached_prompt(overlap):
    """Guards against the max_tokens=1 path at a full hit: admitted, computes its last block, samples
    one token and finishes in a single launched step, freeing everything."""
    engine = FakeEngine(block_size=4, overlap=overlap)
    engine.add(list(range(8)), max_tokens=1)
    engine.run()
    num_launched = len(engine.steps)
    again = engine.add(list(range(8)), max_tokens=1)
    assert engine.run() == (2 if overlap else 1)  # with overlap, one more step reads it back
    assert len(engine.steps) == num_launched + 1
    assert engine.steps[-1] == [(again, 4, 4)]
    assert again.completion_token_ids == reference_completion(list(range(8)), 1)


def test_num_cached_tokens_survives_later_steps():
    """Guards against the prefix-hit count of a request being lost after admission: LLM reports
    seq.num_cached_tokens in RequestOutput.num_cached_tokens when the request finishes, so it must
    still say how many prompt tokens came from the cache after the request decoded."""
    engine = FakeEngine(block_size=4)
    prompt = list(range(12))
    engine.add(prompt, max_tokens=3)
    engine.run()
    again = engine.add(prompt + [99], max_tokens=3)
    engine.step()
    assert again.num_cached_tokens == 12
    engine.run()
    assert again.finish_reason == "length"
    assert again.num_cached_tokens == 12


@pytest.mark.parametrize("seed", range(3))
def test_caching_on_and_off_agree_under_preemption(seed):
    """Guards against prefix caching or preemption changing any output: the same random workload with
    staggered arrivals, on a tight pool, gives the reference tokens with caching off and on, synchronous
    and overlapped; with caching on, blocks really are hit."""
    rng = random.Random(100 + seed)
    requests = random_requests(rng, 12, prompt_len=(8, 40), max_tokens=(1, 20))
    arrivals = [rng.randint(0, 40) for _ in requests]
    bs = rng.choice([1, 2, 4])
    common = {
        "block_size": bs,
        "num_blocks": blocks_for(requests, bs) + rng.randint(0, 6),
        "max_num_batched_tokens": rng.choice([7, 32]),
        "max_num_seqs": rng.choice([4, 12]),
    }
    expected = [reference_completion(*r) for r in requests]
    preemptions = 0
    for caching in (False, True):
        for overlap in (False, True):
            engine, outputs = run_requests(requests, arrivals, **common, enable_prefix_caching=caching, overlap=overlap)
            assert outputs == expected
            assert (engine.bm.num_hit_blocks > 0) == caching
            preemptions += engine.scheduler.num_preemptions
    assert preemptions > 0


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("seed", range(3))
def test_equal_blocks_under_different_prefixes(seed, overlap):
    """Guards against a prefix hit that matches a block's tokens but not everything before them (what a
    hash collision or a key without the parent's prefix would give): prompts over a two-token vocabulary in
    one-token and two-token blocks repeat the same block contents under many different prefixes; on a tight
    pool with staggered arrivals, every hit must read back its own prefix and every output be the reference."""
    rng = random.Random(200 + seed)
    requests = [([rng.randrange(2) for _ in range(rng.randint(4, 24))], rng.randint(1, 12)) for _ in range(14)]
    arrivals = [rng.randint(0, 30) for _ in requests]
    bs = rng.choice([1, 2])
    engine, outputs = run_requests(
        requests,
        arrivals,
        block_size=bs,
        overlap=overlap,
        num_blocks=blocks_for(requests, bs) + rng.randint(0, 4),
        max_num_batched_tokens=rng.choice([5, 16]),
        max_num_seqs=6,
    )
    assert outputs == [reference_completion(*r) for r in requests]
    keys = list(engine.bm.cached)
    assert len({tokens for _, tokens in keys}) < len(keys)  # equal contents under different prefixes met
    assert engine.bm.num_hit_blocks > 0
