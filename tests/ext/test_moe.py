"""Mixture-of-experts models (nanoserve/ext/moe/): tiny random Qwen3-MoE (one routing layer, one dense, k weights not
renormalised) and Mixtral (every layer routes, renormalised) from transformers' configs, fp32 on the CPU. Greedy output
equal to transformers token for token, alone and in mixed batches, with chunked prefill, preemption and prefix caching,
with the fused kernel inside decode graphs, with two tensor-parallel ranks, with n-gram drafts, the latency kernels,
cascade attention and LoRA on the attention. The fused kernel against its reference (the loop over experts) on shapes
drawn afresh each run, the grouping's bookkeeping under hypothesis, and its sm_90 build without spills. Bad configs
refused by name. The course's experiment: how many distinct experts a batch of N tokens touches, against the formula."""

import json
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    TINY,
    RerunGraph,
    extension_or_skip,
    graphs_on_a_cpu,
    hf_greedy,
    random_prompts,
    refused,
    sm90_builds,
)
from hypothesis import given, settings
from hypothesis import strategies as st

moe = extension_or_skip("moe")
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig  # noqa: E402

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.ext import find  # noqa: E402
from nanoserve.ext.moe.kernels import (  # noqa: E402
    MIN_BLOCK_M,
    block_rows,
    fused_moe,
    fused_moe_ref,
    group_by_expert,
    group_by_expert_kernel,
    route,
)
from nanoserve.kernels import get_kernels  # noqa: E402
from nanoserve.layers import Layers  # noqa: E402
from nanoserve.model import CausalLM, ModelArgs  # noqa: E402

