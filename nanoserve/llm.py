"""The user-facing engine, vLLM-style. Offline: LLM(...).generate(prompts, sampling_params) and chat(...). Online:
add_request / step / abort, which generate() is a short loop over and which the server drives.

One step() has three numbered phases:
  1) schedule step n+1: the scheduler plans and books it (lengths are known even where values are pending);
  2) launch it: the model runner queues it on the GPU, its decode inputs read from step n's samples there;
  3) finish step n: read its tokens back, apply the stop rules (stopping.py), free what finished.
So the host's work on one step overlaps the GPU's work on the previous one. With overlap=False each step is finished
right after it is launched: the plain synchronous loop, with the same outputs.

Extensions (nanoserve/ext/, found through its registry) meet the engine at four places: one whose engine option is set
starts with the engine (start); a request whose fields belong to an extension is attached to it once, when it is added
(attach; generate's lora_request likewise, to ext/lora.py); the logits processors extensions make live here
(logits_processors) and go to every step's launch; and run_step / receive_tokens are the step driver that a loop of
its own (beam search) runs steps with."""

import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from itertools import count
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from nanoserve import ext
from nanoserve.block_manager import BlockManager
from nanoserve.checks import (
    LISTS,
    InvalidField,
    check_flag,
    check_number,
    check_text,
    check_token_ids,
    is_integer,
    shown,
)
from nanoserve.config import EngineConfig
from nanoserve.outputs import Request, RequestOutput
from nanoserve.sampling_params import BeamSearchParams, SamplingParams
from nanoserve.scheduler import Scheduler, Step
from nanoserve.sequence import Sequence
from nanoserve.stopping import StopChecker

if TYPE_CHECKING:  # annotations only: the engine loop runs on any runner with launch() (tests use a fake)
    from transformers import PreTrainedTokenizerBase

    from nanoserve.model_runner import InFlightStep, ModelRunner
    from nanoserve.sampler import LogitsProcessor

# A prompt: text, token ids (a list, or a numpy array or tensor of them), or vLLM's {"prompt": text} or
# {"prompt_token_ids": ids}
Prompt = str | list[int] | dict
Conversation = list[dict]  # chat messages: {"role": ..., "content": ...}
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")  # the roles chat templates know


@dataclass
class EngineCounters:
    """Running totals for stats(): tokens computed (prefill and decode) and generated, requests finished, and the
    sums of their time to first token and mean inter-token latency."""

    computed_tokens: int = 0
    generated_tokens: int = 0
    finished_requests: int = 0
    ttft_s_sum: float = 0.0
    itl_s_sum: float = 0.0


