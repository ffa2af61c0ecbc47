"""The paged-attention kernels against their PyTorch references (nanoserve/attention.py).

Inputs are random and fresh each run (the seed is printed, so pytest shows it with a failure). Caches start as
NaN and block tables are padded with a NaN block, so a kernel that reads past a context fails. On CPU the
kernels run in Triton's interpreter: shapes stay tiny and dtypes are fp32/fp16 (it computes bf16 dots wrongly);
tests marked gpu run bf16 at Qwen3-0.6B's head shapes and capture decode in a CUDA graph. The launchers check
nothing per call: AttentionMetadata validates its inputs once, when made, and is tested here too. FP8 caches
(float8 e4m3) are checked the same way: kernels and references read the same fp8 values and widen them exactly.
"""

import itertools
import os

import pytest
import torch

from nanoserve import attention
from nanoserve.attention import (
    DECODE_TILE_N,
    MAX_SPLITS,
    PAD_SLOT,
    PREFILL_TILE_M,
    PREFILL_TILE_N,
    PROGRAMS_PER_SM,
    AttentionMetadata,
    decode_splits,
    num_sms,
    paged_attention,
    paged_attention_ref,
    store_kv_ref,
)
from nanoserve.kernels import get_kernels
from nanoserve.step_inputs import BLOCK_TABLE_WIDTH_MULTIPLE, round_up

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = {torch.float32: 1e-4, torch.float16: 1e-2}  # CPU dtypes; fp16 rounds the softmax weights before P @ V
BF16_REL_TOL = 1e-2  # ||out - ref|| / ||ref|| against an fp32 reference
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# (dtype, GQA group = num_heads / num_kv_heads, head_dim, block_size): each ratio, head_dim, block size and dtype
CASES = [
    (torch.float32, 1, 64, 16),
    (torch.float16, 2, 128, 16),
    (torch.float32, 8, 64, 64),
    (torch.float16, 1, 128, 64),
    (torch.float32, 2, 32, 256),
]  # 256: a key tile and a split inside a block


