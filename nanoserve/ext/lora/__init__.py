"""An extension: multi-LoRA serving, vLLM's interface (Punica's idea). One base model serves many fine-tuned adapters
at once, rows of different adapters (and of none) in the same step: the base weights are read once per step for every
row, and each row adds two thin matmuls of its own adapter, shrink (to rank r) and expand (back), in kernels.py.

    llm = LLM(model, enable_lora=True, max_loras=4, max_lora_rank=16)  # vLLM's names (ext/vllm_names.py); or
    llm = LLM(model, lora_config=LoRAConfig(max_loras=4))              # nanoserve's own option
    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "path/to/adapter"))  # or one (or None) per prompt
    add_request(llm, prompt, params, lora_request=...)                 # the step API's: LLM.add_request, and one

Adapters are PEFT's folders (adapter_config.json, adapter_model.safetensors) that adapt any of q/k/v/o and gate/up/down
(any rank up to max_lora_rank, lora_alpha, rsLoRA's scaling). Where they live:
  - loading: an adapter is read from its folder beside the steps (ext/background.py's worker thread) when a request
    first names it, and checked (load_adapter): plain LoRA of this model's shapes, each tensor's shape read from the
    file's header before the tensor (so an adapter is never larger than a slot: its size limit), a finite scale, and
    the overflow rule below. A request of the step API waits in the queue until its adapter is loaded (an admission
    rule holds it while later ones go ahead); one whose adapter fails ends alone, with the reason (Sequence.error).
    LLM.generate, beam search and check_adapter wait for their adapters instead, so a bad one is an InvalidField naming
    lora_request before any request is queued;
  - host: the loaded adapters, up to max_cpu_loras besides those a queued or running sequence uses (pinned: a step
    never reads a folder, so one deleted after its request was queued harms nothing), the least recently used dropped;
  - scheduler and device: max_loras slots beside each adapted projection (LoRALinear: an A and a B per slot, padded to
    max_lora_rank). A waiting sequence is admitted once its adapter has a slot (Scheduler.admission_rules): its own
    already, or one whose adapter no running sequence uses, into which it is copied then (the least recently used
    replaced). So no step needs more adapters than there are slots (more adapters in flight queue), and a slot is held
    exactly while its adapter runs. Before every step the runner calls this extension's step hook
    (ModelRunner.step_hooks), which writes the step's rows grouped by slot into static buffers that every adapted
    projection reads: the kernels' segments. A CUDA graph reads the same buffers, so a replay sees the current step's
    rows; a padded row is in no segment and gets nothing;
  - prefix cache: a sequence's adapter (its LoRARequest) is its cache salt (Sequence.cache_salt), so a block computed
    under one adapter is never found by a request under another or under none; preemption and recompute keep it.

The overflow rule: an adapter adds scale x (x @ A^T) @ B^T to its projection, computed in the model's dtype after the
shrink. For an input whose elements are at most MAX_INPUT in magnitude, the largest element either product can reach
(all signs aligned: the largest sum of |A| over a row, and that times |scale| times the largest sum of |B| over a row)
must stay within the dtype's largest value, and the scale within float32's (the slots hold it so); a weight that is not
finite fails it. In bf16 or fp32 only an absurd adapter fails (lora_alpha 1e300, weights near 1e17); in fp16, one whose
worst case multiplies an input by more than 65504 / MAX_INPUT = 256.

The engine's start wraps the model's projections (CausalLM.wrap_projections), before the engine captures its decode
graphs over them; quantized ones too (ext/quantization), whose adapters stay in the model's dtype (QLoRA's way).
The slots are allocated then, after the KV pool was sized, beyond gpu_memory_utilization, and left
uninitialised (a slot is read only once an adapter was copied into it whole, so a CPU takes their memory only as they
fill): max_loras x max_lora_rank x (in + out features of each of q, k, v, o, gate, up and down) elements per layer
(Qwen3-0.6B, 8 slots of rank 16: 161 MB in bf16). max_loras is at most MAX_LORAS; slots the device cannot hold are an
InvalidField naming max_loras. Tensor parallelism is refused (tensor_parallel_size must be 1): the adapters are not
sharded as the base weights are."""

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from itertools import accumulate, chain
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import Tensor, nn