class LLM:
    def __init__(self, model: str | None = None, **kwargs: object) -> None:
        from nanoserve import loader
        from nanoserve.model_runner import ModelRunner

        config = EngineConfig.from_kwargs(model=model, **kwargs)
        model_dir = loader.resolve_model_dir(model)
        hf_config, args = loader.load_hf_config(model_dir, config)
        loader.check_checkpoint(model_dir, args)  # here, once: tensor-parallel workers read the same folder
        loader.check_kv_cache_fits(config, args, config.torch_dtype(hf_config))
        tokenizer = loader.load_tokenizer(config.tokenizer or model_dir)
        if tokenizer is None and config.tokenizer is not None:
            raise InvalidField("tokenizer", f"no tokenizer files in {config.tokenizer!r}")
        eos_token_ids = loader.eos_ids_of(model_dir, hf_config, tokenizer)
        if config.tensor_parallel_size > 1:  # rank 0's runner, and the other ranks' processes (ext/tp)
            runner = ext.load("tp", "tensor_parallel_size").start_runner(config, model_dir, hf_config, args)
        else:
            runner = ModelRunner(config, model_dir, hf_config, args)
        self._close = weakref.finalize(self, runner.close)  # closed or garbage-collected: the workers exit
        self._start(config, runner, tokenizer, eos_token_ids, args.vocab_size)

    def _start(  # the engine around a runner; tests start it around a fake runner (tests/conftest.py's FakeEngine)
        self,
        config: EngineConfig,
        runner: "ModelRunner",
        tokenizer: "PreTrainedTokenizerBase | None",
        eos_token_ids: frozenset[int],
        vocab_size: int,
    ) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.block_manager = BlockManager(
            runner.num_kvcache_blocks, config.kvcache_block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len
        )
        self.stop_checker = StopChecker(tokenizer, config.max_model_len)
        self.requests: dict[str, Request] = {}
        self.in_flight: InFlightStep | None = None  # with overlap: the launched step not yet read back
        # extension name -> its logits processor, made by its attach() when the first request that uses it comes
        self.logits_processors: dict[str, LogitsProcessor] = {}
        self.trace = None  # a step trace's writer (trace=PATH: ext/plots.py), told when each step begins and ends
        self._request_ids = count()
        self.counters = EngineCounters()
        for name in config.extensions:  # the extensions its options use (trace, ...): each starts with the engine
            ext.load(name, name).start(self)

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        stream: bool = True,
    ) -> str:
        """Queue one request (its n samples) after checking everything about it. With stream, step() returns its
        output every time it changes, with the new text in text_delta; without, only when it has finished."""
        return self._queue(self._make_request(prompt, sampling_params, request_id, stream))

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is (queued, prefilling, decoding, preempted): its blocks return at once.
        A request that has already finished (or an unknown id) is left as it is. It returns no output, so its text
        is not decoded further."""
        request = self.requests.pop(request_id, None)  # the engine forgets it
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish_sequence(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do with one rank) and close the trace."""
        self._close()
        if self.trace is not None:
            self.trace.close()

    def _make_request(
        self, prompt: Prompt, params: SamplingParams | None, request_id: str | None, stream: bool
    ) -> Request:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidField("sampling_params", f"expected SamplingParams, got {type(params).__name__}")
        check_token_ids("stop_token_ids", params.stop_token_ids, self.vocab_size)  # now against the vocabulary
        for field in ("logprobs", "prompt_logprobs"):  # at most the whole vocabulary (None: not asked for)
            check_number(field, getattr(params, field) or 0, 0, self.vocab_size, integer=True)
        if params.n > self.config.max_num_seqs:  # each sample is a sequence; a step runs at most max_num_seqs
            raise InvalidField("n", f"{params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        check_flag("stream", stream)
        if request_id is None:
            request_id = f"req-{next(self._request_ids)}"
        if not isinstance(request_id, str) or request_id in self.requests:
            raise InvalidField("request_id", f"{request_id!r} is not a new string id")
        prompt = unwrap_prompt(prompt)
        ids = self.prompt_ids(prompt)
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        seqs = [
            Sequence(ids, sample_params(params, i, self.config.seed), self.config.kvcache_block_size, stop_ids)
            for i in range(params.n)
        ]
        self.scheduler.check_fits(seqs[0])
        for name in params.extensions:  # the extensions its fields use: each checks it and attaches it
            ext.load(name, name).attach(self, seqs)
        return Request(request_id, prompt if isinstance(prompt, str) else None, seqs, stream)

    def _queue(self, request: Request) -> str:
        self.requests[request.request_id] = request
        for seq in request.seqs:
            seq.request = request
            self.scheduler.add(seq)
        return request.request_id

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The prompt as checked token ids (text through the tokenizer). It reads only the tokenizer and the config,
        so the server calls it on other threads, off the engine's."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidField("prompt", "this model has no tokenizer; pass token ids")
            check_text("prompt", prompt)
            prompt = self.tokenizer.encode(prompt)
        ids = check_token_ids("prompt", prompt, self.vocab_size)
        if not ids:
            raise InvalidField("prompt", "is empty")
        if len(ids) >= self.config.max_model_len:
            raise InvalidField(
                "prompt", f"has {len(ids)} tokens; max_model_len={self.config.max_model_len} leaves no room to generate"
            )
        return ids

    # ---- one step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs that changed (streaming requests) or finished."""
        # a processor that needs each step's tokens before the next (a grammar's mask): no overlap while it does
        overlap = self.config.overlap and not any(p.needs_tokens_on_host() for p in self.logits_processors.values())
        return self.run_step(overlap, self._read_back)

    def run_step(self, overlap: bool, read_back: Callable[["InFlightStep"], list]) -> list:
        """One step's phases, each step finished by read_back; returns what read_back returns. The step driver: step()
        finishes the requests' steps with _read_back (their outputs); a driver of its own, such as beam search
        (ext/beam_search.py), runs its steps here without overlap, finishing them with receive_tokens (the sequences
        that got a token: its beams belong to no request)."""
        started = time.perf_counter()
        try:
            finished = []
            if not overlap and self.in_flight is not None:  # 0) finish step n first: the plain loop from here
                finished = read_back(self.in_flight)
                self.in_flight = None
            # 1) schedule step n+1
            step = self.scheduler.schedule()
            self.counters.computed_tokens += step.num_tokens
            self._record_first_scheduled(step)
            # 2) launch it: the GPU queues it behind step n, whose samples it takes as inputs on the device
            launched = None
            if step.scheduled:
                processors = list(self.logits_processors.values())
                launched = self.runner.launch(step, self.in_flight, processors)
            if self.trace is not None:
                self.trace.begin(step)
            # 3) finish a step: read its tokens back, apply the stop rules
            if overlap:
                # overlapped: finish step n, launched by the previous call; step n+1 runs on the GPU meanwhile
                to_read_back = self.in_flight
                self.in_flight = launched
            else:
                # the plain loop: finish the step just launched
                to_read_back = launched
            if to_read_back is None and launched is None and self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler found nothing to run")  # a bug, never a state
            finished += read_back(to_read_back) if to_read_back is not None else []
        except BaseException:  # a failed or interrupted step: blocks it planned were findable before their K/V existed
            self._forget_failed_step()
            raise
        if self.trace is not None:
            self.trace.end(started)
        return finished

    def _record_first_scheduled(self, step: Step) -> None:
        """vLLM's first_scheduled_time and time_in_queue of the requests this step starts: a request starts when its
        first sequence is admitted (a readmission after preemption changes nothing), so only admissions are looked at,
        not every scheduled sequence of every decode step."""
        now = time.time()
        for seq in step.admitted:
            if seq.request is None:  # beam search's sequences belong to no request
                continue
            metrics = seq.request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
                metrics.time_in_queue = now - metrics.arrival_time

    def _forget_failed_step(self) -> None:
        """After a failed step: forget the prefix cache and abort every request a step touched; queued ones stay."""
        self.block_manager.cached.clear()
        self.in_flight = None
        for request in list(self.requests.values()):  # a copy: abort() forgets requests
            if not all(seq.is_queued for seq in request.seqs):
                self.abort(request.request_id)

    def _read_back(self, in_flight: "InFlightStep") -> list[RequestOutput]:
        """Finish a launched step: wait for its tokens, hand them to their sequences, apply the stop rules, and forget
        the requests that finished. Returns the outputs of the requests that changed, each once, in order: every
        streaming one, and the others once they have finished."""
        sampled = self.receive_tokens(in_flight)
        now = time.time()
        for seq in sampled:
            request = seq.request
            reason = self.stop_checker.check(seq, incremental=request.stream)
            if reason is not None:
                self.scheduler.finish_sequence(seq, reason)
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            self.counters.generated_tokens += 1
        outputs = []
        for request in dict.fromkeys(seq.request for seq in sampled):  # the requests that changed, each once, in order
            if request.finished:
                self._record_finished(request)
                del self.requests[request.request_id]
            if request.stream or request.finished:
                outputs.append(request.take_output())
        return outputs

    def receive_tokens(self, in_flight: "InFlightStep") -> list[Sequence]:
        """Wait for a launched step's tokens and hand them to their sequences (and the prompt logprobs it computed);
        returns the sequences that got a token."""
        tokens, logprobs, prompt_logprobs = in_flight.wait()
        for (seq, position), entry in prompt_logprobs:  # by position: a preempted sequence's recompute rewrites its own
            seq.prompt_logprobs[position] = entry
        return self.scheduler.update(in_flight.step, tokens, logprobs)

    def _record_finished(self, request: Request) -> None:
        """Its finish time, and its TTFT and mean inter-token latency into the running totals."""
        metrics = request.metrics
        metrics.finished_time = time.time()
        num_tokens = max(seq.num_completion_tokens for seq in request.seqs)
        self.counters.finished_requests += 1
        self.counters.ttft_s_sum += metrics.first_token_time - metrics.arrival_time
        self.counters.itl_s_sum += (metrics.finished_time - metrics.first_token_time) / max(num_tokens - 1, 1)

    # ---- offline batches --------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: object = None,
    ) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either; sampling_params: one for all, or one per
        prompt; lora_request: vLLM's, a LoRA adapter for all prompts or a list of one (or None) per prompt, which the
        extension ext/lora.py attaches. Every prompt is checked before any is queued; then the engine steps until all
        have finished, and the outputs come back in prompt order. The progress bar counts output tokens."""
        # 1) check everything: a bad prompt or parameter refuses the whole batch before any work
        if is_one_prompt(prompts):
            prompts = [prompts]
        if not isinstance(prompts, LISTS):
            raise InvalidField("prompts", "expected a string, token ids, or a list of them")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidField("sampling_params", f"{len(params)} given for {len(prompts)} prompts")
        check_flag("use_tqdm", use_tqdm)
        requests = [self._make_request(p, sp, None, stream=False) for p, sp in zip(prompts, params, strict=True)]
        if lora_request is not None:  # each request's adapter, checked and loaded before any is queued
            ext.load("lora", "lora_request").attach_adapters(self, requests, lora_request)
        # 2) queue them all and step until each has finished
        finished: dict[str, RequestOutput] = {}
        generated_before = self.counters.generated_tokens  # the bar counts this batch's tokens: bar.n of them so far
        bar = tqdm(
            total=sum(seq.params.max_tokens for request in requests for seq in request.seqs),
            unit="tok",
            desc="Generating",
            disable=not use_tqdm,
            dynamic_ncols=True,
        )
        try:
            for request in requests:
                self._queue(request)
            while len(finished) < len(requests):
                for out in self.step():
                    if out.finished:
                        finished[out.request_id] = out
                bar.update(self.counters.generated_tokens - generated_before - bar.n)
        finally:
            bar.total = bar.n  # outputs that ended early (EOS) never reach max_tokens
            bar.close()
            for request in requests:  # an interruption leaves nothing behind; a no-op otherwise
                self.abort(request.request_id)
        return [finished[r.request_id] for r in requests]

    def beam_search(self, prompts: list[Prompt], params: BeamSearchParams) -> list:
        """vLLM's beam search: per prompt (a list of them, as vLLM takes, each a prompt as generate takes one),
        params.beam_width beams, best first, on forked sequences that share KV blocks (the extension
        ext/beam_search.py, with transformers' rule; a BeamSearchOutput per prompt). Needs an idle engine."""
        return ext.load("beam_search", "beam_search").beam_search(self, prompts, params)

    def chat(
        self,
        messages: Conversation | list[Conversation],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: object = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them, through the chat template;
        lora_request as generate takes it."""
        return self.generate(self.chat_prompts(messages), sampling_params, use_tqdm, lora_request)

    def chat_prompts(
        self, messages: Conversation | list[Conversation], tools: list[dict] | None = None
    ) -> list[list[int]]:
        """Each conversation through the chat template, as token ids (the template adds the special tokens); tools:
        OpenAI's function definitions, which a template that supports tools renders."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise InvalidField("model", "this model has no chat template")
        # a list of conversations, or one (anything else is one too, which check_conversation then refuses)
        is_many = isinstance(messages, LISTS) and messages and isinstance(messages[0], LISTS)
        conversations = messages if is_many else [messages]
        for conversation in conversations:
            check_conversation(conversation)
        # all at once, as token ids (return_dict=False: a list of id lists, not a BatchEncoding)
        return self.tokenizer.apply_chat_template(
            conversations, add_generation_prompt=True, return_dict=False, tools=tools
        )

    def stats(self) -> dict[str, int | float]:
        bm = self.block_manager
        counters = self.counters
        num_finished = max(counters.finished_requests, 1)  # the means are 0 before any request finished
        return {
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "kv_blocks_peak": bm.peak_used_blocks,
            "kv_blocks_cached": bm.count_cached_free_blocks(),
            "prefix_hit_tokens": bm.prefix_hit_tokens,
            "prefix_queried_tokens": bm.prefix_queried_tokens,
            "prefix_hit_rate": bm.prefix_hit_tokens / max(bm.prefix_queried_tokens, 1),
            "preemptions": self.scheduler.num_preemptions,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            **asdict(counters),  # computed and generated tokens, finished requests, the sums behind the means
            "mean_ttft_s": counters.ttft_s_sum / num_finished,
            "mean_itl_s": counters.itl_s_sum / num_finished,
        }


def is_one_prompt(prompts: object) -> bool:
    """A single prompt rather than a list of them: a string, a vLLM prompt dict, a list of token ids, or an array."""
    if isinstance(prompts, (str, dict)) or hasattr(prompts, "ndim"):
        return True
    return isinstance(prompts, LISTS) and len(prompts) > 0 and is_integer(prompts[0])


def unwrap_prompt(prompt: object) -> object:
    """vLLM's prompt dicts as what they hold: {"prompt": text} as the text, {"prompt_token_ids": ids} as the ids.
    Other keys (vLLM's multi_modal_data, cache_salt, ...) are refused by name; anything else is returned as it is."""
    if not isinstance(prompt, dict):
        return prompt
    if len(prompt) == 1 and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    if len(prompt) == 1 and "prompt_token_ids" in prompt:
        return check_token_ids("prompt_token_ids", prompt["prompt_token_ids"])
    keys = ", ".join(map(shown, prompt))
    raise InvalidField("prompt", f"a prompt dict takes 'prompt' (text) or 'prompt_token_ids' (ids), one: not {keys}")


def check_conversation(conversation: object) -> None:
    """A non-empty list of {"role": one of CHAT_ROLES, "content": valid Unicode text} dicts; an optional "name" is a
    string too."""
    if not isinstance(conversation, LISTS) or not conversation:
        raise InvalidField("messages", "expected a non-empty list of {'role': str, 'content': str} dicts")
    for message in conversation:
        is_valid = (
            isinstance(message, dict)
            and message.get("role") in CHAT_ROLES
            and isinstance(message.get("content"), str)
            and isinstance(message.get("name", ""), str)
        )
        if not is_valid:
            wanted = f"{{'role': one of {', '.join(CHAT_ROLES)}; 'content': str; optional 'name': str}}"
            raise InvalidField("messages", f"{shown(message)} is not {wanted}")
        check_text("messages", message["content"])


def sample_params(params: SamplingParams, index: int, engine_seed: int | None) -> SamplingParams:
    """The parameters of sample `index` of a request. Its seed is the request's, or the engine's (LLM(seed=...)) for
    a request that sets none; with a seed, each later sample draws its own noise from a seed derived from it, so n
    seeded samples differ from each other yet stay reproducible. Only the first sample computes the prompt's
    logprobs (the others share its prompt, and take its KV from the prefix cache)."""
    seed = engine_seed if params.seed is None else params.seed
    if index == 0:
        return replace(params, seed=seed)
    return replace(params, seed=None if seed is None else hash((seed, index)), prompt_logprobs=None)
