"""Tests for the block manager: hypothesis drives it with random admissions, growth, preemptions and
frees over a tiny pool, and after every operation the bookkeeping is checked against a plain recount.

The trusted reference is a fake KV cache: a dict from physical slot to the token prefix whose K/V that
slot holds (K/V at position p depends on tokens[:p+1], nothing else). Every "compute" writes the prefix
of each new position into its slot, after checking that every earlier position of the sequence reads
back its own prefix. So a wrong prefix hit, a shared block that gets written, a block handed out while
still in use, or a stale block table all show up as a slot that holds someone else's prefix.
No model, no torch: the whole file runs in seconds.
"""
import copy
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from nanoserve.block_manager import BlockManager, hash_block
from nanoserve.sampling_params import SamplingParams
from nanoserve.sequence import Sequence

PARAMS = SamplingParams(max_tokens=1, ignore_eos=True)  # the block manager never reads them
SMALL_VOCAB = 3  # few distinct tokens, so random prompts share prefixes and hits happen
HASH_FNS = {
    "chained": hash_block,
    "all_collide": lambda parent, tokens: 0,                 # every block lands on one key
    "two_buckets": lambda parent, tokens: hash(tokens) % 2,  # ignores the parent: chains collide
}


# ---- the fake KV cache --------------------------------------------------------------------------
def slot(bm: BlockManager, seq: Sequence, pos: int) -> int:
    return seq.block_table[pos // bm.block_size] * bm.block_size + pos % bm.block_size


def check_kv_reads(bm: BlockManager, kv: dict, seq: Sequence, end: int):
    """Positions [0, end) of seq must read back exactly their own token prefix."""
    for p in range(end):
        got = kv.get(slot(bm, seq, p))
        assert got == tuple(seq.token_ids[:p + 1]), (
            f"seq {seq.seq_id} position {p} reads K/V of {got}, expected its prefix "
            f"{tuple(seq.token_ids[:p + 1])}")


def compute(bm: BlockManager, kv: dict, seq: Sequence, num_new: int):
    """What a model step does to the cache: read the computed prefix, write num_new new positions,
    then what Scheduler.update does: advance num_computed_tokens and publish full blocks."""
    start = seq.num_computed_tokens
    assert len(seq.block_table) * bm.block_size >= start + num_new, "allocate left no room to write"
    check_kv_reads(bm, kv, seq, start)
    for p in range(start, start + num_new):
        block_id = seq.block_table[p // bm.block_size]
        assert bm.blocks[block_id].ref_count == 1, (
            f"seq {seq.seq_id} writes position {p} into block {block_id}, "
            f"shared by {bm.blocks[block_id].ref_count} sequences")
        kv[slot(bm, seq, p)] = tuple(seq.token_ids[:p + 1])
    seq.num_computed_tokens += num_new
    bm.cache_full_blocks(seq)


def snapshot(bm: BlockManager, seq: Sequence):
    return (copy.deepcopy(bm.blocks), list(bm.free_ids), dict(bm.hash_to_block),
            bm.prefix_hit_tokens, bm.prefix_queried_tokens,
            list(seq.block_table), seq.num_computed_tokens, seq.num_cached_tokens)


# ---- the state machine --------------------------------------------------------------------------
class BlockManagerMachine(RuleBasedStateMachine):
    """Sequences are created (waiting), admitted with their cached prefix, grown chunk by chunk (a
    sampled token is appended once all known tokens are computed, as Scheduler.update does), preempted
    (freed, back to waiting with their tokens, to be readmitted and maybe hit their own blocks) or
    finished (freed for good)."""

    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 12),
                hash_name=st.sampled_from(sorted(HASH_FNS)),
                prefix_caching=st.sampled_from([True, True, True, False]))
    def setup(self, block_size, num_blocks, hash_name, prefix_caching):
        self.bm = BlockManager(num_blocks, block_size, prefix_caching, hash_fn=HASH_FNS[hash_name])
        self.kv: dict[int, tuple] = {}
        self.live: list[Sequence] = []     # hold blocks
        self.waiting: list[Sequence] = []  # hold none: new, or preempted
        self.hit_tokens = self.queried_tokens = 0

    # ---- operations -----------------------------------------------------------------------------
    @rule(tokens=st.lists(st.integers(0, SMALL_VOCAB - 1), min_size=1, max_size=14))
    def new_request(self, tokens):
        if len(self.waiting) < 6:
            self.waiting.append(Sequence(tokens, PARAMS, self.bm.block_size))

    @rule(index=st.integers(0, 99), chunk=st.integers(1, 16), token=st.integers(0, SMALL_VOCAB - 1))
    def admit(self, index, chunk, token):
        if not self.waiting:
            return
        seq = self.waiting[index % len(self.waiting)]
        bs = self.bm.block_size
        cached = self.bm.find_cached_prefix(seq)
        if not self.bm.enable_prefix_caching:
            assert cached == []
        assert len(cached) * bs <= seq.num_tokens - 1, "a hit must leave the last token to compute"
        assert len(set(cached)) == len(cached)
        for i, block_id in enumerate(cached):  # a hit is a full, published block with these tokens
            block = self.bm.blocks[block_id]
            assert block.hash is not None and block.key[1] == seq.block_tokens(i)
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
        assert list(seq.block_table[:len(cached)]) == cached
        assert seq.num_computed_tokens == len(cached) * bs
        # the hit blocks must hold this sequence's own prefix, whole, not just matching tokens
        check_kv_reads(self.bm, self.kv, seq, seq.num_computed_tokens)
        self._compute(seq, num_new, token)

    @rule(index=st.integers(0, 99), chunk=st.integers(1, 16), token=st.integers(0, SMALL_VOCAB - 1))
    def grow(self, index, chunk, token):
        if not self.live:
            return
        seq = self.live[index % len(self.live)]
        num_new = min(chunk, seq.num_uncomputed_tokens)
        before = snapshot(self.bm, seq)
        if not self.bm.allocate(seq, num_new):
            assert snapshot(self.bm, seq) == before, "a failed allocate changed state"
            return
        self._compute(seq, num_new, token)

    @rule(index=st.integers(0, 99))
    def preempt(self, index):
        seq = self._free_live(index)
        if seq is not None:
            assert len(seq.block_table) == 0 and seq.num_computed_tokens == 0
            self.waiting.insert(0, seq)

    @rule(index=st.integers(0, 99))
    def finish(self, index):
        self._free_live(index)

    def _free_live(self, index):
        """Take a running sequence out and free its blocks (None when none runs)."""
        if not self.live:
            return None
        seq = self.live.pop(index % len(self.live))
        self.bm.free(seq)
        return seq

    def _compute(self, seq, num_new, token):
        compute(self.bm, self.kv, seq, num_new)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_pending()  # what a sampled token does, once read back
            seq.resolve_pending(token)
        assert seq.num_uncomputed_tokens >= 1

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
                f"block {block.block_id}: ref_count {block.ref_count}, "
                f"held by {owners[block.block_id]} live sequences")
            assert (block.ref_count == 0) == (block.block_id in self.bm.free_ids)
        assert self.bm.num_used_blocks + self.bm.num_free_blocks == self.bm.num_blocks
        assert len(self.bm.free_ids) == sum(b.ref_count == 0 for b in self.bm.blocks)

    @invariant()
    def block_tables_are_tight(self):
        if not hasattr(self, "bm"):
            return
        for seq in self.live:
            assert len(set(seq.block_table)) == len(seq.block_table), "a block twice in one table"
            assert len(seq.block_table) == self.bm.blocks_needed(seq.num_computed_tokens)
            for i, block_id in enumerate(seq.block_table):  # hashed blocks are full and computed
                block = self.bm.blocks[block_id]
                if block.hash is not None:
                    assert i < seq.num_computed_tokens // self.bm.block_size
                    assert block.key[1] == seq.block_tokens(i)
        for seq in self.waiting:
            assert len(seq.block_table) == 0 and seq.num_computed_tokens == 0

    @invariant()
    def published_blocks_hold_their_tokens(self):
        """Every findable block holds K/V of one consistent prefix ending in its key's tokens, and a
        prefix_id always names the same token prefix."""
        if not hasattr(self, "bm"):
            return
        bs = self.bm.block_size
        for h, block_id in self.bm.hash_to_block.items():
            block = self.bm.blocks[block_id]
            assert block.hash == h
            full = self.kv[block_id * bs + bs - 1]
            assert full[-bs:] == block.key[1]
            for j in range(bs):
                assert self.kv[block_id * bs + j] == full[:len(full) - bs + j + 1]
        named: dict[int, tuple] = {}
        for block in self.bm.blocks:
            if block.prefix_id is not None:
                content = self.kv[block.block_id * bs + bs - 1]
                assert named.setdefault(block.prefix_id, content) == content, (
                    f"prefix_id {block.prefix_id} names two different prefixes")

    @invariant()
    def counters_match(self):
        if not hasattr(self, "bm"):
            return
        assert self.bm.prefix_hit_tokens == self.hit_tokens
        assert self.bm.prefix_queried_tokens == self.queried_tokens


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])


