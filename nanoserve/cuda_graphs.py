"""CUDA graphs for decode. A decode step is hundreds of small kernels, and launching them one by one from Python costs
more than running them. So the decode forward is recorded once per batch size (1, 2, 4, 8, then every 16 up to
max_num_seqs) into graphs that share one memory pool and read their inputs from the same static buffers. A decode step
copies its inputs into those buffers and replays the smallest graph that fits: padded rows write no KV (PAD_SLOT) and
read none (context length 0)."""

import torch
from torch import Tensor

from nanoserve.attention import PAD_SLOT, AttentionMetadata
from nanoserve.model import CausalLM, KVCache
from nanoserve.step_inputs import INTS_PER_16_BYTES, round_up


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[KVCache],
        max_num_seqs: int,
        max_blocks_per_seq: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        # the batch sizes that get a graph: 1, 2, 4, 8, then every 16, and max_num_seqs itself
        smaller = (1, 2, 4, 8, *range(16, max_num_seqs, 16))
        self.sizes = [size for size in smaller if size < max_num_seqs] + [max_num_seqs]
        # the static input buffers every graph reads, max_num_seqs rows each. The four per-row ones are the rows of
        # one tensor, so a step fills them with one copy (its row length a multiple of 4 int32s: each row 16-byte
        # aligned, as step_inputs keeps its views, so the kernels compile no second variant)
        ints = {"dtype": torch.int32, "device": next(model.parameters()).device}
        self.per_row = torch.zeros(4, round_up(max_num_seqs, INTS_PER_16_BYTES), **ints)
        self.input_ids, self.positions, self.slot_mapping, self.context_lens = self.per_row
        self.slot_mapping.fill_(PAD_SLOT)  # the captures write no KV
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, **ints)
        self.query_start_loc = torch.arange(max_num_seqs + 1, **ints)  # one query per sequence
        # each graph's output [size, hidden_size]: the tensor its capture made (in the shared pool), which every replay
        # of that graph rewrites in place, so no copy into a static output buffer; valid until the next replay
        self.hidden = {}
        self.graphs = {}  # batch size -> its torch.cuda.CUDAGraph

    def forward(self, size: int) -> None:
        """The decode forward on the first `size` rows of the static buffers, its output kept as hidden[size]. A
        replay cannot change its grid: the decode kernel's grid depends on the batch size alone, and each sequence cuts
        its own context into the grid's splits, so a short context keeps every split busy."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            context_lens=self.context_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            decode_only=True,
        )
        input_ids = self.input_ids[:size]
        self.hidden[size] = self.model(input_ids, self.positions[:size], self.kv_caches, meta)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for size in reversed(self.sizes):  # largest first, so the smaller ones fit in its pool
            self.forward(size)  # warm-up: compiles kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.forward(size)
            self.graphs[size] = graph
            pool = graph.pool()  # the next (smaller) graph shares this one's memory
        torch.cuda.synchronize()

    def run(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        """Decode rows [num_seqs] -> hidden states [num_seqs, hidden_size], by replaying the graph of the next size
        up: the rows past num_seqs are padding."""
        num_seqs = len(input_ids)
        size = next(s for s in self.sizes if s >= num_seqs)
        rows = [input_ids, positions, meta.slot_mapping, meta.context_lens]
        self.per_row[:, :num_seqs] = torch.stack(rows)
        self.slot_mapping[num_seqs:size] = PAD_SLOT  # padded rows write nothing...
        self.context_lens[num_seqs:size] = 0  # ...and read nothing
        self.block_tables[:num_seqs, : meta.block_tables.shape[1]] = meta.block_tables
        self.graphs[size].replay()
        return self.hidden[size][:num_seqs]
