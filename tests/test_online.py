"""The online API (add_request / step / abort / has_unfinished_requests) on the real engine loop with a fake model
(conftest.FakeRunner): abort frees blocks at once wherever a request is, streaming outputs arrive step by step, and the
overlapped and plain loops agree."""

import random

import pytest
from conftest import FakeEngine, reference_completion

from nanoserve import SamplingParams
from nanoserve.sequence import SequenceStatus


def add(engine, prompt, max_tokens, **kwargs):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kwargs)
    request_id = engine.llm.add_request(prompt, params)
    return request_id, engine.llm.requests[request_id].seqs


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_abort_mid_prefill_frees_blocks_at_once(overlap):
    """Guards against an aborted request keeping its blocks until a later step, or being scheduled again."""
    engine = FakeEngine(block_size=4, max_num_batched_tokens=8, overlap=overlap)
    request_id, (seq,) = add(engine, list(range(40)), 5)
    engine.step()  # its first 8-token chunk
    assert engine.bm.num_used_blocks > 0 and seq.num_computed_tokens < seq.num_prompt_tokens
    engine.llm.abort(request_id)
    assert engine.bm.num_used_blocks == 0 and seq.finish_reason == "abort"
    assert not engine.llm.has_unfinished_requests() and not engine.scheduler.has_unfinished()
    other_id, (other,) = add(engine, [1, 2, 3], 4)
    engine.run()
    assert other.completion_token_ids == reference_completion([1, 2, 3], 4)
    assert all(s is not seq for step in engine.steps[1:] for s, _, _ in step)


def test_abort_while_preempted_and_while_pending():
    """Guards against abort mishandling a preempted sequence (it holds no blocks but waits in the queue) or one
    whose last token is still pending on the device (the in-flight step must not bring it back to life)."""
    rng = random.Random(5)
    engine = FakeEngine(num_blocks=12, block_size=4, max_num_batched_tokens=64, overlap=True)
    ids = [add(engine, [rng.randrange(50) for _ in range(20)], 20)[0] for _ in range(4)]
    preempted = None
    for _ in range(200):
        engine.step()
        preempted = next(
            (s for s in engine.scheduler.waiting if s.num_computed_tokens == 0 and s.num_completion_tokens > 0), None
        )
        if preempted:
            break
    assert preempted is not None, "the pool should force a preemption"
    victim_id = next(i for i in ids if engine.llm.requests[i].seqs[0] is preempted)
    engine.llm.abort(victim_id)
    assert preempted.status == SequenceStatus.FINISHED and preempted not in engine.scheduler.waiting
    pending = next(s for s in engine.scheduler.running if s.num_pending)  # its token is in flight
    engine.llm.abort(next(i for i in ids if i in engine.llm.requests and engine.llm.requests[i].seqs[0] is pending))
    assert pending.num_pending == 0 and pending.block_table == type(pending.block_table)("i")
    engine.run()  # the in-flight step comes back carrying the aborted sequence's token: it must be dropped
    assert pending.finish_reason == "abort" and engine.bm.num_used_blocks == 0
    for request_id in ids:
        if request_id in engine.llm.requests:
            pytest.fail("a request was left behind")


def test_streamed_outputs_arrive_step_by_step():
    """Guards against step() withholding a streaming request's progress, repeating tokens, or returning a
    non-streaming request before it has finished."""
    engine = FakeEngine(block_size=4)
    streamed = engine.llm.add_request([5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.llm.add_request([8, 9], SamplingParams(max_tokens=3, ignore_eos=True), stream=False)
    deltas, finals = [], []
    while engine.llm.has_unfinished_requests():
        for out in engine.llm.step():
            if out.request_id == streamed:
                deltas += out.outputs[0].token_ids_delta
            else:
                finals.append(out)
    assert deltas == reference_completion([5, 6, 7], 5)
    assert len(finals) == 1 and finals[0].finished and finals[0].outputs[0].token_ids == reference_completion([8, 9], 3)


@pytest.mark.parametrize("seed", range(3))
def test_overlap_on_and_off_agree(seed):
    """Guards against the overlapped loop changing any output or leaking, on a random workload that preempts."""
    rng = random.Random(seed)
    requests = [([rng.randrange(50) for _ in range(rng.randint(5, 40))], rng.randint(1, 20)) for _ in range(10)]
    outputs = {}
    for overlap in (False, True):
        engine = FakeEngine(num_blocks=24, block_size=4, max_num_batched_tokens=32, overlap=overlap)
        seqs = [add(engine, p, m)[1][0] for p, m in requests]
        engine.run()
        outputs[overlap] = [s.completion_token_ids for s in seqs]
    assert outputs[False] == outputs[True] == [reference_completion(*r) for r in requests]


def interrupt_once(obj, name: str, on_call: int, run_first: bool):
    """Make obj.name raise KeyboardInterrupt on its on_call-th call from now (after doing its work, if run_first)."""
    original, calls = getattr(obj, name), []

    def interrupted(*args):
        calls.append(1)
        if len(calls) < on_call:
            return original(*args)
        delattr(obj, name)  # once
        if run_first:
            original(*args)
        raise KeyboardInterrupt

    setattr(obj, name, interrupted)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("where", ["schedule", "launch", "finish"])
def test_a_failed_step_leaves_nothing_stale_and_the_engine_serves_on(overlap, where):
    """Guards against a step that raises (a kernel error, Ctrl-C) leaving behind what it had done: blocks booked
    while planning are findable before their K/V exist, so the same prompt sent again would read garbage (the fake
    KV cache catches that); a request finished just before the failure would never be retired; started requests
    would hold blocks for ever. The failure comes while planning (after an admission booked its prompt), before the
    launch, or while finishing (right after a request finished). A request still waiting is kept and finishes
    correctly."""
    engine = FakeEngine(block_size=4, max_num_batched_tokens=64, max_num_seqs=3, overlap=overlap)
    prompt = list(range(3, 16))
    started = [add(engine, [7, 8, 9], 30)[0]]
    engine.step()
    started.append(add(engine, prompt, 6)[0])  # admitted by the failing step or before it
    add(engine, [9, 9, 9], 2)
    waiting_id, (waiting,) = add(engine, [4, 5, 6, 7, 8], 6)  # max_num_seqs=3: not admitted before the failure
    target = {
        "schedule": (engine.scheduler, "_plan", 2, True),
        "launch": (engine.runner, "launch", 1, False),
        "finish": (engine.scheduler, "finish_sequence", 1, True),
    }[where]
    interrupt_once(*target)
    with pytest.raises(KeyboardInterrupt):
        for _ in range(100):
            engine.llm.step()
    assert not set(started) & set(engine.llm.requests) and waiting_id in engine.llm.requests
    assert all(seq.is_queued for r in engine.llm.requests.values() for seq in r.seqs)
    assert engine.bm.num_used_blocks == 0 and not engine.scheduler.running
    _, (again,) = add(engine, prompt, 6)
    engine.run()
    assert again.completion_token_ids == reference_completion(prompt, 6)
    assert waiting.completion_token_ids == reference_completion([4, 5, 6, 7, 8], 6)