@pytest.fixture(autouse=True)
def fresh_seed():
    """New random inputs every run; the seed is printed, and pytest shows it with a failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch.manual_seed({seed})")


@pytest.fixture(autouse=True)
def nan_for_new_buffers(monkeypatch):
    """Outputs and scratch buffers the launchers allocate start as NaN, so an element no kernel writes fails."""
    # torch's device context (`with torch.device(...)`, the loader's meta-device dry run) caches the set of factory
    # functions it redirects the first time it is used: let it see the real torch.empty, not the wrapper below
    with torch.device("cpu"):
        torch.empty(0)
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: poison(empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: poison(empty_like(*args, **kwargs)))


def store_kv(k, v, k_cache, v_cache, slots):
    """The engine's K/V store, which rides in the layer's rotation (the Triton backend's qk_norm_rope_store_kv: the
    fused kernel where ext/fused_kernels.py is installed): here with an identity rotation (cos 1, sin 0, no norm),
    so K and V reach their slots exactly as given (q: a copy of k)."""
    cos = torch.ones(1, k.shape[-1] // 2, device=k.device)
    positions = torch.zeros(len(k), dtype=torch.int32, device=k.device)
    rotate_and_store = get_kernels("triton").qk_norm_rope_store_kv
    rotate_and_store(k.clone(), k, v, positions, cos, torch.zeros_like(cos), k_cache, v_cache, slots)


def randint(low, high):
    """A random int in [low, high]."""
    return int(torch.randint(low, high + 1, ()))


def make_batch(
    query_lens,
    context_lens,
    *,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    dtype,
    kv_dtype=None,
):
    """Random q and a paged KV cache holding each sequence's keys in shuffled blocks; every other slot is NaN.

    Sequence i has context_lens[i] keys, of which the last query_lens[i] are this step's queries. The cache is in
    kv_dtype (default: dtype), written by store_kv_ref."""
    num_seqs = len(context_lens)
    blocks_per_seq = [-(-ctx // block_size) for ctx in context_lens]
    num_blocks = sum(blocks_per_seq) + 1  # one block is never written
    kv_dtype = kv_dtype or dtype
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=kv_dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    physical = torch.randperm(num_blocks, dtype=torch.int32, device=DEVICE)
    width = round_up(max(blocks_per_seq) + 1, BLOCK_TABLE_WIDTH_MULTIPLE)  # as the engine pads its block tables
    block_tables = physical[-1].repeat(num_seqs, width)  # padding -> the NaN block
    slots = []  # per sequence: [context_len] slot of each key
    for i, (first, n, ctx) in enumerate(
        zip(itertools.accumulate([0] + blocks_per_seq), blocks_per_seq, context_lens, strict=False)
    ):
        block_tables[i, :n] = physical[first : first + n]
        pos = torch.arange(ctx, device=DEVICE)
        slots.append(block_tables[i, pos // block_size] * block_size + pos % block_size)
    all_slots = torch.cat(slots).int()
    store_kv_ref(
        torch.randn(len(all_slots), num_kv_heads, head_dim, device=DEVICE).to(dtype),
        torch.randn(len(all_slots), num_kv_heads, head_dim, device=DEVICE).to(dtype),
        k_cache,
        v_cache,
        all_slots,
    )
    q = torch.randn(sum(query_lens), num_heads, head_dim, device=DEVICE).to(dtype)
    pad = torch.full((1,), PAD_SLOT, device=DEVICE)  # a context_len 0 sequence: a padded slot of a graph batch
    meta = AttentionMetadata(
        slot_mapping=torch.cat([s[-n:] if len(s) else pad for s, n in zip(slots, query_lens, strict=False)]).int(),
        query_start_loc=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        decode_only=all(n == 1 for n in query_lens),
    )
    return q, k_cache, v_cache, meta


def assert_close(out, ref, atol, what):
    """Fail with the max and mean absolute error, so a near miss reads differently from garbage."""
    err = (out.float() - ref.float()).abs()
    max_err, mean_err = err.max().item(), err.mean().item()
    assert max_err <= atol, f"{what}: max abs err {max_err:.3g}, mean {mean_err:.3g} (atol {atol})"  # NaN fails too


def assert_rel_close(out, ref, tol, what):
    err = (out.float() - ref).norm() / ref.norm()
    assert err < tol, f"{what}: relative err {err:.3g} (tol {tol}), max abs err {(out.float() - ref).abs().max():.3g}"


def heads(group, num_kv_heads=2):
    return {"num_heads": group * num_kv_heads, "num_kv_heads": num_kv_heads}


def metadata_fields(**changes) -> dict:
    """A valid decode-free batch of two sequences (2 and 1 queries; 5 and 3 keys), with `changes` applied."""
    ints = {"dtype": torch.int32, "device": DEVICE}
    fields = {
        "slot_mapping": torch.tensor([3, 4, 18], **ints),
        "query_start_loc": torch.tensor([0, 2, 3], **ints),
        "context_lens": torch.tensor([5, 3], **ints),
        "block_tables": torch.tensor([[0, 2], [1, 3]], **ints),
        "max_query_len": 2,
        "decode_only": False,
    }
    return {**fields, **changes}


BAD_METADATA = {
    "int64 context_lens": lambda f: {"context_lens": f["context_lens"].long()},
    "int64 slot_mapping": lambda f: {"slot_mapping": f["slot_mapping"].long()},
    "int64 block_tables": lambda f: {"block_tables": f["block_tables"].long()},
    "query_start_loc one short": lambda f: {"query_start_loc": f["query_start_loc"][:-1]},
    "query_start_loc one long": lambda f: {
        "query_start_loc": torch.cat([f["query_start_loc"], f["query_start_loc"][-1:]])
    },
    "a block table row missing": lambda f: {"block_tables": f["block_tables"][:1]},
    "block table entries strided": lambda f: {"block_tables": f["block_tables"].t().contiguous().t()},
    "decode_only with two queries for one sequence": lambda f: {"decode_only": True},
    "block tables on another device": lambda f: {"block_tables": f["block_tables"].to("meta")},
}


def test_metadata_checks_pass_a_valid_batch():
    AttentionMetadata(**metadata_fields())
    AttentionMetadata(
        **metadata_fields(
            slot_mapping=torch.tensor([4, 18], dtype=torch.int32, device=DEVICE),
            query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
            max_query_len=1,
            decode_only=True,
        )
    )


@pytest.mark.parametrize("bad", BAD_METADATA)
def test_bad_metadata_fails_at_construction(bad):
    """The launchers no longer check their inputs on every call: AttentionMetadata checks them once, when it is
    made (int32 everywhere, one device, one query_start_loc entry per sequence plus one, a block-table row per
    sequence with unit-stride entries, decode batches one query per sequence)."""
    fields = metadata_fields()
    with pytest.raises(AssertionError):
        AttentionMetadata(**{**fields, **BAD_METADATA[bad](fields)})


def test_unsupported_head_dim_is_refused_before_any_work(tmp_path):
    """Guards against a model whose head_dim the Triton kernels cannot tile (not a power of two, or over 128)
    failing deep inside a kernel compile: LLM(kernels="triton") refuses it up front, naming the field; the torch
    path runs it."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from nanoserve import LLM
    from nanoserve.sampling_params import InvalidField

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=96,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=48,
        max_position_embeddings=64,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(InvalidField) as info:
        LLM(str(tmp_path), kernels="triton", device=DEVICE, dtype="float32", max_model_len=32)
    assert info.value.field == "kernels" and "48" in str(info.value)
    llm = LLM(str(tmp_path), kernels="torch", device="cpu", max_model_len=32, num_kvcache_blocks=4)
    assert len(llm.generate([[1, 2, 3]], None, use_tqdm=False)[0].outputs[0].token_ids) > 0


