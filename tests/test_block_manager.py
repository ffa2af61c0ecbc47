"""Tests for the block manager: hypothesis drives it with random admissions, growth, preemptions, frees and
late read-backs of sampled tokens over a tiny pool, and after every operation the bookkeeping is checked
against a plain recount.

The trusted reference is a fake KV cache: a dict from physical slot to the token prefix whose K/V that
slot holds (K/V at position p depends on tokens[:p+1], nothing else). Every "compute" writes the prefix
of each new position into its slot, after checking that every earlier position of the sequence reads
back its own prefix. So a wrong prefix hit, a shared block that gets written, a block handed out while
still in use, or a stale block table all show up as a slot that holds someone else's prefix.
The prefix cache is one dict keyed by (parent's prefix id, block tokens); the tests below aim at what that
key must get right: equal blocks under different prefixes, prefix ids outliving their blocks, and the same
prefix computed twice at once. No model, no torch: the whole file runs in seconds.
"""

import copy
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nanoserve.block_manager import BlockManager
from nanoserve.sampling_params import SamplingParams
from nanoserve.sequence import PENDING, Sequence

PARAMS = SamplingParams(max_tokens=1, ignore_eos=True)  # the block manager never reads them
SMALL_VOCAB = 3  # few distinct tokens, so random prompts share prefixes and hits happen


