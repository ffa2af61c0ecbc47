"""Tensor parallelism on the CPU: two ranks over gloo (the engine process and one worker it starts). The split model
must give the same greedy tokens as one rank and as transformers, with prefix caching and preemption; failures in a
worker, at start-up or in a step, must surface within seconds as errors naming it and what happened, and nothing may
outlive the LLM. A GPU test runs NCCL with two GPUs. Running over torchrun is in test_torchrun.py."""

import gc
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import hf_greedy, random_prompts

import nanoserve.ext.tp.workers
from nanoserve import LLM, SamplingParams
from nanoserve.ext.tp.workers import HEADER_LEN, buffer_len, header_ints, header_of
from nanoserve.sampling_params import InvalidField
from nanoserve.step_inputs import NUM_PARTS

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ENGINE = {"device": "cpu", "max_model_len": 128, "max_num_batched_tokens": 64}
REPORT_BOUND_S = 10  # a worker's failure must be reported within this
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPORTS_THIS_CHECKOUT = dict(os.environ, PYTHONPATH=REPO)  # for scripts run in a subprocess


@pytest.fixture
def started(monkeypatch):
    """Every worker process nanoserve starts during the test, in order."""
    procs = []
    popen = subprocess.Popen

    def recording_popen(*args, **kwargs):
        procs.append(popen(*args, **kwargs))
        return procs[-1]

    monkeypatch.setattr(nanoserve.ext.tp.workers.subprocess, "Popen", recording_popen)
    return procs


def wait_until_exited(procs: list, timeout_s: float = 20.0) -> list:
    """The processes still running after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in procs if p.poll() is None]


def generate_in_thread(llm: LLM, result: dict) -> threading.Thread:
    """A long generate in a thread; its RuntimeError's message lands in result["error"]."""

    def generate():
        try:
            params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
            llm.generate(random_prompts([20] * 8), params, use_tqdm=False)
        except RuntimeError as e:
            result["error"] = str(e)

    thread = threading.Thread(target=generate)
    thread.start()
    return thread


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "llama_bias"])
def test_two_ranks_equal_one_rank_and_transformers(tiny_model, family, started):
    """Guards against any sharding bug (a wrong slice of q/k/v or gate/up, the row-parallel all-reduce, the bias
    added twice, the vocab-split embedding or logits, the KV heads per rank, a step's header, inputs or last samples
    not reaching the worker): greedy tokens with prefix hits (a second wave sharing a prompt prefix) and preemption (a
    pool of 5 blocks of 16) equal one rank's and transformers'; no block leaks and the worker exits on close."""
    path, hf = tiny_model(family)
    shared = random_prompts([33])[0]
    waves = [[shared + p for p in random_prompts([4, 9])], [shared + p for p in random_prompts([6, 2, 11])]]
    outputs = {}
    for size in (1, 2):
        llm = LLM(path, tensor_parallel_size=size, num_kvcache_blocks=5, **ENGINE)
        outputs[size] = [[o.outputs[0].token_ids for o in llm.generate(w, GREEDY, use_tqdm=False)] for w in waves]
        stats = llm.stats()
        assert stats["preemptions"] > 0 and stats["prefix_hit_tokens"] >= 3 * 32 and stats["kv_blocks_used"] == 0
        llm.close()
    assert outputs[2] == outputs[1] == [[hf_greedy(hf, p, 10) for p in w] for w in waves]
    assert len(started) == 1 and started[0].returncode == 0  # stopped by close(), not killed


def test_killed_worker_makes_generate_raise_not_hang(tiny_model, started):
    """Guards against the engine waiting for ever on a dead rank: the worker is killed in the middle of a long
    generate, which must raise an error naming the rank and the signal within seconds and leave no process behind."""
    path, _ = tiny_model("llama")
    llm = LLM(path, tensor_parallel_size=2, num_kvcache_blocks=32, **ENGINE)
    result = {}
    generating = generate_in_thread(llm, result)
    time.sleep(0.5)
    killed_at = time.monotonic()
    started[0].kill()
    generating.join(timeout=120)
    assert not generating.is_alive(), "generate hung after a worker died"
    assert time.monotonic() - killed_at < REPORT_BOUND_S
    assert "rank 1 was killed by SIGKILL" in result.get("error", ""), result
    llm.close()
    assert wait_until_exited(started) == []


