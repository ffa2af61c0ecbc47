"""The scheduler decides, every step, which sequences run and how many of their tokens: continuous
batching at the level of single iterations. Plain Python over Sequences and the BlockManager.

Each step has a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs). Running
sequences go first, oldest first: a decoding one costs one token, one still prefilling takes the next
chunk of its prompt, so prefill chunks and decodes share one mixed batch and a long prompt never stalls
the decodes. Leftover budget admits waiting sequences, which first reuse whatever prefix is cached.
When the pool runs dry, the most recently admitted sequence is preempted: its blocks go back (keeping
their hashes) and it waits at the front of the queue to recompute its tokens later.

A step's life: schedule() picks it, launched() books its work as done (each sampling sequence gets a PENDING
token), and update() fills those tokens in once the GPU's results are read back, which the engine does only
after launching the next step. So scheduling never waits for the GPU: lengths are known before values.
"""
from collections import deque

from nanoserve.block_manager import BlockManager
from nanoserve.sequence import Sequence, SequenceStatus

ScheduledBatch = list[tuple[Sequence, int]]  # (sequence, number of its tokens to compute this step)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # in admission order: the last one is preempted first
        self.num_preemptions = 0

    def check_fits(self, seq: Sequence):
        """Refuse a request that could not fit in the whole pool even alone: it would never finish."""
        final_len = min(seq.num_tokens + seq.params.max_tokens, self.max_model_len)
        kv_tokens = max(seq.num_tokens, final_len - 1)  # the last sampled token never needs KV
        needed = self.block_manager.blocks_needed(kv_tokens)
        if needed > self.block_manager.num_blocks:
            raise ValueError(f"request needs {needed} KV blocks ({kv_tokens} tokens) but the pool has "
                             f"{self.block_manager.num_blocks}: lower max_tokens or add KV memory")

    def add(self, seq: Sequence):
        self.check_fits(seq)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        batch: ScheduledBatch = []
        preempted = False
        for seq in list(self.running):
            if budget == 0 or seq.status != SequenceStatus.RUNNING:  # out of budget, or preempted below
                continue
            if self.reached_length_limit(seq):  # its last token is pending: it finishes when read back
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.allocate(seq, num_new):
                preempted = True
                if self._preempt(self.running[-1]) is seq:
                    break
            else:
                batch.append((seq, num_new))
                budget -= num_new
        # Admitting while others were just preempted would only make the pool thrash.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs and not self.waiting[0].num_pending):
            seq = self.waiting[0]  # (a preempted sequence waits for its pending tokens' values)
            cached = self.block_manager.find_cached_prefix(seq)
            num_new = min(seq.num_tokens - len(cached) * self.block_manager.block_size, budget)
            if not self.block_manager.allocate(seq, num_new, cached):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append((seq, num_new))
            budget -= num_new
        return batch

    def _preempt(self, seq: Sequence) -> Sequence:
        """Preemption by recompute: drop seq's KV; readmitted, it re-prefills prompt + output so far."""
        self.running.remove(seq)
        self.block_manager.cache_full_blocks(seq)  # (its last step's tokens are all known by now)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        return seq

    def reached_length_limit(self, seq: Sequence) -> bool:
        return seq.num_completion_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len

    def launched(self, batch: ScheduledBatch):
        """The step is on its way to the GPU: its tokens count as computed, and every sequence whose
        computed tokens reach its end will get a sampled token, PENDING for now."""
        for seq, num_new in batch:
            seq.num_computed_tokens += num_new
            if not seq.num_pending:  # every computed token is known: its full blocks are findable now, so
                self.block_manager.cache_full_blocks(seq)  # a request admitted next step can hit them
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_pending()

    def update(self, batch: ScheduledBatch, sampling: list[Sequence], tokens: list[int],
               logprobs: list | None = None) -> list[Sequence]:
        """A launched step's results are back: `tokens` (and logprobs) for its `sampling` sequences, those
        that got a PENDING token in launched(). Returns those still unfinished, for the stop checks."""
        got_token = []
        for i, (seq, token) in enumerate(zip(sampling, tokens)):
            if seq.status != SequenceStatus.FINISHED:  # finished meanwhile: the extra token is dropped
                seq.resolve_pending(token, logprobs[i] if logprobs is not None else None)
                got_token.append(seq)
        for seq, _ in batch:  # blocks completed by a decode of a then-pending token become findable
            if seq.status == SequenceStatus.RUNNING:
                self.block_manager.cache_full_blocks(seq)
        return got_token

    def finish(self, seq: Sequence, reason: str):
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        else:  # preempted while its last token was pending: it holds no blocks
            self.waiting.remove(seq)
        seq.drop_pending()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort_all(self):
        """Free everything, e.g. after an interrupted generate, so the engine stays usable."""
        for seq in self.running + list(self.waiting):
            self.block_manager.free(seq)
            seq.status = SequenceStatus.FINISHED
        self.running.clear()
        self.waiting.clear()
