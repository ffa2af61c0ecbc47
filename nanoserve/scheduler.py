"""The scheduler plans every step: which sequences run and how many of their tokens (continuous batching at the level of
single iterations). Plain Python over Sequences and the BlockManager.

A step has a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs). Running sequences go first, oldest
first: a decoding one costs one token, one still prefilling takes the next chunk of its prompt, so prefill chunks and
decodes share one batch and a long prompt never stalls the decodes (chunked prefill). When the pool runs dry, the most
recently admitted sequence is preempted: its blocks go back (still findable in the prefix cache) and it waits at the
front of the queue to recompute its tokens later. Leftover budget admits waiting sequences, which first take whatever
prefix of theirs is cached (unless they asked for prompt_logprobs, which need logits at every prompt position).

Each sequence's share of a step is booked as it is planned (_plan), and a sequence whose chunk reaches its end gets a
PENDING token, which update() and resolve() fill in when the step is read back; update() also keeps or rolls back draft
tokens (keep_drafts). Why booking ahead is safe, and the rest of a token's life (the overlap, drafts): sequence.py's
docstring, the one place that tells it."""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from nanoserve.block_manager import BlockManager
from nanoserve.sampling_params import InvalidField
from nanoserve.sequence import PENDING, Logprobs, Sequence, SequenceStatus
from nanoserve.stopping import reached_length_limit

# an admission rule (Scheduler.admission_rules): may this waiting sequence join these running ones now?
AdmissionRule = Callable[[Sequence, list[Sequence]], bool]
# what a step read back gave one sequence (Scheduler.update): its new tokens, and their logprobs (or Nones)
NewTokens = tuple[Sequence, list[int], list[Logprobs | None]]


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step
    num_new_tokens: int  # positions [start, start + num_new_tokens) are computed
    picks_next_token: bool  # the chunk reaches the sequence's end, so its last logits pick the next token


@dataclass
class Step:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # taken from the waiting queue this step
    failed: list[Sequence] = field(default_factory=list)  # waiting ones an extension failed on (Sequence.error)
    num_tokens: int = 0  # tokens computed in the step, counted as they are planned
    block_copies: list[int] = field(default_factory=list)  # copy-on-write (source, destination) pairs, flat

    @property
    def sampling_seqs(self) -> list[Sequence]:
        """The sequences that get a token from this step, in batch order."""
        return [s.seq for s in self.scheduled if s.picks_next_token]

    def sampled_rows(self) -> list[tuple[Sequence, int]]:
        """The step's rows of samples, in order: (its sequence, that sequence's length with the row's token). Each
        sequence has one, after its last position; one with draft tokens one more per draft, at each draft's
        position."""
        return [
            (seq, seq.num_tokens - seq.num_draft_tokens + i)
            for seq in self.sampling_seqs
            for i in range(seq.num_draft_tokens + 1)
        ]


