"""One decoder for the Llama family: Llama (SmolLM2, Llama 3), Qwen2 (bias on q/k/v) and Qwen3
(RMSNorm on each head of q and k before RoPE). The differences are three flags in ModelArgs.

The model knows nothing of scheduling: a step's tokens arrive flattened ([num_tokens]), with their
positions, the per-layer KV caches and the AttentionMetadata that says which sequence each token is in.
Projections that read the same input are fused (q|k|v, gate|up): fewer, larger matmuls. With Triton on,
the elementwise work between them runs as fused kernels (fused_ops.py); the PyTorch code here is their reference.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve import attention, fused_ops
from nanoserve.attention import AttentionMetadata

SUPPORTED = ("llama", "qwen2", "qwen3")


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
    rope_scaling: dict | None       # Llama 3's frequency rescaling, when the config has it
    tie_word_embeddings: bool
    qkv_bias: bool                  # Qwen2
    o_bias: bool
    qk_norm: bool                   # Qwen3

    @classmethod
    def from_hf(cls, cfg) -> "ModelArgs":
        if cfg.model_type not in SUPPORTED:
            raise ValueError(f"model_type={cfg.model_type!r} is not supported (supported: {SUPPORTED})")
        # transformers 5 keeps rope settings in rope_parameters; older configs use rope_theta/rope_scaling
        rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope_type={rope_type!r} is not supported (default, llama3)")
        bias = getattr(cfg, "attention_bias", False)
        return cls(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            rms_norm_eps=cfg.rms_norm_eps, max_position=cfg.max_position_embeddings,
            rope_theta=rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)),
            rope_scaling=rope if rope_type == "llama3" else None,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=cfg.model_type == "qwen2" or bias, o_bias=cfg.model_type != "qwen2" and bias,
            qk_norm=cfg.model_type == "qwen3",
        )


class RMSNorm(nn.Module):
    """weight * x / rms(x). Given the residual stream it first adds x into it, fused with the norm (one kernel on
    GPU). Returns (normed, stream): stream = x + residual, or x itself when there is no residual yet. The Triton
    path writes the sum into `residual` in place, so the stream must be a tensor the model owns."""
    def __init__(self, dim: int, eps: float, use_triton: bool = False):
        super().__init__()
        self.eps, self.use_triton = eps, use_triton
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, residual=None):
        if self.use_triton:
            return fused_ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        xf = x.float()  # the mean of squares in fp32, as the reference does, whatever the model dtype
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype), x


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    inv_freq = 1.0 / args.rope_theta ** (torch.arange(0, args.head_dim, 2).float() / args.head_dim)
    s = args.rope_scaling
    if s is None:
        return inv_freq
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old_len = s["original_max_position_embeddings"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    blend = ((old_len / wavelen - low) / (high - low)).clamp(0, 1)
    return (1 - blend) * inv_freq / s["factor"] + blend * inv_freq


class Rotary(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        freqs = torch.outer(torch.arange(args.max_position).float(), rope_inv_freq(args))
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_position, head_dim / 2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions, x):  # x: [num_tokens, heads, head_dim], rotate-half layout
        cos = self.cos[positions].unsqueeze(1)  # [num_tokens, 1, head_dim / 2]
        sin = self.sin[positions].unsqueeze(1)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class MergedLinear(nn.Linear):
    """Several projections of the same input in one matmul; checkpoints load them one shard at a time."""
    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes

    def load_shard(self, index: int, param_name: str, tensor: torch.Tensor):
        start = sum(self.shard_sizes[:index])
        getattr(self, param_name).data[start:start + self.shard_sizes[index]].copy_(tensor)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, use_triton: bool):
        super().__init__()
        self.use_triton = use_triton  # Triton kernels on GPU; the PyTorch reference on CPU
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = MergedLinear(args.hidden_size, [q_size, kv_size, kv_size], args.qkv_bias)
        self.o_proj = nn.Linear(q_size, args.hidden_size, bias=args.o_bias)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.scale = args.head_dim ** -0.5

    def forward(self, x, positions, rotary, kv_cache, meta: AttentionMetadata):
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.shard_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)     # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.position_encode(q, k, positions, rotary)
        k_cache, v_cache = kv_cache
        if self.use_triton:
            attention.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            o = attention.paged_attention(q, k_cache, v_cache, meta, self.scale)
        else:
            attention.store_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping)
            o = attention.paged_attention_ref(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.flatten(1))

    def position_encode(self, q, k, positions, rotary):
        """RoPE on q and k; Qwen3 first RMS-normalises each of their heads. On GPU, one in-place kernel."""
        if self.use_triton and self.q_norm is None:
            return fused_ops.qk_norm_rope(q, k, positions, rotary.cos, rotary.sin)
        if self.use_triton:
            return fused_ops.qk_norm_rope(q, k, positions, rotary.cos, rotary.sin, self.q_norm.weight,
                                          self.k_norm.weight, self.q_norm.eps)
        if self.q_norm is not None:
            q, k = self.q_norm(q)[0], self.k_norm(k)[0]
        return rotary(positions, q), rotary(positions, k)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, use_triton: bool):
        super().__init__()
        self.use_triton = use_triton
        self.gate_up_proj = MergedLinear(args.hidden_size, [args.intermediate_size] * 2, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.use_triton:
            return self.down_proj(fused_ops.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, use_triton: bool):
        super().__init__()
        self.self_attn = Attention(args, use_triton)
        self.mlp = MLP(args, use_triton)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, use_triton)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, use_triton)

    def forward(self, h, residual, positions, rotary, kv_cache, meta):
        """h: the previous sublayer's output, not yet added to the residual stream (layer 0: the embeddings,
        and no stream yet). Each add is fused into the norm after it. Returns (mlp output, stream)."""
        h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, positions, rotary, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, use_triton: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, use_triton) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, use_triton)


class CausalLM(nn.Module):
    """Module names follow the HF checkpoints (model.layers.0.self_attn...), so weights load by name."""
    def __init__(self, args: ModelArgs, use_triton: bool = False):
        super().__init__()
        self.args = args
        self.model = Transformer(args, use_triton)
        self.rotary = Rotary(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata):
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        h, residual = self.model.embed_tokens(input_ids), None  # a fresh tensor: the stream may overwrite it
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h, residual = layer(h, residual, positions, self.rotary, kv_cache, meta)
        return self.model.norm(h, residual)[0]

    def compute_logits(self, hidden):
        return self.lm_head(hidden)  # [num_rows, vocab_size], model dtype: the sampler reads it in fp32


PACKED_SHARDS = {  # checkpoint projection -> (our fused projection, shard index)
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def load_weights(model: CausalLM, tensors):
    """tensors: iterable of (HF name, tensor). Unfused names copy straight; fused ones fill a shard."""
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    loaded = set()
    for name, tensor in tensors:
        module_name, _, param_name = name.rpartition(".")
        *parent, proj = module_name.split(".")
        if proj in PACKED_SHARDS:
            fused, shard = PACKED_SHARDS[proj]
            modules[".".join(parent + [fused])].load_shard(shard, param_name, tensor)
            loaded.add(".".join(parent + [fused, param_name]))
        elif name in params:
            params[name].data.copy_(tensor)
            loaded.add(name)
        elif name.endswith("rotary_emb.inv_freq"):
            continue  # older checkpoints store RoPE frequencies; we compute them
        else:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
    if model.args.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint lacks {sorted(missing)[:5]}")
