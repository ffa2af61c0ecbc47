"""Loading a model: finding its folder, reading its config, tokenizer and EOS ids, and building the model in
the serving dtype with its weights from safetensors. Each parameter loads its own part of a checkpoint tensor
(its `weight_loader`), so a layer that stores a slice or a fused shard says how, where it is defined.

Everything about a model folder is checked before any weight is read (load_hf_config, then check_checkpoint in
the engine process): config.json present, parseable and with positive sizes, then a dry run of the weight loading into
the model built on the meta device, fed the tensors' names and shapes from the safetensors headers. A broken folder is
an InvalidField("model") naming the file, the config field or the tensor at fault, never transformers', safetensors'
or torch's own error after some loading."""

import glob
import json
import os
from collections.abc import Iterable

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from nanoserve import ext
from nanoserve.attention import SUPPORTED_HEAD_DIMS
from nanoserve.checks import InvalidField, check_number
from nanoserve.config import EngineConfig
from nanoserve.kernels import Kernels, get_kernels
from nanoserve.layers import Layers
from nanoserve.model import CausalLM, ModelArgs

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")  # any one will do
NamedTensors = Iterable[tuple[str, torch.Tensor]]  # a checkpoint's (name, tensor) pairs, read one at a time
CONFIG_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)  # config.json fields that, where given, must be positive integers (0 heads would divide by zero)


def resolve_model_dir(model: str | os.PathLike | None) -> str:
    """The embedded default model (None: its extension, ext/default_model.py), a local HF directory, or a hub id
    ("org/name", fetched when online by its extension, ext/hub.py)."""
    if model is None:
        return ext.load("default_model", "model").default_model_dir()
    model = os.fspath(model)  # a pathlib.Path
    if os.path.isdir(model):
        return model
    # "org/name" and no such path here: a hub id (./org/name, /org/name and ~/org/name are paths, never fetched)
    looks_like_hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    if not looks_like_hub_id or os.path.exists(model):
        raise InvalidField("model", f"no such model directory: {model!r}")
    return ext.load("hub", "model").download(model)


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
    sources.append(hf_config.eos_token_id)
    if all(source is None for source in sources) and tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    eos_ids = set()
    for source in sources:  # None, one id, or a list of ids
        if isinstance(source, int):
            eos_ids.add(source)
        elif source is not None:
            eos_ids.update(source)
    return frozenset(eos_ids)


def read_safetensors(model_dir: str, shapes_only: bool = False) -> NamedTensors:
    """(name, tensor) for every tensor of every *.safetensors file in model_dir, one at a time, on the CPU; with
    shapes_only, an empty meta tensor of its shape instead (only the file's header is read). A file that is not
    safetensors (or is cut short) is an InvalidField naming it."""
    files = sorted(glob.glob(f"{model_dir}/*.safetensors"))
    if not files:
        raise InvalidField("model", f"{model_dir!r} has no *.safetensors files")
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:  # on the CPU (its default device)
                for name in f.keys():
                    if shapes_only:
                        yield name, torch.empty(f.get_slice(name).get_shape(), device="meta")
                    else:
                        yield name, f.get_tensor(name)
        except SafetensorError as error:
            raise InvalidField("model", f"{path}: {error}") from None


@torch.no_grad()  # parameters are copied into in place, which autograd would refuse
def load_weights(model: CausalLM, tensors: NamedTensors) -> None:
    """tensors: (HF name, tensor) pairs, each loaded by its parameter's weight_loader, or copied whole into a
    parameter that defines none, at the places the model's family gives (ModelArgs.checkpoint_places). A tensor with
    no place, one whose shape does not fit, or one missing is an InvalidField("model") naming it."""
    places = model.args.checkpoint_places(model)  # HF name -> (our parameter, extra weight_loader arguments)
    for hf_name, tensor in tensors:
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue  # older checkpoints store RoPE frequencies; we compute them
        if hf_name not in places:
            raise InvalidField("model", f"checkpoint tensor {hf_name!r} has no place in the model")
        param, shard = places.pop(hf_name)
        weight_loader = getattr(param, "weight_loader", torch.Tensor.copy_)
        try:
            weight_loader(param, tensor, *shard)
        except RuntimeError as error:  # copy_'s size mismatch: the config says another shape
            raise InvalidField("model", f"checkpoint tensor {hf_name!r} does not fit the config: {error}") from None
    if model.args.tie_word_embeddings:
        places.pop("lm_head.weight", None)  # the embedding, loaded under its own name
    if places:
        raise InvalidField("model", f"checkpoint lacks {sorted(places)[:5]}")