# ---- the fake KV cache --------------------------------------------------------------------------
def slot(bm: BlockManager, seq: Sequence, pos: int) -> int:
    return seq.block_table[pos // bm.block_size] * bm.block_size + pos % bm.block_size


def check_kv_reads(bm: BlockManager, kv: dict, seq: Sequence, end: int, tokens: list[int] | None = None):
    """Positions [0, end) of seq must read back exactly their own token prefix (tokens: seq's token values,
    pending ones included, when some are not on the host yet)."""
    tokens = seq.token_ids if tokens is None else tokens
    for p in range(end):
        got = kv.get(slot(bm, seq, p))
        assert got == tuple(tokens[: p + 1]), (
            f"seq {seq.seq_id} position {p} reads K/V of {got}, expected its prefix {tuple(tokens[: p + 1])}"
        )


def compute(bm: BlockManager, kv: dict, seq: Sequence, num_new: int, tokens: list[int] | None = None):
    """What a model step does to the cache: read the computed prefix, write num_new new positions;
    and what the scheduler books with it: advance num_computed_tokens and make full blocks findable."""
    tokens = seq.token_ids if tokens is None else tokens
    start = seq.num_computed_tokens
    assert len(seq.block_table) * bm.block_size >= start + num_new, "allocate left no room to write"
    check_kv_reads(bm, kv, seq, start, tokens)
    for p in range(start, start + num_new):
        block_id = seq.block_table[p // bm.block_size]
        assert bm.blocks[block_id].ref_count == 1, (
            f"seq {seq.seq_id} writes position {p} into block {block_id}, "
            f"shared by {bm.blocks[block_id].ref_count} sequences"
        )
        kv[slot(bm, seq, p)] = tuple(tokens[: p + 1])
    seq.num_computed_tokens += num_new
    bm.cache_full_blocks(seq)


def snapshot(bm: BlockManager, seq: Sequence):
    return (
        copy.deepcopy(bm.blocks),
        list(bm.free_ids),
        dict(bm.cached),
        bm.prefix_hit_tokens,
        bm.prefix_queried_tokens,
        bm.num_allocated,
        bm.num_hit_blocks,
        bm.peak_used_blocks,
        list(bm.block_copies),
        list(seq.block_table),
        seq.num_computed_tokens,
        seq.num_cached_tokens,
    )


# ---- the state machine --------------------------------------------------------------------------
class BlockManagerMachine(RuleBasedStateMachine):
    """Sequences are created (waiting), admitted with their cached prefix, grown chunk by chunk (a
    sampled token is appended once all tokens are computed, PENDING until read back, as the scheduler
    books it; up to two pending, as with an overlapped loop), read back (the oldest pending token gets
    its value and the blocks it completes become findable, as Scheduler.update does), preempted (freed,
    back to waiting with their tokens, to be readmitted once nothing is pending and maybe hit their own
    blocks) or finished (freed for good). And forked, as beam search does: the child shares every block of
    its parent, full or not, and may change its last token (known, K/V not computed yet) to another value; the
    first of them to write into a shared partial block gets a copy of it (the copies are made in the fake KV cache,
    as a step would make them on the device), and compute() checks that no shared block is ever written."""

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(1, 12),
        prefix_caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, block_size, num_blocks, prefix_caching):
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.kv: dict[int, tuple] = {}
        self.live: list[Sequence] = []  # hold blocks
        self.waiting: list[Sequence] = []  # hold none: new, or preempted
        self.seen: list[Sequence] = []  # every sequence so far
        self.on_device: dict[int, list[int]] = {}  # seq_id -> values of its pending tokens, oldest first
        self.named: dict[int, tuple] = {}  # prefix_id -> the token prefix it named, over the whole run
        self.hit_tokens = self.queried_tokens = self.hit_blocks = self.allocated = 0

    def true_tokens(self, seq: Sequence) -> list[int]:
        """What the device sees: seq's tokens with the pending ones' values filled in."""
        return seq.token_ids[: seq.num_known_tokens] + self.on_device.get(seq.seq_id, [])

    # ---- operations -----------------------------------------------------------------------------
    @rule(
        tokens=st.lists(st.integers(0, SMALL_VOCAB - 1), min_size=1, max_size=14),
        base=st.integers(0, 99),
        shared=st.integers(0, 14),
    )
    def new_request(self, tokens, base, shared):
        """A new prompt, often starting with (part of) an earlier sequence's tokens, so hits happen."""
        if len(self.waiting) < 6:
            if self.seen and shared:
                earlier = self.seen[base % len(self.seen)]
                tokens = (earlier.token_ids[: min(shared, earlier.num_known_tokens)] + tokens)[:16]
            seq = Sequence(tokens, PARAMS, self.bm.block_size)
            self.waiting.append(seq)
            self.seen.append(seq)

    @precondition(lambda self: self.waiting)
    @rule(
        index=st.integers(0, 99),
        chunk=st.integers(1, 16),
        token=st.integers(0, SMALL_VOCAB - 1),
        read_now=st.booleans(),
    )
    def admit(self, index, chunk, token, read_now):
        seq = self.waiting[index % len(self.waiting)]
        if seq.num_pending:  # preempted before its last token was read back: it waits for the value
            return
        bs = self.bm.block_size
        cached = self.bm.find_cached_prefix(seq)
        if not self.bm.enable_prefix_caching:
            assert cached == []
        assert len(cached) * bs <= seq.num_tokens - 1, "a hit must leave the last token to compute"
        assert len(set(cached)) == len(cached)
        for i, block_id in enumerate(cached):  # a hit is a full, findable block with these tokens
            block = self.bm.blocks[block_id]
            assert block.key is not None and self.bm.cached[block.key] == block_id
            assert block.key[1] == seq.block_tokens(i)
        num_new = min(chunk, seq.num_tokens - len(cached) * bs)
        before = snapshot(self.bm, seq)
        first_admission = seq.num_cached_tokens is None
        if not self.bm.allocate(seq, num_new, cached):
            assert snapshot(self.bm, seq) == before, "a failed allocate changed state"
            return
        self.waiting.remove(seq)
        self.live.append(seq)
        if first_admission:  # a preempted sequence's readmission is recompute, not a new query
            self.hit_tokens += len(cached) * bs
            self.queried_tokens += seq.num_tokens
            assert seq.num_cached_tokens == len(cached) * bs
        self.hit_blocks += len(cached)
        self.allocated += len(seq.block_table) - len(cached) + self._make_copies()
        assert list(seq.block_table[: len(cached)]) == cached
        assert seq.num_computed_tokens == len(cached) * bs
        # the hit blocks must hold this sequence's own prefix, whole, not just matching tokens
        check_kv_reads(self.bm, self.kv, seq, seq.num_computed_tokens)
        self._compute(seq, num_new, token, read_now)

    @precondition(lambda self: self.live)
    @rule(
        index=st.integers(0, 99),
        chunk=st.integers(1, 16),
        token=st.integers(0, SMALL_VOCAB - 1),
        read_now=st.booleans(),
    )
    def grow(self, index, chunk, token, read_now):
        seq = self.live[index % len(self.live)]
        num_new = min(chunk, seq.num_uncomputed_tokens)
        if seq.num_computed_tokens + num_new == seq.num_tokens and seq.num_pending == 2:
            return  # a third pending token: the oldest is always read back before
        before = snapshot(self.bm, seq)
        num_blocks = len(seq.block_table)
        if not self.bm.allocate(seq, num_new):
            assert snapshot(self.bm, seq) == before, "a failed allocate changed state"
            return
        self.allocated += len(seq.block_table) - num_blocks + self._make_copies()
        self._compute(seq, num_new, token, read_now)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 99), token=st.integers(0, SMALL_VOCAB - 1), diverge=st.booleans())
    def fork(self, index, token, diverge):
        """Beam search's fork, of a sequence with no token pending (beam search forks after reading a step back):
        the child holds the parent's blocks, one more user each, nothing allocated; with diverge, the child's last
        token takes another value, as a beam's candidate does (only a token whose K/V is not computed yet)."""
        parent = self.live[index % len(self.live)]
        if parent.num_pending:
            return
        refs = Counter(parent.block_table)
        before = [self.bm.blocks[b].ref_count for b in parent.block_table]
        child = self.bm.fork(parent)
        assert child.seq_id != parent.seq_id and list(child.block_table) == list(parent.block_table)
        assert [self.bm.blocks[b].ref_count for b in parent.block_table] == [
            n + refs[b] for n, b in zip(before, parent.block_table, strict=True)
        ]
        assert child.token_ids == parent.token_ids and child.token_ids is not parent.token_ids
        self.live.append(child)
        self.seen.append(child)
        if diverge and child.num_uncomputed_tokens:
            child.token_ids[-1] = token

    def _make_copies(self) -> int:
        """The copy-on-write copies allocate booked, made in the fake KV cache (what the next step does first);
        returns how many blocks they took. Each copies one partial block into a fresh block only its writer holds,
        from a block that stays held by the others."""
        copies = self.bm.block_copies
        self.bm.block_copies = []
        bs = self.bm.block_size
        for source, destination in zip(copies[::2], copies[1::2], strict=True):
            assert self.bm.blocks[destination].ref_count == 1 and self.bm.blocks[source].ref_count >= 1
            assert self.bm.blocks[source].key is None, "a full (keyed) block is never copied: nobody writes it"
            for j in range(bs):
                if source * bs + j in self.kv:
                    self.kv[destination * bs + j] = self.kv[source * bs + j]
        return len(copies) // 2

    @precondition(lambda self: any(seq.num_pending for seq in self.live + self.waiting))
    @rule(index=st.integers(0, 99))
    def read_back(self, index):
        """The oldest pending token of a sequence (running or preempted) gets its value."""
        pending = [seq for seq in self.live + self.waiting if seq.num_pending]
        self._read_back(pending[index % len(pending)])

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 99))
    def preempt(self, index):
        seq = self.live.pop(index % len(self.live))
        self.bm.cache_full_blocks(seq)  # as a sequence's blocks are cached when booked, before a preemption frees them
        self.bm.free(seq)
        assert len(seq.block_table) == 0 and seq.num_computed_tokens == 0
        self.waiting.insert(0, seq)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 99))
    def finish(self, index):
        seq = self.live.pop(index % len(self.live))
        self.bm.free(seq)
        self.on_device.pop(seq.seq_id, None)

    def _compute(self, seq, num_new, token, read_now):
        compute(self.bm, self.kv, seq, num_new, self.true_tokens(seq))
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_pending()  # what a sampling step books
            self.on_device.setdefault(seq.seq_id, []).append(token)
            if read_now:  # the synchronous loop reads it back at once
                self._read_back(seq)
        assert seq.num_uncomputed_tokens >= 1

    def _read_back(self, seq):
        seq.resolve_pending(self.on_device[seq.seq_id].pop(0))
        if seq in self.live:
            self.bm.cache_full_blocks(seq)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in self.live:
            self.bm.free(seq)
        assert self.bm.num_used_blocks == 0
        assert all(b.ref_count == 0 for b in self.bm.blocks)
        assert sorted(self.bm.free_ids) == list(range(self.bm.num_blocks))

    # ---- invariants -----------------------------------------------------------------------------
    @invariant()
    def ref_counts_match_block_tables(self):
        if not hasattr(self, "bm"):
            return
        owners = Counter(b for seq in self.live for b in seq.block_table)
        for block in self.bm.blocks:
            assert block.ref_count >= 0
            assert block.ref_count == owners[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, held by {owners[block.block_id]} live sequences"
            )
            assert (block.ref_count == 0) == (block.block_id in self.bm.free_ids)
        assert self.bm.num_used_blocks + self.bm.num_free_blocks == self.bm.num_blocks
        assert len(self.bm.free_ids) == sum(b.ref_count == 0 for b in self.bm.blocks)

    @invariant()
    def block_tables_are_tight(self):
        if not hasattr(self, "bm"):
            return
        bs = self.bm.block_size
        for seq in self.live:
            assert len(set(seq.block_table)) == len(seq.block_table), "a block twice in one table"
            assert len(seq.block_table) == self.bm.blocks_needed(seq.num_computed_tokens)
            for i, block_id in enumerate(seq.block_table):  # keyed blocks are full, computed and known
                block = self.bm.blocks[block_id]
                if block.key is not None:
                    assert i < min(seq.num_computed_tokens, seq.num_known_tokens) // bs
                    assert block.key[1] == seq.block_tokens(i)
        for seq in self.waiting:
            assert len(seq.block_table) == 0 and seq.num_computed_tokens == 0

    @invariant()
    def findable_blocks_hold_their_tokens(self):
        """Every findable block holds K/V of one consistent prefix ending in its key's tokens, under the
        prefix its key's parent names; a prefix_id names the same token prefix for the whole run (so it is
        never reused); no key holds a token whose value was still on the device."""
        if not hasattr(self, "bm"):
            return
        bs = self.bm.block_size
        for block in self.bm.blocks:
            assert block.key is None or PENDING not in block.key[1], f"block {block.block_id} keyed on PENDING"
            if block.prefix_id is not None:
                content = self.kv[block.block_id * bs + bs - 1]
                assert self.named.setdefault(block.prefix_id, content) == content, (
                    f"prefix_id {block.prefix_id} names two different prefixes"
                )
        if not self.bm.enable_prefix_caching:
            assert not self.bm.cached
        for key, block_id in self.bm.cached.items():
            block = self.bm.blocks[block_id]
            assert block.key == key
            full = self.kv[block_id * bs + bs - 1]
            assert full[-bs:] == key[1]
            for j in range(bs):
                assert self.kv[block_id * bs + j] == full[: len(full) - bs + j + 1]
            parent_id = key[0]
            assert (parent_id is None) == (len(full) == bs)
            if parent_id is not None:
                assert self.named[parent_id] == full[:-bs], "a key under a parent that names another prefix"

    @invariant()
    def counters_match(self):
        if not hasattr(self, "bm"):
            return
        assert self.bm.prefix_hit_tokens == self.hit_tokens
        assert self.bm.prefix_queried_tokens == self.queried_tokens
        assert self.bm.num_hit_blocks == self.hit_blocks
        assert self.bm.num_allocated == self.allocated
        assert self.bm.count_cached_free_blocks() == sum(
            self.bm.cached.get(self.bm.blocks[b].key) == b for b in self.bm.free_ids
        )


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# ---- hits against a trusted reference -----------------------------------------------------------
def fully_computed(bm: BlockManager, kv: dict, tokens: list[int]) -> Sequence:
    seq = Sequence(tokens, PARAMS, bm.block_size)
    cached = bm.find_cached_prefix(seq)
    assert bm.allocate(seq, seq.num_tokens - len(cached) * bm.block_size, cached)
    compute(bm, kv, seq, seq.num_tokens - seq.num_computed_tokens)
    return seq


