"""The server (nanoserve/server.py) under faults that take a server of their own: a body that stalls, one client's
pathological-but-valid request beside another's one-token request, and shutdown (the bounded drain in-process; SIGTERM
and a second SIGINT on a subprocess, since signals reach only a main thread). Each in-process server is built on one
shared LLM with ServerConfig's limits set low enough to hit quickly. Loopback only; every wait is bounded; after each
test the server still generates what it generated before, and no KV block is held."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parent.parent
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_tokens": 8}
ONE_TOKEN = {"prompt": "hi", "max_tokens": 1}
WAIT_S = 30  # the longest any wait below allows for something that should take well under a second
FAIRNESS_BOUND_S = 5.0  # a one-token request beside a pathological one is answered within this (alone: ~0.1 s)
SHUTDOWN_TIMEOUT_S = 1.0  # the servers' ServerConfig.shutdown_timeout here
STARTED = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


@pytest.fixture(scope="module")
def llm():
    from conftest import default_model_or_skip

    from nanoserve import LLM

    default_model_or_skip()
    return LLM(max_model_len=512, num_kvcache_blocks=512)


@pytest.fixture(scope="module")
def reference(llm):
    """The greedy completion of PROMPT, computed offline before any server ran."""
    from nanoserve import SamplingParams

    return llm.generate(PROMPT, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].text


@contextlib.contextmanager
def serving(llm, **limits):
    """A server on llm with these ServerConfig limits; after it stops, the engine holds no request and no block."""
    from nanoserve.ext.server.app import ServerConfig, serve_in_background

    with serve_in_background(llm, config=ServerConfig(**limits)) as base_url:
        yield base_url
    assert not llm.has_unfinished_requests() and llm.block_manager.num_used_blocks == 0


def metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url.removesuffix('/v1')}/metrics", timeout=WAIT_S).text
    return {name: float(value) for name, value in (line.split() for line in text.splitlines() if line[0] != "#")}


def generates_correctly(base_url, reference):
    """The server answers PROMPT as it did offline, then settles with no request running and no block in use."""
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=WAIT_S)
    assert client.completions.create(prompt=PROMPT, model=MODEL, **GREEDY).choices[0].text == reference
    deadline = time.monotonic() + WAIT_S
    while True:
        m = metrics(base_url)
        if m["nanoserve_running"] == m["nanoserve_waiting"] == m["nanoserve_kv_blocks_used"] == 0:
            return
        assert time.monotonic() < deadline, f"the server did not settle: {m}"
        time.sleep(0.05)


def assert_openai_error(body: dict, kind: str, param: str | None) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == kind and error["param"] == param


def test_a_stalled_body_gets_408(llm, reference):
    """Guards against a client that sends its headers and then stalls holding a connection (and a handler) forever:
    after ServerConfig.body_timeout it gets a 408 in OpenAI's shape, and the connection is closed."""
    with serving(llm, body_timeout=1.0) as base_url:
        port = int(base_url.split(":")[-1].split("/")[0])
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as conn:
            conn.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"prompt": "th'
            )
            started = time.monotonic()
            received = b""
            while chunk := conn.recv(65536):  # until the server closes the connection
                received += chunk
            elapsed = time.monotonic() - started
        head, _, body = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), received
        assert_openai_error(json.loads(body), "invalid_request_error", None)
        assert 1.0 <= elapsed < 1.0 + FAIRNESS_BOUND_S
        generates_correctly(base_url, reference)


def test_a_long_prompt_does_not_stall_a_one_token_request(llm, reference):
    """Guards against tokenizing on the engine thread: while a 4-million-character prompt (allowed by the server's
    max_prompt_chars here, too long for max_model_len) is tokenized for ~2 s, a one-token request is answered within
    FAIRNESS_BOUND_S and before the long one's 400."""
    with serving(llm, max_prompt_chars=4_000_000, max_body_bytes=16 * 2**20) as base_url:
        answers = {}

        def long_request():
            r = httpx.post(f"{base_url}/completions", json={"prompt": "word " * 800_000}, timeout=WAIT_S)
            answers["long"] = (time.monotonic(), r)

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(0.3)  # the long body is in, and being tokenized
        started = time.monotonic()
        short = httpx.post(f"{base_url}/completions", json=ONE_TOKEN, timeout=WAIT_S)
        answered = time.monotonic()
        thread.join(WAIT_S)
        assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 1
        assert answered - started < FAIRNESS_BOUND_S
        long_answered, long = answers["long"]
        assert answered < long_answered, "the one-token request waited for the long prompt's tokenization"
        assert long.status_code == 400
        assert_openai_error(long.json(), "invalid_request_error", "prompt")
        generates_correctly(base_url, reference)


