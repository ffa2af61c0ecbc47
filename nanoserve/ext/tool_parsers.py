"""An extension: tool calls parsed out of a model's text, for chat's tool_choice "auto": the OpenAI server's
--enable-auto-tool-choice --tool-call-parser NAME, as vLLM's server takes them (ext/server loads this when the flag is
given; without it, the server serves on, and only the flag is refused). One format so far, hermes (Hermes 2 Pro's, and
Qwen 2.5's and Qwen 3's chat templates): the model writes each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and the server returns it as an OpenAI tool call ({"id", "type": "function", "function": {"name", "arguments"}}, the
arguments as a JSON string). The text outside the blocks is the message's content; whitespace right after a call is not
(the model separates calls with newlines). A block whose text is not such a call stays in the content as the model
wrote it, so nothing the model wrote is lost.

One idea: a parser is fed a choice's text piece by piece, a stream's deltas or the whole text at once, and hands out
content as soon as it cannot be the start of a block, and each call as OpenAI's stream deltas, as vLLM streams them: a
first delta with the call's index, id, type and name as soon as the name is written, then the arguments in pieces as the
model writes them (the raw text of the "arguments" value, cut where that JSON value ends). A stream's pieces join to
exactly what the whole answer holds: `calls` keeps each call joined. Whether a block is a call is decided by its start,
so a stream never takes back what it sent: a block that opens with {"name": "..." is a call (its arguments those
written, as the model wrote them: a block cut by max_tokens keeps what it had); any other block is read when it closes
(or at the end, if never closed): a call if its JSON is one, else content."""

import json
import re
import uuid

from nanoserve.checks import InvalidField, shown
from nanoserve.stopping import longest_stop_prefix_at_end

START = "<tool_call>"
END = "</tool_call>"
NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')  # a block that opens with its name, a whole string
ARGUMENTS_NEXT = re.compile(r'\s*,\s*"arguments"\s*:\s*(?=\S)')  # ... followed by the arguments, begun


def json_value_end(text: str) -> int | None:
    """Where the JSON object or array that text starts with ends (just after its closing bracket); None while it is
    still open. Brackets inside strings do not count."""
    depth, in_string, escaped = 0, False, False
    for i, char in enumerate(text):
        if in_string:  # a backslash escapes the next character, a quote among them
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class HermesToolParser:
    """One choice's tool calls and content, as its text comes."""

    def __init__(self) -> None:
        self.pending = ""  # text not handed out yet: an open block, or a tail that may be the start of one
        self.in_block = False  # pending is inside a <tool_call> block
        self.after_call = False  # a call has just closed: whitespace here is a separator, not content
        self.calls: list[dict] = []  # every call so far, joined from its deltas (a whole answer's tool_calls)
        self.streaming: dict | None = None  # the open block's call, once its name is known: where its arguments are

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """The content and the call deltas that `text`, the output's next piece, brings. final: the output has ended,
        so nothing is held back."""
        self.pending += text
        content = ""
        deltas = []
        while True:
            if not self.in_block:
                start = self.pending.find(START)
                if start < 0:  # no block starts: all content, less a tail that may still become "<tool_call>"
                    held = 0 if final else longest_stop_prefix_at_end(self.pending, [START])
                    content += self._content(self.pending[: len(self.pending) - held])
                    self.pending = self.pending[len(self.pending) - held :]
                    return content, deltas
                content += self._content(self.pending[:start])
                self.pending = self.pending[start + len(START) :]
                self.in_block = True
            end = self.pending.find(END)
            block = self.pending if end < 0 else self.pending[:end]
            closed = end >= 0 or final
            deltas += self._stream(block, closed)
            if not closed:  # the block is still open: wait for the rest of it
                return content, deltas
            self.pending = "" if end < 0 else self.pending[end + len(END) :]
            self.in_block = False
            if self.streaming is None:  # not a call by its start: by its whole JSON, else content as written
                call = self._whole_call(block)
                if call is None:
                    content += self._content(START + block + ("" if end < 0 else END))
                    continue
                deltas.append(self._begin(call["name"]))
                deltas += self._arguments(json.dumps(call.get("arguments", {}), ensure_ascii=False))
            self.streaming = None
            self.after_call = True

    def _content(self, text: str) -> str:
        """text as content: right after a call, without its leading whitespace."""
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        return text

    @property
    def num_calls(self) -> int:
        """Calls begun so far: the newest one's index in a stream is num_calls - 1."""
        return len(self.calls)

    def _stream(self, block: str, closed: bool) -> list[dict]:
        """The deltas of a block that opens with its name, so far: the call's first delta once the name is whole, then
        the arguments written since the last look. closed: the block is complete; what is left of the arguments goes
        (none written: {}, or the "arguments" of the block's JSON where its keys come in another order)."""
        deltas = []
        if self.streaming is None:
            match = NAME_FIRST.match(block)
            if match is None:
                return []
            deltas.append(self._begin(json.loads(match.group(1))))
            self.streaming = {"name_end": match.end(), "arguments_at": None}
        call = self.streaming
        if call["arguments_at"] is None and (match := ARGUMENTS_NEXT.match(block, call["name_end"])):
            call["arguments_at"] = match.end()
        if call["arguments_at"] is None:
            if closed:
                whole = self._whole_call(block) or {}
                deltas += self._arguments(json.dumps(whole.get("arguments", {}), ensure_ascii=False))
            return deltas
        raw = block[call["arguments_at"] :]
        if raw[:1] in ("{", "["):  # an object or array: sent as it comes, up to where it ends
            written = raw[: json_value_end(raw) or len(raw)]
        else:  # a scalar (rare): sent whole at the end, without the call's closing brace
            written = raw.rstrip().removesuffix("}").rstrip() if closed else ""
        return deltas + self._arguments(written[len(self.calls[-1]["function"]["arguments"]) :])

    def _begin(self, name: str) -> dict:
        """A new call's first delta (index, id, type, name; no arguments yet), and its entry in self.calls."""
        call = {"id": f"call_{uuid.uuid4().hex}", "type": "function", "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        return {"index": self.num_calls - 1, **call, "function": dict(call["function"])}

    def _arguments(self, piece: str) -> list[dict]:
        """A delta that carries the newest call's next piece of arguments (none for nothing new)."""
        if not piece:
            return []
        self.calls[-1]["function"]["arguments"] += piece
        return [{"index": self.num_calls - 1, "function": {"arguments": piece}}]

    @staticmethod
    def _whole_call(block: str) -> dict | None:
        """A block's JSON, if it is an object with a string "name" (and "arguments", any JSON value); else None."""
        try:
            call = json.loads(block)
        except ValueError:
            return None
        return call if isinstance(call, dict) and isinstance(call.get("name"), str) else None


TOOL_PARSERS = {"hermes": HermesToolParser}  # --tool-call-parser's choices: a name -> its parser, one per choice


def parser_for(name: str) -> type[HermesToolParser]:
    """The parser --tool-call-parser names; any other name is an InvalidField."""
    if name not in TOOL_PARSERS:
        raise InvalidField("tool_call_parser", f"{shown(name)} is not one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]
