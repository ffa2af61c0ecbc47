"""The block manager owns the paged KV cache's bookkeeping: which physical blocks are free, which sequence holds which,
and which hold a reusable prefix. It never touches tensors.

A block holds the K/V of `block_size` consecutive tokens. A sequence's block table lists its blocks in order, so any
free block can serve any sequence and memory never fragments. Reference counts let sequences share blocks.

Automatic prefix caching: once a block is full and computed, it goes into one dict under the key (prefix id of the block
before it, its own tokens). A prefix id names a whole token prefix and is never reused, and keys are compared exactly,
not by hash alone, so a hit always holds the same tokens after the same prefix: wrong KV cannot be handed out, by
construction. A first block's key starts from its sequence's cache salt instead (Sequence.cache_salt: None, or what
else its K/V depend on, such as a LoRA adapter), so blocks computed under different salts never meet. A freed block
stays findable until it is needed again; free blocks are handed out least-recently-freed first, so a popular prefix
stays cached (LRU).

Forks and copy-on-write (beam search): a forked sequence shares every block of its parent, full or not, by reference
count. Full blocks are never written again, so sharing them is free for ever. A partial block is still being written:
the first sequence to write its next token into a shared partial block gets a fresh copy of it first (one block, copied
on the device before the step runs: `block_copies`, which the scheduler hands to the step), and the last holder writes
in place. So no block is written while shared, and a partial block, never keyed, cannot be found while being written."""

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import count

from nanoserve.sequence import Sequence

# (parent block's prefix id, or for a first block its sequence's cache salt; this block's tokens)
PrefixKey = tuple[object, tuple[int, ...]]


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: PrefixKey | None = None  # set once the block is full and its K/V computed
    prefix_id: int | None = None  # names the whole token prefix ending in this block


