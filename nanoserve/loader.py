"""Loading a model: finding its folder, reading its config, tokenizer and EOS ids, and building the model in
the serving dtype with its weights from safetensors. Each parameter loads its own part of a checkpoint tensor
(its `weight_loader`), so a layer that stores a slice or a fused shard says how, where it is defined."""

import glob
import os
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

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
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]  # config, weights, tokenizer, chat template
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")  # any one will do


def resolve_model_dir(model: str | None) -> str:
    """The embedded default model (None), a local HF directory, or a hub id ("org/name", fetched when online)."""
    if model is None:
        from nanoserve.default_model import default_model_dir

        return default_model_dir()
    if os.path.isdir(model):
        return model
    # "org/name" and no such path here: a hub id (./org/name, /org/name and ~/org/name are paths, never fetched)
    looks_like_hub_id = model.count("/") == 1 and not os.path.exists(model) and not model.startswith((".", "/", "~"))
    error = None
    if looks_like_hub_id:
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(model, allow_patterns=HUB_FILES)
        except Exception as e:  # offline, or no such repository
            error = e
    raise InvalidField("model", f"no such model directory: {model!r}") from error


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase | None:
    """None for a weights-only directory (prompts must then be token ids): transformers would make an empty one."""
    if not any(os.path.exists(f"{model_dir}/{name}") for name in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(model_dir)


def eos_ids_of(
    model_dir: str, hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase | None
) -> frozenset[int]:
    """EOS ids from the generation config and the model config (several allowed), then the tokenizer."""
    try:
        sources = [GenerationConfig.from_pretrained(model_dir).eos_token_id]
    except OSError:  # no generation_config.json
        sources = []
    sources.append(getattr(hf_config, "eos_token_id", None))
    if all(source is None for source in sources) and tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    eos_ids = set()
    for source in sources:  # each None, one id, or a list of ids
        if isinstance(source, int):
            eos_ids.add(source)
        elif source:
            eos_ids.update(source)
    return frozenset(eos_ids)


def checkpoint_dtype(hf_config: PretrainedConfig) -> torch.dtype | None:
    """The dtype the weights were saved in, if the config says (`dtype`; older transformers name it `torch_dtype`)."""
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):  # "bfloat16" in a config read from JSON
        return getattr(torch, dtype, None)
    return dtype


def read_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every *.safetensors file in model_dir, one at a time, on the CPU."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise InvalidField("model", f"{model_dir!r} has no *.safetensors files")
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def copy_whole(param: torch.nn.Parameter, tensor: torch.Tensor) -> None:
    """The weight_loader of a parameter that defines none: the checkpoint tensor is the whole parameter."""
    param.data.copy_(tensor)


def load_weights(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """tensors: (HF name, tensor) pairs. q/k/v and gate/up fill a shard of their fused projection."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = set()
    for name, tensor in tensors:
        if name.endswith("rotary_emb.inv_freq"):
            continue  # older checkpoints store RoPE frequencies; we compute them
        module_name, _, param_name = name.rpartition(".")
        *parent, proj = module_name.split(".")
        shard = ()  # extra weight_loader arguments: the shard index, for a fused projection only
        if proj in PACKED_SHARDS:
            fused, index = PACKED_SHARDS[proj]
            name = ".".join(parent + [fused, param_name])
            shard = (index,)
        if name not in params:
            raise ValueError(f"model: checkpoint tensor {name!r} has no place in the model")
        param = params[name]
        weight_loader = getattr(param, "weight_loader", copy_whole)
        weight_loader(param, tensor, *shard)
        loaded.add(name)
    if model.args.tie_word_embeddings:
        loaded.add("lm_head.weight")
    if missing := set(params) - loaded:
        raise ValueError(f"model: checkpoint lacks {sorted(missing)[:5]}")


def build_model(
    args: ModelArgs, model_dir: str, dtype: torch.dtype, device: torch.device, kernels: Kernels, tp: TP
) -> CausalLM:
    """The model on device in the serving dtype, its weights loaded from model_dir's safetensors, in eval mode."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are made in the serving dtype; RoPE tables stay fp32
    try:
        with torch.device(device):
            model = CausalLM(args, kernels, tp)
    finally:
        torch.set_default_dtype(default_dtype)
    load_weights(model, read_safetensors(model_dir))
    return model.eval()


def load_hf_config(model_dir: str, config: EngineConfig) -> tuple[PretrainedConfig, ModelArgs]:
    """The HF config and our ModelArgs from it, refused (InvalidField) where the engine config cannot serve it."""
    hf_config = AutoConfig.from_pretrained(model_dir)
    args = ModelArgs.from_hf(hf_config)
    if config.max_model_len > args.max_position:
        raise InvalidField(
            "max_model_len", f"{config.max_model_len} exceeds the model's max_position_embeddings={args.max_position}"
        )
    if config.kernels == "triton" and args.head_dim not in SUPPORTED_HEAD_DIMS:
        raise InvalidField("kernels", f"'triton' tiles head_dim {SUPPORTED_HEAD_DIMS}, not {args.head_dim}: 'torch'")
    for name in ("num_heads", "num_kv_heads", "vocab_size", "intermediate_size"):  # an equal share for each rank
        size = getattr(args, name)
        if size % config.tensor_parallel_size:  # (fewer KV heads than ranks: refused, too)
            raise InvalidField("tensor_parallel_size", f"does not divide the model's {name}={size}")
    return hf_config, args