def test_a_large_n_does_not_stall_a_one_token_request(llm, reference):
    """Guards against a request for many samples holding up everyone behind it: while n = 128 (ServerConfig.max_n's
    default) samples stream, a one-token request is answered within FAIRNESS_BOUND_S, long before they finish."""
    with serving(llm) as base_url:
        events = {}
        first_chunk = threading.Event()

        def many_samples():
            body = {"prompt": "Once upon a time", "n": 128, "max_tokens": 12, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{base_url}/completions", json=body, timeout=WAIT_S * 4) as r:
                for line in r.iter_lines():
                    first_chunk.set()
                    if line:
                        events["last"] = line
            events["finished"] = time.monotonic()

        thread = threading.Thread(target=many_samples)
        thread.start()
        assert first_chunk.wait(WAIT_S), "the n = 128 request never started"
        started = time.monotonic()
        short = httpx.post(f"{base_url}/completions", json=ONE_TOKEN, timeout=WAIT_S)
        answered = time.monotonic()
        thread.join(WAIT_S * 4)
        assert short.status_code == 200 and answered - started < FAIRNESS_BOUND_S
        assert answered < events["finished"] and events["last"] == "data: [DONE]"
        generates_correctly(base_url, reference)


def read_stream(response, lines: list, first: threading.Event) -> None:
    """Collect a stream's lines (first: set at the first); a connection cut short just ends the list."""
    with contextlib.suppress(httpx.HTTPError):
        for line in response.iter_lines():
            if line:
                lines.append(line)
                first.set()


def test_shutdown_drains_within_its_timeout(llm, reference):
    """Guards against shutdown waiting as long as the longest request runs: a stream and a whole request still open
    after ServerConfig.shutdown_timeout fail in OpenAI's shape (the stream with an error event, then [DONE]), the server
    stops within the timeout plus uvicorn's grace, and the engine is left with nothing held, generating as before."""
    from nanoserve import SamplingParams
    from nanoserve.ext.server.app import SHUTDOWN_GRACE_S

    long = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    lines, first, whole = [], threading.Event(), {}
    with contextlib.ExitStack() as stack:
        with serving(llm, shutdown_timeout=SHUTDOWN_TIMEOUT_S) as base_url:
            url = f"{base_url}/completions"
            response = stack.enter_context(httpx.stream("POST", url, json={**long, "stream": True}, timeout=WAIT_S))
            reader = threading.Thread(target=read_stream, args=(response, lines, first))
            reader.start()
            waiter = threading.Thread(target=lambda: whole.update(r=httpx.post(url, json=long, timeout=WAIT_S)))
            waiter.start()
            assert first.wait(WAIT_S), "the stream never started"
            deadline = time.monotonic() + WAIT_S
            while metrics(base_url)["nanoserve_running"] < 2:  # the whole request runs too
                assert time.monotonic() < deadline, "the whole request never started"
                time.sleep(0.05)
            stopping = time.monotonic()
        stopped = time.monotonic() - stopping
        reader.join(WAIT_S)
        waiter.join(WAIT_S)
    assert stopped < SHUTDOWN_TIMEOUT_S + SHUTDOWN_GRACE_S + 2
    assert lines[-1] == "data: [DONE]"
    assert_openai_error(json.loads(lines[-2].removeprefix("data: ")), "server_error", None)
    assert whole["r"].status_code == 500
    assert_openai_error(whole["r"].json(), "server_error", None)
    offline = llm.generate(PROMPT, SamplingParams(**GREEDY), use_tqdm=False)  # the engine thread is gone
    assert offline[0].outputs[0].text == reference


class Subprocess:
    """`python -m nanoserve.ext.server` on a free port, its stderr collected by a thread."""

    def __init__(self):
        command = [sys.executable, "-m", "nanoserve.ext.server", "--port", "0", "--max-model-len", "512"]
        command += ["--num-kvcache-blocks", "64", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        self.stderr: list[str] = []
        threading.Thread(target=self._collect, daemon=True).start()
        self.base_url = f"http://127.0.0.1:{self.wait_for(STARTED, WAIT_S * 2).group(1)}/v1"

    def _collect(self):
        for line in self.process.stderr:
            self.stderr.append(line)

    def wait_for(self, pattern: re.Pattern, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            for line in list(self.stderr):
                if match := pattern.search(line):
                    return match
            time.sleep(0.05)
        raise AssertionError(f"{pattern.pattern!r} never came; stderr:\n{''.join(self.stderr)}")

    def exit_code(self, timeout: float) -> int:
        """The process's exit code; it must exit within timeout, and never abort."""
        try:
            code = self.process.wait(timeout)
        finally:
            self.process.kill()  # a no-op once it has exited
        time.sleep(0.1)  # the collector reads the last lines
        log = "".join(self.stderr)
        assert code != -signal.SIGABRT and "terminate called" not in log, log
        return code


@pytest.fixture
def server_process():
    from conftest import default_model_or_skip

    default_model_or_skip()
    server = Subprocess()
    yield server
    server.process.kill()


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 0)])
def test_a_signal_drains_and_exits(server_process, sig, code):
    """Guards against SIGTERM (or Ctrl+C) waiting for every open stream with no limit: an open stream gets an error
    event and [DONE] after --shutdown-timeout, and the process runs the app's shutdown and exits (by the signal, as
    uvicorn re-raises it, or 0 after a Ctrl+C)."""
    server = server_process
    lines, first = [], threading.Event()
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=WAIT_S) as response:
        reader = threading.Thread(target=read_stream, args=(response, lines, first))
        reader.start()
        assert first.wait(WAIT_S), "the stream never started"
        server.process.send_signal(sig)
        reader.join(WAIT_S)
    assert lines[-1] == "data: [DONE]"
    assert_openai_error(json.loads(lines[-2].removeprefix("data: ")), "server_error", None)
    assert server.exit_code(WAIT_S) == code
    assert any("Application shutdown complete" in line for line in server.stderr)