# ---- hits against a trusted reference -----------------------------------------------------------
def fully_computed(bm: BlockManager, kv: dict, tokens: list[int]) -> Sequence:
    seq = Sequence(tokens, PARAMS, bm.block_size)
    cached = bm.find_cached_prefix(seq)
    assert bm.allocate(seq, seq.num_tokens - len(cached) * bm.block_size, cached)
    compute(bm, kv, seq, seq.num_tokens - seq.num_computed_tokens)
    return seq


@settings(max_examples=200, deadline=None)
@given(first=st.lists(st.integers(0, 1), min_size=1, max_size=12),
       second=st.lists(st.integers(0, 1), min_size=1, max_size=12),
       block_size=st.sampled_from([1, 2, 3, 4]), hash_name=st.sampled_from(sorted(HASH_FNS)))
def test_hit_is_longest_common_full_block_prefix(first, second, block_size, hash_name):
    """Guards against wrong hits (a hash collision, or a matching block under a different parent,
    taken as a match) and missed ones: with one cached sequence, the hit is exactly its leading full
    blocks that equal the new prompt's, capped so the new prompt's last token is computed."""
    bm = BlockManager(16, block_size, hash_fn=HASH_FNS[hash_name])
    kv: dict[int, tuple] = {}
    cached_seq = fully_computed(bm, kv, first)
    new = Sequence(second, PARAMS, block_size)
    expected = 0
    while (expected < min(len(first) // block_size, (len(second) - 1) // block_size)
           and new.block_tokens(expected) == cached_seq.block_tokens(expected)):
        expected += 1
    hit = bm.find_cached_prefix(new)
    if hash_name == "chained":
        assert hit == list(cached_seq.block_table[:expected])
    else:  # a colliding hash_fn may lose hits (the first block on a key keeps it), never invent one
        assert len(hit) <= expected and hit == list(cached_seq.block_table[:len(hit)])
    bm.free(cached_seq)  # freed blocks stay findable, with the same answer
    assert bm.find_cached_prefix(new) == hit


@settings(max_examples=100, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=10), min_size=2, max_size=6),
       hash_name=st.sampled_from(sorted(HASH_FNS)))
