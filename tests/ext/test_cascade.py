"""Cascade attention (nanoserve/ext/cascade.py): a decode step whose sequences share leading KV blocks attends to the
shared keys once for all of them and merges each sequence's own keys by log-sum-exp. The kernels against the
extension's PyTorch reference and both against the core's plain path, on fresh random batches (in Triton's interpreter
on a CPU); the engine's greedy outputs with it equal to those without it and to transformers; the rule that takes it;
bad settings refused by name."""

import gc
import os
import weakref

import pytest
import torch
from conftest import TRITON_DEVICE, extension_or_skip, hf_greedy, random_prompts, refused, sm90_builds
from test_attention import ATOL, assert_close, make_batch, randint

cascade = extension_or_skip("cascade")

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.attention import paged_attention_ref  # noqa: E402
from nanoserve.config import EngineConfig  # noqa: E402
from nanoserve.step_inputs import INTS_PER_16_BYTES  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_seed():
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch.manual_seed({seed})")


def shared_batch(num_seqs, shared_blocks, group, head_dim, block_size, dtype):
    """A decode batch whose sequences' first shared_blocks blocks are the same blocks (as the prefix cache makes
    them), each sequence with 1..40 keys of its own after them."""
    contexts = [shared_blocks * block_size + randint(1, 40) for _ in range(num_seqs)]
    q, k_cache, v_cache, meta = make_batch(
        [1] * num_seqs,
        contexts,
        num_heads=2 * group,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    meta.block_tables[1:, :shared_blocks] = meta.block_tables[0, :shared_blocks]  # (their own first blocks: unused)
    return q, k_cache, v_cache, meta


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, group, head_dim, block_size",
    [(torch.float32, 1, 64, 16), (torch.float16, 2, 128, 16), (torch.float32, 4, 32, 32)],
)
def test_kernels_equal_the_reference_and_the_plain_path(dtype, group, head_dim, block_size):
    """Guards against a shared key counted twice or missed, a partial merged with the wrong weight, a row of another
    sequence or head, or a tile read past the shared part: the cascade's kernels equal its PyTorch reference, and both
    equal the core's plain paged attention on the same batch, for 2-20 sequences (rows that do not fill a tile) and
    1-3 shared blocks, with the sequences' own keys split as the core would split them."""
    num_seqs, shared_blocks = randint(2, 20), randint(1, 3)
    q, k_cache, v_cache, meta = shared_batch(num_seqs, shared_blocks, group, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    suffix = cascade.suffix_metadata(meta, shared_blocks, block_size)
    plain = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    reference = cascade.cascade_attention_ref(q, k_cache, v_cache, meta, suffix, shared_blocks, scale)
    kernel = cascade.cascade_attention(q, k_cache, v_cache, meta, suffix, shared_blocks, scale)
    assert_close(reference, plain, ATOL[dtype], "reference vs plain")
    assert_close(kernel, reference, ATOL[dtype], "kernel vs reference")


def test_the_rule_takes_the_cascade_only_where_it_pays():
    """The step hook's rule on hand-made steps: decode-only, the shared blocks wholly before every sequence's newest
    token, and (sequences - 1) x shared tokens at least MIN_SAVED_KEY_READS."""
    from types import SimpleNamespace

    def step(tables, contexts, new_tokens=1):
        seqs = [SimpleNamespace(block_table=t, num_computed_tokens=c) for t, c in zip(tables, contexts, strict=True)]
        return SimpleNamespace(scheduled=[SimpleNamespace(seq=s, num_new_tokens=new_tokens) for s in seqs])

    hook = cascade.Cascade.__new__(cascade.Cascade)
    hook.block_size, hook.enabled = 16, True
    blocks_needed = -(-cascade.MIN_SAVED_KEY_READS // 16)  # shared blocks that pay with 2 sequences
    shared = list(range(100, 100 + blocks_needed))
    cases = [  # (tables, contexts, new tokens per sequence, shared blocks expected)
        ([shared + [1], shared + [2]], [16 * blocks_needed + 5] * 2, 1, blocks_needed),
        ([shared + [1], shared + [2]], [16 * blocks_needed + 5] * 2, 3, 0),  # a prefill chunk: plain
        ([shared[:-1] + [7, 1], shared + [2]], [16 * blocks_needed + 5] * 2, 1, 0),  # one block fewer: does not pay
        ([shared, shared], [16 * blocks_needed] * 2, 1, 0),  # the last shared block holds the newest token: too short
        ([shared + [1]], [16 * blocks_needed + 5], 1, 0),  # one sequence: nothing to share
    ]
    for tables, contexts, new_tokens, expected in cases:
        hook.before_step(step(tables, contexts, new_tokens))
        assert hook.shared_blocks == expected, (tables, contexts, new_tokens)


def test_each_sequences_own_block_table_stays_16_byte_aligned():
    """Guards against a shared run of any block count: each sequence's own block table is a view that starts after
    the shared blocks, and Triton compiles a kernel variant per pointer alignment, so a view that is not 16-byte
    aligned (a shared run that is not a multiple of 4 int32 blocks) compiled one in the middle of a run. The rule
    rounds the run down to a multiple of INTS_PER_16_BYTES blocks, and the views keep the step's alignment."""
    from types import SimpleNamespace

    hook = cascade.Cascade.__new__(cascade.Cascade)
    hook.block_size, hook.enabled = 16, True
    for extra in range(1, 2 * INTS_PER_16_BYTES):
        num_shared = -(-cascade.MIN_SAVED_KEY_READS // 16) + extra  # pays, and not always a multiple of 4
        tables = [list(range(100, 100 + num_shared)) + [1], list(range(100, 100 + num_shared)) + [2]]
        seqs = [SimpleNamespace(block_table=t, num_computed_tokens=16 * num_shared + 5) for t in tables]
        hook.before_step(SimpleNamespace(scheduled=[SimpleNamespace(seq=s, num_new_tokens=1) for s in seqs]))
        assert hook.shared_blocks == num_shared - num_shared % INTS_PER_16_BYTES, (num_shared, hook.shared_blocks)
    _, _, _, meta = shared_batch(3, 2 * INTS_PER_16_BYTES + 1, 2, 32, 16, torch.float32)
    assert meta.block_tables.data_ptr() % 16 == 0 and meta.block_tables.stride(0) % INTS_PER_16_BYTES == 0
    for shared_blocks in (INTS_PER_16_BYTES, 2 * INTS_PER_16_BYTES):
        own = cascade.suffix_metadata(meta, shared_blocks, 16).block_tables
        assert own.data_ptr() % 16 == 0, shared_blocks


@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=pytest.mark.gpu)])
def test_engine_outputs_are_unchanged(tiny_model, monkeypatch, kernels):
    """Guards against the engine's use of it (the step hook, the layers' attention, the suffix metadata per step):
    sequences behind a shared 70-token prompt (4 shared blocks of 16: the rule shares whole runs of 4), greedy, give
    transformers' tokens with cascade attention as without it, and the cascade did run (its threshold lowered so tiny
    steps take it)."""
    monkeypatch.setattr(cascade, "MIN_SAVED_KEY_READS", 1)
    path, hf = tiny_model("qwen3")
    system = random_prompts([70])[0]
    prompts = [system + tail for tail in random_prompts([3, 7, 5, 9])]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    device = TRITON_DEVICE if kernels == "triton" else "cpu"
    engine = {"device": device, "kernels": kernels, "dtype": "float32", "max_model_len": 128, "num_kvcache_blocks": 64}
    plain = [o.outputs[0].token_ids for o in LLM(path, **engine).generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, **engine, cascade_attention=True)
    cascaded = []
    state = llm.extensions["cascade"]

    def counting(q, *args):
        cascaded.append(bool(state.shared_blocks and args[2].decode_only))
        return state.paged_attention(q, *args)

    llm.runner.model.replace_kernels(paged_attention=counting)  # (the graphs were captured before: eager here)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == plain == [hf_greedy(hf, p, 8) for p in prompts]
    assert any(cascaded), "the cascade never ran"
    assert llm.stats()["kv_blocks_used"] == 0
    engine = weakref.ref(llm)  # no reference cycle through the extension: freed at once, the collector off
    gc.disable()
    try:
        del llm
        assert engine() is None
    finally:
        gc.enable()