def test_stopped_worker_is_named_within_the_step_deadline(tiny_model, started, monkeypatch):
    """Guards against a hung worker (alive, not answering) hanging the engine until an idle timeout, then failing
    with an error that names no rank: the worker is stopped (SIGSTOP) in the middle of a generate; with a step
    deadline of 2 s the error names rank 1 within deadline + 2 s of heartbeat watching, and the worker is killed."""
    monkeypatch.setenv("NANOSERVE_TP_STEP_TIMEOUT_S", "2")  # read by every rank once its runner is built
    path, _ = tiny_model("llama")
    llm = LLM(path, tensor_parallel_size=2, num_kvcache_blocks=32, **ENGINE)
    result = {}
    generating = generate_in_thread(llm, result)
    time.sleep(0.5)
    stopped_at = time.monotonic()
    os.kill(started[0].pid, signal.SIGSTOP)
    generating.join(timeout=120)
    assert not generating.is_alive(), "generate hung after a worker stopped"
    assert time.monotonic() - stopped_at < REPORT_BOUND_S
    assert "rank 1 stopped answering" in result.get("error", ""), result
    llm.close()
    assert wait_until_exited(started) == []


def test_idle_workers_outlive_the_step_deadline(tiny_model, started, monkeypatch):
    """Guards against a server's workers dying of idleness: a step's collective that waits longer than the step
    deadline fails, so workers must wait for the next step elsewhere (the host group, without deadline). With a 2 s
    deadline, an engine idle for 5 s still answers."""
    monkeypatch.setenv("NANOSERVE_TP_STEP_TIMEOUT_S", "2")
    path, hf = tiny_model("qwen2")
    llm = LLM(path, tensor_parallel_size=2, num_kvcache_blocks=16, **ENGINE)
    prompts = random_prompts([7, 3])
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    time.sleep(5)
    assert started[0].poll() is None, "a worker died while idle"
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert (
        [o.outputs[0].token_ids for o in again]
        == [o.outputs[0].token_ids for o in first]
        == [hf_greedy(hf, p, 10) for p in prompts]
    )
    llm.close()
    assert wait_until_exited(started) == []


def test_interrupted_step_stops_the_workers_and_says_so(tiny_model, started):
    """Guards against Ctrl-C in the middle of a tensor-parallel step leaving the worker waiting inside the step's
    collectives (the next generate would hang until their timeout): the interrupt reaches the caller, the worker is
    stopped at once, and the next call raises an error saying why instead of hanging."""
    path, _ = tiny_model("llama")
    llm = LLM(path, tensor_parallel_size=2, num_kvcache_blocks=16, **ENGINE)
    runner = llm.runner

    def interrupted(*args):  # rank 0 stops after waking the worker and broadcasting the step's inputs
        del runner.execute
        raise KeyboardInterrupt

    runner.execute = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(random_prompts([5]), GREEDY, use_tqdm=False)
    assert wait_until_exited(started, timeout_s=5) == []
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="stopped by an earlier failure"):
        llm.generate(random_prompts([5]), GREEDY, use_tqdm=False)
    assert time.monotonic() - began < 5 and llm.stats()["kv_blocks_used"] == 0
    llm.close()


