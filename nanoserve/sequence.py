"""A Sequence is one request as the engine sees it: token ids, how many of them already have KV in the
cache, and the block table that says where that KV lives. Scheduler and block manager talk in Sequences;
neither knows about tensors or models.

The engine launches step n+1 before reading step n's tokens back from the GPU, so a sequence's last one or two
tokens can be PENDING: sampled, counted in every length, but their values not yet on the host."""
from array import array
from enum import Enum, auto
from itertools import count

from nanoserve.sampling_params import SamplingParams

PENDING = -1  # a token id sampled on the GPU and not yet read back


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(self, token_ids: list[int], params: SamplingParams, block_size: int, prompt: str | None = None):
        self.seq_id = next(Sequence._ids)
        self.prompt = prompt                 # the text, when the request came as text
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        # physical block ids in token order, as packed int32: the runner copies it, no per-entry conversion
        self.block_table = array("i")
        self.num_computed_tokens = 0       # tokens whose K/V are in the cache
        self.num_cached_tokens: int | None = None  # prompt tokens the prefix cache served; None until admitted
        self.finish_reason: str | None = None
        self.logprobs: list[dict] = []     # one entry per generated token when params.logprobs is set
        self.num_pending = 0               # trailing PENDING tokens (at most two: steps n and n+1)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values are on the host: all but the pending ones."""
        return len(self.token_ids) - self.num_pending

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def block_tokens(self, i: int) -> tuple[int, ...]:
        """The token ids that block i of this sequence holds (or will hold)."""
        return tuple(self.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def append_pending(self):
        self.token_ids.append(PENDING)
        self.num_pending += 1

    def resolve_pending(self, token_id: int, logprobs: dict | None = None):
        """The oldest pending token's value has arrived (steps are read back in launch order)."""
        self.token_ids[self.num_known_tokens] = token_id
        self.num_pending -= 1
        if logprobs is not None:
            self.logprobs.append(logprobs)

    def drop_pending(self):
        """Finished: a token sampled after the last one kept is discarded."""
        del self.token_ids[self.num_known_tokens:]
        self.num_pending = 0
