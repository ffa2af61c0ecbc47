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
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.distributed as dist

from nanoserve.attention import MIN_DOT_ROWS, PAD_SLOT, PREFILL_TILE_M, AttentionMetadata
from nanoserve.config import EngineConfig
from nanoserve.cuda_graphs import DecodeGraphs
from nanoserve.kernels import get_kernels
from nanoserve.loader import build_model, checkpoint_dtype
from nanoserve.model import ModelArgs
from nanoserve.parallel import HEADER_LEN, TP, Workers
from nanoserve.sampler import Sampler
from nanoserve.sampling_params import InvalidField, SamplingParams
from nanoserve.scheduler import Step
from nanoserve.sequence import PENDING
from nanoserve.stopping import banned_token_ids

logger = logging.getLogger("nanoserve")
CPU_KV_CACHE_BYTES = 1 << 30  # no GPU to profile: the KV pool gets 1 GiB of host memory (config.num_kvcache_blocks)
# Triton compiles a kernel variant per alignment of its pointer and integer arguments (divisible by 16 or not):
# keeping every input view 16-byte aligned and block-table widths a multiple of 16 means one variant, compiled
# at start-up rather than in the middle of a run.
INTS_PER_16_BYTES, BLOCK_TABLE_WIDTH_MULTIPLE = 4, 16
NUM_PARTS = 9  # integer lists a step uploads (prepare's), in one buffer
PROFILE_SAMPLING = SamplingParams(top_k=50, top_p=0.9, min_p=0.05, logprobs=1)  # the sampler's costliest path


