r"""Workers on several hosts: started on each host by torchrun, joined to the central
scheduler through a torch.distributed TCPStore that it listens on.

    # the caller's host: the central scheduler (LLM, bench.py) listens at HOST:PORT
    python bench.py --policy disaggregated --join HOST:PORT
    # every host with workers, one worker per GPU (here 2 hosts, 2 GPUs each):
    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr HOST --master-port 29500 \
        -m nanopd.hosts --join HOST:PORT
    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 1 --master-addr HOST --master-port 29500 \
        -m nanopd.hosts --join HOST:PORT

Each worker is worker RANK of torchrun's world (its GPU the LOCAL_RANK-th of its host). It
reads the engine settings the central scheduler published in the store, builds its engine,
joins torchrun's process group (env://) for the KV transfers (the distributed transport:
NCCL between GPUs, gloo between CPUs), and then runs the same loop as a worker spawned on
one host: its inbox and its reports are two mailboxes in the store (StoreChannel) instead
of a queue and a pipe. Nothing is shared between hosts but the store and the process group;
the only addresses nanoPD listens on are the two the user gives (the store's, torchrun's),
and the pairs' links are gloo's or NCCL's own, as in any torch.distributed job.

A remote worker's death is seen as silence (cluster.py's worker timeout). The end is a
handshake, so that a finished run ends quietly: close() tells every worker to stop (node
rank 0's last), each worker leaves its process group and writes left/RANK, and only then (or
after LEAVE_TIMEOUT_S) does the store stop listening; each worker prints one line, "[worker
RANK (HOST/DEVICE): done]", and exits 0. A worker whose store connection breaks first (the
central scheduler is gone without that) says so in one line and exits 1; one that fails
reports its traceback to the central scheduler and exits 1.
"""

import argparse
import contextlib
import datetime
import os
import pickle
import queue
import socket
import time

import torch
import torch.distributed as dist

from nanopd.config import EngineConfig
from nanopd.workers import ParentGone, Stop, WorkerSpec, worker_main

STORE_TIMEOUT_S = 600.0   # a store operation (a worker waiting for the settings, a message's body)
LEAVE_TIMEOUT_S = 10.0    # close(): how long the central scheduler waits for the workers to leave
AGENT_GAP_S = 1.0         # close(): the other hosts' torchrun agents reach their exit barrier first


class StoreChannel:
    """One direction of a mailbox in a TCPStore, with one writer: message n is the key
    name/n, and the key name counts the messages written. The writer side offers send();
    the reader side the get() / get_nowait() of a queue. A worker's connection to the store
    that breaks raises ParentGone (the central scheduler is gone), and sets gone."""

    def __init__(self, store: dist.Store, name: str):
        self.store, self.name, self.read, self.written = store, name, 0, 0
        self.gone = False

    @contextlib.contextmanager
    def _connected(self):
        try:
            yield
        except dist.DistNetworkError:
            self.gone = True
            raise ParentGone from None

    def send(self, obj) -> None:
        # The body first, then the count: a message is counted only once it is whole, so a
        # reader never waits for the body of a writer that died in between.
        self.written += 1
        with self._connected():
            self.store.set(f"{self.name}/{self.written}", pickle.dumps(obj))
            self.store.add(self.name, 1)

    def waiting(self) -> bool:
        with self._connected():
            return self.store.add(self.name, 0) > self.read

    def recv(self):
        """The next message, which is counted, so whole; it is deleted."""
        self.read += 1
        key = f"{self.name}/{self.read}"
        with self._connected():
            data = self.store.get(key)
            self.store.delete_key(key)
        return pickle.loads(data)

    def get_nowait(self):
        if not self.waiting():
            raise queue.Empty
        return self.recv()

    def get(self, timeout: float):
        deadline = time.monotonic() + timeout
        while not self.waiting():
            if time.monotonic() > deadline:
                raise queue.Empty
            time.sleep(0.001)
        return self.recv()


