"""An extension: mixture-of-experts models, Qwen3-MoE (Qwen3MoeForCausalLM) and Mixtral (MixtralForCausalLM). The core
finds it by config.json's model_type (ext/__init__.py's MODEL_TYPES) and asks model_family() for the ModelArgs of these
models: the dense decoder (attention, norms, RoPE: the core's) whose MLP, in the layers that route, is a block of
experts. Each token goes to the k of E experts its router scores highest, and its MLP output is their weighted sum
(kernels.py: route, group by expert, the fused kernel; its reference beside it).

    layer i routes (SparseMoeBlock) where: Mixtral: every layer; Qwen3-MoE: i not in mlp_only_layers and
    (i + 1) % decoder_sparse_step == 0 (the others: the core's dense MLP, intermediate_size wide)

The checkpoints store each expert's gate, up and down projections apart (Qwen3-MoE: mlp.experts.{e}.gate_proj, ...;
Mixtral: block_sparse_moe.experts.{e}.w1 / w3 / w2); the loader copies each into its place in two stacked parameters
per layer, once, at load: w13_weight [E, 2 x inner, hidden] (each expert's gate rows, then its up rows) and w2_weight
[E, hidden, inner], the layout the kernel reads. The router (gate) is a plain projection, whole on every rank.

Tensor parallelism (ext/tp) shards every expert as the core's dense MLP is sharded: gate|up by output features
(column-parallel), down by input features (row-parallel), so each rank holds 1/N of every expert's inner features, the
router whole; every rank routes every token alike, runs its share, and one all-reduce (Layers.all_reduce) sums the
partial outputs. Expert parallelism (whole experts per rank) would need the same all-reduce, but its work per rank
follows the router: a rank whose experts are popular in a step is the step's slowest; sharded, the ranks' work is
always equal, and the model's code is the same for 1 and N ranks.

What else works with these models: the prefix cache, chunked prefill and preemption (the experts hold no state across
tokens), speculative decoding (a draft's tokens are routed as any others), the latency kernels and cascade attention
(they change attention and the dense projections; the experts keep this extension's kernel), LoRA on the attention
projections and on a Qwen3-MoE's dense layers (a routing layer has no gate/up/down projection to adapt: ext/lora
refuses an adapter of the experts by name, lora_request, as it refuses PEFT's)."""

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from nanoserve.checks import InvalidField, shown
from nanoserve.ext.moe.kernels import fused_moe, fused_moe_ref, route
from nanoserve.kernels import Kernels
from nanoserve.layers import Layers
from nanoserve.model import CausalLM, ModelArgs, Place

# per model_type: the MoE block's name in the checkpoint, and each expert's gate, up and down projections' names
CHECKPOINT_NAMES = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
}
# config.json's options that change how a routing layer computes, and the values nanoserve implements (softmax over
# the experts, the greedy top k, no shared expert, SiLU experts): another value (DeepSeek's sigmoid scores, grouped
# top-k, a routed scaling factor, Qwen2-MoE's shared expert) is refused by name. An option a config leaves out is fine.
ROUTING_OPTIONS = {
    "scoring_func": ("softmax",),
    "topk_method": ("greedy",),
    "n_group": (1,),
    "topk_group": (1,),
    "routed_scaling_factor": (1.0,),
    "n_shared_experts": (0,),
    "shared_expert_intermediate_size": (0,),
    "norm_topk_prob": (True, False),
    "hidden_act": ("silu",),
}


def model_family() -> type[ModelArgs]:
    """The ModelArgs of every model_type this extension serves (ModelArgs.from_hf asks)."""
    return MoEArgs


def check_routing(cfg: PretrainedConfig) -> None:
    """The config's routing options, each one nanoserve implements (ROUTING_OPTIONS), k within 1 and E, and no
    sliding window: an InvalidField("model") naming the option otherwise."""
    for name, implemented in ROUTING_OPTIONS.items():
        value = getattr(cfg, name, None)
        if value is not None and value not in implemented:
            raise InvalidField("model", f"config.json's {name}={shown(value)}: nanoserve routes with {implemented}")
    if not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
        raise InvalidField(
            "model", f"num_experts_per_tok={cfg.num_experts_per_tok} is not within 1 and num_experts={cfg.num_experts}"
        )
    window = getattr(cfg, "sliding_window", None)
    if window is not None and window < cfg.max_position_embeddings:
        raise InvalidField("model", f"config.json's sliding_window={window}: sliding-window attention is not supported")


