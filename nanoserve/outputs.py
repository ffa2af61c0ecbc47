"""What a request returns, in vLLM's shapes (RequestOutput holding one CompletionOutput per sample), and the
Request record the engine keeps while it runs: its sequences, its timings, and whether it streams."""

import time
from copy import copy
from dataclasses import dataclass, field

from nanoserve.sequence import Logprobs, Sequence
from nanoserve.stopping import take_stream_delta


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str  # the text so far (final: special tokens and a matched stop string removed)
    token_ids: list[int]  # generated tokens, EOS or stop id included when that ended it
    # "stop" (EOS, stop id, stop string), "length", "abort", "error" (RequestOutput.error says why); None while running
    finish_reason: str | None
    logprobs: list[Logprobs] | None  # per token: {token_id: logprob}, the top-N and the chosen
    cumulative_logprob: float | None
    text_delta: str  # the text added since this request's previous output (all of it, the first time)
    token_ids_delta: list[int]


@dataclass
class RequestMetrics:
    """vLLM's request timings: time.time() readings (wall clock, seconds since the epoch), and the wait in between."""

    arrival_time: float = field(default_factory=time.time)  # when the request was made
    first_scheduled_time: float | None = None  # the first step that computed any of it
    time_in_queue: float | None = None  # first_scheduled_time - arrival_time
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int  # prompt tokens served by the prefix cache (of the first sample)
    metrics: RequestMetrics
    # per prompt token, when asked for (prompt_logprobs=N): None for the first, then {token_id: logprob} of the
    # token and the top N at its position, as vLLM; one list for all n samples (they share the prompt)
    prompt_logprobs: list[Logprobs | None] | None
    error: str | None = None  # why it failed inside the engine (its finish_reason: "error"), or None


@dataclass(eq=False)  # a request is itself, never equal to another one
class Request:
    request_id: str
    prompt: str | None
    seqs: list[Sequence]  # one per sample (n)
    stream: bool
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: str | None = None  # set when it fails inside the engine (LLM._fail)

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def take_output(self) -> RequestOutput:
        """The request as it stands. Streaming, each completion also carries what changed since the previous call,
        and this call advances the stream cursors: calling it twice hands out each delta once."""
        outputs = [take_completion(index, seq) for index, seq in enumerate(self.seqs)]
        first = self.seqs[0]
        return RequestOutput(
            self.request_id,
            self.prompt,
            first.token_ids[: first.num_prompt_tokens],
            outputs,
            self.finished,
            first.num_cached_tokens or 0,
            self.metrics,
            copy(first.prompt_logprobs),  # a snapshot: later steps fill in more (None if not asked for)
            self.error,
        )


def take_completion(index: int, seq: Sequence) -> CompletionOutput:
    """Sample `index` of a request as it stands, with what changed since the previous call (this advances seq's
    stream cursors)."""
    decoded = seq.text
    token_ids = seq.completion_token_ids
    text_delta = take_stream_delta(seq)  # advances decoded.num_streamed (without streaming: all of it, at the end)
    token_ids_delta = token_ids[decoded.num_tokens_streamed :]
    decoded.num_tokens_streamed = len(token_ids)
    logprobs = None  # (only for a request that asked for them)
    cumulative_logprob = None
    if seq.params.logprobs is not None:
        logprobs = list(seq.logprobs)
        cumulative_logprob = seq.cumulative_logprob
    return CompletionOutput(  # in the fields' order
        index,
        decoded.text[: decoded.num_streamed],  # the text: once finished, all of decoded.final, streamed by now
        token_ids,
        seq.finish_reason,
        logprobs,
        cumulative_logprob,
        text_delta,
        token_ids_delta,
    )