def test_colliding_hashes_never_give_wrong_kv(prompts, hash_name):
    """Guards against a hash collision handing back K/V of other tokens: prompts over a two-token
    vocabulary are cached one after another (all kept alive), and each admission's hit must read
    back its own prefix from the fake KV cache."""
    bm = BlockManager(64, 2, hash_fn=HASH_FNS[hash_name])
    kv: dict[int, tuple] = {}
    for tokens in prompts:
        seq = Sequence(tokens, PARAMS, 2)
        cached = bm.find_cached_prefix(seq)
        assert bm.allocate(seq, seq.num_tokens - len(cached) * 2, cached)
        check_kv_reads(bm, kv, seq, seq.num_computed_tokens)
        compute(bm, kv, seq, seq.num_uncomputed_tokens)


# ---- plain unit tests ---------------------------------------------------------------------------
def test_lru_evicts_least_recently_freed_prefix_first():
    """Guards against evicting in the wrong order: of two cached prefixes, the one freed earlier goes
    first, so the one freed later survives; and a hit that revives a block makes it recent again."""
    bm = BlockManager(4, 2)
    kv: dict[int, tuple] = {}
    a = fully_computed(bm, kv, [1, 2, 9])   # block [1, 2] full and cached, [9] partial
    b = fully_computed(bm, kv, [3, 4, 9])
    bm.free(a)
    bm.free(b)
    probe_a, probe_b = Sequence([1, 2, 0], PARAMS, 2), Sequence([3, 4, 0], PARAMS, 2)
    a_head, b_head = bm.find_cached_prefix(probe_a), bm.find_cached_prefix(probe_b)
    assert len(a_head) == len(b_head) == 1 and bm.num_cached_blocks == 2
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
    """Guards against free() dropping hashes: a request with the same prompt as a finished one reuses
    its full blocks (all but the block holding the last token) and its K/V reads back right."""
    bm = BlockManager(8, 4)
    kv: dict[int, tuple] = {}
    prompt = list(range(10))
    first = fully_computed(bm, kv, prompt)
    table = list(first.block_table)
    bm.free(first)
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 2
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
    assert cached == list(first.block_table[:len(cached)])
    assert bm.allocate(second, len(prompt) - len(cached) * block_size, cached)
    assert second.num_uncomputed_tokens == block_size >= 1
    assert second.block_table[-1] not in first.block_table
    compute(bm, kv, second, second.num_uncomputed_tokens)


