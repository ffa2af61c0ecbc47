"""An extension: multi-LoRA serving, vLLM's interface (Punica's idea). One base model serves many fine-tuned adapters
at once, rows of different adapters (and of none) in the same step: the base weights are read once per step for every
row, and each row adds two thin matmuls of its own adapter, shrink (to rank r) and expand (back), in kernels.py.

    llm = LLM(model, enable_lora=True, max_loras=4, max_lora_rank=16)  # vLLM's names (ext/vllm_names.py); or
    llm = LLM(model, lora_config=LoRAConfig(max_loras=4))              # nanoserve's own option
    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "path/to/adapter"))  # or one (or None) per prompt
    add_request(llm, prompt, params, lora_request=...)                 # the step API's: LLM.add_request, and one

Adapters are PEFT's folders (adapter_config.json, adapter_model.safetensors) that adapt any of q/k/v/o and gate/up/down
(any rank up to max_lora_rank, lora_alpha, rsLoRA's scaling). Where they live:
  - host: up to max_cpu_loras adapters stay loaded (checked when a request first names one), the least recently used
    dropped (and read again from its folder if a step needs it later);
  - device: max_loras slots, preallocated beside each adapted projection (LoRALinear: an A and a B per slot, padded to
    max_lora_rank). Before every step the runner calls this extension's step hook (ModelRunner.step_hooks), which puts
    the step's adapters in slots (the least recently used replaced) and writes the step's rows grouped by slot into
    static buffers that every adapted projection reads: the kernels' segments. A CUDA graph reads the same buffers, so
    a replay sees the current step's rows; a padded row is in no segment and gets nothing;
  - scheduler: a waiting sequence is admitted only if its adapter runs already or fewer than max_loras do
    (Scheduler.admission_rules), so no step needs more slots than there are: more adapters in flight queue;
  - prefix cache: a sequence's adapter (its LoRARequest) is its cache salt (Sequence.cache_salt), so a block computed
    under one adapter is never found by a request under another or under none; preemption and recompute keep it.
The engine's start wraps the model's projections (CausalLM.wrap_projections), before the engine captures its decode
graphs over them; quantized ones too (ext/quantization), whose adapters stay in the model's dtype (QLoRA's way). The
slots are allocated after the KV pool was sized, beyond gpu_memory_utilization: max_loras x max_lora_rank x (in + out
features of each of q, k, v, o, gate, up and down) elements per layer (Qwen3-0.6B, 8 slots of rank 16: 161 MB in bf16).
Tensor parallelism is refused (tensor_parallel_size must be 1): the adapters are not sharded as the base weights are."""

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from itertools import accumulate, chain
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from nanoserve.checks import LISTS, InvalidField, check_numbers, shown
from nanoserve.config import EngineConfig
from nanoserve.ext.lora.kernels import sgmv, sgmv_ref
from nanoserve.scheduler import Step
from nanoserve.sequence import Sequence

if TYPE_CHECKING:
    from nanoserve.llm import LLM

# the model's adapted projections, (module, name) in a decoder layer -> the PEFT target modules they merge, in order
PROJECTIONS = {
    ("self_attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"),
    ("self_attn", "o_proj"): ("o_proj",),
    ("mlp", "gate_up_proj"): ("gate_proj", "up_proj"),
    ("mlp", "down_proj"): ("down_proj",),
}
SHARD_OF = {target: (name, i) for (_, name), targets in PROJECTIONS.items() for i, target in enumerate(targets)}
# an adapter tensor's name in PEFT's safetensors: its layer, its target module, A or B
PEFT_NAME = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# adapter_config.json's settings that change what an adapter computes, beyond r, lora_alpha and use_rslora: the value
# each must have (plain LoRA: no bias, no DoRA, one rank and alpha for every module, no other module trained)
PLAIN_LORA = {
    "bias": "none",
    "use_dora": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
}
MAX_RANK = 256  # the highest max_lora_rank (vLLM's)


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: an adapter's name, a positive id and its folder (a str). Equal requests (all three fields) are one
    adapter, loaded once, whose blocks the prefix cache shares; a different one is never given them."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        names = isinstance(self.lora_name, str) and isinstance(self.lora_path, str)
        if not (names and isinstance(self.lora_int_id, int)) or self.lora_int_id < 1:
            raise InvalidField("lora_request", f"{shown(self)}: a name, a positive integer id and a folder")


