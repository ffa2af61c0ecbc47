"""Compile nanoserve's Triton kernels for an H100 (sm_90) on a machine without a GPU, and report each build.

Triton lowers a kernel to PTX and runs ptxas on it without touching a driver, so CPU-only CI can still catch a
kernel that no longer compiles for Hopper, that spills registers, or whose prefill stopped using wgmma. Run it
in a process without TRITON_INTERPRET (the interpreter replaces the kernels when they are defined):
    python tests/sm90_build.py [DTYPE:HEAD_DIM:GROUP:BLOCK_SIZE[:fp8] ...]    (default: a spread of shapes)
prints one JSON line per build: kernel, shape, tile, registers per thread, spilled bytes, wgmma or not,
shared memory, and the sizes of its asynchronous (pipelined) loads. DTYPE is the model's (bf16, fp16, fp32); a
trailing ":fp8" makes the KV cache float8 e4m3 (kv_cache_dtype="fp8"), and then only the kernels that read or
write the cache are built (the others do not see it).
"""

import importlib.util
import json
import os
import re
import subprocess
import sys

assert not os.environ.get("TRITON_INTERPRET"), "compile for sm_90 needs the real kernels, not the interpreter"
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from nanoserve import attention as A  # noqa: E402

F = None  # ext/fused_kernels, where the extension is installed (the core-only run has none)
if importlib.util.find_spec("nanoserve.ext.fused_kernels") is not None:
    from nanoserve.ext import fused_kernels as F  # noqa: E402
LATENCY_DECODE = None  # ext/latency's decode module, where the extension is installed (the core-only run has none)
if importlib.util.find_spec("nanoserve.ext.latency") is not None:
    from nanoserve.ext.latency import decode as LATENCY_DECODE  # noqa: E402

H100 = GPUTarget("cuda", 90, 32)
# keys per step of the wide prefill tile's candidate (the Triton tutorial's Hopper choice; a prediction, BENCHMARKS.md):
# built beside today's PREFILL_TILE_N for the widest tile over a 16-bit cache (4-warp tiles spill at 128, and an fp8
# cache's widened tile on triton 3.6), as bench_kernels.py's sweep times it
WIDE_TILE_N = 128
TORCH_DTYPES = {
    "*bf16": torch.bfloat16,
    "*fp16": torch.float16,
    "*fp32": torch.float32,
    "*fp8e4nv": torch.float8_e4m3fn,
}


