"""An extension's second half: what rides in the few-row GEMV's loads and in its epilogue (ext/gemv.py is the weight
read itself; its start() calls fuse_into_layers here, so these come with `small_batch_gemv=True`, not under LoRA,
whose adapters read what the fusions no longer produce). Each removes a kernel launch per decoder layer from a step of
a few rows, where a launch (~1.5-2.5 us inside a CUDA graph, plus its gap) costs as much as the work it does:
  1. SiLU-and-mul into the down projection's input load: the layer's kernel table hands the MLP's gate|up on whole
     (`gate_and_up`), and the down projection's GEMV forms silu(gate) * up as it loads x;
  2. the residual add and RMSNorm before q|k|v and before gate|up, into those projections' loads: the layer's norm hands
     on a NormedRows (its two inputs, nothing computed), and the projection's programs each first read the whole rows of
     x + residual (4 KiB a row at Qwen3-0.6B's width, from L2) for their mean square, then form
     RMSNorm(x + residual) * weight as they load each tile; program (0, 0) also writes x + residual, the next residual
     stream, into a fresh tensor (the other programs are still reading the old one). Every program redoing the mean
     square reads, per row, a quarter to an eighth of the bytes of its weight slice again (from L2, not memory): cheap
     beside a ~1.6 us launch for a row or a few, not for 16, so only steps of at most NORM_MAX_ROWS rows do it;
  3. Qwen3's QK-norm, RoPE and the K/V store, into q|k|v's epilogue (`RotatingAttention`): each tile of q|k|v's GEMV,
     once written, arrives on one more counter, and the program whose tile is the grid's last to be written norms and
     rotates every q and k head of every row in place and stores the rows' K and V into their cache slots, as
     fused_ops' QK-norm + RoPE + store kernel does for one token (its _norm_rope_heads, on the GEMV's output). The
     arrival is acquire-release at GPU scope after a barrier, as the split-K handshake's: the tiles other programs wrote
     are visible to the last one. The rows are done one after another in that one program, a few L2 round trips each,
     while the kernel it saves runs every row at once, so only steps of at most ROTATE_MAX_ROWS rows do it.
The kernel's side of each (its SILU_INPUT, NORM_INPUT and ROTATE variants) is in ext/gemv.py's _gemv_kernel; what here
changes is the layers' wiring, and the PyTorch references the GEMV's reference applies."""

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch import Tensor, nn

from nanoserve.attention import PAD_SLOT, AttentionMetadata
from nanoserve.fused_ops import add_rms_norm_ref, qk_norm_rope_store_kv_ref
from nanoserve.model import Attention, KVCache, Rotary
from nanoserve.triton_shim import triton

NORM_MAX_ROWS = 4  # rows whose add + RMSNorm the GEMV forms in its load (more: the norm's own kernel; see 2 above)
# the widest rows whose mean square the GEMV takes: its loop over a row's tiles is unrolled to keep their loads in
# flight together, and the registers grow with the width (sm_90, bf16, triton 3.6: 90 at 1,024, 134 at 4,096, 214 at
# 8,192, where only 2 programs fit an SM): wider rows are left to the norm's own kernel until a GPU run says otherwise
NORM_MAX_WIDTH = 4096
# rows whose QK-norm + RoPE and K/V store q|k|v's GEMV does in its last program (see 3 above): that tail grows by a
# row's few L2 round trips per row, while the kernel it saves (~2.5 us and its gap in a graph) takes every row at once,
# so the crossover lies at a few rows; 2 keeps it to batches of 1-2 until a GPU run measures it
ROTATE_MAX_ROWS = 2


def fuse_into_layers(model: nn.Module) -> None:
    """Every decoder layer of the model, whose projections ext/gemv.py has wrapped: SiLU-and-mul into its down
    projection, its norms into q|k|v and gate|up (rows up to NORM_MAX_WIDTH wide), the rotation and K/V store into
    q|k|v (the layer's attention becomes a RotatingAttention: the same module and weights)."""
    for layer in model.model.layers:
        fuse_silu_into_down(layer)
        if model.args.hidden_size <= NORM_MAX_WIDTH:
            fuse_norms_into_projections(layer)
        layer.self_attn.__class__ = RotatingAttention


