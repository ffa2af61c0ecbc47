"""The ModelRunner owns the model and its KV cache on the device. Each step it turns a ScheduledBatch
into flat tensors plus AttentionMetadata, runs the model (replaying a CUDA graph when the step is
decode-only), and samples. It sizes the KV cache from a memory profile unless told how many blocks.

KV cache size: every token keeps a K and a V vector per layer and KV head, so
    bytes per token = 2 x num_layers x num_kv_heads x head_dim x bytes per element,
and the pool is as many blocks of `block_size` tokens as the memory left after weights and activations holds.
"""
import array
import glob
import logging
import os

import torch
from safetensors import safe_open

from nanoserve.attention import MIN_DOT_ROWS, PAD_SLOT, PREFILL_TILE_M, AttentionMetadata
from nanoserve.config import EngineConfig
from nanoserve.model import CausalLM, ModelArgs, load_weights
from nanoserve.sampler import Sampled, Sampler
from nanoserve.sampling_params import SamplingParams
from nanoserve.scheduler import ScheduledBatch
from nanoserve.sequence import Sequence

logger = logging.getLogger("nanoserve")
CPU_KV_CACHE_BYTES = 1 << 30  # without a GPU to profile, give the KV cache 1 GiB of host memory
# Triton compiles a kernel variant per alignment of its pointer and integer arguments (divisible by 16
# or not): keeping every input view 16-byte aligned and block-table widths a multiple of 16 means one
# variant, compiled at warm-up rather than in the middle of a run.
INTS_PER_16_BYTES = 4
BLOCK_TABLE_WIDTH_MULTIPLE = 16
PROFILE_SAMPLING = SamplingParams(top_k=50, top_p=0.9, min_p=0.05, logprobs=1)  # the sampler's costliest path


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes that get a CUDA graph: 1, 2, 4, 8, then every 16; a step pads up to one."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def read_safetensors(model_dir: str):
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"model={model_dir!r} has no *.safetensors files")
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def build_model(args: ModelArgs, model_dir: str, dtype, device, use_triton: bool) -> CausalLM:
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are made in the serving dtype; RoPE tables stay fp32
    try:
        with torch.device(device):
            model = CausalLM(args, use_triton)
    finally:
        torch.set_default_dtype(default_dtype)
    load_weights(model, read_safetensors(model_dir))
    return model.eval()


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, model_dir: str, eos_token_ids: set[int]):
        self.config = config
        self.device = torch.device(config.device)
        checkpoint_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(checkpoint_dtype, str):
            checkpoint_dtype = getattr(torch, checkpoint_dtype, None)
        self.dtype = config.torch_dtype(checkpoint_dtype)
        self.args = ModelArgs.from_hf(hf_config)
        if config.max_model_len > self.args.max_position:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                             f"max_position_embeddings={self.args.max_position}")
        self.model = build_model(self.args, model_dir, self.dtype, self.device,
                                 config.kernels == "triton")
        self.eos_token_ids = eos_token_ids
        self.block_size = config.kvcache_block_size
        self.max_blocks_per_seq = round_up(-(-config.max_model_len // self.block_size), BLOCK_TABLE_WIDTH_MULTIPLE)
        self.sampler = Sampler(self.device, use_triton=config.kernels == "triton")  # profile_run samples
        self.num_kvcache_blocks = config.num_kvcache_blocks or self.blocks_from_memory()
        a = self.args
        # [K or V, layer, block, slot in block, kv head, head_dim]
        self.kv_cache = torch.zeros(2, a.num_layers, self.num_kvcache_blocks, self.block_size,
                                    a.num_kv_heads, a.head_dim, dtype=self.dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[0, i], self.kv_cache[1, i]) for i in range(a.num_layers)]
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB (%d bytes per token)",
                    self.num_kvcache_blocks, self.block_size, self.num_kvcache_blocks * self.block_size,
                    self.kv_cache.numel() * self.dtype.itemsize / 2**30, self.kv_bytes_per_token)
        if self.device.type == "cuda" and config.kernels == "triton":
            self.compile_kernels()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if not config.enforce_eager:
            self.capture_cudagraphs()

    @property
    def kv_bytes_per_token(self) -> int:
        a = self.args
        return 2 * a.num_layers * a.num_kv_heads * a.head_dim * self.dtype.itemsize

    # ---- KV cache sizing ------------------------------------------------------------------------
    def blocks_from_memory(self) -> int:
        block_bytes = self.kv_bytes_per_token * self.block_size
        # More blocks than every sequence at full length need only feed the prefix cache, and each
        # costs a Python object in the block manager: small models would otherwise get millions.
        enough = self.config.max_num_seqs * self.max_blocks_per_seq
        if self.device.type == "cpu":
            return min(CPU_KV_CACHE_BYTES // block_bytes, enough)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.profile_run()
        free, total = torch.cuda.mem_get_info()
        outside_torch = total - free - torch.cuda.memory_reserved()  # CUDA context, other processes
        peak = torch.cuda.max_memory_allocated()  # weights + the largest step's activations
        budget = total * self.config.gpu_memory_utilization - outside_torch - peak
        if budget < block_bytes:
            raise ValueError(f"gpu_memory_utilization={self.config.gpu_memory_utilization} leaves no "
                             f"memory for the KV cache (weights and activations take {peak / 2**30:.1f} GiB)")
        return min(int(budget // block_bytes), enough)

    @torch.inference_mode()
    def profile_run(self):
        """The biggest step the scheduler can make: max_num_batched_tokens of prefill, then logits and
        sampling for max_num_seqs rows."""
        cfg = self.config
        num_tokens = cfg.max_num_batched_tokens
        hidden = self._dummy_prefill([min(cfg.max_model_len, num_tokens - i)
                                      for i in range(0, num_tokens, cfg.max_model_len)])
        logits = self.model.compute_logits(hidden[:1].expand(cfg.max_num_seqs, -1))
        n = cfg.max_num_seqs
        self.sampler(logits, [PROFILE_SAMPLING] * n, [1] * n, [[]] * n)  # waits for the GPU

    @torch.inference_mode()
    def compile_kernels(self):
        """Triton compiles a kernel per constexpr set on first use. The prefill kernel has one per query-tile
        size (chosen from a step's longest query); build them all now, so no request waits for the compiler
        and no benchmark times it. Decode's are compiled by graph capture (enforce_eager: by the first decode)."""
        tile = MIN_DOT_ROWS
        while tile <= PREFILL_TILE_M:
            hidden = self._dummy_prefill([tile])
            tile *= 2
        self.sampler(self.model.compute_logits(hidden[:1]), [SamplingParams(temperature=1.0)], [1], [[]])

    def _dummy_prefill(self, seq_lens: list[int]) -> torch.Tensor:
        """A prefill of sequences of these lengths whose K/V go nowhere (padded slots; reads from one zeroed
        scratch block): for profiling and compiling without touching the real cache."""
        a = self.args
        num_tokens = sum(seq_lens)
        scratch = torch.zeros(2, 1, self.block_size, a.num_kv_heads, a.head_dim, dtype=self.dtype,
                              device=self.device)
        no_blocks = array.array("i", bytes(4 * len(seq_lens) * self.max_blocks_per_seq))
        ids, _, meta, _ = self._upload([0] * num_tokens, [0] * num_tokens, [PAD_SLOT] * num_tokens, seq_lens,
                                       seq_lens, no_blocks, [0])
        return self.model(ids, ids, [(scratch[0], scratch[1])] * a.num_layers, meta)

    # ---- one step ---------------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch):
        """Flatten the batch: token ids, positions and cache slots per token; per sequence, its query
        length, context length and block table (padded to the longest); and which rows' logits to sample."""
        bs = self.block_size
        input_ids, positions, slots, query_lens, context_lens, sample_rows = [], [], [], [], [], []
        pending_at, pending_rows = [], []  # input tokens whose values are still on the device, and their rows
        for seq, num_new in batch:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            if seq.num_pending:  # a decode of the token the previous step sampled: read it on the device
                assert num_new == 1 and start == seq.num_known_tokens, "only the oldest is input"
                pending_at.append(len(input_ids))
                pending_rows.append(self._last_sample_rows[seq.seq_id])
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            for first in range(start - start % bs, end, bs):  # block by block, not token by token
                base = seq.block_table[first // bs] * bs - first
                slots += range(base + max(start, first), base + min(end, first + bs))
            query_lens.append(num_new)
            context_lens.append(end)
            if end == seq.num_tokens:  # the chunk reaches the sequence's end: its logits pick a token
                sample_rows.append(len(input_ids) - 1)
        width = round_up(max(len(seq.block_table) for seq, _ in batch), BLOCK_TABLE_WIDTH_MULTIPLE)
        block_tables = array.array("i")
        padding = array.array("i", bytes(4 * width))
        for seq, _ in batch:  # int32 arrays: copied row by row, never converted entry by entry
            block_tables += seq.block_table
            block_tables += padding[:width - len(seq.block_table)]
        return self._upload(input_ids, positions, slots, query_lens, context_lens, block_tables, sample_rows,
                            pending_at, pending_rows)

    def _upload(self, input_ids, positions, slots, query_lens, context_lens, block_tables, logits_indices,
                pending_at=(), pending_rows=()):
        """All of a step's integer inputs in one int32 buffer and one host-to-device copy: per-element
        conversion and per-copy overhead are most of the host's work in a decode step."""
        query_start_loc = [0]
        for n in query_lens:
            query_start_loc.append(query_start_loc[-1] + n)
        parts = [input_ids, positions, slots, query_start_loc, context_lens, block_tables, logits_indices,
                 pending_at, pending_rows]
        flat = array.array("i")
        for part in parts:
            flat += part if isinstance(part, array.array) else array.array("i", part)
            flat += array.array("i", bytes(4 * (-len(flat) % INTS_PER_16_BYTES)))  # each view 16-byte aligned
        host = torch.frombuffer(flat, dtype=torch.int32)
        if self.device.type == "cuda":
            host = host.pin_memory()  # a pinned source lets the copy run asynchronously
        views = host.to(self.device, non_blocking=True).split([round_up(len(p), INTS_PER_16_BYTES) for p in parts])
        ids, pos, slot_mapping, qsl, ctx, tables, rows, at, from_rows = (v[:len(p)] for v, p in zip(views, parts))
        if pending_at:  # the previous step's samples, still on the device, become this step's inputs
            ids[at.long()] = self._last_sampled[from_rows.long()].int()
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, query_start_loc=qsl, context_lens=ctx,
            block_tables=tables.view(len(context_lens), -1), max_query_len=max(query_lens),
            max_context_len=max(context_lens), decode_only=max(query_lens) == 1)
        return ids, pos, meta, rows

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> tuple[list[Sequence], Sampled | None]:
        """Queue one step on the device and return without waiting for it: the sequences that sample a
        token (their computed tokens reach their end), in batch order, and their samples on the way back.
        Reads the sequences as scheduled, before Scheduler.launched() books the step."""
        input_ids, positions, meta, logits_indices = self.prepare(batch)
        if meta.decode_only and self.graphs:  # graphs exist up to max_num_seqs, the most a step holds
            hidden = self.replay_graph(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        sampling = [seq for seq, num_new in batch if seq.num_computed_tokens + num_new == seq.num_tokens]
        if not sampling:
            return [], None
        logits = self.model.compute_logits(hidden[logits_indices])
        sampled = self.sampler.sample(logits, [s.params for s in sampling], [s.num_tokens for s in sampling],
                                      [self._banned_tokens(s) for s in sampling])
        self._last_sampled = sampled.device_tokens  # the next step's decode inputs, without a round trip
        self._last_sample_rows = {seq.seq_id: row for row, seq in enumerate(sampling)}
        return sampling, sampled

    def _banned_tokens(self, seq) -> list[int]:
        """Before min_tokens, EOS and stop ids may not be chosen (vLLM's min_tokens)."""
        if seq.num_completion_tokens >= seq.params.min_tokens:
            return []
        eos = [] if seq.params.ignore_eos else list(self.eos_token_ids)
        return eos + seq.params.stop_token_ids

    # ---- CUDA graphs for decode ---------------------------------------------------------------------
    @torch.inference_mode()
    def capture_cudagraphs(self):
        """Record the decode forward once per batch size; replaying skips Python and launch overhead.
        All graphs share one memory pool and read their inputs from the same static buffers."""
        n = self.config.max_num_seqs
        dev = self.device
        self.graph_sizes = graph_batch_sizes(n)
        self.graph_in = dict(
            input_ids=torch.zeros(n, dtype=torch.int32, device=dev),
            positions=torch.zeros(n, dtype=torch.int32, device=dev),
            slot_mapping=torch.full((n,), PAD_SLOT, dtype=torch.int32, device=dev),
            context_lens=torch.zeros(n, dtype=torch.int32, device=dev),
            block_tables=torch.zeros(n, self.max_blocks_per_seq, dtype=torch.int32, device=dev),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev))
        self.graph_out = torch.zeros(n, self.args.hidden_size, dtype=self.dtype, device=dev)
        pool = None
        for size in reversed(self.graph_sizes):  # largest first, so smaller ones fit in its pool
            meta = self._graph_metadata(size)
            args = (self.graph_in["input_ids"][:size], self.graph_in["positions"][:size], self.kv_caches, meta)
            self.graph_out[:size] = self.model(*args)  # warm-up: compiles kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.graph_out[:size] = self.model(*args)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def _graph_metadata(self, size: int) -> AttentionMetadata:
        g = self.graph_in
        return AttentionMetadata(
            slot_mapping=g["slot_mapping"][:size], query_start_loc=g["query_start_loc"][:size + 1],
            context_lens=g["context_lens"][:size], block_tables=g["block_tables"][:size],
            max_query_len=1, max_context_len=self.config.max_model_len, decode_only=True)

    def replay_graph(self, input_ids, positions, meta: AttentionMetadata):
        b = input_ids.shape[0]
        size = next(s for s in self.graph_sizes if s >= b)
        g = self.graph_in
        g["input_ids"][:b] = input_ids
        g["positions"][:b] = positions
        g["slot_mapping"][:b] = meta.slot_mapping
        g["slot_mapping"][b:size] = PAD_SLOT  # padded rows write nothing...
        g["context_lens"][:b] = meta.context_lens
        g["context_lens"][b:size] = 0         # ...and read nothing
        g["block_tables"][:b, :meta.block_tables.shape[1]] = meta.block_tables
        self.graphs[size].replay()
        return self.graph_out[:b]
