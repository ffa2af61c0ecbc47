"""An extension: vLLM's allowed_token_ids and bad_words, as one logits processor (sampler.py's LogitsProcessor, applied
after the EOS bans and before the filters). Their rules, as vLLM's:
    allowed_token_ids: only these ids may be sampled; every other logit is -inf (EOS too, unless it is listed);
    bad_words: each word is never generated. A word is tokenized as vLLM does, without and with a leading space (the
        second only where it makes a different first token and as many tokens), so that it is caught at the start of
        the text and after a space. Its last token is banned wherever the tokens before it are the newest tokens of
        the output (a one-token word: always). The output only: the prompt's tail never counts.

The one idea: a ban that depends on nothing but the request (allowed_token_ids, one-token words) is the same mask at
every step, made once per request on the device; a ban that depends on the last tokens' values (a word of several
tokens) needs them on the host, so while such a sequence runs, the engine does not overlap steps (llm.py), as with a
grammar's mask (ext/structured.py).

No request is left with no token to sample (which would draw a banned one): allowed_token_ids that the one-token words,
or min_tokens (which bans the stop ids), ban every one of are refused by name when the request comes; a request whose
longer words ban its last allowed ids at some step ends there, with an error that says so (Sequence.error)."""

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from nanoserve.checks import LISTS, InvalidField, check_text, check_token_ids, shown
from nanoserve.sampler import to_device
from nanoserve.sampling_params import SamplingParams
from nanoserve.sequence import Sequence

if TYPE_CHECKING:  # for annotations only
    from transformers import PreTrainedTokenizerBase

    from nanoserve.llm import LLM

NAME = "token_bans"  # this extension's name in the registry (ext/__init__.py)


def check_params(params: SamplingParams) -> None:
    """allowed_token_ids: a non-empty list of integer ids (checked against the vocabulary in attach); bad_words: a list
    of words, each with some text that is not whitespace. Both stored back as plain lists."""
    if params.allowed_token_ids is not None:
        params.allowed_token_ids = check_token_ids("allowed_token_ids", params.allowed_token_ids)
        if not params.allowed_token_ids:
            raise InvalidField("allowed_token_ids", "is empty: no token could be sampled")
    words = [] if params.bad_words is None else params.bad_words
    if not isinstance(words, LISTS) or not all(isinstance(word, str) and word.strip() for word in words):
        raise InvalidField("bad_words", f"{shown(words)} is not a list of words (strings that are not blank)")
    for word in words:
        check_text("bad_words", word)
    params.bad_words = list(words)


def bad_word_ids(tokenizer: "PreTrainedTokenizerBase", words: list[str]) -> list[tuple[int, ...]]:
    """Each word's token ids as vLLM finds them (SamplingParams.update_from_tokenizer): the word without leading
    whitespace, then with one space before it, where that gives a different first token and as many tokens (a word
    whose spaced form splits differently is caught by its plain form where it can be)."""
    found = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        found.append(tuple(plain))
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            found.append(tuple(spaced))
    return found


@dataclass
class Bans:
    """One request's bans, shared by its n sequences."""

    allowed: Tensor | None  # [vocab] bool on the device: the ids that may be sampled; None: every id
    allowed_ids: frozenset[int] | None  # the same ids, on the host
    always: list[int]  # the one-token words
    after: list[tuple[tuple[int, ...], int]]  # the longer words: (the tokens before the last, the last)

    def banned(self, output: list[int]) -> list[int]:
        """The ids a sequence whose output so far is `output` may not sample next."""
        return self.always + [last for before, last in self.after if tuple(output[-len(before) :]) == before]

    def leave_none(self, seq: Sequence, banned: list[int]) -> bool:
        """Whether these bans, and the stop ids min_tokens bans (stopping.py's banned_token_ids, for seq's next token
        with its pending ones aside), leave none of its allowed ids."""
        stops = set()
        if len(seq.completion_token_ids) < seq.params.min_tokens:
            stops = seq.stop_token_ids
        return self.allowed_ids is not None and self.allowed_ids <= {*banned, *stops}