ENGINE = {"device": "cpu", "max_model_len": 256, "num_kvcache_blocks": 64}
NUM_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
# config.json's fields of each tiny family; a test may change some (more)
MOE_FIELDS = {
    # layer 0 routes to 2 of 8 experts, layer 1 is dense (mlp_only_layers); the k weights are not renormalised
    "qwen3_moe": dict(
        TINY,
        num_attention_heads=8,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        norm_topk_prob=False,
    ),
    # every layer routes to 2 of 4 experts (intermediate_size is each expert's), renormalised; head_dim null
    "mixtral": dict(TINY, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
}
CONFIGS = {"qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig}


def moe_config(family: str, **more: object) -> Qwen3MoeConfig | MixtralConfig:
    return CONFIGS[family](**MOE_FIELDS[family] | more)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """moe_model(family) -> (directory, transformers model in fp32), made once per module."""
    made = {}

    def make(family: str):
        if family not in made:
            torch.manual_seed(10 + len(made))
            hf = AutoModelForCausalLM.from_config(moe_config(family)).eval()
            path = tmp_path_factory.mktemp(family)
            hf.save_pretrained(path)
            made[family] = (str(path), hf)
        return made[family]

    return make


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# ---- the models against transformers ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(MOE_FIELDS))
def test_greedy_matches_transformers_in_mixed_batches(moe_model, family):
    """Guards against any routing or loading bug (softmax before top-k, the renormalisation, a gate swapped with up,
    Mixtral's w1/w3/w2 names, an expert's weights in another's place, a dense layer taken for a routing one, Mixtral's
    null head_dim) and against tokens of different sequences disturbing each other's routing in one batch."""
    path, hf = moe_model(family)
    llm = LLM(path, **ENGINE)
    prompts = random_prompts([3, 17, 40, 64])
    alone = tokens(llm.generate(prompts[:1], GREEDY, use_tqdm=False))
    together = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert together == [hf_greedy(hf, p, NUM_TOKENS) for p in prompts] and alone == together[:1]
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("family", sorted(MOE_FIELDS))
def test_chunked_prefill_preemption_and_prefix_caching(moe_model, family):
    """Guards against an expert block that keeps anything across steps or tokens: prompts cut into 16-token chunks,
    sequences preempted in a 6-block pool and recomputed, and a second wave that takes the first's cached prefix, all
    give transformers' tokens."""
    path, hf = moe_model(family)
    llm = LLM(path, **dict(ENGINE, num_kvcache_blocks=6, max_num_batched_tokens=16, max_num_seqs=4))
    shared = random_prompts([33])[0]
    for wave in ([shared + p for p in random_prompts([4, 9])], [shared + p for p in random_prompts([6, 2, 11])]):
        assert tokens(llm.generate(wave, GREEDY, use_tqdm=False)) == [hf_greedy(hf, p, NUM_TOKENS) for p in wave]
    stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["prefix_hit_tokens"] >= 32 and stats["kv_blocks_used"] == 0


def test_the_fused_kernel_in_decode_graphs(moe_model, monkeypatch):
    """Guards against the fused kernel breaking the decode graphs (a shape that follows the routing, a padded row of
    the graph's batch routed into a real token's output): the Triton backend, with graphs captured and replayed (on
    the CPU: the forward rerun on the graphs' buffers), gives transformers' tokens."""
    path, hf = moe_model("qwen3_moe")
    captured = graphs_on_a_cpu(monkeypatch)
    llm = LLM(path, **dict(ENGINE, kernels="triton", max_num_seqs=3))
    assert llm.runner.model.model.layers[0].mlp.experts is fused_moe
    graphs = captured[0]
    graphs.graphs = {size: RerunGraph(graphs, size) for size in graphs.graphs}
    graphs.replays = 0
    prompts = random_prompts([5, 19, 11])  # 3 rows in a graph of 4: one padded row
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == [hf_greedy(hf, p, 6) for p in prompts]
    assert graphs.replays >= 5


@pytest.mark.parametrize("family", sorted(MOE_FIELDS))
def test_two_ranks_equal_one_rank(moe_model, family):
    """Guards against a wrong shard of the experts under tensor parallelism (gate and up sliced apart, down's columns
    not matching them, the all-reduce missing or doubled, ranks routing differently): two ranks (gloo) give one
    rank's tokens and transformers', with preemption in a 5-block pool."""
    extension_or_skip("tp")
    path, hf = moe_model(family)
    prompts = random_prompts([21, 9, 30])
    engine = {"device": "cpu", "max_model_len": 128, "max_num_batched_tokens": 64, "num_kvcache_blocks": 5}
    outputs = {}
    for size in (1, 2):
        llm = LLM(path, tensor_parallel_size=size, **engine)
        outputs[size] = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        assert llm.stats()["preemptions"] > 0
        llm.close()
    assert outputs[2] == outputs[1] == [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]


def test_ngram_drafts_latency_kernels_and_cascade_change_nothing(moe_model):
    """Guards against an extension that assumes every layer has a dense MLP: n-gram speculative decoding (a draft's
    tokens routed in the same step as the sequence's), ext/latency (the dense layers' projections wrapped, SiLU moved
    into their down projection, the experts left alone) and cascade attention each give transformers' greedy tokens
    on Qwen3-MoE."""
    path, hf = moe_model("qwen3_moe")
    motif = random_prompts([6])[0]
    prompts = [motif * 5, random_prompts([20])[0]]
    expected = [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    options = {"speculative": {"speculative_config": ngram}}
    options |= {"latency": {"latency_kernels": True}, "cascade": {"cascade_attention": True}}
    for name, option in options.items():
        if find(name) is None:
            continue  # (not installed)
        llm = LLM(path, **ENGINE, **option)
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected, name
        assert llm.stats()["kv_blocks_used"] == 0
        if name == "speculative":
            assert llm.stats()["spec_accepted_tokens"] > 0


def test_lora_adapts_attention_and_refuses_experts(moe_model, tmp_path):
    """Guards against LoRA on a MoE model adapting the wrong rows or silently skipping what it cannot adapt: PEFT's
    adapter of q and v gives PEFT's tokens; PEFT's adapter of gate and up (which it applies to transformers' stacked
    experts) is refused by name, and the engine serves on."""
    lora = extension_or_skip("lora")
    peft = pytest.importorskip("peft")
    path, _ = moe_model("qwen3_moe")
    peft_models = {}
    for name, targets in {"qv": ["q_proj", "v_proj"], "experts": ["q_proj", "gate_proj", "up_proj"]}.items():
        torch.manual_seed(3)
        config = peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False)
        peft_models[name] = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path), config).eval()
        peft_models[name].save_pretrained(tmp_path / name)
    llm = LLM(path, **ENGINE, enable_lora=True)
    prompts = random_prompts([7, 15])
    qv = lora.LoRARequest("qv", 1, str(tmp_path / "qv"))
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=qv))
    assert got == [hf_greedy(peft_models["qv"], p, NUM_TOKENS) for p in prompts]
    assert got != tokens(llm.generate(prompts, GREEDY, use_tqdm=False))  # the adapter changed something
    experts = lora.LoRARequest("experts", 2, str(tmp_path / "experts"))
    error = refused("lora_request", llm.generate, prompts, GREEDY, use_tqdm=False, lora_request=experts)
    assert any(name in str(error) for name in ("experts", "gate_up_proj"))  # (PEFT's rank_pattern for the experts)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=qv)) == got  # still serves