def common_full_blocks(a: list[int], b: list[int], block_size: int) -> int:
    """How many leading full blocks of a could serve b: equal tokens, and b's last token left to compute."""
    n = 0
    while (
        n < min(len(a) // block_size, (len(b) - 1) // block_size)
        and a[n * block_size : (n + 1) * block_size] == b[n * block_size : (n + 1) * block_size]
    ):
        n += 1
    return n


@settings(max_examples=200, deadline=None)
@given(
    first=st.lists(st.integers(0, 1), min_size=1, max_size=12),
    second=st.lists(st.integers(0, 1), min_size=1, max_size=12),
    block_size=st.sampled_from([1, 2, 3, 4]),
)
def test_hit_is_longest_common_full_block_prefix(first, second, block_size):
    """Guards against wrong hits (a matching block under a different parent taken as a match) and missed
    ones: with one cached sequence, the hit is exactly its leading full blocks that equal the new prompt's,
    capped so the new prompt's last token is computed."""
    bm = BlockManager(16, block_size)
    kv: dict[int, tuple] = {}
    cached_seq = fully_computed(bm, kv, first)
    new = Sequence(second, PARAMS, block_size)
    hit = bm.find_cached_prefix(new)
    assert hit == list(cached_seq.block_table[: common_full_blocks(first, second, block_size)])
    bm.free(cached_seq)  # freed blocks stay findable, with the same answer
    assert bm.find_cached_prefix(new) == hit


@settings(max_examples=100, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=10), min_size=2, max_size=6),
    block_size=st.sampled_from([1, 2, 3]),
)
def test_hits_over_many_cached_prompts_read_back_their_own_prefix(prompts, block_size):
    """Guards against a hit on K/V of other tokens, and against missed hits, when many cached blocks hold
    equal tokens under different prefixes: prompts over a two-token vocabulary are cached one after another
    (all kept alive); each admission's hit is as long as its longest common full-block prefix with any
    earlier prompt, and reads back its own prefix from the fake KV cache."""
    bm = BlockManager(64, block_size)
    kv: dict[int, tuple] = {}
    for n, tokens in enumerate(prompts):
        seq = Sequence(tokens, PARAMS, block_size)
        cached = bm.find_cached_prefix(seq)
        assert len(cached) == max((common_full_blocks(p, tokens, block_size) for p in prompts[:n]), default=0)
        assert bm.allocate(seq, seq.num_tokens - len(cached) * block_size, cached)
        check_kv_reads(bm, kv, seq, seq.num_computed_tokens)
        compute(bm, kv, seq, seq.num_uncomputed_tokens)


