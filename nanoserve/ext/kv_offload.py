"""An extension: a host-memory tier behind the prefix cache, vLLM's KV cache offloading
(`LLM(..., kv_offloading_size=GiB, kv_offloading_backend="native")`, the server's --kv-offloading-size), and with it
preemption by swap. It also owns the KV connector's worker side, BlockCopies, which ext/kv_transfer imports from here
(the one dependency between the two: both fill the device's blocks from host tensors the same way).

The idea. The prefix cache names every full block by its exact content (block_manager.py: the key (parent prefix id,
tokens), and a prefix id per whole token prefix). When the device pool evicts a cached block for new K/V
(BlockManager.on_evict), this tier copies it to a fixed pool of host memory under the same key and prefix id; the least
recently used host block is dropped when the pool is full. When a waiting sequence is admitted, the scheduler asks the
connector (Scheduler.kv_connector) how many full blocks past the device's hits it can supply: this tier follows the
chain of keys from where the device's hits end, block after block, as find_cached_prefix does on the device, then asks
the swap rule whether copying them back beats recomputing them. The scheduler gives the sequence fresh blocks for them
and books them as computed; load() queues a copy into each and has the block manager take the block back under its old
key and prefix id (BlockManager.restore), so that the blocks after it, on the device or here, stay findable.

Why a block is never found here under a key whose K/V it does not hold: the key is the device's own (prefix ids are
never reused), a block is copied out before the step it was taken for writes into it, and every copy, out and in, runs
in the order it was booked. One list of (source, destination) views (BlockCopies), made by this tier's step hook before
the step's kernels, on the step's own stream: a slot dropped and reused after a load was booked is written after that
load has read it, and a block taken for a load is saved before it is filled. On a GPU the host pool is pinned and the
copies are asynchronous (non_blocking: the host never waits for them); they run on the step's stream rather than a copy
stream of their own because each must follow the step in flight (which may still write a block just evicted: a preempted
sequence's) and precede the next step, which reads the blocks loaded or overwrites those saved: a second stream would
have to wait for the first at both ends.

Preemption becomes swap. The core preempts by recompute: the victim's blocks return to the pool, its full blocks still
findable. With this tier, those the pool then evicts come here; when the victim is readmitted its blocks come back from
the device cache (nothing left it), from here (swap), or, where they were dropped here too or the rule says recompute,
from recomputing them. stats() counts each (preemptions_swapped, preemptions_recomputed, preemptions_resumed) and the
blocks saved, loaded and dropped; the step trace (ext/plots.py) records them per step and draws blocks leaving and
returning (host_tier.png).

The swap rule: copy back n tokens starting at position s when n x (K/V bytes per token) / (copy rate) is less than the
time to recompute them: n x (matmul FLOPs per token) + (keys attended: s x n + n(n+1)/2) x (attention FLOPs per key),
over the device's FLOP rate. Both rates are measured when the engine starts, on its device (a host-to-device copy of a
few blocks; a matmul at the model's width). BENCHMARKS.md compares the rule with measured loads and recomputes on the
CPU, and predicts the H100's: over PCIe a Qwen3-0.6B-sized model recomputes short prefixes faster than it copies them
back; an 8B one never does.

Not here: tensor parallelism (each rank holds its share of every block; the hook runs on rank 0), a second connector
(ext/kv_transfer) in the same engine, and vLLM's lmcache backend."""

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary, WeakSet

import torch
from torch import Tensor

from nanoserve.block_manager import Block, BlockManager, PrefixKey
from nanoserve.checks import InvalidField, check_number, shown
from nanoserve.config import EngineConfig
from nanoserve.scheduler import Step
from nanoserve.sequence import Sequence

if TYPE_CHECKING:
    from nanoserve.llm import LLM
    from nanoserve.model_runner import ModelRunner

GIB = 2**30
BACKENDS = ("native",)  # vLLM's kv_offloading_backend values this extension implements (not "lmcache")
PROBE_BLOCKS = 16  # blocks copied host to device to measure the copy rate
PROBE_TOKENS = 256  # rows of the matmul that measures the FLOP rate
PROBE_REPEATS = 3  # each probe's fastest of this many runs, after one to warm up


