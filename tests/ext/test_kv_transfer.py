"""Prefill and decode on separate engines (ext/kv_transfer): two processes, placed as torchrun places its ranks (RANK,
WORLD_SIZE, MASTER_ADDR:MASTER_PORT; rank 0 hosts the rendezvous store), joined over gloo. The decode engine's outputs
must be a single engine's, token for token (and transformers'), with chunked prefill, prefix caching and n > 1, and it
must never recompute a full prompt block; a peer killed or stopped mid-transfer, and a transfer that never comes, must
each be named within seconds, the requests it held failed with that name, and no block left held on either side."""

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial

import pytest
import torch
from conftest import FakeEngine, extension_or_skip, hf_greedy, random_prompts, reference_completion, refused
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import nanoserve
from nanoserve import SamplingParams
from nanoserve.config import EngineConfig

kv_transfer = extension_or_skip("kv_transfer")
from test_kv_offload import TensorKV  # noqa: E402 (the host tier's fake runner: ext/kv_transfer imports ext/kv_offload)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLM = partial(nanoserve.LLM, device="cpu", max_model_len=256)
ENGINE = {"device": "cpu", "max_model_len": 256, "max_num_batched_tokens": 32}  # prompts of 33+ tokens are chunked
TIMEOUT_S = 240  # a pair's whole run
POLL_S = 0.5  # how often a test waiting for a rank's line looks whether the rank has exited
NAMED_WITHIN_S = 10  # a fault must be named within this (heartbeat_timeout_s below is 3)
PRODUCER = {"kv_role": "kv_producer", "kv_connector_extra_config": {"heartbeat_timeout_s": 3}}
CONSUMER = {"kv_role": "kv_consumer", "kv_connector_extra_config": {"heartbeat_timeout_s": 3}}
# A child process started with stdin=PIPE runs this first: when the test's process is gone (ended by a timeout, or
# killed), its end of the pipe closes and the child exits too, rather than holding ports and cores for ever; the
# fixtures and finally blocks end the children of a test that merely fails.
EXIT_WITH_PARENT = """
import os, sys, threading
def exit_with_parent():
    sys.stdin.read()
    os._exit(3)
threading.Thread(target=exit_with_parent, daemon=True).start()
"""
PRELUDE = (
    EXIT_WITH_PARENT
    + """
import json, sys, time
from nanoserve import LLM, SamplingParams
def say(kind, **what):
    print(kind, json.dumps(what), flush=True)
"""
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pair:
    """Two processes, rank 0 and rank 1, each running its script (PRELUDE first); each line a script prints as
    `KIND {json}` is collected, with when it arrived."""

    def __init__(self, scripts: tuple[str, str]) -> None:
        port = free_port()
        self.lines: list[queue.Queue] = [queue.Queue(), queue.Queue()]
        self.procs = []
        self.collectors = []  # each ends once its rank's stdout has closed and every line is in lines
        self.errors = [tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")]  # a pipe nobody reads could fill
        for rank, script in enumerate(scripts):
            env = dict(
                os.environ,
                PYTHONPATH=REPO,
                RANK=str(rank),
                LOCAL_RANK="0",
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            proc = subprocess.Popen(
                [sys.executable, "-c", PRELUDE + script],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.errors[rank],
                text=True,
                env=env,
                start_new_session=True,
            )
            collector = threading.Thread(target=self.collect, args=(proc, self.lines[rank]), daemon=True)
            collector.start()
            self.collectors.append(collector)
            self.procs.append(proc)

    @staticmethod
    def collect(proc: subprocess.Popen, into: queue.Queue) -> None:
        for line in proc.stdout:
            kind, _, what = line.partition(" ")
            if what.startswith("{"):
                into.put((kind, json.loads(what), time.monotonic()))

    def next(self, rank: int, kind: str) -> tuple[dict, float]:
        """The next `kind` line rank printed (others before it are skipped), and when it came; a rank that has exited
        without printing it fails the test at once."""
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            exited = not self.collectors[rank].is_alive()  # (looked at before the read: every line is in by then)
            try:
                got, what, when = self.lines[rank].get(timeout=POLL_S)
            except queue.Empty:
                if exited:
                    pytest.fail(f"rank {rank} exited before printing {kind}: {self.stderr(rank)}")
                continue
            if got == kind:
                return what, when
        pytest.fail(f"rank {rank} printed no {kind} within {TIMEOUT_S} s: {self.stderr(rank)}")

    def stderr(self, rank: int) -> str:
        """What rank wrote to stderr so far (its end), and whether it is still running."""
        self.errors[rank].seek(0)
        state = "running" if self.procs[rank].poll() is None else f"exit status {self.procs[rank].returncode}"
        return f"({state}) " + self.errors[rank].read()[-4000:]

    def wait(self, rank: int) -> int:
        return self.procs[rank].wait(TIMEOUT_S)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def pair():
    made = []
    yield lambda *scripts: made.append(Pair(scripts)) or made[-1]
    for each in made:
        each.kill()


def prompts_and_params() -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts sharing a 40-token start (prefix caching on both sides), longer than a step's budget (chunked), one of a
    single block (nothing to send) and one with an exact block boundary; greedy and seeded, one and two samples."""
    torch.manual_seed(471)
    shared = random_prompts([40])[0]
    prompts = [shared + p for p in random_prompts([5, 20, 33])] + random_prompts([50, 12, 32])
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=4, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True),
    ]
    return prompts, params


def params_source(params: list[SamplingParams]) -> str:
    fields = ("n", "temperature", "seed", "max_tokens")
    return (
        "["
        + ", ".join(
            f"SamplingParams(ignore_eos=True, {', '.join(f'{f}={getattr(p, f)!r}' for f in fields)})" for p in params
        )
        + "]"
    )


def test_the_pair_equals_one_engine_and_transformers(tiny_model, pair):
    """Guards against K/V that arrives wrong (another prompt's, blocks out of order, a block of the wrong layer or
    half, the last block sent though its logits are needed) or is never used: the decode engine's tokens, greedy and
    seeded, one and two samples, equal one engine's and transformers'; it computes exactly each sequence's last block
    of prompt and its decodes (every full prompt block came over or from its own cache); both pools end empty."""
    path, hf = tiny_model("qwen3")
    prompts, params = prompts_and_params()
    producer = f"""
llm = LLM({path!r}, kv_transfer_config={PRODUCER!r}, **{ENGINE!r})
llm.generate({prompts!r}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
say("DONE", stats=llm.extensions["kv_transfer"].stats(), used=llm.block_manager.num_used_blocks)
llm.extensions["kv_transfer"].link.close(wait_s=120)
"""
    consumer = f"""
llm = LLM({path!r}, kv_transfer_config={CONSUMER!r}, **{ENGINE!r})
outs = llm.generate({prompts!r}, {params_source(params)}, use_tqdm=False)
say("DONE", tokens=[[s.token_ids for s in o.outputs] for o in outs], stats=llm.extensions["kv_transfer"].stats(),
    computed=llm.stats()["computed_tokens"], used=llm.block_manager.num_used_blocks)
llm.extensions["kv_transfer"].link.close(wait_s=120)
"""
    run = pair(producer, consumer)
    sent, _ = run.next(0, "DONE")
    got, _ = run.next(1, "DONE")
    assert run.wait(0) == 0 and run.wait(1) == 0, run.stderr(0) + run.stderr(1)
    one_engine = LLM(path, **ENGINE).generate(prompts, params, use_tqdm=False)
    assert got["tokens"] == [[s.token_ids for s in o.outputs] for o in one_engine]
    assert got["tokens"][0][0] == hf_greedy(hf, prompts[0], 12)
    assert got["tokens"][4][0] == hf_greedy(hf, prompts[4], 12)
    full_blocks = [(len(p) - 1) // 16 for p in prompts]
    assert sent["stats"]["kv_transfer_requests_sent"] == sum(m > 0 for m in full_blocks)
    assert got["stats"]["kv_transfer_requests_loaded"] > 0 and got["stats"]["kv_transfer_blocks_loaded"] > 0
    # each sequence computes its prompt past its full blocks, then max_tokens - 1 decodes
    expected = sum(
        p.n * (len(prompt) - 16 * m + p.max_tokens - 1)
        for prompt, p, m in zip(prompts, params, full_blocks, strict=True)
    )
    assert got["computed"] == expected
    assert sent["used"] == got["used"] == 0


def test_roles_that_cannot_pair_are_refused_on_both_sides(tiny_model, pair):
    """Guards against two decode engines (or two prefill engines) waiting for each other for ever: both refuse at
    start, naming kv_transfer_config and the roles."""
    path, _ = tiny_model("qwen3")
    script = f"""
from nanoserve.checks import InvalidField
try:
    LLM({path!r}, kv_transfer_config={CONSUMER!r}, **{ENGINE!r})
except InvalidField as error:
    say("REFUSED", error=str(error))
"""
    run = pair(script, script)
    for rank in (0, 1):
        refusal, _ = run.next(rank, "REFUSED")
        assert refusal["error"].startswith("kv_transfer_config: kv_role: kv_consumer cannot pair"), refusal
        assert run.wait(rank) == 0


def test_two_kv_both_engines_share_their_prefills(tiny_model, pair):
    """Guards against kv_both doing only one of its two jobs, or waiting: each engine sends the prompts it computes and
    loads what the other sent when it is there. Rank 0 prefills prompts A, which rank 1 decodes from the K/V it loads;
    rank 1 prefills prompts B, which rank 0 decodes the same way; outputs equal one engine's."""
    path, _ = tiny_model("qwen3")
    a, b = random_prompts([40, 70, 33]), random_prompts([50, 20, 36])
    both = {"kv_role": "kv_both"}
    greedy = "SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)"
    helpers = f"""
llm = LLM({path!r}, kv_transfer_config={both!r}, **{ENGINE!r})
def wait_for(count):  # transfers waiting to be loaded here
    deadline = time.monotonic() + 60
    while llm.extensions["kv_transfer"].stats()["kv_transfer_waiting"] < count and time.monotonic() < deadline:
        time.sleep(0.05)
def decode(prompts):
    outs = llm.generate(prompts, {greedy}, use_tqdm=False)
    say("DONE", tokens=[o.outputs[0].token_ids for o in outs], stats=llm.extensions["kv_transfer"].stats(),
        used=llm.block_manager.num_used_blocks)
"""
    first = f"""{helpers}
llm.generate({a!r}, SamplingParams(max_tokens=1), use_tqdm=False)  # sent to rank 1
wait_for(6)  # B, and A again: rank 1 sends what it computes, loaded blocks and all
decode({b!r})
llm.extensions["kv_transfer"].link.close(wait_s=120)
"""
    second = f"""{helpers}
wait_for(3)
decode({a!r})
llm.generate({b!r}, SamplingParams(max_tokens=1), use_tqdm=False)  # sent to rank 0
llm.extensions["kv_transfer"].link.close(wait_s=120)
"""
    run = pair(first, second)
    one_engine = LLM(path, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for rank, prompts in ((0, b), (1, a)):
        done, _ = run.next(rank, "DONE")
        assert done["tokens"] == [o.outputs[0].token_ids for o in one_engine.generate(prompts, params, use_tqdm=False)]
        assert done["stats"]["kv_transfer_requests_loaded"] == len(prompts), done["stats"]
        assert done["used"] == 0
    assert run.wait(0) == 0 and run.wait(1) == 0


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_decode_engine_killed_or_stopped_mid_transfer_is_named(tiny_model, pair, fault):
    """Guards against a prefill engine that goes on computing for a decode engine that is gone (killed: its socket
    closes) or hung (stopped: only the heartbeat tells): its next requests fail within seconds with an error naming the
    decode engine, its pool ends empty, and it exits."""
    path, _ = tiny_model("qwen3")
    prompts = random_prompts([100, 90, 80, 70])
    producer = f"""
llm = LLM({path!r}, kv_transfer_config={PRODUCER!r}, **{ENGINE!r})
deadline = time.monotonic() + {NAMED_WITHIN_S * 6}  # by time: once cached, a batch takes milliseconds
batch = 0
while time.monotonic() < deadline:
    batch += 1
    time.sleep(0.05)
    outs = llm.generate({prompts!r}, SamplingParams(max_tokens=1), use_tqdm=False)
    errors = [o.error for o in outs if o.error is not None]
    say("BATCH", batch=batch, errors=errors)
    if errors:
        break
say("DONE", used=llm.block_manager.num_used_blocks)
llm.extensions["kv_transfer"].link.close(wait_s=1)  # (a stopped peer never says BYE)
"""
    consumer = f"""
llm = LLM({path!r}, kv_transfer_config={CONSUMER!r}, **{ENGINE!r})
time.sleep(1000)
"""
    run = pair(producer, consumer)
    run.next(0, "BATCH")  # blocks are flowing
    os.kill(run.procs[1].pid, fault)
    faulted = time.monotonic()
    while True:
        batch, when = run.next(0, "BATCH")
        if batch["errors"]:
            break
    assert when - faulted < NAMED_WITHIN_S
    assert all(e.startswith("the decode engine (kv_consumer) ") for e in batch["errors"]), batch
    expected = "is gone" if fault == signal.SIGKILL else "stopped answering"
    assert expected in batch["errors"][0]
    done, _ = run.next(0, "DONE")
    assert done["used"] == 0
    assert run.wait(0) == 0, run.stderr(0)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_prefill_engine_killed_mid_request_is_named(tiny_model, pair, policy):
    """Guards against decode requests that wait for ever for K/V from a prefill engine that died: once it is killed,
    each waiting request fails within seconds naming it, and the decode engine's pool ends empty; with
    kv_load_failure_policy "recompute" they are computed here instead, equal to one engine's."""
    path, _ = tiny_model("qwen3")
    prompts = random_prompts([40, 60, 35])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    config = dict(CONSUMER, kv_load_failure_policy=policy)
    producer = f"""
llm = LLM({path!r}, kv_transfer_config={PRODUCER!r}, **{ENGINE!r})
say("READY")
time.sleep(1000)
"""
    consumer = f"""
llm = LLM({path!r}, kv_transfer_config={config!r}, **{ENGINE!r})
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ids = [llm.add_request(p, params, stream=False) for p in {prompts!r}]
say("WAITING", waiting=len(llm.scheduler.waiting))
finished = {{}}
while llm.has_unfinished_requests():
    for out in llm.step():
        finished[out.request_id] = (out.error, out.outputs[0].token_ids)
say("DONE", results=[finished[i] for i in ids], used=llm.block_manager.num_used_blocks, stats=llm.extensions[
    "kv_transfer"].stats())
"""
    run = pair(producer, consumer)
    run.next(0, "READY")
    waiting, _ = run.next(1, "WAITING")
    assert waiting["waiting"] == len(prompts)  # (held by the admission rule until K/V comes)
    time.sleep(1)
    os.kill(run.procs[0].pid, signal.SIGKILL)
    killed = time.monotonic()
    done, when = run.next(1, "DONE")
    assert when - killed < NAMED_WITHIN_S
    assert done["used"] == 0
    if policy == "fail":
        for error, _ in done["results"]:
            assert error.startswith("the prefill engine (kv_producer) "), error
    else:
        expected = LLM(path, **ENGINE).generate(prompts, params, use_tqdm=False)
        assert [tokens for _, tokens in done["results"]] == [o.outputs[0].token_ids for o in expected]
        assert done["stats"]["kv_transfer_recomputed"] == len(prompts)
    assert run.wait(1) == 0, run.stderr(1)


def test_a_transfer_that_never_arrives_fails_at_its_deadline(tiny_model, pair):
    """Guards against a decode request held for ever when its K/V never comes (the prefill engine is alive but never
    ran it): it fails after transfer_timeout_s naming the deadline, while a prompt of one block (nothing to wait for)
    is served; the pool ends empty."""
    path, _ = tiny_model("qwen3")
    config = dict(CONSUMER, kv_connector_extra_config={"transfer_timeout_s": 2, "heartbeat_timeout_s": 3})
    long, short = random_prompts([40, 10])
    producer = f"""
llm = LLM({path!r}, kv_transfer_config={PRODUCER!r}, **{ENGINE!r})
time.sleep(1000)
"""
    consumer = f"""
llm = LLM({path!r}, kv_transfer_config={config!r}, **{ENGINE!r})
started = time.monotonic()
outs = llm.generate([{long!r}, {short!r}], SamplingParams(max_tokens=4), use_tqdm=False)
say("DONE", errors=[o.error for o in outs], seconds=time.monotonic() - started, used=llm.block_manager.num_used_blocks)
llm.extensions["kv_transfer"].link.close()  # the producer, alive, answers BYE: every thread ends, none left at exit
"""
    run = pair(producer, consumer)
    done, _ = run.next(1, "DONE")
    assert done["errors"][0] == "no K/V arrived from the prefill engine (kv_producer) within 2 s"
    assert done["errors"][1] is None
    assert 2 <= done["seconds"] < 2 + NAMED_WITHIN_S
    assert done["used"] == 0
    assert run.wait(1) == 0, run.stderr(1)


def test_options_are_checked_by_name():
    """Guards against a kv_transfer_config that is silently misread: unknown keys, another connector, a role missing
    or unknown, numbers out of range, JSON that does not parse, and the combinations not implemented are refused
    naming kv_transfer_config and the key, before any engine starts; vLLM's defaults are taken."""
    bad = [
        {"kv_role": "kv_consumer", "kv_colour": 1},
        {"kv_role": "kv_consumer", "kv_connector": "NixlConnector"},
        {"kv_connector": "TorchDistributedConnector"},
        {"kv_role": "decode"},
        {"kv_role": "kv_both", "kv_parallel_size": 3},
        {"kv_role": "kv_both", "kv_rank": True},
        {"kv_role": "kv_both", "kv_port": 0},
        {"kv_role": "kv_both", "kv_buffer_size": -1},
        {"kv_role": "kv_both", "kv_load_failure_policy": "retry"},
        {"kv_role": "kv_both", "kv_connector_extra_config": {"transfer_timeout_s": 0}},
        {"kv_role": "kv_both", "kv_connector_extra_config": {"deadline": 5}},
        '{"kv_role": "kv_both"',
        ["kv_role", "kv_both"],
    ]
    for config in bad:
        refused("kv_transfer_config", EngineConfig, device="cpu", kv_transfer_config=config)
    both = {"kv_role": "kv_both"}
    refused("kv_transfer_config", EngineConfig, device="cpu", kv_transfer_config=both, lora_config={"max_loras": 1})
    vllm_defaults = {
        "kv_role": "kv_consumer",
        "kv_connector": "TorchDistributedConnector",
        "kv_parallel_size": 1,
        "kv_ip": "127.0.0.1",
        "kv_port": 14579,
        "kv_buffer_size": 1e9,
        "kv_buffer_device": "cuda",
        "engine_id": "decode-0",
    }
    config = EngineConfig(device="cpu", kv_transfer_config=json.dumps(vllm_defaults))
    assert config.extensions == ("kv_transfer",)


# ---- hypothesis over two fake engines in one process: nothing lost on either side ------------------------------------
class Loopback:
    """The link between two engines of one process: what one sends, the other's side receives at once."""

    def __init__(self) -> None:
        self.other = None  # the receiving KVTransfer

    def start(self, on_message: object, on_failure: object, name: str) -> None:
        self.peer_name = name

    def send(self, tokens: torch.Tensor, kv: torch.Tensor) -> None:
        self.other.on_message(tokens, kv.reshape(-1).view(torch.uint8).clone())

    def close(self, wait_s: float = 0.0) -> None:
        """Nothing to close."""


def fake_side(role: str, num_blocks: int, block_size: int, prefixes: tuple) -> tuple[FakeEngine, object, Loopback]:
    """A FakeEngine whose runner keeps its K/V in a tensor (TensorKV), numbered as the other side's (prefixes), with
    this extension's side connected to a Loopback."""
    engine = FakeEngine(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=6)
    runner = TensorKV(num_blocks, block_size)
    runner.prefixes, runner.numbers = prefixes
    runner.engine = engine.llm
    engine.runner = engine.llm.runner = runner
    options = kv_transfer.Settings(role, None, "127.0.0.1", 1, 1e9, "fail", 1e6, 10.0)
    side = kv_transfer.KVTransfer(engine.llm, options)
    link = Loopback()
    side.connect(engine.llm, link, f"the other side of {role}")
    return engine, side, link


BASES = [[], [1, 2, 1, 2, 1, 2, 0, 1], [2, 2, 1], [1, 2, 1, 2, 2, 2, 2, 1, 0]]  # shared prompt starts


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# found by hypothesis: a request of two samples, both loading the prompt that two prefills sent, took both arrivals,
# and a later request for the same prompt waited for ever
@example(2, 10, 11, [(2, [0, 0], 5, 2, 0, 6), (2, [0, 0], 1, 1, 0, 6), (2, [0], 2, 1, 0, 2), (0, [0], 6, 2, 0, 0)])
@given(
    block_size=st.sampled_from([2, 4]),
    producer_blocks=st.integers(4, 12),
    consumer_blocks=st.integers(4, 12),
    requests=st.lists(
        st.tuples(
            st.integers(0, len(BASES) - 1),  # how its prompt starts
            st.lists(st.integers(0, 2), min_size=1, max_size=8),  # then its own tokens
            st.integers(1, 6),  # max_tokens on the decode side
            st.integers(1, 2),  # n there
            st.integers(0, 10),  # the step it reaches the prefill engine
            st.integers(0, 10),  # the step it reaches the decode engine: before its K/V, or after
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_the_pair_loses_nothing(block_size, producer_blocks, consumer_blocks, requests):
    """Guards against the pair's bookkeeping going wrong where transfers meet prefix caching, chunked prefill, n > 1
    and preemption in tiny pools on both sides: a block held after its request ended, K/V loaded into the wrong block
    or from another prompt (TensorKV reads every position back), a full prompt block computed again on the decode side,
    a transfer neither loaded, waiting nor counted as dropped. Requests reach the two engines in any order; after every
    step both pools are checked (check_pool), at the end both are empty and every output is the fake model's."""
    prefixes = ([None], {None: 0})
    producer, sent, to_consumer = fake_side("kv_producer", producer_blocks, block_size, prefixes)
    consumer, received, to_producer = fake_side("kv_consumer", consumer_blocks, block_size, prefixes)
    to_consumer.other, to_producer.other = received, sent
    arrivals = []  # (step, engine, prompt, params)
    for start, own, max_tokens, n, at_producer, at_consumer in requests:
        prompt = (BASES[start] + own)[:16]
        if -(-(len(prompt) + max_tokens) // block_size) > min(producer_blocks, consumer_blocks):
            continue  # would not fit a pool alone
        arrivals.append((at_producer, 0, prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
        arrivals.append((at_consumer, 1, prompt, SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True)))
    arrivals.sort(key=lambda arrival: arrival[:2])
    decoded = []  # (prompt, the request's sequences, max_tokens) on the decode side
    step = 0
    while arrivals or producer.llm.has_unfinished_requests() or consumer.llm.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step:
            _, side, prompt, params = arrivals.pop(0)
            engine = (producer, consumer)[side]
            request = engine.llm.requests[engine.llm.add_request(prompt, params, stream=False)]
            if side:
                decoded.append((prompt, request.seqs, params.max_tokens))
        producer.step()
        consumer.step()
        step += 1
        assert step < 3000, "no progress"
    assert producer.bm.num_used_blocks == consumer.bm.num_used_blocks == 0
    first_admission = {}  # seq_id -> (order, start) of its first admission on the decode side
    for order, (seq, start, _) in enumerate(consumer.admissions):
        first_admission.setdefault(seq.seq_id, (order, start))
    for prompt, seqs, max_tokens in decoded:
        for seq in seqs:
            assert seq.token_ids[len(prompt) :] == reference_completion(prompt, max_tokens)
        _, start = min(first_admission[seq.seq_id] for seq in seqs)  # the sample admitted first
        assert start == (len(prompt) - 1) // block_size * block_size, "a full prompt block computed on the decode side"
    counts = received.stats()
    loaded_or_left = (
        counts["kv_transfer_requests_loaded"] + counts["kv_transfer_waiting"] + counts["kv_transfer_dropped"]
    )
    assert sent.counts["requests_sent"] == loaded_or_left