# ---- the dict key: (parent's prefix id, tokens) -------------------------------------------------
def test_equal_block_under_another_parent_is_not_hit():
    """Guards against a key that leaves out the parent (or a lookup that ignores it): [3,4] is cached after
    nothing and [5,6] after [1,2]; a prompt [3,4,5,6,...] hits its first block but not the [5,6] block, whose
    K/V belongs to the prefix [1,2,5,6]. Once computed, its own [5,6] block is a second entry with the same
    tokens, and each prefix finds its own."""
    bm = BlockManager(16, 2)
    kv: dict[int, tuple] = {}
    a = fully_computed(bm, kv, [1, 2, 5, 6, 9])
    c = fully_computed(bm, kv, [3, 4, 7, 7, 9])
    b = Sequence([3, 4, 5, 6, 9], PARAMS, 2)
    cached = bm.find_cached_prefix(b)
    assert cached == [c.block_table[0]]
    assert bm.allocate(b, 3, cached)
    check_kv_reads(bm, kv, b, 2)
    compute(bm, kv, b, 3)
    assert b.block_table[1] != a.block_table[1]
    assert [tokens for _, tokens in bm.cached].count((5, 6)) == 2
    expected = {(1, 2, 5, 6): list(a.block_table[:2]), (3, 4, 5, 6): list(b.block_table[:2])}
    for seq in (a, b, c):
        bm.free(seq)
    for prefix, blocks in expected.items():  # freed, each prefix still finds its own [5, 6]
        probe = Sequence(list(prefix) + [0], PARAMS, 2)
        assert bm.find_cached_prefix(probe) == blocks
        assert bm.allocate(probe, 1, blocks)
        check_kv_reads(bm, kv, probe, 4)
        bm.free(probe)


