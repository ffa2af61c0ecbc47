"""The OpenAI-compatible server (nanoserve/server.py) end to end: one server per module on 127.0.0.1 with the default
model, driven by the official `openai` client (and raw httpx where a client would refuse to send bad input). Every
wait is bounded; nothing depends on speed. After each test the KV pool must be empty again."""

import asyncio
import contextlib
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 12}
WAIT_S = 15  # the longest any poll below waits for the server to settle


class Served:
    def __init__(self, base_url, tokenizer, llm):
        self.base_url, self.llm = base_url, llm  # llm: only to inject faults
        self.tokenizer = tokenizer  # the test's own: the engine's belongs to the engine thread
        self.root = base_url.removesuffix("/v1")
        self.client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120)

    def aclient(self, timeout=120):
        return openai.AsyncOpenAI(base_url=self.base_url, api_key="x", max_retries=0, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.root}/metrics", timeout=30).text
        return {
            name: float(value)
            for name, value in (line.split() for line in text.splitlines() if line and not line.startswith("#"))
        }

    def wait_idle(self) -> dict[str, float]:
        """Poll until nothing runs, waits or holds a block (bounded); returns the last metrics."""
        deadline = time.monotonic() + WAIT_S
        while True:
            m = self.metrics()
            if m["nanoserve_running"] == m["nanoserve_waiting"] == m["nanoserve_kv_blocks_used"] == 0:
                return m
            assert time.monotonic() < deadline, f"the server did not settle: {m}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def served():
    from conftest import default_model_or_skip
    from transformers import AutoTokenizer

    from nanoserve import LLM
    from nanoserve.ext.server.app import serve_in_background

    model_dir = default_model_or_skip()
    llm = LLM(max_model_len=512, num_kvcache_blocks=256)
    with serve_in_background(llm) as base_url:
        yield Served(base_url, AutoTokenizer.from_pretrained(model_dir), llm)
    engine_threads = [t for t in threading.enumerate() if t.name == "nanoserve-engine"]
    assert not engine_threads, "the engine thread outlived the server"


@pytest.fixture(autouse=True)
def pool_empty_after(served):
    """Guards against leaked blocks: whatever a test did, every request's blocks are back in the pool after it."""
    yield
    served.wait_idle()


def collect_stream(chunks):
    """(text per choice index, finish_reason per index, usage), checking that each choice's finish_reason comes
    once, on its last chunk."""
    texts, reasons, finish_chunks, usage, last_chunk_of = {}, {}, {}, None, {}
    for n, chunk in enumerate(chunks):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.text if hasattr(c, "text") else c.delta.content or "")
            last_chunk_of[c.index] = n
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
                finish_chunks.setdefault(c.index, []).append(n)
    for index, chunk_numbers in finish_chunks.items():  # finish_reason once per choice, on its last chunk
        assert chunk_numbers == [last_chunk_of[index]], f"choice {index}: finish_reason on chunks {chunk_numbers}"
    assert set(reasons) == set(texts), "a choice never finished"
    return texts, reasons, usage


def test_completion_streamed_equals_whole(served):
    """Guards against lost, repeated or reordered deltas, finish_reason on a middle chunk, and wrong usage counts."""
    whole = served.client.completions.create(prompt=PROMPT, extra_body={"ignore_eos": True}, **GREEDY)
    chunks = served.client.completions.create(
        prompt=PROMPT, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **GREEDY
    )
    texts, reasons, usage = collect_stream(chunks)
    assert whole.object == "text_completion" and whole.model == MODEL and len(whole.choices) == 1
    assert texts == {0: whole.choices[0].text} and whole.choices[0].text
    assert reasons == {0: "length"} and whole.choices[0].finish_reason == "length"
    num_prompt = len(served.tokenizer.encode(PROMPT))
    for u in (whole.usage, usage):
        assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (num_prompt, 12, num_prompt + 12)
        assert 0 <= u.prompt_tokens_details.cached_tokens < num_prompt