def test_prefix_counters():
    """Guards against miscounted hit rates: queried counts every admitted prompt token, hit counts
    only tokens served from the cache, and a failed admission counts nothing."""
    bm = BlockManager(6, 4)
    kv: dict[int, tuple] = {}
    a = fully_computed(bm, kv, list(range(12)))          # 12 queried, 0 hit
    assert (bm.prefix_hit_tokens, bm.prefix_queried_tokens) == (0, 12)
    b = fully_computed(bm, kv, list(range(8)) + [99])    # 9 queried, 8 hit
    assert (bm.prefix_hit_tokens, bm.prefix_queried_tokens) == (8, 21)
    big = Sequence(list(range(8)) + [50] * 20, PARAMS, 4)  # hits 2 blocks, needs 5 more: only 2 free
    cached = bm.find_cached_prefix(big)
    assert len(cached) == 2
    assert not bm.allocate(big, big.num_tokens - 8, cached)
    assert (bm.prefix_hit_tokens, bm.prefix_queried_tokens) == (8, 21)
    bm.free(a)
    bm.free(b)


def test_failed_admission_with_revived_hit_changes_nothing():
    """Guards against a failed allocate that half-revived cached blocks: hit blocks sitting in the
    free list count against the free blocks, and on failure they stay free and findable."""
    bm = BlockManager(4, 2)
    kv: dict[int, tuple] = {}
    a = fully_computed(bm, kv, [1, 2, 3, 4, 5])  # 3 blocks, two full
    bm.free(a)
    hog = fully_computed(bm, kv, [9])            # takes the one never-used block
    seq = Sequence([1, 2, 3, 4, 6, 6, 6], PARAMS, 2)
    cached = bm.find_cached_prefix(seq)
    assert len(cached) == 2
    before = snapshot(bm, seq)
    assert not bm.allocate(seq, 3, cached)      # 2 revived + 2 fresh > 3 free
    assert snapshot(bm, seq) == before
    assert bm.find_cached_prefix(seq) == cached
    assert bm.allocate(seq, 1, cached)          # 2 revived + 1 fresh fits
    check_kv_reads(bm, kv, seq, 4)
    compute(bm, kv, seq, 1)
    bm.free(seq)
    bm.free(hog)
    assert bm.num_used_blocks == 0