def free_cores() -> int:
    """Cores this process may use that other processes are not busy on. On a CPU, more torch threads than free
    cores is ruinous: each parallel region waits for a thread that is not running (60 -> 1.4 tok/s measured)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if not os.path.exists("/proc/loadavg"):  # macOS: the last minute's average number of busy cores; Windows: none
        return max(1, cores - round(os.getloadavg()[0] if hasattr(os, "getloadavg") else 0))
    running = []
    for _ in range(5):  # Linux: processes running right now ("running/total"; less this one), fewest of 5 looks
        with open("/proc/loadavg") as f:
            running.append(int(f.read().split()[3].split("/")[0]) - 1)
        time.sleep(0.01)
    return max(1, cores - min(running))


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int32
    positions: torch.Tensor  # [num_tokens] int32
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sampling] int32: rows of the hidden states whose logits pick a token


class InFlightStep:
    """A launched step. Its samples stay on the device (the next step reads its decode inputs there), and their
    copy to the host is queued behind the step's kernels, so launching the next step need not wait for it."""

    def __init__(self, step: Step, samples: list[torch.Tensor]):
        self.step, self.params = step, [seq.params for seq in step.sampling]
        self.row_of = {seq.seq_id: row for row, seq in enumerate(step.sampling)}  # seq -> row of its sample
        self.device_tokens, self.host, self.ready = (samples[0] if samples else None), samples, None
        if samples and samples[0].is_cuda:
            self.host = [
                torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in samples
            ]
            self.ready = torch.cuda.current_stream().record_event()

    def wait(self) -> tuple[list[int], list[dict | None] | None]:
        """The tokens (waiting for the GPU if needed) and, per row, {token: logprob} if any row asked for them."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens = self.host[0].tolist() if self.host else []
        if len(self.host) < 2:
            return tokens, None
        chosen, top_lp, top_ids = (t.tolist() for t in self.host[1:])
        return tokens, [
            None
            if p.logprobs is None
            else {**dict(zip(top_ids[r][: p.logprobs], top_lp[r][: p.logprobs], strict=False)), tokens[r]: chosen[r]}
            for r, p in enumerate(self.params)
        ]


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_dir: str,
        hf_config,
        args: ModelArgs,
        tp: TP = TP(),
        workers: Workers | None = None,
    ):
        self.config, self.args, self.tp, self.workers = config, args, tp, workers  # workers: rank 0 of several
        self.device = torch.device(f"cuda:{tp.rank}" if config.device == "cuda" else "cpu")
        if self.device.type == "cpu":
            torch.set_num_threads(config.threads or max(1, free_cores() // tp.size))
        self.block_size, self.num_kv_heads = config.kvcache_block_size, args.num_kv_heads // tp.size  # this rank's
        self.max_blocks_per_seq = round_up(-(-config.max_model_len // self.block_size), BLOCK_TABLE_WIDTH_MULTIPLE)
        # 1) the model in the serving dtype, and the sampler
        self.kernels, self.dtype = get_kernels(config.kernels), config.torch_dtype(checkpoint_dtype(hf_config))
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

    @classmethod
    def start(cls, config: EngineConfig, model_dir: str, hf_config, args: ModelArgs) -> "ModelRunner":
        """Rank 0's runner; with tensor parallelism it first starts ranks 1..N-1 (parallel.py)."""
        workers = Workers(config, model_dir) if config.tensor_parallel_size > 1 else None
        try:
            return cls(config, model_dir, hf_config, args, TP(0, config.tensor_parallel_size), workers)
        except BaseException as error:
            if workers is not None:
                workers.failed(error)  # raises, naming the rank at fault
            raise

    def close(self):
        if self.workers is not None:
            self.workers.close()

    # ---- the KV cache -----------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.args.num_layers * self.num_kv_heads * self.args.head_dim * self.dtype.itemsize

    def kv_account(self) -> str:
        a, tokens, cfg = self.args, self.num_kvcache_blocks * self.block_size, self.config
        why = (
            "num_kvcache_blocks"
            if cfg.num_kvcache_blocks
            else "1 GiB of host memory on a CPU"
            if self.device.type == "cpu"
            else f"{cfg.gpu_memory_utilization:.0%} of the GPU less weights, activations"
        )
        return (
            f"KV cache: 2 (K, V) x {a.num_layers} layers x {self.num_kv_heads} KV heads x {a.head_dim} "
            f"x {self.dtype.itemsize} bytes ({str(self.dtype)[6:]}) = {self.kv_bytes_per_token / 1024:.1f} KiB per "
            f"token; {self.num_kvcache_blocks} blocks x {self.block_size} = {tokens:,} tokens, "
            f"{tokens * self.kv_bytes_per_token / 2**30:.2f} GiB ({why})"
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
    def warm_up(self):
        """Before the KV cache exists: compile a prefill kernel per query-tile size (Triton compiles on first use: no
        request should wait for that), then run the biggest step the scheduler can make (max_num_batched_tokens of
        prefill; logits and the sampler's costliest path for max_num_seqs rows) to measure the memory left."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        for tile in (MIN_DOT_ROWS << i for i in range((PREFILL_TILE_M // MIN_DOT_ROWS).bit_length())):  # 16 ... 128
            self._dummy_prefill([tile])
        cfg, n = self.config, self.config.max_num_seqs
        hidden = self._dummy_prefill(
            [
                min(cfg.max_model_len, cfg.max_num_batched_tokens - i)
                for i in range(0, cfg.max_num_batched_tokens, cfg.max_model_len)
            ]
        )
        logits = self.model.compute_logits(hidden[:1].expand(n, -1))
        self.sampler(logits, [PROFILE_SAMPLING] * n, [1] * n, [frozenset()] * n)  # the allocator counts at launch

    def _dummy_prefill(self, seq_lens: list[int]) -> torch.Tensor:
        """A prefill whose K/V go nowhere (padded slots, one zeroed scratch block): warm-up without the real cache."""
        num_tokens = sum(seq_lens)
        scratch = torch.zeros(
            2, 1, self.block_size, self.num_kv_heads, self.args.head_dim, dtype=self.dtype, device=self.device
        )
        no_blocks = array.array("i", bytes(4 * len(seq_lens) * self.max_blocks_per_seq))
        header, flat = self._upload(
            [[0] * num_tokens, [0] * num_tokens, [PAD_SLOT] * num_tokens, seq_lens, seq_lens, no_blocks, [0], [], []]
        )
        inputs = self._inputs(header, flat, None)
        return self.model(inputs.input_ids, inputs.positions, [tuple(scratch)] * self.args.num_layers, inputs.meta)

    # ---- one step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, step: Step, previous: InFlightStep | None) -> InFlightStep:
        """Queue one step on the device and return without waiting for it. `previous`, the step launched before
        and maybe not yet read back, holds the values of this step's PENDING decode inputs."""
        header, flat = self._upload(self.prepare(step, previous))
        try:
            if self.workers is not None:  # tensor parallel: every rank runs the step; rank 0 samples
                self.workers.send_step(torch.tensor(header, device=self.device), flat)
            logits = self.execute(header, flat, previous.device_tokens if previous else None)
            if logits is None:
                return InFlightStep(step, [])
            sampling = step.sampling
            samples = self.sampler(
                logits,
                [s.params for s in sampling],
                [s.num_tokens for s in sampling],
                [banned_token_ids(s) for s in sampling],
            )
            if self.workers is not None:
                dist.broadcast(samples[0], 0)  # the workers' next decode inputs
            return InFlightStep(step, samples)
        except BaseException as error:  # Ctrl-C too: the workers may be waiting inside the step
            if self.workers is not None:
                self.workers.failed(error)  # raises, naming the rank at fault
            raise

    def execute(self, header: list[int], flat: torch.Tensor, previous_tokens: torch.Tensor | None):
        """Every rank: a step's forward pass (a graph replay if decode-only) and its sampling rows' logits (or None)."""
        inputs = self._inputs(header, flat, previous_tokens)
        if inputs.meta.decode_only and self.graphs is not None:
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        return self.model.compute_logits(hidden[inputs.sample_rows]) if len(inputs.sample_rows) else None

    @torch.inference_mode()
    def serve_steps(self, wake):
        """A worker rank's loop: woken by rank 0 for each step (parallel.Workers), receive its inputs and run it."""
        tokens = None  # the last step's samples, broadcast by rank 0: the next step's PENDING inputs
        while wake.recv_bytes() == b"s":
            header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
            dist.broadcast(header, 0)
            header = header.tolist()
            flat = torch.empty(
                sum(round_up(n, INTS_PER_16_BYTES) for n in header[:NUM_PARTS]), dtype=torch.int32, device=self.device
            )
            dist.broadcast(flat, 0)
            logits = self.execute(header, flat, tokens)
            if logits is not None:
                tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=self.device)
                dist.broadcast(tokens, 0)

    def prepare(self, step: Step, previous: InFlightStep | None) -> list:
        """Flatten the step: per token its id, position and cache slot; per sequence its query length, context
        length and block table (padded to the longest); the rows whose logits are sampled; and the inputs whose
        values are still on the device (PENDING decode inputs) with the rows of `previous` that hold them."""
        bs = self.block_size
        input_ids, positions, slots, query_lens, context_lens, sample_rows = [], [], [], [], [], []
        pending_at, pending_rows = [], []
        for s in step.scheduled:
            seq, start, end = s.seq, s.start, s.start + s.num_new_tokens
            if seq.token_ids[start] == PENDING:  # a decode of the token the previous step sampled
                pending_at.append(len(input_ids))
                pending_rows.append(previous.row_of[seq.seq_id])
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            for first in range(start - start % bs, end, bs):  # block by block, not token by token
                base = seq.block_table[first // bs] * bs - first
                slots += range(base + max(start, first), base + min(end, first + bs))
            query_lens.append(s.num_new_tokens)
            context_lens.append(end)
            if s.samples:
                sample_rows.append(len(input_ids) - 1)
        width = round_up(max(len(s.seq.block_table) for s in step.scheduled), BLOCK_TABLE_WIDTH_MULTIPLE)
        block_tables, padding = array.array("i"), array.array("i", bytes(4 * width))
        for s in step.scheduled:  # int32 arrays: copied row by row, never converted entry by entry
            block_tables += s.seq.block_table
            block_tables += padding[: width - len(s.seq.block_table)]
        return [
            input_ids,
            positions,
            slots,
            query_lens,
            context_lens,
            block_tables,
            sample_rows,
            pending_at,
            pending_rows,
        ]

    def _upload(self, parts: list) -> tuple[list[int], torch.Tensor]:
        """All of a step's integer inputs in one int32 buffer and one host-to-device copy: per-element conversion
        and per-copy overhead are most of the host's work in a decode step. The header says how to cut it up."""
        query_lens, context_lens = parts[3], parts[4]
        parts[3] = [0, *accumulate(query_lens)]  # query lengths -> query_start_loc
        flat = array.array("i")
        for part in parts:
            flat += part if isinstance(part, array.array) else array.array("i", part)
            flat += array.array("i", bytes(4 * (-len(flat) % INTS_PER_16_BYTES)))  # each view 16-byte aligned
        host = torch.frombuffer(flat, dtype=torch.int32)
        if self.device.type == "cuda":
            host = host.pin_memory()  # a pinned source lets the copy run asynchronously
        header = [*map(len, parts), max(query_lens), max(context_lens)]
        return header, host.to(self.device, non_blocking=True)

    def _inputs(self, header: list[int], flat: torch.Tensor, previous_tokens: torch.Tensor | None) -> StepInputs:
        """Views into the uploaded buffer; PENDING decode inputs filled in on the device from the last step's tokens."""
        lengths, (max_query_len, max_context_len) = header[:NUM_PARTS], header[NUM_PARTS:]
        views = flat.split([round_up(n, INTS_PER_16_BYTES) for n in lengths])
        ids, pos, slot_mapping, qsl, ctx, tables, rows, at, from_rows = (
            v[:n] for v, n in zip(views, lengths, strict=False)
        )
        if len(at):
            ids[at.long()] = previous_tokens[from_rows.long()].int()
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=qsl,
            context_lens=ctx,
            block_tables=tables.view(len(ctx), -1),
            max_query_len=max_query_len,
            max_context_len=max_context_len,
            decode_only=max_query_len == 1,
        )
        return StepInputs(ids, pos, meta, rows)
