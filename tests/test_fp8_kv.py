"""The FP8 KV cache (kv_cache_dtype="fp8"): K and V stored as float8 e4m3, one byte per element, with a scale of 1.0
(attention.py's docstring says why), read back widened to the model's dtype.

What is checked: the field is refused by name where it cannot work; the pool holds twice bf16's tokens in the same
memory and the KV account says so; the tiny models stay within a tolerance of transformers (teacher-forced logprobs)
on both backends; and on the default model (24 chat prompts x 32 greedy tokens; the CPU's PyTorch path in fp32, and
with pytest -m gpu the Triton path in bf16) the fp8 run is close to the model-dtype cache's by vLLM's own rule for an
FP8 KV cache (conftest.logprobs_close: the tokens agree up to the first divergence, and there each side's token is in
the other's top 5), while the error fp8 adds to one layer's attention output stays small.

Why that rule and not equal outputs: e4m3 keeps 3 mantissa bits (a relative rounding error up to 1/16), and a
135M-parameter model's greedy path meets near-ties often enough for that to flip one within 32 tokens. Measured on
the default model (fp32 model, scale 1.0; this test prints it again): 6 to 7 of 24 chats have all 32 greedy tokens
equal to the fp32 cache's (16 of 24 agree on the first 8), a bf16 cache 23 of 24, and every divergence is within the
other side's top 5. A scale cannot help (e4m3 is a float: its relative precision is the same at every magnitude, and
K/V stay far inside its range: |K| <= 21, |V| <= 13): measured with a per-layer amax scale, 6 of 24 again; with a
scale per token and head (not storable in one byte per element), 10 of 24. The relative mean absolute error of layer
0's attention output is 1.6% (its inputs are the same in both runs, so this is fp8's own error); deeper layers, which
also see the earlier layers' error, 4% to 13%."""

import os

import pytest
import torch
from conftest import FAMILIES, default_model_or_skip, extension_or_skip, logprobs_close, random_prompts

from nanoserve import LLM, SamplingParams, loader, model_runner
from nanoserve.config import EngineConfig
from nanoserve.model import ModelArgs
from nanoserve.sampling_params import InvalidField

FP8 = getattr(torch, "float8_e4m3fn", None)
pytestmark = pytest.mark.skipif(FP8 is None, reason="this torch has no float8 types")
TINY_LOGPROB_TOL = 0.15  # nats: measured up to 0.054 (PyTorch path) and 0.09 (interpreter, whose fp8 rounding is rough)
TOP_K = 5  # vLLM's rule for an FP8 KV cache: at the first divergence, each side's token in the other's top 5
LAYER0_REL_ERROR = 0.03  # layer 0's attention output, mean |fp8 - fp32| / mean |fp32| (measured 0.016)
LAYER_REL_ERROR = 0.25  # any layer's, with the error of the layers before it (measured up to 0.13)
NUM_TOKENS = 32
QUESTIONS = [  # short ShareGPT-style first turns
    "What is the capital of France?",
    "Explain photosynthesis in simple terms.",
    "Write a haiku about autumn.",
    "How do I reverse a list in Python?",
    "What are three tips for better sleep?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet.",
    "How does a computer store numbers?",
    "Suggest a name for a pet goldfish.",
    "What causes earthquakes?",
    "Write a short thank-you note to a teacher.",
    "How many planets are in the solar system?",
    "What is machine learning?",
    "Give me two ideas for a rainy afternoon.",
    "How do I make a cup of tea?",
    "What is the boiling point of water?",
    "Explain what a noun is.",
    "Why do cats purr?",
    "What should I pack for a beach trip?",
    "Describe the color green to someone.",
    "What is 12 times 7?",
]