def attach(llm: "LLM", seqs: list[Sequence]) -> None:
    """A request with allowed ids or bad words: the ids within the vocabulary, the words tokenized (which needs a
    tokenizer), and its bans given to each of its sequences. A word with an id past the model's vocabulary can never
    be generated, so it bans nothing."""
    params = seqs[0].params
    allowed = None
    allowed_ids = None
    if params.allowed_token_ids is not None:
        allowed_ids = frozenset(check_token_ids("allowed_token_ids", params.allowed_token_ids, llm.vocab_size))
        allowed = torch.zeros(llm.vocab_size, dtype=torch.bool, device=llm.runner.device)
        allowed[list(allowed_ids)] = True
    if params.bad_words and llm.tokenizer is None:
        raise InvalidField("bad_words", "needs a tokenizer; this model has none")
    words = bad_word_ids(llm.tokenizer, params.bad_words) if params.bad_words else []
    words = [word for word in words if max(word) < llm.vocab_size]
    always = [word[0] for word in words if len(word) == 1]
    after = [(word[:-1], word[-1]) for word in words if len(word) > 1]
    bans = Bans(allowed, allowed_ids, always, after)
    if bans.leave_none(seqs[0], always):
        raise InvalidField("allowed_token_ids", "bad_words and min_tokens (the stop ids) ban every one of them")
    processor = llm.logits_processors.setdefault(NAME, TokenBans(llm.runner.device))
    for seq in seqs:
        processor.bans[seq] = bans


@dataclass
class StepBans:
    """One step's rows with bans: those with allowed ids and their masks, and (row, id) pairs to ban."""

    allowed_rows: Tensor | None  # [a] int64: rows of the logits with allowed_token_ids
    allowed: Tensor | None  # [a, vocab] bool: each such row's allowed ids
    banned: Tensor | None  # [2, b] int64: (row, id) pairs banned by bad words

    def apply(self, logits: Tensor) -> None:
        """In place on logits [rows, vocab]: every id a row may not sample becomes -inf."""
        if self.allowed_rows is not None:
            rows = self.allowed_rows
            logits[rows] = logits[rows].masked_fill(~self.allowed, float("-inf"))
        if self.banned is not None:
            banned_rows, banned_ids = self.banned
            logits[banned_rows, banned_ids] = float("-inf")

    def sampled(self, tokens: Tensor) -> None:
        """Nothing here: the next step's prepare reads the tokens it needs from the sequences."""


class TokenBans:
    """The logits processor: each sequence's bans, forgotten once it has finished (or, weakly keyed, once nothing
    holds it: a request refused before it was queued)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bans: weakref.WeakKeyDictionary[Sequence, Bans] = weakref.WeakKeyDictionary()

    def needs_tokens_on_host(self) -> bool:
        """While a sequence with a word of several tokens runs: its next ban depends on its newest tokens' values."""
        return any(bans.after and not seq.is_finished for seq, bans in self.bans.items())

    def prepare(self, seqs: list[Sequence]) -> StepBans | None:
        for seq in [s for s in self.bans if s.is_finished]:
            del self.bans[seq]
        limited = []  # (row, its allowed ids' mask)
        pairs = []  # (row, a banned id)
        for row, seq in enumerate(seqs):
            bans = self.bans.get(seq)
            if bans is None:
                continue
            # its tokens read back so far: all of them, since a sequence whose bans depend on them stops the overlap
            try:
                banned = bans.banned(seq.completion_token_ids)
            except Exception as error:  # the request ends alone (Sequence.error)
                seq.error = f"{NAME}: {error}"
                continue
            if bans.leave_none(seq, banned):
                seq.error = "allowed_token_ids: bad_words and min_tokens (the stop ids) ban every one of them here"
                continue
            pairs += [(row, token) for token in banned]
            if bans.allowed is not None:
                limited.append((row, bans.allowed))
        if not limited and not pairs:
            return None
        return StepBans(
            to_device([row for row, _ in limited], torch.long, self.device) if limited else None,
            torch.stack([mask for _, mask in limited]) if limited else None,
            to_device(pairs, torch.long, self.device).T if pairs else None,
        )
