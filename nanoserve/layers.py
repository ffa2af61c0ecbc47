"""The layers that hold the model's weights, and the one place their kind is chosen: the model asks a Layers object for
each projection and the embedding, and for the logits over the whole vocabulary. The core's Layers keeps every weight
whole, in one process. That is the extension point for tensor parallelism: ext/tp's ShardedLayers hands out layers
that each hold a rank's shard and join their partial results (Megatron-LM's column- and row-parallel layers), so the
model never knows how many processes run it.

Each parameter loads itself from the checkpoint (its `weight_loader`, which loader.load_weights calls): a merged
projection fills one shard per checkpoint tensor, a sharded layer takes its rank's slice."""

from torch import Tensor, nn


class MergedLinear(nn.Linear):
    """Several projections of one input in one matmul (q|k|v, gate|up; the LM head is a merge of one): the output
    features are the shards' sizes end to end, and the checkpoint, which stores each projection apart, fills one shard
    at a time. Fewer, larger matmuls: one read of the input instead of three."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias)
        self.shard_sizes = shard_sizes  # the model splits the output by these
        for param in self.parameters():
            param.weight_loader = self.load_shard

    def load_shard(self, param: nn.Parameter, tensor: Tensor, shard: int = 0) -> None:
        """Projection number `shard` (q, k, v: 0, 1, 2; gate, up: 0, 1) from its checkpoint tensor."""
        param.split(self.shard_sizes)[shard].copy_(tensor)


class Layers:
    """Layers that hold their weights whole: the model in one process."""

    size = 1  # processes each weight is split across; the KV cache holds num_kv_heads / size heads per process
    rank = 0  # this process's share among them

    def all_reduce(self, x: Tensor) -> Tensor:
        """x summed across the processes (one process: x itself), for a layer whose partial results add up (ext/moe's
        experts, split by their inner features as down is)."""
        return x

    def merged(self, in_features: int, shard_sizes: list[int], bias: bool) -> MergedLinear:
        """Projections that read the same input, fused (split by output features under ext/tp: column-parallel)."""
        return MergedLinear(in_features, shard_sizes, bias)

    def linear(self, in_features: int, out_features: int, bias: bool) -> nn.Linear:
        """A projection of the heads' or the MLP's features, o and down (split by input features under ext/tp, its
        partial products summed: row-parallel)."""
        return nn.Linear(in_features, out_features, bias)

    def embedding(self, vocab_size: int, dim: int) -> nn.Embedding:
        return nn.Embedding(vocab_size, dim)

    def whole_vocab(self, logits: Tensor) -> Tensor:
        """The LM head's output, [rows, vocab] here already (under ext/tp each rank has a slice of the vocabulary)."""
        return logits
