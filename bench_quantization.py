"""Bytes per step: decode with quantized weights beside 16-bit ones, at batch 1 and at batch 64, in one run.

    python bench_quantization.py                          # the default model (SmolLM2-135M), batches 1 and 64
    python bench_quantization.py --arch qwen3-0.6b        # random Qwen3-0.6B weights (bench.py's standard shape)
    python bench_quantization.py --formats 16-bit w4a16 --batches 1 8 64 --json quantization.json
    python bench_quantization.py --arch qwen3-0.6b --batches 1 64 256 --standard 256     # the GPU check's row

Each format is the same weights held another way: "16-bit" as the checkpoint has them (--dtype: bf16 on a GPU; on a
CPU the model's fp32 unless --dtype bfloat16), "w4a16" a GPTQ checkpoint made here (4-bit round-to-nearest, with zero
points, in groups of the largest of 128, 64, 32 that divides every projection's input: the same layout AutoGPTQ
writes), "fp8" quantization="fp8" (float8 weights and activations, made as the model loads). For each, the engine
starts, its KV-account line gives the weights' bytes, and each batch runs: B prompts of --prompt-len random tokens,
--new-tokens greedy tokens each; a decode step's time is the median of the steps after every prompt's prefill.

Beside each measured time, the step's bytes and FLOPs and a roofline prediction: a decode step reads every weight once
and the batch's K/V (B x context x the KV bytes per token), and does 2 x B x (projection weights) FLOPs, so it takes at
least max(bytes / bandwidth, FLOPs / peak). At batch 1 the bytes win by far, and 4-bit weights (a quarter of the
bytes) should take about a quarter of the time where a kernel reads them at the memory's speed; at batch 64 the FLOPs
catch up (2 x 64 FLOPs per 16-bit weight: 64 per byte; an H100 does ~295 per byte of bandwidth), and the dequantizing
work per weight and row tile, which bytes do not show, is paid in every program. The peaks are --device-peaks' (an
H100 SXM's by default: 3.35 TB/s, 989 dense bf16 TFLOP/s, NVIDIA's datasheet), so on a CPU the prediction is the H100's
for the same step, not this machine's. With --standard N, each format also runs bench.py's standard workload (its
first N random requests; output tokens per second). Prints a table, then one JSON line of all rows."""

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from safetensors.torch import load_file, save_file

import bench
from nanoserve import LLM, SamplingParams
from nanoserve.loader import resolve_model_dir

H100_TBPS, H100_TFLOPS = 3.35, 989.4  # H100 SXM: HBM3 bandwidth, dense bf16 tensor-core FLOP/s (NVIDIA's datasheet)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SEED = 0


