"""An OpenAI-compatible HTTP server (`python -m nanoserve.server --model DIR --port 8000`, and every EngineConfig
field as a flag): /v1/completions and /v1/chat/completions, whole or streamed as server-sent events, /v1/models,
/health, and Prometheus /metrics. The engine is not thread-safe, so one thread owns it (EngineLoop). Handlers on
uvicorn's event loop send it commands through a queue.Queue and await the replies as futures; each HTTP request's
outputs come back on its own asyncio.Queue. A client that goes away has its requests aborted, which returns their KV
blocks at once."""

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import fields

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from nanoserve.config import EngineConfig
from nanoserve.default_model import DEFAULT_MODEL
from nanoserve.sampling_params import InvalidField, SamplingParams

DISCONNECT_POLL_S = 0.2  # a handler waiting for outputs checks this often whether its client is still there
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat's is the whole context
SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "min_tokens",
    "ignore_eos",
    "stop",
    "stop_token_ids",
    "seed",
)  # named alike in OpenAI's body (with vLLM's extras) and SamplingParams
GAUGES = ("running", "waiting", "kv_blocks_used", "kv_blocks_cached", "kv_blocks_total", "prefix_hit_rate")
COUNTERS = ("preemptions", "generated_tokens", "finished_requests", "prefix_hit_tokens", "prefix_queried_tokens")


class EngineLoop:
    """The one thread that calls the engine: it runs queued commands, steps while any request is unfinished, and
    sleeps on the command queue when there is nothing to do."""

    def __init__(self, llm):
        self.llm, self.commands = llm, queue.Queue()  # commands: (concurrent future, function, args); None: stop
        self.sinks = {}  # request_id -> function given each of its outputs, on the engine thread
        self.thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)

    def call(self, fn, *args) -> asyncio.Future:
        """Run fn(*args) on the engine thread; the event loop awaits its result (or exception)."""
        future = concurrent.futures.Future()
        self.commands.put((future, fn, args))
        return asyncio.wrap_future(future)

    async def generate(self, http: Request, prompts: list, params: SamplingParams, stream: bool):
        """One engine request per prompt: yields None once all are queued (bad input raises before a response
        starts), then (prompt index, output) as they come; aborts what is left if the client or the caller quits."""
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()
        ids = [f"{uuid.uuid4().hex}-{i}" for i in range(len(prompts))]
        unfinished = set(ids)
        try:
            await self.call(
                self._add, prompts, params, ids, stream, lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out)
            )
            yield None
            while unfinished:
                try:
                    out = await asyncio.wait_for(outputs.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        return
                    continue
                if isinstance(out, Exception):
                    raise RuntimeError(f"the engine failed this request: {out}") from out
                unfinished.difference_update([out.request_id] if out.finished else [])
                yield ids.index(out.request_id), out
        finally:
            if unfinished:  # queued behind the add, so it finds the requests whenever the handler gave up
                self.commands.put((concurrent.futures.Future(), self._abort, (ids,)))

    def _run(self):  # the engine thread
        while True:
            try:  # idle: sleep until a command comes; busy: run the queued commands, then step
                command = self.commands.get(block=not self.llm.has_unfinished_requests())
            except queue.Empty:
                self._step()
                continue
            if command is None:
                return
            future, fn, args = command
            if future.set_running_or_notify_cancel():  # False: the handler has already given up on it
                try:
                    future.set_result(fn(*args))
                except Exception as e:  # bad input (InvalidField) goes back to the handler, which answers 400
                    future.set_exception(e)

    def _step(self):
        try:
            for out in self.llm.step():  # each to its handler; a finished request's sink is dropped
                (self.sinks.pop(out.request_id) if out.finished else self.sinks[out.request_id])(out)
        except Exception as error:  # a bug or a device error: every request in flight fails; the server serves on
            logging.getLogger(__name__).exception("an engine step failed; failing the requests in flight")
            for request_id, sink in list(self.sinks.items()):
                self._abort([request_id])
                sink(error)

    def _add(self, prompts, params, request_ids, stream, sink):
        """All prompts are queued or none: one bad prompt in a list refuses the whole HTTP request."""
        try:
            for prompt, request_id in zip(prompts, request_ids, strict=False):
                self.llm.add_request(prompt, params, request_id, stream)
                self.sinks[request_id] = sink
        except Exception:
            self._abort(request_ids)
            raise

    def _abort(self, request_ids):
        for request_id in request_ids:
            self.llm.abort(request_id)
            self.sinks.pop(request_id, None)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def field(body: dict, name: str, kind: type, default):
    if body.get(name) is not None and not isinstance(body[name], kind):
        raise InvalidField(name, f"{body[name]!r} is not a {kind.__name__}")
    return default if body.get(name) is None else body[name]


def client_named(error: InvalidField, body: dict, chat: bool) -> InvalidField:
    """The error under the client's name for the field: chat calls three engine fields differently."""
    max_tokens = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    names = {"max_tokens": max_tokens, "logprobs": "top_logprobs", "prompt": "messages"} if chat else {}
    return InvalidField(names.get(error.field, error.field), error.problem)


def sampling_params(body: dict, chat: bool, max_model_len: int) -> SamplingParams:
    """SamplingParams from an OpenAI body. SamplingParams checks every type and range, so the server refuses a
    string temperature or a negative one with the same code as the offline API."""
    kwargs = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    given = [body.get(name) for name in (("max_completion_tokens", "max_tokens") if chat else ("max_tokens",))]
    kwargs["max_tokens"] = next((v for v in given if v is not None), max_model_len if chat else COMPLETION_MAX_TOKENS)
    if chat:  # `logprobs` says whether, `top_logprobs` how many alternatives
        kwargs["logprobs"] = (body.get("top_logprobs") or 0) if field(body, "logprobs", bool, False) else None
    else:
        kwargs["logprobs"] = body.get("logprobs")
    try:
        return SamplingParams(**kwargs)
    except InvalidField as e:
        raise client_named(e, body, chat) from None


def logprobs_json(tokenizer, chat: bool, token_ids: list[int], logprobs: list[dict] | None, num_top: int | None):
    """Chat: {"content": [{token, logprob, bytes, top_logprobs}]}; completions: the legacy parallel lists."""
    if logprobs is None:
        return None
    text = [tokenizer.decode([t]) for t in token_ids]
    top = [sorted(lp.items(), key=lambda item: -item[1])[:num_top] for lp in logprobs]
    if not chat:
        return {
            "tokens": text,
            "token_logprobs": [lp[t] for t, lp in zip(token_ids, logprobs, strict=False)],
            "top_logprobs": [{tokenizer.decode([i]): v for i, v in tp} for tp in top],
        }
    entry = lambda token, logprob: {"token": token, "logprob": logprob, "bytes": list(token.encode())}  # noqa: E731
    return {
        "content": [
            {**entry(s, lp[t]), "top_logprobs": [entry(tokenizer.decode([i]), v) for i, v in tp]}
            for s, t, lp, tp in zip(text, token_ids, logprobs, top, strict=False)
        ]
    }


def choice_json(tokenizer, chat: bool, stream: bool, index: int, c, num_top: int | None) -> dict:
    """A choice: the whole completion, or in a stream its new text and tokens (a chat stream names the role first)."""
    text, ids = (c.text_delta, c.token_ids_delta) if stream else (c.text, c.token_ids)
    logprobs = logprobs_json(tokenizer, chat, ids, c.logprobs and c.logprobs[len(c.token_ids) - len(ids) :], num_top)
    message = {"role": "assistant", "content": text} if len(ids) == len(c.token_ids) else {"content": text}
    body = {"delta" if stream else "message": message} if chat else {"text": text}
    return {"index": index, **body, "logprobs": logprobs, "finish_reason": c.finish_reason}


def usage_json(finals) -> dict:
    prompt = sum(len(out.prompt_token_ids) for out in finals)
    completion = sum(len(c.token_ids) for out in finals for c in out.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(out.num_cached_tokens for out in finals)},
    }


