"""The pair's connection: two engine processes over torch.distributed (gloo: host memory, over TCP), found as torchrun
finds its ranks (env://: RANK, WORLD_SIZE, MASTER_ADDR:MASTER_PORT), or at kv_ip:kv_port as kv_rank of 2 where no
launcher set them. It owns three threads and knows nothing of engines:
  - the sender: messages from the engine's queue (outbox), each a header, a prompt's tokens and their K/V as bytes, in
    order; BYE when the link closes;
  - the receiver: the peer's messages, each handed to on_message(tokens, kv bytes); the peer's BYE ends it, and is
    answered with this side's BYE, so that the closing side's receiver ends too and its close() can join every thread
    and destroy the process group (a thread left in gloo's recv at the process's exit can abort it);
  - the heartbeat: every HEARTBEAT_S this process bumps its key in the rendezvous store and reads the peer's. A peer
    whose key stops for heartbeat_timeout_s (a stopped or hung process), or a store that fails (the process that hosts
    it is gone), is named through on_failure, as is a send or receive that fails (a peer that exited: gloo's socket
    closes at once).
Idle links wait without a deadline (a server's pair may idle for days): the heartbeat is what names a hung peer. At
start both sides publish their K/V block's shape and role in the store and check the other's, so a pair of two models,
dtypes or block sizes, or two decode engines, is refused before any request."""

import contextlib
import json
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from nanoserve.checks import InvalidField

KV_MESSAGE = 1  # a header's kind: a prompt's tokens and their K/V follow
BYE = 0  # the sender's last message: the link is closing
HEADER_LEN = 3  # kind, number of tokens, bytes of K/V
START_TIMEOUT = timedelta(minutes=5)  # both engines join, and publish, within this: loading may take minutes
IDLE_TIMEOUT = timedelta(days=365)  # gloo's for a send or receive: an idle pair waits without a deadline
HEARTBEAT_S = 0.5
CLOSE_WAIT_S = 10.0  # close(): how long to wait for the peer's BYE
PAIR = 2  # one prefill and one decode engine (vLLM's 1P1D)


@dataclass
class Place:
    """Where this engine is in the pair: its rank (the other's is 1 - rank), and how to meet."""

    rank: int
    init_method: str  # env:// under a launcher, else tcp://kv_ip:kv_port?rank=...


def place_of(kv_rank: int | None, kv_ip: str, kv_port: int) -> Place:
    """Under a launcher (RANK set, as torchrun does): its rank, which kv_rank may repeat; otherwise kv_rank at
    kv_ip:kv_port, where rank 0 hosts the rendezvous store."""
    if "RANK" in os.environ:
        rank = int(os.environ["RANK"])
        if int(os.environ.get("WORLD_SIZE", PAIR)) != PAIR:
            raise InvalidField("kv_transfer_config", f"the launcher started {os.environ['WORLD_SIZE']} ranks, not 2")
        if kv_rank not in (None, rank):
            raise InvalidField("kv_transfer_config", f"kv_rank: {kv_rank}, but the launcher made this rank {rank}")
        return Place(rank, "env://")
    if kv_rank is None:
        raise InvalidField("kv_transfer_config", "kv_rank: 0 or 1 is needed where no launcher sets RANK")
    return Place(kv_rank, f"tcp://{kv_ip}:{kv_port}?rank={kv_rank}&world_size={PAIR}")


