"""CUDA graphs for decode. A decode step is hundreds of small kernels, and launching them one by one from Python costs
more than running them. So the decode forward is recorded once per batch size (1, 2, 4, 8, then every 16 up to
max_num_seqs) into graphs that share one memory pool and read their inputs from the same static buffers. A decode step
copies its inputs into those buffers and replays the smallest graph that fits: padded rows write no KV (PAD_SLOT) and
read none (context length 0)."""

import torch

from nanoserve.attention import PAD_SLOT, AttentionMetadata


class DecodeGraphs:
    def __init__(self, model, kv_caches, max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int):
        self.model, self.kv_caches, self.max_model_len = model, kv_caches, max_model_len
        n, param = max_num_seqs, next(model.parameters())
        self.sizes = [s for s in (1, 2, 4, 8) if s < n] + list(range(16, n, 16)) + [n]  # batch sizes with a graph
        ints = {"dtype": torch.int32, "device": param.device}
        self.input_ids, self.positions = torch.zeros(n, **ints), torch.zeros(n, **ints)
        self.slot_mapping, self.context_lens = torch.full((n,), PAD_SLOT, **ints), torch.zeros(n, **ints)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, **ints)
        self.query_start_loc = torch.arange(n + 1, **ints)  # one query per sequence
        self.hidden = torch.zeros(n, model.args.hidden_size, dtype=param.dtype, device=param.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def forward(self, size: int):
        """The decode forward on the first `size` rows of the static buffers; a replay cannot change its grid, so
        attention is sized for max_model_len."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            context_lens=self.context_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_context_len=self.max_model_len,
            decode_only=True,
        )
        self.hidden[:size] = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)

    @torch.inference_mode()
    def capture(self):
        pool = None
        for size in reversed(self.sizes):  # largest first, so the smaller ones fit in its pool
            self.forward(size)  # warm-up: compiles kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.forward(size)
            pool, self.graphs[size] = graph.pool(), graph
        torch.cuda.synchronize()

    def run(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Decode rows [b] -> hidden states [b, hidden_size], by replaying the graph of the next size up."""
        b = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= b)
        self.input_ids[:b], self.positions[:b] = input_ids, positions
        self.slot_mapping[:b] = meta.slot_mapping
        self.slot_mapping[b:size] = PAD_SLOT  # padded rows write nothing...
        self.context_lens[:b] = meta.context_lens
        self.context_lens[b:size] = 0  # ...and read nothing
        self.block_tables[:b, : meta.block_tables.shape[1]] = meta.block_tables
        self.graphs[size].replay()
        return self.hidden[:b]