# ---- the field and the KV account ----------------------------------------------------------------------------------
def test_kv_cache_dtype_is_checked_by_name(monkeypatch):
    """Guards against an unknown cache type silently served as the model's, and fp8 accepted where it cannot work:
    the Triton kernels on a GPU older than sm_89 (no e4m3 conversions)."""
    for bad in ("fp16", "float8", 8, None):
        with pytest.raises(InvalidField) as info:
            EngineConfig(kv_cache_dtype=bad)
        assert info.value.field == "kv_cache_dtype"
    assert EngineConfig(kv_cache_dtype="auto").kv_cache_torch_dtype(torch.bfloat16) == torch.bfloat16
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_torch_dtype(torch.bfloat16) == FP8
    for name, value in (("is_available", True), ("device_count", 1), ("get_device_capability", (8, 0))):
        monkeypatch.setattr(torch.cuda, name, lambda *args, value=value: value)
    with pytest.raises(InvalidField, match="sm_89") as info:  # an A100
        EngineConfig(kv_cache_dtype="fp8", device="cuda", kernels="triton")
    assert info.value.field == "kv_cache_dtype"
    EngineConfig(kv_cache_dtype="fp8", device="cuda", kernels="torch")  # the references cast on any GPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))  # an H100
    EngineConfig(kv_cache_dtype="fp8", device="cuda", kernels="triton")


def test_fp8_pool_holds_twice_the_tokens_of_bf16(tiny_model, monkeypatch):
    """Guards against an fp8 cache that is not one byte per element, or a pool sized as if it were the model's dtype:
    in the same memory it holds twice bf16's tokens, and the KV account line says 1 byte."""
    path, _ = tiny_model("llama")
    monkeypatch.setattr(model_runner, "CPU_KV_CACHE_BYTES", 1 << 20)  # 1 MiB, so the block count is not capped
    bf16 = LLM(path, device="cpu", dtype="bfloat16", max_model_len=128)
    fp8 = LLM(path, device="cpu", dtype="bfloat16", max_model_len=128, kv_cache_dtype="fp8")
    assert fp8.runner.kv_cache.dtype == FP8 and fp8.runner.kv_cache.element_size() == 1
    assert fp8.runner.kv_bytes_per_token * 2 == bf16.runner.kv_bytes_per_token
    assert fp8.runner.num_kvcache_blocks == 2 * bf16.runner.num_kvcache_blocks
    assert "x 1 bytes (float8_e4m3fn)" in fp8.runner.kv_account()
    assert "x 2 bytes (bfloat16)" in bf16.runner.kv_account()
    prompts = random_prompts([5, 30])
    outs = fp8.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert fp8.stats()["kv_blocks_used"] == 0


def test_kv_memory_check_counts_one_byte_per_element():
    """Guards against the up-front memory check (num_kvcache_blocks) sizing an fp8 pool at the model's bytes."""
    args = ModelArgs(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position=512,
        rope_theta=1e4,
        rope_scaling=None,
        tie_word_embeddings=False,
        qkv_bias=False,
        o_bias=False,
        qk_norm=False,
    )
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    bytes_per_block_bf16 = args.kv_bytes_per_token(torch.bfloat16) * 16
    blocks = int(1.5 * memory / bytes_per_block_bf16)  # 1.5x the RAM in bf16, 0.75x in fp8
    with pytest.raises(InvalidField):
        loader.check_kv_cache_fits(EngineConfig(device="cpu", num_kvcache_blocks=blocks), args, torch.bfloat16)
    config = EngineConfig(device="cpu", num_kvcache_blocks=blocks, kv_cache_dtype="fp8")
    loader.check_kv_cache_fits(config, args, torch.bfloat16)


# ---- accuracy ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,kernels", [(family, "torch") for family in sorted(FAMILIES)] + [("qwen3", "triton")])
def test_tiny_models_with_fp8_cache_stay_near_transformers(tiny_model, family, kernels):
    """Guards against an fp8 path that is wrong rather than rounded (a cache read as the wrong type, a missing
    widening, K or V swapped): at every greedy step, teacher-forced through transformers in fp32, the token nanoserve
    picked is within TINY_LOGPROB_TOL of transformers' best, and its logprob within TINY_LOGPROB_TOL of theirs."""
    path, hf = tiny_model(family)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(
        path,
        device=device,
        kernels=kernels,
        dtype="float32",
        max_model_len=128,
        num_kvcache_blocks=32,
        kv_cache_dtype="fp8",
    )
    prompts = random_prompts([5, 23, 40])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        for step, (token, logprobs) in enumerate(zip(tokens, out.outputs[0].logprobs, strict=True)):
            assert ref[step].max() - ref[step, token] < TINY_LOGPROB_TOL, (step, token)
            assert abs(logprobs[token] - ref[step, token].item()) < TINY_LOGPROB_TOL, (step, token)
    assert llm.stats()["kv_blocks_used"] == 0