@pytest.mark.parametrize(
    "dtype,num_kv_heads,head_dim,block_size", [(torch.float32, 2, 64, 16), (torch.float16, 3, 128, 64)]
)
def test_store_kv_writes_slots_and_skips_padding(dtype, num_kv_heads, head_dim, block_size):
    """store_kv writes each token to its own slot from strided K/V and leaves PAD_SLOT tokens' slots alone."""
    num_tokens, num_heads, num_blocks = 13, 4, 6
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, device=DEVICE).to(dtype)  # fused proj
    k, v = qkv[:, num_heads : num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads :]  # not contiguous
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens].int()
    slots[::4] = PAD_SLOT
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    v_cache = torch.randn_like(k_cache)
    k_expect, v_expect = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, k_expect, v_expect, slots)
    store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_expect) and torch.equal(v_cache, v_expect)


@pytest.mark.parametrize("dtype,group,head_dim,block_size", CASES)
def test_prefill_mixed_batch(dtype, group, head_dim, block_size):
    """Prefill, extend over cached blocks, decode and context-1 sequences in one batch see the right keys."""
    full = randint(20, 70)
    extend_ctx, decode_ctx = randint(40, 140), randint(2, 100)
    query_lens = [full, randint(2, 30), 1, 1]
    context_lens = [full, extend_ctx, decode_ctx, 1]
    q, k_cache, v_cache, meta = make_batch(
        query_lens, context_lens, **heads(group), head_dim=head_dim, block_size=block_size, dtype=dtype
    )
    out = paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5)
    assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, head_dim**-0.5), ATOL[dtype], "prefill")


def test_prefill_query_spans_several_tiles():
    """Query tiles after the first keep their own rows and causal bound (a long chunk after a cached prefix)."""
    query_len = PREFILL_TILE_M[4] + randint(1, 40)  # fp32 tiles
    context_lens = [query_len + randint(1, 50), 3]
    q, k_cache, v_cache, meta = make_batch(
        [query_len, 2], context_lens, **heads(2, 1), head_dim=64, block_size=16, dtype=torch.float32
    )
    out = paged_attention(q, k_cache, v_cache, meta, 0.125)
    assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, 0.125), ATOL[torch.float32], "long prefill")


