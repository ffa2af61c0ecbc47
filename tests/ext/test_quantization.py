"""Quantized weights (nanoserve/ext/quantization): checkpoints of every format the extension reads, each served with
greedy outputs equal token for token to transformers running the same weights dequantized (fp32); the Triton kernel
against its PyTorch reference on shapes drawn afresh each run (Triton's interpreter on a CPU), and its sm_90 build;
online FP8 within vLLM's closeness rule of the 16-bit model; the weights' bytes per format in the KV-account line;
LoRA adapters over quantized weights; CUDA graphs over quantized projections; bad settings refused by name before any
weight is read; and the course experiment "bytes per step".

Who writes the checkpoints: compressed-tensors' own library writes its formats here (pack-quantized W4A16 / W8A16,
float-quantized FP8, from its presets; each group's scale from its minimum and maximum, as llm-compressor's observers
find them, by the library's calculate_qparams), and its fake-quantized forward (the model before compression, its
weights and activations quantized and dequantized as it runs) is the reference. AWQ's and GPTQ's own tools install
here only without their dependencies (`pip install --no-deps auto-gptq==0.7.1 autoawq==0.2.9`; AutoGPTQ's pinned
dependencies and AutoAWQ's pull datasets, pandas and pyarrow, and GPTQModel compiles CUDA code), and load only past
their packages' __init__, which imports names transformers 5 removed: where they do, AutoGPTQ's own GPTQ quantizer and
packer and AutoAWQ's own packer and unpacker write and check checkpoints (test_autogptq_..., test_autoawq_...; skipped
elsewhere). Every format and setting is also written from its specification by write_gptq and write_awq below, which
those tests check byte for byte against AutoGPTQ's and AutoAWQ's packing, and which a second, independent unpacking
(from the bytes and nibbles, not shifts) checks wherever they run."""

import copy
import importlib.util
import json
import os
import random
import re
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    FAMILIES,
    TINY,
    TRITON_DEVICE,
    RerunGraph,
    default_model_or_skip,
    extension_or_skip,
    graphs_on_a_cpu,
    hf_greedy,
    hf_greedy_run,
    logprobs_close,
    random_prompts,
    refused,
    sm90_builds,
)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

quantization = extension_or_skip("quantization")

import nanoserve.model_runner  # noqa: E402
from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.ext.quantization import kernels as K  # noqa: E402

ENGINE = {"device": "cpu", "max_model_len": 128, "num_kvcache_blocks": 64}
NUM_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AWQ's spec: an int32's 8 nibbles hold these columns of its 8, in order
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# a family whose every projection's input takes groups of 128 (the tiny ones have 64 features)
WIDE = {**TINY, "hidden_size": 128, "intermediate_size": 256, "head_dim": 32}


@pytest.fixture(autouse=True)
def fresh_seed():
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    random.seed(seed)
    print(f"seed {seed}")


def tiny_hf(family: str) -> torch.nn.Module:
    """A fresh random transformers model of a tiny family (conftest's, or the wide Llama), fp32."""
    config = LlamaConfig(**WIDE) if family == "wide" else FAMILIES[family]()
    return AutoModelForCausalLM.from_config(config).eval()


