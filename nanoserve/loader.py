"""Loading a model: finding its folder, reading its config, tokenizer and EOS ids, and building the model in
the serving dtype with its weights from safetensors. Each parameter loads its own part of a checkpoint tensor
(its `weight_loader`), so a layer that stores a slice or a fused shard says how, where it is defined."""

import glob
import os

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from nanoserve.attention import SUPPORTED_HEAD_DIMS
from nanoserve.config import EngineConfig
from nanoserve.kernels import Kernels
from nanoserve.model import CausalLM, ModelArgs
from nanoserve.parallel import TP
from nanoserve.sampling_params import InvalidField

PACKED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}  # HF -> (fused projection, shard)


def resolve_model_dir(model: str | None) -> str:
    """The embedded default model (None), a local HF directory, or a hub id ("org/name", fetched when online)."""
    if model is None:
        from nanoserve.default_model import default_model_dir

        return default_model_dir()
    if os.path.isdir(model):
        return model
    error = None
    if model.count("/") == 1 and not os.path.exists(model) and not model.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])
        except Exception as e:  # offline, or no such repository
            error = e
    raise InvalidField("model", f"no such model directory: {model!r}") from error


def load_tokenizer(model_dir: str):
    """None for a weights-only directory (prompts must then be token ids): transformers would make an empty one."""
    files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    return AutoTokenizer.from_pretrained(model_dir) if any(os.path.exists(f"{model_dir}/{f}") for f in files) else None


def eos_ids_of(model_dir: str, hf_config, tokenizer) -> frozenset[int]:
    """EOS ids from the generation config and the model config (several allowed), then the tokenizer."""
    try:
        sources = [GenerationConfig.from_pretrained(model_dir).eos_token_id]
    except OSError:
        sources = []
    sources.append(getattr(hf_config, "eos_token_id", None))
    if not any(s is not None for s in sources) and tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    return frozenset(i for s in sources for i in ([s] if isinstance(s, int) else (s or [])))


def checkpoint_dtype(hf_config) -> torch.dtype | None:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return getattr(torch, dtype, None) if isinstance(dtype, str) else dtype


def read_safetensors(model_dir: str):
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise InvalidField("model", f"{model_dir!r} has no *.safetensors files")
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: CausalLM, tensors):
    """tensors: iterable of (HF name, tensor). q/k/v and gate/up fill a shard of their fused projection."""
    params, loaded = dict(model.named_parameters(remove_duplicate=False)), set()
    for name, tensor in tensors:
        if name.endswith("rotary_emb.inv_freq"):
            continue  # older checkpoints store RoPE frequencies; we compute them
        module_name, _, param_name = name.rpartition(".")
        *parent, proj = module_name.split(".")
        shard = ()
        if proj in PACKED_SHARDS:
            fused, index = PACKED_SHARDS[proj]
            name, shard = ".".join(parent + [fused, param_name]), (index,)
        if name not in params:
            raise ValueError(f"model: checkpoint tensor {name!r} has no place in the model")
        param = params[name]
        getattr(param, "weight_loader", lambda p, t: p.data.copy_(t))(param, tensor, *shard)  # default: whole
        loaded.add(name)
    if model.args.tie_word_embeddings:
        loaded.add("lm_head.weight")
    if missing := set(params) - loaded:
        raise ValueError(f"model: checkpoint lacks {sorted(missing)[:5]}")


def build_model(
    args: ModelArgs, model_dir: str, dtype: torch.dtype, device: torch.device, kernels: Kernels, tp: TP
) -> CausalLM:
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are made in the serving dtype; RoPE tables stay fp32
    try:
        with torch.device(device):
            model = CausalLM(args, kernels, tp)
    finally:
        torch.set_default_dtype(default_dtype)
    load_weights(model, read_safetensors(model_dir))
    return model.eval()


def load_hf_config(model_dir: str, config: EngineConfig):
    hf_config = AutoConfig.from_pretrained(model_dir)
    args = ModelArgs.from_hf(hf_config)
    if config.max_model_len > args.max_position:
        raise InvalidField(
            "max_model_len", f"{config.max_model_len} exceeds the model's max_position_embeddings={args.max_position}"
        )
    if config.kernels == "triton" and args.head_dim not in SUPPORTED_HEAD_DIMS:
        raise InvalidField("kernels", f"'triton' tiles head_dim {SUPPORTED_HEAD_DIMS}, not {args.head_dim}: 'torch'")
    for name in ("num_heads", "num_kv_heads", "vocab_size", "intermediate_size"):  # an equal share for each rank
        if getattr(args, name) % config.tensor_parallel_size:  # (fewer KV heads than ranks: refused, too)
            raise InvalidField("tensor_parallel_size", f"does not divide the model's {name}={getattr(args, name)}")
    return hf_config, args