def attention_outputs(llm: LLM) -> dict[int, torch.Tensor]:
    """Hooks each layer's attention; returns the dict its first call's output (the prefill step) will land in."""
    outputs = {}
    for i, layer in enumerate(llm.runner.model.model.layers):

        def keep_first(module, inputs, output, i=i):
            outputs.setdefault(i, output.detach().clone())

        layer.self_attn.register_forward_hook(keep_first)
    return outputs


@pytest.mark.parametrize(
    "device, dtype",
    [
        ("cpu", "float32"),
        pytest.param(
            "cuda",
            "bfloat16",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
        ),
    ],
)
def test_default_model_with_fp8_cache_is_close_to_the_model_dtype_cache(device, dtype):
    """The default model, 24 chat prompts x 32 greedy tokens, with the model-dtype cache and with the fp8 one (on the
    CPU's PyTorch path in fp32; on a GPU, the Triton path in bf16). Guards against an fp8 error beyond e4m3's
    rounding: every prompt must be close by vLLM's rule (top 5), layer 0's attention output (same inputs in both runs)
    within LAYER0_REL_ERROR, and every layer's within LAYER_REL_ERROR. Prints the per-layer attention error, and how
    many chats are identical (BENCHMARKS.md records it)."""
    model_dir = default_model_or_skip()
    auto = LLM(model_dir, device=device, dtype=dtype, max_model_len=512)
    fp8 = LLM(model_dir, device=device, dtype=dtype, max_model_len=512, kv_cache_dtype="fp8")
    if device == "cpu":
        assert fp8.runner.num_kvcache_blocks // 4 == auto.runner.num_kvcache_blocks  # fp32 -> fp8: 4x the tokens
    prompts = extension_or_skip("chat").chat_prompts(auto, [[{"role": "user", "content": q}] for q in QUESTIONS])
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=TOP_K)
    auto_attention, fp8_attention = attention_outputs(auto), attention_outputs(fp8)
    runs = [
        [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]
        for llm in (auto, fp8)
    ]
    close = [logprobs_close(a, b, TOP_K) for a, b in zip(*runs, strict=True)]
    identical = sum(a[0] == b[0] for a, b in zip(*runs, strict=True))
    errors = [
        ((auto_attention[i] - fp8_attention[i]).abs().float().mean() / auto_attention[i].abs().float().mean()).item()
        for i in sorted(auto_attention)
    ]
    print("relative mean abs error of each layer's attention output:", " ".join(f"{e:.3f}" for e in errors))
    print(f"{device} {dtype}: fp8 close to the {dtype} cache in {sum(close)} of {len(close)}, identical in {identical}")
    assert all(close), close
    assert errors[0] < LAYER0_REL_ERROR and max(errors) < LAYER_REL_ERROR
    assert auto.stats()["kv_blocks_used"] == fp8.stats()["kv_blocks_used"] == 0


def test_bench_kv_report_shows_the_fp8_pool(tmp_path, capsys):
    """Guards against `bench.py --kv-report` reporting the model dtype's bytes for an fp8 pool: its row and its
    printed KV account carry the cache's element type and bytes per token (fp8: a quarter of fp32's)."""
    extension_or_skip("plots")  # --kv-report reads the run's step trace
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import bench

    flags = ["--arch", "tiny", "--num-seqs", "2", "--max-input-len", "24", "--max-output-len", "4", "--kv-report"]
    flags += ["--dtype", "float32"]  # the same model dtype on a GPU as on a CPU
    rows = {}
    for kv in ("auto", "fp8"):
        bench.main([*flags, "--kv-cache-dtype", kv, "--json", str(tmp_path / f"{kv}.json")])
        (rows[kv],) = json.loads((tmp_path / f"{kv}.json").read_text())
    assert rows["fp8"]["kv_cache_dtype"] == "float8_e4m3fn" and rows["auto"]["kv_cache_dtype"] == "float32"
    assert rows["fp8"]["kv_bytes_per_token"] * 4 == rows["auto"]["kv_bytes_per_token"]
    assert rows["fp8"]["kv_pool_tokens"] >= rows["auto"]["kv_pool_tokens"] > 0
    assert "x 1 bytes (float8_e4m3fn)" in capsys.readouterr().out
