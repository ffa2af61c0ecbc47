"""When a sequence stops, and what text it shows: every stop rule in one place, in plain Python.

A sequence stops on its EOS or a stop id (the token is kept in token_ids, its text is not), on a stop string (the text
is cut where it starts), or at max_tokens or max_model_len ("length"). Before min_tokens tokens exist the sampler may
not pick EOS or a stop id, and a stop string does not count.

Pending tokens (sampled on the GPU, value not yet read back: the life of a token, in sequence.py's docstring) follow
one rule: length limits count every token, pending ones included, so the scheduler never plans a token past a limit;
rules on values (stop ids, stop strings) see only tokens read back, one at a time, in order.

Text is decoded incrementally: a few tokens before the new ones are decoded again, so a character whose UTF-8 bytes span
several tokens appears whole, once its last byte arrives. A streamed delta never contains the start of what could still
become a stop string, so a stop string is never streamed, even in part."""

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from nanoserve.sequence import Sequence

if TYPE_CHECKING:  # for annotations only: the bookkeeping modules import neither torch nor transformers
    from transformers import PreTrainedTokenizerBase

DETOKENIZE_CONTEXT = 6  # tokens decoded again before the new ones (a UTF-8 character has at most 4 bytes)
INCOMPLETE_CHARACTER = "\ufffd"  # what decoding shows for a character whose last bytes have not come yet


def reached_length_limit(seq: Sequence, max_model_len: int) -> bool:
    """Counts pending tokens: a sequence whose last token is pending but already at its limit is not scheduled. Draft
    tokens do not count: a draft past max_tokens is dropped by the stop rules when its turn comes."""
    num_tokens = seq.num_tokens - seq.num_draft_tokens
    return num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens or num_tokens >= max_model_len


def banned_token_ids(seq: Sequence) -> frozenset[int]:
    """Ids the sampler may not pick for seq's newest (pending) token: the first min_tokens tokens cannot stop."""
    if seq.num_completion_tokens <= seq.params.min_tokens:
        return seq.stop_token_ids
    return frozenset()


@dataclass
class StopChecker:
    tokenizer: "PreTrainedTokenizerBase | None"  # None (a weights-only model): no text
    max_model_len: int

    def check(self, seq: Sequence, incremental: bool) -> str | None:
        """After seq's oldest pending token is read back: "stop", "length" or None. Keeps seq.text up to date
        token by token when `incremental` (streaming) or when stop strings need it, else decodes once at the end."""
        params = seq.params
        num_known = seq.num_known_tokens  # (this runs for every sequence every step: each look costs)
        num_out = num_known - seq.num_prompt_tokens
        may_stop = num_out >= params.min_tokens
        newest = seq.token_ids[num_known - 1]
        if may_stop and newest in seq.stop_token_ids:
            # the stop id's own text is shown only with include_stop_str_in_output (EOS's is empty anyway where
            # skip_special_tokens leaves special tokens out)
            num_shown = num_out - 1
            if params.include_stop_str_in_output:
                num_shown = num_out
            self._decode(seq, num_shown, final=True)
            return "stop"
        if incremental or params.stop:
            self._decode(seq, num_out, final=False)
        if params.stop and search_stop_strings(seq, may_stop):
            return "stop"
        if num_out >= params.max_tokens or num_known >= self.max_model_len:
            self._decode(seq, num_out, final=True)
            return "length"
        return None

    def _decode(self, seq: Sequence, upto: int, final: bool) -> None:
        """Fold the text of completion tokens [text.num_decoded, upto) into seq.text. Not final: wait while the
        last character is incomplete."""
        decoded = seq.text
        # no text (no tokenizer, or detokenize=False), or nothing new (a stop id or the length limit right after a
        # streamed token): no two decodes of the same ids
        if self.tokenizer is None or not seq.params.detokenize or upto <= decoded.num_decoded:
            return
        ids = seq.completion_token_ids[:upto]
        start = max(0, decoded.num_decoded - DETOKENIZE_CONTEXT)
        decode = partial(self.tokenizer.decode, skip_special_tokens=seq.params.skip_special_tokens)
        before = decode(ids[start : decoded.num_decoded])
        after = decode(ids[start:])
        if after.endswith(INCOMPLETE_CHARACTER) and not final:
            return
        if after.startswith(before):
            decoded.text += after[len(before) :]
        else:  # the new tokens changed how earlier ones read (rare): decode the whole completion again
            decoded.text = decode(ids)
        decoded.num_decoded = upto


def search_stop_strings(seq: Sequence, may_stop: bool) -> bool:
    """Look for a stop string ending in text not searched before (so an occurrence before min_tokens never
    counts later); the first occurrence found ends the text."""
    decoded = seq.text
    found = []
    stops = seq.params.stop
    if not may_stop:  # none counts yet; the text searched now is never searched again
        stops = []
    for stop in stops:
        # an occurrence ending in the new text starts at most len(stop) - 1 characters before it
        search_from = max(0, decoded.num_searched - len(stop) + 1)
        start = decoded.text.find(stop, search_from)
        if start < 0:
            continue
        if seq.params.include_stop_str_in_output:
            found.append(start + len(stop))  # the text ends with the stop string
        else:
            found.append(start)  # the text ends where the stop string starts
    decoded.num_searched = len(decoded.text)
    decoded.stop_at = min(found, default=None)
    return decoded.stop_at is not None


def longest_stop_prefix_at_end(text: str, stops: list[str]) -> int:
    """The length of the longest tail of text that is the beginning of a stop string (shorter than it): those
    characters may still turn out to be a stop string, so they are held back from the stream."""
    longest = 0
    for stop in stops:
        for k in range(1, len(stop)):
            if text.endswith(stop[:k]):
                longest = max(longest, k)
    return longest


def take_stream_delta(seq: Sequence) -> str:
    """The text not yet streamed, less any tail that could still become a stop string (until the end). Advances
    the stream cursor."""
    decoded = seq.text
    if seq.is_finished:
        end = len(decoded.final)
    else:
        end = len(decoded.text) - longest_stop_prefix_at_end(decoded.text, seq.params.stop)
    delta = decoded.text[decoded.num_streamed : end]  # empty if end is not past the cursor
    decoded.num_streamed += len(delta)
    return delta