@dataclass(eq=False)  # the constructor is written for us (num_blocks, block_size, enable_prefix_caching)
class BlockManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    # Counters, for stats() and the trace (they start at 0). Used blocks = allocated - freed + revived.
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache (first admissions)
    prefix_hit_tokens: int = 0  # of those, tokens served from it
    peak_used_blocks: int = 0  # the most blocks ever in use at once
    num_allocated: int = 0  # blocks ever handed out fresh
    num_freed: int = 0  # blocks ever returned to the pool
    num_hit_blocks: int = 0  # blocks reused through the prefix cache
    num_revived: int = 0  # of those, blocks taken back from the free pool
    # The extension point of eviction: called with a cached block (its key and prefix id) as it is taken for new K/V
    # (ext/kv_offload copies it to a host tier first); None: evicted blocks are forgotten
    on_evict: Callable[[Block], None] | None = None

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        # the free pool: block ids, least recently freed first (an OrderedDict as an ordered set: O(1) removal of a
        # revived block, the values unused)
        self.free_ids = OrderedDict.fromkeys(range(self.num_blocks))
        self.cached: dict[PrefixKey, int] = {}  # the prefix cache: key -> block id
        self._prefix_ids = count()
        self.block_copies: list[int] = []  # copy-on-write (source, destination) pairs, flat, that the next step makes

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def count_cached_free_blocks(self) -> int:
        """Free blocks that still hold a findable prefix (evicted only when a block is needed). Scans the cache."""
        return sum(self.blocks[b].ref_count == 0 for b in self.cached.values())

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of seq's longest cached prefix; the last token is always left to compute, for its logits. None
        for a sequence that asked for prompt_logprobs: they need every prompt position's logits, and cached tokens
        would have none."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        hits = []
        parent = seq.cache_salt  # a first block is keyed under the sequence's salt (None for most)
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_id = self.cached.get((parent, seq.block_tokens(i)))
            if block_id is None:
                break
            hits.append(block_id)
            parent = self.blocks[block_id].prefix_id
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Make seq's full blocks findable once their K/V are computed (or queued: the GPU runs steps in order)
        and their tokens' values are known."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_known_tokens) // self.block_size
        first = num_full
        while first and self.blocks[seq.block_table[first - 1]].key is None:
            first -= 1  # keyed blocks form a prefix of the table; find where it ends
        for i in range(first, num_full):
            block = self.blocks[seq.block_table[i]]
            parent = seq.cache_salt  # a first block is keyed under its sequence's salt...
            if i:
                parent = self.blocks[seq.block_table[i - 1]].prefix_id  # ...any other under its parent's prefix id
            block.key = (parent, seq.block_tokens(i))
            owner = self.blocks[self.cached.setdefault(block.key, block.block_id)]  # the block the cache holds
            if owner is block:  # a new prefix gets a new name
                block.prefix_id = next(self._prefix_ids)
            else:  # the same prefix computed twice (two sequences admitted together): one entry, one name
                block.prefix_id = owner.prefix_id

    def restore(self, block_id: int, key: PrefixKey, prefix_id: int) -> None:
        """A block a KV connector fills (ext/kv_offload: copied back from the host tier) takes the key and prefix id
        its K/V had when evicted: the prefix keeps its name, so its children, cached under that name on the device or
        in the host tier, stay findable after it. Before cache_full_blocks, which keys only the blocks after it."""
        block = self.blocks[block_id]
        block.key = key
        block.prefix_id = prefix_id
        self.cached.setdefault(key, block_id)

    def allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        cached_blocks: list[int] | tuple = (),
    ) -> bool:
        """Give seq the blocks it needs to hold num_new_tokens more tokens, after taking cached_blocks (a prefix
        hit, only for a sequence with nothing computed yet). False, changing nothing, if the pool is short."""
        # (the cached blocks hold exactly their tokens, so the new tokens' blocks come on top, counted as for a
        # sequence with nothing computed)
        num_new_blocks = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        copy_on_write = (
            seq.num_computed_tokens % self.block_size  # the next token goes into a partial block...
            and self.blocks[seq.block_table[-1]].ref_count > 1  # ...that a fork shares: copy it first
        )
        if not (num_new_blocks > 0 or cached_blocks or copy_on_write):
            return True  # most decode steps: the token fits in the sequence's last block (nothing to do, quickly)
        num_revived = sum(self.blocks[b].ref_count == 0 for b in cached_blocks)
        if num_new_blocks + num_revived + copy_on_write > self.num_free_blocks:
            return False
        hit_tokens = len(cached_blocks) * self.block_size
        if seq.num_cached_tokens is None:  # first admission; a preempted sequence's recompute is not a query
            seq.num_cached_tokens = hit_tokens
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += hit_tokens
        self.num_hit_blocks += len(cached_blocks)
        self.num_revived += num_revived
        for block_id in cached_blocks:  # one more user; a free one (ref count 0) is taken back from the pool
            self.free_ids.pop(block_id, None)
            self.blocks[block_id].ref_count += 1
        seq.block_table.extend(cached_blocks)
        if copy_on_write:
            shared = seq.block_table[-1]
            self.blocks[shared].ref_count -= 1  # still held by the others
            seq.block_table[-1] = self._take_fresh()
            self.block_copies += [shared, seq.block_table[-1]]
        seq.num_computed_tokens += hit_tokens
        seq.block_table.extend(self._take_fresh() for _ in range(num_new_blocks))
        return True

    def fork(self, seq: Sequence) -> Sequence:
        """A copy of seq (with no token pending: beam search forks after a step is read back) that shares all its
        blocks, full or not: one more user of each."""
        for block_id in seq.block_table:
            self.blocks[block_id].ref_count += 1
        return seq.fork()

    def forget(self, block_ids: Iterable[int]) -> None:
        """Make these blocks unfindable in the prefix cache (a failed request's: what an extension's failed work left
        in them is not trusted); those who hold them keep them."""
        for block_id in block_ids:
            key = self.blocks[block_id].key
            if key is not None and self.cached.get(key) == block_id:
                del self.cached[key]

    def free(self, seq: Sequence, keep: int = 0) -> None:
        """Release seq's blocks past its first `keep` (all of them: the sequence stopped or was preempted; some: a
        rollback of rejected draft tokens); tail first, so a shared prefix stays cached longest."""
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_ids[block_id] = None
                self.num_freed += 1
        del seq.block_table[keep:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, keep * self.block_size)

    def _take_fresh(self) -> int:
        block_id, _ = self.free_ids.popitem(last=False)  # least recently freed
        key = self.blocks[block_id].key
        if self.cached.get(key) == block_id:  # (a block never keyed finds None)
            del self.cached[key]  # evict: its prefix is no longer findable
            if self.on_evict is not None:  # a KV connector may keep it: whole until the step it is taken for writes
                self.on_evict(self.blocks[block_id])
        self.blocks[block_id] = Block(block_id, ref_count=1)  # no key, no prefix name, one user
        self.num_allocated += 1
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        return block_id
