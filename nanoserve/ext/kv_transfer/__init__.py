"""An extension: prefill and decode on separate engines (disaggregation), vLLM's kv_transfer_config, at nanoserve's
scale: one prefill engine and one decode engine in two processes, which may be on two machines.

    # two processes, as torchrun starts them (RANK 0 and 1): each makes its engine with its role
    LLM(model, kv_transfer_config={"kv_role": "kv_producer"})   # rank 0: prefill
    LLM(model, kv_transfer_config={"kv_role": "kv_consumer"})   # rank 1: decode
    # or the pair behind one OpenAI-compatible endpoint, one command (the extension ext/pd_router.py):
    torchrun --nproc-per-node 2 -m nanoserve.ext.pd_router --model DIR --port 8000

  __init__.py  the engine's side: its options, what a producer sends and a consumer loads (a KV connector)
  link.py      the connection between the two processes: torch.distributed (gloo), its threads, the heartbeat

Why: prefill is compute-bound (thousands of tokens per step) and decode bandwidth-bound (one token per sequence per
step); in one engine a long prompt's chunks ride in the decode steps and stretch every stream's inter-token latency.
Apart, the decode engine's steps hold decodes only.

How a request goes. The prefill engine (kv_producer) computes a prompt and its first token; its output hook
(ModelRunner.output_hooks: after the forward, so the K/V exist) copies the prompt's full blocks, all but the one that
holds the last token, to host memory, and sends them with their tokens to the decode engine once the step is read back
(the copies are complete then). The decode engine (kv_consumer) gets the same request: an admission rule
(Scheduler.admission_rules) holds it until K/V for its prompt has arrived (or its own prefix cache holds those blocks),
then the KV connector (Scheduler.kv_connector) says they can be loaded: the scheduler books them as computed in fresh
blocks, whose copies (ext/kv_offload's BlockCopies: this extension imports it, the one dependency between the two) the
step hook makes before the step runs. The decode engine computes only the last block's tokens, and generates every
token itself: its outputs are a single engine's, token for token, sampling included. Transfers are matched by content,
the prompt's tokens (as vLLM's first P/D connectors matched them), so the two engines share no request ids; the decode
engine's prefix cache then keys the loaded blocks as its own.

kv_role: kv_producer sends the prompt of every request it computes; kv_consumer waits for every request's prompt (all
but prompts of one block or less, and prompt_logprobs requests, which need every position's logits); kv_both sends
as a producer and loads what has arrived, never waiting (two kv_both engines share their prefills).

Faults: a peer that exits, hangs or stops is named (link.py) within seconds; from then on a consumer's waiting requests,
and a producer's new ones, fail with that name (Sequence.error: their blocks return; kv_both's go on, computed here and
not shared), unless kv_load_failure_policy is "recompute", with which a consumer computes them itself. A transfer that
has not come transfer_timeout_s after its request arrived fails the same way. K/V that arrives and is never loaded is
dropped after transfer_timeout_s, or when more than kv_buffer_size bytes wait. So neither engine holds a block for the
other.

The options, vLLM's KVTransferConfig keys (a dict or its JSON): kv_role (required); kv_connector
"TorchDistributedConnector" (or unset); kv_rank and kv_parallel_size (2; 1, vLLM's default, means the pair too); kv_ip
and kv_port (where no launcher sets RANK); kv_buffer_size (bytes of K/V waiting to be loaded, 1e9); kv_buffer_device
(the buffer is host memory either way); kv_load_failure_policy ("fail" or "recompute"); engine_id (a name);
kv_connector_extra_config: transfer_timeout_s (30) and heartbeat_timeout_s (10). Not here: NCCL between GPUs (K/V
travels through host memory over gloo, pinned on a GPU), several prefill or decode engines, tensor parallelism, LoRA."""

import json
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from weakref import WeakSet

import torch
from torch import Tensor

from nanoserve.checks import MAX_INT, InvalidField, check_number, shown
from nanoserve.config import EngineConfig
from nanoserve.ext.kv_offload import BlockCopies
from nanoserve.ext.kv_transfer.link import Link, place_of
from nanoserve.scheduler import Step
from nanoserve.sequence import Sequence

if TYPE_CHECKING:
    from nanoserve.llm import LLM