def test_routing_layers_are_transformers_own():
    """Guards against a dense layer routed or a routing one dense: with decoder_sparse_step=2 and mlp_only_layers, the
    layers whose MLP routes are those where transformers builds its sparse block (both built on the meta device)."""
    cfg = moe_config("qwen3_moe", num_hidden_layers=7, decoder_sparse_step=2, mlp_only_layers=[3])
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
        ours = CausalLM(ModelArgs.from_hf(cfg), get_kernels("torch"))
    theirs = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert theirs == [i for i, layer in enumerate(ours.model.layers) if isinstance(layer.mlp, moe.SparseMoeBlock)]
    assert theirs == [1, 5]


ON_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@ON_GPU
def test_on_a_gpu_decode_graphs_give_transformers_tokens(tmp_path):
    """Guards against a grouping that a real CUDA graph cannot capture or replay (a host read, an allocation whose
    size follows the routing), on both paths: 3 sequences (24 pairs: the one-program grouping) and 40 (in a graph of
    48: 384 pairs, PyTorch's sort), Qwen3-MoE with 8 of 16 experts, fp32 with the Triton kernels, equal to
    transformers' greedy tokens."""
    torch.manual_seed(4)
    hf = AutoModelForCausalLM.from_config(moe_config("qwen3_moe", num_experts=16, num_experts_per_tok=8)).eval()
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, num_kvcache_blocks=256, max_num_seqs=48)
    assert llm.runner.graphs is not None
    hf = hf.cuda()
    for num_prompts in (3, 40):
        prompts = random_prompts([int(n) for n in torch.randint(4, 40, (num_prompts,))])
        got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        assert got == [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.gpu
@ON_GPU
@pytest.mark.parametrize("num_tokens", [1, 7, 32, 300, 2048])
def test_on_a_gpu_the_fused_kernel_in_bf16_equals_the_loop(num_tokens):
    """Guards against what only the compiled kernel can get wrong (wgmma tiles, pipelined loads, bf16 rounding) at a
    Qwen3-30B-A3B routing layer's shapes (hidden 2048, 8 of 128 experts of 768), decode to prefill sizes. The bounds
    allow bf16's roundings, which differ (the loop rounds gate|up, SiLU and each product; the kernel once): a CPU
    emulation of the two at 64 tokens differs by 0.7% of the largest output at most and 0.45% on average."""
    hidden, num_experts, top_k, inner = 2048, 128, 8, 768
    x = torch.randn(num_tokens, hidden, device="cuda").bfloat16()
    w13 = (torch.randn(num_experts, 2 * inner, hidden, device="cuda") / hidden**0.5).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inner, device="cuda") / inner**0.5).bfloat16()
    weights, experts = route(torch.randn(num_tokens, num_experts, device="cuda"), top_k, renormalize=True)
    expected = fused_moe_ref(x, w13, w2, weights, experts).float()
    error = (fused_moe(x, w13, w2, weights, experts).float() - expected).abs()
    assert error.max() <= 0.03 * expected.abs().max() and error.mean() <= 0.015 * expected.abs().mean(), (
        f"max error {error.max():.2e}, mean {error.mean():.2e}"
    )