def test_child_of_an_evicted_parent_is_never_hit():
    """Guards against prefix ids that get reused (say, a block's id as its prefix id): a child's key outlives
    its parent's eviction when the child is held by a twin (see below), and when the parent's block id is
    reused for other content, a prompt with that content followed by the child's tokens must not find the
    child, whose K/V belongs to the old prefix; a prompt with the old prefix must not reach it either."""
    bm = BlockManager(4, 2)
    kv: dict[int, tuple] = {}
    x = Sequence([1, 2], PARAMS, 2)  # X and Y compute [1, 2] in the same step: X's block owns the key
    y = Sequence([1, 2, 3, 4, 9], PARAMS, 2)
    assert bm.allocate(x, 2) and bm.allocate(y, 5)
    compute(bm, kv, x, 2)
    compute(bm, kv, y, 5)
    parent, (y_head, child, y_tail) = x.block_table[0], y.block_table
    assert bm.cached[(None, (1, 2))] == parent
    child_key = bm.blocks[child].key
    assert child_key == (bm.blocks[parent].prefix_id, (3, 4)) and bm.cached[child_key] == child
    bm.free(x)
    bm.free(y)  # free, oldest first: X's block, Y's tail, Y's child, Y's head
    assert list(bm.free_ids) == [parent, y_tail, child, y_head]
    z = fully_computed(bm, kv, [5, 5, 9])  # evicts the parent, then reuses its block id for [5, 5]
    assert z.block_table[0] == parent and (None, (1, 2)) not in bm.cached
    assert bm.cached[child_key] == child  # the child is orphaned, still in the dict
    w = Sequence([5, 5, 3, 4, 9], PARAMS, 2)
    assert bm.find_cached_prefix(w) == [parent]  # [5, 5] hit; [3, 4] after it is not the orphan
    assert bm.find_cached_prefix(Sequence([1, 2, 3, 4, 9], PARAMS, 2)) == []
    bm.free(z)
    v = fully_computed(bm, kv, [1, 2, 3, 4, 8])  # recomputes [1, 2], then [3, 4] under a new prefix id
    assert child_key not in bm.cached  # (the orphan's block was evicted for it)
    assert bm.find_cached_prefix(Sequence([1, 2, 3, 4, 7], PARAMS, 2)) == list(v.block_table[:2])
    bm.free(v)


