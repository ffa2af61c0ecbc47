"""A Sequence is one completion as the engine sees it: token ids, how many of them already have KV in the cache,
and the block table that says where that KV lives. Scheduler and block manager talk in Sequences; neither
knows about tensors or models.

The life of a token: the one explanation of it (scheduler.py, step_inputs.py, stopping.py and llm.py point here).
1) Booked. The scheduler plans a step before it runs and books each sequence's share of it as it plans it: those
   tokens count as computed (num_computed_tokens) from then on, and the full blocks they complete become findable in
   the prefix cache at once. A request admitted later in the same step may take them: each layer writes all of a
   step's K/V before it reads any. So the scheduler may plan the next step before this one has run: the device runs
   steps in order, and lengths are all it needs.
2) PENDING. A chunk that reaches the sequence's end makes the step sample the next token, so the scheduler appends a
   PENDING token at once: counted in every length, its value still on the device.
3) Resolved. When the step is read back, Scheduler.update hands each sequence its samples, and the engine fills in its
   pending tokens one at a time, oldest first (Scheduler.resolve, resolve_pending), applying the stop rules
   (stopping.py) after each. Rules on values (stop ids, stop strings) see only resolved tokens; length limits count the
   pending ones too, so no step is planned past a limit. A block is findable only once its last token is resolved (no
   prefix cache key holds PENDING). A sequence that stops drops the pending token after its last one (drop_pending).
4) The overlap. With overlap on (a GPU's default), the engine plans and launches step n+1 before it reads step n back
   (llm.py's _overlapped_step; _plain_step reads each step back before planning the next). Step n+1's decode input is
   then step n's PENDING token: step_inputs.py marks those inputs (pending_at) and the runner fills them in on the
   device from step n's samples (InFlightStep.row_of). So a sequence holds at most two pending tokens (one in the plain
   loop), and one preempted meanwhile is not admitted again until they are resolved (Scheduler.schedule's phase 2).
5) Drafts (speculative decoding, ext/speculative.py). Before a step is planned, a proposer may append draft tokens
   after the known ones (num_draft_tokens): guessed values, never cached. The scheduler plans them with the next token
   (or drops those the budget or the pool has no room for: drop_drafts), the step's PENDING token comes after them, and
   the step samples at every draft's position as well as after the last. At read-back Scheduler.keep_drafts keeps the
   drafts up to the first one its sample disagrees with, plus that sample; the rest are rolled back (no longer
   computed, their blocks freed). The kept ones turn PENDING and are resolved like any sample. A step with drafts is
   never overlapped: the proposer needs the tokens on the host."""

import copy
from array import array
from dataclasses import dataclass
from enum import Enum, auto
from itertools import count

from nanoserve.sampling_params import SamplingParams

PENDING = -1  # a token id sampled on the GPU and not yet read back
Logprobs = dict[int, float]  # {token_id: logprob}: the chosen token's and the top-N


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

    @property
    def final(self) -> str:
        """What the caller is shown: the text up to the stop string, if one matched (text[:None] is all of it)."""
        return self.text[: self.stop_at]


class Sequence:
    _ids = count()

    def __init__(
        self,
        token_ids: list[int],
        params: SamplingParams,
        block_size: int,
        stop_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.seq_id = next(Sequence._ids)
        self.status = SequenceStatus.WAITING
        self.params = params
        self.block_size = block_size
        # the request's stop ids, plus EOS unless ignore_eos
        self.stop_token_ids = stop_token_ids
        # the prompt, then every token sampled so far (the last one or two may be PENDING)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        # physical block ids in token order; packed int32, so the runner copies it whole
        self.block_table = array("i")
        # tokens whose K/V are in the cache (or being written by a step already launched)
        self.num_computed_tokens = 0
        # prompt tokens the prefix cache served; None until first admitted
        self.num_cached_tokens: int | None = None
        # trailing PENDING tokens (the life of a token, above): at most two, or a verified draft run's kept tokens
        self.num_pending = 0
        # draft tokens after the known ones (before a step's PENDING one): values, but never known, so never cached
        self.num_draft_tokens = 0
        # set by an extension whose work on this sequence failed (a step hook, a logits processor, an admission rule):
        # the engine ends the sequence's request with finish reason "error" and this message (LLM._fail)
        self.error: str | None = None
        # "stop", "length", "abort" or "error" once finished
        self.finish_reason: str | None = None
        # per generated token, when params.logprobs is set: {token_id: logprob}
        self.logprobs: list[Logprobs] = []
        self.cumulative_logprob = 0.0
        # if params.prompt_logprobs is set (ext/prompt_logprobs.py): per prompt position, {token_id: logprob} of its
        # token and the top-N, filled in as the steps computing the prompt are read back (position 0, which nothing
        # predicts, stays None)
        self.prompt_logprobs: list[Logprobs | None] | None = None
        self.text = DecodedText()
        # the outputs.Request it samples for, set when the engine queues it (None: beam search's sequences, which
        # belong to no request)
        self.request = None
        # what this sequence's K/V depend on besides its tokens (vLLM's cache_salt): its LoRA adapter (ext/lora.py), or
        # None. Its blocks are keyed under it in the prefix cache (block_manager.py), so a block computed under one
        # salt is never found by a sequence under another; forks, preemption and recompute keep it. Never an int
        self.cache_salt = None

    # Lengths: every token counts, pending ones included; only their values are unknown.
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values are on the host and final (all but the pending ones and the drafts)."""
        # (len, not num_tokens: this and num_uncomputed_tokens run several times per sequence per step)
        return len(self.token_ids) - self.num_pending - self.num_draft_tokens

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        """The generated tokens read back so far."""
        return self.token_ids[self.num_prompt_tokens : self.num_known_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def is_queued(self) -> bool:
        """Waiting and holding nothing: no blocks, no token still in flight."""
        return self.status == SequenceStatus.WAITING and not self.num_pending

    def block_tokens(self, i: int) -> tuple[int, ...]:
        """The token ids that block i of this sequence holds (or will hold)."""
        return tuple(self.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def fork(self) -> "Sequence":
        """A copy under a new id, for beam search: its own tokens, block table (the same blocks: the block manager
        counts their new user), logprobs and text, each a copy. (A deep copy: beam search's sequences have no request,
        which it would copy too.)"""
        child = copy.deepcopy(self)
        child.seq_id = next(Sequence._ids)
        return child

    def append_pending(self) -> None:
        self.token_ids.append(PENDING)
        self.num_pending += 1

    def resolve_pending(self, token_id: int, logprobs: Logprobs | None = None) -> None:
        """The oldest pending token's value has arrived (steps are read back in launch order)."""
        self.token_ids[self.num_known_tokens] = token_id
        self.num_pending -= 1
        if logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token_id]

    def drop_drafts(self, keep: int = 0) -> None:
        """Keep only the first `keep` draft tokens (before the step that computes them is planned)."""
        if keep < self.num_draft_tokens:
            del self.token_ids[self.num_tokens - self.num_draft_tokens + keep :]
            self.num_draft_tokens = keep

    def drop_pending(self) -> None:
        """Finished: a token sampled after the last one kept is discarded."""
        del self.token_ids[self.num_known_tokens :]
        self.num_pending = 0
