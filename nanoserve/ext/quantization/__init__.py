"""An extension: quantized weights, the checkpoints people download to fit a model on one GPU, read as vLLM reads them.

    llm = LLM("Qwen3-0.6B-AWQ")                      # a checkpoint whose config.json has a quantization_config
    llm = LLM("Qwen3-0.6B-AWQ", quantization="awq")  # the same, the name checked against the checkpoint's
    llm = LLM("Qwen3-0.6B", quantization="fp8")      # a 16-bit checkpoint quantized to float8 as it loads

Why it pays: a decode step of a small batch reads every weight once, and little else, so its time is the weights'
bytes over the memory bandwidth, and 4-bit weights are a quarter of the bytes of 16-bit ones. A large batch does
enough arithmetic per weight read that the bytes stop mattering, and dequantizing costs a little (the course's
experiment "bytes per step").

Formats, by vLLM's names (each projection's tensors as vLLM's loaders read them; SERVED lists the settings):
  - "awq": AWQ's GEMM layout, qweight int32 [in, out / 8] (8 columns per int32, in AWQ's order), qzeros, scales;
    4 bits, zero points, any group size dividing the input;
  - "gptq": qweight int32 [in / (32 / bits), out], qzeros (stored minus 1 in GPTQ's own format; gptq_v2: as they
    are), scales, g_idx; 4 or 8 bits, symmetric or not, desc_act (act-order) or not;
  - "compressed-tensors": pack-quantized (weight_packed [out, in / (32 / bits)], weight_scale, weight_shape, zero
    points if asymmetric; group or channel strategy), its W4A16 / W8A16 presets (act-order's g_idx: GPTQ's);
    float-quantized FP8 W8A8 (weight float8, weight_scale per channel or tensor, input_scale if static, else each
    token's scale at run time), its FP8 / FP8_DYNAMIC presets. Its `ignore` list may keep the LM head (and modules
    this model does not have) whole;
  - "fp8" on a 16-bit checkpoint: vLLM's online FP8, each projection's weight quantized to float8 e4m3 as it loads (a
    scale per output feature), activations quantized per token at run time.
The LM head and the embeddings stay as the checkpoint has them.

How it plugs in (model.py's ModelArgs.quantization): the loader calls weight_format(config, hf_config, args) before
any weight is read; it checks every setting (a method the name contradicts, bits, group sizes, what the layout needs)
and returns a WeightFormat, whose `layers(base)` the model asks for its layers: each decoder projection is then a
QuantizedLinear holding its parameters under the checkpoint's names, each with a weight_loader that reads the
checkpoint's tensor (one shard of q|k|v or gate|up at a time) into one layout (kernels.py), so that one kernel serves
every integer format. The loader's dry run on the meta device checks the packed tensors' shapes the same way.

Tensor parallelism (ext/tp): each rank's projection holds its slice, q|k|v and gate|up their output features
(qweight's, scales' and zeros' columns), o and down their input features (qweight's packed rows and g_idx, with the
scales of every group, which g_idx indexes), their partial products summed by the base layers' all_reduce. LoRA
adapters (ext/lora) run in 16 bits over the quantized projections (QLoRA's way). The latency kernels (ext/latency)
read 16-bit weights, and are refused with quantized ones."""

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from nanoserve.checks import InvalidField, shown
from nanoserve.config import EngineConfig
from nanoserve.ext.quantization import kernels
from nanoserve.ext.quantization.kernels import FP8, unpack_columns
from nanoserve.layers import Layers
from nanoserve.model import ModelArgs

if TYPE_CHECKING:
    from nanoserve.llm import LLM

