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
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from dataclasses import fields
from typing import TYPE_CHECKING, TypeVar, get_args

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from nanoserve.config import EngineConfig
from nanoserve.default_model import DEFAULT_MODEL
from nanoserve.llm import LLM
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling_params import InvalidField, SamplingParams

if TYPE_CHECKING:  # for annotations only: the tokenizer is the engine's, loaded by transformers
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")
# A request's outputs go to its sink on the engine thread; an exception instead when the engine failed it.
Sink = Callable[[RequestOutput | Exception], None]

DISCONNECT_POLL_S = 0.2  # a handler waiting for outputs checks this often whether its client is still there
STARTUP_POLL_S = 0.01  # serve_in_background checks this often whether uvicorn has started
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat's is the whole context
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away before the answer
LOCALHOST = "127.0.0.1"
DEFAULT_PORT = 8000  # vLLM's default too
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

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        # (concurrent future, function, args), or None: stop
        self.commands: queue.Queue[tuple[concurrent.futures.Future, Callable, tuple] | None] = queue.Queue()
        self.sinks: dict[str, Sink] = {}  # request_id -> its sink, used on the engine thread only
        self.thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)

    def call(self, fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
        """Run fn(*args) on the engine thread; the event loop awaits its result (or exception)."""
        future = concurrent.futures.Future()
        self.commands.put((future, fn, args))
        return asyncio.wrap_future(future)

    async def generate(
        self, http: Request, prompts: list, params: SamplingParams, stream: bool
    ) -> AsyncIterator[tuple[int, RequestOutput] | None]:
        """One engine request per prompt: yields None once all are queued (bad input raises before a response
        starts), then (prompt index, output) as they come; aborts what is left if the client or the caller quits."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()

        def sink(out: RequestOutput | Exception) -> None:  # called on the engine thread: hand over to this loop
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        request_ids = [f"{uuid.uuid4().hex}-{i}" for i in range(len(prompts))]
        unfinished = set(request_ids)
        try:
            await self.call(self._add, prompts, params, request_ids, stream, sink)
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
                if out.finished:
                    unfinished.discard(out.request_id)
                yield request_ids.index(out.request_id), out
        finally:
            if unfinished:  # queued behind the add, so it finds the requests whenever the handler gave up
                self.commands.put((concurrent.futures.Future(), self._abort, (request_ids,)))

    def _run(self) -> None:
        """The engine thread's loop, until the None command."""
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

    def _step(self) -> None:
        """One engine step; each output goes to its request's sink."""
        try:
            for out in self.llm.step():
                if out.finished:
                    sink = self.sinks.pop(out.request_id)  # its last output: the sink is dropped
                else:
                    sink = self.sinks[out.request_id]
                sink(out)
        except Exception as error:  # a bug or a device error: every request in flight fails; the server serves on
            logging.getLogger(__name__).exception("an engine step failed; failing the requests in flight")
            for request_id, sink in list(self.sinks.items()):
                self._abort([request_id])
                sink(error)

    def _add(self, prompts: list, params: SamplingParams, request_ids: list[str], stream: bool, sink: Sink) -> None:
        """All prompts are queued or none: one bad prompt in a list refuses the whole HTTP request."""
        try:
            for prompt, request_id in zip(prompts, request_ids, strict=False):
                self.llm.add_request(prompt, params, request_id, stream)
                self.sinks[request_id] = sink
        except Exception:
            self._abort(request_ids)
            raise

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.llm.abort(request_id)
            self.sinks.pop(request_id, None)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    """OpenAI's error body; param names the field at fault."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def field(body: dict, name: str, kind: type[T], default: T) -> T:
    """body[name] if it is given and not null, refused (InvalidField) unless it is a kind; else default."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise InvalidField(name, f"{value!r} is not a {kind.__name__}")
    return value


def client_named(error: InvalidField, body: dict, chat: bool) -> InvalidField:
    """The error under the client's name for the field: chat calls three engine fields differently."""
    max_tokens = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    names = {"max_tokens": max_tokens, "logprobs": "top_logprobs", "prompt": "messages"} if chat else {}
    return InvalidField(names.get(error.field, error.field), error.problem)


def sampling_params(body: dict, chat: bool, max_model_len: int) -> SamplingParams:
    """SamplingParams from an OpenAI body. SamplingParams checks every type and range, so the server refuses a
    string temperature or a negative one with the same code as the offline API."""
    kwargs = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    # max_tokens: chat's newer name first; by default, the whole context (chat) or OpenAI's 16 (completions)
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    given = [body[name] for name in names if body.get(name) is not None]
    if given:
        kwargs["max_tokens"] = given[0]
    elif chat:
        kwargs["max_tokens"] = max_model_len
    else:
        kwargs["max_tokens"] = COMPLETION_MAX_TOKENS
    if not chat:  # `logprobs` is how many alternatives
        kwargs["logprobs"] = body.get("logprobs")
    elif field(body, "logprobs", bool, False):  # chat: `logprobs` says whether, `top_logprobs` how many
        kwargs["logprobs"] = body.get("top_logprobs") or 0
    else:
        kwargs["logprobs"] = None
    try:
        return SamplingParams(**kwargs)
    except InvalidField as e:
        raise client_named(e, body, chat) from None


def logprobs_json(
    tokenizer: "PreTrainedTokenizerBase",
    chat: bool,
    token_ids: list[int],
    logprobs: list[dict[int, float]] | None,
    num_top: int | None,
) -> dict | None:
    """Chat: {"content": [{token, logprob, bytes, top_logprobs}]}; completions: the legacy parallel lists."""
    if logprobs is None:
        return None
    texts = [tokenizer.decode([token_id]) for token_id in token_ids]
    # per position, its num_top most likely (token id, logprob), most likely first
    tops = [sorted(position.items(), key=lambda item: -item[1])[:num_top] for position in logprobs]
    if not chat:
        return {
            "tokens": texts,
            "token_logprobs": [position[token_id] for token_id, position in zip(token_ids, logprobs, strict=False)],
            "top_logprobs": [{tokenizer.decode([alt]): logprob for alt, logprob in top} for top in tops],
        }

    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    content = []
    for text, token_id, position, top in zip(texts, token_ids, logprobs, tops, strict=False):
        alternatives = [entry(tokenizer.decode([alt]), logprob) for alt, logprob in top]
        content.append({**entry(text, position[token_id]), "top_logprobs": alternatives})
    return {"content": content}


def choice_json(
    tokenizer: "PreTrainedTokenizerBase",
    chat: bool,
    stream: bool,
    index: int,
    completion: CompletionOutput,
    num_top: int | None,
) -> dict:
    """A choice: the whole completion, or in a stream its new text and tokens (a chat stream names the role first)."""
    if stream:
        text, token_ids = completion.text_delta, completion.token_ids_delta
    else:
        text, token_ids = completion.text, completion.token_ids
    first = len(completion.token_ids) - len(token_ids)  # where these tokens start in the completion
    token_logprobs = None if completion.logprobs is None else completion.logprobs[first:]
    logprobs = logprobs_json(tokenizer, chat, token_ids, token_logprobs, num_top)
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason}
    if first == 0:  # the whole message, or a stream's first chunk: it names the role
        message = {"role": "assistant", "content": text}
    else:
        message = {"content": text}
    key = "delta" if stream else "message"
    return {"index": index, key: message, "logprobs": logprobs, "finish_reason": completion.finish_reason}


