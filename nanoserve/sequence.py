"""A Sequence is one request as the engine sees it: token ids, how many of them already have KV in the
cache, and the block table that says where that KV lives. Scheduler and block manager talk in Sequences;
neither knows about tensors or models."""
from array import array
from enum import Enum, auto
from itertools import count

from nanoserve.sampling_params import SamplingParams


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

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

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

    def append_token(self, token_id: int, logprobs: dict | None = None):
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