def build(
    fn, types: dict, constexprs: dict, num_warps: int, look_for: tuple[str, ...] = (), aligned: tuple[str, ...] = ()
) -> dict:
    """Compile fn for sm_90 with the given argument types (others: i32) and report ptxas's verdict; look_for: PTX
    instructions to report as present or not (an atomic's memory order, a load's cache operator); aligned: more int
    arguments the launcher would see divisible by 16 (a model's feature counts), as pointers and strides are."""
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        signature[name] = "constexpr" if name in constexprs else types.get(name, "i32")
        if signature[name].startswith("*") or name.startswith("stride") or name in aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]  # what the launcher sees for aligned tensors and strides
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=H100, options={"num_warps": num_warps})
    ptx = kernel.asm["ptx"]
    log = subprocess.run(
        [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", "-", "-o", os.devnull],
        input=ptx,
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    # sizes of the asynchronous global-to-shared copies that feed the software pipeline
    async_copies = re.findall(r"cp\.async\.\w+\.shared\.global.*?, (0x\w+)", ptx)
    return {
        "kernel": fn.__name__,
        "tile_m": constexprs.get("TILE_M"),
        "tile_n": constexprs.get("TILE_N"),
        "num_warps": num_warps,
        "registers": registers,
        "spill_bytes": spills,
        "wgmma": "wgmma" in ptx,
        "shared_bytes": kernel.metadata.shared,
        "async_copy_bytes": sorted({int(n, 16) for n in async_copies}),
        "found": {text: text in ptx for text in look_for},
        "acq_rel_atomics": ptx.count("atom.global.gpu.acq_rel"),  # how many, in the PTX's text
        # a split handshake's order: every global store before the first atomic is followed by a CTA barrier, so all
        # of the program's threads have stored before one of them arrives (None: no atomic)
        "barrier_before_atomic": stores_fenced(ptx),
        # a programmatic dependent's order: nothing in global memory read or written before its griddepcontrol.wait
        # (a prefetch is neither; None: no wait)
        "waits_before_memory": waits_first(ptx),
    }


def waits_first(ptx: str) -> bool | None:
    """Whether the PTX's first griddepcontrol.wait comes before its first global load, store, atomic or
    asynchronous copy (None: no wait)."""
    wait = ptx.find("griddepcontrol.wait")
    if wait < 0:
        return None
    first = re.search(r"(ld|st|atom|red)\.global|cp\.async", ptx)
    return first is None or wait < first.start()


def stores_fenced(ptx: str) -> bool | None:
    """Whether, before every global atomic of the PTX, a bar.sync lies between the last global store before it and
    the atomic (None: no atomic)."""
    atomics = [m.start() for m in re.finditer(r"atom\.global", ptx)]
    if not atomics:
        return None
    return all(ptx[:at].rfind("bar.sync") > ptx[:at].rfind("st.global") for at in atomics)


def builds(dtype: str, head_dim: int, group: int, block_size: int, kv_dtype: str | None = None):
    """Every kernel configuration the launchers in attention.py and ext/fused_kernels.py can pick for this model
    shape, the wide prefill tile's candidate, and ext/latency's decode kernel where it is installed; with kv_dtype,
    only those that touch the KV cache, with the cache in that type."""
    kv_dtype = kv_dtype or dtype
    cache = {"k_cache_ptr": kv_dtype, "v_cache_ptr": kv_dtype}
    q_torch, kv_torch = TORCH_DTYPES[dtype], TORCH_DTYPES[kv_dtype]
    # Qwen3's QK-norm + RoPE with the K/V store, and RoPE with the store alone (Llama, Qwen2): no norm weights, None
    # pointers compile as constants; it writes the cache, so it is built for every cache dtype
    rope_types = {"q_ptr": dtype, "k_ptr": dtype, "v_ptr": dtype, "positions_ptr": "*i32", "cos_ptr": "*fp32"}
    rope_types |= {"sin_ptr": "*fp32", **cache, "slot_mapping_ptr": "*i32"}
    rope_sizes = {"Q_HEADS_PAD": 8 * group, "K_HEADS_PAD": 8, "HALF": head_dim // 2}
    rope_sizes |= {"BLOCK_SIZE": block_size, "PAD": A.PAD_SLOT}
    if F is not None:
        yield build(
            F._qk_norm_rope_store_kernel,
            {**rope_types, "q_weight_ptr": dtype, "k_weight_ptr": dtype, "eps": "fp32"},
            rope_sizes,
            4,
        )
        no_norm = {**rope_sizes, "q_weight_ptr": None, "k_weight_ptr": None}
        yield build(F._qk_norm_rope_store_kernel, rope_types, no_norm, 4)
    meta = {"block_tables_ptr": "*i32", "query_start_loc_ptr": "*i32", "context_lens_ptr": "*i32", "qk_scale": "fp32"}
    prefill_types = dict(q_ptr=dtype, out_ptr=dtype, **cache, **meta)
    prefill_shape = {"GROUP": group, "HEAD_DIM": head_dim, "BLOCK_SIZE": block_size}
    for tile_m in A.prefill_tile_sizes(q_torch):  # every query tile, as paged_attention launches it
        yield build(
            A._prefill_kernel,
            prefill_types,
            prefill_shape | {"TILE_M": tile_m, "TILE_N": A.PREFILL_TILE_N},
            A.prefill_num_warps(tile_m, q_torch.itemsize),
        ) | {"candidate": False}
    if kv_torch.itemsize == 2:  # the wide tile's candidate over a 16-bit cache, which gpu_check.sh's sweep times
        tile_m = A.PREFILL_TILE_M[q_torch.itemsize]
        yield build(
            A._prefill_kernel,
            prefill_types,
            prefill_shape | {"TILE_M": tile_m, "TILE_N": WIDE_TILE_N},
            A.prefill_num_warps(tile_m, q_torch.itemsize),
        ) | {"candidate": True}
    decode_shape = {
        "GROUP": group,
        "GROUP_PAD": A.decode_group_pad(group),
        "HEAD_DIM": head_dim,
        "BLOCK_SIZE": block_size,
        "TILE_N": A.DECODE_TILE_N[q_torch.itemsize, kv_torch.itemsize],
    }
    # the core's split kernel: partials for the reduce kernel, or (a batch that fills the GPU) the output itself
    for one_split in (False, True):
        parts = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
        if one_split:
            parts = {"part_out_ptr": dtype, "part_lse_ptr": dtype}  # (never read)
        yield build(
            A._decode_split_kernel,
            dict(q_ptr=dtype, **cache, **meta, out_ptr=dtype, **parts),
            decode_shape | {"ONE_SPLIT": one_split},
            A.DECODE_NUM_WARPS,
        ) | {"one_split": one_split}
    # ext/latency's decode kernel, where the extension is installed: the last split merges, plainly launched or as a
    # programmatic dependent (its engines on sm_90)
    if LATENCY_DECODE is not None:
        for dependent in (False, True):
            types = dict(q_ptr=dtype, **cache, **meta, out_ptr=dtype, part_out_ptr="*fp32", part_lse_ptr="*fp32")
            yield build(
                LATENCY_DECODE._decode_merge_kernel,
                types | {"counters_ptr": "*i32"},
                decode_shape | {"MAX_SPLITS": LATENCY_DECODE.MAX_SPLITS, "DEPENDENT": dependent},
                A.DECODE_NUM_WARPS,
                look_for=("atom.global.gpu.acq_rel.add", "ld.global.cg", "griddepcontrol.launch_dependents"),
            ) | {"dependent": dependent}
    if kv_dtype != dtype:
        return  # the layer kernels, and the decode's reduce, never see the cache
    # the reduce kernel, which merges the split kernel's partials (any number of splits: one variant)
    yield build(
        A._decode_reduce_kernel,
        {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": dtype, "query_start_loc_ptr": "*i32"},
        {"HEAD_DIM": head_dim, "MAX_SPLITS": A.MAX_SPLITS},
        4,  # Triton's default num_warps, which the launcher leaves
    )
    if F is None:
        return  # the fused layer kernels are ext/fused_kernels'
    # the fused layer kernels, at Qwen3-0.6B's widths (hidden 1024, intermediate 3072) and 8x as wide
    for hidden in (1024, 8192):
        yield build(
            F._add_rms_norm_kernel,
            {"x_ptr": dtype, "residual_ptr": dtype, "out_ptr": dtype, "weight_ptr": dtype, "eps": "fp32"},
            {"BLOCK": hidden},
            F.rms_norm_num_warps(hidden),
        )
    yield build(F._silu_mul_kernel, {"x_ptr": dtype, "out_ptr": dtype}, {"BLOCK": F.SILU_BLOCK}, 4)
    yield build(
        F._gumbel_argmax_kernel,
        {
            "logits_ptr": dtype,
            "temperature_ptr": "*fp32",
            "seed_ptr": "*i64",
            "chunk_best_ptr": "*fp32",
            "chunk_id_ptr": "*i64",
        },
        {"TILE": F.GUMBEL_TILE},
        4,  # Triton's default num_warps, which the launcher leaves
    )


DEFAULT_SHAPES = [
    f"{dtype}:{head_dim}:{group}:{block_size}{kv}"
    for kv in ("", ":fp8")
    for dtype in ("bf16", "fp16", "fp32")
    for head_dim, group in ((128, 2), (64, 8), (128, 1), (16, 4))
    for block_size in (16, 256)
]
KV_DTYPES = {"fp8": "*fp8e4nv"}  # the cache's pointer type for a shape's KV suffix

if __name__ == "__main__":
    for shape in sys.argv[1:] or DEFAULT_SHAPES:
        dtype, head_dim, group, block_size, *kv = shape.split(":")
        kv_dtype = KV_DTYPES[kv[0]] if kv else None
        for report in builds("*" + dtype, int(head_dim), int(group), int(block_size), kv_dtype):
            shape_fields = {"shape": shape, "dtype": dtype, "kv": kv[0] if kv else dtype, "head_dim": int(head_dim)}
            print(
                json.dumps({**shape_fields, "group": int(group), "block_size": int(block_size), **report}), flush=True
            )
