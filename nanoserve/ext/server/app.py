"""The OpenAI-compatible HTTP server (`nanoserve serve DIR --port 8000`, or `python -m nanoserve.ext.server --model DIR
--port 8000`, and every EngineConfig field as a flag): /v1/completions and /v1/chat/completions, whole or streamed as
server-sent events, /v1/models, /health, and Prometheus /metrics; beside them, each in a module of its own, OpenAI's
Responses API and Anthropic's Messages API, where their extensions are installed (ext/responses_api.py,
ext/messages_api.py, each an idea of its own), and vLLM's tokenizer endpoints (tokens.py). The
engine is not thread-safe, so one thread owns it (EngineLoop). Handlers on uvicorn's event loop send it commands
through a queue.Queue and await the replies as futures; each HTTP request's outputs come back on its own
asyncio.Queue. A client that goes away has its requests aborted, which returns their KV blocks at once.

Every API answers through one chat pipeline, here (build_app's answer: the body checked and turned into
SamplingParams, the prompt tokenized, the request queued, the answer or its stream of chunks): the Responses and
Messages APIs translate their bodies into chat's, and turn chat's stream into their events with shared.py's loop
(Translated), which holds the other pieces they share too.

One request must not stall the others, so what a request costs is bounded before the engine sees it (ServerConfig:
the body's size, the time it takes to arrive, its nesting, n, the prompt's length in characters, and OpenAI's caps on
logprobs), and what takes a while per request runs on the event loop's executor, not on the event loop (every
stream's) nor on the engine thread: tokenizing, the chat template, and SamplingParams, which parses a response_format's
or a forced tool's JSON schema into a grammar (bounded by max_body_bytes: 0.2 s for a schema of 20,000 properties,
0.74 MiB, and 1.3 s at the 4 MiB cap, measured on the 2-core CI VM; xgrammar lets go of the GIL while it parses).
Every error, 404 and 405 included, comes in OpenAI's shape: {"error": {"message", "type", "param", "code"}} (on
/v1/messages, Anthropic's). A request that an extension fails on alone (finish reason
"error", RequestOutput.error) is answered by whose fault it was (failure): the request's own (the message names one of
its fields, as an InvalidField does: "structured_outputs: ...") a 400 naming that field, the engine's a 500; streamed,
the API's error event ends the stream, and the requests beside it go on. At shutdown, open requests get
ServerConfig.shutdown_timeout seconds to finish and then fail (a stream ends with an error event and [DONE]); a second
Ctrl+C exits at once.

Every field of a body is honoured or refused by name (the tables below): a client never silently gets less than it
asked for. A field the engine does not implement yet (beam search, vLLM's guided_* fields) is refused with a
400 naming it, unless its value asks for nothing (best_of 1); an unknown one is refused as OpenAI does; metadata that
changes nothing the client gets (user, store) is accepted. With ServerConfig.api_key set, every API request (all but
/health and /metrics) needs `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`). Tool calls: a forced one (a
named function) constrains the output to its parameters' schema; with --enable-auto-tool-choice --tool-call-parser
hermes, tool_choice "auto" (the default with tools, as in vLLM) has the calls parsed out of the model's text
(ext/tool_parsers.py)."""

import argparse
import asyncio
import atexit
import concurrent.futures
import contextlib
import gc
import hmac
import logging
import math
import os
import queue
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from dataclasses import fields, replace
from functools import partial
from itertools import accumulate
from types import FrameType
from typing import TYPE_CHECKING, get_args

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from tokenizers import decoders
from transformers.convert_slow_tokenizer import bytes_to_unicode

from nanoserve.checks import InvalidField, check_number, shown
from nanoserve.config import EngineConfig
from nanoserve.ext import find, load
from nanoserve.ext.chat import chat_prompts
from nanoserve.ext.default_model import DEFAULT_MODEL
from nanoserve.ext.server import tokens
from nanoserve.ext.server.shared import (
    LOCALHOST,
    NotFound,
    ServerConfig,
    T,
    check_known,
    event_stream,
    field,
    normalized,
    read_object,
    status_of,
)
from nanoserve.llm import LLM
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # for annotations only: the tokenizer is the engine's, loaded by transformers
    from transformers import PreTrainedTokenizerBase

