"""The ModelRunner owns the model and its KV cache on the device. Each step it turns the scheduler's Step into flat
tensors (StepInputs), runs the model (replaying a CUDA graph when the step is decode-only), samples, and returns an
InFlightStep without waiting: the samples stay on the device as the next step's inputs while a copy travels to the host.

KV cache size: every token keeps a K and a V vector per layer and KV head, so
    bytes per token = 2 x num_layers x num_kv_heads x head_dim x bytes per element,
and the pool is as many blocks of `block_size` tokens as the memory left after weights and activations holds."""

import array
import logging
import os
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from nanoserve.attention import PAD_SLOT, prefill_tile_sizes
from nanoserve.config import EngineConfig
from nanoserve.cuda_graphs import DecodeGraphs
from nanoserve.kernels import get_kernels
from nanoserve.loader import build_model, checkpoint_dtype
from nanoserve.model import ModelArgs
from nanoserve.parallel import TP
from nanoserve.sampler import SampledLogprobs, Sampler, Samples
from nanoserve.sampling_params import InvalidField, SamplingParams
from nanoserve.scheduler import Step
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

if TYPE_CHECKING:
    from nanoserve.workers import Workers

logger = logging.getLogger("nanoserve")
CPU_KV_CACHE_BYTES = 1 << 30  # no GPU to profile: the KV pool gets 1 GiB of host memory (config.num_kvcache_blocks)
PROFILE_SAMPLING = SamplingParams(top_k=50, top_p=0.9, min_p=0.05, logprobs=1)  # the sampler's costliest path