# ---- bad input ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "family, edit, named",
    [
        ("qwen3_moe", {"scoring_func": "sigmoid"}, "scoring_func"),  # DeepSeek's scores
        ("mixtral", {"topk_method": "noaux_tc"}, "topk_method"),
        ("qwen3_moe", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),  # Qwen2-MoE's
        ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9"),  # k above E = 8
        ("mixtral", {"num_experts_per_tok": 0}, "num_experts_per_tok=0"),
        ("mixtral", {"sliding_window": 16}, "sliding_window"),
    ],
)
def test_bad_configs_are_refused_by_name(moe_model, tmp_path, family, edit, named):
    """Guards against a routing nanoserve does not implement being served as if it were softmax-top-k (wrong tokens,
    no error), and k above E failing inside topk: config.json edited, refused as an InvalidField naming the option."""
    path, _ = moe_model(family)
    folder = tmp_path / "edited"
    shutil.copytree(path, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | edit))
    assert named in str(refused("model", LLM, str(folder), **ENGINE))


def test_tensor_parallel_size_must_divide_the_experts():
    """Guards against uneven expert shards (a rank's slice of gate and of up of different widths): a rank count that
    does not divide moe_intermediate_size is refused naming tensor_parallel_size, when the model is built."""

    class TwoRanks(Layers):
        size = 2

    args = ModelArgs.from_hf(moe_config("mixtral", intermediate_size=33))
    with torch.device("meta"):
        error = refused("tensor_parallel_size", CausalLM, args, get_kernels("torch"), TwoRanks())
    assert "moe_intermediate_size=33" in str(error)