def linears(hf: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The decoder projections of a transformers model by name (model.layers.0.self_attn.q_proj, ...)."""
    return {name: m for name, m in hf.named_modules() if name.rsplit(".", 1)[-1] in PROJECTIONS}


# ---- GPTQ and AWQ, written from their specifications --------------------------------------------------------------
def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int, symmetric: bool, order: torch.Tensor | None = None):
    """Round-to-nearest quantization of weight [out, in] in groups of group_size input features (-1: one group), the
    groups' members in order or, with an order (a permutation of the input features: GPTQ's desc_act, act-order), in
    that order: (q [in, out] unsigned ints, zeros [groups, out] ints, scales [groups, out] fp16, g_idx [in] int32) with
    weight ~ (q - zeros[g]) x scales[g], g = g_idx[input feature]."""
    out_features, in_features = weight.shape
    group_size = in_features if group_size == -1 else group_size
    groups = in_features // group_size
    if order is None:
        order = torch.arange(in_features)
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_features) // group_size).int()  # the i-th in order is in group i // group_size
    w = weight.T  # [in, out]
    top = 2**bits - 1
    scales = torch.empty(groups, out_features)
    zeros = torch.empty(groups, out_features, dtype=torch.int32)
    for g in range(groups):
        rows = w[g_idx == g]
        low, high = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
        if symmetric:
            scales[g] = (torch.maximum(-low, high) / (top // 2)).clamp(min=1e-6)
            zeros[g] = 2 ** (bits - 1)
        else:
            scales[g] = ((high - low) / top).clamp(min=1e-6)
            zeros[g] = torch.round(-low / scales[g]).int()
    scales = scales.half()  # as the checkpoints store them
    q = torch.round(w / scales[g_idx].float() + zeros[g_idx]).clamp(0, top).int()
    return q, zeros, scales, g_idx


def dequantized(q, zeros, scales, g_idx) -> torch.Tensor:
    """The weight [out, in] in fp32 that quantized weights stand for."""
    return ((q - zeros[g_idx]).float() * scales[g_idx].float()).T


def pack_words(values: torch.Tensor, bits: int, columns: list[int] | None = None) -> torch.Tensor:
    """Unsigned values [rows, n x (32 / bits)] packed along the last dim, 32 / bits to an int32: word w's value j
    (bits [j x bits, (j + 1) x bits)) is column w x (32 / bits) + columns[j] (in order where columns is None)."""
    per_word = 32 // bits
    groups = values.to(torch.int64).unflatten(-1, (-1, per_word))  # [rows, words, per_word]
    if columns is not None:
        groups = groups[..., columns]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (groups << shifts).sum(-1)  # fits 32 bits unsigned
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def write_gptq(hf, path, bits: int, group_size: int, symmetric: bool, desc_act: bool, version: str = "gptq"):
    """hf's projections quantized and saved in GPTQ's layout (AutoGPTQ's, or GPTQModel's gptq_v2): qweight int32
    [in / (32 / bits), out] (input features packed in order), qzeros int32 [groups, out / (32 / bits)] (output features
    packed in order; minus 1 in the gptq format), scales fp16 [groups, out], g_idx int32 [in]. Returns the reference:
    hf with the dequantized weights, and what was packed, by projection."""
    tensors, packed = {}, {}
    orders = {}  # act-order: one permutation per input, shared by the projections that read it (as GPTQ's, which
    # orders by the input's Hessian): q, k, v; gate, up
    for name, linear in linears(hf).items():
        reads = re.sub(r"\.(q|k|v)_proj$", ".qkv", re.sub(r"\.(gate|up)_proj$", ".gate_up", name))
        order = orders.setdefault(reads, torch.randperm(linear.in_features)) if desc_act else None
        q, zeros, scales, g_idx = quantize_rtn(linear.weight.data, bits, group_size, symmetric, order)
        stored_zeros = (zeros - int(version == "gptq")) & (2**bits - 1)
        tensors |= {
            f"{name}.qweight": pack_words(q.T, bits).T.contiguous(),
            f"{name}.qzeros": pack_words(stored_zeros, bits),
            f"{name}.scales": scales,
            f"{name}.g_idx": g_idx,
        }
        packed[name] = (q, zeros, scales, g_idx)
        linear.weight.data = dequantized(q, zeros, scales, g_idx)
    settings = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": symmetric}
    save_quantized(hf, path, tensors, settings | {"checkpoint_format": version})
    return hf, packed


def write_awq(hf, path, group_size: int):
    """hf's projections quantized and saved in AWQ's GEMM layout: qweight int32 [in, out / 8] (each int32's 8 nibbles
    columns 0, 2, 4, 6, 1, 3, 5, 7 of its 8), qzeros int32 [groups, out / 8] (the same order), scales fp16 [groups,
    out]. Returns the reference and what was packed."""
    tensors, packed = {}, {}
    for name, linear in linears(hf).items():
        q, zeros, scales, g_idx = quantize_rtn(linear.weight.data, 4, group_size, False)
        tensors |= {
            f"{name}.qweight": pack_words(q, 4, AWQ_PACK_ORDER),
            f"{name}.qzeros": pack_words(zeros, 4, AWQ_PACK_ORDER),
            f"{name}.scales": scales,
        }
        packed[name] = (q, zeros, scales, g_idx)
        linear.weight.data = dequantized(q, zeros, scales, g_idx)
    settings = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    save_quantized(hf, path, tensors, settings)
    return hf, packed


def save_quantized(hf, path, tensors: dict, settings: dict) -> None:
    """hf saved to path with its projections' weights replaced by tensors, and quantization_config in config.json."""
    hf.save_pretrained(path)
    state = load_file(f"{path}/model.safetensors")
    state = {k: v for k, v in state.items() if not any(f"{name}.weight" == k for name in linears(hf))}
    save_file(state | tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    config = json.loads(open(f"{path}/config.json").read())
    config["quantization_config"] = settings
    with open(f"{path}/config.json", "w") as f:
        json.dump(config, f)


# ---- the second, independent unpacking (the specifications read from the bytes) ----------------------------------
def values_from_bytes(words: torch.Tensor, bits: int) -> np.ndarray:
    """int32 words [rows, n] -> their values [rows, n, 32 / bits], from their little-endian bytes: 8-bit values are
    the bytes; 4-bit values each byte's low nibble, then its high one."""
    raw = words.contiguous().numpy().astype("<i4").view(np.uint8).reshape(*words.shape, 4)
    if bits == 8:
        return raw.astype(np.int64)
    return np.stack([raw & 15, raw >> 4], axis=-1).reshape(*words.shape, 8).astype(np.int64)


def test_spec_writers_against_an_independent_unpacking():
    """Guards against a checkpoint writer that packs GPTQ's or AWQ's layout wrongly (and so a loader tested against it
    that reads it wrongly the same way): what write_gptq and write_awq pack, read back from the bytes."""
    for bits in (4, 8):
        weight = torch.randn(24, 64)
        q, zeros, scales, g_idx = quantize_rtn(weight, bits, 32, False, torch.randperm(64))
        qweight = pack_words(q.T, bits).T  # GPTQ: [in / per_word, out], input features in order within a word
        unpacked = values_from_bytes(qweight.T.contiguous(), bits).reshape(24, 64).T  # [in, out]
        assert np.array_equal(unpacked, q.numpy())
        qzeros = pack_words(zeros, bits)  # [groups, out / per_word], output features in order
        assert np.array_equal(values_from_bytes(qzeros, bits).reshape(2, 24), zeros.numpy())
        # Each weight within half its group's step, plus what rounding the scale to fp16 (at most 2^-11 of it) moves
        # the ends of the group's range, up to 2^bits - 1 steps from its zero (without that term, 1 seed in ~20 failed)
        step = scales[g_idx].float().T  # [out, in]
        bound = step * (0.5 + (2**bits - 1) * 2**-11) + 1e-6
        assert ((dequantized(q, zeros, scales, g_idx) - weight).abs() <= bound).all()
    q, zeros, _, _ = quantize_rtn(torch.randn(24, 64), 4, 32, False)
    nibbles = values_from_bytes(pack_words(q, 4, AWQ_PACK_ORDER), 4)  # [in, out / 8, 8]: nibble j of each word
    columns = np.empty_like(nibbles)
    columns[..., AWQ_PACK_ORDER] = nibbles  # nibble j holds column AWQ_PACK_ORDER[j]
    assert np.array_equal(columns.reshape(64, 24), q.numpy())


# ---- compressed-tensors, written by its own library ---------------------------------------------------------------
def write_compressed_tensors(hf, path, preset: str, group_size: int | None = None, strategy: str | None = None):
    """hf quantized with one of compressed-tensors' preset schemes (its group size or strategy changed), the LM head
    left whole (ignore), and saved as the library saves it: each group's scale and zero point from its minimum and
    maximum by the library's calculate_qparams, and a static activation scale from the largest input each projection
    sees on random prompts. Returns the reference: hf under the library's fake quantization (its weights, and its
    activations where the scheme quantizes them, quantized and dequantized as it runs, in fp32)."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    largest_input = {}  # projection -> its inputs' (min, max) on random prompts, before quantization

    def observe(module, args, output):
        largest_input[module] = args[0].aminmax()

    hooks = [module.register_forward_hook(observe) for module in linears(hf).values()]
    with torch.no_grad():
        hf(torch.tensor(random_prompts([40])))
    for hook in hooks:
        hook.remove()
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group_size is not None:
        scheme.weights.group_size = group_size
    if strategy is not None:
        scheme.weights.strategy = strategy
        scheme.weights.group_size = None
    apply_quantization_config(hf, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for module in linears(hf).values():
            args = scheme.weights
            weight = module.weight
            if args.strategy == "group":
                weight = weight.unflatten(-1, (-1, args.group_size))  # [out, groups, group_size]
            scale, zero = calculate_qparams(weight.amin(-1), weight.amax(-1), args)
            if args.strategy == "tensor":
                scale, zero = calculate_qparams(weight.amin(), weight.amax(), args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
            if hasattr(module, "input_scale"):  # static: the largest input's scale
                low, high = largest_input[module]
                module.input_scale.copy_(calculate_qparams(low, high, scheme.input_activations)[0])
    reference = copy.deepcopy(hf)
    compressor = ModelCompressor.from_pretrained_model(hf)
    compressor.compress_model(hf)
    hf.save_pretrained(path)
    compressor.update_config(path)
    assert ct.__version__ and json.loads(open(f"{path}/config.json").read())["quantization_config"]
    return reference


def greedy(llm, prompts) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


def assert_serves_as_transformers(hf, path, tensors: dict, settings: dict) -> None:
    """The packed tensors saved as hf's quantized checkpoint at path: nanoserve's greedy tokens on it equal
    transformers' on hf (whose weights the caller set to what the tensors stand for)."""
    save_quantized(hf, path, tensors, settings)
    llm = LLM(str(path), **ENGINE)
    prompts = random_prompts([7, 30])
    for prompt, tokens in zip(prompts, greedy(llm, prompts), strict=True):
        assert tokens == hf_greedy(hf, prompt, NUM_TOKENS)


# name -> (family, how the checkpoint is written): every format, bit width and group size, on each family
CHECKPOINTS = {
    "awq g32": ("llama", lambda hf, path: write_awq(hf, path, 32)[0]),
    "awq g64": ("qwen2", lambda hf, path: write_awq(hf, path, 64)[0]),
    "awq g128": ("wide", lambda hf, path: write_awq(hf, path, 128)[0]),
    "gptq 4-bit g32 sym": ("llama", lambda hf, path: write_gptq(hf, path, 4, 32, True, False)[0]),
    "gptq 4-bit g64 desc_act": ("qwen3", lambda hf, path: write_gptq(hf, path, 4, 64, False, True)[0]),
    "gptq 4-bit g128 desc_act sym": ("wide", lambda hf, path: write_gptq(hf, path, 4, 128, True, True)[0]),
    "gptq 8-bit g32": ("qwen2", lambda hf, path: write_gptq(hf, path, 8, 32, False, False)[0]),
    "gptq 8-bit channel desc_act": ("llama", lambda hf, path: write_gptq(hf, path, 8, -1, True, True)[0]),
    "gptq_v2 4-bit g32": ("qwen3", lambda hf, path: write_gptq(hf, path, 4, 32, False, True, "gptq_v2")[0]),
    "ct W4A16 g32": ("llama", lambda hf, path: write_compressed_tensors(hf, path, "W4A16", 32)),
    "ct W4A16_ASYM g64": ("qwen2", lambda hf, path: write_compressed_tensors(hf, path, "W4A16_ASYM", 64)),
    "ct W4A16 g128": ("wide", lambda hf, path: write_compressed_tensors(hf, path, "W4A16", 128)),
    "ct W4A16 channel": ("qwen3", lambda hf, path: write_compressed_tensors(hf, path, "W4A16", strategy="channel")),
    "ct W8A16 g32": ("llama", lambda hf, path: write_compressed_tensors(hf, path, "W8A16", 32)),
    "ct W4A16_ASYM channel": (
        "llama",
        lambda hf, path: write_compressed_tensors(hf, path, "W4A16_ASYM", strategy="channel"),
    ),
    "ct FP8 static": ("qwen2", lambda hf, path: write_compressed_tensors(hf, path, "FP8")),
    "ct FP8_DYNAMIC": ("qwen3", lambda hf, path: write_compressed_tensors(hf, path, "FP8_DYNAMIC")),
}


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_greedy_equals_transformers_on_the_same_weights(name, tmp_path):
    """Guards against any misread of a format (a packing order, a zero point's offset, a group's scale, act-order's
    g_idx, a transposed layout, FP8's scales and its activations' quantization, Qwen2's bias over quantized q|k|v):
    nanoserve's greedy tokens equal transformers' on the same weights, dequantized in fp32 (compressed-tensors' own
    fake quantization for its checkpoints), prompts of several lengths batched together; for compressed-tensors'
    symmetric integer schemes, also transformers' own load of the quantized checkpoint (decompressed on a CPU)."""
    family, write = CHECKPOINTS[name]
    reference = write(tiny_hf(family), tmp_path)
    llm = LLM(str(tmp_path), **ENGINE)
    prompts = random_prompts([5, 23, 40])
    loaded = None  # transformers' own load of the quantized checkpoint, where it can load it on a CPU
    # compressed-tensors' symmetric integer schemes, decompressed as they load (transformers refuses the asymmetric
    # ones' packed zero points as a shape mismatch; FP8's are left to the fake-quantized reference)
    if name.startswith("ct W") and "ASYM" not in name:
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    for prompt, tokens in zip(prompts, greedy(llm, prompts), strict=True):
        assert tokens == hf_greedy(reference, prompt, NUM_TOKENS)
        assert loaded is None or tokens == hf_greedy(loaded, prompt, NUM_TOKENS)
    assert llm.stats()["kv_blocks_used"] == 0


# ---- the kernel -------------------------------------------------------------------------------------------------
def random_layout(in_features: int, out_features: int, bits: int, group_size: int, act_order: bool, dtype):
    """Random weights in the kernel's layout (kernels.py): qweight, scales, zeros, g_idx; any zero points."""
    groups = -(-in_features // group_size)
    q = torch.randint(0, 2**bits, (in_features, out_features), dtype=torch.int32)
    per_word = 32 // bits
    padded = torch.zeros(-(-in_features // per_word) * per_word, out_features, dtype=torch.int32)
    padded[:in_features] = q
    qweight = pack_words(padded.T, bits).T.contiguous()  # [ceil(in / per_word), out]
    g_idx = (torch.arange(in_features) // group_size).int()
    if act_order:
        g_idx = g_idx[torch.randperm(in_features)]
    scales = (torch.rand(groups, out_features) / 2**bits).to(dtype)
    zeros = torch.randint(0, 2**bits, (groups, out_features)).to(dtype)
    return qweight, scales, zeros, g_idx


def check_kernel(rows: int, in_features: int, out_features: int, bits: int, group_size: int, act_order: bool, dtype):
    """The kernel against its reference, in dtype (fp32: to rounding; fp16: to fp16's, its products' sums in fp32)."""
    layout = random_layout(in_features, out_features, bits, group_size, act_order, dtype)
    x = torch.randn(rows, in_features).to(dtype)
    got = K.dequant_matmul(x.to(TRITON_DEVICE), *[t.to(TRITON_DEVICE) for t in layout], bits).cpu().float()
    weight = K.dequantize(*layout, bits).to(dtype).float()  # [in, out]: rounded to dtype as the kernel rounds it
    expected = x.float() @ weight
    assert torch.equal(K.dequant_matmul_ref(x, *layout, bits).float(), (x @ weight.to(dtype)).float())
    error = (got - expected).abs()
    scale = (x.float().abs() @ weight.abs()).clamp(min=1)  # the sum of the products' sizes
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}[dtype]  # (bf16: 8 bits of mantissa)
    print(f"max error {error.max():.2e}, mean {error.mean():.2e} (relative max {(error / scale).max():.2e})")
    assert (error / scale).max() < tolerance


def test_kernel_equals_its_reference_on_drawn_shapes():
    """Guards against a kernel that reads a weight's bits, its group's scale or zero point, or a tile's edge wrongly:
    on shapes drawn afresh each run (1-300 rows, decode's and prefill's tiles; group sizes 32-128 and one group;
    act-order; 4 and 8 bits; odd output widths; input widths not a whole number of words; fp32 and fp16; any zero
    point), the kernel equals the reference (Triton's interpreter on a CPU computes bf16 dots wrongly: no bf16 here)."""
    for draw in range(6):
        rows = random.choice([1, 2, 16, 17, random.randint(1, 300)])
        bits = random.choice([4, 8])
        group_size = random.choice([32, 64, 128, -1])
        in_features = random.choice([32, 64, 128, 256]) if group_size != -1 else random.randint(1, 200)
        if group_size == -1:
            group_size = in_features
        in_features = max(in_features, group_size)
        out_features = random.randint(1, 160)
        act_order = random.random() < 0.5
        dtype = random.choice([torch.float32, torch.float16])
        shape = (rows, in_features, out_features, bits, group_size, act_order, dtype)
        try:
            check_kernel(*shape)
        except AssertionError as error:
            raise AssertionError(f"draw {draw}: rows, in, out, bits, group size, act-order, dtype = {shape}") from error


def test_kernel_compiles_for_h100_without_spills():
    """Guards against a kernel that only Triton's interpreter accepts: in every model dtype, 4 and 8 bits, with the
    decode step's and prefill's tiles, the kernel compiles for an H100 (sm_90) with ptxas, with no register spills
    (tests/sm90_build.py's build); 16-bit tiles multiply on the tensor cores (wgmma where the tile has 64 rows)."""
    script = """
from nanoserve.ext.quantization import kernels as K
for dtype in ("*bf16", "*fp16", "*fp32"):
    for bits in (4, 8):
        for rows in (1, 64):
            tile_m, tile_n, tile_k = K.tile_sizes(rows, sm90_build.TORCH_DTYPES[dtype])
            types = {"x_ptr": dtype, "qweight_ptr": "*i32", "scales_ptr": dtype, "zeros_ptr": dtype,
                     "g_idx_ptr": "*i32", "out_ptr": dtype}
            constants = {"BITS": bits, "TILE_M": tile_m, "TILE_N": tile_n, "TILE_K": tile_k}
            built = sm90_build.build(K._dequant_matmul_kernel, types, constants, 4)
            print(json.dumps(built | {"dtype": dtype, "bits": bits}))
"""
    builds = sm90_builds(script)
    assert len(builds) == 12 and all(b["spill_bytes"] == 0 for b in builds), builds
    assert all(b["wgmma"] for b in builds if b["tile_m"] == 64 and b["dtype"] != "*fp32"), builds


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernels_on_a_gpu_in_bf16_and_the_engine_over_them(tmp_path):
    """Guards against what Triton's interpreter cannot show (it computes bf16 dots wrongly, and a CPU has no FP8
    tensor cores): the kernel's bf16 tensor-core dots equal the reference on shapes drawn afresh (decode's and
    prefill's tiles); torch._scaled_mm's FP8 product equals its reference where the GPU has FP8 tensor cores (sm_90+);
    and the engine on the GPU in bf16, with its decode graphs, serves a GPTQ act-order checkpoint and quantization="fp8"
    within vLLM's closeness rule of transformers on the same weights (fp32)."""
    for _ in range(3):
        rows = random.choice([1, 16, 64, random.randint(1, 300)])
        group_size = random.choice([32, 64, 128])
        shape = (rows, random.choice([128, 256]), random.randint(1, 160), random.choice([4, 8]), group_size)
        check_kernel(*shape, random.random() < 0.5, torch.bfloat16)
    if torch.cuda.get_device_capability() >= (9, 0):
        x = torch.randn(random.randint(1, 300), 256, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(160, 256, device="cuda")
        weight_scale = weight.abs().amax(1, keepdim=True) / K.FP8_MAX  # [out, 1]
        weight8 = (weight / weight_scale).to(K.FP8)
        got = K.fp8_matmul(x, weight8, weight_scale, None).float()
        expected = K.fp8_matmul_ref(x, weight8, weight_scale, None).float()
        scale = (x.float().abs() @ (weight8.float() * weight_scale).abs().T).clamp(min=1)
        assert ((got - expected).abs() / scale).max() < 8e-3
    # max_num_seqs 4: three decode graphs (gpu_check.sh's first stage runs every gpu-marked test: kept short)
    engine = ENGINE | {"device": "cuda", "dtype": "bfloat16", "max_num_seqs": 4}
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=TOP_K)
    prompts = random_prompts([7, 30])
    reference = write_gptq(tiny_hf("qwen3"), tmp_path / "gptq", 4, 32, False, True)[0]
    hf16 = tiny_hf("llama")
    hf16.save_pretrained(tmp_path / "16-bit")
    for path, quantization, hf in [("gptq", None, reference), ("16-bit", "fp8", hf16)]:
        llm = LLM(str(tmp_path / path), quantization=quantization, **engine)
        assert llm.runner.graphs is not None  # the decode steps replay CUDA graphs over the quantized projections
        for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
            ours = (out.outputs[0].token_ids, out.outputs[0].logprobs)
            assert logprobs_close(ours, hf_greedy_run(hf, prompt, NUM_TOKENS, TOP_K), TOP_K), path
        llm.close()


# ---- bad input ----------------------------------------------------------------------------------------------------
@pytest.fixture
def no_weights_loaded(monkeypatch):
    """Fails the test if an LLM gets as far as loading weights: every check must come first."""

    def fail(*args: object) -> None:
        raise AssertionError("the weights were loaded before the settings were checked")

    monkeypatch.setattr(nanoserve.model_runner, "build_model", fail)


def with_settings(path, tmp_path, name: str, **changes) -> str:
    """A copy of the checkpoint at path whose quantization_config has changes (None: a key removed)."""
    copy = tmp_path / name
    shutil.copytree(path, copy)
    config = json.loads((copy / "config.json").read_text())
    for key, value in changes.items():
        config["quantization_config"][key] = value
    (copy / "config.json").write_text(json.dumps(config))
    return str(copy)


def test_bad_settings_are_refused_by_name_before_any_weight_is_read(tiny_model, tmp_path, no_weights_loaded):
    """Guards against a setting nanoserve cannot serve being taken (and read as garbage) or failing inside the loader:
    each is an InvalidField naming it (the option, or the checkpoint's setting), before any weight is read: an unknown
    method, bits other than 4 or 8, a group size that does not divide an input, AWQ's other layouts, a method the
    option contradicts, a packed tensor of the wrong shape, the combinations refused."""
    gptq = str(tmp_path / "gptq")
    write_gptq(tiny_hf("llama"), gptq, 4, 32, False, True)
    awq = str(tmp_path / "awq")
    write_awq(tiny_hf("qwen2"), awq, 32)
    plain = tiny_model("llama")[0]
    refused("quantization", LLM, plain, quantization="int4", **ENGINE)
    assert "checkpoint quantized so" not in refused("quantization", LLM, plain, quantization="gptq", **ENGINE).problem
    assert "'awq'" in refused("quantization", LLM, gptq, quantization="awq", **ENGINE).problem
    refused("quantization", LLM, awq, quantization="fp8", **ENGINE)
    refused("quantization", LLM, gptq, latency_kernels=True, **ENGINE)
    refused("quantization", LLM, gptq, tensor_parallel_size=2, **ENGINE)
    for name, changes in {
        "bits": {"bits": 3},
        "group_size": {"group_size": 48},  # does not divide hidden_size 64
        "group_size  ": {"group_size": 0},
        "quant_method": {"quant_method": "bitsandbytes"},
        "checkpoint_format": {"checkpoint_format": "marlin"},
    }.items():
        error = refused("model", LLM, with_settings(gptq, tmp_path, name.replace(" ", "_"), **changes), **ENGINE)
        assert f"quantization_config.{name.strip()}=" in error.problem
    for name, changes in {"version": {"version": "gemv"}, "zero_point": {"zero_point": False}}.items():
        error = refused("model", LLM, with_settings(awq, tmp_path, name, **changes), **ENGINE)
        assert f"quantization_config.{name}=" in error.problem
    # a packed tensor of the wrong shape: the loader's dry run names it
    broken = tmp_path / "broken"
    shutil.copytree(gptq, broken)
    state = load_file(broken / "model.safetensors")
    state["model.layers.1.mlp.down_proj.qweight"] = state["model.layers.1.mlp.down_proj.qweight"][:-1]
    save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
    assert "model.layers.1.mlp.down_proj.qweight" in refused("model", LLM, str(broken), **ENGINE).problem


def test_bad_compressed_tensors_schemes_are_refused_by_name(tmp_path, no_weights_loaded):
    """Guards against a compressed-tensors scheme nanoserve does not serve being taken: integer activations (W4A8),
    act-order's g_idx, 3 bits, a block strategy, two schemes, a transform; FP8 weights with 16-bit activations. Each is
    an InvalidField naming the setting, before any weight is read."""
    path = str(tmp_path / "ct")
    write_compressed_tensors(tiny_hf("llama"), path, "W4A16", 32)
    settings = json.loads(open(f"{path}/config.json").read())["quantization_config"]
    scheme = settings["config_groups"]["group_0"]
    weights = scheme["weights"]
    int8_inputs = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
    for key, changes in {
        "config_groups.input_activations": {"config_groups": {"group_0": scheme | {"input_activations": int8_inputs}}},
        "config_groups.weights.actorder": {
            "config_groups": {"group_0": scheme | {"weights": weights | {"actorder": "group"}}}
        },
        "config_groups.weights.num_bits": {
            "config_groups": {"group_0": scheme | {"weights": weights | {"num_bits": 3}}}
        },
        "config_groups.weights.strategy": {
            "config_groups": {"group_0": scheme | {"weights": weights | {"strategy": "block"}}}
        },
        "config_groups": {"config_groups": {"group_0": scheme, "group_1": scheme}},
        "transform_config": {"transform_config": {"config_groups": {"u": {}}}},
        "format": {"format": "marlin-24"},
        "config_groups.input_activations ": {
            "format": "float-quantized",
            "config_groups": {
                "group_0": scheme | {"weights": weights | {"type": "float", "num_bits": 8, "strategy": "channel"}}
            },
        },
    }.items():
        error = refused("model", LLM, with_settings(path, tmp_path, key.replace(" ", "_"), **changes), **ENGINE)
        assert f"quantization_config.{key.strip()}=" in error.problem, error


# ---- online FP8 -------------------------------------------------------------------------------------------------
TOP_K = 5


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_online_fp8_quantizes_each_projection_per_output_feature(tiny_model, family):
    """Guards against quantization="fp8" quantizing wrongly (a scale per tensor, not per output feature; a weight
    transposed) or not running on a family: its weights are float8 e4m3, each row scaled so its largest magnitude is
    float8's largest (448), and a greedy run gives every token. (Its closeness to the 16-bit model is judged on the
    default model, below: a tiny random model's next-token distribution is nearly flat, top logprobs within hundredths
    of a nat, so e4m3's rounding reorders its top 5 by chance, which says nothing about the quantization.)"""
    path, hf = tiny_model(family)
    llm = LLM(path, quantization="fp8", **ENGINE)
    outs = llm.generate(random_prompts([7, 30]), GREEDY, use_tqdm=False)
    assert [len(out.outputs[0].token_ids) for out in outs] == [NUM_TOKENS, NUM_TOKENS]
    down = llm.runner.model.model.layers[1].mlp.down_proj
    weight = hf.model.layers[1].mlp.down_proj.weight
    assert down.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(down.weight_scale, weight.abs().amax(1, keepdim=True) / 448)
    assert torch.equal(down.weight.float().abs().amax(1), torch.full([weight.shape[0]], 448.0))


FP8_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "Give me a tip for learning a language.",
    "What is 12 times 7?",
    "Describe a cat in one sentence.",
]


def test_online_fp8_is_close_to_the_16_bit_model():
    """Guards against quantization="fp8" computing something else than the 16-bit model up to float8's rounding (an
    activation not quantized per row, a scale applied twice, a projection skipped): on the default model (SmolLM2-135M,
    fp32), 8 chat prompts x 16 greedy tokens, every run close to transformers' on the 16-bit weights by vLLM's rule
    (the rule the FP8 KV cache is judged by: up to the first divergence the tokens agree, and there each side's token
    is among the other's top 5). Measured when written: 8 of 8 close, 2 of 8 identical (e4m3 keeps 3 mantissa bits, so
    greedy paths do part)."""
    path = default_model_or_skip()
    llm = LLM(path, quantization="fp8", device="cpu", max_model_len=256, num_kvcache_blocks=64)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = extension_or_skip("chat").chat_prompts(llm, [[{"role": "user", "content": q}] for q in FP8_QUESTIONS])
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=TOP_K)
    close = []
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        ours = (out.outputs[0].token_ids, out.outputs[0].logprobs)
        close.append(logprobs_close(ours, hf_greedy_run(hf, list(prompt), NUM_TOKENS, TOP_K), TOP_K))
    assert all(close), close


# ---- memory: the weights' bytes, in the KV-account line ---------------------------------------------------------
def weight_mib(llm) -> float:
    """The weights' MiB as the KV-account line prints them."""
    return float(re.match(r"weights ([\d,.]+) MiB; KV cache", llm.runner.kv_account())[1].replace(",", ""))


def test_each_format_weighs_what_its_layout_holds(tiny_model, tmp_path):
    """Guards against a quantized model that keeps 16-bit copies of its weights, or a KV-account line that leaves the
    weights out: in bf16, each format's weights are the 16-bit model's embeddings and norms plus, per projection, its
    packed weights (in x out x bits / 8 bytes) and per group a bf16 scale and zero point (GPTQ: its g_idx too, 4 bytes
    per input feature of each fused projection; online FP8: 1 byte per weight). The line counts the parameters, the
    checkpoint's tensors: not what the extension makes beside them (a symmetric format's zero points, online FP8's
    scales: a 4-byte scale per output feature)."""
    hf = tiny_hf("wide")
    engine = ENGINE | {"dtype": "bfloat16"}
    hf.save_pretrained(tmp_path / "16-bit")
    sixteen = LLM(str(tmp_path / "16-bit"), **engine)
    projections = [(m.in_features, m.out_features) for m in linears(hf).values()]
    # GPTQ's g_idx, one per input: the fused q|k|v and gate|up share theirs
    g_idx_bytes = sum(4 * m.in_features for name, m in linears(hf).items() if re.search(r"(q|o|gate|down)_proj$", name))
    rest = sum(p.numel() * 2 for name, p in hf.named_parameters() if not name.endswith("_proj.weight"))
    assert weight_mib(sixteen) == round((rest + sum(i * o * 2 for i, o in projections)) / 2**20, 2)
    write_gptq(tiny_hf("wide"), tmp_path / "gptq", 4, 128, False, True)
    write_awq(tiny_hf("wide"), tmp_path / "awq", 64)
    expected = {
        "gptq": sum(i * o // 2 + 2 * (i // 128) * o * 2 for i, o in projections) + g_idx_bytes,
        "awq": sum(i * o // 2 + 2 * (i // 64) * o * 2 for i, o in projections),
        "fp8": sum(i * o for i, o in projections),  # (its scales, made as it loads, are buffers: not weights)
    }
    for name, projection_bytes in expected.items():
        path = tmp_path / name if name != "fp8" else tmp_path / "16-bit"
        llm = LLM(str(path), quantization=name if name == "fp8" else None, **engine)
        assert weight_mib(llm) == round((rest + projection_bytes) / 2**20, 2), name
        print(f"{name}: {weight_mib(llm)} MiB, the 16-bit model's {weight_mib(sixteen)} MiB")
    assert weight_mib(llm) < weight_mib(sixteen)


# ---- the engine's other paths: Triton's kernel, CUDA graphs ---------------------------------------------------
def test_the_triton_kernel_serves_the_engine(tmp_path):
    """Guards against the kernel's path (kernels="triton") reading the layout differently from the reference's: a GPTQ
    checkpoint with act-order, greedy equal to transformers on the same weights (Triton's interpreter on a CPU, fp32;
    the kernel's every shape and format is test_kernel_equals_its_reference_on_drawn_shapes')."""
    family, write = CHECKPOINTS["gptq_v2 4-bit g32"]
    reference = write(tiny_hf(family), tmp_path).to(TRITON_DEVICE)
    llm = LLM(str(tmp_path), **ENGINE | {"device": TRITON_DEVICE, "kernels": "triton"})
    assert llm.runner.model.args.quantization.matmul.func is K.dequant_matmul
    prompts = random_prompts([6, 19])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 6)


def test_decode_graphs_capture_quantized_projections(tmp_path, monkeypatch):
    """Guards against quantized projections that a CUDA graph cannot replay (a host sync, a buffer made per call, a
    weight read on the host): the engine captures its decode graphs over them once (on a CPU, graphs_on_a_cpu's
    stand-in reruns the captured forward), replays them for every decode step, and answers as the eager engine."""
    reference = write_gptq(tiny_hf("llama"), tmp_path, 4, 32, False, True)[0]
    prompts = random_prompts([9, 4])
    captured = graphs_on_a_cpu(monkeypatch)
    llm = LLM(str(tmp_path), **ENGINE)
    graphs = llm.runner.graphs
    assert len(captured) == 1 and graphs is captured[0]
    graphs.graphs = {size: RerunGraph(graphs, size) for size in graphs.graphs}
    graphs.replays = 0
    for prompt, tokens in zip(prompts, greedy(llm, prompts), strict=True):
        assert tokens == hf_greedy(reference, prompt, NUM_TOKENS)
    assert graphs.replays >= NUM_TOKENS - 1


# ---- LoRA over quantized weights (QLoRA's way) ------------------------------------------------------------------
def test_lora_adapters_over_quantized_weights(tmp_path):
    """Guards against LoRA adapters that a quantized base breaks (adapters allocated from a weight the projection does
    not have, in its integer dtype; the adapter's update lost or added twice): with a GPTQ act-order base, each
    request's greedy tokens equal transformers' with PEFT's adapter over the same weights dequantized, with another
    adapter and with none in the same batch."""
    peft = pytest.importorskip("peft")
    extension_or_skip("lora")
    from nanoserve.ext.lora import LoRARequest

    reference = write_gptq(tiny_hf("qwen2"), tmp_path / "base", 4, 32, False, True)[0]
    adapters = {}
    for lora_int_id, (rank, targets) in enumerate([(8, ["q_proj", "v_proj", "down_proj"]), (4, "all-linear")], 1):
        torch.manual_seed(lora_int_id)
        config = peft.LoraConfig(r=rank, target_modules=targets, init_lora_weights=False)
        peft.get_peft_model(copy.deepcopy(reference), config).save_pretrained(tmp_path / str(lora_int_id))
        adapters[LoRARequest(str(lora_int_id), lora_int_id, str(tmp_path / str(lora_int_id)))] = None
    llm = LLM(str(tmp_path / "base"), enable_lora=True, max_loras=2, **ENGINE)
    prompts = random_prompts([8, 21, 13])
    requests = [*adapters, None]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests)
    for prompt, request, out in zip(prompts, requests, outs, strict=True):
        model = reference
        if request is not None:
            model = peft.PeftModel.from_pretrained(copy.deepcopy(reference), request.lora_path).eval()
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, NUM_TOKENS), request


def test_act_orders_that_differ_between_fused_projections_are_refused(tmp_path):
    """Guards against the one act-order layout the kernel cannot serve being served wrongly: q, k and v (gate and up)
    share one g_idx in the fused projection, as GPTQ writes them (their input's order); a checkpoint whose k_proj has
    an order of its own is an InvalidField naming that tensor, as the weights load."""
    path = str(tmp_path / "gptq")
    write_gptq(tiny_hf("llama"), path, 4, 32, False, True)
    state = load_file(f"{path}/model.safetensors")
    state["model.layers.0.self_attn.k_proj.g_idx"] = state["model.layers.0.self_attn.k_proj.g_idx"].flip(0)
    save_file(state, f"{path}/model.safetensors", metadata={"format": "pt"})
    error = refused("model", LLM, path, **ENGINE)
    assert "g_idx" in error.problem and "model.layers.0.self_attn." in error.problem


# ---- AutoGPTQ's and AutoAWQ's own code, where it loads ------------------------------------------------------------
def library(monkeypatch, package: str, *modules: str) -> list:
    """Modules of AutoGPTQ or AutoAWQ, loaded past the package's __init__ (which imports names transformers 5 removed),
    or a skip where the package is not installed (it is no test dependency: `pip install --no-deps auto-gptq==0.7.1
    autoawq==0.2.9` runs these tests; their CUDA kernels never load on a CPU)."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        pytest.skip(f"{package} is not installed")
    stub = types.ModuleType(package)
    stub.__path__ = list(spec.submodule_search_locations)
    monkeypatch.setitem(sys.modules, package, stub)
    return [importlib.import_module(f"{package}.{module}") for module in modules]


def test_autogptq_writes_what_nanoserve_serves(tmp_path, monkeypatch):
    """Guards against a GPTQ reader (and a spec writer) that agree with each other and with nothing else: AutoGPTQ's
    own GPTQ quantizer (act-order, asymmetric, groups of 32) and its QuantLinear.pack write a checkpoint, which
    nanoserve serves with greedy tokens equal to transformers' on the weights GPTQ chose; and, given the same integers,
    scales and zero points, write_gptq packs the very bytes AutoGPTQ packs."""
    gptq, qlinear = library(monkeypatch, "auto_gptq", "quantization.gptq", "nn_modules.qlinear.qlinear_cuda")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # fasterquant waits for the GPU it assumes
    hf = tiny_hf("llama")
    inputs = {}  # each projection's input on a random prompt, for GPTQ's Hessian

    def observe(module, args, output):
        inputs[module] = args[0][0]

    hooks = [m.register_forward_hook(observe) for m in linears(hf).values()]
    with torch.no_grad():
        hf(torch.tensor(random_prompts([64])))
    for hook in hooks:
        hook.remove()
    tensors = {}
    for name, linear in linears(hf).items():
        quantizer = gptq.GPTQ(linear)
        quantizer.quantizer.configure(4, perchannel=True, sym=False)
        quantizer.add_batch(inputs[linear], linear(inputs[linear]))
        scale, zero, g_idx = quantizer.fasterquant(group_size=32, actorder=True)  # writes the weights it chose
        packed = qlinear.QuantLinear(4, 32, linear.in_features, linear.out_features, False)
        packed.pack(linear, scale, zero, g_idx)
        tensors |= {f"{name}.{part}": getattr(packed, part) for part in ("qweight", "qzeros", "scales", "g_idx")}
        q = torch.round(linear.weight.T / scale.T[g_idx] + zero.T[g_idx]).int()  # the integers it packed
        assert torch.equal(pack_words(q.T, 4).T, packed.qweight)
        assert torch.equal(pack_words((zero.T.int() - 1) & 15, 4), packed.qzeros)
    settings = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False}
    assert_serves_as_transformers(hf, tmp_path, tensors, settings)


def test_autoawq_writes_what_nanoserve_serves(tmp_path, monkeypatch):
    """Guards against an AWQ reader (and a spec writer) that agree with each other and with nothing else: AutoAWQ's
    own WQLinear_GEMM.from_linear packs each projection, AutoAWQ's own dequantize_gemm unpacks them for the
    reference, and nanoserve's greedy tokens equal transformers' on those weights; given the same integers and zero
    points, write_awq's packing gives the very bytes AutoAWQ's does."""
    gemm, packing = library(monkeypatch, "awq", "modules.linear.gemm", "utils.packing_utils")
    hf = tiny_hf("qwen2")
    tensors = {}
    for name, linear in linears(hf).items():
        q, zeros, scales, g_idx = quantize_rtn(linear.weight.data, 4, 32, False)  # (AutoAWQ's search needs datasets)
        linear.weight.data = dequantized(q, zeros, scales, g_idx)  # which AutoAWQ's rounding takes back to q
        packed = gemm.WQLinear_GEMM.from_linear(linear, 4, 32, scales=scales.float(), zeros=zeros.float())
        tensors |= {f"{name}.{part}": getattr(packed, part) for part in ("qweight", "qzeros", "scales")}
        assert torch.equal(pack_words(q, 4, AWQ_PACK_ORDER), packed.qweight)
        assert torch.equal(pack_words(zeros, 4, AWQ_PACK_ORDER), packed.qzeros)
        linear.weight.data = packing.dequantize_gemm(packed.qweight, packed.qzeros, packed.scales, 4, 32).T.float()
    settings = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    assert_serves_as_transformers(hf, tmp_path, tensors, settings)


# ---- the server's command line ------------------------------------------------------------------------------------
def test_nanoserve_serve_takes_quantization(tmp_path, monkeypatch):
    """Guards against `nanoserve serve MODEL --quantization NAME` not reaching the engine (the server's flags are
    EngineConfig's fields): the engine it starts serves the GPTQ checkpoint as LLM(..., quantization="gptq") does,
    and a name the checkpoint contradicts stops it with the InvalidField naming quantization."""
    extension_or_skip("server")
    from nanoserve.ext.server import app, cli

    class Started(Exception):
        pass

    def started(llm, config):
        raise Started(llm)

    monkeypatch.setattr(app, "Server", started)
    reference = write_gptq(tiny_hf("llama"), tmp_path, 4, 32, False, True)[0]
    flags = ["serve", str(tmp_path), "--device", "cpu", "--max-model-len", "128", "--num-kvcache-blocks", "32"]
    with pytest.raises(Started) as info:
        cli.main([*flags, "--quantization", "gptq"])
    llm = info.value.args[0]
    prompt = random_prompts([11])[0]
    assert greedy(llm, [prompt])[0] == hf_greedy(reference, prompt, NUM_TOKENS)
    refused("quantization", cli.main, [*flags, "--quantization", "awq"])


# ---- the course experiment: bytes per step ----------------------------------------------------------------------
def test_bytes_per_step_course_experiment(tiny_model, tmp_path):
    """The course experiment "bytes per step: why 4-bit weights speed up batch 1 and not batch 64"
    (bench_quantization.py on a tiny model). Guards against its arithmetic and its 4-bit copy being wrong: the GPTQ
    copy bench_quantization makes serves greedy tokens equal to transformers' on its weights dequantized (read back
    from the bytes); its weights take fewer bytes than the 16-bit model's, as the KV-account line reports them; a
    batch-1 step is all weight bytes (its roofline time in the ratio of the bytes), and batch 64 does 64 times the
    FLOPs per byte of weights."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import bench_quantization

    path, hf = tiny_model("llama")
    bench_quantization.quantize_gptq(path, str(tmp_path / "w4a16"))
    for name, linear in linears(hf := copy.deepcopy(hf)).items():  # the copy's weights, read back from its bytes
        state = load_file(tmp_path / "w4a16" / "model.safetensors")
        q = values_from_bytes(state[f"{name}.qweight"].T.contiguous(), 4).reshape(linear.out_features, -1).T
        zeros = values_from_bytes(state[f"{name}.qzeros"], 4).reshape(-1, linear.out_features) + 1
        g_idx = state[f"{name}.g_idx"].long()
        linear.weight.data = dequantized(torch.from_numpy(q), torch.from_numpy(zeros), state[f"{name}.scales"], g_idx)
    llm = LLM(str(tmp_path / "w4a16"), **ENGINE)
    prompt = random_prompts([12])[0]
    assert greedy(llm, [prompt])[0] == hf_greedy(hf, prompt, NUM_TOKENS)
    flags = ["--model", path, "--formats", "16-bit", "w4a16", "--batches", "1", "64", "--dtype", "bfloat16"]
    rows = bench_quantization.main([*flags, "--prompt-len", "8", "--new-tokens", "4"])
    (one16, many16), (one4, many4) = [[r for r in rows if r["format"] == name] for name in ("16-bit", "w4a16")]
    assert [r["batch"] for r in rows] == [1, 64, 1, 64] and all(r["ms_per_step"] > 0 for r in rows)
    assert one4["weights_mib"] < 0.6 * one16["weights_mib"]
    assert one4["predicted_us"] / one16["predicted_us"] == pytest.approx(one4["step_bytes"] / one16["step_bytes"], 0.01)
    assert many16["flop_per_byte"] > 20 * one16["flop_per_byte"]