def build_app(llm, model_name: str | None = None) -> FastAPI:
    """The FastAPI app serving llm; its engine thread runs while the app does (lifespan)."""
    engine, model_name = EngineLoop(llm), model_name or llm.config.model or DEFAULT_MODEL

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.thread.start()
        yield
        engine.commands.put(None)
        engine.thread.join()

    app = FastAPI(title="nanoserve", lifespan=lifespan)
    app.exception_handler(ValueError)(lambda request, e: error_response(400, str(e), getattr(e, "field", None)))
    app.exception_handler(RuntimeError)(lambda request, e: error_response(500, str(e)))  # the engine failed it
    app.get("/health")(lambda: Response(status_code=200 if engine.thread.is_alive() else 503))
    app.get("/v1/models")(
        lambda: {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "owned_by": "nanoserve",
                    "max_model_len": llm.config.max_model_len,
                }
            ],
        }
    )

    @app.get("/metrics")
    async def metrics():
        stats = await engine.call(llm.stats)  # the engine's structures may only be read on its thread
        lines = [f"# TYPE nanoserve_{key} gauge\nnanoserve_{key} {stats[key]}" for key in GAUGES]
        lines += [f"# TYPE nanoserve_{key}_total counter\nnanoserve_{key}_total {stats[key]}" for key in COUNTERS]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def completions(http: Request):
        try:
            body, chat = json.loads(await http.body()), http.url.path.endswith("/chat/completions")
        except ValueError as e:
            return error_response(400, f"the body is not valid JSON: {e}")
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object")
        if body.get("model") is not None and body["model"] != model_name:
            return error_response(
                404,
                f"model {body['model']!r} does not exist; this server has {model_name!r}",
                "model",
                "model_not_found",
            )
        if not chat:  # a string, token ids, or a list of either; the engine refuses anything else as "prompt"
            p = body.get("prompt")
            return await serve(http, body, chat, p if isinstance(p, list) and p and not isinstance(p[0], int) else [p])
        messages = body.get("messages")  # one conversation (chat_prompts would also take a list of them)
        one = isinstance(messages, list) and messages and isinstance(messages[0], dict)
        return await serve(http, body, chat, await engine.call(llm.chat_prompts, messages if one else None))

    async def serve(http: Request, body: dict, chat: bool, prompts: list):
        """Queue the prompts; answer with the whole result, or a stream of chunks."""
        params = sampling_params(body, chat, llm.config.max_model_len)
        stream, options = field(body, "stream", bool, False), field(body, "stream_options", dict, {})
        usage = field(options, "include_usage", bool, False)  # checked before anything is queued
        results = engine.generate(http, prompts, params, stream)
        try:
            await anext(results)  # queues every prompt, or raises why not
        except InvalidField as e:
            raise client_named(e, body, chat) from None
        kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": model_name,
        }
        if stream:
            return StreamingResponse(
                stream_chunks(results, head, chat, params, len(prompts), usage), media_type="text/event-stream"
            )
        finals = {i: out async for i, out in results if out.finished}
        if len(finals) < len(prompts):
            return Response(status_code=499)  # the client went away: nobody reads this
        choices = [
            choice_json(llm.tokenizer, chat, False, i * params.n + c.index, c, params.logprobs)
            for i, out in sorted(finals.items())
            for c in out.outputs
        ]  # OpenAI: index = prompt x n + sample
        return {**head, "choices": choices, "usage": usage_json(finals.values())}

    async def stream_chunks(results, head: dict, chat: bool, params: SamplingParams, num_prompts: int, usage: bool):
        """A chunk per choice with new tokens (finish_reason rides on a choice's last), the usage if asked, [DONE]."""
        finals = {}
        try:
            async for i, out in results:
                finals.update({i: out} if out.finished else {})
                for c in out.outputs:
                    if c.token_ids_delta:
                        choice = choice_json(llm.tokenizer, chat, True, i * params.n + c.index, c, params.logprobs)
                        yield f"data: {json.dumps({**head, 'choices': [choice]}, ensure_ascii=False)}\n\n"
        except RuntimeError as e:  # the engine failed mid-stream, after the 200: say so in the stream, as OpenAI does
            yield f"data: {error_response(500, str(e)).body.decode()}\n\n"
            return
        if len(finals) < num_prompts:
            return  # the client went away
        if usage:
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage_json(finals.values())})}\n\n"
        yield "data: [DONE]\n\n"

    return app