@pytest.mark.parametrize("dtype,group,head_dim,block_size", CASES)
def test_decode(dtype, group, head_dim, block_size):
    """Split-KV decode with GQA groups: every split and the merge of their softmaxes match the reference."""
    context_lens = [1, randint(2, 60), randint(60, 200), randint(200, 300)]
    q, k_cache, v_cache, meta = make_batch(
        [1] * 4, context_lens, **heads(group), head_dim=head_dim, block_size=block_size, dtype=dtype
    )
    out = paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5)
    assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, head_dim**-0.5), ATOL[dtype], "decode")


def test_decode_batch_that_needs_no_split():
    """A batch that fills the device unsplit takes the single-split path (a size-1 merge) correctly."""
    num_kv_heads = 2
    num_seqs = PROGRAMS_PER_SM * num_sms(torch.device(DEVICE)) // num_kv_heads
    context_lens = [randint(1, 150) for _ in range(num_seqs)]
    q, k_cache, v_cache, meta = make_batch(
        [1] * num_seqs, context_lens, **heads(2, num_kv_heads), head_dim=64, block_size=16, dtype=torch.float32
    )
    assert decode_splits(num_seqs, num_kv_heads, num_sms(q.device)) == 1
    out = paged_attention(q, k_cache, v_cache, meta, 0.125)
    assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, 0.125), ATOL[torch.float32], "decode")


