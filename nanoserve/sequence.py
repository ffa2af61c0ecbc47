"""A Sequence is one completion as the engine sees it: token ids, how many of them already have KV in the cache,
and the block table that says where that KV lives. Scheduler and block manager talk in Sequences; neither
knows about tensors or models.

The engine may launch step n+1 before reading step n's tokens back from the GPU, so a sequence's last token can
be PENDING: sampled, counted in every length, but its value not yet on the host."""

from array import array
from dataclasses import dataclass
from enum import Enum, auto
from itertools import count

from nanoserve.sampling_params import SamplingParams

PENDING = -1  # a token id sampled on the GPU and not yet read back


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class DecodedText:
    """A completion's text, decoded as its tokens are read back (stopping.py keeps it up to date)."""

    text: str = ""
    num_decoded: int = 0  # completion tokens whose text is in `text`
    num_searched: int = 0  # characters of `text` already searched for stop strings
    stop_at: int | None = None  # a stop string starts here: the output text ends here
    num_streamed: int = 0  # characters already handed out as deltas
    num_tokens_streamed: int = 0  # completion tokens already handed out
    final = property(lambda self: self.text if self.stop_at is None else self.text[: self.stop_at])  # what is shown


class Sequence:
    _ids = count()

    def __init__(
        self,
        token_ids: list[int],
        params: SamplingParams,
        block_size: int,
        stop_token_ids: frozenset[int] = frozenset(),
    ):
        self.seq_id, self.status = next(Sequence._ids), SequenceStatus.WAITING
        self.token_ids, self.num_prompt_tokens = list(token_ids), len(token_ids)
        self.params, self.block_size = params, block_size
        self.stop_token_ids = stop_token_ids  # the request's stop ids, plus EOS unless ignore_eos
        self.block_table = array("i")  # physical block ids in token order; packed int32: the runner copies it whole
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache (or being written this step)
        self.num_cached_tokens: int | None = None  # prompt tokens the prefix cache served; None until admitted
        self.num_pending = 0  # trailing PENDING tokens (at most two: steps n and n+1)
        self.finish_reason: str | None = None
        self.logprobs: list[dict] = []  # per generated token, when params.logprobs is set
        self.cumulative_logprob, self.text = 0.0, DecodedText()

    # lengths: every token counts, pending ones included; only their values are unknown
    num_tokens = property(lambda self: len(self.token_ids))
    num_known_tokens = property(lambda self: len(self.token_ids) - self.num_pending)  # values on the host
    num_completion_tokens = property(lambda self: len(self.token_ids) - self.num_prompt_tokens)
    num_uncomputed_tokens = property(lambda self: len(self.token_ids) - self.num_computed_tokens)
    completion_token_ids = property(lambda self: self.token_ids[self.num_prompt_tokens : self.num_known_tokens])
    is_finished = property(lambda self: self.status == SequenceStatus.FINISHED)
    is_queued = property(lambda self: self.status == SequenceStatus.WAITING and not self.num_pending)  # holds nothing

    def block_tokens(self, i: int) -> tuple[int, ...]:
        """The token ids that block i of this sequence holds (or will hold)."""
        return tuple(self.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def append_pending(self):
        self.token_ids.append(PENDING)
        self.num_pending += 1

    def resolve_pending(self, token_id: int, logprobs: dict | None = None):
        """The oldest pending token's value has arrived (steps are read back in launch order)."""
        self.token_ids[self.num_known_tokens] = token_id
        self.num_pending -= 1
        if logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token_id]

    def drop_pending(self):
        """Finished: a token sampled after the last one kept is discarded."""
        del self.token_ids[self.num_known_tokens :]
        self.num_pending = 0