def test_a_restored_block_keeps_its_prefix_name_and_its_children():
    """Guards against a block that comes back from outside the pool (a KV connector's host tier) getting a new
    prefix id: its children, still cached on the device under the old one, would never be found after it. A prompt
    of three full blocks is cached and freed, its first block evicted (on_evict sees its key and prefix id) and
    restored into another block under them: the prompt then hits all three, reading back its own prefix; without
    the restore (the block keyed anew when computed) it would hit the first only."""
    bm = BlockManager(6, 2)
    kv: dict[int, tuple] = {}
    evicted = []
    bm.on_evict = lambda block: evicted.append((block.block_id, block.key, block.prefix_id))
    a = fully_computed(bm, kv, [1, 2, 3, 4, 5, 6, 7])
    head, middle, tail = a.block_table[:3]
    bm.free(a)
    bm.free_ids.move_to_end(head, last=False)  # the head is the next block taken for new K/V
    saved_kv = [kv[head * 2], kv[head * 2 + 1]]  # its K/V, copied outside the pool
    other = fully_computed(bm, kv, [8])  # evicts the head, and writes other K/V into it
    assert evicted == [(head, (None, (1, 2)), evicted[0][2])] and (None, (1, 2)) not in bm.cached
    b = Sequence([1, 2, 3, 4, 5, 6, 9], PARAMS, 2)
    assert bm.find_cached_prefix(b) == []
    assert bm.allocate(b, 2)  # a fresh block for the first one, filled from outside
    restored = b.block_table[0]
    kv[restored * 2], kv[restored * 2 + 1] = saved_kv
    _, key, prefix_id = evicted[0]
    bm.restore(restored, key, prefix_id)
    b.num_computed_tokens = 2  # booked as computed, as the scheduler does for a connector's blocks
    probe = Sequence([1, 2, 3, 4, 5, 6, 0], PARAMS, 2)
    assert bm.find_cached_prefix(probe) == [restored, middle, tail]
    assert bm.allocate(probe, 1, [restored, middle, tail])
    check_kv_reads(bm, kv, probe, 6)
    for seq in (other, b, probe):
        bm.free(seq)


@pytest.mark.parametrize("freed_first", ["owner", "twin"])
def test_twins_share_one_entry_that_only_the_owner_removes(freed_first):
    """Guards against the same prefix computed twice in one step (twins, admitted before either was cached)
    making two entries, two names for one prefix, or an entry that the non-owner's eviction deletes: the
    first to be cached owns each key and the twin's blocks carry the same keys and prefix ids; evicting the
    twin's blocks never removes an entry (the owner's, or a later owner's of the same key), while evicting
    the owner's does."""
    bm = BlockManager(7, 2)
    kv: dict[int, tuple] = {}
    owner, twin = Sequence([1, 2, 3, 4, 9], PARAMS, 2), Sequence([1, 2, 3, 4, 8], PARAMS, 2)
    assert bm.allocate(owner, 5) and bm.allocate(twin, 5)
    compute(bm, kv, owner, 5)
    compute(bm, kv, twin, 5)
    owner_blocks, twin_blocks = list(owner.block_table[:2]), list(twin.block_table[:2])
    assert not set(owner_blocks) & set(twin_blocks)
    assert sorted(bm.cached.values()) == sorted(owner_blocks) and len(bm.cached) == 2
    for o, t in zip(owner_blocks, twin_blocks, strict=False):
        assert bm.blocks[o].key == bm.blocks[t].key and bm.blocks[o].prefix_id == bm.blocks[t].prefix_id
    probe = Sequence([1, 2, 3, 4, 0], PARAMS, 2)
    first, second = (owner, twin) if freed_first == "owner" else (twin, owner)
    bm.free(first)
    fill = fully_computed(bm, kv, [6] * 7)  # 4 blocks: the never-used one and the 3 just freed
    assert bm.num_free_blocks == 0
    assert bm.find_cached_prefix(probe) == (owner_blocks if first is twin else [])
    bm.free(fill)
    bm.free(second)
    again = fully_computed(bm, kv, [1, 2, 3, 4, 5])  # a hit on the owner's blocks, or a new owner
    if first is twin:
        assert list(again.block_table[:2]) == owner_blocks
    fill = fully_computed(bm, kv, [7] * (2 * bm.num_free_blocks - 1))  # evicts every other block
    assert bm.num_free_blocks == 0
    assert bm.find_cached_prefix(probe) == list(again.block_table[:2])
    bm.free(fill)
    bm.free(again)
    assert bm.num_used_blocks == 0


