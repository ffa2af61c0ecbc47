"""The block manager owns the paged KV cache's bookkeeping: which physical blocks are free, which
sequence owns which, and which hold a reusable prefix. It never touches tensors.

A block holds the K/V of `block_size` consecutive tokens. A sequence's block table lists its blocks in
order, so any free block can serve any sequence and memory never fragments. Reference counts let
sequences share blocks: a full block is keyed by a hash chained over its parent's hash and its own
tokens, so a new request whose prompt starts with the same tokens finds and reuses them (automatic
prefix caching). A hash only proposes a match; the stored tokens and parent confirm it, so a hash
collision can never hand back wrong KV. Freed blocks keep their hash and are handed out again
least-recently-freed first, so a prefix stays cached for as long as memory allows.
"""
from collections import OrderedDict
from dataclasses import dataclass
from itertools import count

from nanoserve.sequence import Sequence


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None         # set once the block is full and its K/V computed
    key: tuple | None = None        # (parent's prefix_id, token_ids): what a hit must match exactly
    prefix_id: int | None = None    # names the whole token prefix ending in this block

    def forget(self):
        self.hash = self.key = self.prefix_id = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn=hash_block):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest first
        self.hash_to_block: dict[int, int] = {}
        self._prefix_ids = count()
        self.prefix_hit_tokens = 0
        self.prefix_queried_tokens = 0
        self.peak_used_blocks = 0

    # ---- counters -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_ids)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a findable prefix (evicted only when a block is needed)."""
        return sum(self.hash_to_block.get(self.blocks[b].hash) == b for b in self.free_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ---------------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of seq, in order. At least the last token is
        left to compute, since its logits are needed to sample the next token."""
        if not self.enable_prefix_caching:
            return []
        hits, parent_hash, parent_prefix = [], None, None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.block_tokens(i)
            h = self.hash_fn(parent_hash, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].key != (parent_prefix, tokens):
                break  # a miss, or a hash collision caught by comparing what the block really holds
            hits.append(block_id)
            parent_hash, parent_prefix = h, self.blocks[block_id].prefix_id
        return hits

    def cache_full_blocks(self, seq: Sequence):
        """Make seq's full, computed blocks findable. Call after each step that computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        first = num_full
        while first > 0 and self.blocks[seq.block_table[first - 1]].hash is None:
            first -= 1  # hashed blocks form a prefix of the table; find where it ends
        for i in range(first, num_full):
            parent = self.blocks[seq.block_table[i - 1]] if i > 0 else None
            block = self.blocks[seq.block_table[i]]
            tokens = seq.block_tokens(i)
            block.hash = self.hash_fn(parent.hash if parent else None, tokens)
            block.key = (parent.prefix_id if parent else None, tokens)
            owner_id = self.hash_to_block.get(block.hash)
            owner = self.blocks[owner_id] if owner_id is not None else None
            if owner is not None and owner.key == block.key:
                block.prefix_id = owner.prefix_id  # same prefix computed twice: same name, one entry
            else:
                block.prefix_id = next(self._prefix_ids)
                if owner is None:  # on a collision with other content, the first one keeps the key
                    self.hash_to_block[block.hash] = block.block_id

    # ---- allocation -----------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Give seq the blocks it needs to hold num_new_tokens more tokens, after taking cached_blocks
        (a prefix hit, only for a sequence with nothing computed yet). False, changing nothing, if the
        pool is short."""
        num_computed = seq.num_computed_tokens + len(cached_blocks) * self.block_size
        num_new_blocks = (self.blocks_needed(num_computed + num_new_tokens)
                          - len(seq.block_table) - len(cached_blocks))
        num_revived = sum(self.blocks[b].ref_count == 0 for b in cached_blocks)
        if num_new_blocks + num_revived > self.num_free_blocks:
            return False
        if seq.num_cached_tokens is None:  # first admission; a preempted sequence's recompute is not a query
            seq.num_cached_tokens = len(cached_blocks) * self.block_size
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += seq.num_cached_tokens
        for block_id in cached_blocks:
            self._take(block_id)
        seq.block_table.extend(cached_blocks)
        seq.num_computed_tokens = num_computed
        for _ in range(num_new_blocks):
            seq.block_table.append(self._take_fresh())
        return True

    def free(self, seq: Sequence):
        """Release seq's blocks; tail first, so a shared prefix stays cached longest."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_ids[block_id] = None
        del seq.block_table[:]
        seq.num_computed_tokens = 0

    def _take(self, block_id: int):
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_ids[block_id]
        block.ref_count += 1

    def _take_fresh(self) -> int:
        block_id, _ = self.free_ids.popitem(last=False)  # least recently freed
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]  # evict: its prefix is no longer findable
        block.forget()
        block.ref_count = 1
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        return block_id
