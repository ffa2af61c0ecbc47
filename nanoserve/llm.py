"""The user-facing engine, vLLM-style: LLM(...).generate(prompts, sampling_params) and .chat(...).

It validates every request before any work, then loops: the scheduler picks a batch, the model runner
computes it and samples, and finished sequences leave, freeing their blocks, while new ones join.
The loop keeps the GPU fed: it launches step n+1 before it reads step n's tokens back and checks them for
stop conditions, so the host's work for a step overlaps the GPU's work on the previous one.
"""
import numbers
import os
import time
from dataclasses import dataclass

from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from nanoserve.block_manager import BlockManager
from nanoserve.config import EngineConfig
from nanoserve.model_runner import ModelRunner
from nanoserve.sampling_params import SamplingParams
from nanoserve.scheduler import Scheduler
from nanoserve.sequence import Sequence

STOP_WINDOW_SLACK = 8  # extra tokens decoded when looking for a stop string at the end of the output


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]          # generated tokens, EOS or stop id included when that ended it
    text: str                     # generated text, special tokens and a matched stop string removed
    finish_reason: str            # "stop" (EOS, stop id, stop string) or "length"
    logprobs: list[dict] | None   # per generated token: {token_id: logprob}, the top-N and the chosen
    num_cached_tokens: int        # prompt tokens served by the prefix cache


def resolve_model_dir(model: str | None) -> str:
    if model is None:
        from nanoserve.default_model import default_model_dir
        return default_model_dir()
    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download  # a hub id: fetched once, when online
    return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])