def test_block_completed_by_a_pending_token_is_cached_once_read_back():
    """Guards against keying a block on a token whose value is still on the device (PENDING), or caching
    it only up to the computed tokens: a block completed by a decode of a pending token becomes findable,
    keyed on the token's real value, only once that value is read back."""
    bm = BlockManager(8, 2)
    kv: dict[int, tuple] = {}
    seq = fully_computed(bm, kv, [1, 2, 3])
    seq.append_pending()  # sampled: [1, 2, 3, ?]
    assert bm.allocate(seq, 1)
    compute(bm, kv, seq, 1, [1, 2, 3, 4])  # the next step decodes the pending token (value 4 on the device)
    assert bm.blocks[seq.block_table[1]].key is None and len(bm.cached) == 1
    seq.resolve_pending(4)
    bm.cache_full_blocks(seq)
    assert bm.blocks[seq.block_table[1]].key == (bm.blocks[seq.block_table[0]].prefix_id, (3, 4))
    assert bm.find_cached_prefix(Sequence([1, 2, 3, 4, 0], PARAMS, 2)) == list(seq.block_table[:2])
    bm.free(seq)


# ---- plain unit tests ---------------------------------------------------------------------------
def test_fork_shares_every_block_and_the_first_writer_copies_the_partial_one():
    """Guards against a fork that copies blocks at once, or shares without counting, and against copy-on-write that
    copies more than one block, copies for the last holder too, or writes into the shared block: parent [1, 2, 3, 4]
    in blocks of 2 (one full, one partial block after the sampled 4); the child takes 5 instead of 4. The child
    writes first: it gets a copy of the partial block; the parent then writes in place; each reads its own
    prefix, and the pool is balanced after both are freed."""
    bm = BlockManager(6, 2)
    kv: dict[int, tuple] = {}
    parent = fully_computed(bm, kv, [1, 2, 3])
    parent.append_pending()
    parent.resolve_pending(4)  # [1, 2, 3, 4]: 4 not computed yet
    full, partial = parent.block_table
    child = bm.fork(parent)
    child.token_ids[-1] = 5
    assert list(child.block_table) == [full, partial] and bm.num_used_blocks == 2
    assert bm.blocks[full].ref_count == bm.blocks[partial].ref_count == 2
    assert bm.allocate(child, 1)
    assert child.block_table[0] == full and child.block_table[1] != partial
    assert bm.block_copies == [partial, child.block_table[1]]
    for j in range(2):  # what the step does first, on the device
        kv[child.block_table[1] * 2 + j] = kv.get(partial * 2 + j)
    bm.block_copies = []
    compute(bm, kv, child, 1)
    assert bm.allocate(parent, 1) and bm.block_copies == []  # the last holder writes in place
    assert list(parent.block_table) == [full, partial]
    compute(bm, kv, parent, 1)
    check_kv_reads(bm, kv, parent, 4)
    check_kv_reads(bm, kv, child, 4)
    assert bm.blocks[full].ref_count == 2 and bm.num_used_blocks == 3
    bm.free(parent)
    assert bm.blocks[full].ref_count == 1 and full not in bm.free_ids  # still the child's
    bm.free(child)
    assert bm.num_used_blocks == 0 and all(b.ref_count == 0 for b in bm.blocks)


def test_lru_evicts_least_recently_freed_prefix_first():
    """Guards against evicting in the wrong order: of two cached prefixes, the one freed earlier goes
    first, so the one freed later survives; and a hit that revives a block makes it recent again."""
    bm = BlockManager(4, 2)
    kv: dict[int, tuple] = {}
    a = fully_computed(bm, kv, [1, 2, 9])  # block [1, 2] full and cached, [9] partial
    b = fully_computed(bm, kv, [3, 4, 9])
    bm.free(a)
    bm.free(b)
    probe_a, probe_b = Sequence([1, 2, 0], PARAMS, 2), Sequence([3, 4, 0], PARAMS, 2)
    a_head, b_head = bm.find_cached_prefix(probe_a), bm.find_cached_prefix(probe_b)
    assert len(a_head) == len(b_head) == 1 and bm.count_cached_free_blocks() == 2
    # 3 fresh blocks, least recently freed first: a's tail, a's head, b's tail
    c = fully_computed(bm, kv, [7, 7, 7, 7, 7])
    assert bm.find_cached_prefix(probe_a) == []
    assert bm.find_cached_prefix(probe_b) == b_head
    bm.free(c)

    # revival: b's head is hit and freed again after c's blocks, so c's go first now
    d = fully_computed(bm, kv, [3, 4, 5])
    assert d.block_table[0] == b_head[0]
    bm.free(d)
    e = fully_computed(bm, kv, [8, 8, 8, 8, 8])  # c's two freed blocks, d's tail; b's head stays
    assert bm.find_cached_prefix(probe_b) == b_head
    bm.free(e)