def fuse_silu_into_down(layer: nn.Module) -> None:
    """The layer's SiLU-and-mul moves into its down projection's input load: the layer's kernel table hands the MLP's
    gate|up on whole (`gate_and_up`), and the down projection's wrapper applies SiLU-and-mul to it, inside the GEMV's
    load for few rows (one launch fewer per layer), or with the table's own kernel before cuBLAS for more."""
    layer.mlp.down_proj.silu_and_mul = layer.kernels.silu_and_mul
    layer.kernels = replace(layer.kernels, silu_and_mul=gate_and_up)


def gate_and_up(x: Tensor) -> Tensor:
    """The kernel table's SiLU-and-mul in a layer whose down projection applies it: gate|up, unchanged."""
    return x


def fuse_norms_into_projections(layer: nn.Module) -> None:
    """The layer's two add + RMSNorms move into the projections that read their outputs: input_layernorm's into q|k|v,
    post_attention_layernorm's into gate|up (for at most NORM_MAX_ROWS rows; with more, each norm runs its own
    kernel, as before)."""
    layer.input_layernorm = NormIntoProjection(layer.input_layernorm)
    layer.post_attention_layernorm = NormIntoProjection(layer.post_attention_layernorm)


def fed_by_norms(model: nn.Module) -> list[nn.Module]:
    """The projections that take a NormedRows: q|k|v and gate|up of each layer whose norms moved into them."""
    layers = [layer for layer in model.model.layers if isinstance(layer.input_layernorm, NormIntoProjection)]
    return [proj for layer in layers for proj in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj)]


@dataclass
class NormedRows:
    """A norm's output not yet computed, handed to the projection that reads it: the input is RMSNorm(x + residual) *
    weight, and x + residual (the next residual stream) goes into `stream`, written by the projection's GEMV."""

    x: Tensor  # [rows, hidden]: the previous sublayer's output
    residual: Tensor  # [rows, hidden]: the stream before it (read, never written)
    stream: Tensor  # [rows, hidden]: the stream after it, written by the projection
    weight: Tensor  # [hidden]: the norm's
    eps: float

    def __len__(self) -> int:
        return len(self.x)


