"""When a sequence stops, and what text it shows: every stop rule in one place, in plain Python.

A sequence stops on its EOS or a stop id (the token is kept in token_ids, its text is not), on a stop string (the text
is cut where it starts), or at max_tokens or max_model_len ("length"). Before min_tokens tokens exist the sampler may
not pick EOS or a stop id, and a stop string does not count.

Pending tokens (sampled on the GPU, value not yet read back) follow one rule: length limits count every token, pending
ones included, so the scheduler never plans a token past a limit; rules on values (stop ids, stop strings) see only
tokens read back, one at a time, in order.

Text is decoded incrementally: a few tokens before the new ones are decoded again, so a character whose UTF-8 bytes span
several tokens appears whole, once its last byte arrives. A streamed delta never contains the start of what could still
become a stop string, so a stop string is never streamed, even in part."""

from nanoserve.sequence import Sequence

DETOKENIZE_CONTEXT = 6  # tokens decoded again before the new ones (a UTF-8 character has at most 4 bytes)
INCOMPLETE_CHARACTER = "\ufffd"  # what decoding shows for a character whose last bytes have not come yet


def reached_length_limit(seq: Sequence, max_model_len: int) -> bool:
    """Counts pending tokens: a sequence whose last token is pending but already at its limit is not scheduled."""
    return seq.num_completion_tokens >= seq.params.max_tokens or seq.num_tokens >= max_model_len


def banned_token_ids(seq: Sequence) -> frozenset[int]:
    """Ids the sampler may not pick for seq's newest (pending) token: the first min_tokens tokens cannot stop."""
    return seq.stop_token_ids if seq.num_completion_tokens <= seq.params.min_tokens else frozenset()


class StopChecker:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len  # tokenizer None (weights only): no text

    def check(self, seq: Sequence, incremental: bool) -> str | None:
        """After seq's oldest pending token is read back: "stop", "length" or None. Keeps seq.text up to date
        token by token when `incremental` (streaming) or when stop strings need it, else decodes once at the end."""
        p, num_out = seq.params, seq.num_known_tokens - seq.num_prompt_tokens
        may_stop = num_out >= p.min_tokens
        if may_stop and seq.token_ids[seq.num_known_tokens - 1] in seq.stop_token_ids:
            self._decode(seq, num_out - 1, final=True)  # the stop id's own text is not shown
            return "stop"
        if incremental or p.stop:
            self._decode(seq, num_out, final=False)
        if p.stop and self._search_stop_strings(seq, may_stop):
            return "stop"
        if num_out >= p.max_tokens or seq.num_known_tokens >= self.max_model_len:
            self._decode(seq, num_out, final=True)
            return "length"
        return None

    def flush(self, seq: Sequence):
        """Finished another way (aborted): the text of every token read back."""
        self._decode(seq, seq.num_known_tokens - seq.num_prompt_tokens, final=True)

    def _decode(self, seq: Sequence, upto: int, final: bool):
        """Fold the text of completion tokens [text.num_decoded, upto) into seq.text. Not final: wait while the
        last character is incomplete."""
        t, ids = seq.text, seq.token_ids[seq.num_prompt_tokens : seq.num_prompt_tokens + upto]
        if self.tokenizer is None or upto <= t.num_decoded:
            return
        start = max(0, t.num_decoded - DETOKENIZE_CONTEXT)
        before = self.tokenizer.decode(ids[start : t.num_decoded], skip_special_tokens=True)
        after = self.tokenizer.decode(ids[start:], skip_special_tokens=True)
        if after.endswith(INCOMPLETE_CHARACTER) and not final:
            return
        if after.startswith(before):
            t.text += after[len(before) :]
        else:  # the new tokens changed how earlier ones read (rare): decode the whole completion again
            t.text = self.tokenizer.decode(ids, skip_special_tokens=True)
        t.num_decoded = upto

    @staticmethod
    def _search_stop_strings(seq: Sequence, may_stop: bool) -> bool:
        """Look for a stop string ending in text not searched before (so an occurrence before min_tokens never
        counts later); the first occurrence found ends the text."""
        t = seq.text
        starts = [t.text.find(s, max(0, t.num_searched - len(s) + 1)) for s in seq.params.stop] if may_stop else []
        t.num_searched = len(t.text)
        t.stop_at = min((i for i in starts if i >= 0), default=None)
        return t.stop_at is not None


def take_stream_delta(seq: Sequence) -> str:
    """The text not yet streamed, less any tail that could still become a stop string (until the end)."""
    t = seq.text
    held = max(
        (k for s in seq.params.stop for k in range(min(len(s) - 1, len(t.text)), 0, -1) if t.text.endswith(s[:k])),
        default=0,
    )  # the longest tail that begins a stop string
    end = len(t.final) if seq.is_finished else len(t.text) - held
    delta = t.text[t.num_streamed : max(end, t.num_streamed)]
    t.num_streamed += len(delta)
    return delta