@dataclass(kw_only=True)
class MoEArgs(ModelArgs):
    """ModelArgs of a mixture-of-experts model: the dense decoder's, and its experts'."""

    model_type: str  # "qwen3_moe" or "mixtral": the checkpoint's names (CHECKPOINT_NAMES)
    num_experts: int  # E
    num_experts_per_tok: int  # k: the experts each token goes to
    moe_intermediate_size: int  # each expert's inner features (a dense layer's: intermediate_size)
    norm_topk_prob: bool  # the k router weights rescaled to sum to 1
    sparse_layers: tuple[int, ...]  # the decoder layers that route (the others: the core's dense MLP)

    @staticmethod
    def extra_fields(cfg: PretrainedConfig) -> dict:
        check_routing(cfg)
        num_layers = cfg.num_hidden_layers
        fields = {
            "model_type": cfg.model_type,
            "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
        }
        if cfg.model_type == "mixtral":  # every layer routes, k weights always renormalised; no QK-norm
            return fields | {
                "moe_intermediate_size": cfg.intermediate_size,
                "norm_topk_prob": True,
                "sparse_layers": tuple(range(num_layers)),
                "head_dim": cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads,  # null in Mixtral's configs
            }
        routing = []  # transformers' rule
        for i in range(num_layers):
            if i not in cfg.mlp_only_layers and (i + 1) % cfg.decoder_sparse_step == 0:
                routing.append(i)
        return fields | {
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "norm_topk_prob": cfg.norm_topk_prob,
            "sparse_layers": tuple(routing),
            "qk_norm": True,  # Qwen3's per-head norms
        }

    def mlp(self, index: int, kernels: Kernels, layers: Layers) -> nn.Module:
        if index in self.sparse_layers:
            return SparseMoeBlock(self, kernels, layers)
        return super().mlp(index, kernels, layers)

    def checkpoint_places(self, model: CausalLM) -> dict[str, Place]:
        """The dense places, where each routing layer's router takes its checkpoint name and each expert's gate, up
        and down projections their places in the stacked parameters: (expert, shard) of w13_weight, (expert,) of
        w2_weight."""
        places = super().checkpoint_places(model)
        block_name, gate, up, down = CHECKPOINT_NAMES[self.model_type]
        for i in self.sparse_layers:
            block = model.model.layers[i].mlp
            ours = f"model.layers.{i}.mlp."
            theirs = f"model.layers.{i}.{block_name}."
            places[theirs + "gate.weight"] = places.pop(ours + "gate.weight")
            del places[ours + "w13_weight"], places[ours + "w2_weight"]
            for e in range(self.num_experts):
                expert = f"{theirs}experts.{e}."
                places[f"{expert}{gate}.weight"] = (block.w13_weight, (e, 0))
                places[f"{expert}{up}.weight"] = (block.w13_weight, (e, 1))
                places[f"{expert}{down}.weight"] = (block.w2_weight, (e,))
        return places


class SparseMoeBlock(nn.Module):
    """A routing layer's MLP: the router (gate), then every token through its k experts (kernels.py), summed with the
    router's weights. Under tensor parallelism this rank holds 1/N of each expert's inner features, and one all-reduce
    sums the ranks' partial outputs, as the dense MLP's down projection does."""

    def __init__(self, args: MoEArgs, kernels: Kernels, layers: Layers) -> None:
        super().__init__()
        if args.moe_intermediate_size % layers.size:
            raise InvalidField(
                "tensor_parallel_size",
                f"does not divide the experts' moe_intermediate_size={args.moe_intermediate_size}",
            )
        self.layers = layers  # this rank's place, and the all-reduce
        self.inner = args.moe_intermediate_size // layers.size  # this rank's share of each expert's features
        self.top_k = args.num_experts_per_tok
        self.renormalize = args.norm_topk_prob
        num_experts, hidden = args.num_experts, args.hidden_size
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router: [E, hidden], whole on every rank
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.inner, hidden))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, self.inner))
        self.w13_weight.weight_loader = self.load_gate_up
        self.w2_weight.weight_loader = self.load_down
        # chosen once, here: the Triton kernel with the Triton backend, else the reference
        self.experts = fused_moe if kernels.name == "triton" else fused_moe_ref

    def load_gate_up(self, param: nn.Parameter, tensor: Tensor, expert: int, shard: int) -> None:
        """An expert's gate (shard 0) or up (1) projection [moe_intermediate, hidden]: this rank's rows of it."""
        rows = tensor.chunk(self.layers.size, 0)[self.layers.rank]
        first = shard * self.inner  # gate's rows, then up's
        param[expert, first : first + self.inner].copy_(rows)

    def load_down(self, param: nn.Parameter, tensor: Tensor, expert: int) -> None:
        """An expert's down projection [hidden, moe_intermediate]: this rank's columns of it."""
        columns = tensor.chunk(self.layers.size, 1)[self.layers.rank]
        param[expert].copy_(columns)

    def forward(self, x: Tensor) -> Tensor:
        """x [num_tokens, hidden] -> [num_tokens, hidden]."""
        weights, experts = route(self.gate(x), self.top_k, self.renormalize)  # [num_tokens, k] each
        out = self.experts(x, self.w13_weight, self.w2_weight, weights, experts)
        return self.layers.all_reduce(out)