def check_config(config: EngineConfig) -> None:
    """kv_offloading_backend: vLLM's "native" (or unset); kv_offloading_size: GiB > 0, or unset, which with the backend
    alone asks for no tier (as in vLLM). The tier keeps the prefix cache's blocks, so it needs prefix caching; one
    connector per engine; one rank."""
    if config.kv_offloading_backend not in (None, *BACKENDS):
        raise InvalidField(
            "kv_offloading_backend", f"{shown(config.kv_offloading_backend)} is not one of {', '.join(BACKENDS)}"
        )
    if config.kv_offloading_size is None:
        return
    config.kv_offloading_size = check_number("kv_offloading_size", config.kv_offloading_size, 0, above_low=True)
    if not config.enable_prefix_caching:
        raise InvalidField("kv_offloading_size", "needs enable_prefix_caching: the host tier keeps the prefix cache's")
    if config.kv_transfer_config is not None:
        raise InvalidField("kv_offloading_size", "one KV connector per engine: not with kv_transfer_config")
    if config.tensor_parallel_size > 1:
        raise InvalidField("kv_offloading_size", "nanoserve offloads KV with tensor_parallel_size=1 only")


def start(llm: "LLM") -> "HostTier | None":
    """The engine's host tier (llm.extensions["kv_offload"]), as many blocks as kv_offloading_size holds, wired in as
    the scheduler's KV connector, the block manager's eviction callback and a step hook; None without a size."""
    size = llm.config.kv_offloading_size
    if size is None:
        return None
    runner = llm.runner
    block_bytes = runner.kv_cache[:, :, 0].nbytes  # [K or V, layer, slot, kv_head, head_dim]
    num_blocks = int(size * GIB // block_bytes)
    if num_blocks < 1:
        raise InvalidField("kv_offloading_size", f"{size} GiB holds no KV block ({block_bytes} bytes)")
    tier = HostTier(llm.block_manager, runner, num_blocks, SwapRule.measured(runner))
    tier.connect(llm)
    return tier


class BlockCopies:
    """The KV connector's worker side: whole blocks copied between the device pool (runner.kv_cache: [K or V, layer,
    block, slot, kv_head, head_dim]) and host tensors of one block each ([K or V, layer, slot, kv_head, head_dim]),
    queued as the scheduler books them and made, in that order, by the owner's step hook (run) before the step's
    kernels read or write any of them. Asynchronous from pinned host memory on a GPU."""

    def __init__(self, runner: "ModelRunner") -> None:
        self.kv_cache = runner.kv_cache
        self.queued: list[tuple[Tensor, Tensor]] = []  # (source, destination) views, in booking order

    def save(self, block_id: int, host: Tensor) -> None:
        self.queued.append((self.kv_cache[:, :, block_id], host))

    def load(self, host: Tensor, block_id: int) -> None:
        self.queued.append((host, self.kv_cache[:, :, block_id]))

    def run(self) -> None:
        for source, destination in self.queued:
            destination.copy_(source, non_blocking=True)
        self.queued = []


@dataclass
class SwapRule:
    """Whether copying a run of blocks back from host memory beats recomputing them (the module's docstring), from three
    costs measured on this engine's device."""

    copy_s_per_token: float  # K/V bytes per token over the host-to-device copy rate
    recompute_s_per_token: float  # a token's matmul FLOPs over the FLOP rate
    recompute_s_per_key: float  # attention FLOPs of one query against one key over the FLOP rate

    def copy_beats_recompute(self, start: int, num_tokens: int) -> bool:
        """For tokens [start, start + num_tokens): each attends to itself and every token before it."""
        keys = num_tokens * start + num_tokens * (num_tokens + 1) // 2
        recompute_s = num_tokens * self.recompute_s_per_token + keys * self.recompute_s_per_key
        return num_tokens * self.copy_s_per_token < recompute_s

    @classmethod
    def measured(cls, runner: "ModelRunner") -> "SwapRule":
        """The copy rate of PROBE_BLOCKS blocks from (pinned) host memory, and the FLOP rate of a [PROBE_TOKENS, hidden]
        x [hidden, intermediate] matmul in the model's dtype, on the runner's device; the model's FLOPs per token and
        per key from its shape (the LM head runs for sampled rows only: left out)."""
        args = runner.args
        host = torch.zeros((PROBE_BLOCKS, *runner.kv_cache[:, :, 0].shape), dtype=runner.kv_dtype)
        if runner.on_gpu:
            host = host.pin_memory()
        scratch = torch.empty_like(host, device=runner.device)
        copy_rate = host.nbytes / fastest(lambda: scratch.copy_(host, non_blocking=True), runner.device)
        x = torch.randn(PROBE_TOKENS, args.hidden_size, dtype=runner.dtype, device=runner.device)
        w = torch.randn(args.hidden_size, args.intermediate_size, dtype=runner.dtype, device=runner.device)
        flop_rate = 2 * x.numel() * w.shape[1] / fastest(lambda: x @ w, runner.device)
        q_width = args.num_heads * args.head_dim
        qkv_o = args.hidden_size * (2 * q_width + 2 * args.num_kv_heads * args.head_dim)
        matmul_flops = 2 * args.num_layers * (qkv_o + 3 * args.hidden_size * args.intermediate_size)
        key_flops = 4 * args.num_layers * q_width  # QK^T and PV: 2 FLOPs per multiply-add each
        return cls(runner.kv_bytes_per_token / copy_rate, matmul_flops / flop_rate, key_flops / flop_rate)


def fastest(work: Callable[[], object], device: torch.device) -> float:
    """Seconds of the fastest of PROBE_REPEATS runs of work, after a warm-up run; on a GPU each is synchronized."""
    best = math.inf
    for run in range(PROBE_REPEATS + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if run:
            best = min(best, time.perf_counter() - started)
    return best


@dataclass
class HostBlock:
    """Where a block evicted from the device lives in host memory, and the prefix id its key's prefix had there."""

    slot: int  # index in HostTier.blocks
    prefix_id: int


class HostTier:
    """The host pool, its index (prefix key -> HostBlock, least recently used first) and its counters; the scheduler's
    KV connector (num_loadable, load), the block manager's on_evict, and a step hook."""

    def __init__(self, bm: BlockManager, runner: "ModelRunner", num_blocks: int, rule: SwapRule) -> None:
        self.bm = bm
        self.rule = rule
        shape = (num_blocks, *runner.kv_cache[:, :, 0].shape)  # [host block, K or V, layer, slot, kv_head, head_dim]
        self.blocks = torch.empty(shape, dtype=runner.kv_cache.dtype, pin_memory=runner.on_gpu)
        self.index: OrderedDict[PrefixKey, HostBlock] = OrderedDict()
        self.free_slots = list(range(num_blocks))
        self.copies = BlockCopies(runner)
        # the chain num_loadable found for the sequence being admitted, (key, host block) per block, for load(); its
        # slots are not dropped for the evictions that the sequence's own allocation makes
        self.found: list[tuple[PrefixKey, HostBlock]] = []
        self.preempted = WeakSet()  # sequences preempted and not readmitted yet
        self.full_blocks = WeakKeyDictionary()  # sequence -> full blocks of K/V it has computed, as of its last step
        self.loaded_for: dict[int, int] = {}  # seq_id -> blocks loaded at its admission in this step
        self.counts = dict.fromkeys(
            (
                "blocks_saved",  # copied device -> host
                "blocks_loaded",  # copied host -> device
                "blocks_dropped",  # least recently used, dropped from a full host pool
                "blocks_declined",  # found here, recomputed because the swap rule said so
                "preemptions_swapped",  # readmitted with blocks copied back from here
                "preemptions_recomputed",  # readmitted recomputing full blocks it had
                "preemptions_resumed",  # readmitted with every full block still in the device's cache
                "recomputed_tokens",  # by those readmissions
            ),
            0,
        )

    def connect(self, llm: "LLM") -> None:
        llm.scheduler.kv_connector = self
        llm.block_manager.on_evict = self.on_evict
        llm.runner.step_hooks.append(self.step_hook)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def stats(self) -> dict[str, int]:
        """The counters and the pool's use, named as in LLM.stats() with this extension's prefix."""
        used = {"host_blocks_used": len(self.index), "host_blocks_total": self.num_blocks}
        return {f"kv_offload_{name}": n for name, n in (self.counts | used).items()}

    # ---- out: the device evicts ------------------------------------------------------------------
    def on_evict(self, block: Block) -> None:
        """A cached block taken for new K/V: a copy of it here under its key, unless one is here already (it was loaded
        from here, or its prefix was computed again): then that one is the most recently used, named as the device
        last named it (both names are of the same token prefix)."""
        held = self.index.get(block.key)
        if held is not None:
            held.prefix_id = block.prefix_id
            self.index.move_to_end(block.key)
            return
        slot = self.take_slot()
        if slot is None:  # every slot holds a block being loaded: this one is forgotten
            return
        self.index[block.key] = HostBlock(slot, block.prefix_id)
        self.copies.save(block.block_id, self.blocks[slot])
        self.counts["blocks_saved"] += 1

    def take_slot(self) -> int | None:
        """A free slot, or the least recently used block's (not one the sequence being admitted loads); None if all are
        those."""
        if self.free_slots:
            return self.free_slots.pop()
        loading = {held.slot for _, held in self.found}
        for key, held in self.index.items():
            if held.slot not in loading:
                del self.index[key]
                self.counts["blocks_dropped"] += 1
                return held.slot
        return None

    # ---- in: the scheduler admits ----------------------------------------------------------------
    def num_loadable(self, seq: Sequence, num_cached: int) -> int:
        """How many of seq's full blocks after its num_cached device hits are here, in a chain, and worth copying back
        (never the block of its last token; none for prompt_logprobs, which needs every position's logits)."""
        self.found = []
        if seq.params.prompt_logprobs is not None:
            return 0
        parent = seq.cache_salt  # a first block's key starts from the salt, any other from its parent's prefix id
        if num_cached:
            parent = self.bm.blocks[self.bm.find_cached_prefix(seq)[num_cached - 1]].prefix_id
        for i in range(num_cached, (seq.num_tokens - 1) // self.bm.block_size):
            key = (parent, seq.block_tokens(i))
            held = self.index.get(key)
            if held is None:
                break
            self.found.append((key, held))
            parent = held.prefix_id
        size = self.bm.block_size
        if self.found and not self.rule.copy_beats_recompute(num_cached * size, len(self.found) * size):
            self.counts["blocks_declined"] += len(self.found)
            self.found = []
        return len(self.found)

    def load(self, seq: Sequence, first_block: int, count: int) -> None:
        """Fill seq's fresh blocks [first_block, first_block + count) with the chain num_loadable found: each copy
        queued, each block restored under its key and prefix id (BlockManager.restore)."""
        targets = seq.block_table[first_block : first_block + count]
        for (key, held), block_id in zip(self.found, targets, strict=True):
            self.copies.load(self.blocks[held.slot], block_id)
            self.bm.restore(block_id, key, held.prefix_id)
            self.index.move_to_end(key)
        self.counts["blocks_loaded"] += count
        self.loaded_for[seq.seq_id] = count
        self.found = []

    # ---- the step hook ---------------------------------------------------------------------------
    def step_hook(self, step: Step) -> None:
        """Before the step's kernels: make the copies booked while it was planned, then count how its readmitted
        sequences got their blocks back."""
        self.copies.run()
        self.count_readmissions(step)
        self.loaded_for = {}
        self.preempted.update(step.preempted)

    def count_readmissions(self, step: Step) -> None:
        """A preempted sequence readmitted in this step swapped (blocks copied back from here), recomputed (some full
        block of K/V it had computed came back from neither cache), or resumed (the device's cache held every one)."""
        size = self.bm.block_size
        for s in step.scheduled:
            seq = s.seq
            if seq in self.preempted:  # readmitted now
                self.preempted.discard(seq)
                missing = self.full_blocks.get(seq, 0) - s.start // size
                if self.loaded_for.get(seq.seq_id):
                    self.counts["preemptions_swapped"] += 1
                elif missing > 0:
                    self.counts["preemptions_recomputed"] += 1
                else:
                    self.counts["preemptions_resumed"] += 1
                self.counts["recomputed_tokens"] += max(missing, 0) * size
            self.full_blocks[seq] = (s.start + s.num_new_tokens) // size