DISCONNECT_POLL_S = 0.2  # a handler waiting for outputs checks this often whether its client is still there
STARTUP_POLL_S = 0.01  # serve_in_background checks this often whether uvicorn has started
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat's is the whole context
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away before the answer
API_KEY_ENV = "NANOSERVE_API_KEY"  # the API key, where --api-key is not given
MAX_TOP_LOGPROBS = 20  # OpenAI's cap on chat's top_logprobs
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's cap on the legacy completions' logprobs
PROMPT_CHARS_PER_TOKEN = 32  # the default cap on a prompt's characters, per token of max_model_len
SHUTDOWN_GRACE_S = 1.0  # after the drain: how long uvicorn waits for the failed requests' answers to go out
EXIT_ON_SECOND_SIGINT = 128 + signal.SIGINT  # 130, as a shell reports a process ended by Ctrl+C
# Named alike in OpenAI's body (with vLLM's extras) and SamplingParams
SAMPLING_FIELDS = """
    n temperature top_p top_k min_p min_tokens ignore_eos stop stop_token_ids seed presence_penalty frequency_penalty
    repetition_penalty logit_bias include_stop_str_in_output skip_special_tokens prompt_logprobs allowed_token_ids
    bad_words truncate_prompt_tokens
""".split()
# The body's fields. Honoured: SAMPLING_FIELDS and these. Anything in no table is refused, as OpenAI does.
HONOURED = "model max_tokens logprobs stream stream_options response_format".split() + SAMPLING_FIELDS
CHAT_HONOURED = "messages max_completion_tokens top_logprobs tools tool_choice".split() + HONOURED
COMPLETION_HONOURED = "prompt echo".split() + HONOURED
# Accepted and ignored: they change nothing the client gets (parallel_tool_calls: a forced call is one call, and "auto"
# returns the calls the model wrote; the prompt cache is automatic and shared, so its key and retention are hints)
IGNORED = """
    user metadata store service_tier safety_identifier prompt_cache_key prompt_cache_retention prompt_cache_options
    parallel_tool_calls
""".split()
# Known but not implemented yet (OpenAI's, then vLLM's extras): refused with a 400, unless the value asks for nothing
NOT_IMPLEMENTED = dict.fromkeys(
    """
    suffix functions audio prediction reasoning_effort verbosity web_search_options moderation
    logits_processors guided_json guided_regex guided_choice
    guided_grammar guided_decoding_backend guided_whitespace_pattern structural_tag structured_outputs chat_template
    chat_template_kwargs documents mm_processor_kwargs add_special_tokens request_id cache_salt kv_transfer_params
    vllm_xargs
    """.split()
) | {  # these values ask for nothing: what the engine does anyway
    "length_penalty": 1,
    "best_of": 1,
    "use_beam_search": False,
    "function_call": "none",
    "modalities": ["text"],
    "spaces_between_special_tokens": True,
    "add_generation_prompt": True,
    "continue_final_message": False,
    "return_tokens_as_token_ids": False,
    "return_token_ids": False,
    "priority": 0,
}
# OpenAI's ranges, inclusive, where SamplingParams allows more (it holds the penalties to OpenAI's [-2, 2] itself).
# Its caps on logprobs too: each alternative costs a decode and a JSON entry per token (49,152 would build megabytes):
# chat's top_logprobs, and the legacy completions' logprobs (chat's logprobs is a flag: a number there is refused
# either way, and top_logprobs in a completions body is unknown).
RANGES = {"temperature": (0, 2), "top_logprobs": (0, MAX_TOP_LOGPROBS), "logprobs": (0, MAX_COMPLETION_LOGPROBS)}
# LLM.stats()'s running totals (speculative decoding's drafts too) and the server's finished requests: Prometheus
# counters; every other key of stats() is a gauge
COUNTERS = """
    preemptions steps computed_tokens generated_tokens prefix_hit_tokens prefix_queried_tokens finished_requests
    spec_proposed_tokens spec_accepted_tokens
""".split()
REQUEST_FIELDS = {request_field.name for request_field in fields(SamplingParams)}  # a request's, by the engine's names


