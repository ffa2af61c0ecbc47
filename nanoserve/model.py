"""One decoder for the Llama family: Llama (SmolLM2, Llama 3), Qwen2 (bias on q/k/v) and Qwen3 (RMSNorm on each head of
q and k before RoPE). The differences are three flags in ModelArgs.

The model knows nothing of scheduling: a step's tokens arrive flattened ([num_tokens]), with their positions, the
per-layer KV caches and the AttentionMetadata that says which sequence each token is in. Projections that read the same
input are fused (q|k|v, gate|up): fewer, larger matmuls. The work between them (add + RMSNorm, QK-norm + RoPE, SiLU x
up, the KV store and paged attention) goes to the kernels chosen when the model is built (kernels.py): Triton, or the
PyTorch references. The layers that hold the weights come from a Layers object (layers.py), chosen when the model is
built too: whole in one process, or sharded across several (ext/tp)."""

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from nanoserve.attention import AttentionMetadata
from nanoserve.checks import InvalidField
from nanoserve.ext import MODEL_TYPES, load
from nanoserve.kernels import Kernels
from nanoserve.layers import Layers

SUPPORTED = ("llama", "qwen2", "qwen3")
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}  # ours -> HF's shards
KVCache = tuple[Tensor, Tensor]  # one layer's (K cache, V cache)
# a checkpoint tensor's place in the model: (our parameter, the arguments its weight_loader takes after the tensor)
Place = tuple[nn.Parameter, tuple]
# wrap_projections' callback: (layer index or None for the LM head, the projection's name, the projection) -> module
ProjectionWrapper = Callable[[int | None, str, nn.Module], nn.Module]


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope_theta: float
    rope_scaling: dict | None  # Llama 3's frequency rescaling, when the config has it
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2
    o_bias: bool
    qk_norm: bool  # Qwen3
    # the checkpoint's quantized weight format, which makes the projections that hold such weights (ext/quantization),
    # or None: 16-bit weights
    quantization: object = None

    def kv_bytes_per_token(self, dtype: torch.dtype, num_ranks: int = 1) -> int:
        """Every token keeps a K and a V vector per layer and KV head: 2 x layers x KV heads x head_dim x bytes per
        element. dtype is the KV cache's: the model's, or float8 (1 byte) with kv_cache_dtype="fp8". With tensor
        parallelism each of num_ranks ranks holds its share of the heads."""
        return 2 * self.num_layers * (self.num_kv_heads // num_ranks) * self.head_dim * dtype.itemsize

    def mlp(self, index: int, kernels: Kernels, layers: Layers) -> nn.Module:
        """Decoder layer `index`'s MLP. A model family of an extension says otherwise (ext/moe: routed experts)."""
        return MLP(self, kernels, layers)

    def checkpoint_places(self, model: "CausalLM") -> dict[str, Place]:
        """Where each checkpoint tensor goes, by its HF name: every parameter is one tensor of its own name, but in
        our fused projections (FUSED), where q, k and v each fill their shard of qkv_proj, gate and up theirs of
        gate_up_proj. A model family of an extension adds its own (ext/moe: each expert's slice of stacked weights)."""
        places = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            proj = name.split(".")[-2]  # model.layers.0.self_attn.qkv_proj.weight: qkv_proj
            if proj in FUSED:  # model.layers.0.self_attn.q_proj.weight fills shard 0 of its qkv_proj.weight, ...
                for index, part in enumerate(FUSED[proj]):
                    places[name.replace(proj, part)] = (param, (index,))
            else:
                places[name] = (param, ())
        return places

    @staticmethod
    def extra_fields(cfg: PretrainedConfig) -> dict:
        """A model family's own fields from the HF config, beyond the dense ones (and any dense one it sets itself)."""
        return {}

    @classmethod
    def from_hf(cls, cfg: PretrainedConfig) -> "ModelArgs":
        family = cls  # the dense decoder, or an extension's family (ext/__init__.py's MODEL_TYPES)
        if cfg.model_type in MODEL_TYPES:
            family = load(MODEL_TYPES[cfg.model_type], "model").model_family()
        elif cfg.model_type not in SUPPORTED:
            raise InvalidField("model", f"model_type {cfg.model_type!r} is not supported (supported: {SUPPORTED})")
        # transformers 5 gathers RoPE's settings (rope_type, rope_theta and any scaling) in rope_parameters, whatever
        # the config.json says (old rope_scaling / rope_theta fields are moved there when the config is read)
        rope = cfg.rope_parameters
        rope_type = rope["rope_type"]
        if rope_type not in ("default", "llama3"):
            raise InvalidField("model", f"rope_type {rope_type!r} is not supported (default, llama3)")
        rope_scaling = None
        if rope_type == "llama3":
            rope_scaling = rope
        bias = getattr(cfg, "attention_bias", False)
        fields = {
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_layers": cfg.num_hidden_layers,
            "num_heads": cfg.num_attention_heads,
            "num_kv_heads": cfg.num_key_value_heads,  # transformers sets it to num_attention_heads when not given
            "head_dim": getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads),  # Qwen2 has none
            "rms_norm_eps": cfg.rms_norm_eps,
            "max_position": cfg.max_position_embeddings,
            "rope_theta": rope["rope_theta"],
            "rope_scaling": rope_scaling,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "qk_norm": cfg.model_type == "qwen3",
            "qkv_bias": cfg.model_type == "qwen2" or bias,  # Qwen2's config has no attention_bias: q, k, v only
            "o_bias": bias,
        }
        return family(**fields | family.extra_fields(cfg))


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm module for its weight and eps, so that the checkpoint's name (input_layernorm.weight) finds
    the weight, with the residual stream's forward: it adds a sublayer's output into the stream, then RMS-normalises
    the sum: forward(x, residual) -> (RMSNorm(x + residual) * weight, x + residual). The kernel table's add_rms_norm
    does both (the fused Triton one, ext/fused_kernels.py, writes the sum into `residual` in place), so the stream is
    a tensor the model owns."""

    def __init__(self, args: ModelArgs, kernels: Kernels) -> None:
        super().__init__(args.hidden_size, args.rms_norm_eps)  # every one normalises the residual stream
        self.kernels = kernels

    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)


class Rotary(nn.Module):
    """RoPE's cos and sin for every position, [max_position, head_dim / 2] in fp32, shared by all layers. With Llama
    3's frequency rescaling (args.rope_scaling), long wavelengths are slowed `factor` times, short ones kept, and those
    in between blended smoothly."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        exponents = torch.arange(0, args.head_dim, 2).float() / args.head_dim  # [head_dim / 2]
        inv_freq = 1.0 / args.rope_theta**exponents
        if scaling := args.rope_scaling:  # Llama 3
            low = scaling["low_freq_factor"]
            high = scaling["high_freq_factor"]
            wavelen = 2 * math.pi / inv_freq
            # how many wavelengths fit the original context, mapped onto 0 (slowed) ... 1 (kept)
            fits = scaling["original_max_position_embeddings"] / wavelen
            blend = ((fits - low) / (high - low)).clamp(0, 1)
            inv_freq = (1 - blend) * inv_freq / scaling["factor"] + blend * inv_freq
        freqs = torch.outer(torch.arange(args.max_position).float(), inv_freq)  # [max_position, head_dim / 2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, kernels: Kernels, layers: Layers) -> None:
        super().__init__()
        self.kernels = kernels
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        q_size = args.num_heads * args.head_dim  # the whole model's (sharded layers hold 1/layers.size of the heads)
        kv_size = args.num_kv_heads * args.head_dim
        self.qkv_proj = layers.merged(args.hidden_size, [q_size, kv_size, kv_size], args.qkv_bias)
        self.o_proj = layers.linear(q_size, args.hidden_size, args.o_bias)
        # Qwen3's per-head norms of q and k: modules for their weights' checkpoint names, never called: the kernel
        # table's qk_norm_rope_store_kv reads their weight and eps (qk_norm_args)
        self.qk_norm_args = ()
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(args.head_dim, args.rms_norm_eps)
            self.qk_norm_args = (self.q_norm.weight, self.k_norm.weight, args.rms_norm_eps)

    def forward(
        self, x: Tensor, positions: Tensor, rotary: Rotary, kv_cache: KVCache, meta: AttentionMetadata
    ) -> Tensor:
        qkv = self.qkv_proj(x).split(self.qkv_proj.shard_sizes, dim=-1)  # [num_tokens, q | k | v] (this rank's heads)
        # each [num_tokens, its heads, head_dim]: views into the one projection, which the kernel rotates in place
        q, k, v = [part.unflatten(-1, (-1, self.head_dim)) for part in qkv]
        # q and k rotated, and all of the step's K/V stored (into kv_cache: K cache, V cache), in one kernel, before
        # any is read: a sequence may read blocks another sequence computes in this same step (a shared prefix
        # admitted together)
        rotation = (positions, rotary.cos, rotary.sin, *kv_cache, meta.slot_mapping, *self.qk_norm_args)
        q = self.kernels.qk_norm_rope_store_kv(q, k, v, *rotation)
        o = self.kernels.paged_attention(q, *kv_cache, meta, self.scale)
        return self.o_proj(o.flatten(1))