def test_chat_streamed_equals_whole(served):
    """Guards against the chat template not being applied, a missing role, and streamed chat text drifting."""
    whole = served.client.chat.completions.create(messages=MESSAGES, **GREEDY)
    chunks = list(
        served.client.chat.completions.create(
            messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    texts, reasons, usage = collect_stream(chunks)
    message = whole.choices[0].message
    assert whole.object == "chat.completion" and message.role == "assistant" and message.content
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert texts == {0: message.content} and reasons == {0: whole.choices[0].finish_reason}
    chat_text = served.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    num_prompt = len(served.tokenizer.encode(chat_text, add_special_tokens=False))
    assert whole.usage.prompt_tokens == usage.prompt_tokens == num_prompt
    assert whole.usage.completion_tokens == usage.completion_tokens <= 12
    assert usage.total_tokens == num_prompt + usage.completion_tokens


def test_n_samples_and_prompt_lists(served):
    """Guards against choices of several samples or several prompts getting the wrong index (OpenAI: prompt x n +
    sample), and against samples of one request being copies of each other."""
    sampled = served.client.completions.create(
        prompt=PROMPT, n=3, temperature=1.0, seed=7, max_tokens=8, model=MODEL, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2]
    assert len({c.text for c in sampled.choices}) > 1  # three seeded draws of 8 tokens: equal would be a bug
    assert sampled.usage.completion_tokens == 24
    prompts = ["One, two, three,", "Monday, Tuesday,"]
    alone = [served.client.completions.create(prompt=p, **GREEDY).choices[0].text for p in prompts]
    both = served.client.completions.create(prompt=prompts, n=2, **GREEDY)
    assert {c.index: c.text for c in both.choices} == {0: alone[0], 1: alone[0], 2: alone[1], 3: alone[1]}
    texts, _, usage = collect_stream(
        served.client.completions.create(
            prompt=prompts, n=2, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert texts == {c.index: c.text for c in both.choices}
    assert usage.completion_tokens == both.usage.completion_tokens
    token_prompt = served.tokenizer.encode(prompts[0])  # token ids are a prompt too
    assert served.client.completions.create(prompt=token_prompt, **GREEDY).choices[0].text == alone[0]


def test_logprobs(served):
    """Guards against logprobs that do not match the tokens: one entry per generated token, the greedy choice the
    most likely, the top-N list of the size asked, and the same values streamed or not."""
    whole = served.client.completions.create(prompt=PROMPT, logprobs=3, **GREEDY)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == whole.usage.completion_tokens
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=False):
        assert len(top) <= 3 and chosen == pytest.approx(max(top.values())) and chosen <= 0
    streamed = [
        c.choices[0].logprobs
        for c in served.client.completions.create(prompt=PROMPT, logprobs=3, stream=True, **GREEDY)
        if c.choices and c.choices[0].logprobs
    ]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [x for s in streamed for x in s.token_logprobs] == pytest.approx(lp.token_logprobs)

    chat = served.client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    plain = served.client.chat.completions.create(messages=MESSAGES, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_prefix_cache_shows_in_usage(served):
    """Guards against prompt_tokens_details.cached_tokens not reporting prefix-cache hits."""
    prompt = "Here is a long shared system prompt that spans several KV blocks. " * 4
    first = served.client.completions.create(prompt=prompt, model=MODEL, max_tokens=2, temperature=0)
    again = served.client.completions.create(prompt=prompt, model=MODEL, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens == first.usage.prompt_tokens > 32
    assert again.usage.prompt_tokens_details.cached_tokens >= 32


def test_64_concurrent_streams(served):
    """Guards against outputs crossing between requests under load (a token or delta routed to another client's
    queue), lost final chunks, and leaked blocks: 64 streaming clients at once, each with its own prompt."""
    prompts = [f"Count: {100 + 7 * i}, {101 + 7 * i}, {102 + 7 * i}," for i in range(64)]
    params = {"model": MODEL, "temperature": 0, "max_tokens": 8}
    reference = served.client.completions.create(prompt=prompts, **params)  # one batch, computed on its own
    expected = {c.index: c.text for c in reference.choices}

    async def one(client, i):
        text, reasons = "", []
        async for chunk in await client.completions.create(prompt=prompts[i], stream=True, **params):
            text += chunk.choices[0].text
            reasons.append(chunk.choices[0].finish_reason)
        assert reasons[-1] == "length" and not any(reasons[:-1])
        return text

    async def all_at_once():
        async with served.aclient() as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(64))), 300)

    assert dict(enumerate(asyncio.run(all_at_once()))) == expected
    assert served.wait_idle()["nanoserve_kv_blocks_used"] == 0


def test_disconnected_clients_are_aborted(served):
    """Guards against a client that hangs up leaving its request running: 32 long requests (half streamed, half
    not) whose clients give up after 0.5 s must free every block, stop generating, and leave the engine free."""
    params = {"prompt": PROMPT, "model": MODEL, "max_tokens": 400, "temperature": 0, "extra_body": {"ignore_eos": True}}

    async def give_up_streaming(client):
        async def read_all():
            async for _ in await client.completions.create(stream=True, **params):
                pass

        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(read_all(), 0.5)  # cancelling closes the response, hence the connection

    async def give_up_waiting(client):
        with pytest.raises(openai.APITimeoutError):
            await client.completions.create(**params)

    async def hang_up_all():
        async with served.aclient(timeout=0.5) as client:
            await asyncio.gather(
                *(give_up_streaming(client) for _ in range(16)), *(give_up_waiting(client) for _ in range(16))
            )

    before = served.metrics()["nanoserve_generated_tokens_total"]
    asyncio.run(hang_up_all())
    settled = served.wait_idle()  # running, waiting and blocks used all back to 0
    assert settled["nanoserve_generated_tokens_total"] - before < 32 * 400, "the requests ran to the end"
    time.sleep(0.5)
    assert served.metrics()["nanoserve_generated_tokens_total"] == settled["nanoserve_generated_tokens_total"]
    after = served.client.completions.create(prompt=PROMPT, model=MODEL, max_tokens=4, temperature=0)
    assert after.choices[0].finish_reason in ("length", "stop") and after.usage.completion_tokens <= 4


def nested(depth: int) -> list:
    """A list nested depth deep: [[...[]...]]."""
    value = []
    for _ in range(depth - 1):
        value = [value]
    return value


BAD_INPUTS = [  # (endpoint, body, status, param the error names)
    ("completions", b"{not json", 400, None),
    ("completions", [1, 2], 400, None),
    ("completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("completions", {"max_tokens": 4}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": [1, 10**9]}, 400, "prompt"),
    ("completions", {"prompt": ["fine", [10**9]]}, 400, "prompt"),  # one bad prompt refuses the list
    ("completions", {"prompt": {"text": "hi"}}, 400, "prompt"),
    ("completions", {"prompt": "hello " * 600}, 400, "prompt"),  # over max_model_len
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "hi", "top_k": 0}, 400, "top_k"),
    ("completions", {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"prompt": "hi", "stop": [1]}, 400, "stop"),
    ("completions", {"prompt": "hi", "seed": "x"}, 400, "seed"),
    ("completions", {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "ignore_eos": "no"}, 400, "ignore_eos"),
    ("completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi " * 600}]}, 400, "messages"),
    ("chat/completions", {"messages": MESSAGES, "max_completion_tokens": -5}, 400, "max_completion_tokens"),
    ("chat/completions", {"messages": MESSAGES, "logprobs": "yes"}, 400, "logprobs"),
    ("chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    ("chat/completions", {"messages": MESSAGES, "model": "gpt-4"}, 404, "model"),
    # numbers too large for a float: 400s, not OverflowError's 500
    ("completions", {"prompt": "hi", "max_tokens": 10**400}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "n": 10**400}, 400, "n"),
    ("chat/completions", {"messages": MESSAGES, "max_tokens": 10**400}, 400, "max_tokens"),
    # lone surrogates (JSON escapes a client's own encoder would refuse to send)
    ("completions", b'{"prompt": "hi \\ud800 there"}', 400, "prompt"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    # nesting: 5,000 deep (json.loads would recurse past Python's limit), and one past MAX_JSON_DEPTH
    ("completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None),
    ("completions", {"prompt": "hi", "user": nested(64)}, 400, None),
    # OpenAI's caps on logprobs
    ("chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 49152}, 400, "top_logprobs"),
    ("completions", {"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    # ServerConfig's defaults: n x prompts <= 128 choices, prompt text <= 32 characters per token of max_model_len
    ("completions", {"prompt": "hi", "n": 129}, 400, "n"),
    ("completions", {"prompt": ["hi"] * 2, "n": 65}, 400, "n"),
    ("completions", {"prompt": ["hi"] * 129}, 400, "prompt"),
    ("chat/completions", {"messages": MESSAGES, "n": 129}, 400, "n"),
    ("completions", {"prompt": "a" * (32 * 512 + 1)}, 400, "prompt"),
    ("completions", {"prompt": ["a" * 10_000, "b" * 10_000]}, 400, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a" * (32 * 512 + 1)}]}, 400, "messages"),
    # a body over ServerConfig.max_body_bytes (4 MiB)
    ("completions", b'{"prompt": "' + b"a" * (4 * 2**20) + b'"}', 413, None),
]


@pytest.mark.parametrize("endpoint, body, status, param", BAD_INPUTS)
def test_bad_input_is_refused_and_server_keeps_serving(served, endpoint, body, status, param):
    """Guards against bad input crashing a handler or the engine thread (a 500 or a hang), against an error that
    does not name the field, and against a half-queued request after a refusal."""
    finished_before = served.metrics()["nanoserve_finished_requests_total"]
    send = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{served.base_url}/{endpoint}", headers={"Content-Type": "application/json"}, timeout=60, **send)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert httpx.get(f"{served.root}/health", timeout=30).status_code == 200
    ok = served.client.completions.create(prompt="hi", model=MODEL, max_tokens=1)
    assert len(ok.choices) == 1
    finished = served.wait_idle()["nanoserve_finished_requests_total"] - finished_before
    assert finished == 1, "part of the refused request ran"


def test_openai_client_sees_bad_input_as_its_errors(served):
    """Guards against errors the official client cannot parse: it must raise its typed errors."""
    with pytest.raises(openai.BadRequestError) as e:
        served.client.completions.create(prompt="hi", model=MODEL, temperature=-1)
    assert e.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        served.client.chat.completions.create(messages=MESSAGES, model="gpt-4")


def test_models_health_and_metrics(served):
    """Guards against the discovery and monitoring endpoints drifting from what clients and Prometheus expect."""
    assert [m.id for m in served.client.models.list()] == [MODEL]
    assert httpx.get(f"{served.root}/health", timeout=30).status_code == 200
    m = served.metrics()
    assert m["nanoserve_kv_blocks_total"] == 256 and 0 <= m["nanoserve_prefix_hit_rate"] <= 1
    for name in (
        "kv_blocks_cached",
        "preemptions_total",
        "generated_tokens_total",
        "finished_requests_total",
        "prefix_hit_tokens_total",
        "prefix_queried_tokens_total",
    ):
        assert f"nanoserve_{name}" in m


def break_next_launch(served):
    runner = served.llm.runner

    def broken(step, previous, processors):
        del runner.launch  # fails once
        raise RuntimeError("injected device error")

    runner.launch = broken


def test_a_failing_step_fails_its_request_and_the_server_serves_on(served):
    """Guards against an engine error hanging clients or killing the server: a launch that raises once must answer
    the request with OpenAI's error shape (500 whole; an error event in a stream, whose 200 is already sent), leave
    no block held or stale prefix cached, and the same request sent again must get the same completion as before."""
    before = served.client.completions.create(prompt=PROMPT, **GREEDY).choices[0].text
    break_next_launch(served)
    with pytest.raises(openai.InternalServerError, match="injected device error"):
        served.client.completions.create(prompt=PROMPT, **GREEDY)
    assert served.wait_idle()["nanoserve_kv_blocks_cached"] == 0  # the failed step's prefix is forgotten
    stream = served.client.chat.completions.create(
        messages=MESSAGES, stream=True, **{**GREEDY, "max_tokens": 400}, extra_body={"ignore_eos": True}
    )
    first = next(iter(stream))  # the role and first token: the stream is under way, far from its end
    break_next_launch(served)
    with pytest.raises(openai.APIError, match="injected device error"):
        for _ in stream:
            pass
    assert first.choices[0].delta.role == "assistant"
    assert served.client.completions.create(prompt=PROMPT, **GREEDY).choices[0].text == before
    assert httpx.get(f"{served.root}/health", timeout=30).status_code == 200


def test_missing_routes_and_methods_answer_in_openai_shape(served):
    """Guards against FastAPI's own {"detail": ...} bodies: a 404 (no such route) and a 405 (wrong method, with its
    Allow header) come in OpenAI's error shape, and the official client raises its typed errors on them."""
    missing = httpx.post(f"{served.base_url}/nothing", json={}, timeout=30)
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert "/v1/nothing" in error["message"] and error["param"] is None
    wrong_method = httpx.get(f"{served.base_url}/completions", timeout=30)
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        served.client.post("/nothing", cast_to=object, body={})
    assert served.client.completions.create(prompt="hi", model=MODEL, max_tokens=1).usage.completion_tokens == 1


def test_a_bug_answers_500_in_openai_shape(served, monkeypatch):
    """Guards against Starlette's plain-text "Internal Server Error": an exception no handler expects (here a
    TypeError from the chat template) is a 500 in OpenAI's shape, and the server serves on."""
    from nanoserve.ext.server import app

    def broken(llm, messages, tools=None):
        raise TypeError("injected bug")

    with monkeypatch.context() as patch:
        patch.setattr(app, "chat_prompts", broken)  # the handler looks it up per request
        r = httpx.post(f"{served.base_url}/chat/completions", json={"messages": MESSAGES}, timeout=30)
    assert r.status_code == 500
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
    assert error["message"] == "injected bug"
    assert served.client.chat.completions.create(messages=MESSAGES, **GREEDY).choices[0].message.content


def test_requests_at_the_limits_are_served(served):
    """Guards against caps that refuse what they should allow: JSON nested exactly MAX_JSON_DEPTH deep, brackets
    inside strings (which do not nest), top_logprobs = 20 and logprobs = 5 (OpenAI's caps), and a 401-digit seed (any
    integer seed is taken, mod 2**63)."""
    from nanoserve.ext.server.shared import MAX_JSON_DEPTH

    short = {"model": MODEL, "max_tokens": 2}
    deep = httpx.post(
        f"{served.base_url}/completions",
        json={"prompt": "[[[{{{" * 100, "user": nested(MAX_JSON_DEPTH - 1), **short},  # the body is one level
        timeout=30,
    )
    assert deep.status_code == 200, deep.text
    chat = served.client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=20, **short)
    assert all(len(entry.top_logprobs) == 20 for entry in chat.choices[0].logprobs.content)
    completion = served.client.completions.create(prompt=PROMPT, logprobs=5, **short)
    assert all(len(top) == 5 for top in completion.choices[0].logprobs.top_logprobs)
    seeded = [
        served.client.completions.create(prompt=PROMPT, seed=10**400, temperature=1.0, **short).choices[0].text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