def eos_ids_of(model_dir: str, hf_config, tokenizer) -> set[int]:
    """EOS ids from the generation config and the model config (several allowed), then the tokenizer."""
    ids = set()
    try:
        sources = [GenerationConfig.from_pretrained(model_dir).eos_token_id]
    except OSError:
        sources = []
    sources.append(getattr(hf_config, "eos_token_id", None))
    if not any(s is not None for s in sources) and tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    for s in sources:
        ids.update([s] if isinstance(s, int) else (s or []))
    return ids


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        model_dir = resolve_model_dir(model)
        hf_config = AutoConfig.from_pretrained(model_dir)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError, TypeError):
            self.tokenizer = None  # a weights-only directory: prompts must be token ids
        self.eos_token_ids = eos_ids_of(model_dir, hf_config, self.tokenizer)
        self.runner = ModelRunner(self.config, hf_config, model_dir, self.eos_token_ids)
        self.block_manager = BlockManager(self.runner.num_kvcache_blocks, self.config.kvcache_block_size,
                                          self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs,
                                   self.config.max_num_batched_tokens, self.config.max_model_len)
        self.vocab_size = self.runner.args.vocab_size

    # ---- requests ---------------------------------------------------------------------------------
    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
        elif all(isinstance(t, numbers.Integral) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            raise ValueError("prompt must be a string or a list of integer token ids")
        if not ids:
            raise ValueError("prompt is empty")
        if not all(0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len={self.config.max_model_len} "
                             "leaves no room to generate")
        return ids

    def _make_sequences(self, prompts, sampling_params) -> list[Sequence]:
        """Everything checked here, before any sequence reaches the scheduler."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        for p in params:
            if not all(0 <= t < self.vocab_size for t in p.stop_token_ids):
                raise ValueError(f"SamplingParams.stop_token_ids must lie in [0, {self.vocab_size})")
            if p.logprobs is not None and p.logprobs > self.vocab_size:
                raise ValueError(f"SamplingParams.logprobs={p.logprobs} exceeds the vocabulary")
        seqs = [Sequence(self._prompt_ids(p), sp, self.config.kvcache_block_size, p if isinstance(p, str) else None)
                for p, sp in zip(prompts, params)]
        for seq in seqs:
            self.scheduler.check_fits(seq)
        return seqs

    # ---- the loop ---------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        seqs = self._make_sequences(prompts, sampling_params)
        for seq in seqs:
            self.scheduler.add(seq)
        bar = tqdm(total=len(seqs), desc="Generating", disable=not use_tqdm, dynamic_ncols=True)
        in_flight = None
        try:
            while self.scheduler.has_unfinished() or in_flight:
                start = time.perf_counter()
                launched, num_prefill, num_decode = self.launch_step()
                num_done = self.finish_step(*in_flight) if in_flight else 0
                if launched is None and in_flight is None:
                    raise RuntimeError("the scheduler found nothing to run")  # a bug, never a state
                in_flight = launched
                rate = 1 / (time.perf_counter() - start)
                bar.set_postfix_str(f"prefill {num_prefill * rate:.0f} tok/s, decode {num_decode * rate:.0f} tok/s",
                                    refresh=False)
                bar.update(num_done)
        finally:
            bar.close()
            self.scheduler.abort_all()  # frees what an interruption left behind; a no-op otherwise
        return [self._output(seq) for seq in seqs]

    def launch_step(self):
        """Schedule a step and queue it on the GPU. Returns (what finish_step needs, or None if nothing
        could run; prefill tokens; decode tokens)."""
        batch = self.scheduler.schedule()
        if not batch:
            return None, 0, 0
        num_decode = sum(1 for seq, n in batch if n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens)
        num_prefill = sum(n for _, n in batch) - num_decode
        sampling, sampled = self.runner.launch(batch)
        self.scheduler.launched(batch)
        return (batch, sampling, sampled), num_prefill, num_decode

    def finish_step(self, batch, sampling, sampled) -> int:
        """Read a launched step's tokens back (waiting for the GPU if needed), record them, and end the
        sequences that reached a stop condition. Returns how many ended."""
        tokens, logprobs = sampled.wait() if sampled is not None else ([], None)
        num_done = 0
        for seq in self.scheduler.update(batch, sampling, tokens, logprobs):
            reason = self._finish_reason(seq)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                num_done += 1
        return num_done

    def _finish_reason(self, seq: Sequence) -> str | None:
        """Checked on the tokens read back so far (a later one may still be pending)."""
        p, known = seq.params, seq.num_known_tokens
        last, num_out = seq.token_ids[known - 1], known - seq.num_prompt_tokens
        if num_out >= p.min_tokens:
            if last in p.stop_token_ids or (last in self.eos_token_ids and not p.ignore_eos):
                return "stop"
            if p.stop and self._stop_string_at(seq) is not None:
                return "stop"
        if num_out >= p.max_tokens or known >= self.config.max_model_len:
            return "length"
        return None

    def _decode(self, token_ids) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer else ""

    def _stop_string_at(self, seq: Sequence, tail_only: bool = True) -> int | None:
        """Where the first stop string starts in the output text. Checked every step, so only a tail
        that could hold a new match is decoded (every token is at least one character; a few more
        tokens cover characters split across byte-level tokens)."""
        known = seq.num_known_tokens
        window = max(map(len, seq.params.stop)) + STOP_WINDOW_SLACK if tail_only else known
        text = self._decode(seq.token_ids[max(seq.num_prompt_tokens, known - window):known])
        found = [i for i in (text.find(s) for s in seq.params.stop) if i >= 0]
        return min(found) if found else None

    def _output(self, seq: Sequence) -> RequestOutput:
        text = self._decode(seq.completion_token_ids)
        if seq.params.stop and seq.finish_reason == "stop":
            cut = self._stop_string_at(seq, tail_only=False)
            text = text if cut is None else text[:cut]
        return RequestOutput(
            prompt=seq.prompt, prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
            token_ids=seq.completion_token_ids, text=text, finish_reason=seq.finish_reason,
            logprobs=seq.logprobs if seq.params.logprobs is not None else None,
            num_cached_tokens=seq.num_cached_tokens)

    # ---- chat and counters ------------------------------------------------------------------------
    def chat(self, messages, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("model: this model has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(
            c, tokenize=False, add_generation_prompt=True), add_special_tokens=False) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stats(self) -> dict:
        bm = self.block_manager
        return dict(kv_blocks_total=bm.num_blocks, kv_blocks_used=bm.num_used_blocks,
                    kv_blocks_peak=bm.peak_used_blocks,
                    kv_blocks_free=bm.num_free_blocks, kv_blocks_cached=bm.num_cached_blocks,
                    prefix_hit_tokens=bm.prefix_hit_tokens, prefix_queried_tokens=bm.prefix_queried_tokens,
                    prefix_hit_rate=bm.prefix_hit_tokens / max(bm.prefix_queried_tokens, 1),
                    preemptions=self.scheduler.num_preemptions)