def quantize_gptq(model_dir: str, out_dir: str, bits: int = 4) -> int:
    """A GPTQ copy of the checkpoint in model_dir (config.json with its quantization_config, the projections' weights
    as qweight, qzeros, scales, g_idx; everything else as it is) written to out_dir: round-to-nearest with zero
    points, groups of the largest of 128, 64, 32 input features that divides every projection's input. Returns it."""
    state = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            state |= load_file(os.path.join(model_dir, name))
    weights = {k: v for k, v in state.items() if k.rsplit(".", 2)[-2] in PROJECTIONS and k.endswith(".weight")}
    group_size = next(g for g in (128, 64, 32) if all(w.shape[1] % g == 0 for w in weights.values()))
    per_word, top = 32 // bits, 2**bits - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    for key, weight in weights.items():
        groups = weight.float().T.unflatten(0, (-1, group_size))  # [groups, group_size, out]
        low = groups.amin(1).clamp(max=0)  # [groups, out]
        high = groups.amax(1).clamp(min=0)
        scales = ((high - low) / top).clamp(min=1e-8).half()
        zeros = torch.round(-low / scales.float()).clamp(0, top)
        q = torch.round(groups / scales.float()[:, None] + zeros[:, None]).clamp(0, top).flatten(0, 1)  # [in, out]
        prefix = key.removesuffix(".weight")
        packed = (q.long().unflatten(0, (-1, per_word)) << shifts[:, None]).sum(1)  # [in / per_word, out]
        zero_words = ((zeros.long() - 1) & top).unflatten(1, (-1, per_word)) << shifts  # GPTQ stores zeros - 1
        state[f"{prefix}.qweight"] = (packed - (packed >= 2**31) * 2**32).int()
        state[f"{prefix}.qzeros"] = (zero_words.sum(2) - (zero_words.sum(2) >= 2**31) * 2**32).int()
        state[f"{prefix}.scales"] = scales
        state[f"{prefix}.g_idx"] = (torch.arange(weight.shape[1]) // group_size).int()
        del state[key]
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(model_dir):  # config, tokenizer, generation config
        if not name.endswith(".safetensors") and os.path.isfile(os.path.join(model_dir, name)):
            with open(os.path.join(model_dir, name), "rb") as src, open(os.path.join(out_dir, name), "wb") as dst:
                dst.write(src.read())
    config = json.load(open(os.path.join(out_dir, "config.json")))
    config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": False}
    json.dump(config, open(os.path.join(out_dir, "config.json"), "w"))
    return group_size


def weight_bytes(llm: LLM) -> int:
    return sum(p.nbytes for p in llm.runner.model.parameters())


def projection_params(llm: LLM) -> int:
    """The decoder projections' weights (each a multiply-add per row of a step), from the model's shape."""
    a = llm.runner.args
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    return a.num_layers * (a.hidden_size * (2 * q + 2 * kv) + 3 * a.hidden_size * a.intermediate_size)


def decode_step_ms(llm: LLM, batch: int, prompt_len: int, new_tokens: int) -> float:
    """The median time of the decode steps of `batch` greedy requests (the steps after every prompt is prefilled)."""
    generator = torch.Generator().manual_seed(SEED)
    vocab = llm.runner.args.vocab_size
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for _ in range(batch):
        llm.add_request(torch.randint(3, vocab, (prompt_len,), generator=generator).tolist(), params, stream=False)
    times = []
    while llm.has_unfinished_requests():
        start = time.perf_counter()
        llm.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    prefill_steps = -(-batch * prompt_len // llm.config.max_num_batched_tokens)
    return statistics.median(times[prefill_steps + 1 :]) * 1000


def run(args, model_dir: str, name: str, path: str, quantization: str | None) -> list[dict]:
    max_model_len = args.prompt_len + args.new_tokens + 16
    if args.standard:  # its prompts and outputs are each up to STANDARD_MAX_LEN tokens
        max_model_len = max(max_model_len, 2 * bench.STANDARD_MAX_LEN)
    llm = LLM(path, quantization=quantization, dtype=args.dtype, max_model_len=max_model_len)
    try:
        decode_step_ms(llm, 1, 8, 8)  # warm-up (and the GPU's kernels compiled)
        rows = []
        for batch in args.batches:
            ms = decode_step_ms(llm, batch, args.prompt_len, args.new_tokens)
            context = args.prompt_len + args.new_tokens // 2  # the mean context of a decode step
            kv_read = batch * context * llm.runner.kv_bytes_per_token
            step_bytes = weight_bytes(llm) + kv_read
            flops = 2 * batch * projection_params(llm)
            predicted = max(step_bytes / (args.device_peaks[0] * 1e12), flops / (args.device_peaks[1] * 1e12))
            rows.append(
                {
                    "format": name,
                    "batch": batch,
                    "ms_per_step": round(ms, 3),
                    "weights_mib": round(weight_bytes(llm) / 2**20, 2),
                    "step_bytes": step_bytes,
                    "flop_per_byte": round(flops / step_bytes, 2),
                    "predicted_us": round(predicted * 1e6, 3),
                }
            )
        if args.standard:  # bench.py's standard workload: throughput, every request's output tokens per second
            workload = bench.random_workload(args.standard, bench.STANDARD_MAX_LEN, bench.STANDARD_MAX_LEN)
            start = time.perf_counter()
            outs = llm.generate(workload.prompts, workload.params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(out.outputs[0].token_ids) for out in outs)
            rows.append({"format": name, "batch": "standard", "output_tok_per_s": round(tokens / seconds, 1)})
        return rows
    finally:
        llm.close()


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="an HF model directory (default: the embedded default model)")
    ap.add_argument("--arch", choices=sorted(bench.ARCHS), help="a random-weight model of bench.py's shapes instead")
    ap.add_argument("--formats", nargs="+", default=["16-bit", "w4a16", "fp8"], choices=["16-bit", "w4a16", "fp8"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="auto", help="the 16-bit model's (and the others' activations') dtype")
    ap.add_argument("--device-peaks", nargs=2, type=float, default=[H100_TBPS, H100_TFLOPS], metavar=("TBPS", "TFLOPS"))
    ap.add_argument("--standard", type=int, metavar="N", help="also bench.py's standard workload, its first N requests")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.arch:
            model_dir = os.path.join(tmp, "model")
            bench.save_random_model(args.arch, model_dir)
        else:
            model_dir = resolve_model_dir(args.model)
        rows = []
        for name in args.formats:
            path, quantization = model_dir, None
            if name == "w4a16":
                path = os.path.join(tmp, "w4a16")
                quantize_gptq(model_dir, path)
            elif name == "fp8":
                quantization = "fp8"
            rows += run(args, model_dir, name, path, quantization)
    baseline = {r["batch"]: r.get("ms_per_step") for r in rows if r["format"] == rows[0]["format"]}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    peaks = f"{args.device_peaks[0]} TB/s, {args.device_peaks[1]} TFLOP/s"
    print(f"bench_quantization: {device}; predicted: the roofline at {peaks}; vs: the first format's time")
    columns = (
        "format",
        "batch",
        "ms_per_step",
        "vs_first",
        "weights_mib",
        "step_bytes",
        "flop_per_byte",
        "predicted_us",
    )
    print(" ".join(f"{column:>13}" for column in columns))
    for row in rows:
        row["device"] = device
        if row["batch"] == "standard":
            first = next(r for r in rows if r["batch"] == "standard")["output_tok_per_s"]
            row["vs_first"] = round(row["output_tok_per_s"] / first, 3)  # (throughput: higher is faster)
            print(f"{row['format']:>13} standard workload: {row['output_tok_per_s']} output tok/s, x{row['vs_first']}")
            continue
        row["vs_first"] = round(row["ms_per_step"] / baseline[row["batch"]], 3)
        print(" ".join(f"{row[column]:>13}" for column in columns))
    print(json.dumps(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
