"""What a request returns, in vLLM's shapes (RequestOutput holding one CompletionOutput per sample), and the
Request record the engine keeps while it runs: its sequences, its timings, and whether it streams."""

import time
from dataclasses import dataclass, field

from nanoserve.sequence import Sequence
from nanoserve.stopping import take_stream_delta


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str  # the text so far (final: special tokens and a matched stop string removed)
    token_ids: list[int]  # generated tokens, EOS or stop id included when that ended it
    finish_reason: str | None  # "stop" (EOS, stop id, stop string), "length", "abort"; None while running
    logprobs: list[dict[int, float]] | None  # per token: {token_id: logprob}, the top-N and the chosen
    cumulative_logprob: float | None
    text_delta: str = ""  # streaming: the text added since this request's previous output
    token_ids_delta: list[int] = field(default_factory=list)


@dataclass
class RequestMetrics:
    arrival_time: float
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


class Request:
    def __init__(self, request_id: str, prompt: str | None, seqs: list[Sequence], stream: bool):
        self.request_id, self.prompt, self.seqs, self.stream = request_id, prompt, seqs, stream
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())

    finished = property(lambda self: all(seq.is_finished for seq in self.seqs))

    def output(self) -> RequestOutput:
        """The request as it stands; streaming, each completion also carries what changed since the last call."""
        outputs = []
        for i, seq in enumerate(self.seqs):
            t, token_ids, wants_logprobs = seq.text, seq.completion_token_ids, seq.params.logprobs is not None
            delta = take_stream_delta(seq) if self.stream else ""
            new_tokens, t.num_tokens_streamed = token_ids[t.num_tokens_streamed :], len(token_ids)
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=seq.text.final if seq.is_finished else t.text[: t.num_streamed],
                    token_ids=token_ids,
                    finish_reason=seq.finish_reason,
                    logprobs=list(seq.logprobs) if wants_logprobs else None,
                    cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
                    text_delta=delta,
                    token_ids_delta=new_tokens,
                )
            )
        first = self.seqs[0]
        return RequestOutput(
            self.request_id,
            self.prompt,
            first.token_ids[: first.num_prompt_tokens],
            outputs,
            self.finished,
            first.num_cached_tokens or 0,
            self.metrics,
        )
