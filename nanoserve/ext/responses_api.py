"""An extension of the server (ext/server), which mounts it where it is installed: OpenAI's Responses API, as OpenAI
specifies it and vLLM serves it: POST /v1/responses and GET /v1/responses/{id}, what the OpenAI Agents SDK and Codex
speak. A request is translated into a chat body (chat_body) and answered by the chat pipeline (app.py's answer: the
same checks, caps, sampling, tool parser and cancellation), whose stream of chunks becomes the Responses events
(ResponseEvents); a whole response is the one the last event carries.

The input is a string or a list of items: messages (text parts only: input_text, output_text), and the function_call
and function_call_output items of a tool-call turn (each output after its call). instructions are the system message.
tools are functions (strict or not: the schema is enforced where the call is forced, by a named tool_choice or
"required", through the structured-outputs extension; with "auto" the tool parser returns what the model wrote, as
vLLM's does); text.format is text, json_object or json_schema. parallel_tool_calls is accepted as chat's is (a forced
call is one call, and "auto" returns the calls the model wrote). A response with store (OpenAI's default) is kept in
memory, at most ServerConfig.max_stored_responses of them, the least recently used (made or read) dropped first:
previous_response_id continues its conversation (its input and output items, not its instructions, as OpenAI's), and
GET returns it; an id not kept is a 404 naming it. Fields nanoserve does not implement (reasoning that asks for
something, background, include, built-in tools such as web_search, conversation, ...) are refused by name. A request
that fails is an HTTP error in OpenAI's shape (400 for its own fault, 500 for the engine's), or, once its stream has
begun, response.failed (error.code invalid_prompt or server_error; opened by response.created first, if need be)."""

import copy
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from nanoserve.checks import InvalidField, shown
from nanoserve.ext.server.shared import (
    NotFound,
    ServerConfig,
    Translated,
    chat_messages,
    check_known,
    field,
    function_tools,
    read_object,
    status_of,
)

# The body's fields (check_known), as in app.py: honoured; accepted and ignored (they change nothing the client gets);
# not implemented, refused unless their value asks for nothing
HONOURED = "model input instructions tools tool_choice max_output_tokens temperature top_p text store stream".split()
IGNORED = """
    previous_response_id parallel_tool_calls user metadata service_tier safety_identifier prompt_cache_key
    prompt_cache_retention prompt_cache_options
""".split()  # previous_response_id: honoured before the others (add_routes)
NOT_IMPLEMENTED = dict.fromkeys(
    """
    conversation prompt max_tool_calls background_options context_management stream_options access_programs image
    moderation
    """.split()
) | {"background": False, "reasoning": {}, "include": [], "truncation": "disabled", "top_logprobs": 0}
# What a response repeats of its request
ECHOED = """
    instructions max_output_tokens metadata parallel_tool_calls previous_response_id store temperature text tool_choice
    tools top_p
""".split()
# The fields a chat body takes as they are: chat's name -> the Responses API's
PASSED = {"model": "model", "max_tokens": "max_output_tokens", "temperature": "temperature", "top_p": "top_p"}
# chat's names for the fields that the Responses API names otherwise (errors name the Responses API's)
CHAT_NAMES = PASSED | {"messages": "input", "response_format": "text.format"}


def chat_body(body: dict, items: list, names: list[str]) -> dict:
    """The chat body that answers a Responses body whose conversation is items (an earlier response's, then the
    input's), named so in errors."""
    messages = chat_messages(items, names)
    instructions = field(body, "instructions", str, "")
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":  # chat's nests the name one level deeper
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    text = field(body, "text", dict, {})
    check_known(text, ["format"], [], {"verbosity": "medium"}, "text.")
    response_format = field(text, "format", dict, {"type": "text"})
    if response_format.get("type") == "json_schema":  # chat's nests its name, schema and strict one level deeper
        response_format = {"type": "json_schema", "json_schema": response_format}
    tools = function_tools(body.get("tools") or [], "function", "parameters")
    chat = {name: body.get(ours) for name, ours in PASSED.items()}
    return chat | {"messages": messages, "tools": tools, "tool_choice": choice, "response_format": response_format}