METHODS = ("awq", "gptq", "compressed-tensors", "fp8")  # vLLM's names
# The settings nanoserve serves, as config.json's quantization_config names them (a compressed-tensors scheme's by its
# format): key -> the values served, the first of them its default (or the rules of a nested dict)
SERVED = {
    "awq": {"bits": (4,), "zero_point": (True,), "version": ("gemm", "GEMM")},
    "gptq": {"bits": (4, 8), "checkpoint_format": ("gptq", "gptq_v2")},  # gptq: zero points stored minus 1
    "compressed-tensors": {"format": ("pack-quantized", "float-quantized"), "transform_config": (None, {})},
    "pack-quantized": {  # (a scheme, of config_groups)
        "weights": {
            "type": ("int",),
            "num_bits": (4, 8),
            "strategy": ("group", "channel"),
            "actorder": (None, "weight", "static"),  # (act-order's "group": GPTQ checkpoints serve it)
        },
        "input_activations": (None,),  # weights only: W4A16, W8A16
        "output_activations": (None,),
    },
    "float-quantized": {
        "weights": {"type": ("float",), "num_bits": (8,), "strategy": ("channel", "tensor")},
        "input_activations": {  # static per tensor, or dynamic (served per token)
            "type": ("float",),
            "num_bits": (8,),
            "strategy": ("tensor", "token"),
            "dynamic": (False, True),
        },
        "output_activations": (None,),
    },
}
# a projection's tensors in the checkpoint -> (our part, how it reads into our layout), by format
TENSORS = {
    "awq": {"qweight": ("qweight", "awq_qweight"), "qzeros": ("zeros", "zero_points"), "scales": ("scales", "as_is")},
    "gptq": {
        "qweight": ("qweight", "as_is"),
        "qzeros": ("zeros", "zero_points"),
        "scales": ("scales", "as_is"),
        "g_idx": ("g_idx", "as_is"),
    },
    "pack-quantized": {
        "weight_packed": ("qweight", "transposed"),
        "weight_scale": ("scales", "transposed"),
        "weight_zero_point": ("zeros", "ct_zero_points"),  # asymmetric only
        "weight_shape": ("weight_shape", "as_is"),
    },
    "float-quantized": {
        "weight": ("weight", "as_is"),
        "weight_scale": ("weight_scale", "as_is"),  # per channel [out, 1], or per tensor [1] (the copy broadcasts it)
        "input_scale": ("input_scale", "as_is"),  # static only
    },
    "fp8": {"weight": ("weight", "as_is")},  # quantization="fp8": 16-bit, quantized as it loads (its scale made then)
}
AWQ_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # AWQ's int32 holds columns 0, 2, 4, 6, 1, 3, 5, 7: column j is value AWQ_ORDER[j]
OUT_DIMS = {"qweight": 1, "scales": 1, "zeros": 1, "weight": 0, "weight_scale": 0, "bias": 0}  # where a shard goes


def check_config(config: EngineConfig) -> None:
    """quantization: one of vLLM's names (METHODS), which weight_format checks against the checkpoint."""
    if config.quantization not in METHODS:
        raise InvalidField("quantization", f"{shown(config.quantization)} is not one of {', '.join(METHODS)}")


def start(llm: "LLM") -> None:
    """Nothing to start: the model was built with the weight format (ModelArgs.quantization)."""


@dataclass
class WeightFormat(Layers):
    """How the checkpoint holds its decoder projections (weight_format makes one, checked against the model), and the
    Layers that make them: each decoder projection a QuantizedLinear. The LM head, which the model asks for as a
    merged projection of one shard, the vocabulary, stays whole (as the checkpoint has it), as the embeddings do."""

    format: str  # TENSORS' key: awq, gptq, pack-quantized, float-quantized, fp8
    bits: int  # 4 or 8 (FP8: 8)
    group_size: object  # input features per scale (-1: one per output feature, the whole input); checked per projection
    tensors: dict  # a projection's checkpoint tensors -> (our part, its reader): TENSORS' less those it lacks
    zero_offset: int = 0  # added to each stored zero point (GPTQ's own format stores them minus 1)
    vocab_size: int = 0  # the LM head's output features
    matmul: object = None  # kernels.py's function for the projections (a kernel, or its reference)

    @property
    def operands(self) -> tuple[str, ...]:
        """Our parts that the matmul reads, in its order: FP8's (float8 weights), or the integer formats'."""
        if "weight" in self.tensors:
            return ("weight", "weight_scale", "input_scale")
        return ("qweight", "scales", "zeros", "g_idx")

    def layers(self, base: Layers) -> "WeightFormat":
        """CausalLM's layers (base is the core's whole Layers: tensor parallelism is refused)."""
        return self

    def merged(self, in_features: int, shard_sizes: list[int], bias: bool) -> nn.Module:
        if shard_sizes == [self.vocab_size]:  # the LM head
            return super().merged(in_features, shard_sizes, bias)
        return QuantizedLinear(self, in_features, shard_sizes, bias)

    def linear(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return QuantizedLinear(self, in_features, [out_features], bias)

    # ---- each reads a checkpoint tensor into our layout ------------------------------------------------------------
    def as_is(self, tensor: Tensor) -> Tensor:
        return tensor

    def transposed(self, tensor: Tensor) -> Tensor:
        """compressed-tensors' [out, ...] as our [..., out]."""
        return tensor.T

    def awq_qweight(self, tensor: Tensor) -> Tensor:
        """AWQ's [in, out / 8] (8 columns per int32) as our [in / 8, out] (8 rows per int32)."""
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=tensor.device)
        values = unpack_columns(tensor, 4, AWQ_ORDER).unflatten(0, (-1, 8))  # [in / 8, 8, out]
        return (values << shifts[:, None]).sum(1, dtype=torch.int32)

    def zero_points(self, tensor: Tensor) -> Tensor:
        """Zero points packed along the output, [groups, out / (32 / bits)], as [groups, out]."""
        order = slice(None)  # in order
        if self.format == "awq":
            order = AWQ_ORDER
        return unpack_columns(tensor, self.bits, order) + self.zero_offset

    def ct_zero_points(self, tensor: Tensor) -> Tensor:
        """compressed-tensors' [out / (32 / bits), groups] (packed along dim 0) as [groups, out]."""
        return self.zero_points(tensor.T)