class Link:
    """The connection to the peer engine, and its threads (the module's docstring): made in two stages, so that the
    engine can refuse a peer it cannot pair with before anything is started."""

    def __init__(self, place: Place, card: dict, heartbeat_timeout_s: float) -> None:
        """Meet the peer in the rendezvous store and swap cards (what each engine publishes: its role, its K/V block's
        shape and dtype), both read before either goes on; the peer's is peer_card."""
        self.rank = place.rank
        self.peer = 1 - place.rank
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.store, _, _ = next(dist.rendezvous(place.init_method, timeout=START_TIMEOUT))
        self.store.set(f"nanoserve/kv_transfer/card/{self.rank}", json.dumps(card))
        self.peer_card = json.loads(self.store.get(f"nanoserve/kv_transfer/card/{self.peer}"))
        self.store.set(f"nanoserve/kv_transfer/read/{self.rank}", "1")
        self.store.wait([f"nanoserve/kv_transfer/read/{self.peer}"])
        # rank 0 hosts the store (tcp://): it goes on only once the peer's last read of it is done, so that a refusal
        # after this handshake, which ends rank 0's process and its store, never cuts the peer off mid-read
        self.store.set(f"nanoserve/kv_transfer/done/{self.rank}", "1")
        if self.rank == 0:
            self.store.wait([f"nanoserve/kv_transfer/done/{self.peer}"])
        self.outbox: queue.Queue[tuple[Tensor, Tensor] | None] = queue.Queue()
        self.closing = False
        self.peer_closed = False
        self.threads = []

    def start(self, on_message: Callable[[Tensor, Tensor], None], on_failure: Callable[[str], None], name: str) -> None:
        """Join the process group and start the threads: each message goes to on_message(tokens, kv bytes), each
        failure to on_failure(what happened), naming the peer as name."""
        self.on_message = on_message
        self.on_failure = on_failure
        self.peer_name = name
        dist.init_process_group("gloo", store=self.store, rank=self.rank, world_size=PAIR, timeout=IDLE_TIMEOUT)
        self.store.set_timeout(timedelta(seconds=self.heartbeat_timeout_s))  # now a store that hangs is a failure
        self.threads = [
            threading.Thread(target=self.send_loop, name="nanoserve-kv-send", daemon=True),
            threading.Thread(target=self.receive_loop, name="nanoserve-kv-receive", daemon=True),
            threading.Thread(target=self.heartbeat_loop, name="nanoserve-kv-heartbeat", daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def send(self, tokens: Tensor, kv: Tensor) -> None:
        """Queue a prompt's tokens (int64) and their K/V (host, contiguous) for the peer."""
        self.outbox.put((tokens, kv))

    def send_loop(self) -> None:
        while True:
            message = self.outbox.get()
            try:
                if message is None:
                    dist.send(torch.tensor([BYE, 0, 0]), self.peer)
                    return
                tokens, kv = message
                kv = kv.view(-1).view(torch.uint8)  # any dtype travels as bytes
                dist.send(torch.tensor([KV_MESSAGE, len(tokens), len(kv)]), self.peer)
                dist.send(tokens, self.peer)
                dist.send(kv, self.peer)
            except RuntimeError as error:  # gloo's, when the peer has gone
                self.on_failure(f"{self.peer_name} is gone: sending to it failed ({error})")
                return

    def receive_loop(self) -> None:
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        try:
            while True:
                dist.recv(header, self.peer)
                kind, num_tokens, num_bytes = header.tolist()
                if kind == BYE:
                    self.peer_closed = True
                    self.outbox.put(None)  # BYE back (after what is queued), which ends the closing peer's receiver
                    self.on_failure(f"{self.peer_name} has closed")
                    return
                tokens = torch.empty(num_tokens, dtype=torch.int64)
                dist.recv(tokens, self.peer)
                kv = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
                dist.recv(kv, self.peer)
                self.on_message(tokens, kv)
        except RuntimeError as error:
            if not self.closing:
                self.on_failure(f"{self.peer_name} is gone: receiving from it failed ({error})")

    def heartbeat_loop(self) -> None:
        """Bump this rank's beat, read the peer's; name the peer if its beat stops or the store fails."""
        last_beats, last_change = None, time.monotonic()
        while not (self.closing or self.peer_closed):
            try:
                self.store.add(f"nanoserve/kv_transfer/beat/{self.rank}", 1)
                beats = self.store.add(f"nanoserve/kv_transfer/beat/{self.peer}", 0)
            except RuntimeError as error:  # (torch's DistStoreError is one)
                if not (self.closing or self.peer_closed):
                    self.on_failure(f"{self.peer_name} stopped answering: the rendezvous store failed ({error})")
                return
            if beats != last_beats:
                last_beats, last_change = beats, time.monotonic()
            elif time.monotonic() - last_change > self.heartbeat_timeout_s:
                self.on_failure(
                    f"{self.peer_name} stopped answering: no heartbeat for {self.heartbeat_timeout_s:g} s "
                    "(its process is stopped, hung or gone)"
                )
                return
            time.sleep(HEARTBEAT_S)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Say BYE after what is queued, and wait up to wait_s for the peer's; the process group is destroyed once every
        thread has ended (one stuck on a hung peer is left to the process's exit). A second close does nothing."""
        if self.closing or not self.threads:
            return
        self.closing = True
        self.outbox.put(None)
        deadline = time.monotonic() + wait_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if not any(thread.is_alive() for thread in self.threads):
            with contextlib.suppress(RuntimeError, AssertionError):
                dist.destroy_process_group()