@dataclass
class LoRAConfig:
    """The engine's adapters (vLLM's LoRAConfig): max_loras device slots (the adapters one step may use), each holding
    an adapter of rank up to max_lora_rank, and max_cpu_loras adapters kept loaded on the host (None: max_loras)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        check_numbers(self, {"max_loras": {"low": 1}, "max_lora_rank": {"low": 1, "high": MAX_RANK}})
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        check_numbers(self, {"max_cpu_loras": {"low": self.max_loras}})


def check_config(config: EngineConfig) -> None:
    """lora_config: a LoRAConfig, a dict of its fields, or JSON text of one (the server's --lora-config), made a
    LoRAConfig. Adapters run in one process."""
    value = config.lora_config
    try:
        value = json.loads(value) if isinstance(value, str) else value
        value = LoRAConfig(**value) if isinstance(value, dict) else value
    except (json.JSONDecodeError, TypeError) as error:  # not JSON, or a key that is no field
        raise InvalidField("lora_config", str(error)) from None
    if not isinstance(value, LoRAConfig):
        raise InvalidField("lora_config", f"{shown(value)} is not a LoRAConfig or a dict of its fields")
    if config.tensor_parallel_size > 1:
        raise InvalidField("tensor_parallel_size", "LoRA adapters run with tensor_parallel_size=1 only")
    config.lora_config = value


def start(llm: "LLM") -> "Adapters":
    """The engine starts with LoRA on: its adapters wrap the model's projections and join the runner's step hooks and
    the scheduler's admission rules. Returns them (llm.extensions["lora"])."""
    return Adapters(llm)


def adapters_of(llm: "LLM") -> "Adapters":
    """The engine's adapters, where LoRA is on; else an InvalidField naming lora_request."""
    if "lora" not in llm.extensions:
        raise InvalidField("lora_request", "needs LoRA on: LLM(..., enable_lora=True), or lora_config")
    return llm.extensions["lora"]


def check_adapter(llm: "LLM", adapter: object) -> None:
    """One request's adapter: None, or a LoRARequest that this engine (with LoRA on) loads, checking it."""
    if adapter is None:
        return
    adapters = adapters_of(llm)
    if not isinstance(adapter, LoRARequest):
        raise InvalidField("lora_request", f"{shown(adapter)} is not a LoRARequest (or None)")
    adapters.on_host(adapter)


def attach_adapters(llm: "LLM", requests: list, lora_request: object) -> None:
    """LLM.generate's lora_request for its requests (outputs.Request, not yet queued): one LoRARequest (or None) for
    all, or a list of one per request. Each adapter, checked, becomes its request's sequences' cache salt."""
    per_request = list(lora_request) if isinstance(lora_request, LISTS) else [lora_request] * len(requests)
    if len(per_request) != len(requests):
        raise InvalidField("lora_request", f"{len(per_request)} given for {len(requests)} prompts")
    for request, adapter in zip(requests, per_request, strict=True):
        check_adapter(llm, adapter)
        for seq in request.seqs:
            seq.cache_salt = adapter


def add_request(llm: "LLM", *args: object, lora_request: LoRARequest | None = None, **kwargs: object) -> str:
    """LLM.add_request(*args, **kwargs) with vLLM's lora_request (the step API's; the server's): the adapter is checked
    and loaded first, and the request's sequences take it before any step can schedule them."""
    check_adapter(llm, lora_request)
    request_id = llm.add_request(*args, **kwargs)
    for seq in llm.requests[request_id].seqs:
        seq.cache_salt = lora_request
    return request_id


@dataclass
class Adapter:
    """An adapter on the host, ready to copy into a slot: its rank, its scale (lora_alpha / rank, or / sqrt(rank) with
    rsLoRA), and per adapted (layer, projection) its A and B as a slot holds them (fp32, zero-padded to max rank)."""

    rank: int
    scale: float
    weights: dict  # (layer, projection) -> (A, B), for each projection the adapter adapts


def load_adapter(request: LoRARequest, layers: dict[tuple[int, str], "LoRALinear"], max_rank: int) -> Adapter:
    """An adapter from its folder (PEFT's format), checked against the model before any request uses it: a rank up to
    max_rank, target modules this model has, plain LoRA, and each tensor an A or a B of a target module of an existing
    layer, in that layer's shape (another base model's is not)."""

    def refuse(problem: str) -> InvalidField:
        return InvalidField("lora_request", f"adapter {request.lora_name!r}: {problem}")

    try:
        peft = json.loads((Path(request.lora_path) / "adapter_config.json").read_text())
        tensors = load_file(Path(request.lora_path) / "adapter_model.safetensors")
    except Exception as error:  # missing, unreadable, not JSON, not safetensors
        raise refuse(f"no PEFT adapter in {request.lora_path!r}: {error}") from None
    rank, alpha = peft.get("r"), peft.get("lora_alpha", 8)
    if not isinstance(rank, int) or not 1 <= rank <= max_rank or not isinstance(alpha, (int, float)):
        raise refuse(f"rank {shown(rank)} is not in [1, max_lora_rank={max_rank}]")
    for key, plain in PLAIN_LORA.items():
        if (peft.get(key) or plain) != plain:
            raise refuse(f"{key}={shown(peft[key])}: plain LoRA only")
    # target modules by name, as PEFT matches them: the last part of each (its "all-linear" saves whole paths)
    targets = peft.get("target_modules")
    targets = {str(t).rsplit(".", 1)[-1] for t in targets} if isinstance(targets, LISTS) else targets
    if not isinstance(targets, set) or not targets <= set(SHARD_OF):
        raise refuse(f"target modules {shown(targets)}: this model has {', '.join(SHARD_OF)}")
    weights = {}  # (layer, projection) -> its A and B
    for key, tensor in tensors.items():
        match = PEFT_NAME.fullmatch(key) or ("", "-1", "", "")
        name, i = SHARD_OF[match[2]] if match[2] in targets else ("", 0)
        where = (int(match[1]), name)
        if where not in layers:
            raise refuse(f"{key!r} is no A or B of this model's {', '.join(targets)}")
        layer = layers[where]
        a, b = weights.setdefault(where, (torch.zeros(layer.a.shape[1:]), torch.zeros(layer.b.shape[1:])))
        start = sum(layer.shard_sizes[:i])  # the shard's first output feature
        # A: the shard's rows of a (max rank each); B: its output features' rows of b, the rank's columns
        into = (
            a[i * max_rank : i * max_rank + rank] if match[3] == "A" else b[start : start + layer.shard_sizes[i], :rank]
        )
        if tensor.shape != into.shape:
            raise refuse(f"{key} is {list(tensor.shape)} where this model has {list(into.shape)}: another base's")
        into.copy_(tensor)
    scale = alpha / (math.sqrt(rank) if peft.get("use_rslora") else rank)
    return Adapter(rank, scale, weights)


class LoRALinear(nn.Module):
    """A projection with every slot's adapter beside it (vLLM's ...WithLoRA layers): base(x), then the rows of each slot
    get scale x (x @ A^T) @ B^T added (shrink, expand). A merged projection (q|k|v, gate|up) has an A and a B per shard,
    stacked: a [slots, shards x max rank, in] and b [slots, out, max rank], zero where an adapter leaves a shard alone;
    ranks [slots] says which slots adapt it at all (0: not, and the kernel skips the slot)."""

    def __init__(self, base: nn.Module, step: tuple, config: LoRAConfig, kernel: object, dtype: torch.dtype) -> None:
        super().__init__()
        self.base = base
        # what every adapted projection reads of a step, which the step hook fills before it runs: its rows grouped by
        # slot (slot s's rows are rows_by_slot[slot_starts[s] : slot_starts[s + 1]]) and each slot's scale. Static
        # buffers on the device, so a CUDA graph's replay reads the current step's
        self.rows_by_slot, self.slot_starts, self.scales = step  # [max_num_batched_tokens], [slots + 1] int32; [slots]
        self.shard_sizes = tuple(getattr(base, "shard_sizes", [base.out_features]))  # merged: its shards'
        slots, rank = config.max_loras, config.max_lora_rank
        # in the model's dtype (base's weights may be quantized ones: QLoRA's way, ext/quantization), on its device
        like = self.scales.new_empty(0, dtype=dtype)
        self.a = like.new_zeros(slots, len(self.shard_sizes) * rank, base.in_features)
        self.b = like.new_zeros(slots, base.out_features, rank)
        ints = {"dtype": torch.int32, "device": like.device}
        self.ranks = torch.zeros(slots, **ints)
        self.shard_starts = torch.tensor([0, *accumulate(self.shard_sizes)], **ints)
        self.sgmv = kernel  # kernels.py's sgmv, or its PyTorch reference (as the engine's kernels are chosen)

    def forward(self, x: Tensor) -> Tensor:
        """x [rows, in] -> [rows, out]: the base projection, plus each row's adapter (none for rows in no segment)."""
        y = self.base(x)
        segments = (self.rows_by_slot, self.slot_starts, self.ranks)
        u = x.new_empty(len(x), self.a.shape[1], dtype=torch.float32)  # shrink: x @ A^T, [rows, shards x max rank]
        self.sgmv(u, x, self.a, *segments)
        self.sgmv(y, u, self.b, *segments, self.scales, self.shard_starts)  # expand
        return y


class Adapters:
    """An engine's adapters: those loaded on the host, the device's slots, the adapted projections, and the step hook
    and admission rule that keep them in step with the scheduler. Both orders are least recently used first."""

    def __init__(self, llm: "LLM") -> None:
        config = self.config = llm.config.lora_config
        runner = llm.runner
        # the step's segments, [slot_starts | rows_by_slot], filled with one copy per step
        parts = [config.max_loras + 1, llm.config.max_num_batched_tokens]
        self.step_inputs = torch.zeros(sum(parts), dtype=torch.int32, device=runner.device)
        starts, rows = self.step_inputs.split(parts)
        self.segments = (rows, starts)
        self.scales = torch.zeros(config.max_loras, device=runner.device)  # each slot's
        # 1) each adapted projection of each layer wrapped: (layer, projection) -> its LoRALinear
        self.kernel = sgmv if llm.config.kernels == "triton" else sgmv_ref
        self.dtype = runner.dtype
        self.layers: dict[tuple[int, str], LoRALinear] = {}
        runner.model.wrap_projections(self.wrap)
        # 2) the adapters on the host, and in slots: adapter -> its slot, where a free slot is its own number's (an int,
        # never an adapter a step needs), so the free slots come first when one is taken; and each slot's rows last step
        self.host: OrderedDict[LoRARequest, Adapter] = OrderedDict()
        self.slot_of: OrderedDict[LoRARequest | int, int] = OrderedDict(
            (slot, slot) for slot in range(config.max_loras)
        )
        self.last_rows: list[list[int]] = [[] for _ in range(config.max_loras)]
        # 3) the extension points, each called once per step
        runner.step_hooks.append(self.before_step)
        llm.scheduler.admission_rules.append(self.may_admit)

    def wrap(self, layer: int | None, name: str, projection: nn.Module) -> nn.Module:
        """CausalLM.wrap_projections' callback: a decoder layer's projection gets its LoRALinear; the LM head none."""
        if layer is None:
            return projection
        step = (*self.segments, self.scales)
        self.layers[layer, name] = LoRALinear(projection, step, self.config, self.kernel, self.dtype)
        return self.layers[layer, name]

    def on_host(self, request: LoRARequest) -> Adapter:
        """The request's adapter, loaded (and checked) if it is not on the host; beyond max_cpu_loras, the least
        recently used are dropped."""
        if request not in self.host:
            self.host[request] = load_adapter(request, self.layers, self.config.max_lora_rank)
            while len(self.host) > self.config.max_cpu_loras:
                self.host.popitem(last=False)
        self.host.move_to_end(request)
        return self.host[request]

    def may_admit(self, seq: Sequence, running_seqs: list[Sequence]) -> bool:
        """The scheduler's admission rule: seq may run if its adapter runs already or fewer than max_loras do, so a step
        never needs more adapters than there are slots (vLLM's scheduler keeps the same bound)."""
        running = {s.cache_salt for s in running_seqs} - {None}  # a sequence's salt is its adapter (or None)
        return seq.cache_salt in running | {None} or len(running) < self.config.max_loras

    def before_step(self, step: Step) -> None:
        """The runner's step hook: the step's adapters into slots, then its rows grouped by slot into the segments."""
        adapters = [s.seq.cache_salt for s in step.scheduled]  # each sequence's LoRARequest, or None
        needed = [a for a in dict.fromkeys(adapters) if a is not None]  # in step order; at most max_loras (may_admit)
        for adapter in needed:
            self.to_slot(adapter, needed)
        rows = [[] for _ in self.last_rows]  # per slot
        first = 0  # each scheduled sequence's rows follow the one before's
        for scheduled, adapter in zip(step.scheduled, adapters, strict=True):
            if adapter is not None:
                rows[self.slot_of[adapter]] += range(first, first + scheduled.num_new_tokens)
            first += scheduled.num_new_tokens
        self.last_rows = rows
        host = torch.tensor([0, *accumulate(map(len, rows)), *chain.from_iterable(rows)], dtype=torch.int32)
        if self.step_inputs.is_cuda:
            host = host.pin_memory()  # a pinned source lets the copy run asynchronously
        self.step_inputs[: len(host)].copy_(host, non_blocking=True)

    def to_slot(self, request: LoRARequest, needed: list[LoRARequest]) -> None:
        """Put the request's adapter in a slot if it is in none: a free one, else the least recently used one whose
        adapter this step does not need. The copies queue behind the steps already launched, which read the old."""
        if request not in self.slot_of:
            slot = self.slot_of.pop(next(r for r in self.slot_of if r not in needed))
            adapter = self.on_host(request)
            for key, layer in self.layers.items():  # each projection's A and B, or none (rank 0)
                if key in adapter.weights:
                    layer.a[slot].copy_(adapter.weights[key][0])
                    layer.b[slot].copy_(adapter.weights[key][1])
                layer.ranks[slot] = adapter.rank if key in adapter.weights else 0
            self.scales[slot] = adapter.scale
            self.slot_of[request] = slot
        self.slot_of.move_to_end(request)

    def slot_table(self) -> str:
        """The slots as the last step used them, a line each: its adapter (name and id) and that step's rows in it."""
        held = {
            slot: f"{r.lora_name} (id {r.lora_int_id})"
            for r, slot in self.slot_of.items()
            if isinstance(r, LoRARequest)
        }
        return "\n".join(
            f"slot {slot}: {held.get(slot, 'free'):<24} {len(rows):>4} rows {rows[:1] + rows[-1:]}"
            for slot, rows in enumerate(self.last_rows)
        )