def usage_json(finals: Collection[RequestOutput]) -> dict:
    """OpenAI's usage: prompt and completion tokens of the finished requests, and the prompt's cached share."""
    prompt = sum(len(out.prompt_token_ids) for out in finals)
    completion = sum(len(sample.token_ids) for out in finals for sample in out.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(out.num_cached_tokens for out in finals)},
    }


def build_app(llm: LLM, model_name: str | None = None) -> FastAPI:
    """The FastAPI app serving llm; its engine thread runs while the app does (lifespan)."""
    engine = EngineLoop(llm)
    model_name = model_name or llm.config.model or DEFAULT_MODEL

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.thread.start()
        yield
        engine.commands.put(None)
        engine.thread.join()

    app = FastAPI(title="nanoserve", lifespan=lifespan)

    @app.exception_handler(ValueError)
    def bad_input(request: Request, error: ValueError) -> JSONResponse:
        """400, naming the field where the error is an InvalidField."""
        return error_response(400, str(error), error.field if isinstance(error, InvalidField) else None)

    @app.exception_handler(RuntimeError)
    def engine_failed(request: Request, error: RuntimeError) -> JSONResponse:
        return error_response(500, str(error))

    @app.get("/health")
    def health() -> Response:
        return Response(status_code=200 if engine.thread.is_alive() else 503)

    # response_model=None: a handler's return annotation documents it; FastAPI is not to validate against it
    @app.get("/v1/models", response_model=None)
    def models() -> dict:
        model = {
            "id": model_name,
            "object": "model",
            "owned_by": "nanoserve",
            "max_model_len": llm.config.max_model_len,
        }
        return {"object": "list", "data": [model]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        stats = await engine.call(llm.stats)  # the engine's structures may only be read on its thread
        lines = [f"# TYPE nanoserve_{key} gauge\nnanoserve_{key} {stats[key]}" for key in GAUGES]
        lines += [f"# TYPE nanoserve_{key}_total counter\nnanoserve_{key}_total {stats[key]}" for key in COUNTERS]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions", response_model=None)
    @app.post("/v1/chat/completions", response_model=None)
    async def completions(http: Request) -> Response | dict:
        chat = http.url.path.endswith("/chat/completions")
        try:
            body = json.loads(await http.body())
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
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompts = prompt  # a list of prompts
            else:
                prompts = [prompt]  # one prompt: text or token ids
            return await serve(http, body, chat, prompts)
        messages = body.get("messages")  # one conversation (chat_prompts would also take a list of them)
        if not (isinstance(messages, list) and messages and isinstance(messages[0], dict)):
            messages = None  # not one conversation: refused as "messages"
        return await serve(http, body, chat, await engine.call(llm.chat_prompts, messages))

    async def serve(http: Request, body: dict, chat: bool, prompts: list) -> Response | dict:
        """Queue the prompts; answer with the whole result, or a stream of chunks."""
        params = sampling_params(body, chat, llm.config.max_model_len)
        stream = field(body, "stream", bool, False)
        options = field(body, "stream_options", dict, {})
        usage = field(options, "include_usage", bool, False)  # checked before anything is queued
        results = engine.generate(http, prompts, params, stream)
        try:
            await anext(results)  # queues every prompt, or raises why not
        except InvalidField as e:
            raise client_named(e, body, chat) from None
        if not chat:
            kind, id_prefix = "text_completion", "cmpl"
        elif stream:
            kind, id_prefix = "chat.completion.chunk", "chatcmpl"
        else:
            kind, id_prefix = "chat.completion", "chatcmpl"
        head = {
            "id": f"{id_prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": model_name,
        }
        if stream:
            return StreamingResponse(
                stream_chunks(results, head, chat, params, len(prompts), usage), media_type="text/event-stream"
            )
        finals = {index: out async for index, out in results if out.finished}  # prompt index -> its final output
        if len(finals) < len(prompts):
            return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads this
        choices = [
            choice_json(llm.tokenizer, chat, False, index * params.n + sample.index, sample, params.logprobs)
            for index, out in sorted(finals.items())
            for sample in out.outputs
        ]  # OpenAI: index = prompt x n + sample
        return {**head, "choices": choices, "usage": usage_json(finals.values())}

    async def stream_chunks(
        results: AsyncIterator[tuple[int, RequestOutput]],
        head: dict,
        chat: bool,
        params: SamplingParams,
        num_prompts: int,
        usage: bool,
    ) -> AsyncIterator[str]:
        """A chunk per choice with new tokens (finish_reason rides on a choice's last), the usage if asked, [DONE]."""
        finals = {}  # prompt index -> its final output
        try:
            async for index, out in results:
                if out.finished:
                    finals[index] = out
                for sample in out.outputs:
                    if sample.token_ids_delta:
                        choice_index = index * params.n + sample.index  # OpenAI: prompt x n + sample
                        choice = choice_json(llm.tokenizer, chat, True, choice_index, sample, params.logprobs)
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
def serve_in_background(llm: LLM, host: str = LOCALHOST, port: int = 0, model_name: str | None = None) -> Iterator[str]:
    """Serve llm from a thread (tests, benchmarks); yields the base URL "http://host:port/v1" (port 0: any free)."""
    server = uvicorn.Server(uvicorn.Config(build_app(llm, model_name), host, port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="nanoserve-http", daemon=True)
    thread.start()
    while not server.started and thread.is_alive():  # started: the engine thread runs and the socket listens
        time.sleep(STARTUP_POLL_S)
    if not server.started:
        raise RuntimeError("the server did not start (see uvicorn's log)")
    try:
        yield f"http://{host}:{server.servers[0].sockets[0].getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join()


def flag_type(annotation: type) -> type:
    """What argparse converts an EngineConfig field's flag to: int or float (also from `int | None`), else str."""
    for kind in (annotation, *get_args(annotation)):
        if kind in (int, float):
            return kind
    return str


def main(argv: list[str] | None = None) -> None:
    """The command line: every EngineConfig field is a flag, and one left out keeps EngineConfig's default."""
    parser = argparse.ArgumentParser(description="nanoserve's OpenAI-compatible server")
    parser.add_argument("--model", help="HF model directory or hub id (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default=LOCALHOST, help="0.0.0.0 serves every interface")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--served-model-name", help="the `model` clients ask for (default: --model)")
    engine_fields = [config_field for config_field in fields(EngineConfig) if config_field.name != "model"]
    for config_field in engine_fields:
        flag = "--" + config_field.name.replace("_", "-")
        if config_field.type is bool:
            parser.add_argument(flag, default=None, action=argparse.BooleanOptionalAction)  # --x and --no-x
        else:
            parser.add_argument(flag, default=None, type=flag_type(config_field.type))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    engine_kwargs = {}
    for config_field in engine_fields:
        value = getattr(args, config_field.name)
        if value is not None:  # given on the command line
            engine_kwargs[config_field.name] = value
    llm = LLM(args.model, **engine_kwargs)
    uvicorn.run(build_app(llm, args.served_model_name), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