class QuantizedLinear(nn.Module):
    """A projection with quantized weights, [rows, in] -> [rows, out], with the in_features, out_features and
    shard_sizes of a MergedLinear. Its parameters have the checkpoint's names (qweight, weight_packed, ...) and hold our
    layout (kernels.py's): the integer formats' qweight, scales, zeros, g_idx, or FP8's weight, weight_scale,
    input_scale. What the checkpoint lacks is made here, as a buffer: the zero points of a symmetric format (2^(bits -
    1), the middle of the unsigned range), g_idx without act-order (i // group_size), online FP8's weight_scale."""

    def __init__(self, format: WeightFormat, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__()
        self.format = format
        self.in_features = in_features
        self.shard_sizes = shard_sizes
        self.out_features = out = sum(shard_sizes)
        group_size = format.group_size
        if group_size == -1:  # one group: the whole input
            group_size = in_features
        ok = group_size in range(1, in_features + 1) and in_features % group_size == 0
        need(ok, "group_size", format.group_size, f"-1, or a divisor of each projection's input ({in_features})")
        dtype = torch.get_default_dtype()  # the model's
        shapes = {  # our part -> its shape and dtype
            "qweight": ((-(-in_features // (32 // format.bits)), out), torch.int32),
            "scales": ((in_features // group_size, out), dtype),
            "zeros": ((in_features // group_size, out), dtype),
            "g_idx": ((in_features,), torch.int32),
            "weight": ((out, in_features), FP8),
            "weight_scale": ((out, 1), torch.float32),
            "input_scale": ((1,), torch.float32),
            "weight_shape": ((len(shard_sizes), 2), torch.int64),
            "bias": ((out,), dtype),
        }
        tensors = dict(format.tensors)
        if bias:
            tensors["bias"] = ("bias", "as_is")
        self.parts = {}  # our part -> the tensor that holds it
        for name, (part, read) in tensors.items():
            shape, dtype = shapes[part]
            param = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            param.weight_loader = partial(self.load, part, getattr(format, read))
            self.register_parameter(name, param)
            self.parts[part] = param
        # what the checkpoint lacks, made here (buffers, not checkpoint tensors; the input_scale of a dynamic one: None)
        made = {
            "zeros": torch.full(shapes["zeros"][0], 2.0 ** (format.bits - 1)),  # symmetric: the unsigned range's middle
            "g_idx": (torch.arange(in_features) // group_size).int(),  # no act-order: the groups in order
            "weight_scale": torch.ones(out, 1),  # quantization="fp8": made as the weight loads
        }
        for part in format.operands:
            if part not in self.parts and part in made:
                self.parts[part] = made[part]
                self.register_buffer(part, made[part], persistent=False)
        if format.format == "fp8":
            self.parts["weight"].weight_loader = self.load_online
        self.operands = [self.parts.get(part) for part in format.operands]

    def load(self, part: str, read: object, param: nn.Parameter, tensor: Tensor, shard: int = 0) -> None:
        """The weight_loader of each part: the checkpoint's tensor of projection `shard` (q, k, v: 0, 1, 2; gate, up:
        0, 1) read into our layout and put in its place. A shape that does not fit is a RuntimeError, which the loader
        reports naming the tensor."""
        tensor = read(tensor)
        if part in OUT_DIMS:  # one shard's output features among the fused projections'
            start = sum(self.shard_sizes[:shard])
            param.narrow(OUT_DIMS[part], start, self.shard_sizes[shard]).copy_(tensor)
        elif part == "weight_shape":
            param[shard].copy_(tensor)
        elif param.is_meta or not param.any():  # g_idx, input_scale: of the input, which fused projections share
            param.copy_(tensor)  # (the first of them to load)
        elif not torch.equal(param, tensor.to(param.dtype)):
            raise RuntimeError(f"the fused projections' {part} differ: they share their input's")

    def load_online(self, param: nn.Parameter, tensor: Tensor, shard: int = 0) -> None:
        """quantization="fp8": a 16-bit weight [out, in] quantized to float8 as it loads, with a scale per output
        feature (its largest magnitude to float8's largest), as kernels.py quantizes activations per row."""
        weight, scale = kernels.quantize_fp8(tensor, None)  # [out, in], [out, 1]
        self.load("weight", self.format.as_is, param, weight, shard)
        self.load("weight_scale", self.format.as_is, self.parts["weight_scale"], scale, shard)

    def forward(self, x: Tensor) -> Tensor:
        """x [rows, in] -> [rows, out]."""
        y = self.format.matmul(x, *self.operands)
        if "bias" in self.parts:  # (Qwen2's q|k|v)
            y += self.parts["bias"]
        return y


# ---- reading and checking the checkpoint's quantization_config -----------------------------------------------------
def need(ok: bool, key: str, value: object, problem: str) -> None:
    """A setting of the checkpoint's quantization_config that nanoserve does not serve: an InvalidField naming it."""
    if not ok:
        raise InvalidField("model", f"config.json's quantization_config.{key}={shown(value)}: {problem}")


def served(settings: dict, rules: dict, where: str = "") -> dict:
    """The values of the settings that rules (a SERVED entry) name, each key's default where it is missing (a nested
    dict's, by its own rules); a value not served is an InvalidField naming it."""
    values = {}
    for key, allowed in rules.items():
        if isinstance(allowed, dict):
            values[key] = served(settings.get(key) or {}, allowed, f"{where}{key}.")
            continue
        values[key] = settings.get(key, allowed[0])
        need(values[key] in allowed, where + key, values[key], f"nanoserve serves {' or '.join(map(shown, allowed))}")
    return values


def compressed_tensors_format(settings: dict) -> WeightFormat:
    """compressed-tensors' one scheme for every Linear layer: pack-quantized W4A16 / W8A16, or float-quantized FP8
    W8A8 (static or dynamic activation scales). (What its ignore list and targets keep whole, the checkpoint holds as
    16-bit weights: the loader's dry run finds a decoder projection's among them out of place, by name.)"""
    kind = served(settings, SERVED["compressed-tensors"])["format"]
    schemes = list((settings.get("config_groups") or {}).values())
    need(len(schemes) == 1, "config_groups", len(schemes), "one scheme for every Linear layer")
    values = served(schemes[0], SERVED[kind], "config_groups.")
    weights = schemes[0]["weights"]
    tensors = dict(TENSORS[kind])
    if kind == "float-quantized":
        need(schemes[0]["input_activations"], "config_groups.input_activations", None, "float8 activations (W8A8)")
        if values["input_activations"]["dynamic"]:  # each row's scale at run time
            del tensors["input_scale"]
        return WeightFormat(kind, 8, -1, tensors)
    if weights.get("symmetric", True):
        del tensors["weight_zero_point"]
    size = -1  # channel: one group
    if values["weights"]["strategy"] == "group":
        size = weights.get("group_size")
    return WeightFormat(kind, values["weights"]["num_bits"], size, tensors)


def weight_format(config: EngineConfig, hf_config: PretrainedConfig, args: ModelArgs) -> WeightFormat:
    """The checkpoint's weight format, checked against the engine config and the model before any weight is read
    (ModelArgs.quantization: the loader calls this where config.quantization is set or the checkpoint's config.json
    has a quantization_config). Anything nanoserve does not serve is an InvalidField naming it."""
    if config.latency_kernels or config.tensor_parallel_size > 1:  # (ext/latency's GEMV reads 16-bit weights)
        raise InvalidField("quantization", "quantized weights run without latency_kernels, in one process (tp=1)")
    settings = getattr(hf_config, "quantization_config", None)
    method = "fp8"  # a 16-bit checkpoint's: quantized as it loads
    if settings is not None:
        method = settings.get("quant_method")
    if config.quantization not in (None, method):
        problem = f"is not the checkpoint's quant_method {method!r} (a 16-bit checkpoint's: 'fp8')"
        raise InvalidField("quantization", f"{config.quantization!r} {problem}")
    if settings is None:
        format = WeightFormat("fp8", 8, -1, TENSORS["fp8"])
    elif method in ("awq", "gptq"):
        values = served(settings, SERVED[method])
        offset = int(values.get("checkpoint_format") == "gptq")  # GPTQ's own format stores zero points minus 1
        format = WeightFormat(method, values["bits"], settings.get("group_size"), TENSORS[method], offset)
    else:
        need(method == "compressed-tensors", "quant_method", method, "nanoserve reads awq, gptq, compressed-tensors")
        format = compressed_tensors_format(settings)
    format.vocab_size = args.vocab_size
    # FP8 tensor cores, and cuBLASLt's row-wise scales: sm_90 and later, bf16 output
    on_fp8_cores = config.device == "cuda" and config.torch_dtype(hf_config) == torch.bfloat16
    fp8 = "weight" in format.tensors
    if fp8 and on_fp8_cores and torch.cuda.get_device_capability() >= (9, 0):
        format.matmul = kernels.fp8_matmul
    elif fp8:
        format.matmul = kernels.fp8_matmul_ref
    elif config.kernels == "triton":
        format.matmul = partial(kernels.dequant_matmul, bits=format.bits)
    else:
        format.matmul = partial(kernels.dequant_matmul_ref, bits=format.bits)
    return format
