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
from dataclasses import replace
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
)
from nanoserve.config import EngineConfig
from nanoserve.outputs import Request, RequestOutput
from nanoserve.sampling_params import SamplingParams
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
HELD_WAIT_S = 0.001  # how long a step with nothing to run sleeps while admission rules hold every waiting sequence


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
        self.failed_outputs: list[RequestOutput] = []  # of requests that failed in this step, for step() to hand out
        # extension name -> its logits processor, made by its attach() when the first request that uses it comes
        self.logits_processors: dict[str, LogitsProcessor] = {}
        self.trace = None  # a step trace's writer (trace=PATH: ext/plots.py), told when each step begins and ends
        self.proposer = None  # speculative decoding's (ext/speculative.py): draft tokens before each step is planned
        self._request_ids = count()
        # running totals, for stats(): steps run, tokens computed (prefill and decode) and tokens generated
        self.num_steps = 0
        self.computed_tokens = 0
        self.generated_tokens = 0
        # the extensions its options use (trace, lora, ...), each started with the engine: name -> what its start()
        # returned, the extension's state for this engine (ext/lora: the adapters; ext/cascade.py: the cascade)
        self.extensions: dict[str, object] = {}
        for name in config.extensions:
            self.extensions[name] = ext.load(name, name).start(self)
        runner.capture_graphs()  # over the modules the extensions wired in

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

    def get_tokenizer(self) -> "PreTrainedTokenizerBase | None":
        """vLLM's accessor: the engine's tokenizer (None for a weights-only model)."""
        return self.tokenizer

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do with one rank) and close the trace."""
        self._close()
        if self.trace is not None:
            self.trace.close()

    def _make_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        stream: bool,
    ) -> Request:
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidField("sampling_params", f"expected SamplingParams, got {type(params).__name__}")
        check_token_ids("stop_token_ids", params.stop_token_ids, self.vocab_size)  # now against the vocabulary
        if params.logprobs is not None:  # at most the whole vocabulary
            check_number("logprobs", params.logprobs, 0, self.vocab_size, integer=True)
        check_flag("stream", stream)
        if request_id is None:
            request_id = f"req-{next(self._request_ids)}"
        if not isinstance(request_id, str) or request_id in self.requests:
            raise InvalidField("request_id", f"{request_id!r} is not a new string id")
        if isinstance(prompt, dict):  # vLLM's {"prompt": text} or {"prompt_token_ids": ids}, by vLLM's names
            prompt = ext.load("vllm_names", "prompt").unwrap_prompt(prompt)
        ids = self.prompt_ids(prompt, params.truncate_prompt_tokens)
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        if params.seed is None and self.config.seed is not None:  # the engine's seed, for a request that sets none
            params = replace(params, seed=self.config.seed)
        seqs = [Sequence(ids, params, self.config.kvcache_block_size, stop_ids)]
        self.scheduler.check_fits(seqs[0])
        # the extensions its fields use: each checks it and attaches it (n > 1: ext/parallel_sampling.py adds the other
        # samples' sequences to the list)
        for name in params.extensions:
            ext.load(name, name).attach(self, seqs)
        text = None  # the prompt's text, where it came as text
        if isinstance(prompt, str):
            text = prompt
        return Request(request_id, text, seqs, stream)

    def _queue(self, request: Request) -> str:
        self.requests[request.request_id] = request
        for seq in request.seqs:
            seq.request = request
            self.scheduler.add(seq)
        return request.request_id

    def prompt_ids(self, prompt: Prompt, keep: int | None = None) -> list[int]:
        """The prompt as checked token ids (text through the tokenizer), only its last `keep` where given
        (truncate_prompt_tokens: vLLM cuts from the left, before the prompt's length is checked). It reads only the
        tokenizer and the config, so the server calls it on other threads, off the engine's."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidField("prompt", "this model has no tokenizer; pass token ids")
            check_text("prompt", prompt)
            prompt = self.tokenizer.encode(prompt)
        ids = check_token_ids("prompt", prompt, self.vocab_size)
        if keep:  # at least 1 (SamplingParams checks it)
            ids = ids[-keep:]
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
        # no overlap while a processor or the proposer needs each step's tokens before the next (a grammar's mask, a
        # proposal of draft tokens)
        helpers = [*self.logits_processors.values(), self.proposer]
        needs_tokens = any(helper.needs_tokens_on_host() for helper in helpers if helper is not None)
        outputs = self.run_step(self.config.overlap and not needs_tokens, self._read_back)
        failed = self.failed_outputs  # the requests that failed in this step (_fail), first
        self.failed_outputs = []
        return failed + outputs

    def run_step(self, overlap: bool, read_back: Callable[["InFlightStep"], list]) -> list:
        """One step, overlapped or plain, each step finished by read_back; returns what read_back returns. The step
        driver: step() finishes the requests' steps with _read_back (their outputs); a driver of its own, such as beam
        search (ext/beam_search.py), runs its steps here without overlap, finishing them with receive_tokens (the
        sequences that got tokens, to resolve: its beams belong to no request)."""
        started = time.perf_counter()
        try:
            if overlap:
                finished = self._overlapped_step(read_back)
            else:
                finished = self._plain_step(read_back)
        except BaseException:  # a failed or interrupted step: blocks it planned were findable before their K/V existed
            self._forget_failed_step()
            raise
        if self.trace is not None:
            self.trace.end(started)
        return finished

    def _plain_step(self, read_back: Callable[["InFlightStep"], list]) -> list:
        """The plain loop: 1) schedule a step, 2) launch it, 3) wait for it and finish it. A step the overlapped loop
        left in flight is finished first."""
        finished = []
        if self.in_flight is not None:
            finished = read_back(self.in_flight)
            self.in_flight = None
        launched = self._schedule_and_launch()
        if launched is not None:
            finished += read_back(launched)
        return finished

    def _overlapped_step(self, read_back: Callable[["InFlightStep"], list]) -> list:
        """The overlapped loop: 1) schedule step n+1 and 2) launch it behind step n, then 3) finish step n while step
        n+1 runs on the GPU."""
        launched = self._schedule_and_launch()
        previous = self.in_flight
        self.in_flight = launched
        if previous is None:
            return []
        return read_back(previous)

    def _schedule_and_launch(self) -> "InFlightStep | None":
        """Phases 1 and 2: plan the next step (the scheduler books it: lengths are known even where values are
        pending), then queue it on the device behind the step in flight, whose samples are its decode inputs there.
        None if there was nothing to run."""
        if self.proposer is not None:  # speculative decoding: draft tokens for the running sequences, to verify
            self.proposer.propose(self)
        step = self.scheduler.schedule()
        self._fail(step.failed)  # waiting ones an extension failed on
        self.num_steps += bool(step.scheduled)
        self.computed_tokens += step.num_tokens
        self._record_first_scheduled(step)
        launched = None
        if step.scheduled:
            processors = list(self.logits_processors.values())
            launched = self.runner.launch(step, self.in_flight, processors)
        elif self.in_flight is None and self.scheduler.running:
            raise RuntimeError("the scheduler found nothing to run")  # a bug, never a state
        elif self.in_flight is None and self.scheduler.waiting:
            time.sleep(HELD_WAIT_S)  # every waiting sequence held by an extension's admission rule
        if self.trace is not None:
            self.trace.begin(step)
        return launched

    def _fail(self, seqs: list[Sequence]) -> None:
        """End the requests of seqs, each of which an extension failed on (Sequence.error): every sequence of the
        request finishes with reason "error", all it held comes back, the prefix cache forgets its blocks (what the
        failed work left in them is not trusted), and the request's output, with the error, goes out with this step's.
        A sequence of no request (beam search's) cannot end alone: its error is raised."""
        for seq in seqs:
            request = seq.request
            if request is None:
                raise RuntimeError(seq.error)
            if self.requests.pop(request.request_id, None) is None:  # ended already
                continue
            request.error = seq.error
            for each in request.seqs:
                self.block_manager.forget(each.block_table)
                if not each.is_finished:
                    self.scheduler.finish_sequence(each, "error")
            request.metrics.finished_time = time.time()
            self.failed_outputs.append(request.take_output())

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
        the requests that finished. Returns the outputs of the requests that changed, each once, in the order they
        changed: every streaming one, and the others once they have finished. First, the requests an extension
        failed on while the step ran end (_fail)."""
        self._fail([s.seq for s in in_flight.step.scheduled if s.seq.error is not None])
        sampled = self.receive_tokens(in_flight)
        now = time.time()
        # the requests to look at, once each, in the order they changed: every streaming one, and those a sequence of
        # which stopped (only they may have finished); most steps of a batch job have few
        changed = {}
        for seq, tokens, logprobs in sampled:
            request = seq.request
            if request.stream:
                changed[request] = None
            # one token, or a speculative run's kept drafts and the token after them: each meets the stop rules in turn
            for token, token_logprobs in zip(tokens, logprobs, strict=True):
                self.scheduler.resolve(seq, token, token_logprobs)
                self.generated_tokens += 1
                reason = self.stop_checker.check(seq, incremental=request.stream)
                if reason is not None:
                    self.scheduler.finish_sequence(seq, reason)  # (it drops the tokens after this one)
                    changed[request] = None
                    break
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
        outputs = []
        for request in changed:
            finished = request.finished  # (n > 1: all its samples)
            if finished:
                request.metrics.finished_time = now
                del self.requests[request.request_id]
            if request.stream or finished:
                outputs.append(request.take_output())
        return outputs

    def receive_tokens(self, in_flight: "InFlightStep") -> list[tuple[Sequence, list, list]]:
        """Wait for a launched step's samples and book its tokens (Scheduler.update): (sequence, its new tokens, their
        logprobs) per sequence that got some, for the caller to resolve one by one (the stop rules between them, in
        _read_back; none, in a driver of its own)."""
        tokens, logprobs = in_flight.wait()
        return self.scheduler.update(in_flight.step, tokens, logprobs)

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
        params = sampling_params
        if not isinstance(params, list):  # one for all
            params = [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidField("sampling_params", f"{len(params)} given for {len(prompts)} prompts")
        check_flag("use_tqdm", use_tqdm)
        requests = []
        for prompt, prompt_params in zip(prompts, params, strict=True):
            requests.append(self._make_request(prompt, prompt_params, None, stream=False))
        if lora_request is not None:  # each request's adapter, checked and loaded before any is queued
            ext.load("lora", "lora_request").attach_adapters(self, requests, lora_request)
        # 2) queue them all and step until each has finished
        finished: dict[str, RequestOutput] = {}
        generated_before = self.generated_tokens  # the bar counts this batch's tokens: bar.n of them so far
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
                bar.update(self.generated_tokens - generated_before - bar.n)
        finally:
            bar.total = bar.n  # outputs that ended early (EOS) never reach max_tokens
            bar.close()
            for request in requests:  # an interruption leaves nothing behind; a no-op otherwise
                self.abort(request.request_id)
        return [finished[r.request_id] for r in requests]

    def beam_search(self, prompts: list[Prompt], params: object, lora_request: object = None) -> list:
        """vLLM's beam search: per prompt (a list of them, as vLLM takes, each a prompt as generate takes one),
        params.beam_width beams, best first, on forked sequences that share KV blocks (the extension
        ext/beam_search.py, with transformers' rule; a BeamSearchOutput per prompt); lora_request: vLLM's, one LoRA
        adapter for every prompt's beams (ext/lora). Needs an idle engine."""
        return ext.load("beam_search", "beam_search").beam_search(self, prompts, params, lora_request)

    def chat(
        self,
        messages: Conversation | list[Conversation],
        *args: object,
        **kwargs: object,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them, through the chat template (the
        extension ext/chat.py, which checks every message first and renders them as token ids); then generate's other
        arguments (sampling_params, use_tqdm, lora_request)."""
        prompts = ext.load("chat", "messages").chat_prompts(self, messages)
        return self.generate(prompts, *args, **kwargs)

    def stats(self) -> dict[str, int | float]:
        """The pool, the prefix cache, the queues and the running totals (an application that wants latencies reads
        each output's metrics: the server's /metrics does)."""
        bm = self.block_manager
        stats = {
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
            "steps": self.num_steps,
            "computed_tokens": self.computed_tokens,
            "generated_tokens": self.generated_tokens,
        }
        if self.proposer is not None:  # speculative decoding's drafts
            stats |= self.proposer.stats()
        return stats


def is_one_prompt(prompts: object) -> bool:
    """A single prompt rather than a list of them: a string, a vLLM prompt dict, a list of token ids, or an array."""
    if isinstance(prompts, (str, dict)) or hasattr(prompts, "ndim"):
        return True
    return isinstance(prompts, LISTS) and len(prompts) > 0 and is_integer(prompts[0])