from nanoserve.checks import LISTS, InvalidField, check_number, check_numbers, shown
from nanoserve.config import EngineConfig
from nanoserve.ext.background import Prepared
from nanoserve.ext.lora.kernels import sgmv, sgmv_ref
from nanoserve.sampler import to_device
from nanoserve.scheduler import Step
from nanoserve.sequence import Sequence

if TYPE_CHECKING:
    from nanoserve.llm import LLM

FIELD = "lora_request"  # the request field this extension owns (generate's, add_request's, beam search's)
# a PEFT target module -> the model's projection that holds it (merged: q|k|v, gate|up) and its shard there
SHARD_OF = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
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
# the most slots: each adds a program per row tile to every adapted projection's launches (most return at once) and
# a slot's memory beside every projection; a step of 256 adapters is beyond any use seen (vLLM's tests go to 16)
MAX_LORAS = 256
MAX_INPUT = 256.0  # the overflow rule's largest input element (module docstring); real inputs stay within tens


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: an adapter's name, a positive id (an int64) and its folder (a str). Equal requests (all three fields)
    are one adapter, loaded once, whose blocks the prefix cache shares; a different one is never given them."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not isinstance(self.lora_path, str):
            raise InvalidField(FIELD, f"{shown(self)}: a name and a folder, each a str")
        check_number(FIELD, self.lora_int_id, 1, integer=True)  # at most an int64's largest; never a bool


