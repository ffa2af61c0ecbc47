"""Tensor parallelism over torchrun, PyTorch's launcher, as across two machines: two torchrun "nodes" on this one
(--nnodes 2 --nproc-per-node 1, node ranks 0 and 1, a c10d rendezvous on 127.0.0.1, gloo). Each runs the same script;
the process torchrun makes global rank 0 runs the engine, the other serves its steps inside LLM(...) and ends there."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from conftest import hf_greedy, random_prompts

from nanoserve import LLM, SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240  # both nodes, start to finish
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
RENDEZVOUS_FAILURES = ("RendezvousConnectionError", "RendezvousTimeoutError", "RendezvousClosedError")

SCRIPT = """
import json
from nanoserve import LLM, SamplingParams
llm = LLM({path!r}, device="cpu", tensor_parallel_size=2, max_model_len=128, num_kvcache_blocks=16)
outputs = llm.generate({prompts!r}, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outputs]), flush=True)
llm.close()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_node(node_rank: int, port: int, script: str) -> subprocess.Popen:
    """One torchrun "node" (in a session of its own, so that a timeout can stop it with its children)."""
    command = [
        *(sys.executable, "-m", "torch.distributed.run"),  # torchrun, with this interpreter
        *("--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node_rank)),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"),
        script,
    ]
    env = dict(os.environ, PYTHONPATH=REPO)  # scripts import this checkout
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )


def test_two_torchrun_nodes_equal_one_rank(tiny_model, tmp_path):
    """Guards against the multi-machine path diverging from the spawned one (the env:// rendezvous, the worker loop
    entered from LLM(...) on rank 1, the host group's headers): greedy tokens over two torchrun nodes equal one
    rank's and transformers', and both nodes exit cleanly."""
    path, hf = tiny_model("qwen2")
    prompts = random_prompts([7, 3, 12])
    script = tmp_path / "serve.py"
    script.write_text(SCRIPT.format(path=path, prompts=prompts))
    port = free_port()
    nodes = [torchrun_node(rank, port, str(script)) for rank in (0, 1)]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=TIMEOUT_S))
    except subprocess.TimeoutExpired:
        for node in nodes:
            os.killpg(node.pid, signal.SIGKILL)  # each node's session: torchrun and the rank it started
            node.wait()
        pytest.fail(f"torchrun did not finish within {TIMEOUT_S} s")
    stderr = "\n".join(err for _, err in outputs)
    if any(node.returncode != 0 for node in nodes) and any(name in stderr for name in RENDEZVOUS_FAILURES):
        pytest.skip(f"torchrun could not start here: {stderr[-1000:]}")
    assert all(node.returncode == 0 for node in nodes), stderr[-5000:]
    printed = [line for out, _ in outputs for line in out.splitlines() if line.startswith("TOKENS ")]
    assert len(printed) == 1, "exactly one rank runs the engine"
    one_rank = LLM(path, device="cpu", max_model_len=128, num_kvcache_blocks=16).generate(
        prompts, GREEDY, use_tqdm=False
    )
    assert (
        json.loads(printed[0].removeprefix("TOKENS "))
        == [o.outputs[0].token_ids for o in one_rank]
        == [hf_greedy(hf, p, 10) for p in prompts]
    )
