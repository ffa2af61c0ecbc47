"""The disaggregated pair behind one OpenAI-compatible endpoint (ext/pd_router.py): started by torchrun, PyTorch's
launcher, as one command, it must answer as one engine does (the official openai client's completions, whole and
streamed, and chat), and an engine that is gone must be named in the answer within seconds. Also the server's side of
it (ext/server): a request an extension failed is answered with why."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import default_model_or_skip, extension_or_skip, random_prompts

pd_router = extension_or_skip("pd_router")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from fastapi.testclient import TestClient  # noqa: E402 (after the skips above)
from test_kv_transfer import EXIT_WITH_PARENT  # noqa: E402

# python -c ROUTER [flags]: a rank of the pair (python -m nanoserve.ext.pd_router [flags]) that exits with the test's
# process (started with stdin=PIPE; under torchrun too, whose ranks share its stdin)
ROUTER = (
    EXIT_WITH_PARENT
    + "import runpy\nrunpy.run_module('nanoserve.ext.pd_router', run_name='__main__', alter_sys=True)\n"
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = "SmolLM2-135M-Instruct"
START_S = 240  # both engines loaded and serving
NAMED_WITHIN_S = 10
PROMPT = "The history of the city begins with a small settlement on an island in the river, where a tribe of fishermen"
MESSAGES = [{"role": "user", "content": "Tell me a short story about a cat who learns to fly over the old town."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(root: str, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + START_S
    while True:
        try:
            if httpx.get(f"{root}/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert all(p.poll() is None for p in procs), "a rank exited before the pair was up"
        assert time.monotonic() < deadline, f"the pair did not come up within {START_S} s"
        time.sleep(0.5)


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_the_pair_under_torchrun_answers_as_one_engine():
    """Guards against the one command not starting the pair (the decode engine's address not found, a rank's server
    not up before the router listens), or the router changing answers (a prefill that leaks into the output, the decode
    request altered, a stream not relayed as it comes): greedy completions whole and streamed, and chat, equal one
    engine's."""
    model = default_model_or_skip()
    port = free_port()
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"),
        *("--master-addr", "127.0.0.1", "--master-port", str(free_port())),
        *("--no-python", sys.executable, "-c", ROUTER, "--model", model, "--port", str(port)),
        *("--served-model-name", NAME, "--max-model-len", "512"),
    ]
    env = dict(os.environ, PYTHONPATH=REPO)
    launcher = subprocess.Popen(command, env=env, start_new_session=True, stdin=subprocess.PIPE)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", [launcher])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        greedy = {"model": NAME, "max_tokens": 16, "temperature": 0}
        whole = client.completions.create(prompt=PROMPT, **greedy).choices[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=PROMPT, stream=True, **greedy))
        chat = client.chat.completions.create(messages=MESSAGES, **greedy).choices[0].message.content
        assert [m.id for m in client.models.list()] == [NAME]
    finally:
        launcher.terminate()  # torchrun ends its ranks (each in a session of its own) when it is told to end
        try:
            launcher.wait(60)
        finally:
            stop([launcher])
    with pytest.raises(httpx.HTTPError):  # the router is gone with its rank
        httpx.get(f"http://127.0.0.1:{port}/health")
    from nanoserve import LLM, SamplingParams

    llm = LLM(model, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=16)
    assert whole == streamed == llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
    assert chat == llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0].text


