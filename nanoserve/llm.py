"""The user-facing engine, vLLM-style. Offline: LLM(...).generate(prompts, sampling_params) and chat(...). Online:
add_request / step / abort, which generate() is a short loop over and which the server drives.

One step() has three numbered phases:
  1) schedule step n+1: the scheduler plans and books it (lengths are known even where values are pending);
  2) launch it: the model runner queues it on the GPU, its decode inputs read from step n's samples there;
  3) finish step n: read its tokens back, apply the stop rules (stopping.py), free what finished.
So the host's work on one step overlaps the GPU's work on the previous one. With overlap=False each step is finished
right after it is launched: the plain synchronous loop, with the same outputs."""

import numbers
import time
import weakref
from dataclasses import replace
from itertools import count

from tqdm.auto import tqdm

from nanoserve.block_manager import BlockManager
from nanoserve.config import EngineConfig
from nanoserve.outputs import Request, RequestOutput
from nanoserve.sampling_params import InvalidField, SamplingParams, check_token_ids
from nanoserve.scheduler import Scheduler
from nanoserve.sequence import Sequence
from nanoserve.stopping import StopChecker


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        from nanoserve import loader
        from nanoserve.model_runner import ModelRunner

        config = EngineConfig.from_kwargs(model=model, **kwargs)
        model_dir = loader.resolve_model_dir(model)
        hf_config, args = loader.load_hf_config(model_dir, config)
        tokenizer = loader.load_tokenizer(model_dir)
        runner = ModelRunner.start(config, model_dir, hf_config, args)  # and its tensor-parallel workers, if any
        self._close = weakref.finalize(self, runner.close)  # closed or garbage-collected: the workers exit
        self._start(config, runner, tokenizer, loader.eos_ids_of(model_dir, hf_config, tokenizer), args.vocab_size)

    @classmethod
    def from_runner(
        cls, config: EngineConfig, runner, vocab_size: int, tokenizer=None, eos_token_ids: frozenset[int] = frozenset()
    ) -> "LLM":
        """The engine around any runner with launch() and num_kvcache_blocks: how tests run the loop on a fake."""
        llm = cls.__new__(cls)
        llm._close = lambda: None
        llm._start(config, runner, tokenizer, eos_token_ids, vocab_size)
        return llm

    def _start(self, config: EngineConfig, runner, tokenizer, eos_token_ids: frozenset[int], vocab_size: int):
        self.config, self.runner, self.tokenizer = config, runner, tokenizer
        self.eos_token_ids, self.vocab_size = frozenset(eos_token_ids), vocab_size
        self.block_manager = BlockManager(
            runner.num_kvcache_blocks, config.kvcache_block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len
        )
        self.stop_checker = StopChecker(tokenizer, config.max_model_len)
        self.requests: dict[str, Request] = {}
        self.request_of: dict[int, Request] = {}  # seq_id -> its request
        self.in_flight = None  # the launched step not yet read back (overlap)
        self.trace = None
        if config.trace is not None:  # opt-in: the trace writer lives with its pictures, in the optional plots.py
            from nanoserve.plots import StepTrace

            self.trace = StepTrace(config.trace, self.scheduler)
        self._request_ids = count()
        self.counters = {
            "computed_tokens": 0,
            "generated_tokens": 0,
            "finished_requests": 0,
            "ttft_s": 0.0,
            "itl_s": 0.0,
        }

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(
        self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None, stream: bool = True
    ) -> str:
        """Queue one request (its n samples) after checking everything about it. With stream, step() returns its
        output every time it changes, with the new text in text_delta; without, only when it has finished."""
        return self._queue(self._make_request(prompt, sampling_params, request_id, stream))

    def abort(self, request_id: str):
        """Stop a request wherever it is (queued, prefilling, decoding, preempted): its blocks return at once."""
        request = self.requests.pop(request_id, None)
        for seq in request.seqs if request else []:
            if not seq.is_finished:
                self.stop_checker.flush(seq)
                self.scheduler.finish(seq, "abort")
            self.request_of.pop(seq.seq_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def close(self):
        """Stop the tensor-parallel workers (nothing to do with one rank) and close the trace."""
        self._close()
        if self.trace is not None:
            self.trace.close()

    def _make_request(self, prompt, params, request_id, stream) -> Request:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidField("sampling_params", f"expected SamplingParams, got {type(params).__name__}")
        if not all(0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise InvalidField("stop_token_ids", f"token ids must lie in [0, {self.vocab_size})")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise InvalidField("logprobs", f"{params.logprobs} exceeds the vocabulary ({self.vocab_size})")
        request_id = f"req-{next(self._request_ids)}" if request_id is None else request_id
        if not isinstance(request_id, str) or request_id in self.requests:
            raise InvalidField("request_id", f"{request_id!r} is not a new string id")
        ids = self._prompt_ids(prompt)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        seqs = [
            Sequence(
                ids,
                params if i == 0 or params.seed is None else replace(params, seed=hash((params.seed, i))),
                self.config.kvcache_block_size,
                stop_ids,
            )
            for i in range(params.n)
        ]
        self.scheduler.check_fits(seqs[0])
        return Request(request_id, prompt if isinstance(prompt, str) else None, seqs, stream)

    def _queue(self, request: Request) -> str:
        self.requests[request.request_id] = request
        for seq in request.seqs:
            self.request_of[seq.seq_id] = request
            self.scheduler.add(seq)
        return request.request_id

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidField("prompt", "this model has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = check_token_ids("prompt", prompt)
        if not ids:
            raise InvalidField("prompt", "is empty")
        if not all(0 <= t < self.vocab_size for t in ids):
            raise InvalidField("prompt", f"token ids must lie in [0, {self.vocab_size})")
        if len(ids) >= self.config.max_model_len:
            raise InvalidField(
                "prompt", f"has {len(ids)} tokens; max_model_len={self.config.max_model_len} leaves no room to generate"
            )
        return ids

    # ---- one step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs that changed (streaming requests) or finished."""
        started = time.perf_counter()
        try:  # 1) schedule step n+1
            step = self.scheduler.schedule()
            self.counters["computed_tokens"] += step.num_tokens
            # 2) launch it: the GPU queues it behind step n, whose samples it takes as inputs on the device
            launched = self.runner.launch(step, self.in_flight) if step.scheduled else None
            if self.trace is not None:
                self.trace.begin(step)
            # 3) finish step n (without overlap: this one): read its tokens back, apply the stop rules
            done, self.in_flight = (self.in_flight, launched) if self.config.overlap else (launched, None)
            if done is None and launched is None and self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler found nothing to run")  # a bug, never a state
            changed = self._finish(done) if done else []
        except BaseException:  # a failed or interrupted step: blocks it planned were findable before their K/V existed
            self.block_manager.cached.clear()
            self.in_flight = None  # every request it touched is aborted; those only queued stay
            for request in [r for r in self.requests.values() if not all(s.is_queued for s in r.seqs)]:
                self.abort(request.request_id)
            raise
        if self.trace is not None:
            self.trace.end(started)
        return self._outputs(changed)

    def _finish(self, in_flight) -> list[Request]:
        tokens, logprobs = in_flight.wait()
        now, changed = time.perf_counter(), {}
        for seq in self.scheduler.update(in_flight.step, tokens, logprobs):
            request = changed[seq.seq_id] = self.request_of[seq.seq_id]
            reason = self.stop_checker.check(seq, incremental=request.stream)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            request.metrics.first_token_time = request.metrics.first_token_time or now
            self.counters["generated_tokens"] += 1
        return list(dict.fromkeys(changed.values()))  # each changed request once, in order

    def _outputs(self, changed: list[Request]) -> list[RequestOutput]:
        for request in changed:
            if request.finished:
                self._retire(request)
        return [request.output() for request in changed if request.stream or request.finished]

    def _retire(self, request: Request):
        m, c = request.metrics, self.counters
        m.finished_time = time.perf_counter()
        num_tokens = max(len(seq.completion_token_ids) for seq in request.seqs)
        c["finished_requests"] += 1
        c["ttft_s"] += m.first_token_time - m.arrival_time
        c["itl_s"] += (m.finished_time - m.first_token_time) / max(num_tokens - 1, 1)
        self.abort(request.request_id)  # every sequence has finished: this only forgets the request

    # ---- offline batches --------------------------------------------------------------------------
    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either; sampling_params: one for all, or one per
        prompt. Every prompt is checked before any is queued; the outputs come back in prompt order."""
        if (
            isinstance(prompts, str)
            or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], numbers.Integral))
            or hasattr(prompts, "ndim")
        ):
            prompts = [prompts]  # one prompt
        if not isinstance(prompts, (list, tuple)):
            raise InvalidField("prompts", "expected a string, token ids, or a list of them")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidField("sampling_params", f"{len(params)} given for {len(prompts)} prompts")
        requests = [self._make_request(p, sp, None, stream=False) for p, sp in zip(prompts, params, strict=False)]
        return self._run(requests, use_tqdm)

    def _run(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        finished, generated = {}, self.counters["generated_tokens"]
        bar = tqdm(
            total=sum(len(r.seqs) * r.seqs[0].params.max_tokens for r in requests),
            unit="tok",
            desc="Generating",
            disable=not use_tqdm,
            dynamic_ncols=True,
        )
        try:
            for request in requests:
                self._queue(request)
            while len(finished) < len(requests):
                finished.update((out.request_id, out) for out in self.step() if out.finished)
                bar.update(self.counters["generated_tokens"] - generated)
                generated = self.counters["generated_tokens"]
                bar.set_postfix_str(f"{len(finished)}/{len(requests)} requests", refresh=False)
        finally:
            bar.total = bar.n  # outputs that ended early (EOS) never reach max_tokens
            bar.close()
            for request in requests:  # an interruption leaves nothing behind; a no-op otherwise
                self.abort(request.request_id)
        return [finished[r.request_id] for r in requests]

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them, through the chat template."""
        return self.generate(self.chat_prompts(messages), sampling_params, use_tqdm)

    def chat_prompts(self, messages) -> list[list[int]]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidField("model", "this model has no chat template")
        one = isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict)
        conversations = [messages] if one else messages
        if (
            not isinstance(conversations, (list, tuple))
            or not conversations
            or not all(
                isinstance(c, (list, tuple))
                and c
                and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in c
                )
                for c in conversations
            )
        ):
            raise InvalidField("messages", "expected a non-empty list of {'role': str, 'content': str} dicts")
        return [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                add_special_tokens=False,
            )
            for c in conversations
        ]

    def stats(self) -> dict:
        bm, c, done = self.block_manager, self.counters, max(self.counters["finished_requests"], 1)
        return {
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "kv_blocks_peak": bm.peak_used_blocks,
            "kv_blocks_cached": bm.num_cached_blocks,
            "prefix_hit_tokens": bm.prefix_hit_tokens,
            "prefix_queried_tokens": bm.prefix_queried_tokens,
            "prefix_hit_rate": bm.prefix_hit_tokens / max(bm.prefix_queried_tokens, 1),
            "preemptions": self.scheduler.num_preemptions,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "computed_tokens": c["computed_tokens"],
            "generated_tokens": c["generated_tokens"],
            "finished_requests": c["finished_requests"],
            "mean_ttft_s": c["ttft_s"] / done,
            "mean_itl_s": c["itl_s"] / done,
        }
