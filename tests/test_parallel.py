"""Tensor parallelism on the CPU: two ranks over gloo (the engine process and one worker it spawns). The split model
must give the same greedy tokens as one rank and as transformers, with prefix caching and preemption; failures in a
worker must surface as errors naming it, and nothing may outlive the LLM. A GPU test runs NCCL with two GPUs."""

import gc
import multiprocessing
import threading
import time

import pytest
import torch
from conftest import hf_greedy, random_prompts

from nanoserve import LLM, SamplingParams
from nanoserve.sampling_params import InvalidField
from nanoserve.step_inputs import HEADER_LEN

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ENGINE = {"device": "cpu", "max_model_len": 128, "max_num_batched_tokens": 64}


def wait_for_no_children(timeout_s: float = 20.0) -> list:
    deadline = time.monotonic() + timeout_s
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    return multiprocessing.active_children()


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_two_ranks_equal_one_rank_and_transformers(tiny_model, family):
    """Guards against any sharding bug (a wrong slice of q/k/v or gate/up, the row-parallel all-reduce, the bias
    added twice, the vocab-split embedding or logits, the KV heads per rank, a step's inputs or last samples not
    reaching the worker): greedy tokens with prefix hits (a second wave sharing a prompt prefix) and preemption (a
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
    assert wait_for_no_children() == []


def test_killed_worker_makes_generate_raise_not_hang(tiny_model):
    """Guards against the engine waiting for ever on a dead rank: the worker is killed in the middle of a long
    generate, which must raise an error naming the rank within seconds and leave no child process behind."""
    path, _ = tiny_model("llama")
    llm = LLM(path, tensor_parallel_size=2, num_kvcache_blocks=32, **ENGINE)
    worker = llm.runner.workers.procs[0]
    result = {}

    def generate():
        try:
            llm.generate(
                random_prompts([20] * 8), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False
            )
        except RuntimeError as e:
            result["error"] = str(e)

    runner = threading.Thread(target=generate)
    runner.start()
    time.sleep(0.5)
    worker.kill()
    runner.join(timeout=120)
    assert not runner.is_alive(), "generate hung after a worker died"
    assert "rank 1" in result.get("error", ""), result
    llm.close()
    assert wait_for_no_children() == []


def test_idle_workers_outlive_the_collective_timeout(tiny_model, monkeypatch):
    """Guards against a server's workers dying of idleness: a collective that waits longer than its timeout fails,
    so workers must wait for the next step elsewhere. With a 2 s timeout, an engine idle for 5 s still answers."""
    monkeypatch.setenv("NANOSERVE_TP_TIMEOUT_S", "2")  # read by every rank when it joins the group (workers.py)
    path, hf = tiny_model("qwen2")
    llm = LLM(path, tensor_parallel_size=2, num_kvcache_blocks=16, **ENGINE)
    prompts = random_prompts([7, 3])
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    time.sleep(5)
    assert all(p.is_alive() for p in llm.runner.workers.procs), "a worker died while idle"
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert (
        [o.outputs[0].token_ids for o in again]
        == [o.outputs[0].token_ids for o in first]
        == [hf_greedy(hf, p, 10) for p in prompts]
    )
    llm.close()
    assert wait_for_no_children() == []


def test_interrupted_step_stops_the_workers_and_says_so(tiny_model):
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
    assert wait_for_no_children(timeout_s=5) == []
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="stopped by an earlier failure"):
        llm.generate(random_prompts([5]), GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 5 and llm.stats()["kv_blocks_used"] == 0
    llm.close()


def test_error_inside_a_worker_names_the_rank(tiny_model):
    """Guards against a worker's exception being lost (the engine would see only a broken connection): a step of 2
    sequences with 5 block-table entries cannot be cut into rows, which fails inside the worker, and the engine's
    next call raises with that rank and its traceback. The garbage-collected LLM then leaves no process behind."""
    path, _ = tiny_model("qwen3")
    llm = LLM(path, tensor_parallel_size=2, num_kvcache_blocks=16, **ENGINE)
    lengths = [3, 3, 3, 3, 2, 5, 1, 0, 0]  # ids, positions, slots, query_start_loc, context_lens, block tables...
    bad_header = torch.tensor([*lengths, 3, 3])
    assert len(bad_header) == HEADER_LEN
    llm.runner.workers.send_step(bad_header, torch.zeros(sum(-(-n // 4) * 4 for n in lengths), dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 failed.*Traceback"):
        llm.generate(random_prompts([5]), GREEDY, use_tqdm=False)
    del llm
    gc.collect()
    assert wait_for_no_children() == []


def test_bad_tensor_parallel_size_is_refused_before_any_process_starts(tiny_model):
    """Guards against starting workers for a split that cannot work: a size that does not divide the heads, or
    (with fewer KV heads than ranks) the KV heads, is a ValueError naming the field, and no process is started."""
    path, _ = tiny_model("llama")  # 4 heads, 2 KV heads
    for size in (3, 4):
        with pytest.raises(InvalidField, match="tensor_parallel_size") as info:
            LLM(path, tensor_parallel_size=size, **ENGINE)
        assert info.value.field == "tensor_parallel_size"
    with pytest.raises(InvalidField, match="tensor_parallel_size"):
        LLM(path, tensor_parallel_size=0, **ENGINE)
    assert multiprocessing.active_children() == []


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
import sys, time
from nanoserve import LLM
if __name__ == "__main__":  # spawned workers re-import the main module: the guard every TP script needs
    llm = LLM({path!r}, device="cpu", tensor_parallel_size=2, max_model_len=128, num_kvcache_blocks=16)
    print(llm.runner.workers.procs[0].pid, flush=True)
    time.sleep(120)
"""


def test_worker_exits_when_the_engine_process_dies(tiny_model, tmp_path):
    """Guards against orphans: when the engine process is killed outright (no close, no garbage collection), its
    worker notices the broken connection and exits within seconds."""
    import os
    import subprocess
    import sys

    path, _ = tiny_model("qwen3")
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_THEN_SLEEP.format(path=path))
    engine = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(__file__))
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
    os.kill(worker_pid, 9)
    pytest.fail("the worker outlived its engine process by 30 s")