def test_a_second_sigint_exits_at_once(server_process):
    """Guards against a second Ctrl+C aborting the process (SIGABRT, "terminate called without an active exception":
    uvicorn's forced exit skipped the app's shutdown and left the engine thread running into the interpreter's exit):
    it exits at once with 130, as a shell reports Ctrl+C, while a stream is still open."""
    server = server_process
    lines, first = [], threading.Event()
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=WAIT_S) as response:
        reader = threading.Thread(target=read_stream, args=(response, lines, first))
        reader.start()
        assert first.wait(WAIT_S), "the stream never started"
        server.process.send_signal(signal.SIGINT)
        server.wait_for(re.compile("Shutting down"), WAIT_S)
        interrupted = time.monotonic()
        server.process.send_signal(signal.SIGINT)
        assert server.exit_code(WAIT_S) == 128 + signal.SIGINT
        assert time.monotonic() - interrupted < SHUTDOWN_TIMEOUT_S  # before the drain would have ended
        reader.join(WAIT_S)
    assert "data: [DONE]" not in lines  # cut off, not drained


def test_cpu_defaults_answer_a_short_stream_while_a_long_prompt_prefills():
    """Guards against CPU serving defaults that stall streams (issue 19): with overlap on and an 8,192-token step, a
    short stream's first token waited 9-10 s for a 1,500-token prompt that arrived 30 ms after it (its token was read
    back only after the long prompt's one huge step). With the CPU defaults, overlap off and 512-token steps, the
    short stream's first token comes from its own short step: well before the long request is answered (its prompt
    takes three steps), and within FAIRNESS_BOUND_S."""
    from conftest import default_model_or_skip

    from nanoserve import LLM

    default_model_or_skip()
    llm = LLM(max_model_len=2048, num_kvcache_blocks=256)
    assert (llm.config.overlap, llm.config.max_num_batched_tokens) == (False, 512)  # the CPU defaults
    with serving(llm) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=WAIT_S)
        answered = {}

        def long_request():
            time.sleep(0.03)  # 30 ms after the short one, as in the issue
            sent = time.monotonic()
            r = httpx.post(f"{base_url}/completions", json={"prompt": "word " * 1500, "max_tokens": 1}, timeout=WAIT_S)
            answered["long"] = (sent, time.monotonic(), r)

        thread = threading.Thread(target=long_request)
        started = time.monotonic()
        thread.start()
        stream = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0, stream=True)
        next(iter(stream))  # the first token
        first_token_s = time.monotonic() - started
        thread.join(WAIT_S)
        sent, done, long = answered["long"]
        assert long.status_code == 200 and long.json()["usage"]["prompt_tokens"] > 1024  # three steps of 512
        assert first_token_s < FAIRNESS_BOUND_S
        assert first_token_s < (done - sent) / 2, (first_token_s, done - sent)