def parse_address(address: str) -> tuple[str, int]:
    """HOST:PORT -> (host, port), or a ValueError naming the address."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"join address {address!r} is not HOST:PORT")
    return host, int(port)


class RemoteWorkers:
    """The central scheduler's side of workers started by torchrun on their hosts: the same
    send / receive / exited / kill / close as workers.WorkerProcesses. It listens on the
    address given and publishes the engine settings; its number of workers is torchrun's
    world size, which the first worker to join writes."""

    def __init__(self, address: str, cfg: EngineConfig, transport: str, report_steps: bool, timeout_s: float):
        host, port = parse_address(address)
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.store.set("config", pickle.dumps((cfg, transport, report_steps)))
        self.count = int(self.store.get("world_size"))   # waits for the first worker
        self.inboxes = [StoreChannel(self.store, f"to/{w}") for w in range(self.count)]
        self.reports = [StoreChannel(self.store, f"from/{w}") for w in range(self.count)]
        self.stopped: set[int] = set()

    def send(self, w: int, msg) -> None:
        self.inboxes[w].send(msg)

    def receive(self, timeout: float, skip: set[int]) -> list[tuple[int, list]]:
        """(worker, its reports of one round) for every round waiting, waiting up to
        timeout for the first."""
        deadline = time.monotonic() + timeout
        while True:
            got = [(w, ch.recv()) for w, ch in enumerate(self.reports) if w not in skip and ch.waiting()]
            if got or time.monotonic() >= deadline:
                return got
            time.sleep(0.001)

    def exited(self) -> list[int]:
        """Remote processes cannot be watched: the workers told to stop. (The others' deaths
        are seen as silence.)"""
        return sorted(self.stopped)

    def kill(self, w: int) -> None:
        """Tell a worker found silent to stop (it cannot be killed from here); it is dead to us."""
        self.stopped.add(w)
        self.send(w, Stop())

    def why(self, w: int) -> str:
        return "stopped"

    def close(self) -> None:
        """Stop the workers, then stop listening. The workers of node rank 0 are stopped
        last, AGENT_GAP_S after the others have left: that host's torchrun agent holds the
        store of torchrun's exit barrier, and if it passes the barrier first it ends that
        store under the other agents still waiting on it (their "Error waiting on exit
        barrier" traceback)."""
        first = [w for w in range(self.count) if not self._on_node_0(w)]
        if self._stop(first):
            time.sleep(AGENT_GAP_S)
        self._stop([w for w in range(self.count) if w not in first])
        self.store, self.inboxes, self.reports = None, [], []   # the last references: the server ends

    def _on_node_0(self, w: int) -> bool:
        return self.store.check([f"node/{w}"]) and self.store.get(f"node/{w}") == b"0"

    def _stop(self, workers: list[int]) -> bool:
        """Tell workers to stop and wait (up to LEAVE_TIMEOUT_S) until those not found dead
        have left: a worker still polling a store that went away would see its connection
        break (the C++ side's warnings, frames and all, then exit status 1). Whether it waited."""
        for w in workers:
            with contextlib.suppress(RuntimeError, OSError):   # the store is gone already
                self.send(w, Stop())
        leaving = [f"left/{w}" for w in workers if w not in self.stopped]
        deadline = time.monotonic() + LEAVE_TIMEOUT_S
        while leaving and not self.store.check(leaving) and time.monotonic() < deadline:
            time.sleep(0.01)
        return bool(leaving)


def join_main(address: str, device: str | None) -> None:
    """A torchrun worker: join the central scheduler at address and serve until told to stop
    (then one line, exit status 0), or until the store connection breaks: the central
    scheduler is gone (one line, exit status 1)."""
    rank, local_rank, world = (int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]),
                               int(os.environ["WORLD_SIZE"]))
    host, port = parse_address(address)
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
    store.set("world_size", str(world))
    store.set(f"node/{rank}", os.environ["GROUP_RANK"])   # torchrun's node rank: close() stops node 0 last
    cfg, transport, report_steps = pickle.loads(store.get("config"))
    device = device or (f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    spec = WorkerSpec(rank, EngineConfig(**{**cfg.__dict__, "device": device}), transport, report_steps, 0,
                      group="env://", world_size=world, name=f"{socket.gethostname()}/{device}")
    inbox, outbox = StoreChannel(store, f"to/{rank}"), StoreChannel(store, f"from/{rank}")
    try:
        worker_main(spec, inbox, outbox, [], None)
    finally:   # however it ends (a failure too): the central scheduler waits for this to stop listening
        if not (inbox.gone or outbox.gone):
            with contextlib.suppress(dist.DistError):   # it stopped waiting, and is gone
                store.set(f"left/{rank}", b"")
    if inbox.gone or outbox.gone:
        raise SystemExit(f"[worker {rank} ({spec.name}): the central scheduler at {address} is gone]")
    print(f"[worker {rank} ({spec.name}): done]", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--join", required=True, help="HOST:PORT the central scheduler listens on")
    p.add_argument("--device", default=None, help="default: cuda:LOCAL_RANK, or cpu without CUDA")
    args = p.parse_args()
    join_main(args.join, args.device)


if __name__ == "__main__":
    main()