logger = logging.getLogger("nanoserve")
FIELD = "kv_transfer_config"
CONNECTOR = "TorchDistributedConnector"  # the name vLLM gives kv_buffer_size's connector
ROLES = ("kv_producer", "kv_consumer", "kv_both")
SENDS = ("kv_producer", "kv_both")
LOADS = ("kv_consumer", "kv_both")
NAMES = {"kv_producer": "the prefill engine", "kv_consumer": "the decode engine", "kv_both": "the peer engine"}
# vLLM's KVTransferConfig keys -> their default (kv_role has none: it is required)
DEFAULTS = {
    "kv_connector": None,
    "kv_role": None,
    "kv_rank": None,
    "kv_parallel_size": 1,
    "kv_ip": "127.0.0.1",
    "kv_port": 14579,
    "engine_id": None,
    "kv_buffer_device": "cuda",
    "kv_buffer_size": 1e9,
    "kv_load_failure_policy": "fail",
    "kv_connector_extra_config": {},
    "kv_connector_module_path": None,
    "enable_permute_local_kv": False,
}
EXTRA_DEFAULTS = {"transfer_timeout_s": 30.0, "heartbeat_timeout_s": 10.0}  # kv_connector_extra_config's keys
CHOICES = {
    "kv_connector": (None, CONNECTOR),
    "kv_role": ROLES,
    "kv_rank": (None, 0, 1),
    "kv_parallel_size": (1, 2),
    "kv_buffer_device": ("cuda", "cpu"),
    "kv_load_failure_policy": ("fail", "recompute"),
    "kv_connector_module_path": (None,),
    "enable_permute_local_kv": (False,),
}


@dataclass
class Settings:
    """kv_transfer_config, checked."""

    role: str
    rank: int | None
    ip: str
    port: int
    buffer_bytes: float
    failure_policy: str
    transfer_timeout_s: float
    heartbeat_timeout_s: float


def settings_of(config: EngineConfig) -> Settings:
    """kv_transfer_config's keys checked one by one: each fault an InvalidField naming kv_transfer_config, and the
    key."""
    given = config.kv_transfer_config
    if isinstance(given, str):
        try:
            given = json.loads(given)
        except json.JSONDecodeError as error:
            raise InvalidField(FIELD, f"is not JSON: {error}") from None
    if not isinstance(given, dict) or set(given) - set(DEFAULTS):
        raise InvalidField(FIELD, f"{shown(given)} is not a dict of vLLM's KVTransferConfig keys {', '.join(DEFAULTS)}")
    given = DEFAULTS | given
    for key, allowed in CHOICES.items():
        if not any(given[key] == value and type(given[key]) is type(value) for value in allowed):
            raise InvalidField(FIELD, f"{key}: {shown(given[key])} is not one of {', '.join(map(str, allowed))}")
    for key in ("kv_ip", "engine_id"):
        if not isinstance(given[key], str | None):
            raise InvalidField(FIELD, f"{key}: {shown(given[key])} is not a string")
    extra = given["kv_connector_extra_config"]
    if not isinstance(extra, dict) or set(extra) - set(EXTRA_DEFAULTS):
        raise InvalidField(FIELD, f"kv_connector_extra_config: {shown(extra)} takes {', '.join(EXTRA_DEFAULTS)}")
    extra = EXTRA_DEFAULTS | extra
    return Settings(
        role=given["kv_role"],
        rank=given["kv_rank"],
        ip=given["kv_ip"],
        port=checked("kv_port", given["kv_port"], high=65535, integer=True),
        buffer_bytes=checked("kv_buffer_size", given["kv_buffer_size"]),
        failure_policy=given["kv_load_failure_policy"],
        transfer_timeout_s=checked("transfer_timeout_s", extra["transfer_timeout_s"]),
        heartbeat_timeout_s=checked("heartbeat_timeout_s", extra["heartbeat_timeout_s"]),
    )


def checked(key: str, value: object, high: float = MAX_INT, integer: bool = False) -> float:
    """A positive number of kv_transfer_config's (check_number's checks), or an InvalidField naming both."""
    try:
        return check_number(key, value, 0, high, integer=integer, above_low=True)
    except InvalidField as error:
        raise InvalidField(FIELD, str(error)) from None


def check_config(config: EngineConfig) -> None:
    """kv_transfer_config's keys (settings_of); one rank, no LoRA (a salted prefix is not matched by its tokens)."""
    settings_of(config)
    if config.tensor_parallel_size > 1:
        raise InvalidField(FIELD, "nanoserve transfers K/V with tensor_parallel_size=1 only")
    if config.lora_config is not None:
        raise InvalidField(FIELD, "not with LoRA: transfers are matched by their tokens, which an adapter changes")


def start(llm: "LLM") -> "KVTransfer":
    """Join the peer engine (refusing one this engine cannot pair with), and wire this engine's side in
    (llm.extensions["kv_transfer"])."""
    settings = settings_of(llm.config)
    transfer = KVTransfer(llm, settings)
    card = {"role": settings.role, "block": list(transfer.block_shape), "dtype": str(llm.runner.kv_dtype)}
    link = Link(place_of(settings.rank, settings.ip, settings.port), card, settings.heartbeat_timeout_s)
    check_peer(card, link.peer_card)
    transfer.connect(llm, link, peer_name(link.peer_card))
    return transfer