class NormIntoProjection(nn.Module):
    """A decoder layer's add + RMSNorm (model.RMSNorm: forward(x, residual) -> (normed, stream)) that, for at most
    NORM_MAX_ROWS rows, computes nothing: it returns a NormedRows for the next projection's GEMV, and the fresh stream
    tensor the GEMV writes (the model carries it to the next norm, which runs after that GEMV).
    What this asks of the layer (model.DecoderLayer.forward, Attention.forward): the normed output goes to one
    projection and nowhere else, and the stream is read only after that projection has run. Both hold in the core's
    layer; a change there that reads the norm's output or the stream elsewhere must drop this fusion."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor | NormedRows, Tensor]:
        if len(x) > NORM_MAX_ROWS:
            return self.norm(x, residual)
        stream = torch.empty_like(residual)
        return NormedRows(x, residual, stream, self.norm.weight, self.norm.eps), stream


def normed_input_ref(x: NormedRows) -> Tensor:
    """A NormedRows' input in PyTorch: its add + RMSNorm (fused_ops' reference), the stream written."""
    normed, stream = add_rms_norm_ref(x.x, x.residual, x.weight, x.eps)
    x.stream.copy_(stream)
    return normed


class Rotation(NamedTuple):
    """What q|k|v's GEMV needs to do the layer's QK-norm + RoPE and K/V store itself: the arguments of
    fused_ops.qk_norm_rope_store_kv that follow q, k and v (the GEMV's output), in its order."""

    positions: Tensor  # [rows]
    cos: Tensor  # [max_position, head_dim / 2] fp32
    sin: Tensor
    k_cache: Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: Tensor
    slot_mapping: Tensor  # [rows]: each row's K/V slot (PAD_SLOT: none)
    q_weight: Tensor | None = None  # Qwen3's QK-norm weights and eps (None: no QK-norm)
    k_weight: Tensor | None = None
    eps: float = 0.0

    def heads(self, y: Tensor) -> list[Tensor]:
        """y [rows, q | k | v] as q, k and v, views [rows, heads, head_dim]."""
        head_dim = 2 * self.cos.shape[1]
        kv = self.k_cache.shape[2] * head_dim
        return [part.unflatten(-1, (-1, head_dim)) for part in y.split([y.shape[1] - 2 * kv, kv, kv], -1)]


def rotate_and_store_ref(y: Tensor, rotation: Rotation) -> None:
    """The rotation in PyTorch, on q|k|v's output y: its q heads normed and rotated in place, K and V stored."""
    q, k, v = rotation.heads(y)
    q.copy_(qk_norm_rope_store_kv_ref(q, k, v, *rotation))


def rotation_launch(rotation: Rotation | None, y: Tensor) -> tuple[tuple, dict]:
    """What ext/gemv.py's kernel takes of a Rotation: its fields, the caches' block, slot and head strides and the head
    counts; and its compile-time sizes: half a head, the head counts padded to powers of two, the cache's block size.
    Without one: placeholders, never read, and 1s (one build)."""
    if rotation is None:
        sizes = {"ROTATE": False, "HALF": 1, "Q_HEADS_PAD": 1, "K_HEADS_PAD": 1, "CACHE_BLOCK": 1}
        return (y,) * 6 + (None, None, 0.0) + (0,) * 5, sizes
    q, k, _ = rotation.heads(y)
    sizes = {"ROTATE": True, "HALF": q.shape[2] // 2, "CACHE_BLOCK": rotation.k_cache.shape[1]}
    sizes |= {"Q_HEADS_PAD": triton.next_power_of_2(q.shape[1]), "K_HEADS_PAD": triton.next_power_of_2(k.shape[1])}
    return (*rotation, *rotation.k_cache.stride()[:3], q.shape[1], k.shape[1]), sizes


def norm_args(normed: NormedRows) -> tuple:
    """What ext/gemv.py's kernel takes of a NormedRows: the residual and stream, their row strides, the weight, eps."""
    residual, stream = normed.residual, normed.stream
    return residual, stream, residual.stride(0), stream.stride(0), normed.weight, normed.eps


class RotatingAttention(Attention):
    """The core's Attention (model.py) whose q|k|v projection, for at most ROTATE_MAX_ROWS rows, also norms and
    rotates q and k and stores K and V (see 3 above): one launch fewer per layer. More rows take the core's forward."""

    def forward(
        self, x: Tensor | NormedRows, positions: Tensor, rotary: Rotary, kv_cache: KVCache, meta: AttentionMetadata
    ) -> Tensor:
        if len(x) > ROTATE_MAX_ROWS:
            return super().forward(x, positions, rotary, kv_cache, meta)
        rotation = self.rotation(positions, rotary, kv_cache, meta.slot_mapping)
        q, _, _ = rotation.heads(self.qkv_proj(x, rotation))
        o = self.kernels.paged_attention(q, *kv_cache, meta, self.scale)  # from here as the core's forward
        return self.o_proj(o.flatten(1))

    def rotation(self, positions: Tensor, rotary: Rotary, kv_cache: KVCache, slot_mapping: Tensor) -> Rotation:
        """This layer's Rotation of the given rows: the RoPE tables, its caches, its QK-norm (Qwen3's) if it has one."""
        return Rotation(positions, rotary.cos, rotary.sin, *kv_cache, slot_mapping, *self.qk_norm())


def warm_up_fusions(model: nn.Module, kv_cache: KVCache) -> None:
    """The fusions' GEMV builds, compiled now rather than in a step (the decode graphs' capture would compile most,
    but an eager engine would in its first steps of a few rows), at 1 and 2 rows (Triton builds an int equal to 1
    apart): q|k|v and gate|up with the norm in their load, and the first layer's q|k|v with the rotation too (with the
    input it takes there; every row's slot PAD_SLOT: nothing is stored)."""
    layer = model.model.layers[0]
    for rows in (1, 2):
        for proj in fed_by_norms(model):
            proj(zero_rows(proj, rows, normed=True))
        if isinstance(layer.self_attn, RotatingAttention):
            proj = layer.self_attn.qkv_proj
            positions = torch.zeros(rows, dtype=torch.int32, device=proj.weight.device)
            rotation = layer.self_attn.rotation(positions, model.rotary, kv_cache, torch.full_like(positions, PAD_SLOT))
            proj(zero_rows(proj, rows, normed=isinstance(layer.input_layernorm, NormIntoProjection)), rotation)


def zero_rows(proj: nn.Module, rows: int, normed: bool) -> Tensor | NormedRows:
    """rows rows of zeros for a projection's input, as a NormedRows (its norm moved into it) or plain."""
    zeros = proj.weight.new_zeros(rows, proj.in_features)
    return NormedRows(zeros, zeros, torch.empty_like(zeros), zeros[0], 1e-6) if normed else zeros