def test_decode_graph_sized_grid():
    """A grid from the batch size alone, as a CUDA graph holds it: contexts shorter than one tile per split (empty
    splits) and a context_len-0 slot (a padded graph row) neither leak nor make NaN."""
    context_lens = [0, 1, randint(2, 40), randint(600, 900)]
    q, k_cache, v_cache, meta = make_batch(
        [1] * 4, context_lens, **heads(3, 1), head_dim=64, block_size=16, dtype=torch.float32
    )
    num_splits = decode_splits(4, 1, num_sms(q.device))
    assert 1 < num_splits and context_lens[2] < num_splits * DECODE_TILE_N[4, 4]  # short contexts: empty splits
    out = paged_attention(q, k_cache, v_cache, meta, 0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_close(out[1:], paged_attention_ref(q, k_cache, v_cache, meta, 0.125)[1:], ATOL[torch.float32], "decode")


@pytest.mark.parametrize("num_seqs", [1, 2, 8, 9, 33, 64, 65, 256])
def test_decode_splits_fill_the_gpu(num_seqs):
    """The split count comes from the batch alone (a CUDA graph's grid), stays within MAX_SPLITS, and is the fewest
    that give an H100 (132 SMs) about PROGRAMS_PER_SM programs per SM: one split fewer would leave SMs short of
    programs, and a batch that fills them unsplit gets one split (the rule the H100 measured on 2026-11-27)."""
    num_kv_heads, h100_sms = 8, 132
    wave = PROGRAMS_PER_SM * h100_sms
    num_splits = decode_splits(num_seqs, num_kv_heads, h100_sms)
    assert 1 <= num_splits <= MAX_SPLITS
    programs = num_seqs * num_kv_heads * num_splits
    assert programs >= wave or num_splits == MAX_SPLITS
    assert num_splits == 1 or programs - num_seqs * num_kv_heads < wave  # one split fewer would not fill it
    if num_seqs * num_kv_heads >= wave:
        assert num_splits == 1


def triton_variant_key(arg):
    """What Triton compiles a new variant for: a tensor's dtype and 16-byte alignment, whether an int is 1 or a
    multiple of 16 (its value otherwise does not matter), a float's type alone; constexprs by value."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, int):
        return arg == 1, arg % 16 == 0
    return type(arg)


class NotLaunched:
    """Stands in for a kernel that should not run: kernel[grid](*args, **constexprs) does nothing."""

    def __getitem__(self, grid: tuple):
        return lambda *args, **constexprs: None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_batch_that_fills_the_gpu_runs_one_split_and_no_reduce(dtype, monkeypatch):
    """Guards against the one-split path (a batch big enough that each (sequence, KV head) program alone fills the
    GPU: the split kernel writes the output itself) writing a wrong or unnormalized output or another row's, or still
    launching the reduce kernel (the H100 measured it at 9.6% of a batch-256 step with nothing to merge): decodes
    alone and beside prefill chunks equal the reference with the reduce kernel removed."""
    num_sms_here = num_sms(torch.device(DEVICE))
    num_seqs = -(-PROGRAMS_PER_SM * num_sms_here // 2) + 2  # 2 KV heads: one split
    assert decode_splits(num_seqs, 2, num_sms_here) == 1
    monkeypatch.setattr(attention, "_decode_reduce_kernel", NotLaunched())
    for query_lens in ([1] * num_seqs, [randint(2, 30)] + [1] * (num_seqs - 2) + [randint(2, 30)]):
        context_lens = [max(q, randint(1, 300)) for q in query_lens]
        q, k_cache, v_cache, meta = make_batch(
            query_lens, context_lens, **heads(2), head_dim=32, block_size=16, dtype=dtype
        )
        out = paged_attention(q, k_cache, v_cache, meta, 32**-0.5)
        assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, 32**-0.5), ATOL[dtype], "one split")


@pytest.mark.parametrize("group", [1, 2, 8])
def test_the_reduce_merges_every_split_the_same_way_each_time(group):
    """Guards against the reduce kernel weighting a split wrongly, missing a query head of the group, or reading a
    padded split (MAX_SPLITS is the kernel's tile, not the count): several splits, three launches over the same inputs
    each equal to the reference and bitwise equal to each other (the merge sums in split order), and a context of 0
    keys (a graph's padded row) gives 0, not NaN."""
    num_seqs = randint(1, 3)
    context_lens = [randint(1, 400) for _ in range(num_seqs)] + [0]
    q, k_cache, v_cache, meta = make_batch(
        [1] * (num_seqs + 1),
        [max(c, 1) for c in context_lens],
        **heads(group),
        head_dim=32,
        block_size=16,
        dtype=torch.float32,
    )
    meta.context_lens[-1] = 0
    assert decode_splits(num_seqs + 1, 2, num_sms(torch.device(DEVICE))) > 1
    expected = paged_attention_ref(q, k_cache, v_cache, meta, 32**-0.5)
    outs = [paged_attention(q, k_cache, v_cache, meta, 32**-0.5) for _ in range(3)]
    for out in outs:
        assert_close(out, expected, ATOL[torch.float32], "merged by the reduce")
        assert torch.equal(out, outs[0]) and not out[-1].any()


def test_the_reference_attends_in_runs_whose_padding_is_bounded(monkeypatch):
    """Guards against the PyTorch reference padding a whole step to its longest prompt: warm-up's step (a long prompt
    beside a crowd of one-token sequences) asked for 8 GiB on a GPU. Sequences go in runs whose padded queries x keys
    stay under REFERENCE_RUN_SIZE (a longer sequence alone), and the result is the same as one run's and the
    kernels'."""
    query_lens = [1] * 20 + [120] + [1] * 30 + [randint(20, 40)]  # 31 x 20 x 90 keys: the last opens a run
    context_lens = [randint(1, 60) for _ in range(20)] + [120] + [randint(1, 200) for _ in range(30)] + [90]
    q, k_cache, v_cache, meta = make_batch(
        query_lens, context_lens, **heads(2), head_dim=32, block_size=16, dtype=torch.float32
    )
    whole = paged_attention_ref(q, k_cache, v_cache, meta, 0.125)  # one run: the default bound is far above
    size = 120 * 120
    monkeypatch.setattr(attention, "REFERENCE_RUN_SIZE", size)
    meta.reference_gather = None
    runs = attention.reference_groups(meta)
    assert slice(20, 21) in runs and len(runs) > 3
    for run in runs:
        padded = (run.stop - run.start) * max(query_lens[run]) * max(context_lens[run])
        assert padded <= size or run.stop - run.start == 1, (run, padded)
    assert [i for run in runs for i in range(run.start, run.stop)] == list(range(len(query_lens)))
    in_runs = paged_attention_ref(q, k_cache, v_cache, meta, 0.125)
    assert_close(in_runs, whole, 1e-6, "in runs")
    assert_close(in_runs, paged_attention(q, k_cache, v_cache, meta, 0.125), ATOL[torch.float32], "kernels")


@pytest.mark.gpu
@needs_cuda
def test_the_torch_backend_warms_up_on_a_gpu_within_its_memory(tmp_path):
    """Guards against LLM(kernels="torch") on a GPU running out of memory in warm-up (the H100 run of 2026-11-27:
    8 GiB asked for the 8,192-token dummy step): a model of 8,192 positions warms up with the default step budget
    and max_num_seqs, and its peak stays far below what one padded run of the step would take."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from nanoserve import LLM, SamplingParams

    config = LlamaConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    torch.cuda.reset_peak_memory_stats()
    llm = LLM(
        str(tmp_path), kernels="torch", max_model_len=8192, num_kvcache_blocks=64
    )  # a small pool: the peak is warm-up's
    # one padded run: 256 sequences x 8,192 queries x 8,192 keys of mask alone is 17 GB
    assert torch.cuda.max_memory_allocated() < 8 * 2**30
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_decode_kernels_have_one_variant_for_every_batch(monkeypatch):
    """Guards against decode kernels compiled in the middle of an eager run (0.5-1 s each on a GPU): warm-up runs
    prefill steps only, which launch the decode kernels too, so every decode step, whatever its batch size and
    number of splits or its mix of prefills, must present one variant key to Triton per kind of launch: the split
    kernel writing partials, the reduce merging them, and, for a batch that fills the GPU, the split kernel writing the
    output itself. The batch sizes come from this device's SM count: from 1 sequence (the most splits) to one that
    fills every SM by itself (one split: 2 x SMs sequences of 2 KV heads, 132 SMs on an H100)."""
    keys = {}

    class Recorder:  # stands in for a kernel: kernel[grid](*args, **constexprs) records the variant's key
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **constexprs):
                key = tuple(map(triton_variant_key, args)) + tuple(sorted(constexprs.items()))
                keys.setdefault((self.name, constexprs.get("ONE_SPLIT")), set()).add(key)

            return launch

    monkeypatch.setattr(attention, "_decode_split_kernel", Recorder("_decode_split_kernel"))
    monkeypatch.setattr(attention, "_decode_reduce_kernel", Recorder("_decode_reduce_kernel"))
    num_sms_here = num_sms(torch.device(DEVICE))
    one_split_batch = -(-PROGRAMS_PER_SM * num_sms_here // 2)  # sequences of 2 KV heads that fill every SM's programs
    splits = set()
    for num_seqs in (1, 2, 3, 5, one_split_batch // 2, one_split_batch, one_split_batch + 3):
        for query_lens in ([1] * num_seqs, [randint(2, 20)] + [1] * (num_seqs - 1)):
            context_lens = [randint(20, 300) for _ in range(num_seqs)]
            q, k_cache, v_cache, meta = make_batch(
                query_lens, context_lens, **heads(2), head_dim=32, block_size=16, dtype=torch.float16
            )
            monkeypatch.setattr(attention, "_prefill_kernel", NotLaunched())
            paged_attention(q, k_cache, v_cache, meta, 0.125)
        splits.add(decode_splits(num_seqs, 2, num_sms_here))
    assert 1 in splits and len(splits) >= 4, splits
    assert {kind: len(variants) for kind, variants in keys.items()} == {
        ("_decode_split_kernel", False): 1,
        ("_decode_split_kernel", True): 1,
        ("_decode_reduce_kernel", None): 1,
    }


def test_decode_any_context_in_a_long_pool():
    """One grid serves contexts from 1 key to 40k (each sequence cuts its own context into the grid's splits),
    in a pool sized for them: a split length from max_model_len, or splits that lose the tail, would show here."""
    tile = DECODE_TILE_N[4, 4]  # fp32
    context_lens = [1, tile - 1, tile + 1, randint(100, 1000), randint(5000, 9000), 40_000]
    q, k_cache, v_cache, meta = make_batch(
        [1] * len(context_lens), context_lens, **heads(2, 1), head_dim=16, block_size=16, dtype=torch.float32
    )
    out = paged_attention(q, k_cache, v_cache, meta, 0.25)
    assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, 0.25), ATOL[torch.float32], "decode, long pool")


@pytest.mark.parametrize("group", [1, 2, 4, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_step_sends_decodes_to_the_split_kernel(group, dtype, monkeypatch):
    """In a mixed step the one-query sequences (decodes, a one-token chunk) run through the split-KV kernel and the
    others through the prefill kernel, each skipping the other's rows: together they match the reference, and with
    either launch removed exactly its own rows stay unwritten (NaN from the poisoned allocator)."""
    decode_ctx = [randint(1, 200) for _ in range(4)]
    query_lens = [1, randint(2, 40), 1, 1, randint(2 * PREFILL_TILE_N, 150), 1]
    context_lens = [decode_ctx[0], randint(40, 120), decode_ctx[1], decode_ctx[2], randint(150, 260), decode_ctx[3]]
    q, k_cache, v_cache, meta = make_batch(
        query_lens, context_lens, **heads(group), head_dim=32, block_size=16, dtype=dtype
    )
    out = paged_attention(q, k_cache, v_cache, meta, 32**-0.5)
    assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, 32**-0.5), ATOL[dtype], "mixed step")
    decode_row = torch.tensor([n == 1 for n in query_lens for _ in range(n)], device=DEVICE)
    decode_kernels, prefill_kernels = ("_decode_split_kernel", "_decode_reduce_kernel"), ("_prefill_kernel",)
    for kernels, unwritten in ((decode_kernels, decode_row), (prefill_kernels, ~decode_row)):
        with monkeypatch.context() as patch:
            for kernel in kernels:
                patch.setattr(attention, kernel, NotLaunched())
            partial = paged_attention(q, k_cache, v_cache, meta, 32**-0.5)
        assert partial[unwritten].isnan().all() and torch.equal(partial[~unwritten], out[~unwritten]), kernels


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("decode", [False, True])
def test_bf16_qwen3_heads(block_size, decode):
    """bf16 at Qwen3-0.6B's heads (16 q, 8 kv, head_dim 128) and realistic lengths stays close to fp32."""
    if decode:
        context_lens = [randint(1, 4000) for _ in range(32)] + [1, 4096]
        query_lens = [1] * len(context_lens)
    else:
        context_lens = [randint(1, 1500) for _ in range(6)] + [1, 700, 2048]
        query_lens = [randint(1, c) for c in context_lens[:6]] + [1, 1, 2048]
    q, k_cache, v_cache, meta = make_batch(
        query_lens,
        context_lens,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        block_size=block_size,
        dtype=torch.bfloat16,
    )
    out = paged_attention(q, k_cache, v_cache, meta, 128**-0.5)
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, 128**-0.5)
    assert_rel_close(out, ref, BF16_REL_TOL, "decode" if decode else "prefill")


@pytest.mark.gpu
@needs_cuda
def test_decode_cuda_graph_replay():
    """Decode captured in a CUDA graph replays new context lengths exactly as eager does (no host sync inside)."""
    max_model_len, num_seqs = 4096, 8
    context_lens = [randint(1, max_model_len) for _ in range(num_seqs)]
    q, k_cache, v_cache, meta = make_batch(
        [1] * num_seqs,
        context_lens,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype=torch.bfloat16,
    )
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels outside the capture
        paged_attention(q, k_cache, v_cache, meta, 128**-0.5)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(q, k_cache, v_cache, meta, 128**-0.5)
    # the next step: other lengths (keys that the cache holds) and one padded slot, written into the same tensors
    new_lens = [randint(1, c) for c in context_lens[:-1]] + [0]
    meta.context_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
    q.copy_(torch.randn_like(q))
    graph.replay()
    eager = paged_attention(q, k_cache, v_cache, meta, 128**-0.5)
    assert torch.equal(out, eager)
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, 128**-0.5)
    assert_rel_close(out[:-1], ref[:-1], BF16_REL_TOL, "graph replay")


# ---- FP8 KV cache (kv_cache_dtype="fp8") ---------------------------------------------------------------------------
FP8 = getattr(torch, "float8_e4m3fn", None)
needs_fp8 = pytest.mark.skipif(FP8 is None, reason="this torch has no float8 types")


@needs_fp8
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_writes_fp8_slots(dtype):
    """store_kv into fp8 caches: each token's K/V cast into its slot, padding skipped. The inputs are fp8 values
    (K and V carry exact fp8 numbers), since the interpreter's fp8 rounding is approximate; on a GPU the cast is
    the hardware's round-to-nearest, saturating (test_store_kv_fp8_rounds_as_torch)."""
    num_tokens, num_kv_heads, head_dim, block_size, num_blocks = 11, 2, 32, 16, 4
    k = (torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE) * 4).to(FP8).to(dtype)
    v = (torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE) / 4).to(FP8).to(dtype)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens].int()
    slots[::3] = PAD_SLOT
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE).to(FP8)
    v_cache = torch.randn_like(k_cache, dtype=torch.float32).to(FP8)
    k_expect, v_expect = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, k_expect, v_expect, slots)
    store_kv(k, v, k_cache, v_cache, slots)
    # K passes through the rotation (identity here) and may flip a zero's sign: -0 * 1 - (-x * 0) = +0; equal as
    # numbers, so K is compared as numbers, V (stored as given) byte for byte
    assert torch.equal(k_cache.float(), k_expect.float())
    assert torch.equal(v_cache.view(torch.uint8), v_expect.view(torch.uint8))