@dataclass
class Arrival:
    """K/V that came for a prompt: its full blocks [blocks, K or V, layer, slot, kv_head, head_dim], when it last came,
    and how many requests it came for (the same prompt prefilled for several: each decode request loads it once)."""

    kv: Tensor
    time: float  # time.monotonic()
    count: int = 1


class KVTransfer:
    """One engine's side of the pair: the producer's output hook, the consumer's admission rule, KV connector and step
    hook, the K/V that arrived (received, by prompt tokens) and the counters."""

    def __init__(self, llm: "LLM", settings: Settings) -> None:
        runner = llm.runner
        self.settings = settings
        self.bm = llm.block_manager
        self.block_size = self.bm.block_size
        self.kv_cache = runner.kv_cache
        self.block_shape = tuple(runner.kv_cache[:, :, 0].shape)  # [K or V, layer, slot, kv_head, head_dim]
        self.on_gpu = runner.on_gpu
        self.copies = BlockCopies(runner)
        self.received: OrderedDict[tuple[int, ...], Arrival] = OrderedDict()  # oldest first
        self.lock = threading.Lock()  # received is filled on the link's thread
        self.served = WeakSet()  # requests whose K/V was loaded (or is computed here): their samples wait no more
        self.sent = WeakSet()  # requests whose K/V was sent
        self.found: Arrival | None = None  # what num_loadable found, for load
        self.failure: str | None = None
        self.counts = dict.fromkeys(
            ("requests_sent", "blocks_sent", "requests_loaded", "blocks_loaded", "recomputed", "dropped"), 0
        )

    def connect(self, llm: "LLM", link: Link, name: str) -> None:
        """Start the link to the peer (named as name in failures), and wire this side into the engine: its admission
        rule, its KV connector, its step and output hooks; the link closes with the engine, or the process."""
        self.link = link
        link.start(self.on_message, self.fail, name)
        weakref.finalize(llm, link.close)  # BYE to the peer
        llm.scheduler.admission_rules.append(self.may_admit)
        llm.scheduler.kv_connector = self
        llm.runner.step_hooks.append(self.step_hook)
        llm.runner.output_hooks.append(self.output_hook)

    def stats(self) -> dict[str, int]:
        """The counters, named as in LLM.stats() with this extension's prefix, and the K/V waiting to be loaded."""
        waiting = sum(arrival.count for arrival in self.received.values())
        return {f"kv_transfer_{name}": n for name, n in (self.counts | {"waiting": waiting}).items()}

    def fail(self, problem: str) -> None:
        """The link failed, or the peer closed: remembered (the first problem), and named to every request it stops."""
        if self.failure is None:
            self.failure = problem
            logger.warning("KV transfer: %s", problem)

    def key(self, seq: Sequence) -> tuple[int, ...] | None:
        """The tokens of seq's prompt whose K/V is sent and loaded: its full blocks but the one with the last token;
        None where there are none, or the request asked for prompt_logprobs."""
        num_blocks = (seq.num_prompt_tokens - 1) // self.block_size
        if not num_blocks or seq.params.prompt_logprobs is not None or seq.request is None:
            return None
        return tuple(seq.token_ids[: num_blocks * self.block_size])

    # ---- the producer ----------------------------------------------------------------------------
    def output_hook(self, step: Step, hidden: Tensor) -> Callable[[], None] | None:
        """After the forward: each request whose prompt this step completed has its blocks copied to host memory
        (queued behind the step), sent once the step is read back."""
        if self.settings.role not in SENDS:
            return None
        outgoing = []
        for s in step.scheduled:
            seq = s.seq
            key = self.key(seq)
            if key is None or s.start + s.num_new_tokens != seq.num_prompt_tokens or seq.request in self.sent:
                continue
            self.sent.add(seq.request)
            if self.failure is not None:  # nowhere to send it: a producer's request fails at read-back
                if self.settings.role == "kv_producer":
                    seq.error = self.failure
                continue
            blocks = torch.tensor(seq.block_table[: len(key) // self.block_size], device=self.kv_cache.device)
            kv = self.kv_cache[:, :, blocks].movedim(2, 0)  # [blocks, K or V, layer, slot, kv_head, head_dim]
            host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=self.on_gpu)
            host.copy_(kv, non_blocking=True)
            outgoing.append((torch.tensor(key), host))
            self.counts["requests_sent"] += 1
            self.counts["blocks_sent"] += len(blocks)
        if not outgoing:
            return None
        return lambda: [self.link.send(tokens, kv) for tokens, kv in outgoing]

    # ---- the consumer ----------------------------------------------------------------------------
    def on_message(self, tokens: Tensor, kv: Tensor) -> None:
        """On the link's thread: K/V for a prompt arrived. Kept by its tokens (the oldest dropped past
        kv_buffer_size)."""
        key = tuple(tokens.tolist())
        kv = kv.view(self.kv_cache.dtype).view(len(key) // self.block_size, *self.block_shape)
        with self.lock:
            earlier = self.received.pop(key, None)  # the same prompt again: one more request to load it
            count = 1
            if earlier is not None:
                count += earlier.count
            self.received[key] = Arrival(kv, time.monotonic(), count)
            while sum(arrival.kv.nbytes for arrival in self.received.values()) > self.settings.buffer_bytes:
                self.counts["dropped"] += self.received.popitem(last=False)[1].count

    def may_admit(self, seq: Sequence, running: list[Sequence]) -> bool:
        """The admission rule: a producer's request fails once the link has (kv_both's goes on, unshared); a consumer's
        waits until its prompt's K/V has arrived (or its own cache holds it), failing (or, with kv_load_failure_policy
        "recompute", computed here) when the link has failed or transfer_timeout_s has passed since it arrived."""
        if self.settings.role == "kv_producer" and self.failure is not None:
            seq.error = self.failure
            return False
        key = self.key(seq)
        if self.settings.role != "kv_consumer" or key is None or seq.request in self.served:
            return True
        with self.lock:
            if key in self.received:
                return True
        if len(self.bm.find_cached_prefix(seq)) * self.block_size >= len(key):
            return True
        problem = self.failure
        waited_s = time.time() - seq.request.metrics.arrival_time
        if problem is None and waited_s > self.settings.transfer_timeout_s:
            problem = f"no K/V arrived from {self.link.peer_name} within {self.settings.transfer_timeout_s:g} s"
        if problem is None:
            return False
        if self.settings.failure_policy == "recompute":
            self.served.add(seq.request)
            self.counts["recomputed"] += 1
            return True
        seq.error = problem
        return False

    def num_loadable(self, seq: Sequence, num_cached: int) -> int:
        """The KV connector: the prompt's blocks past the device's hits, if its K/V has arrived."""
        key = self.key(seq)
        self.found = None
        if self.settings.role not in LOADS or key is None:
            return 0
        with self.lock:
            self.found = self.received.get(key)
        if self.found is None:
            return 0
        return max(len(self.found.kv) - num_cached, 0)

    def load(self, seq: Sequence, first_block: int, count: int) -> None:
        """Copy blocks [first_block, first_block + count) of what arrived into seq's fresh ones, before the step; the
        arrival is taken (one fewer request to load it) by a request's first sample to load, never by its others."""
        for i in range(first_block, first_block + count):
            self.copies.load(self.found.kv[i], seq.block_table[i])
        self.counts["blocks_loaded"] += count
        if seq.request in self.served:  # another sample of a request that has loaded it: the arrival is its already
            return
        key = self.key(seq)
        with self.lock:
            arrival = self.received.get(key)
            if arrival is not None:  # (none: dropped meanwhile, its K/V already in hand)
                arrival.count -= 1
            if arrival is not None and not arrival.count:
                del self.received[key]
        self.served.add(seq.request)
        self.counts["requests_loaded"] += 1

    def step_hook(self, step: Step) -> None:
        """Before the step's kernels: the loads booked while it was planned; then K/V that waited past its time goes."""
        self.copies.run()
        oldest = time.monotonic() - self.settings.transfer_timeout_s
        with self.lock:
            while self.received and next(iter(self.received.values())).time < oldest:
                self.counts["dropped"] += self.received.popitem(last=False)[1].count


def check_peer(card: dict, peer: dict) -> None:
    """The same K/V block (model, dtype, block size) on both sides, and roles that fit: what one sends, the other
    loads."""
    if (peer["block"], peer["dtype"]) != (card["block"], card["dtype"]):
        raise InvalidField(
            FIELD,
            f"the peer's K/V blocks are {peer['block']} {peer['dtype']}, this engine's {card['block']} "
            f"{card['dtype']}: start both with the same model, dtype and kvcache_block_size",
        )
    if (card["role"] in SENDS) != (peer["role"] in LOADS) or (peer["role"] in SENDS) != (card["role"] in LOADS):
        raise InvalidField(FIELD, f"kv_role: {card['role']} cannot pair with the peer's {peer['role']}")


def peer_name(card: dict) -> str:
    """How failures name the peer: by its role."""
    return f"{NAMES[card['role']]} ({card['role']})"
