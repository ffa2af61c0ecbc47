"""The ModelRunner owns the model and its KV cache on the device. Each step it turns the scheduler's Step into flat
tensors (step_inputs.py), runs the model (replaying a CUDA graph when the step is decode-only), samples, and returns an
InFlightStep without waiting: the samples stay on the device as the next step's inputs while a copy travels to the host.
Three extension points meet here, each called once per step: the logits processors the engine hands to launch (the
sampler applies them, sampler.py), the runner's Peers, the other processes that run every step with this one (none
in the core; ext/tp's tensor-parallel ranks), and step_hooks, called with each step before it runs (ext/lora.py fills
its table of which rows use which adapter there).

KV cache size: every token keeps a K and a V vector per layer and KV head, so
    bytes per token = 2 x num_layers x num_kv_heads x head_dim x bytes per element,
and the pool is as many blocks of `block_size` tokens as the memory left after weights and activations holds. The
element is the model's dtype, or 1 byte with kv_cache_dtype="fp8": twice bf16's tokens in the same memory."""

import logging
from collections.abc import Callable
from typing import NoReturn

import torch
from torch import Tensor
from transformers import PretrainedConfig

from nanoserve.attention import prefill_tile_sizes
from nanoserve.checks import InvalidField
from nanoserve.config import EngineConfig
from nanoserve.cuda_graphs import DecodeGraphs
from nanoserve.ext import find
from nanoserve.kernels import get_kernels
from nanoserve.layers import Layers
from nanoserve.loader import build_model
from nanoserve.model import ModelArgs
from nanoserve.sampler import LogitsProcessor, Sampler, Samples
from nanoserve.sampling_params import SamplingParams
from nanoserve.scheduler import ScheduledSeq, Step
from nanoserve.sequence import Sequence
from nanoserve.step_inputs import (
    BLOCK_TABLE_WIDTH_MULTIPLE,
    StepHeader,
    StepLists,
    flatten_step,
    round_up,
    step_inputs,
    upload,
)
from nanoserve.stopping import banned_token_ids

logger = logging.getLogger("nanoserve")
CPU_KV_CACHE_BYTES = 1 << 30  # no GPU to profile: the KV pool gets 1 GiB of host memory (config.num_kvcache_blocks)
PROFILE_SAMPLING = SamplingParams(top_k=50, top_p=0.9, min_p=0.05, logprobs=1)  # the sampler's costliest path
RowLogprobs = dict[int, float] | None  # one row's {token: logprob}; None for a row that asked for none
OutputHook = Callable[[Step, Tensor], Callable[[], None] | None]  # (step, hidden states) -> a finisher, or None


def logprob_dicts(samples: Samples, nums: list[int | None]) -> list[RowLogprobs]:
    """Host samples with logprobs as one {token: logprob} per row: the top nums[row], then the row's own token (its
    entry again if it is among them); None for a row that asked for none."""
    tokens = samples.tokens.tolist()  # each column in one .tolist() call, not element by element
    chosen, top_values, top_ids = map(Tensor.tolist, samples.logprobs)
    dicts = []
    for row, n in enumerate(nums):
        entry = None
        if n is not None:
            entry = dict(zip(top_ids[row][:n], top_values[row][:n], strict=True))
            entry[tokens[row]] = chosen[row]
        dicts.append(entry)
    return dicts


class Peers:
    """The runner's extension point for tensor parallelism: the other processes that run every step with this one, and
    what this one tells them. The core runs alone, rank 0 of 1, so every call below does nothing; ext/tp's subclasses
    (rank 0's handle on its workers, and each worker's own) shard the layers and talk to the other ranks. The runner
    calls each at one named point: the layers when it builds the model, fewest_blocks when it sizes the pool,
    send_step and send_tokens once per step, failed when a step fails, close once."""

    size = 1  # ranks that run each step (the KV cache holds num_kv_heads / size heads per rank)
    local_rank = 0  # this rank's GPU among its machine's

    def layers(self) -> Layers:
        """How the model holds its weights (layers.py): whole."""
        return Layers()

    def fewest_blocks(self, num_blocks: int) -> int:
        """The KV blocks every rank can hold, given this rank's: every rank holds the same blocks (its share of their
        heads)."""
        return num_blocks

    def send_step(self, header: StepHeader, flat: Tensor) -> None:
        """A step's inputs (its header as host ints, and its uploaded buffer), before rank 0 runs it."""

    def send_tokens(self, tokens: Tensor) -> None:
        """A step's samples, which the other ranks' next decode inputs come from."""

    def failed(self, error: BaseException) -> NoReturn:
        """A step failed on this rank: raise (ext/tp: naming the rank at fault, after stopping the others)."""
        raise error

    def close(self) -> None:
        """The engine is closed: stop the other ranks."""