@needs_fp8
@pytest.mark.parametrize("dtype,group,head_dim,block_size", [(torch.float32, 2, 64, 16), (torch.float16, 7, 32, 64)])
def test_attention_reads_fp8_caches(dtype, group, head_dim, block_size):
    """Prefill chunks and decodes over fp8 caches: the kernels widen the same fp8 values the reference widens, so
    they agree as closely as over caches of the model's dtype."""
    query_lens = [randint(20, 70), 1, randint(2, 30), 1]
    context_lens = [query_lens[0], randint(2, 150), randint(40, 140), 1]
    q, k_cache, v_cache, meta = make_batch(
        query_lens, context_lens, **heads(group), head_dim=head_dim, block_size=block_size, dtype=dtype, kv_dtype=FP8
    )
    assert k_cache.dtype == FP8 and k_cache.element_size() == 1
    out = paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5)
    assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, head_dim**-0.5), ATOL[dtype], "fp8 cache")
    decodes = [0, 1, 3]
    q, k_cache, v_cache, meta = make_batch(
        [1] * 3,
        [context_lens[i] for i in decodes],
        **heads(group),
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        kv_dtype=FP8,
    )
    out = paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5)
    assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, head_dim**-0.5), ATOL[dtype], "fp8 decode")


@pytest.mark.gpu
@needs_cuda
@needs_fp8
def test_store_kv_fp8_rounds_as_torch():
    """On a GPU, the store kernel's cast to e4m3 is torch's: round to nearest even, saturating at +-448 (values
    beyond it, as a large K outlier would be, stay finite)."""
    k = torch.randn(300, 8, 128, device="cuda", dtype=torch.bfloat16) * 8
    k[0, 0, :4] = torch.tensor([500.0, -1000.0, 1e-3, 3.1e-3])  # saturating; subnormals
    v = torch.randn_like(k)
    slots = torch.randperm(32 * 16, device="cuda")[:300].int()
    k_cache = torch.zeros(32, 16, 8, 128, device="cuda", dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    k_expect, v_expect = k_cache.clone(), v_cache.clone()
    store_kv_ref(k.clamp(-448, 448), v, k_expect, v_expect, slots)  # e4m3's largest finite value: 448
    store_kv(k, v, k_cache, v_cache, slots)
    # K passes through the rotation (identity here) and may flip a zero's sign: -0 * 1 - (-x * 0) = +0; equal as
    # numbers, so K is compared as numbers, V (stored as given) byte for byte
    assert torch.equal(k_cache.float(), k_expect.float())
    assert torch.equal(v_cache.view(torch.uint8), v_expect.view(torch.uint8))