# ---- the kernel -----------------------------------------------------------------------------------------------------
def random_routing(num_tokens: int, num_experts: int, top_k: int, spread: str, seed: int) -> tuple:
    """(weights [tokens, k] fp32, experts [tokens, k]): each token's k distinct experts, by spread: "any" of all E,
    "some idle" (only the even experts chosen: the odd ones get no token), or "one" (every token's first choice the
    same expert)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    if spread == "some idle":
        logits[:, 1::2] = -torch.inf
    if spread == "one":
        logits[:, seed % num_experts] = logits.max() + 1  # every token's top expert, its weight not all
    return route(logits, top_k, renormalize=seed % 2 == 0)


def test_fused_kernel_equals_the_loop_over_experts():
    """Guards against any bug of the grouping or the kernel (a pair in the wrong group or in none, a padding row
    stored, an expert's gate and up rows mixed, the router weight applied twice, a block past those in use computing,
    masks at feature counts that are no multiple of the tiles): the fused kernel equals the plain loop over experts on
    shapes drawn afresh each run (tokens 1-300, experts 4-64, k 1-8; experts with no token; all tokens on one expert),
    in fp32 and fp16 (the interpreter computes bf16 dots wrongly)."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for draw, spread in enumerate(["any", "some idle", "one", "any", "some idle", "one"]):
        num_experts = rng.randint(4, 64)
        num_tokens = 1 if draw == 0 else rng.randint(1, 300)
        top_k = rng.randint(1, min(8, num_experts // 2))  # "some idle" chooses among the even half
        hidden, inner = rng.randint(16, 80), rng.randint(8, 72)
        dtype = rng.choice([torch.float32, torch.float16])
        shape = (num_tokens, num_experts, top_k, hidden, inner, dtype, spread)
        weights, experts = random_routing(num_tokens, num_experts, top_k, spread, seed + draw)
        generator = torch.Generator().manual_seed(seed + draw)
        x = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
        w13 = (torch.randn(num_experts, 2 * inner, hidden, generator=generator) / hidden**0.5).to(dtype)
        w2 = (torch.randn(num_experts, hidden, inner, generator=generator) / inner**0.5).to(dtype)
        expected = fused_moe_ref(x, w13, w2, weights, experts).float()
        error = (fused_moe(x, w13, w2, weights, experts).float() - expected).abs()
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        assert error.max() <= tolerance * (1 + expected.abs().max()), (
            f"seed {seed}: tokens, experts, k, hidden, inner, dtype, spread = {shape}: max error {error.max():.2e}, "
            f"mean {error.mean():.2e}"
        )


@settings(max_examples=40, deadline=None)
@given(
    num_tokens=st.integers(1, 40),
    num_experts=st.integers(1, 140),
    top_k=st.integers(1, 4),
    block_m=st.sampled_from([16, 32, 64]),
    data=st.data(),
)
def test_grouping_puts_each_pair_once_in_its_experts_blocks(num_tokens, num_experts, top_k, block_m, data):
    """Guards against the grouping's bookkeeping (hypothesis over routings, repeats allowed): every pair appears
    exactly once, in a block of its own expert, blocks in use come first and are at most the bound, padding holds
    num_pairs, and each expert fills exactly ceil(its pairs / block_m) blocks; the one-program kernel (a decode
    step's) gives PyTorch's outputs exactly (its tiles of pairs: 4096 / the padded experts, so several tiles here)."""
    experts = torch.tensor(
        data.draw(st.lists(st.integers(0, num_experts - 1), min_size=num_tokens * top_k, max_size=num_tokens * top_k))
    ).view(num_tokens, top_k)
    sorted_pairs, block_experts, num_blocks = group_by_expert(experts, num_experts, block_m)
    for ours, kernels in zip(
        (sorted_pairs, block_experts, num_blocks), group_by_expert_kernel(experts, num_experts, block_m), strict=True
    ):
        assert torch.equal(ours.int(), kernels)
    num_pairs, used = experts.numel(), int(num_blocks)
    counts = torch.bincount(experts.flatten(), minlength=num_experts)
    assert used == sum(-(-int(c) // block_m) for c in counts) <= len(block_experts)
    assert (block_experts[used:] == num_experts).all()
    rows = sorted_pairs.view(-1, block_m)
    real = rows[:used][rows[:used] < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs)) and (rows[used:] == num_pairs).all()
    for block in range(used):
        pairs = rows[block][rows[block] < num_pairs].long()
        assert len(pairs) and (experts.flatten()[pairs] == block_experts[block]).all()


def test_fused_kernel_compiles_for_h100_without_spills():
    """Guards against a kernel that only Triton's interpreter accepts: gate|up and down, at every block size the
    launcher picks, in every model dtype, and the one-program grouping for 8 to 256 experts, compile for an H100
    (sm_90) with ptxas, with no register spills; the matmuls' weight tiles fetched by 16-byte asynchronous copies
    (software-pipelined), and wgmma at 64 rows of a 16-bit model."""
    script = """
from nanoserve.ext.moe import kernels as K
for dtype, size in (("*bf16", 2), ("*fp16", 2), ("*fp32", 4)):
    for gated in (True, False):
        for block_m in (16, 32, 64):
            if block_m > K.MAX_BLOCK_M[size]:
                continue
            types = {"a_ptr": dtype, "w_ptr": dtype, "out_ptr": dtype, "pair_weights_ptr": "*fp32",
                     "sorted_pairs_ptr": "*i32", "block_experts_ptr": "*i32", "num_blocks_ptr": "*i32"}
            constants = {"PAIRS_PER_ROW": 8 if gated else 1, "GATED": gated, "BLOCK_M": block_m,
                         "BLOCK_N": K.BLOCK_N, "BLOCK_K": K.BLOCK_K[size]}
            # a model's feature counts are multiples of 16, as the launcher then sees them
            build = sm90_build.build(K._moe_gemm_kernel, types, constants, 4, aligned=("n_size", "k_size"))
            print(json.dumps(build | {"dtype": dtype, "gated": gated, "block_m": block_m}))
for experts_pad in (8, 64, 128, 256):
    types = {"experts_ptr": "*i64", "sorted_pairs_ptr": "*i32", "block_experts_ptr": "*i32", "num_blocks_ptr": "*i32"}
    constants = {"BLOCK_M": 16, "EXPERTS_PAD": experts_pad, "TILE": K.GROUP_TILE_ELEMENTS // experts_pad}
    print(json.dumps(sm90_build.build(K._group_kernel, types, constants, 4) | {"experts_pad": experts_pad}))
"""
    builds = sm90_builds(script)
    assert len(builds) == 20 and all(b["spill_bytes"] == 0 for b in builds), builds
    gemms = [b for b in builds if b["kernel"] == "_moe_gemm_kernel"]
    assert all(b["async_copy_bytes"] == [16] for b in gemms if b["block_m"] > MIN_BLOCK_M), builds
    assert all(b["wgmma"] == (b["block_m"] == 64) for b in gemms), builds


# ---- the course's experiment: distinct experts per batch ----------------------------------------------------------
def expected_distinct_experts(num_tokens: int, num_experts: int, top_k: int) -> float:
    """E x (1 - (1 - k/E)^N): each expert is missed by one token's k choices with probability 1 - k/E, by N tokens
    routed independently and uniformly with (1 - k/E)^N."""
    return num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)


def test_distinct_experts_of_a_batch_follow_the_formula():
    """The course's experiment (docs/course.md): N tokens through a random Qwen3-30B-A3B-shaped router (E = 128,
    k = 8) touch, on average, the distinct experts the formula says for uniform routing, within 5%; and a batch that
    fits one block per expert reads exactly those experts' weights (the kernel's blocks in use), so a batch-1 decode
    reads k/E = 1/16 of the layer's experts. Guards against the grouping reading experts no token chose."""
    num_experts, top_k, hidden, trials = 128, 8, 512, 8
    for num_tokens in (1, 4, 16, 64, 256):
        measured = 0.0
        for trial in range(trials):
            generator = torch.Generator().manual_seed(trial)
            router = torch.randn(num_experts, hidden, generator=generator)
            x = torch.randn(num_tokens, hidden, generator=generator)
            _, experts = route(x @ router.T, top_k, renormalize=True)
            distinct = len(experts.unique())
            measured += distinct / trials
            block_m = block_rows(experts.numel(), num_experts, torch.bfloat16)
            if num_tokens <= block_m:  # every expert's pairs fit one block: one block per expert chosen
                assert int(group_by_expert(experts, num_experts, block_m)[2]) == distinct
        expected = expected_distinct_experts(num_tokens, num_experts, top_k)
        assert abs(measured - expected) <= 0.05 * expected, (num_tokens, measured, expected)


def test_bench_kernels_times_a_routing_layer():
    """Guards against bench_kernels.py's moe mode failing on the GPU machine, whose minutes are few: time_moe runs here
    on tiny shapes, the fused kernel and the one-program grouping included (in the interpreter), with every figure."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import bench_kernels

    row = bench_kernels.time_moe(5, (32, 8, 2, 16), fused=True)
    assert 2 <= row["distinct_experts"] <= 8 and row["block_m"] == MIN_BLOCK_M
    times = ("grouping_ms", "grouping_one_program_ms", "loop_ms", "dense_same_active_ms", "fused_ms")
    assert all(row[name] > 0 for name in times), row