def test_freed_prompt_is_hit_again():
    """Guards against free() dropping keys: a request with the same prompt as a finished one reuses
    its full blocks (all but the block holding the last token) and its K/V reads back right."""
    bm = BlockManager(8, 4)
    kv: dict[int, tuple] = {}
    prompt = list(range(10))
    first = fully_computed(bm, kv, prompt)
    table = list(first.block_table)
    bm.free(first)
    assert bm.num_used_blocks == 0 and bm.count_cached_free_blocks() == 2
    again = Sequence(prompt, PARAMS, 4)
    cached = bm.find_cached_prefix(again)
    assert cached == table[:2]
    assert bm.allocate(again, 2, cached)
    assert again.num_computed_tokens == again.num_cached_tokens == 8
    check_kv_reads(bm, kv, again, 8)
    compute(bm, kv, again, 2)


@pytest.mark.parametrize("block_size", [1, 4])
def test_fully_cached_prompt_leaves_last_token_to_compute(block_size):
    """Guards against a prompt that is an exact multiple of the block size and fully cached being
    admitted with nothing to compute (no logits, so no first token): its last block is recomputed
    into a fresh block, never written into the shared cached one."""
    bm = BlockManager(16, block_size)
    kv: dict[int, tuple] = {}
    prompt = [5, 6, 7, 8] * 2
    first = fully_computed(bm, kv, prompt)
    second = Sequence(prompt, PARAMS, block_size)
    cached = bm.find_cached_prefix(second)
    assert len(cached) * block_size == len(prompt) - block_size
    assert cached == list(first.block_table[: len(cached)])
    assert bm.allocate(second, len(prompt) - len(cached) * block_size, cached)
    assert second.num_uncomputed_tokens == block_size >= 1
    assert second.block_table[-1] not in first.block_table
    compute(bm, kv, second, second.num_uncomputed_tokens)


def test_prefix_counters():
    """Guards against miscounted hit rates and block counters: queried counts every admitted prompt token,
    hit counts only tokens served from the cache, num_hit_blocks the blocks reused, num_allocated the fresh
    blocks handed out; a failed admission counts nothing."""
    bm = BlockManager(6, 4)
    kv: dict[int, tuple] = {}
    a = fully_computed(bm, kv, list(range(12)))  # 12 queried, 0 hit; 3 fresh blocks
    assert (bm.prefix_hit_tokens, bm.prefix_queried_tokens) == (0, 12)
    assert (bm.num_hit_blocks, bm.num_allocated) == (0, 3)
    b = fully_computed(bm, kv, list(range(8)) + [99])  # 9 queried, 8 hit; 2 hit blocks, 1 fresh
    assert (bm.prefix_hit_tokens, bm.prefix_queried_tokens) == (8, 21)
    assert (bm.num_hit_blocks, bm.num_allocated) == (2, 4)
    big = Sequence(list(range(8)) + [50] * 20, PARAMS, 4)  # hits 2 blocks, needs 5 more: only 2 free
    cached = bm.find_cached_prefix(big)
    assert len(cached) == 2
    assert not bm.allocate(big, big.num_tokens - 8, cached)
    assert (bm.prefix_hit_tokens, bm.prefix_queried_tokens) == (8, 21)
    assert (bm.num_hit_blocks, bm.num_allocated) == (2, 4)
    bm.free(a)
    bm.free(b)


def test_failed_admission_with_revived_hit_changes_nothing():
    """Guards against a failed allocate that half-revived cached blocks: hit blocks sitting in the
    free list count against the free blocks, and on failure they stay free and findable."""
    bm = BlockManager(4, 2)
    kv: dict[int, tuple] = {}
    a = fully_computed(bm, kv, [1, 2, 3, 4, 5])  # 3 blocks, two full
    bm.free(a)
    hog = fully_computed(bm, kv, [9])  # takes the one never-used block
    seq = Sequence([1, 2, 3, 4, 6, 6, 6], PARAMS, 2)
    cached = bm.find_cached_prefix(seq)
    assert len(cached) == 2
    before = snapshot(bm, seq)
    assert not bm.allocate(seq, 3, cached)  # 2 revived + 2 fresh > 3 free
    assert snapshot(bm, seq) == before
    assert bm.find_cached_prefix(seq) == cached
    assert bm.allocate(seq, 1, cached)  # 2 revived + 1 fresh fits
    check_kv_reads(bm, kv, seq, 4)
    compute(bm, kv, seq, 1)
    bm.free(seq)
    bm.free(hog)
    assert bm.num_used_blocks == 0