@dataclass
class LoRAConfig:
    """The engine's adapters (vLLM's LoRAConfig): max_loras device slots (the adapters one step may use), each holding
    an adapter of rank up to max_lora_rank, and max_cpu_loras adapters kept loaded on the host (None: max_loras)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        check_numbers(self, {"max_loras": {"low": 1, "high": MAX_LORAS}, "max_lora_rank": {"low": 1, "high": MAX_RANK}})
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


def check_adapter(llm: "LLM", adapter: object, wait: bool = True) -> None:
    """One request's adapter: None, or a LoRARequest for this engine (with LoRA on), whose load starts beside the steps
    (ext/background.py); with `wait`, it is loaded and checked before the caller goes on (beam search, the server's
    --lora-modules, LLM.generate's), a bad one an InvalidField naming lora_request."""
    if adapter is None:
        return
    if "lora" not in llm.extensions:
        raise InvalidField(FIELD, "needs LoRA on: LLM(..., enable_lora=True), or lora_config")
    if not isinstance(adapter, LoRARequest):
        raise InvalidField(FIELD, f"{shown(adapter)} is not a LoRARequest (or None)")
    loading = llm.extensions["lora"].host.start(adapter)
    if wait:
        loading.result()  # raises the load's InvalidField


def attach_adapters(llm: "LLM", requests: list, lora_request: object) -> None:
    """LLM.generate's lora_request for its requests (outputs.Request, not yet queued): one LoRARequest (or None) for
    all, or a list of one per request. Each adapter is loaded and checked (a bad one refuses the batch by name) before
    it becomes its request's sequences' cache salt."""
    per_request = list(lora_request) if isinstance(lora_request, LISTS) else [lora_request] * len(requests)
    if len(per_request) != len(requests):
        raise InvalidField(FIELD, f"{len(per_request)} given for {len(requests)} prompts")
    for request, adapter in zip(requests, per_request, strict=True):
        check_adapter(llm, adapter)
        for seq in request.seqs:
            seq.cache_salt = adapter


def add_request(llm: "LLM", *args: object, lora_request: LoRARequest | None = None, **kwargs: object) -> str:
    """LLM.add_request(*args, **kwargs) with vLLM's lora_request (the step API's; the server's). The adapter's load
    starts beside the steps and the request waits in the queue until it is done; an adapter that fails to load ends
    the request alone, finish reason "error", the error naming lora_request."""
    check_adapter(llm, lora_request, wait=False)
    request_id = llm.add_request(*args, **kwargs)
    for seq in llm.requests[request_id].seqs:  # before any step can schedule them
        seq.cache_salt = lora_request
    return request_id


@dataclass
class Adapter:
    """An adapter on the host, ready to copy into a slot: its rank, its scale (lora_alpha / rank, or / sqrt(rank) with
    rsLoRA), and per adapted (layer, projection) its A and B as a slot holds them (zero-padded to max rank), in fp32."""

    rank: int
    scale: float
    weights: dict  # (layer, projection) -> (A, B), for each projection the adapter adapts


def load_adapter(request: LoRARequest, layers: dict[tuple[int, str], "LoRALinear"], max_rank: int) -> Adapter:
    """An adapter from its folder (PEFT's format), checked against the model before any request uses it: a rank up to
    max_rank, a finite scale, target modules this model has, plain LoRA, and each tensor an A or a B of a target module
    of an existing layer, in that layer's shape (another base model's is not), checked from the file's header before
    the tensor is read; then each projection within the overflow rule (module docstring)."""

    def refuse(problem: str) -> InvalidField:
        return InvalidField(FIELD, f"adapter {request.lora_name!r}: {problem}")

    # (a folder that is missing or unreadable, not JSON (or not an object of it), not safetensors: that error, which
    # Prepared names)
    folder = Path(request.lora_path)
    peft = json.loads((folder / "adapter_config.json").read_text())
    file = safe_open(folder / "adapter_model.safetensors", "pt")
    rank, alpha = peft.get("r"), peft.get("lora_alpha", 8)
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise refuse(f"rank {shown(rank)} is not in [1, max_lora_rank={max_rank}]")
    scale = alpha / (math.sqrt(rank) if peft.get("use_rslora") else rank)  # (a TypeError if alpha is no number)
    if not abs(scale) <= torch.finfo(torch.float32).max:  # the slots hold it in fp32; nan is refused too
        raise refuse(f"lora_alpha {shown(alpha)} makes the scale {scale:g}, not a finite float32")
    for key, plain in PLAIN_LORA.items():
        if (peft.get(key) or plain) != plain:
            raise refuse(f"{key}={shown(peft[key])}: plain LoRA only")
    # target modules by name, as PEFT matches them: the last part of each (its "all-linear" saves whole paths)
    targets = peft.get("target_modules")
    targets = {str(t).rsplit(".", 1)[-1] for t in targets} if isinstance(targets, LISTS) else targets
    if not isinstance(targets, set) or not targets <= set(SHARD_OF):
        raise refuse(f"target modules {shown(targets)}: this model has {', '.join(SHARD_OF)}")
    weights = {}  # (layer, projection) -> its A and B
    for key in file.keys():
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
        shape = file.get_slice(key).get_shape()  # from the header: nothing read yet
        if shape != list(into.shape):
            raise refuse(f"{key} is {shape} where this model has {list(into.shape)}: another base's")
        into.copy_(file.get_tensor(key))
    # the overflow rule (module docstring): for an input of elements up to 1, shrink's |u| is at most the largest sum
    # of |A| over a row, and expand's update at most that x |scale| x the largest sum of |B| over a row; the worst case
    # is their sum for inputs up to MAX_INPUT (inf or nan where a weight is)
    for (index, name), (a, b) in weights.items():
        shrink = float(a.abs().sum(1).max())
        worst = MAX_INPUT * shrink * (1 + abs(scale) * float(b.abs().sum(1).max()))
        dtype = layers[index, name].a.dtype
        if not worst <= torch.finfo(dtype).max:
            raise refuse(f"layer {index}'s {name} could make an input of {MAX_INPUT:g} {worst:.3g}, beyond {dtype}")
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
        # the slots, uninitialised: a slot is read only once an adapter is copied into it whole (its rank not 0), so a
        # CPU's memory is taken only as slots are used. In the model's dtype on its device, not base.weight's: a
        # quantized base (ext/quantization) has packed weights, or none, and its adapters stay 16-bit (QLoRA's way)
        slots, rank = config.max_loras, config.max_lora_rank
        like = self.scales.new_empty(0, dtype=dtype)
        self.a = like.new_empty(slots, len(self.shard_sizes) * rank, base.in_features)
        self.b = like.new_empty(slots, base.out_features, rank)
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
        self.scales = torch.zeros(config.max_loras, device=runner.device)  # each slot's
        self.segments = (rows, starts, self.scales)  # what every LoRALinear reads of a step
        # 1) each adapted projection of each layer wrapped, with its slots: (layer, projection) -> its LoRALinear
        self.kernel = sgmv if llm.config.kernels == "triton" else sgmv_ref
        self.dtype = runner.dtype
        self.layers: dict[tuple[int, str], LoRALinear] = {}
        try:
            runner.model.wrap_projections(self.wrap)
        except RuntimeError as error:  # the device has no room for the slots
            raise InvalidField(
                "max_loras", f"{config.max_loras} slots of rank {config.max_lora_rank}: {error}"
            ) from None
        # 2) the adapters on the host, each loaded beside the steps, pinned while a queued or running sequence uses it;
        # and in slots: adapter -> its slot, where a free slot is its own number's (an int, never an adapter a step
        # needs), so the free slots come first when one is taken; and each slot's rows last step
        self.host = Prepared(
            llm,
            FIELD,
            lambda request: load_adapter(request, self.layers, config.max_lora_rank),
            lambda seq: seq.cache_salt,
            config.max_cpu_loras,
        )
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
        self.layers[layer, name] = LoRALinear(projection, self.segments, self.config, self.kernel, self.dtype)
        return self.layers[layer, name]

    def may_admit(self, seq: Sequence, running_seqs: list[Sequence]) -> bool:
        """The scheduler's admission rule, after the host's (which holds seq until its adapter is loaded, and ends its
        request if that failed): seq waits until the adapter has a slot: its own already, or one whose adapter no
        running sequence uses (a free one first, else the least recently used), into which it is copied (to_slot). So a
        step never needs more adapters than there are slots (vLLM's scheduler keeps the same bound), and a slot is held
        while its adapter runs."""
        adapter = seq.cache_salt  # a sequence's salt is its adapter (or None)
        if adapter is None:
            return True
        if adapter in self.slot_of:
            self.slot_of.move_to_end(adapter)
            return True
        running = {s.cache_salt for s in running_seqs}
        victim = next((held for held in self.slot_of if held not in running), None)
        if victim is None:  # every slot's adapter runs: seq waits for one to finish
            return False
        self.to_slot(adapter, victim)
        return True

    def to_slot(self, request: LoRARequest, victim: LoRARequest | int) -> None:
        """Copy the request's adapter into the victim's slot. The copies queue behind the steps already launched, which
        read the old. The slot is free while it is written: a copy that fails (the device's fault: the adapter was
        checked when loaded) leaves it free."""
        slot = self.slot_of.pop(victim)
        self.slot_of[slot] = slot  # free until written
        adapter = self.host.result(request)  # loaded (may_admit), and kept while its sequences run
        for key, layer in self.layers.items():  # each projection's A and B, or none (rank 0)
            if key in adapter.weights:
                layer.a[slot].copy_(adapter.weights[key][0])
                layer.b[slot].copy_(adapter.weights[key][1])
            layer.ranks[slot] = adapter.rank if key in adapter.weights else 0
        self.scales[slot] = adapter.scale
        self.slot_of[request] = self.slot_of.pop(slot)

    def before_step(self, step: Step) -> None:
        """The runner's step hook: the step's rows grouped by the slots of their adapters (each has one since its
        sequence was admitted) into the segments."""
        rows = [[] for _ in self.last_rows]  # per slot
        first = 0  # each scheduled sequence's rows follow the one before's
        for scheduled in step.scheduled:
            if scheduled.seq.cache_salt is not None:
                rows[self.slot_of[scheduled.seq.cache_salt]] += range(first, first + scheduled.num_new_tokens)
            first += scheduled.num_new_tokens
        self.last_rows = rows
        segments = [0, *accumulate(map(len, rows)), *chain.from_iterable(rows)]
        self.step_inputs[: len(segments)].copy_(to_device(segments, torch.int32, self.step_inputs.device))
