"""An extension: speculative decoding, vLLM's speculative_config. Decode is memory-bound: a step reads every weight to
produce one token per sequence, so checking k proposed tokens in the same pass costs little more than producing one.

  LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
  LLM(model, speculative_config={"method": "draft_model", "model": DRAFT_DIR, "num_speculative_tokens": 4})

Before each step is planned, the proposer gives each decoding sequence up to k draft tokens (Sequence.num_draft_tokens):
  - ngram (prompt lookup): the latest earlier occurrence of the sequence's last n tokens (n from prompt_lookup_max down
    to prompt_lookup_min) in its own prompt and output, and the k tokens that followed it there;
  - draft_model: a second, smaller model with the same vocabulary (an engine of its own, whose prefix cache keeps each
    sequence's KV between steps) decodes k tokens greedily.
The step computes the drafts beside the sequence's last token, through the prefill path (one query row each), and the
sampler draws a token at every one of those rows with the request's own rules and noise. Scheduler.keep_drafts keeps
the drafts up to the first one the model's own draw disagrees with, and that draw: so every token is exactly the one
decoding without drafts would have drawn (the standard rejection rule, min(1, p/q), for a proposal q of one token: it
accepts a draft d with probability p(d), and on rejection draws from p without d, which is what the model's own draw
is, given it is not d). A greedy request's output is identical token for token; a seeded one's too (the noise of a row
depends on the seed and the position only). The rejected drafts are rolled back (their blocks freed, never cached).

What the proposer leaves alone: a sequence that uses a logits processor (penalties, a grammar: their state follows one
token per step), one before min_tokens (its stop ids are banned at some rows only), one whose drafts would not fit the
step's token budget or the free blocks, beam search's beams (its driver takes one token per beam and step, with its
logprobs: LLM.beam_search runs as without drafts), and every sequence while more than disable_by_batch_size run: at
large batches the extra rows cost more than they save (on this project's CPU, ordinary chat at batch 24 ran 10-17%
slower with drafts). Proposing needs every token read back, so steps do not overlap while it proposes."""

import json
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from nanoserve.checks import InvalidField, check_number, shown
from nanoserve.config import EngineConfig
from nanoserve.sampling_params import SamplingParams
from nanoserve.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from nanoserve.llm import LLM

FIELD = "speculative_config"
METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # drafts per sequence and step: past ~8, a run of agreeing drafts is rare
# no drafts while more sequences than this run, unless the config says otherwise: the default that keeps ordinary
# chat from losing (BENCHMARKS.md, 2026-11-27: at batch 24 n-gram drafts cost 10-17% on this CPU; at 8, nothing)
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass
class SpeculativeConfig:
    """vLLM's keys; each checked when the engine's config is made."""

    method: str  # "ngram" or "draft_model"
    num_speculative_tokens: int  # k: drafts per sequence and step
    prompt_lookup_max: int | None = None  # ngram: the longest suffix looked up (vLLM: required for ngram)
    prompt_lookup_min: int | None = None  # ngram: the shortest (default 1)
    model: str | None = None  # draft_model: its folder
    disable_by_batch_size: int | None = None  # no drafts while more sequences than this run

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidField(f"{FIELD}.method", f"{shown(self.method)} is not one of {', '.join(METHODS)}")
        drafts = self.num_speculative_tokens
        drafts = check_number(f"{FIELD}.num_speculative_tokens", drafts, 1, MAX_SPECULATIVE_TOKENS, integer=True)
        self.num_speculative_tokens = drafts
        if self.disable_by_batch_size is not None:
            batch = check_number(f"{FIELD}.disable_by_batch_size", self.disable_by_batch_size, 1, 2**31, integer=True)
            self.disable_by_batch_size = batch
        if self.method == "ngram":
            self.prompt_lookup_max = check_number(f"{FIELD}.prompt_lookup_max", self.prompt_lookup_max, 1, 2**31, True)
            low = 1 if self.prompt_lookup_min is None else self.prompt_lookup_min
            self.prompt_lookup_min = check_number(f"{FIELD}.prompt_lookup_min", low, 1, self.prompt_lookup_max, True)
        elif not isinstance(self.model, str):
            raise InvalidField(f"{FIELD}.model", "draft_model needs the draft model's folder")
        # the other method's keys are refused, not ignored
        for unused in ("model",) if self.method == "ngram" else ("prompt_lookup_max", "prompt_lookup_min"):
            if getattr(self, unused) is not None:
                raise InvalidField(f"{FIELD}.{unused}", f"is not a key of method {self.method!r}")
        if self.disable_by_batch_size is None:
            self.disable_by_batch_size = DEFAULT_DISABLE_BY_BATCH_SIZE