@dataclass(eq=False)  # the constructor is written for us; schedulers compare by identity
class Scheduler:
    block_manager: BlockManager
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)  # in admission order: the last one is preempted first
    num_preemptions: int = 0
    # The extension point of admission: rules an extension's start() adds, each asked rule(seq, running) whether the
    # waiting sequence seq may join the running ones now (running: read it, never change it). One a rule says no to
    # keeps its place in the queue while later ones may go ahead (ext/lora: at most max_loras adapters run at once;
    # an adapter still loading); one whose error an extension set is reported by the step (Step.failed)
    admission_rules: list[AdmissionRule] = field(default_factory=list)
    # The extension point of KV transfer (ext/kv_offload: a host tier; ext/kv_transfer: another engine): a connector
    # that may supply the K/V of a waiting sequence's full blocks past those the prefix cache found. Asked
    # num_loadable(seq, num_cached_blocks) at admission, it names how many more; they are booked as computed, in blocks
    # of seq's table that it is then told of (load(seq, first_block, count)) and fills before the step runs (its step
    # hook). Never the block that holds the last token, whose logits the step needs
    kv_connector: object = None

    def check_fits(self, seq: Sequence, num_beams: int = 1) -> None:
        """Refuse a request that could not fit in the whole pool even alone: it would never finish. Beam search's beams
        hold the prompt's full blocks once, and each its own blocks for the rest of its tokens."""
        bm = self.block_manager
        final_len = min(seq.num_tokens + seq.params.max_tokens, self.max_model_len)
        kv_tokens = max(seq.num_tokens, final_len - 1)  # the last sampled token never needs KV
        shared = seq.num_tokens // bm.block_size
        needed = shared + num_beams * (bm.blocks_needed(kv_tokens) - shared)
        if needed > bm.num_blocks:
            raise InvalidField(
                "max_tokens",
                f"the request needs {needed} KV blocks ({kv_tokens} tokens) but the pool "
                f"has {bm.num_blocks}: lower max_tokens or add KV memory",
            )

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Step:
        """Plan the next step in two phases: 1) the running sequences; 2) with the budget left, the waiting ones."""
        step = Step()
        bm = self.block_manager
        # 1) the running sequences, oldest first (a copy: preemption removes from the list)
        for seq in list(self.running):
            budget = self.max_num_batched_tokens - step.num_tokens  # the step's tokens not yet planned
            if seq.num_draft_tokens:  # draft tokens ride whole, or as many as the budget and max_model_len leave
                seq.drop_drafts(max(0, min(budget, self.max_model_len - seq.num_known_tokens) - 1))
            # (a running sequence has at least one uncomputed token: none only when the budget is spent)
            num_new = min(seq.num_uncomputed_tokens, budget)
            # skip one preempted just now, or at its length limit with the last token pending (it ends when read)
            if seq.status != SequenceStatus.RUNNING or not num_new or reached_length_limit(seq, self.max_model_len):
                continue
            num_new = self._make_room(seq, num_new, step)
            if num_new:  # (none: seq itself was preempted)
                self._plan(step, seq, num_new)
        # 2) the budget left admits waiting sequences, in queue order until one does not fit; none after a
        #    preemption, which would only make the pool thrash
        held = []  # waiting sequences an admission rule holds back this step: they keep their place
        while not step.preempted and self.waiting and len(self.running) < self.max_num_seqs:
            budget = self.max_num_batched_tokens - step.num_tokens
            seq = self.waiting[0]
            if not budget or seq.num_pending:  # a preempted sequence waits for its tokens' values
                break
            if seq.error is not None or not self.may_admit(seq):
                if seq.error is not None:
                    step.failed.append(seq)
                held.append(self.waiting.popleft())
                continue
            cached = bm.find_cached_prefix(seq)  # none if it asked for prompt_logprobs
            loaded = 0  # full blocks a KV connector fills after the cached ones
            if self.kv_connector is not None:
                loaded = self.kv_connector.num_loadable(seq, len(cached))
            num_new = min(seq.num_tokens - (len(cached) + loaded) * bm.block_size, budget)
            if not bm.allocate(seq, loaded * bm.block_size + num_new, cached):
                break
            if loaded:  # booked as computed: the connector fills them before the step runs
                self.kv_connector.load(seq, len(cached), loaded)
                seq.num_computed_tokens += loaded * bm.block_size
            self.running.append(self.waiting.popleft())
            seq.status = SequenceStatus.RUNNING
            step.admitted.append(seq)
            self._plan(step, seq, num_new)
        self.waiting.extendleft(reversed(held))
        step.block_copies = bm.block_copies  # copy-on-write: made on the device before the step runs
        bm.block_copies = []
        return step

    def may_admit(self, seq: Sequence) -> bool:
        """Whether every admission rule lets seq join the running sequences now."""
        return all(rule(seq, self.running) for rule in self.admission_rules)

    def fork(self, seq: Sequence) -> Sequence:
        """A copy of a running sequence that shares all its blocks (BlockManager.fork) and runs from the next step
        on: the extension point of a driver that branches sequences (ext/beam_search.py's beams)."""
        child = self.block_manager.fork(seq)
        self.running.append(child)
        return child

    def _plan(self, step: Step, seq: Sequence, num_new: int) -> None:
        """Add seq's next num_new tokens to the step, and book them."""
        start = seq.num_computed_tokens
        picks_next_token = num_new == seq.num_uncomputed_tokens  # the chunk reaches the sequence's end
        step.scheduled.append(ScheduledSeq(seq, start, num_new, picks_next_token))
        step.num_tokens += num_new
        seq.num_computed_tokens += num_new  # booked: counted as computed from now on
        # the full blocks it completes are findable at once; a chunk of pending tokens only (an overlapped decode's)
        # completes none that way: a block is findable once its last token's value is known too (resolve)
        if seq.num_known_tokens > start:
            self.block_manager.cache_full_blocks(seq)
        if picks_next_token:
            seq.append_pending()  # its value arrives when this step is read back

    def _make_room(self, seq: Sequence, num_new: int, step: Step) -> int:
        """Allocate blocks for seq's next num_new tokens, preempting the latest admitted sequences until they fit.
        Returns how many tokens it made room for: num_new, less the draft tokens dropped first, or 0 if seq itself was
        preempted. Preemption by recompute: the victim's KV is dropped and it waits at the front of the queue;
        readmitted, it re-prefills its prompt + output so far."""
        while not self.block_manager.allocate(seq, num_new):
            if seq.num_draft_tokens:  # drafts are optional: dropped before anyone is preempted for their room
                num_new -= seq.num_draft_tokens
                seq.drop_drafts()
                continue
            victim = self.running.pop()
            victim.drop_drafts()  # unverified: a recompute must not take them for tokens
            self.block_manager.free(victim)  # its full blocks stay findable: they were cached when booked or read back
            victim.status = SequenceStatus.WAITING
            self.waiting.appendleft(victim)
            self.num_preemptions += 1
            step.preempted.append(victim)
            if victim is seq:
                return 0
        return num_new

    def update(
        self,
        step: Step,
        tokens: list[int],
        logprobs: list[Logprobs | None] | None,
    ) -> list[NewTokens]:
        """A launched step's samples are back, one per row of step.sampled_rows() (logprobs: None if no row asked
        for them). Returns (sequence, its new tokens, their logprobs or Nones) per sequence that got tokens (not those
        finished meanwhile), for the caller to fill into its pending tokens one by one (resolve): one token, or a draft
        run's kept tokens and the sample after them (keep_drafts)."""
        logprobs = logprobs or [None] * len(tokens)
        got_tokens = []
        end = 0  # one past the previous sequence's rows
        for seq in step.sampling_seqs:
            start = end
            end = start + seq.num_draft_tokens + 1  # a row per draft token, and one after the last
            if seq.is_finished:
                continue
            kept = 0
            if (
                seq.num_draft_tokens
            ):  # (not the common row, a single sample: this loop runs for every sequence per step)
                kept = self.keep_drafts(seq, tokens[start:end])
            got = slice(start, start + kept + 1)
            got_tokens.append((seq, tokens[got], logprobs[got]))
        return got_tokens

    def keep_drafts(self, seq: Sequence, samples: list[int]) -> int:
        """A sequence's draft tokens (it has some) against its samples (one per draft, then one after the last): it
        keeps the drafts up to the first its sample disagrees with, and that sample; returns how many drafts it kept.
        A kept draft is what the model would have drawn there anyway (the rejection rule, for a proposal of one token),
        so the output is exactly the one without drafts. The rest are rolled back: not computed, their blocks freed."""
        drafts = seq.token_ids[-len(samples) : -1]  # (before the step's pending token)
        kept = 0
        while kept < len(drafts) and drafts[kept] == samples[kept]:
            kept += 1
        # the kept drafts and the step's token: pending, until the caller resolves them with the samples' values
        seq.token_ids[-len(samples) :] = [PENDING] * (kept + 1)
        seq.num_pending = kept + 1  # (a step with drafts is never overlapped: it was the only one pending)
        seq.num_draft_tokens = 0
        seq.num_computed_tokens -= len(drafts) - kept  # the rejected drafts' K/V is garbage: not computed
        self.block_manager.free(seq, keep=self.block_manager.blocks_needed(seq.num_computed_tokens))
        return kept

    def resolve(self, seq: Sequence, token: int, logprobs: Logprobs | None) -> None:
        """seq's oldest pending token has its value: fill it in, and make a block it completes findable."""
        seq.resolve_pending(token, logprobs)
        # a block completes only when its last token's value comes (a preempted sequence holds none: no-op)
        if seq.num_known_tokens % self.block_manager.block_size == 0:
            self.block_manager.cache_full_blocks(seq)

    def finish_sequence(self, seq: Sequence, reason: str) -> None:
        """Stopped or aborted: its blocks return to the pool at once, wherever it was."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        else:  # waiting (never finished twice): it holds no blocks
            self.waiting.remove(seq)
        seq.drop_pending()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