def check_checkpoint(model_dir: str, args: ModelArgs) -> None:
    """A dry run of load_weights, reading headers only: every tensor's name and shape checked against the model the
    config describes, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = CausalLM(args, get_kernels("torch"))
    load_weights(model, read_safetensors(model_dir, shapes_only=True))


def build_model(
    args: ModelArgs,
    model_dir: str,
    dtype: torch.dtype,
    device: torch.device,
    kernels: Kernels,
    layers: Layers,
) -> CausalLM:
    """The model on device in the serving dtype, its weights loaded from model_dir's safetensors, in eval mode; layers
    holds them (layers.py: whole, or one rank's shards)."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are made in the serving dtype; RoPE tables stay fp32
    try:
        with torch.device(device):
            model = CausalLM(args, kernels, layers)
    finally:
        torch.set_default_dtype(default_dtype)
    load_weights(model, read_safetensors(model_dir))
    return model.eval()


def check_kv_cache_fits(config: EngineConfig, args: ModelArgs, dtype: torch.dtype) -> None:
    """num_kvcache_blocks, when given, within the memory that would hold the pool (ModelArgs.kv_bytes_per_token x
    block_size x blocks). dtype: the model's; the pool's is config.kv_cache_dtype's (fp8: 1 byte)."""
    blocks = config.num_kvcache_blocks
    if blocks is None:
        return
    # the memory that must hold 1/split of the pool's KV heads
    if config.device == "cuda":  # one GPU holds one rank's share
        split = config.tensor_parallel_size
        memory = torch.cuda.get_device_properties(0).total_memory
    elif hasattr(os, "sysconf"):  # Linux, macOS: the host's RAM holds every rank's share
        split = 1
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    else:
        return  # Windows: unchecked
    needed = args.kv_bytes_per_token(config.kv_cache_torch_dtype(dtype), split) * config.kvcache_block_size * blocks
    if needed > memory:
        raise InvalidField(
            "num_kvcache_blocks",
            f"{blocks} blocks need {needed / 2**30:.1f} GiB; the {config.device} has {memory / 2**30:.1f} GiB",
        )


def load_hf_config(model_dir: str, config: EngineConfig) -> tuple[PretrainedConfig, ModelArgs]:
    """The HF config and our ModelArgs from it, refused (InvalidField) where config.json is broken or the engine config
    cannot serve it. The engine process then checks the checkpoint against it (check_checkpoint, check_kv_cache_fits).
    """
    # 1) config.json, a JSON object whose sizes are positive integers: any fault (missing, unreadable, not JSON, a bad
    # size, an unknown model_type, a field that transformers' own checks refuse) is an InvalidField naming the file
    # (and the field), whatever transformers would have raised
    path = f"{model_dir}/config.json"
    try:
        with open(path, encoding="utf-8") as f:
            fields = json.load(f)
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
        for name in CONFIG_SIZES:
            if fields.get(name) is not None:
                check_number(name, fields[name], 1, integer=True)
        hf_config = AutoConfig.from_pretrained(model_dir)
    except Exception as error:
        raise InvalidField("model", f"{path}: {error}") from error
    # 2) what this engine config can serve of it; quantized weights (asked for, or the checkpoint's own format) are
    # read by their extension, refused by name without it
    args = ModelArgs.from_hf(hf_config)
    if config.quantization is not None or getattr(hf_config, "quantization_config", None) is not None:
        args.quantization = ext.load("quantization", "quantization").weight_format(config, hf_config, args)
    if config.max_model_len > args.max_position:
        raise InvalidField(
            "max_model_len", f"{config.max_model_len} exceeds the model's max_position_embeddings={args.max_position}"
        )
    if config.kernels == "triton" and args.head_dim not in SUPPORTED_HEAD_DIMS:
        raise InvalidField("kernels", f"'triton' tiles head_dim {SUPPORTED_HEAD_DIMS}, not {args.head_dim}: 'torch'")
    return hf_config, args