@contextlib.contextmanager
def serve_in_background(llm, host: str = "127.0.0.1", port: int = 0, model_name: str | None = None):
    """Serve llm from a thread (tests, benchmarks); yields the base URL "http://host:port/v1" (port 0: any free)."""
    server = uvicorn.Server(uvicorn.Config(build_app(llm, model_name), host, port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="nanoserve-http", daemon=True)
    thread.start()
    while not server.started and thread.is_alive():  # started: the engine thread runs and the socket listens
        time.sleep(0.01)
    if not server.started:
        raise RuntimeError("the server did not start (see uvicorn's log)")
    try:
        yield f"http://{host}:{server.servers[0].sockets[0].getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join()


def main(argv=None):
    ap = argparse.ArgumentParser(description="nanoserve's OpenAI-compatible server")
    ap.add_argument("--model", help="HF model directory or hub id (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--host", default="127.0.0.1", help="0.0.0.0 serves every interface")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", help="the `model` clients ask for (default: --model)")
    engine_fields = [f for f in fields(EngineConfig) if f.name != "model"]
    for f in engine_fields:  # a flag left out keeps EngineConfig's default
        kinds = [k for k in (f.type, *getattr(f.type, "__args__", ())) if k in (int, float)] or [str]
        ap.add_argument(
            "--" + f.name.replace("_", "-"),
            default=None,
            **({"action": argparse.BooleanOptionalAction} if f.type is bool else {"type": kinds[0]}),
        )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from nanoserve.llm import LLM

    llm = LLM(args.model, **{f.name: getattr(args, f.name) for f in engine_fields if getattr(args, f.name) is not None})
    uvicorn.run(build_app(llm, args.served_model_name), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