class ResponseEvents(Translated):
    """A response as the Responses API streams it: response.created and .in_progress; per output item (a message with
    one output_text part, or a function_call) .output_item.added (and .content_part.added), its deltas
    (.output_text.delta, .function_call_arguments.delta), its .done events and .output_item.done; last,
    response.completed (or .incomplete, cut at max_output_tokens; .failed, when the request fails) with the whole
    response and its usage. Every event has its sequence_number and a copy of what it shows, as it was then. A
    response that ends calls ended(it)."""

    def __init__(self, response: dict, ended: Callable[[dict], None]) -> None:
        self.whole = response
        self.ended = ended
        self.sequence_number = 0

    def event(self, kind: str, **fields: object) -> dict:
        event = {"type": f"response.{kind}", "sequence_number": self.sequence_number, **copy.deepcopy(fields)}
        self.sequence_number += 1
        return event

    def item_event(self, kind: str, **fields: object) -> dict:
        """An event about the newest output item, which it names."""
        output = self.whole["output"]
        return self.event(kind, item_id=output[-1]["id"], output_index=len(output) - 1, **fields)

    def start(self, chunk: dict | None = None) -> list[dict]:
        return [self.event("created", response=self.whole), self.event("in_progress", response=self.whole)]

    def begin(self, kind: str, call: dict) -> list[dict]:
        if kind == "text":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "content": [part]}
        else:
            item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call["id"], "arguments": ""}
            item["name"] = call["function"]["name"]
        item["status"] = "in_progress"
        self.whole["output"].append(item)
        events = [self.item_event("output_item.added", item=item)]
        if kind == "text":
            events.append(self.item_event("content_part.added", content_index=0, part=part))
        return events

    def delta(self, piece: str) -> list[dict]:
        if self.open == "text":
            return [self.item_event("output_text.delta", content_index=0, delta=piece, logprobs=[])]
        return [self.item_event("function_call_arguments.delta", delta=piece)]

    def finish(self) -> list[dict]:
        item = self.whole["output"][-1]
        item["status"] = "completed"
        if self.open == "text":
            part = item["content"][0]
            part["text"] = self.text
            text_done = self.item_event("output_text.done", content_index=0, text=self.text, logprobs=[])
            events = [text_done, self.item_event("content_part.done", content_index=0, part=part)]
        else:
            item["arguments"] = self.text
            events = [self.item_event("function_call_arguments.done", name=item["name"], arguments=self.text)]
        return [*events, self.item_event("output_item.done", item=item)]

    def end(self, finish_reason: str, usage: dict) -> list[dict]:
        self.whole["status"] = "completed"
        if finish_reason == "length":
            self.whole["status"] = "incomplete"
            self.whole["incomplete_details"] = {"reason": "max_output_tokens"}
        self.whole["usage"] = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": usage["prompt_tokens_details"],
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        }
        self.ended(self.whole)
        return [self.event(self.whole["status"], response=self.whole)]

    def failed(self, error: Exception) -> list[dict]:
        """response.failed, its error's code saying whose fault it was (invalid_prompt: the request's own); a response
        that failed before its first token opens first, as every Responses stream does."""
        code = "server_error"
        if status_of(error) < 500:
            code = "invalid_prompt"
        events = []
        if not self.started:
            events = self.start()
        self.whole["status"] = "failed"
        self.whole["error"] = {"code": code, "message": str(error)}
        return [*events, self.event("failed", response=self.whole)]


def add_routes(router: APIRouter, answer: Callable, config: ServerConfig, model_name: str) -> None:
    """POST /v1/responses and GET /v1/responses/{response_id} on router, answered by answer (app.py's); model_name:
    the model a request that names none gets."""
    stored = OrderedDict()  # response id -> (the response, its conversation's items), the most recently used last

    def kept(response_id: str, name: str) -> tuple[dict, list]:
        """A stored response and its conversation; an id not kept is a NotFound naming the field `name`."""
        if response_id not in stored:
            raise NotFound(name, f"no response {shown(response_id)} is stored here (a server keeps its last few)")
        stored.move_to_end(response_id)
        return stored[response_id]

    @router.post("/v1/responses", response_model=None)
    async def create(http: Request) -> Response | dict:
        """A response, whole or (stream) as its events; stored, if asked, once it has ended."""
        body = await read_object(http, config)
        check_known(body, HONOURED, IGNORED, NOT_IMPLEMENTED)
        store = field(body, "store", bool, True)
        history = []
        previous = field(body, "previous_response_id", str, None)
        if previous is not None:
            history = kept(previous, "previous_response_id")[1]
        items = body.get("input")
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        if not isinstance(items, list):
            raise InvalidField("input", "expected a string or a list of items")
        names = ["previous_response_id"] * len(history) + [f"input[{i}]" for i in range(len(items))]
        chat = chat_body(body, [*history, *items], names)

        def ended(response: dict) -> None:
            if store:
                stored[response["id"]] = (response, [*history, *items, *response["output"]])
            if len(stored) > config.max_stored_responses:
                stored.popitem(last=False)

        response = {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time())}
        response |= {name: body.get(name) for name in ECHOED}
        response["model"] = body.get("model") or model_name
        response |= {"status": "in_progress", "output": [], "error": None, "incomplete_details": None, "usage": None}
        stream = field(body, "stream", bool, False)
        return await ResponseEvents(response, ended).reply(http, answer, chat, CHAT_NAMES, stream)

    @router.get("/v1/responses/{response_id}", response_model=None)
    def retrieve(response_id: str) -> dict:
        return kept(response_id, "response_id")[0]
