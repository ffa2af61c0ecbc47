"""Tensor parallelism's layers (Megatron-LM style) over torch.distributed: one model split across N processes, one per
GPU (NCCL; gloo on CPUs). Each rank holds 1/N of every projection and of the KV cache's heads, and runs every step:
  - q|k|v and gate|up are column-parallel: each rank computes its share of the heads and of the MLP's width;
  - o and down are row-parallel: each rank multiplies its share, and one all-reduce sums the partial outputs;
  - the embedding and the LM head split the vocabulary: each rank embeds the ids it owns (an all-reduce joins
    them), and the logits' slices are gathered so that rank 0 can sample.
ShardedLayers hands these to the model in place of the core's whole layers (layers.py): the model is the same code.
The processes that run the ranks are in workers.py."""

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from nanoserve.layers import Layers, MergedLinear


@dataclass(frozen=True)
class TP:
    rank: int = 0
    size: int = 1
    local_rank: int = 0  # this rank's GPU among its machine's (torchrun's LOCAL_RANK)

    def load_slice(self, param: Tensor, tensor: Tensor, dim: int = 0) -> None:
        """A weight_loader (how a parameter copies its part of a checkpoint tensor, under load_weights' no_grad):
        this rank's 1/size slice of the tensor along dim."""
        param.copy_(tensor.chunk(self.size, dim)[self.rank])


class ColumnParallelLinear(MergedLinear):
    """Output features split across ranks. It may fuse several projections of one input (q|k|v): each is split
    alike, and the checkpoint fills them one shard at a time."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool, tp: TP) -> None:
        super().__init__(in_features, [size // tp.size for size in shard_sizes], bias)
        self.tp = tp

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
        dist.all_reduce(y)
        return y


class VocabParallelEmbedding(nn.Embedding):
    """Each rank holds the rows of a 1/N slice of the vocabulary; ids outside it embed to 0 before the all-reduce."""

    def __init__(self, vocab_size: int, dim: int, tp: TP) -> None:
        super().__init__(vocab_size // tp.size, dim)
        self.tp = tp
        self.weight.weight_loader = tp.load_slice

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.tp.rank * self.num_embeddings  # ids as rows of this rank's slice
        mine = (local >= 0) & (local < self.num_embeddings)
        x = super().forward(local * mine) * mine[:, None]  # ids not mine look up row 0, then are zeroed
        dist.all_reduce(x)
        return x


class ShardedLayers(Layers):
    """The layers of one rank of tp.size (the model asks for them as it asks the core's Layers)."""

    def __init__(self, tp: TP) -> None:
        self.tp = tp
        self.size = tp.size
        self.rank = tp.rank

    def all_reduce(self, x: Tensor) -> Tensor:
        dist.all_reduce(x)
        return x

    def merged(self, in_features: int, shard_sizes: list[int], bias: bool) -> MergedLinear:
        return ColumnParallelLinear(in_features, shard_sizes, bias, self.tp)

    def linear(self, in_features: int, out_features: int, bias: bool) -> nn.Linear:
        return RowParallelLinear(in_features, out_features, bias, self.tp)

    def embedding(self, vocab_size: int, dim: int) -> nn.Embedding:
        return VocabParallelEmbedding(vocab_size, dim, self.tp)

    def whole_vocab(self, logits: Tensor) -> Tensor:
        """[rows, vocab / N] on each rank -> [rows, vocab] on every rank."""
        slices = [torch.empty_like(logits) for _ in range(self.tp.size)]
        dist.all_gather(slices, logits)
        return torch.cat(slices, dim=-1)