def check_config(config: EngineConfig) -> None:
    """speculative_config: a dict of vLLM's keys, or its JSON text (the server's --speculative-config), as a
    SpeculativeConfig; any other key is refused by name."""
    value = config.speculative_config
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise InvalidField(FIELD, f"is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise InvalidField(FIELD, f"{shown(value)} is not a dict of vLLM's speculative_config keys")
    if unknown := sorted(set(value) - {f.name for f in fields(SpeculativeConfig)}):
        raise InvalidField(f"{FIELD}.{unknown[0]}", "is not a key nanoserve implements")
    if "method" not in value and "model" in value:  # vLLM's older form: a draft model named, no method
        value = {"method": "draft_model", **value}
    try:
        config.speculative_config = SpeculativeConfig(**value)
    except TypeError:  # a required key missing
        raise InvalidField(FIELD, "needs method and num_speculative_tokens") from None
    if config.tensor_parallel_size > 1:
        raise InvalidField(FIELD, "nanoserve does not speculate with tensor_parallel_size > 1 yet")


def start(llm: "LLM") -> "Proposer":
    """The engine starts with speculative_config: its proposer (LLM.proposer), which the engine asks for drafts before
    each step is planned."""
    llm.proposer = Proposer(llm, llm.config.speculative_config)
    return llm.proposer


def ngram_drafts(tokens: list[int], k: int, longest: int, shortest: int) -> list[int]:
    """Prompt lookup: the k tokens that followed an earlier occurrence of the longest suffix of tokens, from `longest`
    tokens down to `shortest`; none if no suffix occurs earlier. Of several occurrences, the latest that k tokens
    follow (the nearest context is the likeliest to be copied), else the earliest (the one most tokens follow: in a
    run of one repeated token, the latest has only one after it)."""
    ids = np.asarray(tokens)
    for n in range(min(longest, len(ids) - 1), shortest - 1, -1):
        windows = sliding_window_view(ids[:-1], n)  # every earlier run of n tokens (the suffix itself left out)
        starts = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if len(starts):
            full = starts[starts + n + k <= len(ids)]  # those with k tokens after them
            after = (full[-1] if len(full) else starts[0]) + n
            return tokens[after : after + k]
    return []


def draft_engine(llm: "LLM", model: str) -> "LLM":
    """The draft model's engine, on the target's device and kernels, with a pool for the sequences that may carry
    drafts at once, refused by name if its vocabulary is not the target's (its drafts would be other tokens)."""
    from nanoserve.llm import LLM

    config = llm.config
    spec = config.speculative_config
    blocks_per_seq = -(-config.max_model_len // config.kvcache_block_size)
    # any fault of the draft's folder (missing, a broken tokenizer, a context shorter than max_model_len) is the key's
    try:
        draft = LLM(
            model,
            device=config.device,
            kernels=config.kernels,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            max_num_seqs=min(config.max_num_seqs, spec.disable_by_batch_size),
            kvcache_block_size=config.kvcache_block_size,
            num_kvcache_blocks=blocks_per_seq * min(config.max_num_seqs, spec.disable_by_batch_size) + 1,
            threads=config.threads,
        )
    except Exception as error:
        raise InvalidField(f"{FIELD}.model", f"{model!r} cannot be the draft model: {error}") from None
    same_tokens = (
        llm.tokenizer is None or draft.tokenizer is None or draft.tokenizer.get_vocab() == llm.tokenizer.get_vocab()
    )
    if draft.vocab_size != llm.vocab_size or not same_tokens:
        draft.close()
        raise InvalidField(f"{FIELD}.model", f"{model!r} has another vocabulary than the target model")
    return draft


def rejection_rule(p: np.ndarray, q: np.ndarray, draft: int, u: float) -> tuple[bool, np.ndarray]:
    """The standard rule that keeps a target distribution p exact given a proposal drawn from q: accept the draft with
    probability min(1, p[draft] / q[draft]) (u: a uniform in [0, 1)); on rejection, the token comes from the
    normalised max(0, p - q). Returns (accepted, the distribution to draw from on rejection). For a proposal of one
    token (q one-hot, as both proposers here make), it accepts with probability p[draft] and draws the rest from p
    without the draft: exactly the model's own draw, which is how the engine applies it (Scheduler.keep_drafts)."""
    accepted = u < min(1.0, p[draft] / q[draft])
    residual = np.maximum(p - q, 0.0)
    return bool(accepted), residual / residual.sum()


class Proposer:
    """Draft tokens for the running sequences, once per step, and the running totals of what became of them."""

    def __init__(self, llm: "LLM", spec: SpeculativeConfig) -> None:
        self.spec = spec
        self.draft = None if spec.method == "ngram" else draft_engine(llm, spec.model)
        self.scheduler = llm.scheduler
        self.budget = llm.config.max_num_batched_tokens
        self.max_model_len = llm.config.max_model_len
        # last step's drafts (their first position, the tokens), to count how many were kept
        self.proposed: dict[Sequence, tuple[int, list[int]]] = {}
        self.num_proposed = 0  # draft tokens proposed
        self.num_accepted = 0  # of those, kept
        self.num_runs = 0  # sequences x steps that carried drafts

    def needs_tokens_on_host(self) -> bool:
        """Whether the next step may carry drafts: proposing reads every sequence's last token."""
        return len(self.scheduler.running) <= self.spec.disable_by_batch_size

    def propose(self, llm: "LLM") -> None:
        """Count what became of the last step's drafts, then give each sequence that may have some its drafts."""
        self._count_kept()
        if not self.needs_tokens_on_host():
            return
        running = self.scheduler.running
        bm = self.scheduler.block_manager
        budget = self.budget - sum(seq.num_uncomputed_tokens for seq in running)
        free_blocks = bm.num_free_blocks - sum(bm.blocks_needed(s.num_tokens) - len(s.block_table) for s in running)
        wanted = {seq: self._room(seq, budget) for seq in running}
        wanted = {seq: k for seq, k in wanted.items() if k}
        for seq, drafts in zip(wanted, self._drafts(wanted), strict=True):
            drafts = drafts[: min(wanted[seq], budget)]
            stop = next((i for i, token in enumerate(drafts) if token in seq.stop_token_ids), len(drafts))
            drafts = drafts[:stop]  # a stop id is left for the model's own draw: the stop rules see it there
            new_blocks = bm.blocks_needed(seq.num_tokens + len(drafts)) - bm.blocks_needed(seq.num_tokens)
            if not drafts or new_blocks > free_blocks:
                continue
            self.proposed[seq] = (seq.num_tokens, drafts)
            seq.token_ids += drafts
            seq.num_draft_tokens = len(drafts)
            budget -= len(drafts)
            free_blocks -= new_blocks

    def _room(self, seq: Sequence, budget: int) -> int:
        """How many drafts seq may carry into the next step: none unless it is decoding with every token known, uses
        no logits processor, is past min_tokens and belongs to a request (not a beam); at most k, the budget left, and
        what its length limits leave (the model's own draw after the drafts must fit them too)."""
        params = seq.params
        decoding = seq.status == SequenceStatus.RUNNING and seq.num_uncomputed_tokens == 1 and not seq.num_pending
        if not decoding or params.extensions or seq.num_completion_tokens < params.min_tokens:
            return 0
        if seq.request is None:  # beam search's: its driver takes one token per beam and step
            return 0
        left = min(params.max_tokens - seq.num_completion_tokens, self.max_model_len - seq.num_tokens) - 1
        return max(0, min(self.spec.num_speculative_tokens, budget, left))

    def _drafts(self, wanted: dict[Sequence, int]) -> list[list[int]]:
        """Each sequence's proposal of up to wanted[seq] tokens."""
        if self.draft is None:
            spec = self.spec
            return [
                ngram_drafts(seq.token_ids, k, spec.prompt_lookup_max, spec.prompt_lookup_min)
                for seq, k in wanted.items()
            ]
        prompts = [seq.token_ids[: seq.num_known_tokens] for seq in wanted]
        params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in wanted.values()]
        return [out.outputs[0].token_ids for out in self.draft.generate(prompts, params, use_tqdm=False)]

    def _count_kept(self) -> None:
        """How many of the last step's drafts each sequence kept: its tokens from the first draft's position on agree
        with them up to there (the token after them is the model's own draw, never equal to a rejected draft)."""
        for seq, (start, drafts) in self.proposed.items():
            tokens = seq.token_ids[start : start + len(drafts)]
            self.num_accepted += next((i for i, t in enumerate(tokens) if t != drafts[i]), len(tokens))
            self.num_proposed += len(drafts)
            self.num_runs += 1
        self.proposed = {}

    def stats(self) -> dict[str, int | float]:
        """The running totals, the last step's drafts counted too: a step with drafts is read back before step()
        returns (proposing turns the overlap off), so their fate is known whenever stats() can be called. (A draft the
        scheduler cut for room after it was proposed, which the budget and pool guards above make rare, counts as
        proposed and not accepted.)"""
        self._count_kept()
        return {
            "spec_proposed_tokens": self.num_proposed,
            "spec_accepted_tokens": self.num_accepted,
            "spec_acceptance_rate": self.num_accepted / max(self.num_proposed, 1),
            "spec_mean_accepted_length": self.num_accepted / max(self.num_runs, 1),
        }