class MLP(nn.Module):
    """The gated MLP, down(silu(gate) * up), with gate|up fused into one projection. Its submodules' names
    (mlp.gate_up_proj, mlp.down_proj) find the checkpoint's weights."""

    def __init__(self, args: ModelArgs, kernels: Kernels, layers: Layers) -> None:
        super().__init__()
        self.kernels = kernels
        self.gate_up_proj = layers.merged(args.hidden_size, [args.intermediate_size] * 2, False)
        self.down_proj = layers.linear(args.intermediate_size, args.hidden_size, False)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 x intermediate]: gate | up
        return self.down_proj(self.kernels.silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, kernels: Kernels, layers: Layers, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(args, kernels, layers)
        self.mlp = args.mlp(index, kernels, layers)
        self.input_layernorm = RMSNorm(args, kernels)
        self.post_attention_layernorm = RMSNorm(args, kernels)

    def forward(
        self,
        x: Tensor,
        residual: Tensor,
        positions: Tensor,
        rotary: Rotary,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[Tensor, Tensor]:
        """The residual stream of a pre-norm layer, written plainly:
            h = x + attn(norm(x))
            out = h + mlp(norm(h))
        Here each add is fused into the norm after it, so x arrives as the previous sublayer's output not yet
        added (layer 0: the embeddings, added to an empty stream), and leaves as the MLP's output, added by the
        next layer's first norm (or the model's final one)."""
        h, residual = self.input_layernorm(x, residual)  # residual = x + residual (the h above); h = norm of it
        attn_out = self.self_attn(h, positions, rotary, kv_cache, meta)
        h, residual = self.post_attention_layernorm(attn_out, residual)  # residual += attn(...); h = norm of it
        return self.mlp(h), residual


# a decoder layer's projections, as (its submodule, the projection's name there)
PROJECTIONS = (
    ("self_attn", "qkv_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_up_proj"),
    ("mlp", "down_proj"),
)


class CausalLM(nn.Module):
    """Module names follow the HF checkpoints (model.layers.0.self_attn...), so weights load by name: `model` is only
    a ModuleDict of the decoder's parts, whose forward is this class's. `layers` makes the layers that hold the
    weights (layers.py): whole by default; sharded, one share per rank, under tensor parallelism (ext/tp)."""

    def __init__(self, args: ModelArgs, kernels: Kernels, layers: Layers | None = None) -> None:
        super().__init__()
        self.args = args
        layers = layers or Layers()
        if args.quantization is not None:  # quantized weights: the format makes the projections (ext/quantization)
            layers = args.quantization.layers(layers)
        self.kernels = kernels  # the table every layer calls (replace_kernels changes it everywhere at once)
        self.layout = layers  # how the weights are held; its whole_vocab joins the LM head's output
        self.model = nn.ModuleDict(
            {
                "embed_tokens": layers.embedding(args.vocab_size, args.hidden_size),
                "layers": nn.ModuleList([DecoderLayer(args, kernels, layers, i) for i in range(args.num_layers)]),
                "norm": RMSNorm(args, kernels),
            }
        )
        self.rotary = Rotary(args)
        self.lm_head = layers.merged(args.hidden_size, [args.vocab_size], False)  # sharded: over the vocab
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: Tensor, positions: Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        x = self.model.embed_tokens(input_ids)
        residual = torch.zeros_like(x)  # the residual stream starts empty: layer 0's add gives the embeddings
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, self.rotary, kv_cache, meta)
        hidden, _ = self.model.norm(x, residual)  # the last MLP's output added, then the final norm (stream dropped)
        return hidden

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[num_rows, hidden_size] -> [num_rows, vocab_size] in the model dtype, the whole vocabulary on every rank."""
        return self.layout.whole_vocab(self.lm_head(hidden))

    # ---- two extension points, for an extension's start(), before the decode graphs are captured -------------------
    def wrap_projections(self, wrap: "ProjectionWrapper") -> None:
        """Replace each projection by wrap(layer index, name, projection): every decoder layer's (PROJECTIONS), then
        the LM head's (index None, name "lm_head"). wrap returns the module to use instead (its own wrapper around the
        projection it is given, which keeps the parameters and their checkpoint names), or the projection itself to
        leave it alone. Extensions that wrap (ext/latency: a weight read for few rows; ext/lora: each row's adapter)
        call this in their start(), which runs before the engine captures its decode graphs."""
        for index, layer in enumerate(self.model.layers):
            for part, name in PROJECTIONS:
                owner = getattr(layer, part)
                if hasattr(owner, name):  # (a layer of routed experts has no gate_up_proj: ext/moe)
                    owner.register_module(name, wrap(index, name, getattr(owner, name)))
        self.lm_head = wrap(None, "lm_head", self.lm_head)

    def replace_kernels(self, **changes: Callable) -> None:
        """Use a kernel table with `changes` (Kernels' fields by name) in every module of the model, from now on: an
        extension's kernel in place of the core's (ext/cascade.py: paged attention; ext/latency: its own decode
        attention, and SiLU-and-mul moved into the down projection). In an extension's start(), before the decode
        graphs are captured."""
        self.kernels = replace(self.kernels, **changes)
        for module in self.modules():
            if isinstance(module, (Attention, MLP, RMSNorm)):
                module.kernels = self.kernels