def test_an_error_of_the_engine_is_not_blamed_on_its_workers(tiny_model, started):
    """Guards against naming a healthy worker as the cause of rank 0's own failure: rank 0 raises in the middle of a
    step while its worker waits inside the step's collectives, still beating; the caller gets rank 0's own error,
    and the worker is stopped."""
    path, _ = tiny_model("llama")
    llm = LLM(path, tensor_parallel_size=2, num_kvcache_blocks=16, **ENGINE)

    def broken(*args):
        raise RuntimeError("a bug in rank 0")

    llm.runner.execute = broken
    with pytest.raises(RuntimeError, match="a bug in rank 0"):
        llm.generate(random_prompts([5]), GREEDY, use_tqdm=False)
    assert wait_until_exited(started, timeout_s=5) == []
    llm.close()


def test_error_inside_a_worker_names_the_rank(tiny_model, started):
    """Guards against a worker's exception being lost (the engine would see only a broken connection): a step of 2
    sequences with 5 block-table entries cannot be cut into rows, which fails inside the worker, and the engine's
    next call raises with that rank and its traceback. The garbage-collected LLM then leaves no process behind."""
    path, _ = tiny_model("qwen3")
    llm = LLM(path, tensor_parallel_size=2, num_kvcache_blocks=16, **ENGINE)
    # ids, positions, slots, query_start_loc, context_lens, block tables, sample rows; the later parts empty
    lengths = [3, 3, 3, 3, 2, 5, 1] + [0] * (NUM_PARTS - 7)
    bad_header = header_of([*lengths, 3])
    assert len(header_ints(bad_header)) == HEADER_LEN
    llm.runner.peers.send_step(bad_header, torch.zeros(buffer_len(bad_header), dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 exited with code 1.*Traceback.*RuntimeError"):
        llm.generate(random_prompts([5]), GREEDY, use_tqdm=False)
    del llm
    gc.collect()
    assert wait_until_exited(started) == []


# ---- start-up: a worker that fails before the engine is built is reported at once -------------------------------
def start_and_time(path: str) -> tuple[str, float]:
    """LLM(tensor_parallel_size=2)'s error and how long it took to come."""
    began = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        LLM(path, tensor_parallel_size=2, num_kvcache_blocks=16, **ENGINE)
    return str(info.value), time.monotonic() - began


def test_worker_killed_while_starting_is_reported_at_once(tiny_model, started, monkeypatch):
    """Guards against rank 0 waiting out the rendezvous timeout (300 s) for a worker that died before joining: the
    worker is killed 0.5 s after it starts, while it imports, and LLM() raises within seconds naming rank 1 and
    the signal."""
    path, _ = tiny_model("llama")
    popen = nanoserve.ext.tp.workers.subprocess.Popen

    def popen_then_kill(*args, **kwargs):
        proc = popen(*args, **kwargs)
        threading.Timer(0.5, proc.kill).start()
        return proc

    monkeypatch.setattr(nanoserve.ext.tp.workers.subprocess, "Popen", popen_then_kill)
    error, seconds = start_and_time(path)
    assert "rank 1 was killed by SIGKILL" in error and seconds < REPORT_BOUND_S, (error, seconds)
    assert wait_until_exited(started) == []


def test_worker_killed_while_loading_is_reported_at_once(tiny_model, started, monkeypatch):
    """Guards against rank 0 waiting in a start-up collective for a worker that died after joining: the worker is
    killed when rank 0 starts loading its shard, and LLM() raises within seconds naming rank 1 and the signal."""
    path, _ = tiny_model("llama")
    runner_class = nanoserve.ext.tp.workers.ModelRunner

    def kill_worker_then_load(*args, **kwargs):
        started[0].kill()
        return runner_class(*args, **kwargs)

    monkeypatch.setattr(nanoserve.ext.tp.workers, "ModelRunner", kill_worker_then_load)
    error, seconds = start_and_time(path)
    assert "rank 1 was killed by SIGKILL" in error and seconds < REPORT_BOUND_S, (error, seconds)
    assert wait_until_exited(started) == []


def test_worker_failing_at_import_is_reported_with_its_traceback(tiny_model, started, tmp_path, monkeypatch):
    """Guards against a worker that cannot even import nanoserve (here: a broken package earlier on the path it
    inherits) leaving rank 0 waiting and its traceback unseen: LLM() raises within seconds with rank 1, its exit
    code and the end of its stderr, which holds the ImportError."""
    path, _ = tiny_model("llama")
    broken = tmp_path / "broken" / "safetensors"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(broken.parent))  # this process imported safetensors already: only workers see it
    error, seconds = start_and_time(path)
    assert "rank 1 exited with code 1" in error and "ImportError: broken on purpose" in error, error
    assert seconds < REPORT_BOUND_S
    assert wait_until_exited(started) == []


FROM_STDIN = """
from nanoserve import LLM, SamplingParams
llm = LLM({path!r}, device="cpu", tensor_parallel_size=2, max_model_len=128, num_kvcache_blocks=16)
outputs = llm.generate({prompts!r}, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
print([o.outputs[0].token_ids for o in outputs])
"""


def test_script_from_stdin_without_main_guard_works(tiny_model):
    """Guards against workers that re-import the user's script: `python - <<EOF` has no file to import (spawned
    workers died with FileNotFoundError: '<stdin>'), and a script without a main guard would start workers from
    its workers. A script read from stdin, without a guard, gets one rank's tokens."""
    path, hf = tiny_model("qwen2")
    prompts = random_prompts([7, 3])
    script = FROM_STDIN.format(path=path, prompts=prompts)
    run = subprocess.run(
        [sys.executable, "-"], input=script, capture_output=True, text=True, timeout=180, env=IMPORTS_THIS_CHECKOUT
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == str([hf_greedy(hf, p, 10) for p in prompts])


def test_bad_tensor_parallel_size_is_refused_before_any_process_starts(tiny_model, started):
    """Guards against starting workers for a split that cannot work: a size that does not divide the heads, or
    (with fewer KV heads than ranks) the KV heads, is a ValueError naming the field, and no process is started."""
    path, _ = tiny_model("llama")  # 4 heads, 2 KV heads
    for size in (3, 4):
        with pytest.raises(InvalidField, match="tensor_parallel_size") as info:
            LLM(path, tensor_parallel_size=size, **ENGINE)
        assert info.value.field == "tensor_parallel_size"
    with pytest.raises(InvalidField, match="tensor_parallel_size"):
        LLM(path, tensor_parallel_size=0, **ENGINE)
    assert started == []


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_two_gpus_equal_one(tiny_model):
    """Guards against NCCL-only bugs (device placement per rank, collectives inside CUDA graphs)."""
    path, hf = tiny_model("qwen3")
    prompts = random_prompts([5, 40, 17, 64])
    kw = {"dtype": "float32", "max_model_len": 256, "num_kvcache_blocks": 64, "max_num_seqs": 8}
    one = LLM(path, **kw).generate(prompts, GREEDY, use_tqdm=False)
    two = LLM(path, tensor_parallel_size=2, **kw)
    assert (
        [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY, use_tqdm=False)]
        == [o.outputs[0].token_ids for o in one]
        == [hf_greedy(hf, p, 10) for p in prompts]
    )
    two.close()


ENGINE_THEN_SLEEP = """
import time
from nanoserve import LLM
llm = LLM({path!r}, device="cpu", tensor_parallel_size=2, max_model_len=128, num_kvcache_blocks=16)
print(llm.runner.peers.procs[1].pid, flush=True)
time.sleep(120)
"""


def test_worker_exits_when_the_engine_process_dies(tiny_model, tmp_path):
    """Guards against orphans: when the engine process is killed outright (no close, no garbage collection), its
    worker notices (its heartbeat or its wait for the next step fails) and exits within seconds."""
    path, _ = tiny_model("qwen3")
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_THEN_SLEEP.format(path=path))
    engine = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=IMPORTS_THIS_CHECKOUT
    )
    worker_pid = int(engine.stdout.readline())
    engine.kill()
    engine.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(worker_pid, 0)  # still there?
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(worker_pid, signal.SIGKILL)
    pytest.fail("the worker outlived its engine process by 30 s")