def free_cores() -> int:
    """Cores this process may use that other processes are not busy on. On a CPU, more torch threads than free
    cores is ruinous: each parallel region waits for a thread that is not running (60 -> 1.4 tok/s measured)."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    if not os.path.exists("/proc/loadavg"):  # macOS: the last minute's average number of busy cores; Windows: none
        busy = round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
        return max(1, cores - busy)
    running = []
    for _ in range(5):  # Linux: processes running right now ("running/total"; less this one), fewest of 5 looks
        with open("/proc/loadavg") as f:
            running_and_total = f.read().split()[3]
        running.append(int(running_and_total.split("/")[0]) - 1)
        time.sleep(0.01)
    return max(1, cores - min(running))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")  # torch.bfloat16 -> bfloat16


def copy_to_host_async(samples: Samples) -> Samples:
    """A pinned host copy of the samples, queued behind the kernels that compute them: it waits for nothing."""

    def pinned_copy(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

    if samples.logprobs is None:
        return Samples(pinned_copy(samples.tokens))
    logprobs = samples.logprobs
    host_logprobs = SampledLogprobs(
        pinned_copy(logprobs.chosen), pinned_copy(logprobs.top_values), pinned_copy(logprobs.top_ids)
    )
    return Samples(pinned_copy(samples.tokens), host_logprobs)


class InFlightStep:
    """A launched step. Its samples stay on the device (the next step reads its decode inputs there), and their
    copy to the host is queued behind the step's kernels, so launching the next step need not wait for it."""

    def __init__(self, step: Step, samples: Samples | None) -> None:
        self.step = step
        sampling_seqs = step.sampling_seqs
        self.params = [seq.params for seq in sampling_seqs]
        self.row_of = {seq.seq_id: row for row, seq in enumerate(sampling_seqs)}  # seq -> row of its sample
        self.device_tokens = samples.tokens if samples is not None else None
        self.host_samples = samples  # a CPU's samples are already on the host
        self.ready = None  # on a GPU: the event after which the host copy is complete
        if samples is not None and samples.tokens.is_cuda:
            self.host_samples = copy_to_host_async(samples)
            self.ready = torch.cuda.current_stream().record_event()

    def wait(self) -> tuple[list[int], list[dict[int, float] | None] | None]:
        """The tokens (waiting for the GPU if needed) and, per row, {token: logprob} if any row asked for them:
        the chosen token's and the top-N, N as that row asked."""
        if self.ready is not None:
            self.ready.synchronize()
        if self.host_samples is None:
            return [], None
        tokens = self.host_samples.tokens.tolist()
        sampled_logprobs = self.host_samples.logprobs
        if sampled_logprobs is None:
            return tokens, None
        chosen = sampled_logprobs.chosen.tolist()
        top_values = sampled_logprobs.top_values.tolist()
        top_ids = sampled_logprobs.top_ids.tolist()
        logprobs = []
        for row, params in enumerate(self.params):
            if params.logprobs is None:
                logprobs.append(None)
                continue
            n = params.logprobs
            row_logprobs = dict(zip(top_ids[row][:n], top_values[row][:n], strict=True))
            row_logprobs[tokens[row]] = chosen[row]
            logprobs.append(row_logprobs)
        return tokens, logprobs


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_dir: str,
        hf_config: PretrainedConfig,
        args: ModelArgs,
        tp: TP = TP(),  # noqa: B008 (a frozen dataclass: one rank of one)
        workers: "Workers | None" = None,
    ) -> None:
        self.config = config
        self.args = args
        self.tp = tp
        self.workers = workers  # rank 0 of several: its handle on the other ranks
        self.device = torch.device(f"cuda:{tp.local_rank}" if config.device == "cuda" else "cpu")
        if self.device.type == "cpu":
            torch.set_num_threads(config.threads or max(1, free_cores() // tp.size))
        self.block_size = config.kvcache_block_size
        self.num_kv_heads = args.num_kv_heads // tp.size  # this rank's share
        max_blocks = -(-config.max_model_len // self.block_size)
        self.max_blocks_per_seq = round_up(max_blocks, BLOCK_TABLE_WIDTH_MULTIPLE)
        # 1) the model in the serving dtype, and the sampler
        self.kernels = get_kernels(config.kernels)
        self.dtype = config.torch_dtype(checkpoint_dtype(hf_config))
        self.model = build_model(args, model_dir, self.dtype, self.device, self.kernels, tp)
        self.sampler = Sampler(self.kernels)
        # 2) the KV cache: as many blocks as the memory left after a warm-up run of 1) holds
        if self.device.type == "cuda":
            self.warm_up()
        self.num_kvcache_blocks = config.num_kvcache_blocks or self.blocks_from_memory()
        if tp.size > 1:  # every rank holds the same blocks (its share of their heads): the fewest any rank fits
            fewest = torch.tensor([self.num_kvcache_blocks], device=self.device)
            dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
            self.num_kvcache_blocks = int(fewest)
        # [K or V, layer, block, slot, kv head (this rank's), head_dim], not zeroed: every slot is written before it is
        # read, and on a CPU memory pages are only taken as the cache fills
        self.kv_cache = torch.empty(
            2,
            args.num_layers,
            self.num_kvcache_blocks,
            self.block_size,
            self.num_kv_heads,
            args.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.kv_caches = [(self.kv_cache[0, i], self.kv_cache[1, i]) for i in range(args.num_layers)]
        logger.info(self.kv_account())
        # 3) the decode graphs, captured over that cache
        self.graphs = None
        if not config.enforce_eager:
            self.graphs = DecodeGraphs(
                self.model, self.kv_caches, config.max_num_seqs, self.max_blocks_per_seq, config.max_model_len
            )
            self.graphs.capture()

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()

    # ---- the KV cache -----------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        return self.args.kv_bytes_per_token(self.dtype, self.tp.size)  # this rank's share

    def kv_account(self) -> str:
        """One line: the per-token formula with this model's numbers, the pool's size, and what sized it."""
        args = self.args
        num_tokens = self.num_kvcache_blocks * self.block_size
        if self.config.num_kvcache_blocks:
            sized_by = "num_kvcache_blocks"
        elif self.device.type == "cpu":
            sized_by = "1 GiB of host memory on a CPU"
        else:
            sized_by = f"{self.config.gpu_memory_utilization:.0%} of the GPU less weights, activations"
        return (
            f"KV cache: 2 (K, V) x {args.num_layers} layers x {self.num_kv_heads} KV heads x {args.head_dim} "
            f"x {self.dtype.itemsize} bytes ({dtype_name(self.dtype)}) = {self.kv_bytes_per_token / 1024:.1f} KiB per "
            f"token; {self.num_kvcache_blocks} blocks x {self.block_size} = {num_tokens:,} tokens, "
            f"{num_tokens * self.kv_bytes_per_token / 2**30:.2f} GiB ({sized_by})"
        )

    def blocks_from_memory(self) -> int:
        block_bytes = self.kv_bytes_per_token * self.block_size
        # More blocks than every sequence at full length need only feed the prefix cache, and each costs a
        # Python object in the block manager: small models would otherwise get millions.
        enough = self.config.max_num_seqs * self.max_blocks_per_seq
        if self.device.type == "cpu":
            return min(CPU_KV_CACHE_BYTES // block_bytes, enough)
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
        """Before the KV cache exists: compile a prefill kernel per query-tile size (Triton compiles on first use: no
        request should wait for that), then run the biggest step the scheduler can make (max_num_batched_tokens of
        prefill; logits and the sampler's costliest path for max_num_seqs rows) to measure the memory left."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        for tile in prefill_tile_sizes():
            self._dummy_prefill([tile])
        config = self.config
        # the step budget of prompt tokens, cut into sequences no longer than max_model_len
        budget = config.max_num_batched_tokens
        seq_lens = [min(config.max_model_len, budget - i) for i in range(0, budget, config.max_model_len)]
        hidden = self._dummy_prefill(seq_lens)
        n = config.max_num_seqs
        logits = self.model.compute_logits(hidden[:1].expand(n, -1))
        self.sampler(logits, [PROFILE_SAMPLING] * n, [1] * n, [frozenset()] * n)  # the allocator counts at launch

    def _dummy_prefill(self, seq_lens: list[int]) -> torch.Tensor:
        """A prefill whose K/V go nowhere (padded slots, one zeroed scratch block): warm-up without the real cache."""
        num_tokens = sum(seq_lens)
        scratch = torch.zeros(
            2, 1, self.block_size, self.num_kv_heads, self.args.head_dim, dtype=self.dtype, device=self.device
        )
        query_start_loc = [0]
        for seq_len in seq_lens:
            query_start_loc.append(query_start_loc[-1] + seq_len)
        lists = StepLists(
            input_ids=[0] * num_tokens,
            positions=[0] * num_tokens,
            slot_mapping=[PAD_SLOT] * num_tokens,
            query_start_loc=query_start_loc,
            context_lens=seq_lens,
            block_tables=array.array("i", bytes(4 * len(seq_lens) * self.max_blocks_per_seq)),  # all block 0
            sample_rows=[0],
            pending_at=[],
            pending_rows=[],
            block_copies=[],
        )
        inputs = step_inputs(*upload(lists, self.device), previous_tokens=None)
        return self.model(inputs.input_ids, inputs.positions, [tuple(scratch)] * self.args.num_layers, inputs.meta)

    # ---- one step ---------------------------------------------------------------------------------
    def prepare(self, step: Step, previous: InFlightStep | None) -> StepLists:
        """The step flattened into integer lists (step_inputs.py)."""
        return flatten_step(step, self.block_size, previous)

    @torch.inference_mode()
    def launch(self, step: Step, previous: InFlightStep | None) -> InFlightStep:
        """Queue one step on the device and return without waiting for it. `previous`, the step launched before
        and maybe not yet read back, holds the values of this step's PENDING decode inputs."""
        header, flat = upload(self.prepare(step, previous), self.device)
        try:
            if self.workers is not None:  # tensor parallel: every rank runs the step; rank 0 samples
                self.workers.send_step(header, flat)  # the header as host ints: no copy to the device, no sync
            previous_tokens = previous.device_tokens if previous is not None else None
            logits = self.execute(header, flat, previous_tokens)
            if logits is None:
                return InFlightStep(step, None)
            sampling_seqs = step.sampling_seqs
            samples = self.sampler(
                logits,
                [seq.params for seq in sampling_seqs],
                [seq.num_tokens for seq in sampling_seqs],
                [banned_token_ids(seq) for seq in sampling_seqs],
            )
            if self.workers is not None:
                dist.broadcast(samples.tokens, 0)  # the workers' next decode inputs
            return InFlightStep(step, samples)
        except BaseException as error:  # Ctrl-C too: the workers may be waiting inside the step
            if self.workers is not None:
                self.workers.failed(error)  # raises, naming the rank at fault
            raise

    def execute(
        self, header: StepHeader, flat: torch.Tensor, previous_tokens: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Every rank: a step's forward pass (a graph replay if decode-only) and its sampling rows' logits (or None)."""
        inputs = step_inputs(header, flat, previous_tokens)
        if len(inputs.block_copies):  # copy-on-write: a fork's shared partial block, before the step writes into it
            source, destination = inputs.block_copies.unbind(1)
            self.kv_cache[:, :, destination] = self.kv_cache[:, :, source]  # [K or V, layer, block, ...]
        if inputs.meta.decode_only and self.graphs is not None:
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if len(inputs.sample_rows) == 0:
            return None
        return self.model.compute_logits(hidden[inputs.sample_rows])

    @torch.inference_mode()
    def run_worker_step(self, header: StepHeader, previous_tokens: torch.Tensor | None) -> torch.Tensor | None:
        """A worker rank's step, once rank 0 has sent its header (workers.py): receive the step's buffer, run it, and
        receive the tokens rank 0 sampled. Returns the tokens the next step's PENDING inputs come from."""
        flat = torch.empty(header.buffer_len(), dtype=torch.int32, device=self.device)
        dist.broadcast(flat, 0)
        logits = self.execute(header, flat, previous_tokens)
        if logits is None:  # nothing sampled: the previous samples stay the ones to read from
            return previous_tokens
        tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=self.device)
        dist.broadcast(tokens, 0)
        return tokens