class InFlightStep:
    """A launched step. Its samples stay on the device (the next step reads its decode inputs there), and their
    copy to the host is queued behind the step's kernels, so launching the next step need not wait for it. So are the
    copies the runner's output hooks queued (ext/prompt_logprobs.py): their finishers run once the copies are in."""

    def __init__(
        self,
        step: Step,
        rows: list[tuple[Sequence, int]],
        samples: Samples | None,
        finishers: list[Callable[[], None]],
        on_gpu: bool,
    ) -> None:
        self.step = step
        self.rows = rows  # step.sampled_rows(): (sequence, its length with the row's token) per row of samples
        self.row_of = {}  # seq_id -> the row of its last sample
        for row, (seq, _) in enumerate(rows):
            self.row_of[seq.seq_id] = row
        self.finishers = finishers
        self.device_tokens = None  # what the next step's decode inputs are read from (None: nothing sampled)
        self.host_samples = None  # a host copy, queued behind the step's kernels
        self.ready = None  # on a GPU, the event after which the host copies are complete
        if samples is not None:
            self.device_tokens = samples.tokens
            self.host_samples = samples.to_host()
        if on_gpu and (samples is not None or finishers):
            self.ready = torch.cuda.current_stream().record_event()

    def wait(self) -> tuple[list[int], list[RowLogprobs] | None]:
        """The tokens (waiting for the GPU if needed), and per row, {token: logprob} if any row asked for them: the
        chosen token's and the top-N, N as that row asked. The output hooks' finishers run first."""
        if self.ready is not None:
            self.ready.synchronize()
        for finish in self.finishers:
            finish()
        samples = self.host_samples
        if samples is None:
            return [], None
        logprobs = None
        if samples.logprobs is not None:
            logprobs = logprob_dicts(samples, [seq.params.logprobs for seq, _ in self.rows])
        return samples.tokens.tolist(), logprobs


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_dir: str,
        hf_config: PretrainedConfig,
        args: ModelArgs,
        peers: Peers | None = None,
    ) -> None:
        """peers: the other ranks (ext/tp); None: this runner runs alone."""
        peers = peers or Peers()
        self.config = config
        self.args = args
        self.on_gpu = config.device == "cuda"
        self.peers = Peers()  # alone until start-up's steps (warm_up) have run: every rank runs its own
        # The extension point of steps: callables an extension's start() adds, each called with every step before it
        # runs, to fill inputs of its own that the model reads (ext/lora: which rows use which adapter). One that
        # returns True asks for this step to run eagerly, not as a graph replay (ext/cascade.py: a decode step whose
        # sequences share blocks attends them in a way the graphs were not captured with)
        self.step_hooks: list[Callable[[Step], bool | None]] = []
        # The extension point of outputs: callables an extension adds, each called on rank 0 with every step and its
        # hidden states [num_tokens, hidden_size] after the forward pass, to read what the sampler does not (their
        # rows in the step's order: each scheduled sequence's tokens in turn). Each may return a finisher, which the
        # engine calls when it reads the step back, once the host copies the hook queued are complete
        # (ext/prompt_logprobs.py: the logprobs of prompt tokens)
        self.output_hooks: list[OutputHook] = []
        if self.on_gpu:
            self.device = torch.device("cuda", peers.local_rank)
        else:
            self.device = torch.device("cpu")
            self.set_cpu_threads(peers.size)
        self.block_size = config.kvcache_block_size
        self.num_kv_heads = args.num_kv_heads // peers.size  # this rank's share
        # a block table long enough for max_model_len tokens, its width a multiple of BLOCK_TABLE_WIDTH_MULTIPLE
        widest = round_up(config.max_model_len, self.block_size * BLOCK_TABLE_WIDTH_MULTIPLE)
        self.max_blocks_per_seq = widest // self.block_size
        # 1) the model in the serving dtype, and the sampler
        kernels = get_kernels(config.kernels)
        self.dtype = config.torch_dtype(hf_config)
        self.kv_dtype = config.kv_cache_torch_dtype(self.dtype)
        self.kv_bytes_per_token = args.kv_bytes_per_token(self.kv_dtype, peers.size)  # this rank's share
        self.model = build_model(args, model_dir, self.dtype, self.device, kernels, peers.layers())
        self.sampler = Sampler(kernels.gumbel_argmax)
        # 2) the KV cache: as many blocks as the memory left after a warm-up run of 1) holds, on every rank
        if self.on_gpu:
            self.warm_up()
        self.num_kvcache_blocks = peers.fewest_blocks(config.num_kvcache_blocks or self.blocks_from_memory())
        self.make_kv_cache(self.num_kvcache_blocks)
        logger.info(self.kv_account())
        # 3) the decode graphs: captured by capture_graphs, once the extensions have wired their modules in
        self.graphs: DecodeGraphs | None = None
        self.peers = peers  # set last: every rank runs start-up's steps (warm_up) on its own

    def capture_graphs(self) -> None:
        """Record the decode graphs over the model as it now is (unless enforce_eager): the engine calls this once,
        after its extensions' start() has wrapped projections or replaced kernels (model.py's two extension points),
        so the graphs replay what the eager forward runs."""
        if not self.config.enforce_eager:
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.config.max_num_seqs, self.max_blocks_per_seq)
            self.graphs.capture()

    def close(self) -> None:
        self.peers.close()

    def set_cpu_threads(self, num_ranks: int) -> None:
        """torch's threads on a CPU: threads=, or the cores other processes leave free (ext/cpu_threads.py; without
        it, torch's own count)."""
        cpu_threads = find("cpu_threads")
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        elif cpu_threads is not None:
            torch.set_num_threads(cpu_threads.threads_per_rank(num_ranks))

    # ---- the KV cache -----------------------------------------------------------------------------
    def kv_account(self) -> str:
        """One line: the weights' bytes (this rank's: quantized ones are fewer, ext/quantization), the KV cache's
        per-token formula with this model's numbers, the pool's size, and what sized it."""
        weight_bytes = sum(param.nbytes for param in self.model.parameters())
        num_tokens = self.num_kvcache_blocks * self.block_size
        if self.config.num_kvcache_blocks:
            sized_by = "num_kvcache_blocks"
        elif not self.on_gpu:
            sized_by = "1 GiB of host memory on a CPU"
        else:
            sized_by = f"{self.config.gpu_memory_utilization:.0%} of the GPU less weights, activations"
        return (
            f"weights {weight_bytes / 2**20:,.2f} MiB; "
            f"KV cache: 2 (K, V) x {self.args.num_layers} layers x {self.num_kv_heads} KV heads x {self.args.head_dim} "
            f"x {self.kv_dtype.itemsize} bytes ({str(self.kv_dtype).removeprefix('torch.')}) "
            f"= {self.kv_bytes_per_token / 1024:.1f} KiB per token; "
            f"{self.num_kvcache_blocks} blocks x {self.block_size} = {num_tokens:,} tokens, "
            f"{num_tokens * self.kv_bytes_per_token / 2**30:.2f} GiB ({sized_by})"
        )

    def make_kv_cache(self, num_blocks: int) -> None:
        """kv_cache: [K or V, layer, block, slot, kv head (this rank's), head_dim], not zeroed: every slot is written
        before it is read, and on a CPU memory pages are only taken as the cache fills; kv_caches, what the model
        reads: per layer i, (kv_cache[0, i], kv_cache[1, i])."""
        per_layer = (num_blocks, self.block_size, self.num_kv_heads, self.args.head_dim)
        shape = (2, self.args.num_layers, *per_layer)
        self.kv_cache = torch.empty(shape, dtype=self.kv_dtype, device=self.device)
        self.kv_caches = list(zip(*self.kv_cache, strict=True))

    def blocks_from_memory(self) -> int:
        block_bytes = self.kv_bytes_per_token * self.block_size
        # More blocks than every sequence at full length need only feed the prefix cache, and each costs a
        # Python object in the block manager: small models would otherwise get millions.
        enough = self.config.max_num_seqs * self.max_blocks_per_seq
        budget = CPU_KV_CACHE_BYTES
        if self.on_gpu:  # the share of the GPU given to the engine, less what is taken already
            free, total = torch.cuda.mem_get_info()
            outside_torch = total - free - torch.cuda.memory_reserved()  # CUDA context, other processes
            peak = torch.cuda.max_memory_allocated()  # weights + the largest step's activations (warm_up's)
            budget = total * self.config.gpu_memory_utilization - outside_torch - peak
            if budget < block_bytes:
                raise InvalidField(
                    "gpu_memory_utilization",
                    f"{self.config.gpu_memory_utilization} leaves no memory "
                    f"for the KV cache (weights and activations take {peak / 2**30:.1f} GiB)",
                )
        return min(int(budget // block_bytes), enough)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Before the KV cache exists: compile a prefill kernel per query-tile size, and with them the decode kernels
        (every step launches them; they have one variant for any batch size, so an eager run, too, never waits for a
        compile: Triton compiles on first use), then run the biggest step the scheduler can make to measure the memory
        left: max_num_batched_tokens of prompt, cut into sequences no longer than max_model_len, each sampling its
        next token through the sampler's costliest path, with one-token sequences added up to max_num_seqs sampling
        rows (on the safe side: a few tokens, or rows, more than a real step holds). Each is a real step (launch), its
        sequences all token 0, their block tables all block 0 of a zeroed one-block scratch cache: no K/V goes
        anywhere that matters."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.make_kv_cache(1)
        self.kv_cache.zero_()  # the scratch cache; the real one replaces it
        for tile in prefill_tile_sizes(self.dtype):
            self.launch(self._dummy_step([tile]))
        budget = self.config.max_num_batched_tokens
        longest = self.config.max_model_len
        seq_lens = [min(longest, budget - start) for start in range(0, budget, longest)]
        seq_lens += [1] * (self.config.max_num_seqs - len(seq_lens))
        self.launch(self._dummy_step(seq_lens))

    def _dummy_step(self, seq_lens: list[int]) -> Step:
        """A step of whole prompts of token 0, each sampling its next token (PROFILE_SAMPLING), all in block 0."""
        step = Step()
        for n in seq_lens:
            seq = Sequence([0] * n, PROFILE_SAMPLING, self.block_size)
            seq.block_table.frombytes(bytes(4 * self.max_blocks_per_seq))  # int32 zeros: every entry block 0
            step.scheduled.append(ScheduledSeq(seq, start=0, num_new_tokens=n, picks_next_token=True))
        return step

    # ---- one step ---------------------------------------------------------------------------------
    def prepare(self, step: Step, previous: InFlightStep | None) -> StepLists:
        """The step flattened into integer lists (step_inputs.py)."""
        previous_rows = None
        if previous is not None:
            previous_rows = previous.row_of
        return flatten_step(step, self.block_size, previous_rows)

    @torch.inference_mode()
    def launch(
        self,
        step: Step,
        previous: InFlightStep | None = None,
        processors: list[LogitsProcessor] = (),
    ) -> InFlightStep:
        """Queue one step on the device and return without waiting for it. `previous`, the step launched before
        and maybe not yet read back, holds the values of this step's PENDING decode inputs (None: no step before it,
        as for warm_up's steps); processors: the engine's logits processors (LLM.logits_processors), each asked for its
        rows of this step (none for warm_up's)."""
        lists = self.prepare(step, previous)
        eager = [hook(step) for hook in self.step_hooks]  # every hook runs; one that says True makes the step eager
        header, flat = upload(lists, self.device)
        rows = step.sampled_rows()  # (sequence, its length with the row's token) per row of samples
        previous_tokens = None
        if previous is not None:
            previous_tokens = previous.device_tokens
        try:
            self.peers.send_step(header, flat)  # tensor parallel: every rank runs the step; rank 0 samples
            hidden, logits = self.execute(header, flat, previous_tokens, any(eager))
            finishers = [hook(step, hidden) for hook in self.output_hooks]
            samples = None  # a step of prompt chunks only samples nothing
            if logits is not None:
                samples = self.sample(logits, rows, processors)
                self.peers.send_tokens(samples.tokens)  # the other ranks' next decode inputs
            finishers = [finish for finish in finishers if finish is not None]
            return InFlightStep(step, rows, samples, finishers, on_gpu=self.on_gpu)
        except BaseException as error:  # Ctrl-C too: the other ranks may be waiting inside the step
            self.peers.failed(error)  # raises (ext/tp: naming the rank at fault)

    def sample(self, logits: Tensor, rows: list[tuple[Sequence, int]], processors: list[LogitsProcessor]) -> Samples:
        """The step's samples from its logits, one per row (a sequence per row: drafts have rows too), after the
        logits processors' work on the rows they change."""
        seqs = [seq for seq, _ in rows]
        work = [processor.prepare(seqs) for processor in processors]
        params = [seq.params for seq in seqs]
        lengths = [length for _, length in rows]
        banned = [banned_token_ids(seq) for seq in seqs]
        return self.sampler(logits, params, lengths, banned, [w for w in work if w is not None])

    def execute(
        self,
        header: StepHeader,
        flat: Tensor,
        previous_tokens: Tensor | None,
        eager: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Every rank: a step's forward pass (a graph replay if decode-only, unless a step hook asked for eager): the
        hidden states of its tokens, [num_tokens, hidden_size], and its sampling rows' logits (None if it has none; a
        worker's are dropped)."""
        views, meta = step_inputs(header, flat, previous_tokens)  # StepLists of int32 views on the device
        if len(views.block_copies):  # copy-on-write: a fork's shared partial block, before the step writes into it
            source, destination = views.block_copies.view(-1, 2).T  # int32 indices index as int64 ones do
            cache = self.kv_cache.view(torch.uint8)  # as bytes: any KV dtype, fp8 included; [K or V, layer, block, ...]
            cache[:, :, destination] = cache[:, :, source]
        if meta.decode_only and self.graphs is not None and not eager:
            hidden = self.graphs.run(views.input_ids, views.positions, meta)
        else:
            hidden = self.model(views.input_ids, views.positions, self.kv_caches, meta)
        logits = None
        if len(views.sample_rows):
            logits = self.model.compute_logits(hidden[views.sample_rows])
        return hidden, logits