def test_bad_settings_are_refused_by_name():
    refused("cascade_attention", EngineConfig, device="cpu", cascade_attention="yes")
    refused("cascade_attention", EngineConfig, device="cpu", cascade_attention=True, tensor_parallel_size=2)


def test_shared_prefix_kernel_compiles_for_h100_without_spills():
    """Guards against a kernel that only Triton's interpreter accepts: the shared-prefix kernel, at Qwen3-0.6B's
    heads (head_dim 128, group 2, block 16) in bf16 and fp16, and with an fp8 cache, compiles for an H100 (sm_90) with
    ptxas, with no register spills, its dots on wgmma (tests/sm90_build.py's build)."""
    script = """
from nanoserve.ext import cascade as C
for dtype, cache in (("*bf16", "*bf16"), ("*fp16", "*fp16"), ("*bf16", "*fp8e4nv")):
    types = {"q_ptr": dtype, "k_cache_ptr": cache, "v_cache_ptr": cache, "shared_table_ptr": "*i32",
             "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": dtype, "qk_scale": "fp32"}
    constants = {"GROUP": 2, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "TILE_M": C.SHARED_TILE_M[2], "TILE_N": C.SHARED_TILE_N}
    print(json.dumps(sm90_build.build(C._shared_prefix_kernel, types, constants, C.SHARED_NUM_WARPS)))
"""
    builds = sm90_builds(script)
    assert len(builds) == 3 and all(b["spill_bytes"] == 0 and b["wgmma"] for b in builds), builds
