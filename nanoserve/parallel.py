"""Tensor parallelism (Megatron-LM style) over torch.distributed: one model split across N processes, one per GPU (NCCL;
gloo on CPUs). Each rank holds 1/N of every projection and of the KV cache's heads, and runs every step:
  - q|k|v and gate|up are column-parallel: each rank computes its share of the heads and of the MLP's width;
  - o and down are row-parallel: each rank multiplies its share, and one all-reduce sums the partial outputs;
  - the embedding and the LM head split the vocabulary: each rank embeds the ids it owns (an all-reduce joins
    them), and the logits' slices are gathered so that rank 0 can sample.
This file holds the layers, which the model, the loader and the runner import; the processes that run the ranks are in
workers.py. With one rank nothing communicates."""

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class TP:
    rank: int = 0
    size: int = 1
    local_rank: int = 0  # this rank's GPU among its machine's (torchrun's LOCAL_RANK)

    def load_slice(self, param: Tensor, tensor: Tensor, dim: int = 0) -> None:
        """A weight_loader (how a parameter copies its part of a checkpoint tensor, under load_weights' no_grad):
        this rank's 1/size slice of the tensor along dim."""
        param.copy_(tensor.chunk(self.size, dim)[self.rank])


class ColumnParallelLinear(nn.Linear):
    """Output features split across ranks. It may fuse several projections of one input (q|k|v): each is split
    alike, and the checkpoint fills them one shard at a time."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool, tp: TP) -> None:
        self.shard_sizes = [size // tp.size for size in shard_sizes]
        super().__init__(in_features, sum(self.shard_sizes), bias)
        self.tp = tp
        for param in self.parameters():
            param.weight_loader = self.load_shard

    def load_shard(self, param: nn.Parameter, tensor: Tensor, shard: int = 0) -> None:
        """Fused projection number `shard` (q, k, v: 0, 1, 2; gate, up: 0, 1): this rank's rows of it."""
        self.tp.load_slice(param.split(self.shard_sizes)[shard], tensor)


class RowParallelLinear(nn.Linear):
    """Input features split across ranks: each computes a partial product, and one all-reduce sums them."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TP) -> None:
        super().__init__(in_features // tp.size, out_features, bias)
        self.tp = tp
        self.weight.weight_loader = partial(tp.load_slice, dim=1)

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias if self.tp.rank == 0 else None)  # rank 0's bias: once in the sum
        if self.tp.size > 1:
            dist.all_reduce(y)
        return y


class VocabParallelEmbedding(nn.Embedding):
    """Each rank holds the rows of a 1/N slice of the vocabulary; ids outside it embed to 0 before the all-reduce."""

    def __init__(self, vocab_size: int, dim: int, tp: TP) -> None:
        super().__init__(vocab_size // tp.size, dim)
        self.tp = tp
        self.weight.weight_loader = tp.load_slice

    def forward(self, ids: Tensor) -> Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.tp.rank * self.num_embeddings  # ids as rows of this rank's slice
        mine = (local >= 0) & (local < self.num_embeddings)
        x = super().forward(local * mine) * mine[:, None]  # ids not mine look up row 0, then are zeroed
        dist.all_reduce(x)
        return x


def gather_vocab(logits: Tensor, tp: TP) -> Tensor:
    """[rows, vocab / N] on each rank -> [rows, vocab] on every rank."""
    if tp.size == 1:
        return logits
    slices = [torch.empty_like(logits) for _ in range(tp.size)]
    dist.all_gather(slices, logits)
    return torch.cat(slices, dim=-1)