def test_a_decode_engine_gone_is_named_by_the_router(tiny_model):
    """Guards against a router that hangs or answers blankly when the decode engine dies: the two ranks started as
    torchrun starts them (rank 0 hosting the rendezvous store), the decode rank killed, the next request is answered
    within seconds with an error naming the decode engine."""
    path, _ = tiny_model("qwen3")
    port, rendezvous = free_port(), free_port()
    procs = []
    for rank in (0, 1):
        env = dict(
            os.environ,
            PYTHONPATH=REPO,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(rendezvous),
        )
        command = [sys.executable, "-c", ROUTER, "--model", path, "--port", str(port), "--max-model-len", "256"]
        procs.append(subprocess.Popen(command, env=env, start_new_session=True, stdin=subprocess.PIPE))
    try:
        root = f"http://127.0.0.1:{port}"
        wait_healthy(root, procs)
        body = {"prompt": random_prompts([40])[0], "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{root}/v1/completions", json=body, timeout=60).status_code == 200
        os.killpg(procs[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        answer = httpx.post(f"{root}/v1/completions", json=body, timeout=60)
        assert time.monotonic() - killed < NAMED_WITHIN_S
        assert answer.status_code >= 500 and "the decode engine" in answer.json()["error"]["message"], answer.text
        assert httpx.get(f"{root}/health").status_code == 503
    finally:
        stop(procs)


@pytest.mark.parametrize("gone", ["prefill", "decode"])
def test_an_unreachable_engine_is_named(gone):
    """Guards against a connection error surfacing as a bare 500 or a hang: with nothing listening at the engines'
    addresses, the router answers 502 naming the engine it could not reach and its address (the decode engine's for
    a body that is no JSON object, which goes there without a prefill), and /health is 503."""
    urls = {name: f"http://127.0.0.1:{free_port()}/v1" for name in ("prefill", "decode")}  # nothing listens there
    with TestClient(pd_router.router_app(urls["prefill"], urls["decode"])) as client:
        if gone == "prefill":
            answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        else:
            answer = client.post("/v1/completions", content=b"not JSON")
        assert answer.status_code == 502
        assert answer.json()["error"]["message"].startswith(f"the {gone} engine at {urls[gone]} failed: ConnectError")
        assert client.get("/health").status_code == 503


def test_the_prefill_request_is_one_token_of_one_sample():
    """Guards against the prefill engine generating what only the decode engine should (n samples, a long answer, a
    stream nobody reads): the body it gets asks for one token of one sample, whole, under whichever max_tokens field
    the client used; the rest of the body is as sent."""
    body = {"prompt": "hi", "n": 3, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 50}
    assert pd_router.prefill_body(body) == {"prompt": "hi", "n": 1, "stream": False, "max_tokens": 1}
    chat = {"messages": [], "max_completion_tokens": 9, "min_tokens": 4, "temperature": 0}
    assert pd_router.prefill_body(chat) == {
        "messages": [],
        "max_completion_tokens": 1,
        "temperature": 0,
        "n": 1,
        "stream": False,
    }


def test_a_request_the_transfer_failed_is_answered_with_why(tiny_model):
    """Guards against the prefill engine's server answering a request ext/kv_transfer failed (Sequence.error, named
    after its dead peer) as a 200 with finish_reason "error", or as the client's fault: the server's rule (a message
    naming a request field is a 400, any other the engine's) must make kv_transfer's message a 500 that carries it
    whole, and streamed an error event with it; the router relays that answer as it is."""
    from nanoserve import LLM
    from nanoserve.ext.server.app import serve_in_background

    path, _ = tiny_model("qwen3")
    llm = LLM(path, device="cpu", max_model_len=128)
    problem = "the decode engine (kv_consumer) is gone: sending to it failed (Connection reset by peer)"

    def failing(seq: object, running: object) -> bool:  # what ext/kv_transfer's admission rule does then
        seq.error = problem
        return False

    llm.scheduler.admission_rules.append(failing)
    with serve_in_background(llm) as url:
        body = {"prompt": [5, 6, 7], "max_tokens": 3}
        whole = httpx.post(f"{url}/completions", json=body, timeout=60)
        assert whole.status_code == 500
        assert whole.json()["error"]["message"] == f"the engine failed this request: {problem}"
        streamed = httpx.post(f"{url}/completions", json={**body, "stream": True}, timeout=60)
        assert problem in streamed.text and streamed.text.endswith("data: [DONE]\n\n")
    assert llm.block_manager.num_used_blocks == 0