class EngineLoop:
    """The one thread that calls the engine: it runs queued commands, steps while any request is unfinished, and
    sleeps on the command queue when there is nothing to do."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.commands = queue.Queue()  # (concurrent future, function, args), or None: stop
        # request_id -> where its outputs go (an exception instead, when a step failed), used on the engine thread only
        self.sinks: dict[str, Callable] = {}
        self.finished_requests = 0  # requests the engine finished (for /metrics)
        self.deadline = math.inf  # set at shutdown (time.monotonic()): requests still open then fail
        self.thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)

    def call(self, fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
        """Run fn(*args) on the engine thread; the event loop awaits its result (or exception)."""
        future = concurrent.futures.Future()
        self.commands.put((future, fn, args))
        return asyncio.wrap_future(future)

    async def generate(
        self, http: Request, prompts: list, params: SamplingParams, stream: bool, lora_request: object = None
    ) -> AsyncIterator[tuple[int, RequestOutput] | None]:
        """One engine request per prompt (under lora_request's adapter, if not None): yields None once all are queued
        (bad input raises before a response starts), then (prompt index, output) as they come; aborts what is left if
        the client or the caller quits. A request that fails raises (failure); the others are aborted."""
        outputs = asyncio.Queue()  # this request's outputs, or the exception that failed its step
        # its sink, called on the engine thread: hands an output over to this event loop
        sink = partial(asyncio.get_running_loop().call_soon_threadsafe, outputs.put_nowait)
        request_ids = [f"{uuid.uuid4().hex}-{i}" for i in range(len(prompts))]
        unfinished = set(request_ids)
        add_request = self.llm.add_request
        if lora_request is not None:  # the adapter the body's model names: LLM.add_request with it (ext/lora)
            add_request = partial(load("lora", "model").add_request, self.llm, lora_request=lora_request)

        def add() -> None:  # on the engine thread: all prompts are queued or none (one bad prompt refuses them all)
            try:
                for prompt, request_id in zip(prompts, request_ids, strict=True):
                    add_request(prompt, params, request_id, stream)
                    self.sinks[request_id] = sink
            except Exception:
                self._abort(request_ids)
                raise

        try:
            await self.call(add)
            yield None
            while unfinished:
                if time.monotonic() > self.deadline:
                    raise RuntimeError("the server shut down before this request finished")
                try:
                    out = await asyncio.wait_for(outputs.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    out = None
                # the client is looked for at each output too (a cancelled read: cheap), since a whole answer that
                # another API makes of a stream (Translated.reply) gets outputs every step
                if await http.is_disconnected():
                    return
                if out is None:
                    continue
                if isinstance(out, Exception):  # the step failed, and every request in it
                    raise RuntimeError(f"the engine failed this request: {out}") from out
                if out.error is not None:  # an extension failed this request alone
                    raise failure(out.error)
                if out.finished:
                    unfinished.discard(out.request_id)
                yield request_ids.index(out.request_id), out
        finally:
            if unfinished:  # queued behind the add, so it finds the requests whenever the handler gave up
                self.call(self._abort, request_ids)

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
                self.sinks[out.request_id](out)
                if out.finished:  # its last output: the sink is dropped
                    del self.sinks[out.request_id]
                    self.finished_requests += 1
        except Exception as error:  # a bug or a device error: every request in flight fails; the server serves on
            logging.getLogger(__name__).exception("an engine step failed; failing the requests in flight")
            for request_id, sink in list(self.sinks.items()):
                self._abort([request_id])
                sink(error)

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.llm.abort(request_id)
            self.sinks.pop(request_id, None)


def failure(error: str) -> Exception:
    """What answers a request that an extension failed on alone (finish reason "error"; RequestOutput.error, the
    core's Sequence.error), by whose fault it was. A message in InvalidField's form naming a request field
    ("structured_outputs: ...", as str() of an InvalidField reads) says it was the request's own: an InvalidField, a
    400 naming that field. Any other was the engine's (an adapter, a kernel): a RuntimeError, a 500."""
    name, _, problem = str(error).partition(": ")
    if name in REQUEST_FIELDS:
        return InvalidField(name, problem)
    return RuntimeError(f"the engine failed this request: {error}")


def error_body(error: Exception, message: str | None = None) -> dict:
    """OpenAI's error body for error (its own message, unless message is given): an InvalidField's field is the
    param, and the type says whose fault it was (status_of)."""
    kind = "server_error"
    if status_of(error) < 500:
        kind = "invalid_request_error"
    param = None
    if isinstance(error, InvalidField):
        param = error.field
    return {"error": {"message": message or str(error), "type": kind, "param": param, "code": None}}


def text_length(value: object) -> int:
    """Characters of text in a prompt, a list of them, or a conversation: what tokenizing it would cost."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):  # nested at most MAX_JSON_DEPTH deep: the recursion is bounded
        return sum(map(text_length, value))
    return 0


def check_fields(body: dict, chat: bool) -> None:
    """A completions or chat body's fields (check_known, with the tables above), stream_options too. The honoured
    fields' types and ranges are SamplingParams' to check (sampling_params), except OpenAI's narrower ranges and
    caps (RANGES), checked here on numbers only: true or a string is for the type checks to refuse. stream_options
    is refused without stream: true, as OpenAI and vLLM refuse it; continuous_usage_stats without include_usage is
    accepted and adds nothing, as in vLLM (whose chunks carry usage only with include_usage)."""
    check_known(body, CHAT_HONOURED if chat else COMPLETION_HONOURED, IGNORED, NOT_IMPLEMENTED)
    for name, (low, high) in RANGES.items():
        if type(body.get(name)) in (int, float):  # JSON's numbers (a bool is not one)
            check_number(name, body[name], low, high)
    options = field(body, "stream_options", dict, {})
    check_known(options, ["include_usage", "continuous_usage_stats"], [], {}, "stream_options.")
    for name in options:
        if body.get("stream") is not True:
            raise InvalidField(f"stream_options.{name}", "is only allowed with stream: true")
    for name in ("echo", "prompt_logprobs"):  # a stream's chunks carry only the completion
        if body.get(name) not in (None, False) and body.get("stream"):  # a bad type is refused by name later, too
            raise InvalidField(name, "nanoserve does not implement this field in a stream yet")
    if chat and body.get("top_logprobs") is not None and body.get("logprobs") is not True:
        raise InvalidField("top_logprobs", "needs logprobs: true")


def check_context(prompts: list[list[int]], max_tokens: int, max_model_len: int, names: tuple[str, str]) -> None:
    """A prompt plus max_tokens beyond the context is refused with the numbers (vLLM's words), not cut at "length".
    names: the body's fields for the prompt and for max_tokens; the error names max_tokens's unless the prompt alone
    fills the context."""
    prompt_field, tokens_field = names
    for ids in prompts:
        if len(ids) + max_tokens > max_model_len:
            raise InvalidField(
                prompt_field if len(ids) >= max_model_len else tokens_field,
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the {prompt_field}, {max_tokens} in the completion). "
                f"Please reduce the length of the {prompt_field} or completion.",
            )


def max_tokens_field(body: dict) -> str | None:
    """The body's field that gives max_tokens (chat's newer name, max_completion_tokens, first: check_fields refuses it
    in a completions body); None: neither."""
    return next((name for name in ("max_completion_tokens", "max_tokens") if body.get(name) is not None), None)


def client_named(error: InvalidField, body: dict, chat: bool) -> InvalidField:
    """The error under the client's name for the field: chat calls three engine fields differently."""
    max_tokens = max_tokens_field(body) or "max_tokens"
    names = {"max_tokens": max_tokens, "logprobs": "top_logprobs", "prompt": "messages"} if chat else {}
    return InvalidField(names.get(error.field, error.field), error.problem)


def sampling_params(body: dict, chat: bool, max_model_len: int, tool: dict | str) -> SamplingParams:
    """SamplingParams from an OpenAI body. SamplingParams checks every type and range, so the server refuses a
    string temperature or a negative one with the same code as the offline API."""
    kwargs = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    # max_tokens: by default, the whole context (chat) or OpenAI's 16 (completions)
    given = max_tokens_field(body)
    kwargs["max_tokens"] = body[given] if given else (max_model_len if chat else COMPLETION_MAX_TOKENS)
    bias = kwargs.get("logit_bias")
    if isinstance(bias, dict):  # JSON's keys are strings: OpenAI's token ids come as "50256"; others are refused
        kwargs["logit_bias"] = {int(key) if key.isdecimal() else key: value for key, value in bias.items()}
    if not chat:  # `logprobs` is how many alternatives; with echo, of the prompt's tokens too
        kwargs["logprobs"] = body.get("logprobs")
        if field(body, "echo", bool, False):  # vLLM's prompt_logprobs, if given too, says how many for the prompt
            kwargs.setdefault("prompt_logprobs", kwargs["logprobs"])
            if kwargs["max_tokens"] == 0:  # the prompt's logprobs only: one token is run for them, and dropped
                kwargs["max_tokens"] = 1  # (not max(): a string max_tokens is SamplingParams' to refuse, by name)
    elif field(body, "logprobs", bool, False):  # chat: `logprobs` says whether, `top_logprobs` how many
        kwargs["logprobs"] = body.get("top_logprobs") or 0
    kwargs["structured_outputs"] = structured_outputs(body, tool)
    try:
        return SamplingParams(**kwargs)
    except InvalidField as e:  # under the client's name: chat's `logprobs` count is its top_logprobs
        raise client_named(e, body, chat) from None


def structured_outputs(body: dict, tool: dict | str) -> dict | None:
    """vLLM's structured outputs for a response_format, or for a forced tool call (its parameters' schema)."""
    response_format = field(body, "response_format", dict, {})
    kind = response_format.get("type", "text")
    schema = field(response_format, "json_schema", dict, {}).get("schema") or {"type": "object"}
    forms = {"text": None, "json_object": {"json_object": True}, "json_schema": {"json": schema}}
    forced = isinstance(tool, dict)
    if forced and kind == "text":
        return {"json": tool["function"].get("parameters") or {"type": "object"}}
    if kind not in forms or forced:
        raise InvalidField("response_format", "expected type text, json_object or json_schema, and no forced tool call")
    return forms[kind]


def tool_choice(body: dict, auto: bool) -> dict | str:
    """What a chat body's tool_choice asks for: "none" (tools, if any, go to the chat template only; the answer is
    text), "auto" (tool calls parsed out of the answer's text: only on a server started with
    --enable-auto-tool-choice), or the tool it forces (a named function, or "required" with one tool), whose parameters'
    schema then constrains the answer. Without tool_choice, tools mean "auto" on a server that parses tool calls and
    "none" on others, as vLLM's."""
    tools = field(body, "tools", list, [])
    try:
        by_name = {tool["function"]["name"]: tool for tool in tools}
    except (TypeError, KeyError):  # a tool that is not a dict of that shape
        raise InvalidField("tools", "expected a list of {'type': 'function', 'function': {'name': str, ...}}") from None
    choice = body.get("tool_choice") or ("auto" if tools and auto else "none")
    if choice == "auto" and not auto:
        raise InvalidField("tool_choice", "'auto' needs a server started with --enable-auto-tool-choice")
    if choice in ("none", "auto"):
        return choice if tools else "none"  # "auto" with no tools: nothing to call
    if choice == "required" and len(tools) == 1:
        return tools[0]
    try:  # {"type": "function", "function": {"name": NAME}}, as a tool names itself
        return by_name[choice["function"]["name"]]
    except (TypeError, KeyError):  # not a dict of that shape, or no tool of that name
        raise InvalidField(
            "tool_choice", f"{shown(choice)} is not 'none', 'auto', 'required' with one tool, or a tool's name"
        ) from None


# Byte-level BPE (GPT-2's, and SmolLM2's, Llama 3's, Qwen's) spells each byte as one printable character: the
# printable Latin-1 bytes ("!" to "~", "¡" to "¬", "®" to "ÿ") as themselves, the other 68 as chr(256 + k) in order.
# transformers' bytes_to_unicode is that table (byte -> character); inverted here: character -> byte.
BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer: "PreTrainedTokenizerBase", token_id: int) -> bytes:
    """A token's own UTF-8 bytes, which may be part of a character: an emoji spans several tokens, and each decoded
    alone shows U+FFFD. A byte-level tokenizer's token string maps back to bytes; another's falls back to its text."""
    token = tokenizer.convert_ids_to_tokens(token_id)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(getattr(backend, "decoder", None), decoders.ByteLevel) and all(c in BYTE_OF_CHAR for c in token):
        return bytes(BYTE_OF_CHAR[c] for c in token)
    return tokenizer.decode(token_id).encode()


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
    # per position, its num_top most likely (token id, logprob), most likely first (an echoed prompt's first: None):
    # the engine's dicts hold those first, then the chosen token where it is not among them (logprob_dicts)
    tops = [position and list(position.items())[:num_top] for position in logprobs]
    if not chat:
        tokens = [tokenizer.decode(token_id) for token_id in token_ids]
        return {
            "tokens": tokens,
            "token_logprobs": [position and position[t] for t, position in zip(token_ids, logprobs, strict=False)],
            # a dict per token, {} with logprobs 0 (None: an echoed prompt's first token)
            "top_logprobs": [None if top is None else {tokenizer.decode(a): p for a, p in top} for top in tops],
            "text_offset": [0, *accumulate(map(len, tokens))][: len(tokens)],
        }

    def entry(token_id: int, logprob: float) -> dict:
        return {
            "token": tokenizer.decode(token_id),
            "logprob": logprob,
            "bytes": list(token_bytes(tokenizer, token_id)),
        }

    return {
        "content": [
            {**entry(token_id, position[token_id]), "top_logprobs": [entry(alt, logprob) for alt, logprob in top]}
            for token_id, position, top in zip(token_ids, logprobs, tops, strict=False)
        ]
    }


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


def build_app(engine: EngineLoop, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving engine.llm; the engine thread runs while the app does (lifespan)."""
    llm = engine.llm
    model_name = config.served_model_name or llm.config.model or DEFAULT_MODEL
    # --lora-modules: name -> its LoRARequest, each adapter checked and loaded before the server serves
    adapters = {}
    for lora_int_id, (name, path) in enumerate(config.adapters.items(), 1):
        lora = load("lora", "lora_modules")
        adapters[name] = lora.LoRARequest(name, lora_int_id, path)
        lora.check_adapter(llm, adapters[name])
    max_prompt_chars = config.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * llm.config.max_model_len

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.thread.start()
        yield
        engine.commands.put(None)
        engine.thread.join()

    app = FastAPI(title="nanoserve", lifespan=lifespan)

    def authorize(http: Request) -> None:
        """With an API key set, a request to the API needs it, as OpenAI's clients send it (`Authorization: Bearer
        KEY`) or Anthropic's (`x-api-key: KEY`): else a 401, before the body is read. Compared in constant time."""
        if config.api_key is None:
            return
        key = config.api_key.encode()
        bearer = http.headers.get("authorization", "").encode()
        anthropic = http.headers.get("x-api-key", "").encode()
        if not (hmac.compare_digest(bearer, b"Bearer " + key) or hmac.compare_digest(anthropic, key)):
            raise HTTPException(401, "a valid API key is needed (Authorization: Bearer KEY, or x-api-key: KEY)")

    # every API route is behind the key; /health and /metrics are open, as vLLM's
    api = APIRouter(dependencies=[Depends(authorize)])
    responses_api = find("responses_api")
    messages_api = find("messages_api")

    def error_for(request: Request, error: Exception, message: str) -> JSONResponse:
        """An error in the shape of the API the request speaks: Anthropic's on /v1/messages, OpenAI's elsewhere."""
        status = status_of(error)
        body = error_body(error, message)
        if messages_api is not None and request.url.path.startswith(messages_api.PATH):
            body = messages_api.error_body(status, message)
        return JSONResponse(body, status)

    @app.exception_handler(HTTPException)
    def http_error(request: Request, error: HTTPException) -> JSONResponse:
        """Starlette's errors (404: no such route; 405: wrong method), read_body's (408, 413) and authorize's (401)."""
        response = error_for(request, error, f"{error.detail}: {request.method} {request.url.path}")
        response.headers.update(error.headers or {})  # 405's Allow, or Connection: close
        return response

    @app.exception_handler(ClientDisconnect)
    def client_gone(request: Request, error: ClientDisconnect) -> Response:
        """The client hung up while its body was being read: an ordinary disconnect (a debug line, not a traceback);
        nobody reads the answer."""
        logging.getLogger(__name__).debug("a client went away before its request's body arrived")
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(ValueError)  # bad input: a 400 naming the field (an InvalidField's), a NotFound's 404
    @app.exception_handler(RuntimeError)  # the engine failed the request (its thread has logged why): a 500
    @app.exception_handler(Exception)  # a bug, a 500: uvicorn logs its traceback too
    def failed(request: Request, error: Exception) -> JSONResponse:
        return error_for(request, error, str(error) or type(error).__name__)

    @app.get("/health")
    def health() -> Response:
        return Response(status_code=200 if engine.thread.is_alive() else 503)

    # response_model=None: a handler's return annotation documents it; FastAPI is not to validate against it
    @api.get("/v1/models", response_model=None)
    def models() -> dict:
        model = {
            "id": model_name,
            "object": "model",
            "owned_by": "nanoserve",
            "max_model_len": llm.config.max_model_len,
        }
        lora = [{**model, "id": name, "parent": model_name, "root": r.lora_path} for name, r in adapters.items()]
        return {"object": "list", "data": [model, *lora]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        stats = await engine.call(llm.stats)  # the engine's structures may only be read on its thread
        stats["finished_requests"] = engine.finished_requests
        lines = []
        for key, value in stats.items():
            if key in COUNTERS:
                lines.append(f"# TYPE nanoserve_{key}_total counter\nnanoserve_{key}_total {value}")
            else:
                lines.append(f"# TYPE nanoserve_{key} gauge\nnanoserve_{key} {value}")
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @api.post("/v1/completions", response_model=None)
    @api.post("/v1/chat/completions", response_model=None)
    async def completions(http: Request) -> Response | dict:
        """Both endpoints, which differ in the prompt's form and the choices' shape: the answer, or its chunks as
        server-sent events ending with [DONE]."""
        chat = http.url.path.endswith("/chat/completions")
        answered = await answer(http, await read_object(http, config), chat)
        if not isinstance(answered, AsyncIterator):
            return answered
        # the engine failed, or shutdown came, after the 200: the stream says so
        events = event_stream(answered, lambda error: [error_body(error)], "data: [DONE]\n\n")
        return StreamingResponse(events, media_type="text/event-stream")

    async def answer(http: Request, body: dict, chat: bool) -> dict | Response | AsyncIterator[dict]:
        """A completions or a chat body answered, the pipeline every API shares (the Responses and Messages APIs
        translate their bodies into chat's): 1) the body, checked and turned into SamplingParams; 2) the prompts as
        token ids; 3) queued; 4) the answer, whole, or (stream) its chunks as dicts once every prompt is queued."""
        # 1) the body: nothing is tokenized or queued before every field has been checked
        check_fields(body, chat)
        check_model(body)
        # what tool_choice asks for: "none", "auto" (calls parsed out of the text), or the tool it forces
        tool = tool_choice(body, config.enable_auto_tool_choice)
        # on the executor: a response_format's schema becomes a grammar here (xgrammar parses it), which may take a
        # while for a large one; the event loop (every stream) and the engine thread do not wait for it
        params = await asyncio.to_thread(sampling_params, body, chat, llm.config.max_model_len, tool)
        stream = field(body, "stream", bool, False)
        options = field(body, "stream_options", dict, {})
        usage = field(options, "include_usage", bool, False)
        # vLLM's: with include_usage, every chunk carries its choice's usage so far (guidellm asks for it)
        continuous_usage = usage and field(options, "continuous_usage_stats", bool, False)
        echo = field(body, "echo", bool, False)  # never in a stream: check_fields refuses it
        keep = params.truncate_prompt_tokens  # vLLM's: only the prompt's last N tokens (None: all of it)

        # 2) the prompts as token ids
        prompt_field = "messages" if chat else "prompt"
        # to_ids() tokenizes, on the executor: the engine thread, and with it every stream, does not wait for it
        if chat:  # one conversation, as a list of one: chat_prompts takes a list of conversations
            prompts = [normalized(body.get("messages"))]
            to_ids = partial(chat_prompts, llm, prompts, tools=body.get("tools"))  # rendered by the template, if it can
        else:  # a string, token ids, or a list of either; the engine refuses anything else as "prompt"
            prompt = body.get("prompt")
            is_list = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
            prompts = prompt if is_list else [prompt]  # a list of prompts, or one: text or token ids
            # each checked as the engine checks a prompt (which it does again on the ids, in O(length)); prompt_ids
            # reads only the tokenizer and the config, so any thread may call it. map is lazy: list() runs it there
            to_ids = partial(list, map(partial(llm.prompt_ids, keep=keep), prompts))
        if len(prompts) * params.n > config.max_n:
            name = "n" if params.n > 1 else prompt_field
            raise InvalidField(name, f"{len(prompts)} prompt(s) x n={params.n} is over {config.max_n} choices")
        check_chars(prompts, prompt_field)
        prompts = [ids[-keep:] if keep else ids for ids in await asyncio.to_thread(to_ids)]  # chat's too
        # chat's default max_tokens, the whole context, means as much as fits; any other is checked against it
        if not chat or max_tokens_field(body) is not None:
            names = (prompt_field, max_tokens_field(body) or "max_tokens")
            check_context(prompts, params.max_tokens, llm.config.max_model_len, names)

        # 3) queued: every prompt, or none
        results = engine.generate(http, prompts, params, stream, adapters.get(body.get("model")))
        try:
            await anext(results)  # queues every prompt, or raises why not
        except InvalidField as e:
            raise client_named(e, body, chat) from None

        # 4) the answer
        kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": body.get("model") or model_name,
        }

        parsers = {}  # with tool_choice "auto": choice index -> its tool parser (ext/tool_parsers.py)

        def choice(index: int, out: RequestOutput, sample: CompletionOutput) -> dict:
            """Sample `sample` of prompt `index` as a choice, which OpenAI numbers prompt x n + sample: the whole
            completion, or in a stream its new text and tokens (a chat stream names the role first). With echo
            (completions, never streamed): the prompt's text, tokens and logprobs before the completion's. Chat with
            a forced tool call: OpenAI's tool_calls, the output its arguments (a stream's first chunk names the call,
            as vLLM's, and the others carry more of its arguments); with "auto": the calls the tool parser finds, and
            the text outside them as content. A choice that made calls and stopped on its own ends with
            finish_reason "tool_calls"; one cut at max_tokens says "length", whatever it made."""
            text, token_ids = (sample.text_delta, sample.token_ids_delta) if stream else (sample.text, sample.token_ids)
            first = len(sample.token_ids) - len(token_ids)  # where these tokens start in the completion
            token_logprobs = sample.logprobs and sample.logprobs[first:]  # None: no logprobs asked for
            if echo:
                text = llm.tokenizer.decode(out.prompt_token_ids) + text
                token_ids = out.prompt_token_ids + token_ids
                if token_logprobs is not None:
                    token_logprobs = out.prompt_logprobs + token_logprobs
            result = {
                "index": index * params.n + sample.index,
                "logprobs": logprobs_json(llm.tokenizer, chat, token_ids, token_logprobs, params.logprobs),
                "finish_reason": sample.finish_reason,
            }
            if not chat:
                result["text"] = text
            else:
                content, calls, num_calls = text, [], 0  # num_calls: the calls this choice has made so far
                if isinstance(tool, dict):  # forced: the whole output is the call's arguments
                    function = {"name": tool["function"]["name"], "arguments": text}
                    call = {"id": f"call_{uuid.uuid4().hex}", "type": "function", "function": function}
                    if stream and first > 0:
                        call = {"index": 0, "function": {"arguments": text}}
                    elif stream:
                        call = {"index": 0, **call}
                    content, calls, num_calls = "", [call], 1
                elif tool == "auto":  # as the text comes: the calls in it (a stream's deltas), the text outside them
                    parser = parsers.setdefault(result["index"], config.tool_parser())
                    content, calls = parser.feed(text, final=sample.finish_reason is not None)
                    calls = calls if stream else parser.calls  # whole: each call joined from its deltas
                    num_calls = parser.num_calls
                # the whole message, or a stream's first chunk, names the role
                message = {"role": "assistant", "content": content} if first == 0 else {"content": content}
                if calls:
                    message["tool_calls"] = calls
                if calls and not content and not stream:  # OpenAI's: a message of calls only has content null
                    message["content"] = None
                if num_calls and sample.finish_reason == "stop":
                    result["finish_reason"] = "tool_calls"
                result["delta" if stream else "message"] = message
            if body.get("prompt_logprobs") is not None:  # vLLM's: per prompt token (the first: None), by token id
                result["prompt_logprobs"] = [
                    entry
                    and {str(t): {"logprob": p, "decoded_token": llm.tokenizer.decode(t)} for t, p in entry.items()}
                    for entry in out.prompt_logprobs
                ]
            return result

        async def chunks() -> AsyncIterator[dict]:
            """A chunk per choice with new tokens (finish_reason rides on a choice's last; with continuous usage, its
            usage so far), then the usage of all if asked. An engine failure raises its RuntimeError."""
            finals = {}  # prompt index -> its final output
            async for index, out in results:
                if out.finished:
                    finals[index] = out
                for sample in out.outputs:
                    if sample.token_ids_delta:
                        chunk = {**head, "choices": [choice(index, out, sample)]}
                        if continuous_usage:  # this choice's tokens so far
                            chunk["usage"] = usage_json([replace(out, outputs=[sample])])
                        yield chunk
            if usage and len(finals) == len(prompts):  # (fewer: the client went away)
                yield {**head, "choices": [], "usage": usage_json(finals.values())}

        if stream:
            return chunks()
        finals = {index: out async for index, out in results if out.finished}  # prompt index -> its final output
        if len(finals) < len(prompts):
            return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads this
        if echo and body.get("max_tokens") == 0:  # the prompt's logprobs only: the one token run for them is dropped
            for out in finals.values():
                out.outputs = [replace(s, text="", token_ids=[], logprobs=s.logprobs and []) for s in out.outputs]
        choices = [choice(index, out, sample) for index, out in sorted(finals.items()) for sample in out.outputs]
        return {**head, "choices": choices, "usage": usage_json(finals.values())}

    def check_model(body: dict) -> None:
        """The body's model, where given, is this server's or one of its adapters'; any other is a 404."""
        if body.get("model") not in (None, model_name, *adapters):
            raise NotFound("model", f"{shown(body['model'])} does not exist; this server has {[model_name, *adapters]}")

    def check_chars(prompts: object, prompt_field: str) -> None:
        """A request's prompt text (all prompts, or all messages) within the cap, before anything is tokenized."""
        num_chars = text_length(prompts)
        if num_chars > max_prompt_chars:
            raise InvalidField(prompt_field, f"has {num_chars} characters; this server takes {max_prompt_chars}")

    # the other APIs, each an extension of the server (deleting one removes its routes, nothing else)
    for api_extension in (responses_api, messages_api):
        if api_extension is not None:
            api_extension.add_routes(api, answer, config, model_name)
    tokens.add_routes(api, llm, config, check_model, check_chars)
    app.include_router(api)
    return app


class Server(uvicorn.Server):
    """uvicorn's server for llm on config.host and config.port: it owns the engine thread (EngineLoop), whose open
    requests get a bounded drain at shutdown, and a second Ctrl+C exits at once."""

    def __init__(self, llm: LLM, config: ServerConfig, log_level: str | None = None) -> None:
        self.engine = EngineLoop(llm)
        self.shutdown_timeout = config.shutdown_timeout
        grace = self.shutdown_timeout + SHUTDOWN_GRACE_S  # then uvicorn cancels whatever still runs
        app = build_app(self.engine, config)
        super().__init__(
            uvicorn.Config(app, config.host, config.port, log_level=log_level, timeout_graceful_shutdown=grace)
        )

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn stops accepting and waits for the open requests: after shutdown_timeout, they fail."""
        self.engine.deadline = time.monotonic() + self.shutdown_timeout
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """A second Ctrl+C exits now. uvicorn's own would skip the app's shutdown and leave the engine thread in a
        step while the interpreter exits, which aborts in torch ("terminate called without an active exception")."""
        if sig == signal.SIGINT and self.should_exit:
            logging.getLogger(__name__).warning("a second Ctrl+C: exiting without waiting for open requests")
            os._exit(EXIT_ON_SECOND_SIGINT)
        super().handle_exit(sig, frame)


@contextlib.contextmanager
def serve_in_background(llm: LLM, config: ServerConfig | None = None) -> Iterator[str]:
    """Serve llm from a thread (tests, benchmarks) on a free port of 127.0.0.1; yields the base URL
    "http://127.0.0.1:PORT/v1"."""
    config = replace(config or ServerConfig(), host=LOCALHOST, port=0)  # port 0: any free one
    server = Server(llm, config, log_level="warning")
    thread = threading.Thread(target=server.run, name="nanoserve-http", daemon=True)
    thread.start()
    while not server.started and thread.is_alive():  # started: the engine thread runs and the socket listens
        time.sleep(STARTUP_POLL_S)
    if not server.started:
        raise RuntimeError("the server did not start (see uvicorn's log)")
    try:
        yield f"http://{LOCALHOST}:{server.servers[0].sockets[0].getsockname()[1]}/v1"
    finally:
        server.should_exit = True  # then the drain: open requests get config.shutdown_timeout to finish
        thread.join()


def freeze_heap() -> None:
    """A server process holds one engine for its life, as vLLM's engine core does, and does what vLLM does there:
    freezes the heap once the engine is built. Python's full garbage collection walks every object alive, ~417,000
    with torch, transformers and the engine (194 ms on the 2-core CI machine), and starts one whenever enough new
    objects survive, so a server up for hours would pause some step's host path each time. Frozen objects are never
    walked again, nor collected: right for what lives as long as the process, wrong in a process that makes and drops
    engines (a test suite, a notebook), so the engine itself does not freeze. Unfrozen at exit, so that the collector
    frees them after all (extension modules report objects never freed)."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """The command line: every EngineConfig and ServerConfig field is a flag; one left out keeps its default. prog:
    the command's name in --help (`nanoserve serve` from cli.py; `python -m nanoserve.ext.server` runs __main__.py)."""
    # argument_default=SUPPRESS: a flag left out is missing from the parsed arguments, so its field keeps its default
    parser = argparse.ArgumentParser(
        prog, description="nanoserve's OpenAI-compatible server", argument_default=argparse.SUPPRESS
    )
    parser.add_argument("--model", help="HF model directory or hub id (default: the embedded SmolLM2-135M-Instruct)")
    server_fields = fields(ServerConfig)
    for config_field in fields(EngineConfig) + server_fields:
        if config_field.name == "model":
            continue  # its flag, with its help, is above
        flag = "--" + config_field.name.replace("_", "-")
        # the flag's type: the field's (bool, int or float), also from `int | None`; else str
        kinds = (config_field.type, *get_args(config_field.type))
        kind = next((kind for kind in (bool, int, float) if kind in kinds), str)
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction)  # --x and --no-x
        else:  # --lora-modules takes a list
            parser.add_argument(flag, type=kind, nargs="+" if config_field.name == "lora_modules" else None)
    # vLLM's LoRA flags, which LLM() takes by the same names (ext/vllm_names.py makes lora_config of them)
    parser.add_argument("--enable-lora", action=argparse.BooleanOptionalAction)
    for flag in ("--max-loras", "--max-lora-rank", "--max-cpu-loras"):
        parser.add_argument(flag, type=int)
    parser.set_defaults(api_key=os.environ.get(API_KEY_ENV))  # the key from the environment, unless --api-key
    args = vars(parser.parse_args(argv))
    config = ServerConfig(**{f.name: args.pop(f.name) for f in server_fields if f.name in args})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if config.lora_modules and "enable_lora" not in args:  # adapters need LoRA on: vLLM's default sizes unless
        args.setdefault("lora_config", "{}")  # --lora-config or --enable-lora --max-loras ... give others
    llm = LLM(**args)  # what is left: the EngineConfig fields given, --model among them
    server = Server(llm, config)
    freeze_heap()
    with contextlib.suppress(KeyboardInterrupt):  # after a Ctrl+C's drain, uvicorn raises it again
        server.run()
